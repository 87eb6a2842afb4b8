"""How planning scales: rank 0's work for a simulated job of many ranks, in one process.

For R ranks x T tensors (defaults 1,024 x 2,000, i.e. ~2 million pieces) this times
the steps rank 0 runs on the metadata of a save, from what the ranks send it (each rank's
pieces as `pieces.PieceColumns`, its report's written pieces as `commit.Written`, built
untimed as the ranks build them): assigning every piece to a writer
(`plan.assign_writes`), checking that the shards of each tensor tile it
(`plan.check_shards`, vectorized in `plan.check_tilings`), building the format-3 tensor
table from the ranks' reports (`commit.SaveRun._add_pieces` into a `compact.TableBuilder`)
and encoding the manifest. It also shows (not in rank 0's sum) what unpickling the
gathered intents and reports costs rank 0. Then one
rank's side of a load: decoding and checking that manifest, and planning its load (the
chunks that meet its box of every tensor, `TableEntry.meeting`). It also times the
replicated case (DDP: every rank holds every tensor, each written once in total) and,
with --scale, the same at 8,192 ranks to show the growth. With --repeated, rank 0's work
on the first save of a layout and on the next save of the same layout, which reuses the
kept plan (``protocol/plancache.py``): the ranks' plan ids compared, the kept table
refilled with the new byte ranges and checksums, the manifest encoded.

    python benchmarks/planner.py [--ranks 1024] [--tensors 2000] [--scale 8192 [--scale-tensors 250]] [--repeated]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import pickle
import time

from safeckpt.format.checksum import checksum
from safeckpt.protocol.commit import Assignment, Intent, Report, SaveRun
from safeckpt.protocol.group import SingleGroup
from safeckpt.protocol.plancache import Planned, Probe, layout_key, tree_digest
from safeckpt.protocol.state import FlatState
from safeckpt.testing import MemoryObjectStore
from safeckpt.protocol.datafile import WrittenPiece
from safeckpt.format.compact import TableBuilder
from safeckpt.format.manifest import FileEntry, Manifest, decode_manifest, encode_manifest
from safeckpt.format.pieces import PieceColumns
from safeckpt.format.plan import PieceInfo, WritePlan, assign_writes, check_shards


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


def intents_for(per_rank: list[list[PieceInfo]]) -> list[Intent]:
    """What the ranks send rank 0 before writing (input, not timed): their pieces as columns."""
    return [Intent("url", None, PieceColumns.of(pieces), {}, {}) for pieces in per_rank]


def reports_for(plan: WritePlan, save: int = 0) -> list[Report]:
    """What the ranks send rank 0 after writing (input, not timed): each rank's report
    (data file, every piece's byte range and checksum), compacted as a rank sends it;
    ``save``: which save of the layout (other checksums and file names, same ranges)."""
    reports = []
    n = save << 40
    for rank in range(len(plan.at) - 1):
        sizes = plan.pieces.nbytes[plan.rows[plan.at[rank]:plan.at[rank + 1]]].tolist()
        if not sizes:
            reports.append(Report())
            continue
        name = f"data-0123456789abcdef{save:04d}-r{rank:05d}.safetensors"
        starts = list(itertools.accumulate(sizes, initial=64))
        written = [WrittenPiece(p, a, b, [f"xxh3_64:{n + i:016x}"])
                   for i, (p, a, b) in enumerate(zip(plan.names(rank), starts, starts[1:]))]
        n += len(sizes)
        reports.append(Report(FileEntry(name, starts[-1], rank, 64, checksum(name.encode())), written).compact())
    return reports


def manifest_for(plan: WritePlan, reports: list[Report]) -> Manifest:
    """What rank 0 builds from the reports: ``SaveRun._add_pieces`` into a tensor table."""
    files = {rep.file.name: rep.file for rep in reports if rep.file is not None}
    table = TableBuilder()
    SaveRun._add_pieces(plan, reports, table)
    return Manifest("0123456789abcdef0000", 1, time.time(), len(reports), files, table.build(list(files), 1 << 24),
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
        print(f"  {label:<46} {time.perf_counter() - wall:7.2f} s wall {used:7.2f} s CPU")
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
    intents = timed("describe pieces (input)", lambda: intents_for(make(ranks, tensors)), quiet)
    rank0: list[float] = []
    plan = timed("assign writers", lambda: assign_writes([i.pieces for i in intents]), quiet, rank0)
    timed("check shard coverage", lambda: check_shards(plan), quiet, rank0)
    reports = reports_for(plan)  # the ranks' reports: input, like the pieces
    sent = [pickle.dumps(x) for x in intents + reports]
    timed("(receive: unpickle what the ranks sent)", lambda: list(map(pickle.loads, sent)), quiet)
    manifest = timed("build tensor table", lambda: manifest_for(plan, reports), quiet, rank0)
    data = timed("encode manifest", lambda: encode_manifest(manifest), quiet, rank0)
    one: list[float] = []
    decoded = timed("decode + check (coverage) manifest", lambda: decode_manifest(data, "manifest"), quiet, one)
    chunks = timed("plan one rank's load", lambda: plan_load(decoded, ranks // 2, ranks), quiet, one)
    rank0_s, load = sum(rank0), sum(one)
    pieces = len(plan.rows)
    if not quiet:
        print(f"  {'rank 0: plan + build + encode':<40} {rank0_s:7.2f} s CPU   manifest {len(data) / 2**20:.1f} MiB"
              f" ({len(data) / pieces:.1f} B/piece), {pieces} pieces written (of {len(plan.pieces)} held)")
        print(f"  {'one rank: decode + plan its load':<40} {load:7.2f} s CPU   {chunks} chunks to read")
    return {"rank0": rank0_s, "load": load, "mib": len(data) / 2**20, "pieces": pieces}


def saver(plan: WritePlan | None = None) -> SaveRun:
    """Rank 0's side of a save (its group and folder are never used here)."""
    run = SaveRun(SingleGroup(), MemoryObjectStore(), overwrite=True, step=None, metadata={}, metrics={},
                  new_save_id=lambda: "0123456789abcdef0000", existing=lambda storage: (None, 0))
    run.tree, run.plan = {}, plan
    return run


def repeated(kind: str, make, ranks: int, tensors: int) -> dict:
    """Rank 0's work for the first save of a layout and for the next save of the same
    layout (``plancache``): the first gathers every rank's pieces, plans and builds the
    table (and keeps them); the next compares the ranks' plan ids and refills the kept
    table with the new byte ranges and checksums. Also one rank's own share of the
    next save: the digest of its layout."""
    print(f"{kind}, saved again and again: {ranks} ranks x {tensors} tensors")
    intents = timed("describe pieces (input)", lambda: intents_for(make(ranks, tensors)))
    first: list[float] = []
    plan = timed("first save: assign writers", lambda: assign_writes([i.pieces for i in intents]), spent=first)
    timed("first save: check shard coverage", lambda: check_shards(plan), spent=first)
    lite = [Intent(i.url, i.step, PieceColumns.of([]), i.aliases, None) for i in intents]
    kept = Planned("plan", plan.names(0), plan, lite)
    run = saver(plan)
    run.kept = kept
    mine = Assignment("0123456789abcdef0000", 1, plan_id="plan")
    reports = reports_for(plan)
    manifest = timed("first save: build tensor table (kept)", lambda: run._build_manifest(lite, reports, mine),
                     spent=first)
    timed("first save: encode manifest", lambda: encode_manifest(manifest), spent=first)
    again: list[float] = []
    later = reports_for(plan, save=1)
    key = timed("next save, every rank: digest of its layout",
                lambda: layout_key("url/step", intents[ranks // 2].pieces, {}, ranks // 2, ranks))
    probes = [Probe("url/step", None, "plan", tree_digest({}), None) for _ in range(ranks)]
    run = saver()
    flat = FlatState({}, {})
    timed("next save: compare the ranks' plan ids", lambda: run._answer(probes, flat, kept), spent=again)
    run.kept = kept
    manifest2 = timed("next save: refill the kept table", lambda: run._build_manifest(lite, later, mine),
                      spent=again)
    data = timed("next save: encode manifest", lambda: encode_manifest(manifest2), spent=again)
    assert decode_manifest(data, "manifest").tensors.digests == manifest2.tensors.digests and key
    print(f"  {'rank 0: first save / next save':<46} {sum(first):7.2f} s / {sum(again):.3f} s CPU "
          f"({sum(again) / sum(first):.3f}x)")
    return {"first": sum(first), "next": sum(again), "ratio": sum(again) / sum(first)}


def main() -> None:
    gc.disable()  # as safeckpt.save does: millions of small objects would trigger collections
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--scale", type=int, default=0, help="also simulate up to this many ranks (e.g. 8192), sharded")
    ap.add_argument("--scale-tensors", type=int, default=250, help="tensors per rank in the growth runs")
    ap.add_argument("--repeated", action="store_true", help="also rank 0's work on a save of an unchanged layout")
    args = ap.parse_args()
    for kind, make in (("sharded", sharded), ("replicated", replicated)):
        measure(kind, make, args.ranks, args.tensors)
    if args.repeated:
        for kind, make in (("sharded", sharded), ("replicated", replicated)):
            gc.collect()
            repeated(kind, make, args.ranks, args.tensors)
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
