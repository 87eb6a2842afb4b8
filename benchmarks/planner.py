"""How planning scales: rank 0's work for a simulated job of many ranks, in one process.

For R ranks x T tensors (defaults 1,024 x 2,000, i.e. ~2 million pieces) this times
the steps rank 0 runs on the metadata of a save: assigning every piece to a writer
(`plan.assign_writes`), checking that the shards of each tensor tile it
(`commit._check_shards`, vectorized in `plan.check_tilings`), building the format-3 tensor
table from the ranks' reports (`commit.SaveRun._add_pieces` into a `compact.TableBuilder`)
and encoding the manifest. Then one
rank's side of a load: decoding and checking that manifest, and planning its load (the
chunks that meet its box of every tensor, `TableEntry.meeting`). It also times the
replicated case (DDP: every rank holds every tensor, each written once in total) and,
with --scale, the same at 8,192 ranks to show the growth.

    python benchmarks/planner.py [--ranks 1024] [--tensors 2000] [--scale 8192 [--scale-tensors 250]]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import time

from safeckpt.format.checksum import checksum
from safeckpt.protocol.commit import Intent, Report, SaveRun, _check_shards
from safeckpt.protocol.datafile import WrittenPiece
from safeckpt.format.compact import TableBuilder
from safeckpt.format.manifest import FileEntry, Manifest, decode_manifest, encode_manifest
from safeckpt.format.plan import PieceInfo, assign_writes


def sharded(ranks: int, tensors: int) -> list[list[PieceInfo]]:
    """Every tensor row-sharded over all ranks (FSDP-like)."""
    rows = ranks * 4
    return [[PieceInfo(f"layer{t}.weight", "shard", "float32", (rows, 256), (r * 4, 0), (4, 256), 4 * 256 * 4)
             for t in range(tensors)] for r in range(ranks)]


def replicated(ranks: int, tensors: int) -> list[list[PieceInfo]]:
    """Every rank holds every tensor (DDP-like)."""
    pieces = [PieceInfo(f"layer{t}.weight", "replicated", "float32", (256, 256), (0, 0), (256, 256), 256 * 256 * 4)
              for t in range(tensors)]
    return [list(pieces) for _ in range(ranks)]


def reports_for(per_rank: list[list[PieceInfo]]) -> tuple[list[Intent], list[Report]]:
    """What the ranks send rank 0 after writing (input, not timed): each rank's assigned
    pieces and its report (data file, every piece's byte range and checksum)."""
    intents, reports = [], []
    n = 0
    for rank, pieces in enumerate(per_rank):
        name = f"data-0123456789abcdef0000-r{rank:05d}.safetensors"
        starts = list(itertools.accumulate((p.nbytes for p in pieces), initial=64))
        written = [WrittenPiece(p.name, a, b, [f"xxh3_64:{n + i:016x}"])
                   for i, (p, a, b) in enumerate(zip(pieces, starts, starts[1:]))]
        n += len(pieces)
        intents.append(Intent("url", None, pieces, {}, {}))
        reports.append(Report(FileEntry(name, starts[-1], rank, 64, checksum(name.encode())), written))
    return intents, reports


def manifest_for(intents: list[Intent], reports: list[Report]) -> Manifest:
    """What rank 0 builds from the reports: ``SaveRun._add_pieces`` into a tensor table."""
    files = {rep.file.name: rep.file for rep in reports if rep.file is not None}
    table = TableBuilder()
    SaveRun._add_pieces(intents, reports, table)
    return Manifest("0123456789abcdef0000", 1, time.time(), len(intents), files, table.build(list(files), 1 << 24),
                    {}, version=3)


def timed(label: str, fn, quiet: bool = False, spent: list | None = None):
    """Run ``fn``, printing its wall and CPU seconds (CPU time: this process's own work,
    which other jobs on a shared machine inflate far less than the wall clock); the CPU
    seconds are appended to ``spent``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    used = time.process_time() - cpu
    if spent is not None:
        spent.append(used)
    if not quiet:
        print(f"  {label:<40} {time.perf_counter() - wall:7.2f} s wall {used:7.2f} s CPU")
    return result


def plan_load(manifest: Manifest, rank: int, ranks: int) -> int:
    """One rank of the same layout plans its load: the chunks that meet its rows."""
    n = 0
    for entry in manifest.tensors.values():
        shape = entry.shape
        rows = shape[0] // ranks if shape[0] >= ranks else shape[0]
        lo = rank * rows if shape[0] >= ranks else 0
        n += len(entry.meeting(((lo,) + (0,) * (len(shape) - 1), (rows,) + tuple(shape[1:]))))
    return n


def measure(kind: str, make, ranks: int, tensors: int, quiet: bool = False) -> dict:
    """Time rank 0's planning and one rank's load planning for one kind of job."""
    if not quiet:
        print(f"{kind}: {ranks} ranks x {tensors} tensors")
    per_rank = timed("describe pieces (input)", lambda: make(ranks, tensors), quiet)
    rank0: list[float] = []
    writes = timed("assign writers", lambda: assign_writes(per_rank), quiet, rank0)
    timed("check shard coverage", lambda: _check_shards(writes), quiet, rank0)
    intents, reports = reports_for(writes)  # the ranks' reports: input, like the pieces
    manifest = timed("build tensor table", lambda: manifest_for(intents, reports), quiet, rank0)
    data = timed("encode manifest", lambda: encode_manifest(manifest), quiet, rank0)
    one: list[float] = []
    decoded = timed("decode + check (coverage) manifest", lambda: decode_manifest(data, "manifest"), quiet, one)
    chunks = timed("plan one rank's load", lambda: plan_load(decoded, ranks // 2, ranks), quiet, one)
    rank0_s, load = sum(rank0), sum(one)
    pieces = sum(map(len, writes))
    if not quiet:
        print(f"  {'rank 0: plan + build + encode':<40} {rank0_s:7.2f} s CPU   manifest {len(data) / 2**20:.1f} MiB"
              f" ({len(data) / pieces:.1f} B/piece), {pieces} pieces written (of {sum(map(len, per_rank))} held)")
        print(f"  {'one rank: decode + plan its load':<40} {load:7.2f} s CPU   {chunks} chunks to read")
    return {"rank0": rank0_s, "load": load, "mib": len(data) / 2**20, "pieces": pieces}


def main() -> None:
    gc.disable()  # as safeckpt.save does: millions of small objects would trigger collections
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--scale", type=int, default=0, help="also simulate up to this many ranks (e.g. 8192), sharded")
    ap.add_argument("--scale-tensors", type=int, default=250, help="tensors per rank in the growth runs")
    args = ap.parse_args()
    for kind, make in (("sharded", sharded), ("replicated", replicated)):
        measure(kind, make, args.ranks, args.tensors)
    if args.scale:
        print(f"growth, sharded, {args.scale_tensors} tensors (linear: the time per piece stays flat):")
        ranks = args.ranks
        while ranks <= args.scale:
            gc.collect()
            r = measure("sharded", sharded, ranks, args.scale_tensors, quiet=True)
            print(f"  {ranks:>6} ranks, {r['pieces']:>8} pieces: rank 0 {r['rank0']:6.2f} s CPU"
                  f" ({r['rank0'] / r['pieces'] * 1e6:.2f} us/piece), one rank's load {r['load']:6.2f} s CPU,"
                  f" manifest {r['mib']:6.1f} MiB")
            ranks *= 2


if __name__ == "__main__":
    main()
