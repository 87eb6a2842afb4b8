"""Format 3's tensor tables: every tensor and chunk of a manifest as columns of integers.

A manifest of a job with millions of pieces must stay small and quick to read: in format
3 the ``tensors`` field holds the names once, a dtype and a checksum-algorithm table,
and the rest as columns of little-endian int64 (deflated, base64 in the JSON) plus the
raw block digests. Decoding checks every rule of docs/format.md §6.2 over numpy arrays
(never one Python object per piece); ``TensorTable`` then hands out cheap per-tensor
views (``TableEntry``) that build ``Chunk`` objects only for the chunks a caller asks
for, so a rank plans its load from the chunks that meet its box.
"""

from __future__ import annotations

import base64
import binascii
import copy
import functools
import itertools
import json
import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .pieces import first_seen
from .plan import Box, PlanError, check_tilings, segments
from .records import Chunk, TensorEntry
from .dtypes import MAX_DIMS, itemsize_of


ALGORITHM_WIDTH = {"xxh3_64": 8, "xxh3_128": 16}  # digest bytes per block checksum
TENSOR_COLUMNS = ("dtype", "ndim", "chunks", "tied")  # one value per tensor
CHUNK_COLUMNS = ("file", "start", "length", "algorithm")  # one value per chunk
_LIMIT = 1 << 62  # no count, offset or size of a valid manifest comes near it
# what the packed columns of a table may inflate to in all (docs/format.md §6.4): 16 bytes
# per byte of the manifest's body, plus 1 MiB; a writer whose columns deflate further
# stores them uncompressed, so a reader can bound its memory by the manifest's length
INFLATE_RATIO = 16
INFLATE_FLOOR = 1 << 20
_MIN_DIGEST = min(ALGORITHM_WIDTH.values())  # every chunk has at least one block digest


def pack(values: np.ndarray | list[int], level: int = 1) -> str:
    """A column as stored: little-endian int64, deflated (``level`` 0: stored), base64."""
    raw = np.asarray(values, dtype="<i8").tobytes()
    return base64.b64encode(zlib.compress(raw, level)).decode("ascii")


def unpack(text: Any, count: int, where: str, what: str) -> np.ndarray:
    """Inverse of ``pack``, for a column that must hold exactly ``count`` values: one
    complete zlib stream and nothing after it. It never inflates more than that (a
    crafted column cannot blow up memory)."""
    try:
        if not isinstance(text, str):
            raise ValueError("not a string")
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(text, validate=True), count * 8 + 1)
        complete = inflater.eof and not inflater.unconsumed_tail and not inflater.unused_data
    except (ValueError, binascii.Error, zlib.error) as exc:
        raise CorruptCheckpointError(f"{where}: tensor table column {what!r} is garbled ({exc})") from exc
    if len(raw) != count * 8 or not complete:
        raise CorruptCheckpointError(
            f"{where}: tensor table column {what!r} holds {len(raw) // 8}{'+' if not complete else ''} values, "
            f"not {count}, or bytes after its stream (truncated or altered)")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)


class _Inflation:
    """How much a table's columns may still inflate to: each column's declared length is
    checked against it before the column is inflated, so a small manifest that claims
    millions of values is refused having allocated nothing (docs/format.md §6.4)."""

    def __init__(self, body_length: int, where: str) -> None:
        self.body_length, self.where = body_length, where
        self.left = INFLATE_FLOOR + INFLATE_RATIO * body_length

    def column(self, text: Any, count: int, what: str) -> np.ndarray:
        if 8 * count > self.left:
            raise CorruptCheckpointError(
                f"{self.where}: tensor table column {what!r} declares {count} values, more than a manifest of "
                f"{self.body_length} bytes may hold (crafted or altered)")
        self.left -= 8 * count
        return unpack(text, count, self.where, what)


def _need(cond: Any, where: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"{where}: tensor table: {what}")


def _total(a: np.ndarray, where: str, what: str) -> int:
    """The sum of a column of counts, each in [0, 2^62) (a crafted one cannot overflow it)."""
    _need(a.size == 0 or (a.min() >= 0 and a.max() < _LIMIT), where, f"bad {what}")
    total = float(a.sum(dtype=np.float64))
    _need(total < _LIMIT, where, f"bad {what}")
    return int(a.sum())


@dataclass
class Checksums:
    """The block checksums of many chunks as columns: chunk ``j``'s raw digests are the
    next ``size[j]`` bytes of ``digests``, of algorithm ``algorithms[algorithm[j]]``."""

    algorithms: list[str]
    algorithm: np.ndarray
    size: np.ndarray
    digests: bytes

    @classmethod
    def parse(cls, sums: list[list[str]]) -> "Checksums":
        """From ``"algorithm:hex digest"`` strings, a list per chunk."""
        flat = list(itertools.chain.from_iterable(sums))
        n = len(sums)
        for alg, width in ALGORITHM_WIDTH.items():  # the common case: one checksum per chunk, one algorithm
            prefix = alg + ":"
            if len(flat) == n and set(map(len, flat)) == {len(prefix) + 2 * width} and \
                    all(map(str.startswith, flat, itertools.repeat(prefix))):
                return cls([alg], np.zeros(n, dtype=np.int64), np.full(n, width, dtype=np.int64),
                           bytes.fromhex("".join(flat).replace(prefix, "")))
        algorithms: list[str] = []
        c_alg, size, hexes = [], [], []
        for chunk_sums in sums:
            alg = chunk_sums[0].partition(":")[0]
            if alg not in algorithms:
                algorithms.append(alg)
            c_alg.append(algorithms.index(alg))
            digits = 0
            for text in chunk_sums:
                a, _, hexdigits = text.partition(":")
                if a != alg:
                    raise ValueError(f"a chunk mixes checksum algorithms ({alg}, {a})")
                hexes.append(hexdigits)
                digits += len(hexdigits)
            size.append(digits // 2)
        return cls(algorithms, np.asarray(c_alg, dtype=np.int64), np.asarray(size, dtype=np.int64),
                   bytes.fromhex("".join(hexes)))

    @classmethod
    def join(cls, parts: "list[Checksums]") -> "Checksums":
        digests = b"".join(p.digests for p in parts)
        width = {int(p.size[0]) if p.uniform else -1 for p in parts if len(p.size)}
        if len({tuple(p.algorithms) for p in parts if len(p.size)}) == 1 and len(width) == 1 and -1 not in width:
            n = sum(len(p.size) for p in parts)  # one algorithm, one width: the common case, nothing to join
            return cls(next(p.algorithms for p in parts if len(p.size)), _same(0, n), _same(width.pop(), n), digests)
        algorithms: dict[str, int] = {}
        codes = [np.asarray([algorithms.setdefault(a, len(algorithms)) for a in p.algorithms] or [0],
                            dtype=np.int64)[p.algorithm] for p in parts]
        return cls(list(algorithms), np.concatenate(codes or [np.zeros(0, np.int64)]),
                   np.concatenate([p.size for p in parts] or [np.zeros(0, np.int64)]), digests)

    @property
    def uniform(self) -> bool:
        """One algorithm and one digest width for every chunk."""
        return len(self.algorithms) == 1 and _constant(self.size)

    def take(self, rows: np.ndarray) -> "Checksums":
        digests = _take_ragged(np.frombuffer(self.digests, dtype=np.uint8), self.size, rows).tobytes()
        if self.uniform:
            return Checksums(self.algorithms, _same(0, len(rows)), _same(int(self.size[0]), len(rows)), digests)
        return Checksums(self.algorithms, self.algorithm[rows], self.size[rows], digests)


def _constant(a: np.ndarray) -> bool:
    """A non-empty column of one value (a broadcast one is, by its stride)."""
    return bool(len(a)) and (a.strides[0] == 0 or bool((a == a[0]).all()))


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or np.array_equal(a, b)


def _same(value: int, n: int) -> np.ndarray:
    """``n`` times ``value`` as a read-only int64 view (nothing allocated)."""
    return np.broadcast_to(np.int64(value), (n,))


def _take_ragged(flat: np.ndarray, lengths: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of ``flat``, whose row ``i`` is the next ``lengths[i]`` values."""
    if _constant(lengths):  # rows of one length: a reshape
        width = int(lengths[0])
        if width == 8 and not flat.size % 8:  # one 8-byte digest per row: one gather of 64-bit words
            return flat.view(np.uint64)[rows].view(np.uint8)
        return np.take(flat.reshape(len(lengths), width), rows, axis=0).reshape(-1)
    at = np.concatenate(([0], np.cumsum(lengths)))[:-1].astype(np.int64)
    return flat[segments(at[rows], lengths[rows])]


@dataclass
class ChunkColumns:
    """Chunks as columns: chunk ``j`` of tensor ``tensor[j]`` holds bytes
    ``start[j]:end[j]`` of file ``files[file[j]]``, and its box is the next ``ndim[j]``
    values of ``offsets`` and of ``shape``."""

    files: list[str]
    file: np.ndarray
    tensor: np.ndarray
    start: np.ndarray
    end: np.ndarray
    sums: Checksums
    ndim: np.ndarray
    offsets: np.ndarray
    shape: np.ndarray

    @classmethod
    def join(cls, parts: "list[ChunkColumns]") -> "ChunkColumns":
        if len(parts) == 1:
            return parts[0]
        files: dict[str, int] = {}
        file = [np.asarray([files.setdefault(f, len(files)) for f in p.files] or [0], dtype=np.int64)[p.file]
                for p in parts]
        cat = lambda name: np.concatenate([getattr(p, name) for p in parts] or [np.zeros(0, np.int64)])  # noqa: E731
        return cls(list(files), np.concatenate(file or [np.zeros(0, np.int64)]), cat("tensor"), cat("start"),
                   cat("end"), Checksums.join([p.sums for p in parts]), cat("ndim"), cat("offsets"), cat("shape"))

    def take(self, rows: np.ndarray) -> "ChunkColumns":
        return ChunkColumns(self.files, self.file[rows], self.tensor[rows], self.start[rows], self.end[rows],
                            self.sums.take(rows), self.ndim[rows], _take_ragged(self.offsets, self.ndim, rows),
                            _take_ragged(self.shape, self.ndim, rows))


class TableBuilder:
    """Collects tensors and their chunks (in any order) into a ``TensorTable``: what a
    writer fills from its plan, with no per-tensor dataclass. Chunks come one by one
    (``chunk``) or as columns (``add``: rank 0 of a large job, numpy per batch)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.dtypes: list[str] = []
        self.t_dtype: list[int] = []
        self.t_shape: list[Any] = []
        self.t_tied: list[str | None] = []
        self.parts: list[ChunkColumns] = []
        self.c_tensor: list[int] = []  # chunks added one by one since the last part
        self.c_file: list[str] = []
        self.c_start: list[int] = []
        self.c_end: list[int] = []
        self.c_sums: list[list[str]] = []
        self.c_offsets: list[Any] = []
        self.c_shape: list[Any] = []
        self.aliases: list[tuple[int, int]] = []  # (tied tensor, the tensor it is tied to)
        self.source = np.zeros(0, dtype=np.int64)  # see build

    def tensor(self, name: str, dtype: str, shape: Any, tied_to: str | None = None) -> int:
        """The index of tensor ``name``, added on first sight."""
        i = self.index.get(name)
        if i is None:
            i = self.index[name] = len(self.names)
            self.names.append(name)
            if dtype not in self.dtypes:
                self.dtypes.append(dtype)
            self.t_dtype.append(self.dtypes.index(dtype))
            self.t_shape.append(shape)
            self.t_tied.append(tied_to)
        return i

    def chunk(self, tensor: int, file: str, start: int, end: int, checksums: list[str],
              offsets: Any, shape: Any) -> None:
        """One chunk: tensor index, file, byte range, block checksums and box."""
        self.c_tensor.append(tensor)
        self.c_file.append(file)
        self.c_start.append(start)
        self.c_end.append(end)
        self.c_sums.append(checksums)
        self.c_offsets.append(offsets)
        self.c_shape.append(shape)

    def add(self, chunks: ChunkColumns) -> None:
        """Many chunks at once, after those added before."""
        self._flush()
        self.parts.append(chunks)

    def _flush(self) -> None:
        """The chunks added one by one, as a part."""
        if not self.c_tensor:
            return
        files: dict[str, int] = {}
        file = np.fromiter((files.setdefault(f, len(files)) for f in self.c_file), np.int64, len(self.c_file))
        tensor = np.asarray(self.c_tensor, dtype=np.int64)
        ndim = np.asarray([len(s) for s in self.t_shape], dtype=np.int64)[tensor]
        count = int(ndim.sum())
        self.parts.append(ChunkColumns(
            list(files), file, tensor, np.asarray(self.c_start, dtype=np.int64),
            np.asarray(self.c_end, dtype=np.int64), Checksums.parse(self.c_sums), ndim,
            np.fromiter(itertools.chain.from_iterable(self.c_offsets), np.int64, count),
            np.fromiter(itertools.chain.from_iterable(self.c_shape), np.int64, count)))
        for pending in (self.c_tensor, self.c_file, self.c_start, self.c_end, self.c_sums, self.c_offsets,
                        self.c_shape):
            pending.clear()

    def alias(self, name: str, first: str) -> None:
        """``name`` is tied to ``first`` (the same tensor): its own entry, the same chunks
        (copied in ``build``). Every rank of a sharded tie reports it; the first counts."""
        if name not in self.index:
            src = self.index[first]
            self.aliases.append((self.tensor(name, self.dtypes[self.t_dtype[src]], self.t_shape[src], first), src))

    def _with_aliases(self, chunks: ChunkColumns) -> tuple[ChunkColumns, np.ndarray]:
        """Every alias given the chunks of its tensor, appended alias after alias; and
        the chunk each row is (a copy of)."""
        order = np.argsort(chunks.tensor, kind="stable")
        counts = np.bincount(chunks.tensor, minlength=len(self.names))
        first = np.concatenate(([0], np.cumsum(counts)))
        alias, src = (np.asarray(c, dtype=np.int64) for c in zip(*self.aliases))
        copied = order[segments(first[src], counts[src])]
        copies = chunks.take(copied)
        copies.tensor = np.repeat(alias, counts[src])
        return ChunkColumns.join([chunks, copies]), np.concatenate((np.arange(len(chunks.tensor)), copied))

    def build(self, file_names: list[str], block_size: int) -> "TensorTable":
        """The table, its chunks naming files by their position in ``file_names`` (the
        manifest's ``files``). ``source`` is then, for each of its chunk rows, the
        chunk added (in the order added) that it holds: a table of the same layout is
        ``refill``ed from new chunks added in that order."""
        self._flush()
        chunks = ChunkColumns.join(self.parts)
        self.source = np.arange(len(chunks.tensor), dtype=np.int64)
        if self.aliases:
            chunks, self.source = self._with_aliases(chunks)
        if (chunks.tensor[1:] < chunks.tensor[:-1]).any():  # tensor after tensor (rank 0 adds them so)
            by_tensor = np.argsort(chunks.tensor, kind="stable")
            chunks, self.source = chunks.take(by_tensor), self.source[by_tensor]
        file_index = {n: i for i, n in enumerate(file_names)}
        files = np.asarray([file_index[f] for f in chunks.files] or [0], dtype=np.int64)
        algorithms, c_alg = _used_algorithms(chunks.sums)
        ndim = np.asarray([len(s) for s in self.t_shape], dtype=np.int64)
        tied = [-1 if t is None else self.index[t] for t in self.t_tied]
        return TensorTable(
            self.names, self.dtypes, algorithms, list(file_names), block_size,
            t_dtype=np.asarray(self.t_dtype, dtype=np.int64), t_ndim=ndim,
            t_chunks=np.bincount(chunks.tensor, minlength=len(self.names)).astype(np.int64),
            t_tied=np.asarray(tied, dtype=np.int64),
            shape=np.fromiter(itertools.chain.from_iterable(self.t_shape), dtype=np.int64, count=int(ndim.sum())),
            c_file=files[chunks.file], c_start=chunks.start, c_length=chunks.end - chunks.start,
            c_alg=c_alg, offsets=chunks.offsets, box=chunks.shape, digests=chunks.sums.digests)


def _used_algorithms(sums: Checksums) -> tuple[list[str], np.ndarray]:
    """The checksum algorithms ``sums`` uses, in order of first use, and each chunk's."""
    if len(sums.algorithms) == 1 and len(sums.algorithm):  # the common case: one algorithm, used
        return list(sums.algorithms), _same(0, len(sums.algorithm))
    used = first_seen(sums.algorithm, len(sums.algorithms))
    relabel = np.zeros(len(sums.algorithms) or 1, dtype=np.int64)
    relabel[used] = np.arange(len(used))
    return [sums.algorithms[k] for k in used.tolist()], relabel[sums.algorithm]


def from_entries(tensors: Mapping[str, "TensorEntry | TableEntry"], file_names: list[str], block_size: int) -> "TensorTable":
    """The table of a manifest built as per-tensor entries (seal, DCP, export, tests), or
    a decoded table whose manifest's file list changed (a seal adds files)."""
    if isinstance(tensors, TensorTable):
        return tensors.with_files(file_names)
    builder = TableBuilder()
    for name, t in tensors.items():
        i = builder.tensor(name, t.dtype, t.shape, t.tied_to)
        for c in t.chunks:
            builder.chunk(i, c.file, c.start, c.end, c.checksums, c.offsets, c.shape)
    return builder.build(file_names, block_size)


class TensorTable(Mapping[str, "TableEntry"]):
    """The decoded tensor table: name -> ``TableEntry``, backed by numpy columns.

    Tensor ``i``'s shape is ``shape[shape_at[i]:shape_at[i+1]]``; its chunks are rows
    ``first[i]:first[i+1]``; chunk ``j``'s box is ``offsets``/``box`` at
    ``[dim_at[j], dim_at[j+1])`` and its digests are ``digests[digest_at[j]:digest_at[j+1]]``."""

    def __init__(self, names: list[str], dtypes: list[str], algorithms: list[str], file_names: list[str],
                 block_size: int, *, t_dtype: np.ndarray, t_ndim: np.ndarray, t_chunks: np.ndarray,
                 t_tied: np.ndarray, shape: np.ndarray, c_file: np.ndarray, c_start: np.ndarray,
                 c_length: np.ndarray, c_alg: np.ndarray, offsets: np.ndarray, box: np.ndarray,
                 digests: bytes) -> None:
        self.names, self.dtypes, self.algorithms = names, dtypes, algorithms
        self.file_names, self.block_size = file_names, block_size
        self.t_dtype, self.t_ndim, self.t_chunks, self.t_tied = t_dtype, t_ndim, t_chunks, t_tied
        self.shape, self.c_file, self.c_start, self.c_length, self.c_alg = shape, c_file, c_start, c_length, c_alg
        self.offsets, self.box, self.digests = offsets, box, digests
        self.packed: dict[tuple[str, int], tuple[np.ndarray, str]] = {}  # see _packed
        self.index = {n: i for i, n in enumerate(names)}
        self.first = np.concatenate(([0], np.cumsum(t_chunks))).astype(np.int64)
        self.shape_at = np.concatenate(([0], np.cumsum(t_ndim))).astype(np.int64)
        self.c_tensor = np.repeat(np.arange(len(names), dtype=np.int64), t_chunks)
        self.c_ndim = t_ndim[self.c_tensor]
        self.dim_at = np.concatenate(([0], np.cumsum(self.c_ndim))).astype(np.int64)
        self.c_sums = np.maximum(1, -(-c_length // block_size))
        width = np.asarray([ALGORITHM_WIDTH.get(a, 0) for a in algorithms] or [0], dtype=np.int64)
        self.digest_at = np.concatenate(([0], np.cumsum(self.c_sums * width[c_alg]))).astype(np.int64)
        # per-tensor values as Python lists: a lookup per loaded tensor must not go through numpy
        self._first, self._shape_at, self._tied = self.first.tolist(), self.shape_at.tolist(), t_tied.tolist()
        self._dtype = [dtypes[k] for k in t_dtype.tolist()]
        flat = shape.tolist()
        self._shape = [flat[a:b] for a, b in zip(self._shape_at, self._shape_at[1:])]

    # -- Mapping ---------------------------------------------------------------------
    def __getitem__(self, name: str) -> "TableEntry":
        return TableEntry(self, self.index[name])

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def get(self, name: str, default: Any = None) -> Any:  # Mapping's get goes through a KeyError
        i = self.index.get(name)
        return default if i is None else TableEntry(self, i)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    # -- per-tensor views ------------------------------------------------------------
    def chunks_at(self, rows: "np.ndarray | list[int]") -> list["Chunk"]:
        """Chunk rows ``rows`` as ``Chunk`` objects, built in one batch (each column
        gathered with numpy, then turned into Python values once)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return []
        files, starts = self.c_file[rows].tolist(), self.c_start[rows].tolist()
        lengths, algs = self.c_length[rows].tolist(), self.c_alg[rows].tolist()
        ndim = self.c_ndim[rows]
        dims = segments(self.dim_at[rows], ndim)
        offsets, boxes, ndims = self.offsets[dims].tolist(), self.box[dims].tolist(), ndim.tolist()
        lo, hi = self.digest_at[rows].tolist(), self.digest_at[rows + 1].tolist()
        names, digests, algorithms = self.file_names, self.digests, self.algorithms
        out, d = [], 0
        for k in range(len(rows)):
            alg = algorithms[algs[k]]
            width = ALGORITHM_WIDTH[alg]
            sums = [f"{alg}:{digests[p:p + width].hex()}" for p in range(lo[k], hi[k], width)]
            n = ndims[k]
            out.append(Chunk(names[files[k]], starts[k], starts[k] + lengths[k], sums, offsets[d:d + n],
                             boxes[d:d + n]))
            d += n
        return out

    def meeting_many(self, tensors: list[int], boxes: list[Box]) -> list[list["Chunk"]]:
        """For each tensor ``tensors[k]``, its chunks whose boxes meet ``boxes[k]`` (every
        chunk of a tensor of one chunk: the caller's planning checks that one), built in
        one batch."""
        rows: list[int] = []
        counts: list[int] = []
        first = self._first
        for i, box in zip(tensors, boxes):
            lo, hi = first[i], first[i + 1]
            if hi - lo <= 1:
                rows += range(lo, hi)
                counts.append(hi - lo)
                continue
            found = self._meeting_rows(i, lo, hi, box)
            rows += found
            counts.append(len(found))
        chunks = self.chunks_at(rows)
        out, at = [], 0
        for n in counts:
            out.append(chunks[at:at + n])
            at += n
        return out

    def _meeting_rows(self, i: int, lo: int, hi: int, box: Box) -> list[int]:
        n = self._shape_at[i + 1] - self._shape_at[i]
        if not n:
            return list(range(lo, hi))
        dims = slice(int(self.dim_at[lo]), int(self.dim_at[hi]))
        off = self.offsets[dims].reshape(hi - lo, n)
        ext = self.box[dims].reshape(hi - lo, n)
        want = np.asarray(box[0], dtype=np.int64)
        meets = np.all(np.maximum(off, want) < np.minimum(off + ext, want + np.asarray(box[1], dtype=np.int64)),
                       axis=1)
        return (np.flatnonzero(meets) + lo).tolist()

    def chunks_in(self, file: str) -> list[tuple[str, "Chunk"]]:
        """(tensor name, chunk) of every chunk stored in ``file``, found with numpy."""
        if file not in self.file_names:
            return []
        rows = np.flatnonzero(self.c_file == self.file_names.index(file))
        return list(zip([self.names[i] for i in self.c_tensor[rows].tolist()], self.chunks_at(rows)))

    def distinct_bytes(self, files: list[bool]) -> int:
        """Bytes of the distinct byte ranges the chunks hold in the files flagged in
        ``files`` (by position in the manifest's list): ties and repeats count once."""
        mask = np.asarray(files + [False], dtype=bool)[self.c_file]
        ranges = np.stack((self.c_file[mask], self.c_start[mask], self.c_length[mask]))
        return int(np.unique(ranges, axis=1)[2].sum()) if ranges.shape[1] else 0

    def entries(self) -> dict[str, "TensorEntry"]:
        """Every tensor as a (mutable) ``TensorEntry``: for tools that edit a manifest."""
        return {n: TensorEntry(e.dtype, list(e.shape), e.chunks, e.tied_to)
                for n, e in ((n, TableEntry(self, i)) for i, n in enumerate(self.names))}

    def refill(self, file_names: list[str], start: np.ndarray, length: np.ndarray, sums: Checksums) -> "TensorTable":
        """A table of the same tensors, boxes and files (by position) whose chunks now
        hold ``length`` bytes from ``start`` with checksums ``sums`` (one entry per chunk
        row, in this table's order): the next save of an unchanged layout. Columns that
        did not change keep their stored form (``encode`` packs them once)."""
        algorithms, c_alg = _used_algorithms(sums)
        if algorithms != self.algorithms or not _equal(c_alg, self.c_alg) \
                or not _equal(length, self.c_length):  # another layout of bytes: derive it all
            table = TensorTable(self.names, self.dtypes, algorithms, list(file_names), self.block_size,
                                t_dtype=self.t_dtype, t_ndim=self.t_ndim, t_chunks=self.t_chunks,
                                t_tied=self.t_tied, shape=self.shape, c_file=self.c_file, c_start=start,
                                c_length=length, c_alg=c_alg, offsets=self.offsets, box=self.box,
                                digests=sums.digests)
            table.packed = self.packed
            return table
        table = copy.copy(self)  # what is derived from the tensors, boxes and lengths holds as it is
        table.file_names, table.c_start, table.digests = list(file_names), start, sums.digests
        return table

    def with_files(self, file_names: list[str]) -> "TensorTable":
        """The same table for a manifest whose files are ``file_names`` (a superset)."""
        if file_names == self.file_names:
            return self
        where = {n: i for i, n in enumerate(file_names)}
        remap = np.asarray([where[n] for n in self.file_names] or [0], dtype=np.int64)
        return TensorTable(self.names, self.dtypes, self.algorithms, list(file_names), self.block_size,
                           t_dtype=self.t_dtype, t_ndim=self.t_ndim, t_chunks=self.t_chunks, t_tied=self.t_tied,
                           shape=self.shape, c_file=remap[self.c_file], c_start=self.c_start,
                           c_length=self.c_length, c_alg=self.c_alg, offsets=self.offsets, box=self.box,
                           digests=self.digests)

    def check_ties(self, where: str) -> None:
        """Every tied tensor repeats the tensor it is tied to: dtype, shape and chunks
        (files, byte ranges, boxes, checksums). Readers hand out one tensor for both, so
        any other tie would give one tensor's values under another's name."""
        a = np.flatnonzero(self.t_tied >= 0)
        if not a.size:
            return
        b = self.t_tied[a]
        bad = (self.t_dtype[a] != self.t_dtype[b]) | (self.t_ndim[a] != self.t_ndim[b]) | \
              (self.t_chunks[a] != self.t_chunks[b])
        first_dim, first_digest = self.dim_at[self.first], self.digest_at[self.first]
        digests = np.frombuffer(self.digests, dtype=np.uint8)
        # (values, where tensor i's run of them starts: run i is at[i]:at[i + 1])
        for values, at in ((self.shape, self.shape_at), (self.c_file, self.first), (self.c_start, self.first),
                           (self.c_length, self.first), (self.c_alg, self.first), (self.offsets, first_dim),
                           (self.box, first_dim), (digests, first_digest)):
            ok = np.flatnonzero(~bad)
            bad[ok] = _runs_differ(values, at[a[ok]], at[a[ok] + 1], at[b[ok]], at[b[ok] + 1])
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise tie_error(where, self.names[int(a[k])], self.names[int(b[k])])

    # -- storage form ----------------------------------------------------------------
    def encode(self) -> dict[str, Any]:
        """The stored form (§6.4)."""
        packed, digests = self._stored()
        return {"names": self.names, "dtypes": self.dtypes, "algorithms": self.algorithms, "columns": packed,
                "digests": digests.decode("ascii")}

    def encode_parts(self) -> list[bytes]:
        """``encode()`` as JSON, as ``json.dumps(..., separators=(",", ":"))`` writes it,
        in parts: the long base64 strings (they need no escaping) go in as they are, not
        scanned or copied into one text (for millions of pieces that cost more than
        the rest of an encoding)."""
        packed, digests = self._stored()
        head = json.dumps({"names": self.names, "dtypes": self.dtypes, "algorithms": self.algorithms},
                          separators=(",", ":"))
        columns = ",".join(f'"{k}":"{v}"' for k, v in packed.items())
        return [f'{head[:-1]},"columns":{{{columns}}},"digests":"'.encode(), digests, b'"}']

    def _stored(self) -> tuple[dict[str, str], bytes]:
        """The packed columns and the base64 of the digests. Columns that would inflate
        to more than a reader accepts for the manifest's length (many high-dimensional
        boxes deflate far) are stored uncompressed, which always fits."""
        columns = {"dtype": self.t_dtype, "ndim": self.t_ndim, "chunks": self.t_chunks, "tied": self.t_tied,
                   "shape": self.shape, "file": self.c_file, "start": self.c_start, "length": self.c_length,
                   "algorithm": self.c_alg, "offsets": self.offsets, "box": self.box}
        digests = base64.b64encode(self.digests)
        packed = {k: self._packed(k, v, 1) for k, v in columns.items()}
        if 8 * sum(len(v) for v in columns.values()) > INFLATE_RATIO * (len(digests) + sum(map(len, packed.values()))):
            packed = {k: self._packed(k, v, 0) for k, v in columns.items()}
        return packed, digests

    def _packed(self, name: str, values: np.ndarray, level: int) -> str:
        """``pack(values, level)``, remembered: a refilled table (``refill``) shares the
        columns that did not change (tables never change a column in place), and
        packing them again is most of an encoding."""
        known = self.packed.get((name, level))
        if known is not None and _equal(known[0], values):
            return known[1]
        text = pack(values, level)
        self.packed[(name, level)] = (values, text)
        return text


class TableEntry:
    """One tensor of a ``TensorTable``, with the fields of ``TensorEntry`` (read-only)."""

    __slots__ = ("table", "i")

    def __init__(self, table: TensorTable, i: int) -> None:
        self.table, self.i = table, i

    @property
    def dtype(self) -> str:
        return self.table._dtype[self.i]

    @property
    def shape(self) -> list[int]:
        return self.table._shape[self.i]

    @property
    def tied_to(self) -> str | None:
        tied = self.table._tied[self.i]
        return None if tied < 0 else self.table.names[tied]

    @property
    def only_chunk(self) -> int:
        """The table row of the tensor's chunk when it has exactly one, else -1."""
        first = self.table._first
        return first[self.i] if first[self.i + 1] - first[self.i] == 1 else -1

    @property
    def chunks(self) -> list["Chunk"]:
        t = self.table
        return t.chunks_at(list(range(t._first[self.i], t._first[self.i + 1])))

    def meeting(self, box: Box) -> list["Chunk"]:
        return self.table.meeting_many([self.i], [box])[0]

    def __eq__(self, other: object) -> bool:
        return all(getattr(self, f) == getattr(other, f, None) for f in ("dtype", "shape", "chunks", "tied_to"))

    def __repr__(self) -> str:
        return f"TableEntry({self.table.names[self.i]!r}, {self.dtype}, {self.shape}, {self.table.t_chunks[self.i]} chunk(s))"


def decode_table(raw: Any, files: Mapping[str, Any], block_size: int, where: str, body_length: int) -> TensorTable:
    """Check a stored table against every rule of §6.2 and §6.4 (vectorized) and return
    it; any violation is a ``CorruptCheckpointError`` naming ``where``. ``body_length``
    (of the manifest's body) bounds what the columns may inflate to; every declared
    count is checked against it, and the chunk count against the digests, before the
    columns it sizes are inflated."""
    _need(isinstance(raw, dict) and isinstance(raw.get("columns"), dict), where, "not an object with columns")
    names, dtypes, algorithms, cols = raw["names"], raw["dtypes"], raw["algorithms"], raw["columns"]
    _need(isinstance(names, list) and all(type(n) is str for n in names), where, "names are not strings")
    _need(len(set(names)) == len(names), where, "a tensor name is listed twice")
    _need(isinstance(dtypes, list) and isinstance(algorithms, list), where, "bad dtype or algorithm list")
    itemsizes = np.asarray([itemsize_of(d, f"{where}: tensor table") for d in dtypes] or [1],
                           dtype=np.int64)
    _need(all(a in ALGORITHM_WIDTH for a in algorithms), where, f"unknown checksum algorithm in {algorithms!r}")
    digests = _digests(raw["digests"], where)
    inflation = _Inflation(body_length, where)
    n = len(names)
    t = {c: inflation.column(cols.get(c), n, c) for c in TENSOR_COLUMNS}
    t_dtype, ndim, nchunks, tied = t["dtype"], t["ndim"], t["chunks"], t["tied"]
    _need(n == 0 or (t_dtype.min() >= 0 and t_dtype.max() < len(dtypes)), where, "dtype index out of range")
    _need(n == 0 or (ndim.min() >= 0 and ndim.max() <= MAX_DIMS), where, f"a tensor has more than {MAX_DIMS} dimensions")
    _need(n == 0 or (tied.min() >= -1 and tied.max() < n and not np.any(tied == np.arange(n))), where,
          "a tensor is tied to an unknown tensor or to itself")
    shape = inflation.column(cols.get("shape"), _total(ndim, where, "ndim"), "shape")
    n_chunks = _total(nchunks, where, "chunk counts")
    _need(n_chunks * _MIN_DIGEST <= len(digests), where,
          f"{n_chunks} chunks declared, but the block digests hold at most {len(digests) // _MIN_DIGEST} "
          "(truncated or altered)")
    _need(shape.size == 0 or shape.min() >= 0, where, "negative dimension")
    c = {k: inflation.column(cols.get(k), n_chunks, k) for k in CHUNK_COLUMNS}
    c_file, c_start, c_length, c_alg = c["file"], c["start"], c["length"], c["algorithm"]
    c_tensor = np.repeat(np.arange(n, dtype=np.int64), nchunks)
    n_dims = _total(ndim[c_tensor], where, "chunk dimensions")
    offsets = inflation.column(cols.get("offsets"), n_dims, "offsets")
    box = inflation.column(cols.get("box"), n_dims, "box")
    sizes = np.asarray([f.size for f in files.values()] or [0], dtype=np.int64)
    if n_chunks:
        rule = functools.partial(_chunk_rule, c_tensor, names)
        rule((c_file < 0) | (c_file >= len(files)), where, "a chunk names a file not in the list")
        rule((c_alg < 0) | (c_alg >= len(algorithms)), where, "a chunk names an unknown checksum algorithm")
        rule((c_start < 0) | (c_length < 0), where, "a chunk has a negative byte offset or length")
        size = sizes[c_file]
        rule((c_start > size) | (c_length > size - c_start), where, "a chunk's byte range does not fit", c_file, files)
    _check_boxes(names, shape, ndim, itemsizes[t_dtype], nchunks, c_tensor, c_length, offsets, box, where)
    width = np.asarray([ALGORITHM_WIDTH[a] for a in algorithms] or [0], dtype=np.int64)
    sums = np.maximum(1, -(-c_length // block_size))
    _need(len(digests) == int((sums * width[c_alg]).sum()), where,
          "the block digests do not match the chunks (truncated or altered)")
    _check_coverage(names, shape, ndim, nchunks, offsets, box, where)
    table = TensorTable(names, dtypes, algorithms, list(files), block_size, t_dtype=t_dtype, t_ndim=ndim,
                        t_chunks=nchunks, t_tied=tied, shape=shape, c_file=c_file, c_start=c_start,
                        c_length=c_length, c_alg=c_alg, offsets=offsets, box=box, digests=digests)
    table.check_ties(where)
    return table


def _digests(text: Any, where: str) -> bytes:
    """The raw block digests (base64 in the manifest)."""
    try:
        if isinstance(text, str):
            return base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        pass
    raise CorruptCheckpointError(f"{where}: tensor table: the block digests are garbled (truncated or altered)")


def tie_error(where: str, name: str, first: str) -> CorruptCheckpointError:
    """A tensor tied to another whose dtype, shape or chunks it does not repeat: a reader
    would hand out ``first``'s values under ``name``."""
    return CorruptCheckpointError(
        f"{where}: tensor {name!r} is tied to {first!r} but does not repeat it (a tie has the same dtype, shape "
        "and chunks as its tensor): crafted or altered; restore from another checkpoint")


def _runs_differ(values: np.ndarray, a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray,
                 b_hi: np.ndarray) -> np.ndarray:
    """For each pair ``k``: whether ``values[a_lo[k]:a_hi[k]]`` and ``values[b_lo[k]:b_hi[k]]``
    differ (in length or in any value)."""
    lengths = a_hi - a_lo
    differ = lengths != b_hi - b_lo
    same = np.flatnonzero(~differ)
    unequal = values[segments(a_lo[same], lengths[same])] != values[segments(b_lo[same], lengths[same])]
    differ[same] = np.bincount(np.repeat(np.arange(len(same)), lengths[same])[unequal], minlength=len(same)) > 0
    return differ


def _chunk_rule(c_tensor: np.ndarray, names: list[str], bad: np.ndarray, where: str, what: str,
                c_file: np.ndarray | None = None, files: Mapping[str, Any] | None = None) -> None:
    """Raise naming the tensor (and, given ``files``, the file) of the first chunk flagged
    in ``bad``."""
    found = np.flatnonzero(bad)
    if found.size:
        j = int(found[0])
        file = f" {list(files)[int(c_file[j])]}" if files is not None and c_file is not None else ""
        raise CorruptCheckpointError(f"{where}: tensor {names[int(c_tensor[j])]!r}: {what}{file}")


def _products(values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Float64 products per segment ``[at[g], at[g+1])`` (1 when empty): overflow tests."""
    out = np.ones(len(at) - 1, dtype=np.float64)
    nonempty = at[1:] > at[:-1]
    if values.size:
        prod = np.multiply.reduceat(values.astype(np.float64), at[:-1][nonempty])
        out[nonempty] = prod
    return out


def _exact_products(values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Int64 products per segment ``[at[g], at[g+1])`` (1 when empty); the caller has
    checked that they fit."""
    out = np.ones(len(at) - 1, dtype=np.int64)
    nonempty = at[1:] > at[:-1]
    if values.size:
        out[nonempty] = np.multiply.reduceat(values, at[:-1][nonempty])
    return out


def _check_boxes(names: list[str], shape: np.ndarray, ndim: np.ndarray, itemsize: np.ndarray,
                 nchunks: np.ndarray, c_tensor: np.ndarray, c_length: np.ndarray, offsets: np.ndarray,
                 box: np.ndarray, where: str) -> np.ndarray:
    """Shapes that torch can allocate, boxes inside their tensors, byte lengths that match
    the boxes; returns every tensor's element count."""
    shape_at = np.concatenate(([0], np.cumsum(ndim))).astype(np.int64)
    roomy = np.maximum(shape, 1)
    approx = _products(roomy, shape_at) * itemsize
    for i in np.flatnonzero(approx >= 2.0 ** 62).tolist():  # near the limit: decide exactly
        dims = shape[shape_at[i]:shape_at[i + 1]].tolist()
        if math.prod(max(d, 1) for d in dims) * int(itemsize[i]) >= 2**63:
            raise CorruptCheckpointError(f"{where}: tensor {names[i]!r}: bad shape {str(dims)[:100]}")
    volumes = _exact_products(shape, shape_at)
    if not len(c_tensor):
        return volumes
    _need(offsets.min() >= 0 and box.min() >= 0, where, "negative chunk offset or shape")
    # the tensor dimension each chunk dimension belongs to
    c_ndim = ndim[c_tensor]
    dim_at = np.concatenate(([0], np.cumsum(c_ndim))).astype(np.int64)
    tdim = segments(shape_at[:-1][c_tensor], c_ndim)
    bound = shape[tdim]
    bad = np.flatnonzero((offsets > bound) | (box > bound - offsets))
    if bad.size:
        j = int(np.searchsorted(dim_at, bad[0], side="right") - 1)
        raise CorruptCheckpointError(f"{where}: tensor {names[int(c_tensor[j])]!r}: chunk box outside the tensor")
    c_volume = _exact_products(box, dim_at)
    bad = np.flatnonzero(c_length != c_volume * itemsize[c_tensor])
    if bad.size:
        raise CorruptCheckpointError(f"{where}: tensor {names[int(c_tensor[bad[0]])]!r}: "
                                     "byte length does not match its chunk's shape")
    # volumes add up (exact int64 sums, with a float64 sum ruling out wrap-around)
    first = np.concatenate(([0], np.cumsum(nchunks))).astype(np.int64)[:-1]
    has = nchunks > 0
    total = np.zeros(len(names), dtype=np.int64)
    approx_total = np.zeros(len(names), dtype=np.float64)
    total[has] = np.add.reduceat(c_volume, first[has])
    approx_total[has] = np.add.reduceat(c_volume.astype(np.float64), first[has])
    bad = np.flatnonzero((total != volumes) | (np.abs(approx_total - volumes) > 1 + volumes * 1e-6))
    if bad.size:
        i = int(bad[0])
        raise CorruptCheckpointError(f"{where}: tensor {names[i]!r}: the pieces cover {int(approx_total[i])} of "
                                     f"{int(volumes[i])} elements; every element must be held by exactly one box")
    return volumes


def _check_coverage(names: list[str], shape: np.ndarray, ndim: np.ndarray, nchunks: np.ndarray,
                    offsets: np.ndarray, box: np.ndarray, where: str) -> None:
    """Chunks tile their tensor: volumes add up and boxes lie inside (checked before); a
    single chunk is the whole tensor; several pass ``plan.check_tilings``."""
    shape_at = np.concatenate(([0], np.cumsum(ndim))).astype(np.int64)
    first = np.concatenate(([0], np.cumsum(nchunks))).astype(np.int64)
    c_ndim = np.repeat(ndim, nchunks)
    c_tensor = np.repeat(np.arange(len(names), dtype=np.int64), nchunks)
    dim_at = np.concatenate(([0], np.cumsum(c_ndim))).astype(np.int64)
    single = np.flatnonzero(nchunks == 1)
    if single.size:  # the box equals the tensor's shape (its offsets are then 0)
        rows = segments(dim_at[first[single]], ndim[single])
        tdims = segments(shape_at[single], ndim[single])
        bad = np.flatnonzero(box[rows] != shape[tdims])
        if bad.size:
            i = int(single[np.searchsorted(np.cumsum(ndim[single]), bad[0], side="right")])
            raise CorruptCheckpointError(f"{where}: tensor {names[i]!r}: its chunk does not cover it")
    multi = nchunks[c_tensor] > 1
    for k in np.unique(c_ndim[multi]).tolist():  # several chunks: one batch per number of dimensions
        rows = np.flatnonzero(multi & (c_ndim == k))
        at = dim_at[rows][:, None] + np.arange(k, dtype=np.int64)
        tensors = np.flatnonzero((nchunks > 1) & (ndim == k))
        local = np.zeros(len(names), dtype=np.int64)
        local[tensors] = np.arange(len(tensors), dtype=np.int64)
        try:
            check_tilings([names[i] for i in tensors.tolist()],
                          [tuple(shape[shape_at[i]:shape_at[i + 1]].tolist()) for i in tensors.tolist()],
                          local[c_tensor[rows]], offsets[at], box[at])
        except PlanError as exc:
            raise CorruptCheckpointError(f"{where}: {exc}") from exc
