"""Planning as pure functions: who writes what on save, which bytes to read on load.

Everything here is linear in ranks x tensors and testable without torch.distributed.
A *box* is ``(offsets, shape)`` in the index space of a global tensor.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

Box = tuple[tuple[int, ...], tuple[int, ...]]


class PieceInfo(NamedTuple):
    """What one rank holds of one logical tensor (metadata only, never data)."""

    name: str
    kind: str           # "replicated" | "shard" | "local"
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None when they do not meet."""
    offsets, shape = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return tuple(offsets), tuple(shape)


def volume(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def byte_runs(chunk_shape: tuple[int, ...], sub: Box, itemsize: int) -> list[tuple[int, int]]:
    """Contiguous (start, length) byte runs of a sub-box inside a row-major chunk, in
    row-major order of the sub-box. Trailing dimensions the sub-box spans fully merge
    into one run."""
    offsets, shape = sub
    n = len(chunk_shape)
    if n == 0:
        return [(0, itemsize)]
    strides = [1] * n
    for d in range(n - 2, -1, -1):
        strides[d] = strides[d + 1] * chunk_shape[d + 1]
    j = n - 1
    while j > 0 and shape[j] == chunk_shape[j] and offsets[j] == 0:
        j -= 1
    run = shape[j] * strides[j] * itemsize
    base = offsets[j] * strides[j]
    outer = [range(o, o + s) for o, s in zip(offsets[:j], shape[:j])]
    return [((base + sum(i * st for i, st in zip(idx, strides))) * itemsize, run)
            for idx in itertools.product(*outer)]


class PlanError(ValueError):
    """The ranks' pieces are inconsistent (shapes, dtypes, coverage)."""


def assign_writes(pieces_by_rank: list[list[PieceInfo]]) -> list[list[PieceInfo]]:
    """Decide which rank writes each piece: rank-local pieces by their owner, every
    other distinct box exactly once, spread over the ranks that hold it, balanced by
    bytes (largest first onto the least-loaded holder)."""
    if len(pieces_by_rank) == 1:  # one process writes everything it holds
        return [list(pieces_by_rank[0])]
    holders: dict[tuple, list[int]] = {}
    first: dict[tuple, PieceInfo] = {}
    meta: dict[str, PieceInfo] = {}
    out: list[list[PieceInfo]] = [[] for _ in pieces_by_rank]
    load = [0] * len(pieces_by_rank)
    for rank, pieces in enumerate(pieces_by_rank):
        for p in pieces:
            seen = meta.setdefault(p.name, p)
            if (seen.kind, seen.dtype, seen.global_shape) != (p.kind, p.dtype, p.global_shape):
                raise PlanError(
                    f"tensor {p.name!r}: rank {rank} has {p.kind} {p.dtype} {list(p.global_shape)}, "
                    f"another rank {seen.kind} {seen.dtype} {list(seen.global_shape)}")
            if p.kind == "local":
                out[rank].append(p)
                load[rank] += p.nbytes
                continue
            key = (p.name, p.offsets, p.shape)
            holders.setdefault(key, []).append(rank)
            first.setdefault(key, p)
    _check_replicated(meta, holders, len(pieces_by_rank))
    contested = []
    for key, ranks in holders.items():
        if len(ranks) == 1:  # a shard only one rank holds: it writes it
            out[ranks[0]].append(first[key])
            load[ranks[0]] += first[key].nbytes
        else:
            contested.append(key)
    for key in sorted(contested, key=lambda k: (-first[k].nbytes, k)):
        rank = min(holders[key], key=lambda r: (load[r], r))
        out[rank].append(first[key])
        load[rank] += first[key].nbytes
    return out


def _check_replicated(meta: dict[str, PieceInfo], holders: dict[tuple, list[int]], world: int) -> None:
    for (name, _, _), ranks in holders.items():
        if meta[name].kind == "replicated" and len(ranks) != world:
            missing = sorted(set(range(world)) - set(ranks))
            raise PlanError(f"tensor {name!r} is a plain (replicated) tensor on some ranks but "
                            f"missing on rank(s) {missing}; wrap per-rank tensors in safeckpt.RankLocal")


def _row_tiling(global_shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """The common case, checked in linear time: boxes that span every dimension but the
    first and follow each other along it from 0 to the end."""
    rest = tuple(global_shape[1:])
    edge = 0
    for offsets, shape in sorted(boxes):
        if offsets[0] != edge or tuple(shape[1:]) != rest or any(offsets[1:]):
            return False
        edge += shape[0]
    return edge == global_shape[0]


def check_coverage(name: str, global_shape: tuple[int, ...], boxes: list[Box]) -> None:
    """The saved boxes of a tensor must tile it exactly: no gaps, no overlaps."""
    if global_shape and _row_tiling(global_shape, boxes):
        return
    total = sum(volume(s) for _, s in boxes)
    if total != volume(global_shape):
        raise PlanError(f"tensor {name!r}: the pieces cover {total} of {volume(global_shape)} "
                        "elements; every element must be held by exactly one box")
    clash = _grid_overlap([b for b in boxes if volume(b[1])], global_shape)
    if clash is not None:
        raise PlanError(f"tensor {name!r}: pieces at {list(clash[0][0])} and {list(clash[1][0])} overlap")


def _grid_overlap(boxes: list[Box], global_shape: tuple[int, ...]) -> tuple[Box, Box] | None:
    """Two boxes that share an element, or None. The boxes' edges cut the tensor into a
    grid of cells; each box marks the cells it covers (as many cells as boxes for the
    usual grid-shaped shardings, so this is linear in practice)."""
    cuts = [sorted({0, g, *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)})
            for d, g in enumerate(global_shape)]
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    owner: dict[tuple[int, ...], Box] = {}
    for box in boxes:
        offsets, shape = box
        spans = [range(index[d][o], index[d][o + s]) for d, (o, s) in enumerate(zip(offsets, shape))]
        for cell in itertools.product(*spans):
            if cell in owner:
                return owner[cell], box
            owner[cell] = box
    return None
