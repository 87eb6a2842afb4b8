"""Planning as pure functions: who writes what on save, which bytes to read on load.

Everything here is linear in ranks x tensors and testable without torch.distributed.
A *box* is ``(offsets, shape)`` in the index space of a global tensor.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .pieces import LOCAL, REPLICATED, SHARD, AllPieces, PieceColumns, first_seen
from .pieces import PieceInfo as PieceInfo  # the plan's input, imported from here

Box = tuple[tuple[int, ...], tuple[int, ...]]


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


@dataclass
class WritePlan:
    """Who writes what: ``rows`` of ``pieces`` (each distinct box once), rank after rank
    and in the order each rank writes them; rank r's are ``rows[at[r]:at[r + 1]]``."""

    pieces: AllPieces
    rows: np.ndarray
    at: np.ndarray

    def names(self, rank: int) -> list[str]:
        """The names of the pieces ``rank`` writes, in order (its ``Assignment.write``)."""
        rows = self.rows[self.at[rank]:self.at[rank + 1]]
        return list(map(self.pieces.names.__getitem__, self.pieces.code[rows].tolist()))


def assign_writes(pieces_by_rank: list[PieceColumns]) -> WritePlan:
    """Decide which rank writes each piece: rank-local pieces by their owner, every
    other distinct box exactly once, spread over the ranks that hold it, balanced by
    bytes (largest first onto the least-loaded holder, the lowest rank on a tie). A rank
    writes its local pieces, then the boxes only it holds (in its order), then those it
    was given. Numpy over every rank's pieces at once; Python only per box held by
    several ranks."""
    p = AllPieces.gather(pieces_by_rank)
    world, n = len(pieces_by_rank), len(p)
    if world == 1:  # one process writes everything it holds
        return WritePlan(p, np.arange(n, dtype=np.int64), np.asarray([0, n], dtype=np.int64))
    _check_agreement(p)
    held = np.flatnonzero(p.kind != LOCAL)
    order, start = _group_boxes(p, held)
    rows = held[order]  # grouped by box, each group in rank order
    size = np.diff(np.append(start, len(rows)))
    _check_replicated(p, rows, start, size, world)
    single = np.zeros(n, dtype=bool)
    single[rows[start[size == 1]]] = True
    mask = single | (p.kind == LOCAL)  # written by their holder, in its order
    bytes_at = np.concatenate(([0], np.cumsum(np.where(mask, p.nbytes, 0))))
    load = (bytes_at[p.starts[1:]] - bytes_at[p.starts[:-1]]).tolist()
    shared = np.flatnonzero(size > 1)
    given = _spread(p, rows, start[shared], size[shared], load)
    out = np.flatnonzero(mask)
    if len(given) or (single.any() and len(held) < n):  # else the rows are in that order already
        position = np.arange(n, dtype=np.int64)  # the write order: local pieces, single boxes, given boxes
        position[single] += n
        position[given] = 2 * n + np.arange(len(given))
        out = np.concatenate((out, given))
        out = out[np.argsort(p.rank[out] * (3 * n + 1) + position[out], kind="stable")]
    return WritePlan(p, out, np.searchsorted(p.rank[out], np.arange(world + 1)).astype(np.int64))


def _spread(p: AllPieces, rows: np.ndarray, start: np.ndarray, size: np.ndarray, load: list[int]) -> np.ndarray:
    """The boxes held by several ranks (groups ``rows[start[g]:start[g] + size[g]]``),
    largest first (then by name, offsets, shape), each onto its least-loaded holder:
    the row each is written from, in that order. ``load`` (bytes per rank) grows."""
    if not len(start):
        return np.zeros(0, dtype=np.int64)
    lead = rows[start]
    names = np.unique(p.code[lead]).tolist()
    name_order = np.zeros(len(p.names), dtype=np.int64)
    name_order[sorted(names, key=p.names.__getitem__)] = np.arange(len(names))
    turn = np.lexsort([p.shape[lead, d] for d in range(p.shape.shape[1] - 1, -1, -1)] +
                      [p.offsets[lead, d] for d in range(p.offsets.shape[1] - 1, -1, -1)] +
                      [name_order[p.code[lead]], -p.nbytes[lead]])  # the last key sorts first
    at = segments(start, size)  # the groups' positions in rows
    holders = p.rank[rows[at]]
    holder = holders.tolist()
    stop = np.cumsum(size)
    begin, stop, nbytes = (stop - size).tolist(), stop.tolist(), p.nbytes[lead].tolist()
    chosen = [0] * len(start)
    weight = load.__getitem__
    for g in turn.tolist():  # the one loop per box: holders in rank order, min() keeps the lowest
        r = min(holder[begin[g]:stop[g]], key=weight)
        load[r] += nbytes[g]
        chosen[g] = r
    mine = holders == np.repeat(np.asarray(chosen, dtype=np.int64), size)  # one row per group: its ranks differ
    return rows[at[mine]][turn]


def segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ranges ``[starts[i], starts[i] + lengths[i])``, vectorized."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)


def _check_agreement(p: AllPieces) -> None:
    """Every piece of a tensor has the kind, dtype and global shape of its first piece."""
    ref = p.first[p.code]
    bad = (p.kind != p.kind[ref]) | (p.dtype != p.dtype[ref]) | (p.ndim != p.ndim[ref])
    for d in range(p.global_shape.shape[1]):  # a column at a time: quicker than along short rows
        col = p.global_shape[:, d]
        bad |= col != col[ref]
    found = np.flatnonzero(bad)
    if found.size:
        j = int(found[0])
        got, seen = p.info(j), p.info(int(ref[j]))
        raise PlanError(
            f"tensor {got.name!r}: rank {int(p.rank[j])} has {got.kind} {got.dtype} {list(got.global_shape)}, "
            f"another rank {seen.kind} {seen.dtype} {list(seen.global_shape)}")


def _group_boxes(p: AllPieces, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group ``rows`` by (tensor, offsets, shape): the order that sorts them into groups
    (stable: each group in row order) and where each group starts. One int64 key per
    row, from the columns that differ between pieces of a tensor (each compressed to
    its distinct values only when the key would overflow)."""
    every = len(rows) == len(p)  # no rank-local pieces: no gathers
    code = p.code if every else p.code[rows]
    ref = p.first[code]
    key, bound = code, max(len(p.names), 1)
    for col in (a[:, d] for a in (p.offsets, p.shape) for d in range(a.shape[1])):
        values = col if every else col[rows]
        if not (values != col[ref]).any():  # the same in every piece of a tensor: implied by it
            continue
        lo = int(values.min())
        values, top = values - lo, int(values.max()) - lo + 1
        if bound * top >= 2**62:
            key = np.unique(key, return_inverse=True)[1].reshape(-1)
            bound = int(key.max()) + 1
        if bound * top >= 2**62:
            values = np.unique(values, return_inverse=True)[1].reshape(-1)
            top = int(values.max()) + 1
        key, bound = key * top + values, bound * top
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    return order, np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])) if len(rows) else
                                 np.zeros(0, bool))


def _check_replicated(p: AllPieces, rows: np.ndarray, start: np.ndarray, size: np.ndarray, world: int) -> None:
    """A plain (replicated) tensor must be on every rank."""
    bad = np.flatnonzero((p.kind[rows[start]] == REPLICATED) & (size != world))
    if bad.size:
        g = int(bad[np.argmin(rows[start[bad]])])  # the first seen, as the ranks listed them
        name = p.names[int(p.code[rows[start[g]]])]
        missing = sorted(set(range(world)) - set(p.rank[rows[start[g]:start[g] + size[g]]].tolist()))
        raise PlanError(f"tensor {name!r} is a plain (replicated) tensor on some ranks but "
                        f"missing on rank(s) {missing}; wrap per-rank tensors in safeckpt.RankLocal")


def check_shards(plan: WritePlan) -> None:
    """The boxes of every sharded tensor tile it: the pieces the plan writes (each
    distinct box once), checked in one batch per number of dimensions
    (``check_tilings``)."""
    p = plan.pieces
    rows = plan.rows[p.kind[plan.rows] == SHARD]
    ndim = p.ndim[rows]
    for k in np.unique(ndim).tolist():
        batch = rows[ndim == k]
        every = len(batch) == len(p) and bool((batch == np.arange(len(p))).all())  # FSDP: every row, in order

        def boxes(a: np.ndarray) -> np.ndarray:
            return a[:, :k] if every else np.take(a[:, :k], batch, axis=0)

        code = p.code[batch]
        tensors = first_seen(code, len(p.names))
        local = np.zeros(len(p.names), dtype=np.int64)
        local[tensors] = np.arange(len(tensors))
        check_tilings([p.names[c] for c in tensors.tolist()],
                      [tuple(s) for s in p.global_shape[p.first[tensors], :k].tolist()],
                      local[code], boxes(p.offsets), boxes(p.shape))


def check_coverage(name: str, global_shape: tuple[int, ...], boxes: list[Box]) -> None:
    """The saved boxes of a tensor must tile it exactly: no gaps, no overlaps. Bounded
    by ``TILING_WORK`` steps per box and dimension, whatever the boxes (a crafted
    manifest cannot make it slow or large); see ``_tiling_defect``. A tensor with no
    elements (a dimension of 0) is tiled by any boxes inside it, but one box alone must be
    the whole tensor, as a manifest's single chunk is."""
    n = len(global_shape)
    for o, s in boxes:
        if len(o) != n or len(s) != n or any(a < 0 or e < 0 or a + e > g for a, e, g in zip(o, s, global_shape)):
            raise PlanError(f"tensor {name!r}: a piece lies outside the tensor's shape {list(global_shape)}")
    if len(boxes) == 1 and tuple(boxes[0][1]) != tuple(global_shape):
        raise PlanError(f"tensor {name!r}: its only piece, {list(boxes[0][1])} at {list(boxes[0][0])}, is not the "
                        f"whole tensor {list(global_shape)}")
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
    and grids (the layout of every sharding) are checked with numpy, a column at a time
    (reductions along a short row are slow); a tensor whose boxes are no grid goes
    through ``check_coverage``."""
    n, k = len(names), offsets.shape[1]
    bound = np.take(np.asarray(shapes, dtype=np.int64).reshape(n, k), tensor, axis=0)
    out = np.zeros(len(tensor), dtype=bool)
    volumes = np.ones(len(tensor), dtype=np.int64)
    for d in range(k):
        o, e, b = offsets[:, d], extents[:, d], bound[:, d]
        out |= (o < 0) | (e < 0) | (o > b) | (e > b - o)
        volumes *= e  # each box inside its tensor (checked before use): no overflow
    outside = np.flatnonzero(out)
    if outside.size:
        i = int(tensor[outside[0]])
        raise PlanError(f"tensor {names[i]!r}: a piece lies outside the tensor's shape {list(shapes[i])}")
    want = np.asarray([volume(s) for s in shapes], dtype=np.float64)
    approx = np.bincount(tensor, weights=volumes.astype(np.float64), minlength=n)
    # float64 sums of counts >= 0 are exact below 2^53 (and only grow); larger tensors
    # (none a machine holds) are summed exactly in check_coverage, as are tensors with no
    # elements (whose volumes say nothing)
    wrong = (approx != want) | (want >= 2.0**53) | (want == 0)
    grid = grid_tensors(tensor, offsets, extents, n, bound)
    for i in np.flatnonzero(wrong | ~grid).tolist():
        rows = tensor == i
        check_coverage(names[i], shapes[i], list(zip(map(tuple, offsets[rows].tolist()),
                                                     map(tuple, extents[rows].tolist()))))


def grid_tensors(tensor: np.ndarray, offsets: np.ndarray, extents: np.ndarray, n: int,
                 bound: np.ndarray | None = None) -> np.ndarray:
    """For each of ``n`` tensors, whether its non-empty boxes (the rows of ``offsets`` and
    ``extents`` whose ``tensor`` is its index) are distinct cells of one grid with as many
    cells as boxes: in every dimension the boxes' intervals are each one of a row of
    adjacent intervals. If their volumes add up to the tensor's and every box lies inside
    it, they then tile it exactly. Vectorized over every tensor at once; a dimension that
    every box spans whole (``bound``: each row's tensor shape) needs no sort."""
    keep = np.ones(len(tensor), dtype=bool)
    for d in range(extents.shape[1]):
        keep &= extents[:, d] > 0
    if not keep.all():
        tensor, offsets, extents = tensor[keep], offsets[keep], extents[keep]
        bound = None if bound is None else bound[keep]
    t = tensor
    count = np.bincount(t, minlength=n)
    ok = np.ones(n, dtype=bool)
    cells = np.ones(n, dtype=np.float64)
    cell = np.zeros(len(t), dtype=np.int64)
    for d in range(offsets.shape[1]):
        lo, ext = offsets[:, d], extents[:, d]
        if bound is not None and not lo.any() and (ext == bound[:, d]).all():
            continue  # one interval: every box is cell 0 of this dimension
        index, intervals = _intervals(t, lo, lo + ext, n, ok)
        intervals = np.maximum(intervals, 1)
        cells *= intervals
        cell = cell * intervals[t] + index  # wraps only where cells exceed the count (refused)
    ok &= cells == count
    rows = ok[t]  # there cell < count <= len(t): (tensor, cell) is one int64 key
    top = int(count.max()) + 1 if len(t) else 1
    keys = np.sort(t[rows] * top + cell[rows])
    ok[keys[1:][keys[1:] == keys[:-1]] // top] = False
    return ok | (count == 0)


def _intervals(t: np.ndarray, lo: np.ndarray, hi: np.ndarray, n: int, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The intervals ``[lo, hi)`` of the boxes in one dimension: each box's index among
    the distinct ones of its tensor (by ``lo``) and how many each tensor has. A tensor
    whose distinct intervals are not adjacent in a row (two with one start, an overlap,
    a gap) is marked not ``ok``."""
    first, inverse = _distinct(t, lo, n)  # one row per distinct (tensor, lo), in that order
    dt, dlo, dhi = t[first], lo[first], hi[first]
    ok[t[hi != dhi[inverse]]] = False
    same = dt[1:] == dt[:-1]
    ok[dt[1:][same & (dhi[:-1] != dlo[1:])]] = False
    per = np.bincount(dt, minlength=n)
    start = np.concatenate(([0], np.cumsum(per)))[:-1]
    return inverse - start[t], per


def _distinct(tensor: np.ndarray, values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (tensor, value) pairs (values >= 0), sorted: the first row of each,
    and each row's pair's position. One sort of a combined key where it fits, none where
    the rows are in that order already (a decoded table's: tensor after tensor, each
    tensor's chunks in the order its ranks wrote them)."""
    top = int(values.max()) + 1 if len(values) else 1
    if n * top < 2**62:
        key = tensor * top + values
        if (key[1:] >= key[:-1]).all():
            new = np.ones(len(key), dtype=bool)
            new[1:] = key[1:] != key[:-1]
            return np.flatnonzero(new), np.cumsum(new) - 1
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    order = np.lexsort((values, tensor))
    ts, vs = tensor[order], values[order]
    new = np.ones(len(ts), dtype=bool)
    new[1:] = (ts[1:] != ts[:-1]) | (vs[1:] != vs[:-1])
    inverse = np.empty(len(ts), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return order[new], inverse


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
    start: dict[Box, int] = {whole: -1} if volume(global_shape) else {}  # an empty tensor needs no box
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
