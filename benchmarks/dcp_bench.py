#!/usr/bin/env python
"""safeckpt.dcp against DCP's FileSystemWriter / FileSystemReader, in the same run.

Real gloo processes (1, 2 ranks by default) on one local disk; for each state and
repeat, rank 0 times (barrier, op on every rank, barrier), the two storage layers in
alternating order:
* ``dcp.save`` into a fresh folder with ``FileSystemWriter`` vs ``safeckpt.dcp.Writer``
  (both to durability: FileSystemWriter's default ``sync_files=True`` fsyncs its files);
* ``dcp.load`` in place with ``FileSystemReader`` vs ``safeckpt.dcp.Reader`` (every block
  checksummed), page cache dropped first when permitted;
* ``dcp.async_save``: the time the caller is blocked (staging), over a separate gloo
  group; the save is then waited for outside the timing.
States: ``large``, the ~1 GiB state of ~50 fp32 matrices as DTensor row shards (the
total is the same for every world size); ``small``, 20,000 optimizer-like tensors,
replicated on every rank (DCP writes each once). Loads are checked against the saved
data outside the timing.

``python benchmarks/dcp_bench.py [--quick] [--ranks 1,2] [--size-mib 1024] [--n-small 20000]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MiB, bench_parser, drop_page_cache, flatten, large_rows, launch_ranks,  # noqa: E402
                    make_small_state, parse_or_work, remove, run_and_report, summary)

LAYERS = ("FileSystem", "safeckpt.dcp")
OPS = ("save", "load (in place)", "async_save blocked")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard

    import safeckpt.dcp

    warnings.filterwarnings("ignore")
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    async_group = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world,))
    rows = large_rows(args.size_mib, args.n_large, multiple=world)
    local_rows = rows // world
    g = torch.Generator().manual_seed(1000 + rank)

    def dt(t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t, mesh, [DShard(0)], run_check=False, shape=torch.Size((rows, 4096)),
                                  stride=(4096, 1))

    large_local = {f"w{i:03d}": torch.randn(local_rows, 4096, generator=g) for i in range(args.n_large)}
    states = {"large": ({"model": {k: dt(t) for k, t in large_local.items()}},
                        {"model": {k: dt(torch.zeros_like(t)) for k, t in large_local.items()}}),
              "small": (make_small_state(args.n_small, 8), make_small_state(args.n_small, 8))}
    work = Path(args.dir)

    def writer(layer: str, path: Path):
        return dcp.FileSystemWriter(str(path)) if layer == "FileSystem" else safeckpt.dcp.Writer(str(path))

    def reader(layer: str, path: Path):
        return dcp.FileSystemReader(str(path)) if layer == "FileSystem" else safeckpt.dcp.Reader(str(path))

    def local_of(obj) -> dict:
        return {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in flatten(obj).items()}

    times: dict = {name: {layer: {op: [] for op in OPS} for layer in LAYERS} for name in states}
    errors: dict = {}
    for r in range(args.repeat):
        for name, (state, dest) in states.items():
            order = LAYERS if r % 2 == 0 else LAYERS[::-1]
            for layer in order:
                folder = work / f"{name}-{layer}-{r}"
                for op in OPS:
                    key = f"{name}/{layer}/{op}"
                    if key in errors:
                        continue
                    if op.startswith("load"):
                        for t in local_of(dest).values():
                            t.zero_()
                        if rank == 0:
                            drop_page_cache()
                    elif rank == 0:
                        os.sync()
                    dist.barrier()
                    t0 = time.perf_counter()
                    err, future = None, None
                    try:
                        if op == "save":
                            dcp.save(state, storage_writer=writer(layer, folder))
                        elif op.startswith("load"):
                            dcp.load(dest, storage_reader=reader(layer, folder))
                        else:
                            future = dcp.async_save(state, storage_writer=writer(layer, Path(f"{folder}-async")),
                                                    process_group=async_group)
                    except BaseException as e:  # noqa: BLE001 - every rank must still reach the barrier
                        err = f"rank {rank}: {type(e).__name__}: {str(e)[:300]}"
                    blocked = time.perf_counter() - t0
                    dist.barrier()
                    elapsed = blocked if future is not None else time.perf_counter() - t0
                    if future is not None:
                        try:
                            future.result()
                        except BaseException as e:  # noqa: BLE001
                            err = f"rank {rank}: async {type(e).__name__}: {str(e)[:300]}"
                    if err is None and op.startswith("load"):
                        want, got = local_of(state), local_of(dest)
                        bad = [k for k in want if not torch.equal(want[k], got[k])]
                        err = f"rank {rank}: {len(bad)} tensors differ after load" if bad else None
                    errs = [None] * world
                    dist.all_gather_object(errs, err)
                    if any(errs):
                        errors[key] = "; ".join(e for e in errs if e)
                    else:
                        times[name][layer][op].append(elapsed)
                dist.barrier()
                if rank == 0:
                    remove(folder)
                    remove(Path(f"{folder}-async"))
                dist.barrier()
    if rank == 0:
        out = {"world": world, "bytes": {"large": sum(t.nbytes for t in large_local.values()) * world,
                                         "small": sum(t.nbytes for t in flatten(states["small"][0]).values())},
               "ops": {n: {layer: {op: summary(ts) for op, ts in ops.items() if ts} for layer, ops in by.items()}
                       for n, by in times.items()}, "errors": errors}
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def table(res: dict) -> str:
    lines = ["### torch.distributed.checkpoint: safeckpt.dcp vs FileSystemWriter/Reader (gloo, one local disk)", "",
             "| ranks | state | MiB | op | FileSystem s | safeckpt.dcp s | safeckpt / FileSystem |",
             "|---:|---|---:|---|---:|---:|---:|"]
    for w, r in res.items():
        if "error" in r:
            lines.append(f"| {w} | | | ERROR: {r['error'][:200]} | | | |")
            continue
        for name, by in r["ops"].items():
            for op in OPS:
                a, b = by["FileSystem"].get(op), by["safeckpt.dcp"].get(op)
                if a is None or b is None:
                    missing = [k for k in r["errors"] if k.startswith(f"{name}/") and k.endswith(op)]
                    lines.append(f"| {w} | {name} | | {op} | ERROR: {'; '.join(r['errors'][k] for k in missing)[:200]} | | |")
                    continue
                lines.append(f"| {w} | {name} | {r['bytes'][name] / MiB:,.0f} | {op} | {a['median_s']:.3f} | "
                             f"{b['median_s']:.3f} | {b['median_s'] / a['median_s']:.2f} |")
    lines += ["", "Medians of the repeats; safeckpt / FileSystem < 1 means safeckpt.dcp is faster.", ""]
    return "\n".join(lines)


def run_dcp(worlds: list[int], size_mib: int, n_large: int, n_small: int, repeat: int, workdir: Path,
            timeout: float = 1800) -> dict:
    """Every world size in its own set of processes; ``{world: rank 0's results}``."""
    res = {}
    for w in worlds:
        print(f"  [dcp] {w} rank(s)", file=sys.stderr, flush=True)
        extra = ["--size-mib", str(size_mib), "--n-large", str(n_large), "--n-small", str(n_small),
                 "--repeat", str(repeat)]
        res[str(w)] = launch_ranks(Path(__file__).resolve(), w, extra, workdir / f"dcp-{w}", timeout=timeout)
    return res


def main() -> int:
    p = bench_parser(__doc__, "dcp.json")
    p.add_argument("--n-large", type=int, default=50)
    p.add_argument("--ranks", default="1,2")
    args = parse_or_work(p, worker)
    if args is None:
        return 0
    if args.quick:
        args.size_mib, args.n_small, args.repeat = 16, 2000, 1
    worlds = [int(x) for x in args.ranks.split(",")]
    return run_and_report(args, lambda workdir: run_dcp(worlds, args.size_mib, args.n_large, args.n_small,
                                                        args.repeat, workdir), table)


if __name__ == "__main__":
    sys.exit(main())
