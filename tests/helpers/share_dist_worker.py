"""Read once, share, and plan once, on real gloo ranks: scenarios for
tests/test_read_once.py and tests/test_plan_once.py.

Scenarios are added to ``dist_worker.SCENARIOS`` (the worker loop, ``Ctx``, ``compare``
and ``caught`` are dist_worker's); ``ShareForkServer`` starts this file as the fork
server (torch and torch.distributed only: a launch costs a fork). Every load goes
through a storage that counts the bytes each rank reads; the ranks report what they
read and what loaded, the test judges.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import dist_worker as dw

HERE = Path(__file__).resolve()
BIG = 4_300_000  # float32: 17.2 MB, two checksum blocks
SMALL = 120      # small tensors, read in batches
W_ROWS, W_COLS = 1024, 512  # the resharded matrix (float32, 2 MiB)


# --------------------------------------------------------------------------- shared data


def ddp_state(empty: bool = False) -> dict:
    """About 21 MB, equal on every rank: large tensors over several blocks and files,
    mixed dtypes, small ones, an empty one, plain values (``empty``: the same, zeroed)."""
    if empty:
        state = _zeroed(_made())
        state["step"], state["name"] = -1, ""
        return state
    return _made()


@functools.lru_cache(maxsize=1)
def _made() -> dict:
    """Made once per process; never modified (loads go into zeroed copies)."""
    import torch
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(BIG, generator=g),
        "mid": {"a": torch.randn(200_000, generator=g, dtype=torch.float64),
                "b": torch.randn(300, 1000, generator=g).bfloat16(),
                "c": torch.randint(-(1 << 40), 1 << 40, (200_000,), generator=g)},
        "small": [torch.randn(17 + i % 5, generator=g) for i in range(SMALL)],
        "none": torch.zeros(0, 3),
        "step": 11, "name": "ddp",
    }


def _zeroed(obj: Any) -> Any:
    import torch
    if isinstance(obj, torch.Tensor):
        return torch.full_like(obj, 0)
    if isinstance(obj, dict):
        return {k: _zeroed(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_zeroed(v) for v in obj]
    return obj


def W_full():
    import torch
    return torch.arange(W_ROWS * W_COLS, dtype=torch.float32).reshape(W_ROWS, W_COLS) / 3


def even(n: int, world: int) -> list[tuple[int, int]]:
    step = n // world
    return [(r * step, n if r == world - 1 else (r + 1) * step) for r in range(world)]


def shifted(n: int, world: int) -> list[tuple[int, int]]:
    """Row ranges that straddle the even ones: each meets one or two saved shards."""
    cuts = [0] + [r * (n // world) + (n // world) // 3 for r in range(1, world)] + [n]
    return list(zip(cuts, cuts[1:]))


class Counting:
    """Makes storages that count the bytes this process reads, per file."""

    def __init__(self) -> None:
        self.read: dict[str, int] = {}
        self.lock = threading.Lock()

    def wrap(self, inner: Any) -> Any:
        from safeckpt.storage import StorageWrapper
        counts = self

        class CountingStorage(StorageWrapper):
            def read_into(self, name: str, offset: int, out: memoryview) -> None:
                self.inner.read_into(name, offset, out)
                with counts.lock:
                    key = name.rsplit("/", 1)[-1]
                    counts.read[key] = counts.read.get(key, 0) + len(out)
        return CountingStorage(inner)

    @property
    def total(self) -> int:
        return sum(self.read.values())


def _local(path: Path) -> Any:
    from safeckpt.storage import LocalStorage
    return LocalStorage(str(path))


def counted_load(state: dict, path: Path, **kw: Any) -> dict:
    """Load through a counting storage: what was read, how long, what it raised."""
    import safeckpt
    counts = Counting()
    res = dw.caught(lambda: safeckpt.load(state, counts.wrap(_local(path)), **kw))
    res["read"] = counts.read
    res["bytes"] = counts.total
    return res


def _with_env(values: dict[str, str], fn: Any) -> Any:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        return fn()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _small_windows(ctx: dw.Ctx) -> None:
    """Windows and messages far smaller than a block: many windows for little data."""
    from safeckpt.protocol import exchange
    exchange.WINDOW_BYTES = 4 << 20
    exchange.MESSAGE_BYTES = 1 << 20


# --------------------------------------------------------------------------- read once


def sc_share_ddp(ctx: dw.Ctx) -> dict:
    """A replicated state saved by every rank, loaded back in every mode (``cases``)."""
    import safeckpt
    _small_windows(ctx)
    path = ctx.root / f"ddp-{ctx.world}"
    safeckpt.save(ddp_state(), str(path))
    ctx.barrier()
    want = ddp_state()
    nodes2 = {"SAFECKPT_NODE_ID": f"node{ctx.rank * 2 // ctx.world}"}
    cases = {
        "off": lambda t: counted_load(t, path, share_reads="off"),
        "job": lambda t: counted_load(t, path, share_reads="job"),
        "auto": lambda t: counted_load(t, path),
        "auto_nodes": lambda t: _with_env({"SAFECKPT_NODE_ID": f"node{ctx.rank}"}, lambda: counted_load(t, path)),
        "node_scope": lambda t: _with_env(nodes2, lambda: counted_load(t, path, share_reads="node")),
        "env_off": lambda t: _with_env({"SAFECKPT_SHARE_READS": "off",
                                        "SAFECKPT_NODE_ID": f"node{ctx.rank}"}, lambda: counted_load(t, path)),
        "env_job": lambda t: _with_env({"SAFECKPT_SHARE_READS": "job"}, lambda: counted_load(t, path)),
        "unverified": lambda t: counted_load(t, path, share_reads="job", verify=False),
    }
    out: dict[str, Any] = {}
    for name in ctx.opts.get("cases", list(cases)):
        load = cases[name]
        target = ddp_state(empty=True)
        res = load(target)
        res["problems"] = dw.compare(target, want)
        out[name] = res
        ctx.barrier()
    if "restore" not in ctx.opts.get("cases", ["restore"]):
        return out
    counts = Counting()
    mgr = safeckpt.CheckpointManager(counts.wrap(_local(ctx.root / f"mgr-{ctx.world}")))
    mgr.save(5, ddp_state())
    counts.read.clear()
    target = ddp_state(empty=True)
    res = dw.caught(lambda: mgr.restore(target, share_reads="job"))
    out["restore"] = dict(res, bytes=counts.total, read=dict(counts.read), problems=dw.compare(target, want))
    mgr.close()
    return out


def sc_share_bounded(ctx: dw.Ctx) -> dict:
    """Many small replicated tensors (every message staged in a buffer), 1 MiB windows:
    the most buffer bytes a rank holds at once, against a load of 10 MB."""
    import weakref

    import numpy as np
    import torch

    import safeckpt
    from safeckpt.protocol import exchange
    exchange.WINDOW_BYTES, exchange.MESSAGE_BYTES = 1 << 20, 256 << 10
    path = ctx.root / f"bounded-{ctx.world}"
    g = torch.Generator().manual_seed(5)
    state = {"t": [torch.randn(1280, generator=g) for _ in range(2000)]}  # 5 KB each, 10 MB
    safeckpt.save(state, str(path))
    ctx.barrier()
    live, peak = [0], [0]
    lock = threading.Lock()
    made = exchange._buffer

    def tracked(n: int) -> memoryview:
        view = made(n)
        with lock:
            live[0] += n
            peak[0] = max(peak[0], live[0])

        def gone() -> None:
            with lock:
                live[0] -= n
        weakref.finalize(view.obj, gone)
        return view
    exchange._buffer = tracked
    target = {"t": [torch.zeros(1280) for _ in range(2000)]}
    res = counted_load(target, path, share_reads="job")
    exchange._buffer = made
    res["problems"] = [f"t.{i}" for i, (a, b) in enumerate(zip(target["t"], state["t"])) if not torch.equal(a, b)]
    return dict(res, peak=peak[0], total=sum(t.nbytes for t in state["t"]), window=exchange.WINDOW_BYTES,
                message=exchange.MESSAGE_BYTES, numpy=np.__version__)


def _reshard_state(rank: int, rows: list, cols: list | None, empty: bool = False) -> dict:
    import torch
    from safeckpt import Shard
    r0, r1 = rows[rank]
    if cols is None:
        w = W_full()[r0:r1].clone()
        offsets = [r0, 0]
    else:
        c0, c1 = cols[rank]
        w = W_full()[:, c0:c1].clone()
        offsets = [0, c0]
    return {"w": Shard(torch.zeros_like(w) if empty else w, (W_ROWS, W_COLS), offsets)}


def sc_share_reshard(ctx: dw.Ctx) -> dict:
    """W saved as even row shards, loaded as row shards that straddle them (each saved
    shard needed by one or two ranks) and as column shards (every shard by every rank)."""
    import safeckpt
    _small_windows(ctx)
    path = ctx.root / f"reshard-{ctx.world}"
    rows = even(W_ROWS, ctx.world)
    safeckpt.save(_reshard_state(ctx.rank, rows, None), str(path))
    ctx.barrier()
    out: dict[str, Any] = {}
    layouts = {"rows": (shifted(W_ROWS, ctx.world), None), "cols": ([(0, W_ROWS)] * ctx.world, even(W_COLS, ctx.world))}
    for name, (load_rows, load_cols) in layouts.items():
        for mode in ("off", "job"):
            target = _reshard_state(ctx.rank, load_rows, load_cols, empty=True)
            res = counted_load(target, path, share_reads=mode)
            want = _reshard_state(ctx.rank, load_rows, load_cols)
            res["problems"] = dw.compare(target["w"].local_tensor, want["w"].local_tensor, "w")
            out[f"{name}_{mode}"] = res
            ctx.barrier()
    return out


def sc_share_fail(ctx: dw.Ctx) -> dict:
    """A rank whose reads fail (EIO on rank 1), and a corrupt block: every rank raises."""
    import safeckpt
    from safeckpt.testing import Fault, FaultyStorage
    _small_windows(ctx)
    path = ctx.root / f"fail-{ctx.world}"
    safeckpt.save(ddp_state(), str(path))
    ctx.barrier()
    out: dict[str, Any] = {}
    storage = _local(path)
    if ctx.rank == 1:
        storage = FaultyStorage(storage, faults=[Fault("read", errno.EIO, path="data-")])
    target = ddp_state(empty=True)
    out["eio"] = dw.caught(lambda: safeckpt.load(target, storage, share_reads="job"))
    ctx.barrier()
    bad = ctx.root / f"corrupt-{ctx.world}"
    if ctx.rank == 0:
        shutil.copytree(path, bad)
        out["corrupted"] = _flip_in(bad, "big", 1000)
    ctx.barrier()
    target = ddp_state(empty=True)
    out["corrupt"] = dw.caught(lambda: safeckpt.load(target, str(bad), share_reads="job"))
    ctx.barrier()
    target = ddp_state(empty=True)
    out["after"] = counted_load(target, path, share_reads="job")
    out["after"]["problems"] = dw.compare(target, ddp_state())
    return out


def _flip_in(folder: Path, tensor: str, at: int) -> str:
    """Flip a byte ``at`` bytes into ``tensor``'s data; the file's name."""
    from safeckpt.format.folder import read_committed
    chunk = read_committed(_local(folder)).tensors[tensor].chunks[0]
    with open(folder / chunk.file, "r+b") as f:
        f.seek(chunk.start + at)
        byte = f.read(1)
        f.seek(chunk.start + at)
        f.write(bytes([byte[0] ^ 0xFF]))
    return chunk.file


def sc_share_killed(ctx: dw.Ctx) -> dict:
    """Rank ``victim`` is SIGKILLed at its first data read of a shared load."""
    import safeckpt
    from safeckpt.storage import StorageWrapper
    path = ctx.root / "killed-share"
    safeckpt.save(ddp_state(), str(path))
    ctx.barrier()
    storage = _local(path)
    if ctx.rank == ctx.opts.get("victim", 1):
        class Dies(StorageWrapper):
            def read_into(self, name: str, offset: int, out: memoryview) -> None:
                if name.startswith("data-"):
                    os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(60)
                self.inner.read_into(name, offset, out)
        storage = Dies(storage)
    ctx.stop = True  # the group is broken after this scenario
    return {"load": dw.caught(lambda: safeckpt.load(ddp_state(empty=True), storage, share_reads="job"))}


# --------------------------------------------------------------------------- plan once


def plan_state(rank: int, world: int, step: int, *, grow: int | None = None, differ: int | None = None,
               resize: int | None = None, empty: bool = False) -> dict:
    """A replicated matrix, row shards, a rank-local tensor and counter, a step. ``grow``:
    that rank's rank-local tensor is one longer; ``differ``: that rank's plain value
    differs; ``resize``: that rank's replicated matrix has a column more."""
    import torch
    from safeckpt import RankLocal, Shard
    cols = 33 if resize == rank else 32
    w = torch.arange(64 * cols, dtype=torch.float32).reshape(64, cols) + step
    s = torch.full((4, 8), float(rank * 100 + step))
    t = torch.arange(5 + (grow == rank), dtype=torch.float64) + rank + step
    state = {"w": w, "s": Shard(s, (4 * world, 8), (4 * rank, 0)),
             "loc": RankLocal({"t": t, "n": rank * 1000 + step}),
             "opt": {"lr": 0.5 if differ == rank else 0.1, "step": step}}
    if empty:
        state = {"w": torch.zeros_like(w), "s": Shard(torch.zeros_like(s), (4 * world, 8), (4 * rank, 0)),
                 "loc": RankLocal({"t": torch.zeros_like(t), "n": -1}), "opt": {"lr": 0.0, "step": -1}}
    return state


def _plan_problems(path: str, rank: int, world: int, step: int, **kw: Any) -> list[str]:
    import safeckpt
    got = plan_state(rank, world, step, empty=True, **kw)
    safeckpt.load(got, path)
    want = plan_state(rank, world, step, **kw)
    return (dw.compare(got["w"], want["w"], "w") + dw.compare(got["s"].local_tensor, want["s"].local_tensor, "s")
            + dw.compare(got["loc"].value, want["loc"].value, "loc") + dw.compare(got["opt"], want["opt"], "opt"))


def sc_plan_once(ctx: dw.Ctx) -> dict:
    """Saves of one layout, then a layout changed on one rank only, and refusals."""
    import safeckpt
    from safeckpt.protocol import commit
    from safeckpt.protocol.group import resolve
    calls = [0]
    planner = commit.assign_writes

    def counted(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        return planner(*a, **kw)
    commit.assign_writes = counted
    rank, world = ctx.rank, ctx.world
    mgr = safeckpt.CheckpointManager(str(ctx.root / "plan"))
    plans = lambda: [mgr.group.plans.planned, mgr.group.plans.reused, calls[0]]  # noqa: E731
    saves: dict[str, Any] = {}
    # steps: (changes, committed?)
    script = [(1, {}), (2, {}), (3, {}), (4, {"grow": 2}), (5, {"grow": 2}), (6, {"grow": 2, "differ": 1}),
              (7, {"grow": 2, "resize": 3}), (8, {"grow": 2})]
    for step, kw in script:
        res = dw.caught(lambda: mgr.save(step, plan_state(rank, world, step, **kw)))
        res["plans"] = plans()
        if not res["raised"]:
            res["problems"] = _plan_problems(mgr.path(step), rank, world, step, **kw)
        saves[str(step)] = res
    mgr.close()
    group = resolve(None)
    plain = {}
    for name in ("p1/a", "p1/b", "p2/c"):
        res = dw.caught(lambda: safeckpt.save(plan_state(rank, world, 9), str(ctx.root / name)))
        res["plans"] = [group.plans.planned, group.plans.reused]
        res["problems"] = _plan_problems(str(ctx.root / name), rank, world, 9)
        plain[name] = res
    commit.assign_writes = planner
    return {"saves": saves, "plain": plain}


dw.SCENARIOS.update({"share_ddp": sc_share_ddp, "share_reshard": sc_share_reshard, "share_fail": sc_share_fail,
                     "share_bounded": sc_share_bounded,
                     "share_killed": sc_share_killed, "plan_once": sc_plan_once})


class ShareForkServer(dw.ForkServer):
    """``dist_worker.ForkServer`` started on this file (so the ranks know the scenarios above)."""

    def __init__(self, src: str) -> None:
        super().__init__(src, script=HERE)


if __name__ == "__main__":
    dw.extension_main()
