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

Every checkpoint written is loaded back and compared with the GPU tensors; a mismatch
fails the run. Without CUDA it says it was skipped and exits 0 (``--on-cpu`` runs the
same steps on CPU tensors instead, unpinned: a check of the script itself, no figures).

    python benchmarks/gpu_check.py [--size-mib 4096] [--n-small 20000] [--repeat 3] [--dir D]
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
    args = p.parse_args()
    global DEVICE
    if args.on_cpu:
        DEVICE = "cpu"
    started = time.perf_counter()
    rows = run_gpu(args.size_mib, args.n_small, args.repeat, (args.dir or default_dir()).resolve())
    if not rows:
        print("gpu_check: skipped (no CUDA device)")
        return 0
    print(gpu_table(rows, time.perf_counter() - started))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
