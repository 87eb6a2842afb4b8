"""Planning as pure functions: who writes what on save, which bytes to read on load.

Everything here is linear in ranks x tensors and testable without torch.distributed.
A *box* is ``(offsets, shape)`` in the index space of a global tensor.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

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
    holders: dict[tuple, list] = {}  # distinct box -> [its first piece, the ranks that hold it...]
    meta: dict[str, PieceInfo] = {}
    out: list[list[PieceInfo]] = [[] for _ in pieces_by_rank]
    load = [0] * len(pieces_by_rank)
    for rank, pieces in enumerate(pieces_by_rank):
        for p in pieces:  # the hot loop of a large job: a few dict operations per piece
            seen = meta.get(p.name)
            if seen is None:
                meta[p.name] = seen = p
            elif seen.global_shape != p.global_shape or seen.kind != p.kind or seen.dtype != p.dtype:
                raise PlanError(
                    f"tensor {p.name!r}: rank {rank} has {p.kind} {p.dtype} {list(p.global_shape)}, "
                    f"another rank {seen.kind} {seen.dtype} {list(seen.global_shape)}")
            if p.kind == "local":
                out[rank].append(p)
                load[rank] += p.nbytes
                continue
            key = (p.name, p.offsets, p.shape)
            held = holders.get(key)
            if held is None:
                holders[key] = [p, rank]
            else:
                held.append(rank)
    _check_replicated(meta, holders, len(pieces_by_rank))
    contested = []
    for key, held in holders.items():
        if len(held) == 2:  # a shard only one rank holds: it writes it
            out[held[1]].append(held[0])
            load[held[1]] += held[0].nbytes
        else:
            contested.append(key)
    for key in sorted(contested, key=lambda k: (-holders[k][0].nbytes, k)):
        p, *ranks = holders[key]
        rank = min(ranks, key=lambda r: (load[r], r))
        out[rank].append(p)
        load[rank] += p.nbytes
    return out


def _check_replicated(meta: dict[str, PieceInfo], holders: dict[tuple, list], world: int) -> None:
    for (name, _, _), held in holders.items():
        if len(held) != world + 1 and meta[name].kind == "replicated":
            missing = sorted(set(range(world)) - set(held[1:]))
            raise PlanError(f"tensor {name!r} is a plain (replicated) tensor on some ranks but "
                            f"missing on rank(s) {missing}; wrap per-rank tensors in safeckpt.RankLocal")


def check_coverage(name: str, global_shape: tuple[int, ...], boxes: list[Box]) -> None:
    """The saved boxes of a tensor must tile it exactly: no gaps, no overlaps. Bounded
    by ``TILING_WORK`` steps per box and dimension, whatever the boxes (a crafted
    manifest cannot make it slow or large); see ``_tiling_defect``."""
    total = sum(volume(s) for _, s in boxes)
    if total != volume(global_shape):
        raise PlanError(f"tensor {name!r}: the pieces cover {total} of {volume(global_shape)} "
                        "elements; every element must be held by exactly one box")
    corner = _tiling_defect(tuple(global_shape), boxes)
    if corner is not None:
        raise PlanError(f"tensor {name!r}: pieces overlap (and leave a gap as large) near {list(corner)}")


def check_tilings(names: list[str], shapes: list[tuple[int, ...]], tensor: np.ndarray, offsets: np.ndarray,
                  extents: np.ndarray) -> None:
    """``check_coverage`` for many tensors of one rank (number of dimensions) at once:
    row ``j`` of the ``(n, ndim)`` int64 arrays ``offsets``/``extents`` is a box of tensor
    ``tensor[j]`` (an index into ``names``/``shapes``). Boxes inside the tensors, volumes
    and grids (the layout of every sharding) are checked with numpy; a tensor whose boxes
    are no grid goes through ``check_coverage``."""
    n = len(names)
    bound = np.asarray(shapes, dtype=np.int64).reshape(n, offsets.shape[1])[tensor]
    outside = np.flatnonzero(((offsets < 0) | (extents < 0) | (offsets > bound) | (extents > bound - offsets)).any(axis=1))
    if outside.size:
        i = int(tensor[outside[0]])
        raise PlanError(f"tensor {names[i]!r}: a piece lies outside the tensor's shape {list(shapes[i])}")
    volumes = np.prod(extents, axis=1)  # each inside its tensor: no overflow
    want = np.asarray([volume(s) for s in shapes], dtype=np.float64)
    exact = np.zeros(n, dtype=np.int64)  # int64 sums; the float64 ones rule out wrap-around
    np.add.at(exact, tensor, volumes)
    approx = np.bincount(tensor, weights=volumes.astype(np.float64), minlength=n)
    grid = grid_tensors(tensor, offsets, extents, n, bound)
    for i in np.flatnonzero((approx != want) | (exact != want.astype(np.int64)) | ~grid).tolist():
        rows = tensor == i
        check_coverage(names[i], shapes[i], list(zip(map(tuple, offsets[rows].tolist()),
                                                     map(tuple, extents[rows].tolist()))))


def grid_tensors(tensor: np.ndarray, offsets: np.ndarray, extents: np.ndarray, n: int,
                 bound: np.ndarray | None = None) -> np.ndarray:
    """For each of ``n`` tensors, whether its non-empty boxes (the rows of ``offsets`` and
    ``extents`` whose ``tensor`` is its index) are distinct cells of one grid with as many
    cells as boxes: if their volumes add up to the tensor's and every box lies inside
    it, they then tile it exactly. Vectorized over every tensor at once; a dimension that
    every box spans whole (``bound``: each row's tensor shape) needs no sort."""
    keep = (extents > 0).all(axis=1)
    t, off, ext = tensor[keep], offsets[keep], extents[keep]
    count = np.bincount(t, minlength=n)
    ok = np.ones(n, dtype=bool)
    cells = np.ones(n, dtype=np.float64)
    cell = np.zeros(len(t), dtype=np.int64)
    both = np.concatenate((t, t))
    for d in range(off.shape[1]):
        if bound is not None and not off[:, d].any() and (ext[:, d] == bound[keep, d]).all():
            continue  # one interval: every box is cell 0 of this dimension
        local, distinct = _ranks(both, np.concatenate((off[:, d], off[:, d] + ext[:, d])), n)
        lo, hi = local[:len(t)], local[len(t):]
        ok[t[hi - lo != 1]] = False
        intervals = np.maximum(distinct - 1, 1)
        cells *= intervals
        cell = cell * intervals[t] + lo  # wraps only where cells exceed the count (refused)
    ok &= cells == count
    rows = ok[t]  # there cell < count <= len(t): (tensor, cell) is one int64 key
    top = int(count.max()) + 1 if len(t) else 1
    keys = np.sort(t[rows] * top + cell[rows])
    ok[keys[1:][keys[1:] == keys[:-1]] // top] = False
    return ok | (count == 0)


def _ranks(tensor: np.ndarray, values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each value's rank among the distinct values of its tensor, and how many distinct
    values each of the ``n`` tensors has: one sort of a combined key where it fits."""
    top = int(values.max()) + 1 if len(values) else 1
    if n * top < 2**62:
        distinct, rank = np.unique(tensor * top + values, return_inverse=True)
        owner = distinct // top
        first = np.searchsorted(owner, np.arange(n))
        return rank.reshape(-1) - first[tensor], np.bincount(owner, minlength=n)
    order = np.lexsort((values, tensor))
    ts, vs = tensor[order], values[order]
    new = np.ones(len(ts), dtype=bool)
    new[1:] = (ts[1:] != ts[:-1]) | (vs[1:] != vs[:-1])
    rank = np.cumsum(new) - 1
    starts = np.ones(len(ts), dtype=bool)
    starts[1:] = ts[1:] != ts[:-1]
    local = np.empty(len(ts), dtype=np.int64)
    local[order] = rank - np.maximum.accumulate(np.where(starts, rank, 0))
    return local, np.bincount(ts[new], minlength=n)


TILING_WORK = 64  # steps per box and dimension: grids need about 2, random guillotine cuts in 6-d under 10


def _tiling_defect(global_shape: tuple[int, ...], boxes: list[Box]) -> tuple[int, ...] | None:
    """A point near which the boxes do not tile the tensor exactly, or None.

    The boxes tile the tensor exactly when the sum of their indicator functions equals
    the tensor's. Taking differences along one dimension turns each box into a start and
    an end at two coordinates, each holding the box's cross-section: the sums are equal
    when, at every coordinate, the cross-sections starting there cancel those ending
    there (identical boxes of opposite sign cancel at once, which makes grids, row and
    column strips linear), and a sum already checked (or its negation, as the two ends of
    a slab give) is not checked again. Repeated over every dimension, what is left is a
    signed count per point; any point not cancelled is a defect. Dimensions every box
    spans whole are skipped; the work is capped at ``TILING_WORK`` steps per box and
    dimension."""
    dims = [d for d, g in enumerate(global_shape)
            if any(o[d] != 0 or s[d] != g for o, s in boxes)]
    ndim = len(dims)
    whole = (tuple(0 for _ in dims), tuple(global_shape[d] for d in dims))
    start: dict[Box, int] = {whole: -1}
    for o, s in boxes:
        if volume(s):  # an empty box holds nothing
            key = (tuple(o[d] for d in dims), tuple(s[d] for d in dims))
            _add(start, key, 1)
    budget = TILING_WORK * (len(boxes) + 1) * max(ndim, 1)
    level: list[tuple[tuple[int, ...], dict[Box, int]]] = [((), start)] if start else []
    for _ in range(ndim):
        nxt: list[tuple[tuple[int, ...], dict[Box, int]]] = []
        seen: set[frozenset] = set()  # a sum and its negation need checking once
        for prefix, items in level:
            budget -= 2 * len(items)
            if budget < 0:
                raise PlanError(f"the layout of its {len(boxes)} pieces is too irregular to check "
                                "(a grid, row or column split of the tensor always is)")
            groups: dict[int, dict[Box, int]] = {}
            for (o, s), count in items.items():
                rest = (o[1:], s[1:])
                _add(groups.setdefault(o[0], {}), rest, count)
                _add(groups.setdefault(o[0] + s[0], {}), rest, -count)
            for x, g in groups.items():
                if g and (form := _canonical(g)) not in seen:
                    seen.add(form)
                    nxt.append((prefix + (x,), g))
        level = nxt
    if not level:
        return None
    point = dict(zip(dims, level[0][0]))
    return tuple(point.get(d, 0) for d in range(len(global_shape)))


def _canonical(counts: dict[Box, int]) -> frozenset:
    """The same for a signed sum of boxes and its negation."""
    sign = 1 if counts[min(counts)] > 0 else -1
    return frozenset((k, v * sign) for k, v in counts.items())


def _add(counts: dict, key: Box, value: int) -> None:
    total = counts.get(key, 0) + value
    if total:
        counts[key] = total
    else:
        del counts[key]
