#!/usr/bin/env python
"""What safeckpt's checksums cost: the share of a save (and of a load) spent on them.

Per repeat, interleaved so that drift of a shared machine hits both alike:
* ``safeckpt.save`` as shipped, and the same save with the data checksums stubbed out
  (``safeckpt.protocol.datafile.block_checksums`` replaced by a constant; the header and manifest
  checksums stay): the wall-time difference is what the checksums cost the caller;
* ``safeckpt.load`` in place with ``verify=True`` (default) and ``verify=False``, each
  from a cold page cache when it can be dropped;
* xxh3 over the same bytes on one thread, nothing else: the CPU work the checksums
  are, an upper bound of their cost when they overlap with I/O.

Standalone: ``python benchmarks/checksum_bench.py [--quick]``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (bench_parser, MiB, drop_page_cache, empty_like_state, flatten,  # noqa: E402
                    make_large_state, make_small_state, remove, run_and_report, state_nbytes, summary)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def run_checksum_case(case: str, state: dict, repeat: int, workdir: Path) -> dict:
    import safeckpt
    import safeckpt.protocol.datafile as datafile
    from safeckpt.format.checksum import block_checksums

    nbytes = state_nbytes(state)
    dest = empty_like_state(state)
    views = [tensor_bytes(t) for t in flatten(state).values()]
    fake = "xxh3_64:" + "0" * 16

    def no_checksums(data, block_size: int = 16 << 20) -> list[str]:
        n = memoryview(data).nbytes
        return [fake] * max(1, -(-n // block_size))

    times: dict[str, list[float]] = {"save": [], "save without data checksums": [],
                                     "load (verify=True)": [], "load (verify=False)": [], "xxh3 only": []}
    for r in range(repeat):
        for stub in (False, True):
            path = workdir / f"cks-{case}-{r}-{int(stub)}"
            os.sync()
            gc.collect()
            real = datafile.block_checksums
            if stub:
                datafile.block_checksums = no_checksums
            try:
                t0 = time.perf_counter()
                safeckpt.save(state, str(path))
                times["save without data checksums" if stub else "save"].append(time.perf_counter() - t0)
            finally:
                datafile.block_checksums = real
            if not stub:
                for verify in (True, False):
                    for t in flatten(dest).values():
                        t.zero_()
                    drop_page_cache()
                    t0 = time.perf_counter()
                    safeckpt.load(dest, str(path), verify=verify)
                    times[f"load (verify={verify})"].append(time.perf_counter() - t0)
            remove(path)
        t0 = time.perf_counter()
        for v in views:
            block_checksums(v)
        times["xxh3 only"].append(time.perf_counter() - t0)
        print(f"  [checksum {case} r{r + 1}/{repeat}] done", file=sys.stderr, flush=True)
    os.sync()
    out = {"bytes": nbytes, "n_tensors": len(views), "ops": {k: summary(v) for k, v in times.items()}}
    med = {k: statistics.median(v) for k, v in times.items()}
    # per-repeat paired differences, then their median: less noisy than a difference of medians
    save_diff = [a - b for a, b in zip(times["save"], times["save without data checksums"])]
    load_diff = [a - b for a, b in zip(times["load (verify=True)"], times["load (verify=False)"])]
    out["save_share"] = statistics.median(save_diff) / med["save"]
    out["save_share_range"] = [min(save_diff) / med["save"], max(save_diff) / med["save"]]
    out["load_share"] = statistics.median(load_diff) / med["load (verify=True)"]
    out["cpu_share_of_save"] = med["xxh3 only"] / med["save"]
    out["xxh3_gbps"] = nbytes / med["xxh3 only"] / 1e9
    return out


def checksum_table(cases: dict) -> str:
    lines = ["### checksum cost (safeckpt; xxh3-64 per 16 MiB block)", "",
             "| state | MiB | save s | save w/o data checksums s | checksum share of save (min–max) | xxh3 alone s "
             "(GB/s) | xxh3 CPU / save | load verify=True s | verify=False s | verify share of load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in cases.items():
        o = c["ops"]
        lines.append(
            f"| {name} | {c['bytes'] / MiB:,.0f} | {o['save']['median_s']:.3f} | "
            f"{o['save without data checksums']['median_s']:.3f} | {c['save_share']:.1%} "
            f"({c['save_share_range'][0]:.0%}–{c['save_share_range'][1]:.0%}) | "
            f"{o['xxh3 only']['median_s']:.3f} ({c['xxh3_gbps']:.1f}) | {c['cpu_share_of_save']:.1%} | "
            f"{o['load (verify=True)']['median_s']:.3f} | {o['load (verify=False)']['median_s']:.3f} | "
            f"{c['load_share']:.1%} |")
    lines += ["", "checksum share = median over repeats of (time with − time without) / median time with; "
              "negative = below the noise. xxh3 CPU / save = the hashing work alone as a share of the save "
              "(an upper bound: safeckpt hashes large tensors on a helper thread while it writes).", ""]
    return "\n".join(lines)


def main() -> int:
    p = bench_parser(__doc__, "checksum.json")
    args = p.parse_args()
    if args.quick:
        args.size_mib, args.n_small, args.repeat = 32, 1000, 1
    return run_and_report(args, lambda workdir: {
        "large": run_checksum_case("large", make_large_state(args.size_mib, 50), args.repeat, workdir),
        "small": run_checksum_case("small", make_small_state(args.n_small, 8), args.repeat, workdir)}, checksum_table)


if __name__ == "__main__":
    sys.exit(main())
