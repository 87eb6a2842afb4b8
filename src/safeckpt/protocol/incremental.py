"""Incremental saves: chunks identified by their content, each written once per run.

A piece larger than the chunk size is cut into boxes that are contiguous runs of its
row-major bytes, at most one chunk size each, so a partly changed tensor rewrites only
the chunks that changed. Every chunk is identified by the xxh3_128 of its bytes. A
chunk that the run's newest committed checkpoint already stores is referenced by the
new manifest (``../step-.../data-....safetensors``) instead of written again, and a
chunk repeated within one save is written once. References always name the file that
holds the bytes, never a chain of references.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Union

import torch

from ..format.checksum import STRONG, checksum
from ..format.manifest import Chunk, FileEntry, Manifest, is_shared
from ..format.plan import Box
from ..format.tensors import byte_view, to_storable

CHUNK_SIZE = 4 << 20  # fine enough that a few changed rows rewrite little; few enough to list
MIN_CHUNK_SIZE = 64  # at least one element of every dtype, so a chunk is one checksum block
HASH_THREADS = 2


class ChunkDigest(NamedTuple):
    """One chunk of a rank's piece: where it sits in the logical tensor, and its hash."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    digest: str


def split_box(shape: tuple[int, ...], itemsize: int, limit: int) -> list[Box]:
    """Boxes (offsets, shape) that tile ``shape`` in row-major order, each a contiguous
    run of at most ``limit`` bytes (or one element, if an element is larger)."""
    n = len(shape)
    total = itemsize
    for d in shape:
        total *= d
    if n == 0 or total <= limit:
        return [((0,) * n, tuple(shape))]
    inner = [itemsize] * n  # bytes of one index step along each dimension
    for d in range(n - 2, -1, -1):
        inner[d] = inner[d + 1] * shape[d + 1]
    axis = next((d for d in range(n) if inner[d] <= limit), n - 1)  # else: one element each
    rows = max(1, limit // inner[axis])
    boxes: list[Box] = []
    for outer in _indices(shape[:axis]):
        for start in range(0, shape[axis], rows):
            boxes.append((outer + (start,) + (0,) * (n - axis - 1),
                          (1,) * axis + (min(rows, shape[axis] - start),) + tuple(shape[axis + 1:])))
    return boxes


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in shape:
        out = [o + (i,) for o in out for i in range(size)]
    return out


def _linear(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    index = 0
    for o, s in zip(offsets, shape):
        index = index * s + o
    return index


def digest_pieces(pieces: list[tuple[str, torch.Tensor, tuple[int, ...]]],
                  chunk_size: int) -> tuple[list[ChunkDigest], list[torch.Tensor]]:
    """Cut each (name, tensor, global offsets of the tensor) into chunks and hash them.

    Returns the digests and, in the same order, each chunk as a contiguous CPU tensor
    view (what gets written if the chunk is new)."""
    digests: list[ChunkDigest] = []
    views: list[torch.Tensor] = []
    for name, tensor, base in pieces:
        storable = to_storable(tensor, name)
        flat = storable.reshape(-1)
        shape = tuple(storable.shape)
        for offsets, box in split_box(shape, storable.element_size(), chunk_size):
            numel = 1
            for d in box:
                numel *= d
            start = _linear(offsets, shape) if numel else 0
            views.append(flat[start:start + numel].view(box))
            digests.append(ChunkDigest(name, tuple(b + o for b, o in zip(base, offsets)), box,
                                       numel * storable.element_size(), ""))
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="safeckpt-hash") as pool:
        hashes = list(pool.map(lambda v: checksum(byte_view(v), STRONG), views))
    return [d._replace(digest=h) for d, h in zip(digests, hashes)], views


@dataclass
class Stored:
    """Where a committed chunk's bytes are, named from the new checkpoint's folder."""

    file: FileEntry
    chunk: Chunk


def reuse_index(base: tuple[str, Manifest] | None, chunk_size: int) -> dict[tuple[str, int], Stored]:
    """(digest, size) -> stored chunk, for the chunks of the checkpoint in sibling folder
    ``base[0]`` that carry a single content hash (chunks of incremental saves) and fit
    in one block of ``chunk_size``."""
    if base is None:
        return {}
    folder, manifest = base
    index: dict[tuple[str, int], Stored] = {}
    for entry in manifest.tensors.values():
        for c in entry.chunks:
            if len(c.checksums) != 1 or not c.checksums[0].startswith(STRONG + ":") \
                    or c.end - c.start > chunk_size:
                continue
            name = c.file if is_shared(c.file) else f"../{folder}/{c.file}"
            f = manifest.files[c.file]
            index[(c.checksums[0], c.end - c.start)] = Stored(
                FileEntry(name, f.size, f.rank, f.header_size, f.header_checksum, f.checksum), c)
    return index


Source = Union[Stored, tuple[int, int]]  # a committed chunk, or (rank, index) written by this save


def plan_reuse(index: dict[tuple[str, int], Stored],
               per_rank: list[list[ChunkDigest]]) -> tuple[list[list[int]], dict[tuple[int, int], Source]]:
    """Which chunks each rank writes, and for every other chunk where its bytes are."""
    writes: list[list[int]] = [[] for _ in per_rank]
    sources: dict[tuple[int, int], Source] = {}
    first: dict[tuple[str, int], tuple[int, int]] = {}
    for rank, digests in enumerate(per_rank):
        for i, d in enumerate(digests):
            key = (d.digest, d.nbytes)
            if key in index:
                sources[(rank, i)] = index[key]
            elif key in first:
                sources[(rank, i)] = first[key]
            else:
                first[key] = (rank, i)
                writes[rank].append(i)
    return writes, sources


def chunk_key(d: ChunkDigest, whole: bool) -> str:
    """The chunk's tensor name in its data file's safetensors header (unique per file)."""
    return d.name if whole else f"{d.name}@{','.join(map(str, d.offsets))}"
