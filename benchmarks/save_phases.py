#!/usr/bin/env python
"""Where a save of many small tensors spends its time, phase by phase.

    PYTHONPATH=src python benchmarks/save_phases.py                 # 20,000 tensors, 5 repeats
    PYTHONPATH=src python benchmarks/save_phases.py --n-small 2000 --repeat 3

Times ``safeckpt.save`` and the caller's part of ``async_save`` (the time it blocks) of
``make_small_state`` and, inside them, each phase (flatten, layout, data file write,
staging, manifest build and encode), as wall and CPU time (``time.process_time``: on a
shared machine CPU time is the steadier figure). References in the same run: a plain
fsync'd write of the same bytes, ``torch.save`` and safetensors' ``save_file`` (each
fsync'd), and a plain copy of every tensor into preallocated memory (the floor of a
snapshot). Medians of ``--repeat`` runs after one untimed warm-up; the phases are found
by wrapping the functions that run them, so run it against any version of the source.
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_dir, flatten, make_small_state, raw_src_buffer, state_nbytes, write_fsync  # noqa: E402

Times = dict[str, list[tuple[float, float]]]

PHASES = [  # (module, attribute, label): the functions that run each phase
    ("safeckpt.protocol.checkpoint", "flatten", "flatten"),
    ("safeckpt.format.codec", "check_tree", "  check_tree (in flatten)"),
    ("safeckpt.protocol.commit", "SaveRun._plan", "plan (rank 0)"),
    ("safeckpt.protocol.commit", "plan_layout", "data file layout"),
    ("safeckpt.protocol.commit", "write_data_file", "data file write + fsync"),
    ("safeckpt.protocol.staging", "StagingPool.stage", "staging copy + small checksums"),
    ("safeckpt.protocol.commit", "SaveRun._build_manifest", "manifest build"),
    ("safeckpt.protocol.commit", "SaveRun._add_pieces", "  _add_pieces (in build)"),
    ("safeckpt.protocol.commit", "encode_manifest", "manifest encode"),
]


def timed(times: Times, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(label, []).append((time.perf_counter() - t0, time.process_time() - c0))
    return wrapper


def instrument(times: Times) -> None:
    import importlib

    for module, attr, label in PHASES:
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        if not hasattr(owner, name):
            continue  # not in this version of the source
        raw = inspect.getattr_static(owner, name)
        fn = timed(times, label, getattr(owner, name))
        setattr(owner, name, staticmethod(fn) if isinstance(raw, staticmethod) else fn)


def median(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)


def repeat(fn: Callable[[int], Any], n: int, times: Times | None = None) -> list[tuple[float, float]]:
    out = []
    for r in range(n + 1):
        if r == 1 and times is not None:
            times.clear()  # the warm-up's phases do not count
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        fn(r)
        out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out[1:]


def fsynced(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-small", type=int, default=20000)
    p.add_argument("--small-kib", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: the current folder)")
    args = p.parse_args()
    import safeckpt
    from safeckpt.protocol.checkpoint import save_request
    from safeckpt.run.asyncsave import AsyncSaver
    from safetensors.torch import save_file

    state = make_small_state(args.n_small, args.small_kib)
    tensors = flatten(state)
    n, nbytes = len(tensors), state_nbytes(state)
    work = Path(tempfile.mkdtemp(prefix=".safeckpt-phases-", dir=(args.dir or default_dir()).resolve()))
    times: Times = {}
    instrument(times)
    rows: list[tuple[str, tuple[float, float]]] = []
    try:
        src = raw_src_buffer()

        def raw(r: int) -> None:
            write_fsync(work / f"raw{r}", nbytes, src)
            os.remove(work / f"raw{r}")
        rows.append(("raw fsync'd write", median(repeat(raw, args.repeat))))

        def torch_save(r: int) -> None:
            torch.save(state, work / f"t{r}.pt")
            fsynced(work / f"t{r}.pt")
            os.remove(work / f"t{r}.pt")
        rows.append(("torch.save", median(repeat(torch_save, args.repeat))))

        def st_save(r: int) -> None:
            save_file(tensors, work / f"s{r}.safetensors")
            fsynced(work / f"s{r}.safetensors")
            os.remove(work / f"s{r}.safetensors")
        rows.append(("safetensors save_file", median(repeat(st_save, args.repeat))))

        def save(r: int) -> None:
            safeckpt.save(state, work / f"c{r}")
        save_runs = repeat(save, args.repeat, times)
        for r in range(args.repeat + 1):
            shutil.rmtree(work / f"c{r}")
        save_phases = {k: median(v) for k, v in times.items()}
        times.clear()

        pairs = [(torch.empty_like(t), t) for t in tensors.values()]

        def memcopy(r: int) -> None:
            for d, s in pairs:
                d.copy_(s)
        copy_floor = median(repeat(memcopy, args.repeat * 2))
        pairs.clear()  # the copies' memory is not the async save's to use
        saver = AsyncSaver()
        blocked: list[tuple[float, float]] = []

        def async_save(r: int) -> None:
            request = save_request(work / f"a{r}")
            t0, c0 = time.perf_counter(), time.process_time()
            future = saver.submit(state, request)
            blocked.append((time.perf_counter() - t0, time.process_time() - c0))
            future.result()
            saver.wait()
            shutil.rmtree(work / f"a{r}")
        repeat(async_save, args.repeat, times)
        saver.close()
        async_phases = {k: median(v) for k, v in times.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    save_wall, save_cpu = median(save_runs)
    raw_wall = rows[0][1][0]
    print(f"{n:,} tensors, {nbytes / 2**20:.0f} MiB, median of {args.repeat}; wall ms / CPU ms")
    for name, (w, c) in rows:
        print(f"  {name:34s} {w * 1e3:8.1f} {c * 1e3:8.1f}   safeckpt.save is {w / save_wall:.2f}x its speed")
    print(f"safeckpt.save {save_wall * 1e3:8.1f} {save_cpu * 1e3:8.1f}   {save_wall / n * 1e6:.1f} us/tensor wall, "
          f"{save_cpu / n * 1e6:.1f} us/tensor CPU, {raw_wall / save_wall:.2f}x the raw write")
    for label, (w, c) in save_phases.items():
        print(f"  {label:34s} {w * 1e3:8.1f} {c * 1e3:8.1f}")
    b_wall, b_cpu = median(blocked[1:])
    print(f"async_save, caller blocked {b_wall * 1e3:8.1f} {b_cpu * 1e3:8.1f}   {b_wall / copy_floor[0]:.2f}x a memory "
          f"copy ({copy_floor[0] * 1e3:.1f} ms)")
    for label, (w, c) in async_phases.items():
        if label not in ("data file write + fsync", "manifest encode"):  # the background thread's
            print(f"  {label:34s} {w * 1e3:8.1f} {c * 1e3:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
