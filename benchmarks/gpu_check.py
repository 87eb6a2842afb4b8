#!/usr/bin/env python
"""GPU staging, measured where a CUDA device exists (well under 3 minutes).

For 4 GiB of CUDA tensors (32 × 128 MiB; ``--size-mib`` to change) and 20,000 small
CUDA tensors (~156 MiB, the optimizer-like state of the suite), it prints one table:

* ``pinned copy_``: a plain ``copy_(non_blocking=True)`` of every tensor into
  preallocated pinned host buffers, then one synchronize: the floor of any snapshot;
* ``safeckpt.async_save`` blocked: the time the caller waits for the snapshot into
  safeckpt's reusable pinned staging (after a first, allocating call), and × the
  pinned copy; once as the writer process gets it (a shared buffer, page-locked with
  ``cudaHostRegister``), once as a thread of this process does
  (``SAFECKPT_ASYNC_WRITER=thread``: pinned host buffers);
* ``safeckpt.save`` from the GPU: a synchronous save to durability, in GB/s, beside a
  raw fsync'd write of the same bytes from host memory.

Then a load shared between 2 ranks (``share_reads="job"``: each saved byte read from
storage once, sent to the other rank) into CUDA tensors, against the same load without
sharing: bytes read from storage by both ranks, time, and which transport moved the
bytes -- NCCL between two GPUs (``SAFECKPT_SHARE_TRANSPORT=nccl``, a world of
``cpu:gloo,cuda:nccl``) where there are 2 GPUs, else gloo with both ranks on the one GPU
(NCCL refuses two ranks on one device: that row says so).

Every checkpoint written is loaded back and compared with the GPU tensors; a mismatch
fails the run. Without CUDA it says it was skipped and exits 0 (``--on-cpu`` runs the
same steps on CPU tensors instead, unpinned: a check of the script itself, no figures).

    python benchmarks/gpu_check.py [--size-mib 4096] [--n-small 20000] [--repeat 3] [--dir D]
                                   [--share-mib 1024] [--share-only] [--on-cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HERE, MiB, default_dir, flatten, make_small_state  # noqa: E402


DEVICE = "cuda"  # --on-cpu: "cpu"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_large(total_mib: int) -> dict:
    n = max(1, total_mib // 128)
    numel = min(total_mib, 128) * MiB // 4
    g = torch.Generator(device=DEVICE).manual_seed(0)
    return {"model": {f"w{i:02d}": torch.randn(numel, device=DEVICE, generator=g) for i in range(n)}}


def cuda_small(n: int) -> dict:
    state = make_small_state(n, 8)
    return {"optim": {"state": {k: {n_: t.to(DEVICE) for n_, t in v.items()}
                                for k, v in state["optim"]["state"].items()}}}


def pinned_copy(state: dict, repeat: int) -> list[float]:
    pin = DEVICE == "cuda"
    pairs = [(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin), t) for t in flatten(state).values()]
    for d, s in pairs:  # allocated and touched outside the timing
        d.copy_(s)
    times = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        for d, s in pairs:
            d.copy_(s, non_blocking=True)
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def async_blocked(state: dict, work: Path, repeat: int, mode: str) -> tuple[list[float], bool]:
    """Blocked seconds of ``repeat`` async saves (``mode``: where they are committed,
    ``SAFECKPT_ASYNC_WRITER``) and whether the staging memory was pinned."""
    import safeckpt
    from safeckpt.run import asyncsave, writer

    os.environ[writer.ENV] = mode
    safeckpt.async_save(state, work / "warm").result()  # allocates (and pins) the staging memory
    saver = asyncsave._default
    if saver.arena.buffer is not None:
        pinned = saver.arena.buffer.pinned
    else:
        pinned = bool(saver.pool.buffers) and all(b.is_pinned() for b in saver.pool.buffers.values())
    times = []
    for r in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fut = safeckpt.async_save(state, work / f"a{r}")
        times.append(time.perf_counter() - t0)
        fut.result()
        check(state, work / f"a{r}")
        shutil.rmtree(work / f"a{r}")
    shutil.rmtree(work / "warm")
    saver.close()
    os.environ.pop(writer.ENV)
    return times, pinned and DEVICE == "cuda"


def sync_save(state: dict, work: Path, repeat: int) -> list[float]:
    import safeckpt

    times = []
    for r in range(repeat):
        os.sync()
        _sync()
        t0 = time.perf_counter()
        safeckpt.save(state, work / f"s{r}")
        times.append(time.perf_counter() - t0)
        check(state, work / f"s{r}")
        shutil.rmtree(work / f"s{r}")
    return times


def raw_write(nbytes: int, work: Path, repeat: int) -> list[float]:
    """An fsync'd write of ``nbytes`` from host memory in 64 MiB writes: the disk's limit."""
    block = torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8).numpy().tobytes()
    times = []
    for r in range(repeat):
        os.sync()
        t0 = time.perf_counter()
        with open(work / f"raw{r}", "wb", buffering=0) as f:
            left = nbytes
            while left > 0:
                left -= f.write(block[:min(left, len(block))])
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
        os.remove(work / f"raw{r}")
    return times


def check(state: dict, path: Path) -> None:
    import safeckpt

    got = flatten(safeckpt.load_state(path))
    want = flatten(state)
    bad = [k for k, t in want.items() if not torch.equal(got[k], t.cpu())]
    if bad or got.keys() != want.keys():
        raise SystemExit(f"MISMATCH in {path}: {bad[:5]} (of {len(want)})")


def run_gpu(size_mib: int, n_small: int, repeat: int, base: Path) -> list[dict]:
    """Measure both states (see the module docstring); ``[]`` without a device."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        return []
    work = Path(tempfile.mkdtemp(prefix=".safeckpt-gpu-", dir=base))
    rows = []
    try:
        for name, make in ((f"{size_mib / 1024:g} GiB, {max(1, size_mib // 128)} tensors", lambda: cuda_large(size_mib)),
                           (f"{n_small:,} small tensors", lambda: cuda_small(n_small))):
            state = make()
            nbytes = sum(t.nbytes for t in flatten(state).values())
            copy = pinned_copy(state, repeat)
            blocked, pinned = async_blocked(state, work, repeat, "process")
            blocked_thread, pinned_thread = async_blocked(state, work, repeat, "thread")
            save = sync_save(state, work, max(1, repeat - 1))
            raw = raw_write(nbytes, work, max(1, repeat - 1))
            rows.append({"state": name, "bytes": nbytes, "pinned_copy_s": copy, "async_blocked_s": blocked,
                         "staging_pinned": pinned, "async_blocked_thread_s": blocked_thread,
                         "staging_pinned_thread": pinned_thread, "sync_save_s": save, "raw_write_s": raw})
            del state
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _share_rank(rank: int, port: int, size_mib: int, repeat: int, work: str, device_kind: str, gpus: int) -> None:
    """One of the 2 ranks of ``share_check`` (spawned: CUDA does not survive a fork)."""
    import datetime
    import logging
    import threading

    import torch.distributed as dist

    nccl = device_kind == "cuda" and gpus >= 2
    if nccl:
        os.environ["SAFECKPT_SHARE_TRANSPORT"] = "nccl"
        torch.cuda.set_device(rank)
    device = torch.device(device_kind, rank if nccl else 0) if device_kind == "cuda" else torch.device("cpu")
    dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    import safeckpt
    from safeckpt.storage import StorageWrapper
    from safeckpt.storage import open as open_storage

    said: list[str] = []

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())
    log = logging.getLogger("safeckpt.protocol.exchange")
    log.setLevel(logging.DEBUG)
    log.addHandler(Heard())
    count = [0]
    lock = threading.Lock()

    class Counted(StorageWrapper):
        def read_into(self, name: str, offset: int, out: memoryview) -> None:
            self.inner.read_into(name, offset, out)
            with lock:
                count[0] += len(out)

    g = torch.Generator(device=device).manual_seed(0)
    n = max(1, size_mib // 32)
    state = {"model": {f"w{i:02d}": torch.randn(min(size_mib, 32) * MiB // 4, device=device, generator=g)
                       for i in range(n)}}
    dest = {"model": {k: torch.zeros_like(t) for k, t in state["model"].items()}}
    path = Path(work) / "shared"
    safeckpt.save(state, path)
    out: dict = {"transport": None, "device": str(device), "modes": {}}
    for mode in ("off", "job"):
        times, nbytes = [], []
        for r in range(repeat + 1):  # the first one warms up
            for t in dest["model"].values():
                t.zero_()
            count[0] = 0
            said.clear()
            dist.barrier()
            t0 = time.perf_counter()
            safeckpt.load(dest, Counted(open_storage(str(path))), share_reads=mode)
            if device.type == "cuda":  # this process's own device (a spawned rank has its own DEVICE)
                torch.cuda.synchronize()
            dist.barrier()
            if r:
                times.append(time.perf_counter() - t0)
            both = [None, None]
            dist.all_gather_object(both, count[0])
            nbytes.append(sum(both))
            bad = [k for k, t in state["model"].items() if not torch.equal(dest["model"][k], t)]
            if bad:
                raise SystemExit(f"MISMATCH after a shared load ({mode}): {bad[:5]}")
            if mode == "job" and said:
                out["transport"] = "nccl" if "nccl" in said[-1] else "gloo"
        out["modes"][mode] = {"times": times, "bytes": min(nbytes)}
    out["state_bytes"] = sum(t.nbytes for t in state["model"].values())
    if rank == 0:
        (Path(work) / "share.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def share_check(size_mib: int, repeat: int, base: Path) -> dict:
    """A load shared between 2 ranks into CUDA tensors (see the module docstring); ``{}``
    without a device."""
    import torch.multiprocessing as mp

    from common import free_port

    if DEVICE == "cuda" and not torch.cuda.is_available():
        return {}
    gpus = torch.cuda.device_count() if DEVICE == "cuda" else 0
    work = Path(tempfile.mkdtemp(prefix=".safeckpt-gpu-share-", dir=base))
    try:
        mp.spawn(_share_rank, args=(free_port(), size_mib, repeat, str(work), DEVICE, gpus), nprocs=2, join=True)
        res = json.loads((work / "share.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["nccl_note"] = ("" if res["transport"] == "nccl" else
                        f"NCCL not run: {gpus} GPU(s); it needs two (one rank per GPU)" if DEVICE == "cuda" else
                        "on CPU: gloo, a check of the script")
    return res


def share_table(res: dict) -> str:
    if not res:
        return "### shared load into GPU tensors\n\nskipped (no CUDA device)\n"
    med = statistics.median
    off, job = res["modes"]["off"], res["modes"]["job"]
    lines = [f"### shared load into {res['device']} tensors, 2 ranks, {res['state_bytes'] / MiB:,.0f} MiB "
             f"(bytes moved over {res['transport']}{'; ' + res['nccl_note'] if res['nccl_note'] else ''})", "",
             "| load | bytes read from storage (both ranks) | × the state | median s |", "|---|---:|---:|---:|"]
    for name, m in (("not shared (share_reads='off')", off), ("shared (share_reads='job')", job)):
        lines.append(f"| {name} | {m['bytes'] / MiB:,.0f} MiB | {m['bytes'] / res['state_bytes']:.2f} | "
                     f"{med(m['times']):.3f} |")
    lines += ["", "Every load was compared with the saved tensors.", ""]
    return "\n".join(lines)


def gpu_table(rows: list[dict], seconds: float | None = None) -> str:
    if not rows:
        return "### GPU staging\n\nskipped (no CUDA device)\n"
    med = statistics.median
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "on CPU: a check of the script, not figures"
    took = f", {seconds:.0f} s" if seconds is not None else ""
    lines = [f"### GPU staging ({where}, torch {torch.__version__}{took})", "",
             "| state | MiB | pinned copy_ s | async_save blocked s: writer process (× pinned copy, pinned) | "
             "on a thread (× pinned copy, pinned) | sync save from GPU s | GB/s | raw fsync'd write GB/s | "
             "save speed ÷ raw |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def blocked(r: dict, key: str, pinned: str, c: float) -> str:
        b = med(r[key])
        return f"{b:.3f} ({b / c:.2f}×, {'pinned' if r[pinned] else 'NOT pinned'})"

    for r in rows:
        c, s, w = med(r["pinned_copy_s"]), med(r["sync_save_s"]), med(r["raw_write_s"])
        lines.append(f"| {r['state']} | {r['bytes'] / MiB:,.0f} | {c:.3f} | "
                     f"{blocked(r, 'async_blocked_s', 'staging_pinned', c)} | "
                     f"{blocked(r, 'async_blocked_thread_s', 'staging_pinned_thread', c)} | {s:.3f} | "
                     f"{r['bytes'] / s / 1e9:.2f} | {r['bytes'] / w / 1e9:.2f} | {w / s:.2f}× |")
    lines += ["", "Medians of the repeats; every checkpoint was loaded back and matched the source tensors.", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=4096)
    p.add_argument("--n-small", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=HERE / "results" / "gpu_check.json")
    p.add_argument("--on-cpu", action="store_true", help="the same steps on CPU tensors (checks the script)")
    p.add_argument("--share-mib", type=int, default=1024, help="size of the shared load's state")
    p.add_argument("--share-only", action="store_true", help="only the shared load")
    args = p.parse_args()
    global DEVICE
    if args.on_cpu:
        DEVICE = "cpu"
    started = time.perf_counter()
    base = (args.dir or default_dir()).resolve()
    rows = [] if args.share_only else run_gpu(args.size_mib, args.n_small, args.repeat, base)
    shared = share_check(min(args.size_mib, args.share_mib), args.repeat, base)
    if not rows and not shared:
        print("gpu_check: skipped (no CUDA device)")
        return 0
    if rows:
        print(gpu_table(rows, time.perf_counter() - started))
    print(share_table(shared))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"staging": rows, "share": shared}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
