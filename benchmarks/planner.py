"""How planning scales: rank 0's work for a simulated job of many ranks, in one process.

For R ranks x T tensors (defaults 1,024 x 2,000, i.e. ~2 million pieces) this times
the steps rank 0 runs on the metadata of a save: assigning every piece to a writer
(`plan.assign_writes`), checking that the shards of each tensor tile it
(`plan.check_coverage`), building the manifest and encoding it. It also times the
replicated case (DDP: every rank holds every tensor, each written once in total).
torch.distributed.checkpoint is reported to take minutes here (pytorch #163548);
the target is under 10 s on a 2-core machine.

    python benchmarks/planner.py [--ranks 1024] [--tensors 2000]
"""

from __future__ import annotations

import argparse
import gc
import time

from safeckpt.format.checksum import checksum
from safeckpt.format.manifest import Chunk, FileEntry, Manifest, TensorEntry, encode_manifest
from safeckpt.format.plan import PieceInfo, assign_writes, check_coverage


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


def manifest_for(per_rank: list[list[PieceInfo]]) -> Manifest:
    fake = checksum(b"")
    files, tensors = {}, {}
    for rank, pieces in enumerate(per_rank):
        name = f"data-0123456789abcdef0000-r{rank:05d}.safetensors"
        offset, size = 64, 64 + sum(p.nbytes for p in pieces)
        files[name] = FileEntry(name, size, rank, 64, fake)
        for p in pieces:
            entry = tensors.setdefault(p.name, TensorEntry(p.dtype, list(p.global_shape)))
            entry.chunks.append(Chunk(name, offset, offset + p.nbytes, [fake], list(p.offsets), list(p.shape)))
            offset += p.nbytes
    return Manifest("0123456789abcdef0000", 1, time.time(), len(per_rank), files, tensors, {})


def timed(label: str, fn):
    start = time.perf_counter()
    result = fn()
    print(f"  {label:<34} {time.perf_counter() - start:7.2f} s")
    return result


def measure(kind: str, make, ranks: int, tensors: int) -> None:
    """Time rank 0's planning for one kind of job."""
    print(f"{kind}: {ranks} ranks x {tensors} tensors")
    start = time.perf_counter()
    per_rank = timed("describe pieces (input)", lambda: make(ranks, tensors))
    plan_start = time.perf_counter()
    writes = timed("assign writers", lambda: assign_writes(per_rank))
    if kind == "sharded":
        def coverage() -> None:
            for t in range(tensors):
                boxes = [(p.offsets, p.shape) for p in (per_rank[r][t] for r in range(ranks))]
                check_coverage(per_rank[0][t].name, per_rank[0][t].global_shape, boxes)
        timed("check shard coverage", coverage)
    manifest = timed("build manifest", lambda: manifest_for(writes))
    data = timed("encode manifest", lambda: encode_manifest(manifest))
    total = time.perf_counter() - plan_start
    print(f"  {'planning + manifest (rank 0)':<34} {total:7.2f} s   manifest {len(data) / 2**20:.0f} MiB,"
          f" {sum(map(len, writes))} pieces written (of {sum(map(len, per_rank))} held)")
    print(f"  {'total including input':<34} {time.perf_counter() - start:7.2f} s")


def main() -> None:
    gc.disable()  # as safeckpt.save does: millions of small objects would trigger collections
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=2000)
    args = ap.parse_args()
    for kind, make in (("sharded", sharded), ("replicated", replicated)):
        measure(kind, make, args.ranks, args.tensors)


if __name__ == "__main__":
    main()
