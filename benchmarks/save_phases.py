#!/usr/bin/env python
"""Where a save spends its time, phase by phase, beside its references.

    PYTHONPATH=src python benchmarks/save_phases.py                 # 20,000 small tensors, 5 repeats
    PYTHONPATH=src python benchmarks/save_phases.py --state large   # 1 GiB in 48 tensors, cold cache
    PYTHONPATH=src python benchmarks/save_phases.py --n-small 2000 --repeat 3

Times ``safeckpt.save`` and the caller's part of ``async_save`` (the time it blocks) of
``make_small_state`` (or ``make_large_state``) and, inside them, each phase (flatten,
layout, data file write, staging, manifest build and encode; the fsync of the data
file, of the manifest and of the folders; the hashing thread; the async caller's walk,
checks and copy), as wall and CPU time (``time.process_time``: on a shared machine CPU
time is the steadier figure). References in the same run: a plain fsync'd write of the
same bytes, ``torch.save`` and safetensors' ``save_file`` (each fsync'd), and a plain
copy of every tensor into preallocated memory (the floor of a snapshot).

The repeats are interleaved: each repeat runs every tool once, in an order that rotates
from repeat to repeat (with the page cache dropped before each where allowed, always
for ``--state large``), so a drifting machine shows as spread, and the ratios are taken
within a repeat (``raw ÷ safeckpt`` per repeat: median and range). One untimed warm-up
repeat first. The phases are found by wrapping the functions that run them, so run it
against any version of the source.
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
from common import (default_dir, drop_page_cache, flatten, make_large_state, make_small_state,  # noqa: E402
                    raw_src_buffer, state_nbytes, write_fsync)

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
    ("safeckpt.protocol.datafile", "block_checksums", "hashing large pieces (helper thread, wall)"),
    ("safeckpt.run.asyncsave", "walk", "async caller: walk the state"),
    ("safeckpt.protocol.arena", "_Layout.matches", "async caller: check the layout"),
    ("safeckpt.protocol.arena", "ArenaStaging._plan", "async caller: plan a new layout"),
    ("safeckpt.protocol.arena", "_Layout.copy", "async caller: copy into the shared buffer"),
]


def instrument_storage(times: Times) -> None:
    """Time every file ``LocalStorage`` writes (with its fsyncs) and every fsync it
    makes, by what it is: the data file, the manifest, or a folder."""
    try:
        from safeckpt.storage.local import LocalStorage, OSFileSystem
    except ImportError:
        return
    real_write = LocalStorage.write_file

    def write_file(self: Any, name: str, parts: Any) -> int:
        label = "data file written (with its fsyncs)" if name.startswith("data-") else "manifest written (with its fsyncs)"
        return timed(times, label, lambda: real_write(self, name, parts))()

    LocalStorage.write_file = write_file  # type: ignore[method-assign]
    real = OSFileSystem.fsync

    def fsync(self: Any, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        name = os.path.basename(path)
        label = ("  fsync of a folder" if os.path.isdir(path) else "  fsync of a data file" if name.startswith("data-")
                 else "  fsync of a manifest" if name.startswith("manifest-") else "  fsync of another file")
        timed(times, label, lambda: real(self, fd))()

    OSFileSystem.fsync = fsync  # type: ignore[method-assign]


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


def interleaved(tools: dict[str, Callable[[int], Any]], repeats: int, cold: bool, times: Times,
                clean: Callable[[], Any]) -> dict[str, list[tuple[float, float]]]:
    """Run every tool once per repeat, in an order rotating from repeat to repeat (the
    page cache dropped before each when ``cold``, what it wrote removed after it,
    outside the timing); repeat 0 is a warm-up, its phases dropped."""
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in tools}
    names = list(tools)
    for r in range(repeats + 1):
        if r == 1:
            times.clear()
        for name in names[r % len(names):] + names[:r % len(names)]:
            if cold:
                drop_page_cache()
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            tools[name](r)
            if r:
                out[name].append((time.perf_counter() - t0, time.process_time() - c0))
            clean()
            os.sync()
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state", choices=["small", "large"], default="small")
    p.add_argument("--n-small", type=int, default=20000)
    p.add_argument("--small-kib", type=int, default=8)
    p.add_argument("--size-mib", type=int, default=1024, help="--state large: its size")
    p.add_argument("--n-large", type=int, default=48, help="--state large: its number of tensors")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each save (always for large)")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: the current folder)")
    args = p.parse_args()
    import safeckpt
    from safeckpt.protocol.checkpoint import save_request
    from safeckpt.run.asyncsave import AsyncSaver
    from safetensors.torch import save_file

    large = args.state == "large"
    state = make_large_state(args.size_mib, args.n_large) if large else make_small_state(args.n_small, args.small_kib)
    tensors = flatten(state)
    n, nbytes = len(tensors), state_nbytes(state)
    work = Path(tempfile.mkdtemp(prefix=".safeckpt-phases-", dir=(args.dir or default_dir()).resolve()))
    times: Times = {}
    instrument(times)
    instrument_storage(times)
    try:
        src = raw_src_buffer()

        def done(path: Path) -> None:
            shutil.rmtree(path) if path.is_dir() else os.remove(path)

        def raw(r: int) -> None:
            write_fsync(work / f"raw{r}", nbytes, src)

        def torch_save(r: int) -> None:
            torch.save(state, work / f"t{r}.pt")
            fsynced(work / f"t{r}.pt")

        def st_save(r: int) -> None:
            save_file(tensors, work / f"s{r}.safetensors")
            fsynced(work / f"s{r}.safetensors")

        def save(r: int) -> None:
            safeckpt.save(state, work / f"c{r}")

        refs = {"raw fsync'd write": raw, "safetensors save_file + fsync": st_save, "torch.save + fsync": torch_save,
                "safeckpt.save": save}
        if large:
            del refs["torch.save + fsync"]  # torch.save's zip writer: not a reference for the disk's speed
        runs = interleaved(refs, args.repeat, large or args.cold, times, lambda: [done(q) for q in work.iterdir()])
        for path in list(work.iterdir()):
            done(path)
        save_phases = {k: median(v) for k, v in times.items()}
        times.clear()

        pairs = [(torch.empty_like(t), t) for t in tensors.values()]
        saver = AsyncSaver()
        blocked: list[tuple[float, float]] = []
        copies: list[tuple[float, float]] = []

        def memcopy() -> tuple[float, float]:
            t0, c0 = time.perf_counter(), time.process_time()
            for d, s in pairs:
                d.copy_(s)
            return time.perf_counter() - t0, time.process_time() - c0

        def async_save(r: int) -> None:
            request = save_request(work / f"a{r}")
            before = memcopy()
            t0, c0 = time.perf_counter(), time.process_time()
            future = saver.submit(state, request)
            blocked.append((time.perf_counter() - t0, time.process_time() - c0))
            after = memcopy()
            copies.append(((before[0] + after[0]) / 2, (before[1] + after[1]) / 2))
            future.result()
            saver.wait()
            shutil.rmtree(work / f"a{r}")
        repeat(async_save, args.repeat, times)
        saver.close()
        pairs.clear()
        async_phases = {k: median(v) for k, v in times.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mine = runs["safeckpt.save"]
    save_wall, save_cpu = median(mine)
    print(f"{n:,} tensors, {nbytes / 2**20:.0f} MiB, {args.repeat} interleaved repeats"
          f"{' (page cache dropped before each)' if large or args.cold else ''}; medians, wall ms / CPU ms")
    for name, values in runs.items():
        w, c = median(values)
        ratio = "" if name == "safeckpt.save" else \
            f"   {name} ÷ safeckpt.save per repeat: {spread([a[0] / b[0] for a, b in zip(values, mine)])}"
        print(f"  {name:34s} {w * 1e3:8.1f} {c * 1e3:8.1f}{ratio}")
    print(f"safeckpt.save {save_wall / n * 1e6:.1f} us/tensor wall, {save_cpu / n * 1e6:.1f} us/tensor CPU; phases:")
    for label, (w, c) in save_phases.items():
        print(f"  {label:44s} {w * 1e3:8.1f} {c * 1e3:8.1f}")
    b_wall, b_cpu = median(blocked[1:])
    pairs_x = [(b[0] / m[0], b[1] / m[1]) for b, m in zip(blocked[1:], copies[1:])]
    print(f"async_save, caller blocked {b_wall * 1e3:8.1f} {b_cpu * 1e3:8.1f}   × the memcopies around it, per repeat: "
          f"wall {spread([x for x, _ in pairs_x])}, CPU {spread([y for _, y in pairs_x])}")
    for label, (w, c) in async_phases.items():
        if label.startswith("async caller") or label in ("flatten", "staging copy + small checksums"):
            print(f"  {label:44s} {w * 1e3:8.1f} {c * 1e3:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
