"""Every rank's pieces as columns: what a rank sends rank 0 in phase 1 of a save.

Rank 0 of a job of 1,000 ranks x 2,000 tensors plans ~2 million pieces; as one
``PieceInfo`` object each, planning is Python work per piece. Each rank instead sends
its pieces as a few numpy arrays and a list of names (``PieceColumns``), and rank 0
concatenates them once (``AllPieces``) so that planning is numpy over all of them.
Boxes are padded to a common number of dimensions (offsets with 0, shapes with 1: a
padded dimension is one cell every box spans whole); ``ndim`` says how many are real.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class PieceInfo(NamedTuple):
    """What one rank holds of one logical tensor (metadata only, never data)."""

    name: str
    kind: str           # "replicated" | "shard" | "local"
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int

KINDS = ("replicated", "shard", "local")
REPLICATED, SHARD, LOCAL = range(3)
_KIND = {k: i for i, k in enumerate(KINDS)}
_NAME, _GLOBAL = operator.attrgetter("name"), operator.attrgetter("global_shape")
_OFFSETS, _SHAPE = operator.attrgetter("offsets"), operator.attrgetter("shape")


def _padded(rows: list[tuple[int, ...]], ndim: np.ndarray, width: int, fill: int) -> np.ndarray:
    """``rows`` (``ndim[i]`` ints each) as an ``(n, width)`` int64 array padded with ``fill``."""
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(ndim.sum()))
    if len(rows) and (ndim == width).all():
        return flat.reshape(len(rows), width)
    out = np.full((len(rows), width), fill, dtype=np.int64)
    out[np.arange(width) < ndim[:, None]] = flat  # row-major: each row's values in order
    return out


def pad(a: np.ndarray, width: int, fill: int) -> np.ndarray:
    """``a`` (``(n, k)``, ``k <= width``) widened to ``width`` columns of ``fill``."""
    if a.shape[1] == width:
        return a
    return np.hstack((a, np.full((len(a), width - a.shape[1]), fill, dtype=np.int64)))


def first_seen(code: np.ndarray, n: int) -> np.ndarray:
    """The distinct values of ``code`` (each in ``range(n)``) in order of first sight."""
    at = np.full(n, len(code), dtype=np.int64)
    np.minimum.at(at, code, np.arange(len(code), dtype=np.int64))
    seen = np.flatnonzero(at < len(code))
    return seen[np.argsort(at[seen])]


def unpad(a: np.ndarray, rows: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of padded ``a``, the first ``ndim[i]`` values of each, back to back."""
    taken = np.take(a, rows, axis=0)  # far quicker than a[rows] for short rows
    if (ndim == a.shape[1]).all():
        return taken.reshape(-1)
    return taken[np.arange(a.shape[1]) < ndim[:, None]]


@dataclass
class PieceColumns:
    """The ``PieceInfo`` of every piece one rank holds, as columns (row ``i`` is piece
    ``names[i]``): small to send, and planned without a Python object per piece."""

    names: list[str]
    kind: np.ndarray          # index into KINDS
    dtypes: list[str]         # this rank's distinct dtypes
    dtype: np.ndarray         # index into dtypes
    ndim: np.ndarray
    global_shape: np.ndarray  # (n, width), padded with 1
    offsets: np.ndarray       # (n, width), padded with 0
    shape: np.ndarray         # (n, width), padded with 1
    nbytes: np.ndarray

    @classmethod
    def of(cls, infos: list[PieceInfo]) -> "PieceColumns":
        n = len(infos)
        dtypes: dict[str, int] = {}
        dtype = np.fromiter((dtypes.setdefault(p.dtype, len(dtypes)) for p in infos), np.int16, n)
        ndim = np.fromiter(map(len, map(_GLOBAL, infos)), np.int64, n)
        width = int(ndim.max()) if n else 0
        return cls(list(map(_NAME, infos)), np.fromiter((_KIND[p.kind] for p in infos), np.int8, n), list(dtypes),
                   dtype, ndim.astype(np.int8), _padded(list(map(_GLOBAL, infos)), ndim, width, 1),
                   _padded(list(map(_OFFSETS, infos)), ndim, width, 0),
                   _padded(list(map(_SHAPE, infos)), ndim, width, 1),
                   np.fromiter((p.nbytes for p in infos), np.int64, n))

    def __len__(self) -> int:
        return len(self.names)

    def infos(self) -> list[PieceInfo]:
        """Every piece as a ``PieceInfo`` again (for the paths that are not per piece of a
        large job: incremental saves)."""
        ndim = self.ndim.tolist()
        cut = [tuple(row[:k]) for rows in (self.global_shape.tolist(), self.offsets.tolist(), self.shape.tolist())
               for row, k in zip(rows, ndim)]
        n = len(self)
        return [PieceInfo(name, KINDS[k], self.dtypes[d], cut[i], cut[n + i], cut[2 * n + i], b)
                for i, (name, k, d, b) in enumerate(zip(self.names, self.kind.tolist(), self.dtype.tolist(),
                                                        self.nbytes.tolist()))]


@dataclass
class AllPieces:
    """Every rank's pieces concatenated on rank 0, rank after rank. Row ``j`` is piece
    ``index[j]`` of rank ``rank[j]``, of tensor ``names[code[j]]``; ``first[c]`` is the
    first row of tensor ``c`` (the reference its other pieces must agree with)."""

    names: list[str]          # distinct tensor names, in order of first sight
    code: np.ndarray
    first: np.ndarray
    rank: np.ndarray
    starts: np.ndarray        # rank r's rows are starts[r]:starts[r + 1]
    kind: np.ndarray
    dtypes: list[str]
    dtype: np.ndarray
    ndim: np.ndarray
    global_shape: np.ndarray
    offsets: np.ndarray
    shape: np.ndarray
    nbytes: np.ndarray

    @classmethod
    def gather(cls, ranks: list[PieceColumns]) -> "AllPieces":
        sizes = np.asarray([len(c) for c in ranks], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        width = max((c.offsets.shape[1] for c in ranks), default=0)
        names, first, codes = _codes(ranks, starts)
        dtypes: dict[str, int] = {}
        dtype = []
        for c in ranks:
            remap = np.asarray([dtypes.setdefault(d, len(dtypes)) for d in c.dtypes] or [0], dtype=np.int16)
            dtype.append(remap[c.dtype])
        def join(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
            return np.concatenate(parts) if parts else empty

        def boxes(field: str, fill: int) -> np.ndarray:
            return join([pad(getattr(c, field), width, fill) for c in ranks], np.zeros((0, width), np.int64))

        return cls(names, codes, first, np.repeat(np.arange(len(ranks), dtype=np.int64), sizes), starts,
                   join([c.kind for c in ranks], np.zeros(0, np.int8)), list(dtypes),
                   join(dtype, np.zeros(0, np.int16)), join([c.ndim for c in ranks], np.zeros(0, np.int8)),
                   boxes("global_shape", 1), boxes("offsets", 0), boxes("shape", 1),
                   join([c.nbytes for c in ranks], np.zeros(0, np.int64)))

    def __len__(self) -> int:
        return len(self.code)

    def info(self, j: int) -> PieceInfo:
        """Row ``j`` as a ``PieceInfo`` (for messages)."""
        k = int(self.ndim[j])
        return PieceInfo(self.names[int(self.code[j])], KINDS[int(self.kind[j])], self.dtypes[int(self.dtype[j])],
                         tuple(self.global_shape[j, :k].tolist()), tuple(self.offsets[j, :k].tolist()),
                         tuple(self.shape[j, :k].tolist()), int(self.nbytes[j]))


def _codes(ranks: list[PieceColumns], starts: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The distinct names (in order of first sight), the name index of every row and
    the first row of each name. Ranks that hold the same names in the same order (every
    rank of an FSDP job) cost one list comparison; otherwise a dict lookup per piece,
    and Python work only for the names seen for the first time."""
    index: dict[str, int] = {}
    names: list[str] = []
    first: list[int] = []
    parts: list[np.ndarray] = []
    last: tuple[list[str] | None, np.ndarray] = (None, np.zeros(0, dtype=np.int64))
    for r, c in enumerate(ranks):
        if c.names != last[0]:
            got = np.fromiter(map(index.get, c.names, itertools.repeat(-1)), np.int64, len(c))
            for i in np.flatnonzero(got < 0).tolist():
                name = c.names[i]
                k = index.get(name)
                if k is None:
                    k = index[name] = len(names)
                    names.append(name)
                    first.append(int(starts[r]) + i)
                got[i] = k
            last = (c.names, got)
        parts.append(last[1])
    code = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return names, np.asarray(first, dtype=np.int64), code
