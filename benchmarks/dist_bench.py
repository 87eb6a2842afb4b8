#!/usr/bin/env python
"""Distributed save/load over gloo: 1, 2, 4 ranks (real processes) on one local disk.

Every rank holds a row-``Shard`` of each of the ~50 large matrices, so the total state
is the same for every world size and the aggregate GB/s compare. Per world size and
repeat, rank 0 times (barrier, op on every rank, barrier):
* raw write+fsync: every rank writes its share of the bytes to its own file (os.write
  of 64 MiB buffers, os.fsync) -- the limit of the disk under N writers;
* raw read: every rank reads its file back into a preallocated buffer;
* ``safeckpt.save`` of ``{"model": {name: Shard(...)}}`` and ``safeckpt.load`` into
  preallocated shards;
* ``dcp.save`` / ``dcp.load`` of the same data as ``DTensor`` row shards on a CPU
  device mesh (so every rank writes its own piece, as with FSDP/TP states).
The page cache is dropped before each load when permitted. Loads are checked against
the saved data outside the timing.

Standalone: ``python benchmarks/dist_bench.py [--quick] [--ranks 1,2,4]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (bench_parser, MiB, drop_page_cache, large_rows, launch_ranks, parse_or_work,  # noqa: E402
                    raw_src_buffer, read_into, remove, run_and_report, summary, write_fsync)

OPS = ["raw write+fsync", "raw read", "safeckpt.save", "safeckpt.load (in place)", "dcp.save",
       "dcp.load (in place)"]


# ----------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import safeckpt
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard

    rows = large_rows(args.size_mib, args.n_large, multiple=world)  # even row shards
    local_rows = rows // world
    g = torch.Generator().manual_seed(1000 + rank)
    local = {f"w{i:03d}": torch.randn(local_rows, 4096, generator=g) for i in range(args.n_large)}
    dest = {k: torch.zeros_like(t) for k, t in local.items()}
    offsets = (rank * local_rows, 0)
    sk_state = {"model": {k: safeckpt.Shard(t, (rows, 4096), offsets) for k, t in local.items()}}
    sk_dest = {"model": {k: safeckpt.Shard(t, (rows, 4096), offsets) for k, t in dest.items()}}
    mesh = init_device_mesh("cpu", (world,))

    def dt(t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t, mesh, [DShard(0)], run_check=False, shape=torch.Size((rows, 4096)),
                                  stride=(4096, 1))

    dcp_state = {"model": {k: dt(t) for k, t in local.items()}}
    dcp_dest = {"model": {k: dt(t) for k, t in dest.items()}}
    my_bytes = sum(t.nbytes for t in local.values())
    src = raw_src_buffer()
    buf = np.zeros(my_bytes, dtype=np.uint8)
    work = Path(args.dir)

    def check() -> None:
        for k, t in local.items():
            if not torch.equal(t, dest[k]):
                raise AssertionError(f"rank {rank}: {k} differs after load")

    def zero() -> None:
        for t in dest.values():
            t.zero_()

    def raw_w(r: int) -> None:
        write_fsync(work / f"raw-{r}-rank{rank}.bin", my_bytes, src)

    def raw_r(r: int) -> None:
        read_into(work / f"raw-{r}-rank{rank}.bin", buf, my_bytes)

    ops = {
        "raw write+fsync": (raw_w, None),
        "raw read": (raw_r, None),
        "safeckpt.save": (lambda r: safeckpt.save(sk_state, str(work / f"sk-{r}")), None),
        "safeckpt.load (in place)": (lambda r: safeckpt.load(sk_dest, str(work / f"sk-{r}")), check),
        "dcp.save": (lambda r: dcp.save(dcp_state, checkpoint_id=str(work / f"dcp-{r}")), None),
        "dcp.load (in place)": (lambda r: dcp.load(dcp_dest, checkpoint_id=str(work / f"dcp-{r}")), check),
    }
    times: dict[str, list[float]] = {op: [] for op in OPS}
    errors: dict[str, str] = {}
    for r in range(args.repeat):
        for op in OPS:
            fn, verify = ops[op]
            if op in errors:
                continue
            if "load" in op or "read" in op:
                zero()
                if rank == 0:
                    drop_page_cache()
            elif rank == 0:
                os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            err = None
            try:
                fn(r)
            except Exception as e:  # every rank must still reach the barrier
                err = f"rank {rank}: {type(e).__name__}: {e}"
                traceback.print_exc()
            dist.barrier()
            dt_s = time.perf_counter() - t0
            if err is None and verify is not None:
                try:
                    verify()
                except AssertionError as e:
                    err = str(e)
            errs = [None] * world
            dist.all_gather_object(errs, err)
            bad = [e for e in errs if e]
            if bad:
                errors[op] = "; ".join(bad)
            else:
                times[op].append(dt_s)
        dist.barrier()
        if rank == 0:
            for p in work.iterdir():
                if p.name.endswith(f"-{r}") or f"-{r}-rank" in p.name:
                    remove(p)
        dist.barrier()
    if rank == 0:
        total = sum(t.nbytes for t in local.values()) * world
        out = {"world": world, "bytes": total, "rows": rows, "ops": {}, "errors": errors}
        for op, ts in times.items():
            if ts:
                out["ops"][op] = summary(ts)
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def run_world(world: int, size_mib: int, n_large: int, repeat: int, workdir: Path, timeout: float) -> dict:
    args = ["--size-mib", str(size_mib), "--n-large", str(n_large), "--repeat", str(repeat)]
    return launch_ranks(Path(__file__).resolve(), world, args, workdir / f"dist-{world}", timeout)


def run_dist(worlds: list[int], size_mib: int, n_large: int, repeat: int, workdir: Path,
             timeout: float = 600) -> dict:
    res = {}
    for w in worlds:
        print(f"  [dist] {w} rank(s)", file=sys.stderr, flush=True)
        res[str(w)] = run_world(w, size_mib, n_large, repeat, workdir, timeout)
    return res


def dist_table(res: dict) -> str:
    lines = ["### distributed (gloo, real processes, one local disk): aggregate GB/s", "",
             "| ranks | MiB total | op | median s | min–max s | aggregate GB/s | × raw | safeckpt / dcp (time) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for w, r in res.items():
        if "error" in r:
            lines.append(f"| {w} | | ERROR: {r['error'][:200]} | | | | | |")
            continue
        ops = r["ops"]
        for op in OPS:
            if op not in ops:
                if op in r.get("errors", {}):
                    lines.append(f"| {w} | | {op} | ERROR: {r['errors'][op][:200]} | | | | |")
                continue
            s = ops[op]
            raw = ops.get("raw write+fsync" if ("save" in op or "write" in op) else "raw read")
            ratio = f"{raw['median_s'] / s['median_s']:.2f}" if raw else "–"
            peer = {"safeckpt.save": "dcp.save", "safeckpt.load (in place)": "dcp.load (in place)"}.get(op)
            vs = f"{s['median_s'] / ops[peer]['median_s']:.2f}" if peer and peer in ops else ""
            lines.append(f"| {w} | {r['bytes'] / MiB:,.0f} | {op} | {s['median_s']:.3f} | "
                         f"{s['min_s']:.3f}–{s['max_s']:.3f} | {r['bytes'] / s['median_s'] / 1e9:.2f} | {ratio} | {vs} |")
    lines += ["", "× raw = throughput / throughput of the raw write (saves) or raw read (loads) with the same "
              "number of ranks; safeckpt / dcp < 1 means safeckpt is faster.", ""]
    return "\n".join(lines)


def main() -> int:
    p = bench_parser(__doc__, "dist.json", count=("--n-large", 50))
    p.add_argument("--ranks", default="1,2,4")
    args = parse_or_work(p, worker)
    if args is None:
        return 0
    if args.quick:
        args.size_mib, args.repeat = 16, 1
    worlds = [int(x) for x in args.ranks.split(",")]
    return run_and_report(args, lambda workdir: run_dist(worlds, args.size_mib, args.n_large, args.repeat, workdir),
                          dist_table)


if __name__ == "__main__":
    sys.exit(main())
