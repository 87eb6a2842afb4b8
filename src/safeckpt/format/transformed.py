"""Tensors stored through stream transforms (compression, encryption: DCP's
``_extensions``), as a manifest records them (format 4, docs/format.md §6.4).

A transformed chunk's stored bytes are not the tensor's bytes, so the tensor table
(``compact``) holds such a tensor as what is stored: a 1-D ``uint8`` tensor whose chunks
are the stored streams, each with its block checksums (``verify`` checks them without
the transforms' code). The manifest's ``transformed`` field says what the streams decode
to: the tensor's dtype and shape, each chunk's box (in the table's chunk order) and the
transforms. A decoded manifest presents the tensor as it was saved (``WithTransformed``),
its chunks as ``StoredChunk`` objects that carry their transforms; ``split`` is the way
back to what is stored.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError
from .compact import TableEntry, TensorTable
from .plan import PlanError, check_coverage, volume
from .records import Chunk, TensorEntry
from .dtypes import is_shape, itemsize_of

TRANSFORMED_VERSION = 4  # the format version a manifest with transformed tensors declares
STORED_DTYPE = "uint8"
MAX_TRANSFORMS = 16  # transforms of one tensor (a stream may be compressed, then encrypted, ...)
MAX_DESCRIPTOR = 256  # characters of one transform's descriptor


@dataclass
class StoredChunk(Chunk):
    """A chunk stored through stream transforms: ``start``, ``end`` and ``checksums`` are
    those of the stored stream, ``offsets`` and ``shape`` its box in the tensor.
    ``transforms`` (descriptors) are in the order they were applied when it was written:
    reading undoes them last to first."""

    transforms: list[str] = field(default_factory=list)


def is_transformed(chunk: Chunk) -> bool:
    return isinstance(chunk, StoredChunk)


class WithTransformed(Mapping[str, "TensorEntry | TableEntry"]):
    """A decoded manifest's tensors when some are transformed: the table's entries, and
    for each transformed tensor its entry as saved (dtype, shape, ``StoredChunk``s)."""

    def __init__(self, table: Mapping[str, TensorEntry | TableEntry], transformed: dict[str, TensorEntry],
                 record: dict[str, Any]) -> None:
        self.table, self.transformed, self.record = table, transformed, record

    def __getitem__(self, name: str) -> TensorEntry | TableEntry:
        found = self.transformed.get(name)
        return found if found is not None else self.table[name]

    def __contains__(self, name: object) -> bool:
        return name in self.table

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)


def split(tensors: Mapping[str, TensorEntry | TableEntry]) -> tuple[Mapping[str, TensorEntry | TableEntry], dict]:
    """What the tensor table stores (each transformed tensor as its ``uint8`` streams)
    and the ``transformed`` record (empty when nothing is transformed)."""
    if isinstance(tensors, WithTransformed):
        return tensors.table, tensors.record
    if isinstance(tensors, TensorTable) or not any(isinstance(e, TensorEntry) and e.chunks and
                                                is_transformed(e.chunks[0]) for e in tensors.values()):
        return tensors, {}
    stored: dict[str, TensorEntry | TableEntry] = {}
    record: dict[str, Any] = {}
    for name, entry in tensors.items():
        chunks = entry.chunks
        first = chunks[0] if chunks else None
        if not isinstance(first, StoredChunk):
            stored[name] = entry
            continue
        if not all(isinstance(c, StoredChunk) and c.transforms == first.transforms for c in chunks):
            raise ValueError(f"tensor {name!r}: its chunks must all be stored through the same transforms")
        at, parts = 0, []
        for c in chunks:
            parts.append(Chunk(c.file, c.start, c.end, c.checksums, [at], [c.end - c.start]))
            at += c.end - c.start
        stored[name] = TensorEntry(STORED_DTYPE, [at], parts)
        record[name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                        "transforms": list(first.transforms),
                        "chunks": [[list(c.offsets), list(c.shape)] for c in chunks]}
    return stored, record


def _need(cond: bool, where: str, name: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"{where}: transformed tensor {name!r}: {what}")


def _nat_list(value: Any, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(type(v) is int and v >= 0 for v in value)


def decode(table: Mapping[str, TensorEntry | TableEntry], raw: Any, where: str) -> WithTransformed:
    """The ``transformed`` record of a manifest whose table is ``table``, checked: each
    tensor is a 1-D ``uint8`` table entry with one stored stream per box, the boxes tile
    the tensor, the transforms are descriptors."""
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{where}: the transformed record is not an object")
    out: dict[str, TensorEntry] = {}
    for name, rec in raw.items():
        stored = table.get(name)
        _need(stored is not None and stored.dtype == STORED_DTYPE and len(stored.shape) == 1
              and stored.tied_to is None, where, name, "not a 1-D uint8 tensor of the table")
        assert stored is not None  # checked just above
        _need(isinstance(rec, dict) and type(rec.get("dtype")) is str, where, name, "malformed entry")
        itemsize = itemsize_of(rec["dtype"], f"{where}: transformed tensor {name!r}")
        shape, transforms, boxes = rec.get("shape"), rec.get("transforms"), rec.get("chunks")
        _need(is_shape(shape, itemsize), where, name, f"bad shape {str(shape)[:100]}")
        assert isinstance(shape, list)  # is_shape checked it
        _need(isinstance(transforms, list) and 0 < len(transforms) <= MAX_TRANSFORMS and all(
            type(t) is str and 0 < len(t) <= MAX_DESCRIPTOR for t in transforms), where, name, "bad transforms")
        chunks = stored.chunks
        _need(isinstance(boxes, list) and len(boxes) == len(chunks), where, name,
              f"{len(boxes) if isinstance(boxes, list) else 'no'} boxes for {len(chunks)} stored streams")
        assert isinstance(boxes, list)  # checked just above
        for box in boxes:
            _need(isinstance(box, list) and len(box) == 2 and _nat_list(box[0], len(shape))
                  and _nat_list(box[1], len(shape)), where, name, f"bad box {str(box)[:100]}")
        try:
            check_coverage(name, tuple(shape), [(tuple(o), tuple(s)) for o, s in boxes])
        except PlanError as exc:
            raise CorruptCheckpointError(f"{where}: transformed {exc}") from exc
        out[name] = TensorEntry(rec["dtype"], shape, [
            StoredChunk(c.file, c.start, c.end, c.checksums, o, s, list(transforms))
            for c, (o, s) in zip(chunks, boxes)])
    return WithTransformed(table, out, raw)


def decoded_size(chunk: Chunk, itemsize: int) -> int:
    """The bytes a chunk holds once its stored stream is decoded."""
    return volume(chunk.shape) * itemsize
