"""Real multi-process runs of safeckpt over torch.distributed (gloo, CPU) for
tests/test_distributed.py.

A *launch* starts ``world`` ranks that each call ``dist.init_process_group("gloo")``
(``env://``: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) and then run a
list of *scenarios* in sequence. Each scenario is a function of a ``Ctx`` that returns
plain JSON data (observations, never assertions across ranks: the test judges them);
its outcome on each rank is written to ``OUT/<scenario>/rank<r>.json`` as
``{"ok": true, "data": ...}`` or ``{"ok": false, "error": traceback}``. After each
scenario the ranks resynchronise over the default group, so one scenario's failure
does not silently shift the next one's collectives.

Two ways to start the ranks, same worker code:

- ``ForkServer`` (default): one process imports torch once and forks the ranks of
  every launch, so a launch costs a fork instead of ``import torch`` per rank (about
  10 s for 4 ranks on a 2-core machine). The children are fresh to torch.distributed:
  nothing distributed happens in the server.
- ``popen_launch``: one fresh interpreter per rank (``python dist_worker.py run``),
  like torchrun does. Selected with ``SAFECKPT_DIST_LAUNCH=popen``.

Every child is bounded: it dumps its stacks into its log and exits after ``limit_s``
(faulthandler), dies with its server (PR_SET_PDEATHSIG), and the client SIGKILLs
whatever is left after the launch's timeout.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from forkserver import ServerProcess

HERE = Path(__file__).resolve()

# --------------------------------------------------------------------------- shared data
# Pure functions of their arguments, used by the workers and by the test process.

SAVE_ROWS = [(0, 3), (3, 10), (10, 11), (11, 16)]   # 4 uneven row shards of W
SAVE_ECOLS = [(0, 2), (2, 3), (3, 5), (5, 6)]        # 4 uneven column shards of E
LOAD_COLS3 = [(0, 2), (2, 9), (9, 10)]               # W on 3 ranks: uneven column shards
LOAD_EROWS3 = [(0, 5), (5, 6), (6, 16)]              # E on 3 ranks: uneven row shards
LOAD_ROWS2 = [(0, 5), (5, 16)]                       # W on 2 ranks: other row shards
W_SHAPE, E_SHAPE = (16, 10), (16, 6)


def W_full():
    import torch
    return torch.arange(160, dtype=torch.float64).reshape(W_SHAPE) * 0.5 + 1


def E_full():
    import torch
    return (torch.arange(96, dtype=torch.float32).reshape(E_SHAPE) / 7 - 3).to(torch.bfloat16)


def BIAS():
    import torch
    return torch.linspace(-1, 1, 10)


def replicated_state() -> dict:
    """Several large tensors (about 6 MB) and a few small ones and values, equal on every rank."""
    import torch
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(300_000, generator=g),                                  # 1.2 MB
        "b": torch.randn(200_000, generator=g, dtype=torch.float64),             # 1.6 MB
        "c": torch.randint(-(1 << 40), 1 << 40, (150_000,), generator=g),        # 1.2 MB
        "d": {"e": torch.randn(400_000, generator=g).half(),                     # 0.8 MB
              "f": torch.randn(400, 1000, generator=g).bfloat16()},              # 0.8 MB
        "small": [torch.arange(5), torch.ones(3, 3, dtype=torch.float64)],
        "step": 7, "name": "replicated",
    }


def dt_full(name: str):
    import torch
    shapes = {"a": (16, 12), "b": (10, 10), "c": (5, 7), "d": (8, 6), "g": (6, 8)}
    n = 1
    for s in shapes[name]:
        n *= s
    return (torch.arange(n, dtype=torch.float32).reshape(shapes[name]) + 1000 * (ord(name) - 96)) / 3


def mgr_w(step: int):
    import torch
    return torch.arange(160, dtype=torch.float32).reshape(W_SHAPE) + 1000 * step


def tensor_bytes(obj: Any) -> int:
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def compare(got: Any, want: Any, key: str = "") -> list[str]:
    """Differences between two nested states (exact: dtype, shape and every value)."""
    import torch
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{key}: expected a tensor, got {type(got).__name__}"]
        if type(got).__name__ == "DTensor":
            got = got.full_tensor()
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return [f"{key}: expected {want.dtype} {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}"]
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            return [f"{key}: {len(bad)} value(s) differ, first at {bad[0].tolist()}: "
                    f"got {got[tuple(bad[0])].item()} want {want[tuple(bad[0])].item()}"]
        return []
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{key}: expected keys {sorted(map(str, want))}, got "
                    f"{sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__}"]
        return [p for k in want for p in compare(got[k], want[k], f"{key}.{k}" if key else str(k))]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{key}: expected a sequence of {len(want)}, got {got!r:.80}"]
        return [p for i, (g, w) in enumerate(zip(got, want)) for p in compare(g, w, f"{key}.{i}")]
    return [] if got == want else [f"{key}: expected {want!r:.80}, got {got!r:.80}"]


def listing(folder: Path) -> dict[str, int]:
    """Files (recursively, relative names) and sizes under a folder."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- worker side


@dataclass
class Ctx:
    rank: int
    world: int
    root: Path           # shared by all launches of a test module: checkpoints live here
    out: Path            # this launch's results
    opts: dict = field(default_factory=dict)
    stop: bool = False   # set by a scenario after which the group is unusable (a rank died)

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier()


def caught(fn: Callable[[], Any]) -> dict:
    """Run ``fn`` and describe what it raised (or that it did not)."""
    import safeckpt
    t0 = time.monotonic()
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"raised": type(exc).__name__, "message": str(exc),
                "is_save_aborted": isinstance(exc, safeckpt.SaveAbortedError),
                "is_checkpoint_error": isinstance(exc, safeckpt.CheckpointError),
                "is_state_mismatch": isinstance(exc, safeckpt.StateMismatchError),
                "errors": {str(k): str(v) for k, v in (getattr(exc, "errors", None) or {}).items()},
                "seconds": time.monotonic() - t0,
                "traceback": traceback.format_exc()[-3000:]}
    return {"raised": None, "seconds": time.monotonic() - t0, "value": repr(value)[:200]}


class Boom:
    """A stateful object whose ``state_dict`` fails (or kills the process) on demand."""

    def __init__(self, value: int, fail: str | None = None, rank: int = 0) -> None:
        self.value = value
        self.fail = fail
        self.rank = rank

    def state_dict(self) -> dict:
        if self.fail == "raise":
            raise ValueError(f"boom: state_dict failed on rank {self.rank}")
        if self.fail == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        return {"v": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["v"]


def _local_storage(path: Path, *, fail_write: str | None = None):
    """A LocalStorage, optionally failing (ENOSPC after a partial write) or SIGKILLing
    this process once a data file is completely written and fsynced."""
    from safeckpt.storage import LocalStorage

    class Faulty(LocalStorage):
        def write_file(self, name, parts):
            if not name.startswith("data-") or fail_write is None:
                return super().write_file(name, parts)
            if fail_write == "enospc":
                def some_then_fail():
                    it = iter(parts)
                    yield next(it)
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                return super().write_file(name, some_then_fail())
            size = super().write_file(name, parts)
            if fail_write == "kill_after":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            return size

    return Faulty(str(path))


# -- scenarios: 4-rank saves ----------------------------------------------------------


def sc_replicated_save(ctx: Ctx) -> dict:
    import safeckpt
    import torch
    path = ctx.root / "replicated"
    state = replicated_state()
    info = safeckpt.save(state, str(path), metadata={"kind": "replicated"})
    ctx.barrier()
    target = replicated_state()
    for t in [target["a"], target["b"], target["c"], target["d"]["e"], target["d"]["f"], *target["small"]]:
        t.zero_()
    target["step"], target["name"] = -1, ""
    safeckpt.load(target, str(path))
    return {"info_world_size": info.world_size, "info_bytes": info.bytes, "info_files": sorted(info.files),
            "state_bytes": tensor_bytes(state), "problems": compare(target, replicated_state()),
            "torch_threads": torch.get_num_threads()}


def shard_state(rank: int, rows: list, ecols: list, *, empty: bool = False) -> dict:
    """W as row shards ``rows[rank]``, E as column shards ``ecols[rank]``, a replicated bias."""
    import torch
    from safeckpt.protocol.shards import Shard
    W, E = W_full(), E_full()
    r0, r1 = rows[rank]
    c0, c1 = ecols[rank]
    w, e, bias = W[r0:r1].clone(), E[:, c0:c1].clone(), BIAS()
    if empty:
        w, e, bias = torch.full_like(w, -7), torch.full_like(e, -7), torch.full_like(bias, -7)
    return {"w": Shard(w, W_SHAPE, [r0, 0]), "e": Shard(e, E_SHAPE, [0, c0]), "bias": bias}


def _shard_problems(state: dict, rank: int, rows: list | None, wcols: list | None,
                    erows: list | None, ecols: list | None) -> list[str]:
    W, E = W_full(), E_full()
    rr = rows[rank] if rows else (0, W_SHAPE[0])
    wc = wcols[rank] if wcols else (0, W_SHAPE[1])
    er = erows[rank] if erows else (0, E_SHAPE[0])
    ec = ecols[rank] if ecols else (0, E_SHAPE[1])
    return (compare(state["w"].local_tensor, W[rr[0]:rr[1], wc[0]:wc[1]], "w")
            + compare(state["e"].local_tensor, E[er[0]:er[1], ec[0]:ec[1]], "e")
            + compare(state["bias"], BIAS(), "bias"))


def sc_rows_save(ctx: Ctx) -> dict:
    import safeckpt
    path = ctx.root / "rows"
    info = safeckpt.save(shard_state(ctx.rank, SAVE_ROWS, SAVE_ECOLS), str(path))
    target = shard_state(ctx.rank, SAVE_ROWS, SAVE_ECOLS, empty=True)
    safeckpt.load(target, str(path))
    return {"info_world_size": info.world_size,
            "problems": _shard_problems(target, ctx.rank, SAVE_ROWS, None, None, SAVE_ECOLS)}


def V_full():
    import torch
    return torch.arange(64, dtype=torch.float32).reshape(16, 4) - 20


def sc_even_save(ctx: Ctx) -> dict:
    """Even row shards (every piece the same size): a wrong box in the manifest would
    still fit the byte ranges, so only the values can tell."""
    import safeckpt
    import torch
    from safeckpt.protocol.shards import Shard
    n = 16 // ctx.world
    safeckpt.save({"v": Shard(V_full()[n * ctx.rank:n * (ctx.rank + 1)].clone(), (16, 4), [n * ctx.rank, 0])},
                  str(ctx.root / "even"))
    target = {"v": Shard(torch.full((n, 4), -1.0), (16, 4), [n * ctx.rank, 0])}
    safeckpt.load(target, str(ctx.root / "even"))
    return {"problems": compare(target["v"].local_tensor, V_full()[n * ctx.rank:n * (ctx.rank + 1)], "v")}


def _mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape)


def sc_dtensor_save_1d(ctx: Ctx) -> dict:
    import safeckpt
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh((ctx.world,))
    state = {"a": distribute_tensor(dt_full("a"), mesh, [Shard(0)]),
             "b": distribute_tensor(dt_full("b"), mesh, [Shard(1)]),     # 10 columns on 4 ranks: 3,3,3,1
             "c": distribute_tensor(dt_full("c"), mesh, [Replicate()])}
    locals_ = {k: list(v.to_local().shape) for k, v in state.items()}
    safeckpt.save(state, str(ctx.root / "dt1"))
    target = {"a": distribute_tensor(dt_full("a") * 0, mesh, [Shard(0)]),
              "b": distribute_tensor(dt_full("b") * 0, mesh, [Shard(1)]),
              "c": distribute_tensor(dt_full("c") * 0, mesh, [Replicate()])}
    safeckpt.load(target, str(ctx.root / "dt1"))
    problems = [p for k in "abc" for p in compare(target[k], dt_full(k), k)]
    return {"local_shapes": locals_, "problems": problems}


def sc_dtensor_save_2d(ctx: Ctx) -> dict:
    import safeckpt
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh((2, 2))
    state = {"d": distribute_tensor(dt_full("d"), mesh, [Shard(0), Replicate()]),
             "g": distribute_tensor(dt_full("g"), mesh, [Shard(1), Shard(0)])}
    safeckpt.save(state, str(ctx.root / "dt2"))
    target = {"d": distribute_tensor(dt_full("d") * 0, mesh, [Replicate(), Shard(1)]),
              "g": distribute_tensor(dt_full("g") * 0, mesh, [Shard(0), Shard(1)])}
    safeckpt.load(target, str(ctx.root / "dt2"))
    problems = [p for k in "dg" for p in compare(target[k], dt_full(k), k)]
    return {"problems": problems}


def fsdp_build(mesh, *, init_optimizer_state: bool):
    """A small model sharded with FSDP2 (``fully_shard``) and an Adam optimizer.
    Layer sizes are chosen so that shards are uneven on 4 and 3 ranks."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 6))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    if init_optimizer_state:  # zero gradients: creates the state, leaves the parameters unchanged
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def fsdp_train_step(model, opt, rank: int, step: int) -> None:
    import torch
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def fsdp_full(model, opt) -> dict:
    """Full tensors of the model and optimizer state (collective: every rank calls it)."""
    import torch

    def full(t):
        return t.full_tensor() if type(t).__name__ == "DTensor" else t.clone()
    out = {"model": {k: full(v) for k, v in model.state_dict().items()}, "optim": {}}
    sd = opt.state_dict()
    for idx, st in sd["state"].items():
        out["optim"][str(idx)] = {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
    return out


def sc_fsdp_save(ctx: Ctx) -> dict:
    import safeckpt
    import torch
    mesh = _mesh((ctx.world,))
    model, opt = fsdp_build(mesh, init_optimizer_state=False)
    for step in range(2):
        fsdp_train_step(model, opt, ctx.rank, step)
    placements = {k: str(getattr(v, "placements", None)) for k, v in model.state_dict().items()}
    safeckpt.save({"model": model, "optim": opt}, str(ctx.root / "fsdp"))
    expected = fsdp_full(model, opt)
    if ctx.rank == 0:
        torch.save(expected, ctx.root / "fsdp_expected.pt")
    ctx.barrier()
    return {"placements": placements}


def sc_ranklocal_save(ctx: Ctx) -> dict:
    import safeckpt
    import torch
    from safeckpt.protocol.shards import RankLocal
    torch.manual_seed(1000 + ctx.rank)
    rng = torch.get_rng_state()
    torch.save(rng, ctx.root / f"rng-{ctx.rank}.pt")
    state = {"rng": RankLocal(rng), "pos": RankLocal(ctx.rank * 10), "w": BIAS(),
             "loader": RankLocal({"epoch": 3, "offset": ctx.rank + 0.5})}
    safeckpt.save(state, str(ctx.root / "ranklocal"))
    torch.manual_seed(0)
    target = {"rng": RankLocal(torch.zeros_like(rng)), "pos": RankLocal(-1), "w": BIAS() * 0,
              "loader": RankLocal(None)}
    safeckpt.load(target, str(ctx.root / "ranklocal"))
    return {"pos": target["pos"].value, "rng_equal": bool(torch.equal(target["rng"].value, rng)),
            "loader": target["loader"].value, "w": compare(target["w"], BIAS(), "w")}


def sc_differ(ctx: Ctx) -> dict:
    """Plain values that differ between ranks, not wrapped in RankLocal."""
    import safeckpt
    out = {}
    path = ctx.root / "differ"
    state = {"w": BIAS(), "data": {"epoch": 1, "offset": ctx.rank * 10}}
    out["value"] = caught(lambda: safeckpt.save(state, str(path)))
    ctx.barrier()
    # a plain tensor whose shape differs between ranks
    state2 = {"w": BIAS()[: 10 - (ctx.rank == 2)]}
    out["shape"] = caught(lambda: safeckpt.save(state2, str(ctx.root / "differ_shape")))
    ctx.barrier()
    out.update(_differ_exactly(ctx))
    return out


def _differ_exactly(ctx: Ctx) -> dict:
    """Values Python's ``==`` calls equal that differ in type or sign between rank 0 and
    the others, each in a save of its own; then the same difference in the second save of
    one layout (the ranks compare digests of a kept plan first, ``plancache``); and values
    the same on every rank (a NaN, -0.0) that must save and come back bit for bit."""
    import safeckpt
    other = ctx.rank != 0
    out: dict = {}
    cases = {"int_float": 1.0 if other else 1, "bool_int": 1 if other else True, "zero_sign": -0.0 if other else 0.0,
             "nested_sign": {"betas": (0.9, -0.0 if other else 0.0)}}
    for name, value in cases.items():
        out[name] = caught(lambda: safeckpt.save({"w": BIAS(), "x": value}, str(ctx.root / f"differ_{name}")))
        ctx.barrier()
    path = str(ctx.root / "differ_kept")
    out["kept_first"] = caught(lambda: safeckpt.save({"w": BIAS(), "x": 1.0}, path))
    out["kept"] = caught(lambda: safeckpt.save({"w": BIAS(), "x": 1 if other else 1.0}, path, overwrite=True))
    ctx.barrier()
    same = str(ctx.root / "differ_none")
    out["same"] = caught(lambda: safeckpt.save({"w": BIAS(), "nan": float("nan"), "zero": -0.0}, same))
    ctx.barrier()
    got = safeckpt.load_state(same)
    out["same_loaded"] = [repr(got["nan"]), repr(got["zero"])]
    return out


def sc_bad_shards(ctx: Ctx) -> dict:
    """Shards that do not tile their tensor: rank 3 holds rows 10-13 of 16 (rank 2 holds
    8-11: an overlap, and rows 14-15 held by nobody), then rows 4-7 again (rank 1's box,
    written once: a gap)."""
    import safeckpt
    from safeckpt import Shard
    out = {}
    for name, start in (("overlap", 10), ("gap", 4)):
        first = start if ctx.rank == 3 else 4 * ctx.rank
        state = {"v": Shard(V_full()[first:first + 4].clone(), (16, 4), [first, 0]), "b": BIAS()}
        out[name] = caught(lambda: safeckpt.save(state, str(ctx.root / f"bad_shards_{name}")))
        ctx.barrier()
    return out


def sc_raise(ctx: Ctx) -> dict:
    """A rank raises inside ``state_dict()`` (rank 2, then rank 0), and a rank's storage
    fails after a partial write (rank 1): every rank raises, nothing changes on disk."""
    import safeckpt
    path = ctx.root / "raise"
    out: dict = {}
    safeckpt.save({"w": BIAS(), "obj": Boom(1), "big": replicated_state()["a"]}, str(path))
    ctx.barrier()
    out["before"] = listing(path)
    for name, failing in (("state_dict_rank2", 2), ("state_dict_rank0", 0)):
        obj = Boom(2, "raise" if ctx.rank == failing else None, ctx.rank)
        out[name] = caught(lambda: safeckpt.save({"w": BIAS() * 2, "obj": obj, "big": replicated_state()["a"]},
                                                 str(path), overwrite=True))
        ctx.barrier()
        out[name]["after"] = listing(path)
    storage = _local_storage(path, fail_write="enospc" if ctx.rank == 1 else None)
    out["write_rank1"] = caught(lambda: safeckpt.save(
        {"w": BIAS() * 3, "obj": Boom(3), "big": replicated_state()["a"], **replicated_state()["d"]},
        storage, overwrite=True))
    ctx.barrier()
    out["write_rank1"]["after"] = listing(path)
    target = {"w": BIAS() * 0, "obj": Boom(0), "big": replicated_state()["a"] * 0}
    out["reload"] = caught(lambda: safeckpt.load(target, str(path)))
    out["reload_problems"] = compare({"w": target["w"], "obj": target["obj"].value, "big": target["big"]},
                                     {"w": BIAS(), "obj": 1, "big": replicated_state()["a"]})
    return out


def sc_disagree(ctx: Ctx) -> dict:
    import safeckpt
    out: dict = {}
    state = {"w": BIAS(), "n": 1}
    mgr = safeckpt.CheckpointManager(str(ctx.root / "disagree_mgr"))
    out["manager_step"] = caught(lambda: mgr.save(6 if ctx.rank == 3 else 5, state))
    ctx.barrier()
    path = ctx.root / ("disagree_p1" if ctx.rank == 1 else "disagree_p0")
    out["path"] = caught(lambda: safeckpt.save(state, str(path)))
    ctx.barrier()
    out["save_step"] = caught(lambda: safeckpt.save(state, str(ctx.root / "disagree_step"),
                                                    step=8 if ctx.rank == 2 else 7))
    ctx.barrier()
    return out


def sc_nonshared(ctx: Ctx) -> dict:
    """Node-local disks that look the same: each rank its own folder, one URL."""
    import safeckpt
    from safeckpt.storage import LocalStorage
    storage = LocalStorage(str(ctx.root / "nonshared" / f"rank_{ctx.rank}" / "ckpt"))
    storage.url = "/mnt/shared/ckpt"
    out = {"save": caught(lambda: safeckpt.save(replicated_state(), storage))}
    ctx.barrier()
    return out


def _mgr_state(rank: int, step: int, *, empty: bool = False) -> dict:
    """Each rank's rows of a step-dependent matrix as a rank-local tensor (so that each
    rank reads only its own bytes back), a replicated tensor and the step."""
    import torch
    from safeckpt.protocol.shards import RankLocal
    r0, r1 = SAVE_ROWS[rank]
    w = mgr_w(step)[r0:r1].clone()
    return {"w": RankLocal(torch.full_like(w, -1) if empty else w),
            "bias": BIAS() * (0 if empty else step), "step": -1 if empty else step}


def _mgr_problems(state: dict, rank: int, step: int) -> list[str]:
    want = _mgr_state(rank, step)
    return (compare(state["w"].value, want["w"].value, "w") + compare(state["bias"], want["bias"], "bias")
            + compare(state["step"], step, "step"))


def sc_manager(ctx: Ctx) -> dict:
    import warnings
    import safeckpt
    root = ctx.root / "mgr"
    mgr = safeckpt.CheckpointManager(str(root), keep_last=2)
    out: dict = {"after_save": []}
    for step in (10, 20, 30):
        mgr.save(step, _mgr_state(ctx.rank, step))
        out["after_save"].append({"steps": mgr.steps(), "latest": mgr.latest_step()})
    state = _mgr_state(ctx.rank, 0, empty=True)
    out["restored"] = mgr.restore(state)
    out["restored_problems"] = _mgr_problems(state, ctx.rank, 30)
    ctx.barrier()
    if ctx.rank == 0:  # damage rank 2's part of the newest checkpoint: only rank 2 reads it
        try:
            folder = Path(mgr.path(30))
            victim = next(p for p in folder.iterdir() if p.name.startswith("data-")
                          and p.name.endswith("-r00002.safetensors"))
            data = bytearray(victim.read_bytes())
            data[-1] ^= 0x55  # the last byte of the file: rank 2's rank-local rows
            victim.write_bytes(bytes(data))
            out["damaged"] = victim.name
        except Exception as exc:  # noqa: BLE001 - reported; the others wait at the barrier
            out["damaged"] = f"could not damage step 30: {exc!r} (folder: {listing(root)})"
    ctx.barrier()
    state = _mgr_state(ctx.rank, 0, empty=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = caught(lambda: out.__setitem__("fallback", mgr.restore(state)))
    out["fallback_error"] = res
    out["fallback_warnings"] = [str(w.message)[:500] for w in seen]
    out["fallback_problems"] = _mgr_problems(state, ctx.rank, 20)
    out["final_steps"] = mgr.steps()
    return out


# -- scenarios: loads on other world sizes --------------------------------------------


def sc_replicated_load(ctx: Ctx) -> dict:
    import safeckpt
    target = replicated_state()
    for t in [target["a"], target["b"], target["c"], target["d"]["e"], target["d"]["f"], *target["small"]]:
        t.zero_()
    target["step"], target["name"] = -1, ""
    safeckpt.load(target, str(ctx.root / "replicated"))
    return {"problems": compare(target, replicated_state())}


REGION_DTYPES = ["float32", "bfloat16", "int16", "float64", "uint8", "complex64"]


def region_full(i: int):
    """Small tensor ``i`` of the region scenarios: 12 x (3 + i % 4), dtype by ``i``."""
    import torch
    t = torch.arange(12 * (3 + i % 4), dtype=torch.float64).reshape(12, 3 + i % 4) * (i + 1) - 7 * i
    return t.to(getattr(torch, REGION_DTYPES[i % len(REGION_DTYPES)]))


def region_state(rank: int, rows: list, cols: bool = False, empty: bool = False) -> dict:
    """60 small tensors, each sharded by rows (``cols``: by columns of the same ranges
    clipped to its width) over the ranks, so every rank's pieces sit in one small-tensor
    region of its data file; ``tied`` names the same shard as ``r3``; ``view`` is a
    strided view of a larger local tensor."""
    import torch
    from safeckpt.protocol.shards import Shard
    r0, r1 = rows[rank]
    state: dict = {}
    for i in range(60):
        full = region_full(i)
        if cols:
            c0, c1 = min(r0, full.shape[1]), min(r1, full.shape[1])
            piece, offsets = full[:, c0:c1].clone(), [0, c0]
        else:
            piece, offsets = full[r0:r1].clone(), [r0, 0]
        if empty:
            piece = torch.zeros_like(piece)
        state[f"r{i}"] = Shard(piece, list(full.shape), offsets)
    state["tied"] = state["r3"]
    base = torch.zeros(2 * 12, 8, dtype=torch.float32)
    base[::2, 1:7:2] = 0 if empty else region_full(0)[:, :3].float()
    state["view"] = base[::2, 1:7:2] if not empty else base[::2, 1:7:2].clone()
    return state


def _region_problems(state: dict, rank: int, rows: list, cols: bool = False) -> list[str]:
    problems = []
    r0, r1 = rows[rank]
    for i in range(60):
        full = region_full(i)
        want = full[:, min(r0, full.shape[1]):min(r1, full.shape[1])] if cols else full[r0:r1]
        problems += compare(state[f"r{i}"].local_tensor, want, f"r{i}")
    problems += compare(state["tied"].local_tensor, state["r3"].local_tensor, "tied")
    return problems + compare(state["view"], region_full(0)[:, :3].float(), "view")


REGION_SAVE4 = [(0, 2), (2, 7), (7, 8), (8, 12)]   # 4 uneven row shards of each small tensor
REGION_LOAD3 = [(0, 5), (5, 6), (6, 12)]           # on 3 ranks: boxes straddling the saved ones


def sc_regions_save(ctx: Ctx) -> dict:
    import safeckpt
    path = ctx.root / "regions"
    safeckpt.save(region_state(ctx.rank, REGION_SAVE4), str(path))
    target = region_state(ctx.rank, REGION_SAVE4, empty=True)
    safeckpt.load(target, str(path))
    return {"problems": _region_problems(target, ctx.rank, REGION_SAVE4)}


def sc_regions_load3(ctx: Ctx) -> dict:
    """Saved as 4 row shards per tensor -> 3 other row shards, and 3 column shards."""
    import safeckpt
    rows = region_state(ctx.rank, REGION_LOAD3, empty=True)
    safeckpt.load(rows, str(ctx.root / "regions"))
    cols = region_state(ctx.rank, REGION_LOAD3, cols=True, empty=True)
    cols.pop("view")
    safeckpt.load(cols, str(ctx.root / "regions"), strict=False)
    cols["view"] = rows["view"]
    return {"problems": _region_problems(rows, ctx.rank, REGION_LOAD3)
            + _region_problems(cols, ctx.rank, REGION_LOAD3, cols=True)}


def sc_rows_load3(ctx: Ctx) -> dict:
    """4 row shards saved -> 3 uneven column shards of W, 3 row shards of E."""
    import safeckpt
    import torch
    from safeckpt.protocol.shards import Shard
    c0, c1 = LOAD_COLS3[ctx.rank]
    r0, r1 = LOAD_EROWS3[ctx.rank]
    target = {"w": Shard(torch.empty(W_SHAPE[0], c1 - c0, dtype=torch.float64), W_SHAPE, [0, c0]),
              "e": Shard(torch.empty(r1 - r0, E_SHAPE[1], dtype=torch.bfloat16), E_SHAPE, [r0, 0]),
              "bias": torch.empty(10)}
    safeckpt.load(target, str(ctx.root / "rows"))
    return {"problems": _shard_problems(target, ctx.rank, None, LOAD_COLS3, LOAD_EROWS3, None)}


def sc_rows_load2(ctx: Ctx) -> dict:
    """4 row shards saved -> 2 other row shards of W; E as a full plain tensor."""
    import safeckpt
    import torch
    from safeckpt.protocol.shards import Shard
    r0, r1 = LOAD_ROWS2[ctx.rank]
    target = {"w": Shard(torch.empty(r1 - r0, W_SHAPE[1], dtype=torch.float64), W_SHAPE, [r0, 0]),
              "e": torch.empty(E_SHAPE, dtype=torch.bfloat16), "bias": torch.empty(10)}
    safeckpt.load(target, str(ctx.root / "rows"))
    problems = (compare(target["w"].local_tensor, W_full()[r0:r1], "w") + compare(target["e"], E_full(), "e")
                + compare(target["bias"], BIAS(), "bias"))
    return {"problems": problems}


def sc_dtensor_load2(ctx: Ctx) -> dict:
    """DTensors saved on 4 ranks (1-D and 2-D meshes) -> other placements on 2 ranks."""
    import safeckpt
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh((ctx.world,))
    t1 = {"a": distribute_tensor(dt_full("a") * 0, mesh, [Shard(1)]),
          "b": distribute_tensor(dt_full("b") * 0, mesh, [Shard(0)]),
          "c": distribute_tensor(dt_full("c") * 0, mesh, [Shard(1)])}   # 7 columns on 2 ranks: 4,3
    safeckpt.load(t1, str(ctx.root / "dt1"))
    t2 = {"d": distribute_tensor(dt_full("d") * 0, mesh, [Replicate()]),
          "g": distribute_tensor(dt_full("g") * 0, mesh, [Shard(0)])}
    r2 = caught(lambda: safeckpt.load(t2, str(ctx.root / "dt2")))
    problems = [p for k in "abc" for p in compare(t1[k], dt_full(k), k)]
    local_a = t1["a"].to_local()
    problems += compare(local_a, dt_full("a")[:, 6 * ctx.rank: 6 * ctx.rank + 6], "a.local")
    problems2 = [p for k in "dg" for p in compare(t2[k], dt_full(k), k)] if r2["raised"] is None else []
    return {"problems": problems, "dt2": r2, "dt2_problems": problems2}


def sc_fsdp_load2(ctx: Ctx) -> dict:
    import safeckpt
    import torch
    mesh = _mesh((ctx.world,))
    expected = torch.load(ctx.root / "fsdp_expected.pt")
    out = {}
    model, opt = fsdp_build(mesh, init_optimizer_state=True)
    out["initialized"] = caught(lambda: safeckpt.load({"model": model, "optim": opt}, str(ctx.root / "fsdp")))
    if out["initialized"]["raised"] is None:
        out["initialized"]["problems"] = compare(fsdp_full(model, opt), expected)
        out["initialized"]["step_after"] = caught(lambda: fsdp_train_step(model, opt, ctx.rank, 5))
    ctx.barrier()
    # a fresh optimizer with no state yet (DESIGN.md: "must work")
    model, opt = fsdp_build(mesh, init_optimizer_state=False)
    out["fresh"] = caught(lambda: safeckpt.load({"model": model, "optim": opt}, str(ctx.root / "fsdp")))
    if out["fresh"]["raised"] is None:
        out["fresh"]["problems"] = compare(fsdp_full(model, opt), expected)
        # per-parameter state (exp_avg, exp_avg_sq); the scalar "step" is a plain tensor
        # under FSDP2 too
        out["fresh"]["state_types"] = sorted({type(v).__name__ for st in opt.state.values()
                                              for v in st.values() if v.dim() > 0})
        out["fresh"]["step_after"] = caught(lambda: fsdp_train_step(model, opt, ctx.rank, 5))
    return out


def sc_ranklocal_load3(ctx: Ctx) -> dict:
    import warnings
    import safeckpt
    import torch
    from safeckpt.protocol.shards import RankLocal
    rng = torch.get_rng_state()
    target = {"rng": RankLocal(rng.clone()), "pos": RankLocal(-1), "w": BIAS() * 0,
              "loader": RankLocal({"epoch": 0, "offset": 0.0})}
    out = {"strict": caught(lambda: safeckpt.load(target, str(ctx.root / "ranklocal")))}
    out["strict_untouched"] = compare(target["w"], BIAS() * 0, "w") + compare(target["pos"].value, -1, "pos")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out["lenient"] = caught(lambda: safeckpt.load(target, str(ctx.root / "ranklocal"), strict=False))
    out["lenient_warnings"] = [str(w.message)[:500] for w in seen]
    out["lenient_pos"] = target["pos"].value
    out["lenient_loader"] = target["loader"].value
    out["lenient_rng_kept"] = bool(torch.equal(target["rng"].value, rng))
    out["lenient_w"] = compare(target["w"], BIAS(), "w")
    return out


# -- scenarios: a rank killed during a save ----------------------------------------------


def _killed_save(ctx: Ctx, how: str) -> dict:
    import safeckpt
    path = ctx.root / f"killed_{how}"
    safeckpt.save({"w": BIAS(), "obj": Boom(1), "big": replicated_state()["a"]}, str(path))
    ctx.barrier()
    before = listing(path)
    victim = ctx.opts.get("victim", 1)
    obj = Boom(2, "kill" if how == "state_dict" and ctx.rank == victim else None, ctx.rank)
    storage = _local_storage(path, fail_write="kill_after" if how == "after_write" and ctx.rank == victim else None)
    state = {"w": BIAS() * 2, "obj": obj, "big": replicated_state()["a"] * 2, **replicated_state()["d"]}
    res = caught(lambda: safeckpt.save(state, storage, overwrite=True))
    ctx.stop = True  # a rank is gone: no more collectives in this launch
    return {"before": before, "save": res, "after": listing(path)}


def sc_hang_state_dict(ctx: Ctx) -> dict:
    """Rank ``victim`` hangs inside ``state_dict()`` (alive, connections open) until the
    others have given up (or 60 s): they must raise after ``SAFECKPT_TIMEOUT``."""
    import safeckpt
    path = ctx.root / "hang"
    marker = ctx.out / "hang-survivors-done"
    victim = ctx.opts.get("victim", 1)

    class Hang(Boom):
        def state_dict(self) -> dict:
            deadline = time.monotonic() + 60
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return {"v": self.value}

    obj = Hang(2) if ctx.rank == victim else Boom(2)
    res = caught(lambda: safeckpt.save({"w": BIAS(), "obj": obj}, str(path)))
    if ctx.rank != victim:
        marker.touch()
    ctx.stop = True
    return {"save": res, "after": listing(path)}


def sc_kill_state_dict(ctx: Ctx) -> dict:
    return _killed_save(ctx, "state_dict")


def sc_kill_after_write(ctx: Ctx) -> dict:
    return _killed_save(ctx, "after_write")


SCENARIOS: dict[str, Callable[[Ctx], dict]] = {
    name[3:]: fn for name, fn in dict(globals()).items() if name.startswith("sc_") and callable(fn)}


def worker_main(out: str, root: str, scenarios: list[str], opts: dict | None = None) -> int:
    """One rank: init the default group from the environment, run the scenarios."""
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    step_timeout = float(os.environ.get("DIST_WORKER_STEP_TIMEOUT", "120"))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=step_timeout))
    ctx = Ctx(rank, world, Path(root), Path(out), dict(opts or {}))
    failed_before: list[str] = []
    for name in scenarios:
        folder = Path(out) / name
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            rec: dict = {"ok": True, "data": SCENARIOS[name](ctx)}
        except BaseException:  # noqa: BLE001 - reported to the test
            rec = {"ok": False, "error": traceback.format_exc()}
        rec["seconds"] = time.monotonic() - t0
        rec["failed_before"] = list(failed_before)
        tmp = folder / f".rank{rank}.json"
        tmp.write_text(json.dumps(rec, default=repr))
        os.replace(tmp, folder / f"rank{rank}.json")
        if ctx.stop:
            return 0
        try:  # resynchronise: every rank has finished this scenario
            oks = [None] * world
            dist.all_gather_object(oks, rec["ok"])
        except Exception:  # noqa: BLE001
            (Path(out) / f"resync-failed-rank{rank}.txt").write_text(f"after {name}:\n{traceback.format_exc()}")
            return 3
        failed_before += [f"{name} (rank {r})" for r, ok in enumerate(oks) if not ok]
    dist.barrier()
    return 0


# --------------------------------------------------------------------------- launching


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world: int, port: int, env: dict | None) -> dict:
    out = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
           "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    out.update(env or {})
    return out


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


def _child(req: dict, rank: int) -> None:
    code = 1
    try:
        _die_with_parent()
        log = os.open(os.path.join(req["out"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)  # the server's stdout is the protocol pipe
        os.dup2(log, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.update(_rank_env(rank, req["world"], req["port"], req.get("env")))
        faulthandler.dump_traceback_later(req["limit_s"], exit=True, file=sys.stderr)
        code = worker_main(req["out"], req["root"], req["scenarios"], req.get("opts"))
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)


def _waitpids(pids: list[int], timeout: float) -> tuple[dict, bool]:
    """Reap ``pids`` (children of this process); SIGKILL what is left after ``timeout``."""
    status: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    timed_out = False
    while len(status) < len(pids):
        for pid in pids:
            if pid in status:
                continue
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = {"code": os.waitstatus_to_exitcode(st) if os.WIFEXITED(st) else None,
                               "signal": os.WTERMSIG(st) if os.WIFSIGNALED(st) else None}
        if len(status) < len(pids) and time.monotonic() > deadline:
            timed_out = True
            for pid in pids:
                if pid not in status:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            deadline = float("inf")
        time.sleep(0.02)
    return status, timed_out


def serve(heavy: bool = True) -> None:
    """The fork server: import torch once, then fork the ranks of each launch. Without
    ``heavy``, DTensor, FSDP and dynamo are not imported (a second faster to start)."""
    import numpy  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401  (not safeckpt: ranks read SAFECKPT_TIMEOUT when they import it)
    if heavy:
        import torch.distributed.tensor  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.device_mesh  # noqa: F401
        import torch._dynamo  # noqa: F401  (imported lazily by the first DTensor op: 2-5 s per rank)
    torch.set_num_threads(1)  # forked children must not inherit a thread pool
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "launch":
            pids = []
            for rank in range(req["world"]):
                pid = os.fork()
                if pid == 0:
                    _child(req, rank)
                pids.append(pid)
            reply: dict = {"pids": pids}
        elif req["cmd"] == "wait":
            status, timed_out = _waitpids(req["pids"], req["timeout"])
            reply = {"status": [status[p] for p in req["pids"]], "timed_out": timed_out}
        else:
            reply = {"error": f"unknown command {req['cmd']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


@dataclass
class Launch:
    """What one launch left behind: per-rank exit status, logs and scenario results."""

    world: int
    out: Path
    scenarios: list[str]
    status: list[dict]
    timed_out: bool
    seconds: float
    pids: list[int] = field(default_factory=list)

    def log(self, rank: int, tail: int = 4000) -> str:
        p = self.out / f"rank{rank}.log"
        return p.read_text(errors="replace")[-tail:] if p.exists() else "(no log)"

    def describe(self) -> str:
        lines = [f"launch of {self.world} ranks ({', '.join(self.scenarios)}) took {self.seconds:.1f}s"
                 + (" and TIMED OUT (ranks SIGKILLed)" if self.timed_out else "")]
        for r, st in enumerate(self.status):
            lines.append(f"--- rank {r} (pid {self.pids[r] if self.pids else '?'}): {st}\n{self.log(r)}")
        for p in sorted(self.out.glob("resync-failed-*")):
            lines.append(f"--- {p.name}\n{p.read_text()[-2000:]}")
        return "\n".join(lines)

    def records(self, scenario: str) -> list[dict | None]:
        out = []
        for r in range(self.world):
            p = self.out / scenario / f"rank{r}.json"
            out.append(json.loads(p.read_text()) if p.exists() else None)
        return out

    def results(self, scenario: str, ranks: list[int] | None = None) -> list[dict]:
        """Each rank's data for ``scenario``; raises AssertionError naming every rank that
        failed (with its traceback) or left no result."""
        ranks = list(range(self.world)) if ranks is None else ranks
        recs = self.records(scenario)
        problems = []
        for r in ranks:
            rec = recs[r]
            if rec is None:
                problems.append(f"rank {r}: no result (the rank died or hung; exit status {self.status[r]})")
            elif not rec["ok"]:
                problems.append(f"rank {r} raised:\n{rec['error']}")
        if problems:
            earlier = sorted({f for rec in recs if rec for f in rec.get("failed_before", [])})
            note = f"\n(earlier failures in this launch: {', '.join(earlier)})" if earlier else ""
            raise AssertionError(f"scenario {scenario!r} on {self.world} ranks failed:\n"
                                 + "\n".join(problems) + note + "\n\n" + self.describe())
        return [recs[r]["data"] for r in ranks]


class ForkServer(ServerProcess):
    """The test side of ``serve()``: launch the ranks of a group through it."""

    def __init__(self, src: str, script: Path = HERE, env: dict | None = None) -> None:
        """``script`` (this file, or one that adds scenarios to ``SCENARIOS``) runs ``serve()``."""
        super().__init__(src, script, env)

    def launch(self, world: int, scenarios: list[str], root: Path, out: Path, *, timeout: float,
               env: dict | None = None, opts: dict | None = None) -> Launch:
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        pids = self.request(cmd="launch", world=world, port=free_port(), out=str(out), root=str(root),
                            scenarios=scenarios, env=env or {}, opts=opts or {},
                            limit_s=timeout - 2)["pids"]
        reply = self.request(cmd="wait", pids=pids, timeout=timeout)
        return Launch(world, out, scenarios, reply["status"], reply["timed_out"], time.monotonic() - t0, pids)


def popen_launch(world: int, scenarios: list[str], root: Path, out: Path, *, timeout: float, src: str,
                 env: dict | None = None, opts: dict | None = None) -> Launch:
    """The same launch with one fresh interpreter per rank (as torchrun starts them)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    t0 = time.monotonic()
    for rank in range(world):
        e = dict(os.environ)
        e.update(_rank_env(rank, world, port, env))
        e["PYTHONPATH"] = src + os.pathsep + e.get("PYTHONPATH", "")
        log = open(out / f"rank{rank}.log", "ab")
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE), "run", "--out", str(out), "--root", str(root),
             "--scenarios", ",".join(scenarios), "--opts", json.dumps(opts or {}),
             "--limit", str(timeout - 2)], stdout=log, stderr=subprocess.STDOUT, env=e))
        log.close()
    timed_out = False
    deadline = t0 + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    status = [{"code": p.returncode if p.returncode >= 0 else None,
               "signal": -p.returncode if p.returncode < 0 else None} for p in procs]
    return Launch(world, out, scenarios, status, timed_out, time.monotonic() - t0, [p.pid for p in procs])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve")
    run = sub.add_parser("run", help="one rank; RANK, WORLD_SIZE, MASTER_* from the environment")
    run.add_argument("--out", required=True)
    run.add_argument("--root", required=True)
    run.add_argument("--scenarios", required=True)
    run.add_argument("--opts", default="{}")
    run.add_argument("--limit", type=float, default=300)
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        serve()
        return 0
    _die_with_parent()
    faulthandler.dump_traceback_later(args.limit, exit=True)
    code = worker_main(args.out, args.root, args.scenarios.split(","), json.loads(args.opts))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def extension_main() -> None:
    """The ``__main__`` of a worker that adds scenarios to this one: its fork server skips
    the heavy imports (DTensor, FSDP), its ranks run as ``main`` does."""
    if sys.argv[1:] == ["serve"]:
        serve(heavy=False)
        sys.exit(0)
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
