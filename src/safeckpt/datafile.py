"""Data files: standard safetensors files written by streaming tensor memory to storage.

Layout: 8-byte little-endian header length N, N bytes of JSON header (padded with
spaces to a multiple of 8), then every piece's bytes back to back. The manifest
records each piece's absolute byte range and block checksums, and the header's
checksum, so every byte of the file is covered.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from .checksum import block_checksums
from .tensors import SAFETENSORS_DTYPES, byte_view, nbytes_of, to_storable

if TYPE_CHECKING:
    from .storage import Storage

COALESCE_BELOW = 1 << 20  # pieces smaller than this are gathered into one write
COALESCE_BUFFER = 8 << 20


@dataclass
class WrittenPiece:
    """Where one piece landed in a data file, and its block checksums."""

    name: str
    start: int
    end: int
    checksums: list[str] = field(default_factory=list)


@dataclass
class DataFileLayout:
    """The header of a data file and where each piece goes; computed before writing."""

    header: bytes
    entries: list[tuple[str, torch.Tensor, int, int]]  # name, tensor, start, end

    @property
    def size(self) -> int:
        return self.entries[-1][3] if self.entries else len(self.header)


def _header_key(name: str) -> str:
    # "__metadata__" is reserved by safetensors; the manifest keeps the real name
    return "_" + name if name == "__metadata__" else name


def plan_layout(pieces: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> DataFileLayout:
    """Place pieces back to back after a safetensors header (no data is touched)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    spans = []
    for name, t in pieces:
        n = nbytes_of(t.shape, t.dtype)
        code = SAFETENSORS_DTYPES.get(t.dtype)
        shape = list(t.shape) if code else [n]
        header[_header_key(name)] = {"dtype": code or "U8", "shape": shape, "data_offsets": [offset, offset + n]}
        spans.append((offset, offset + n))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    base = len(prefix)
    entries = [(name, t, base + a, base + b) for (name, t), (a, b) in zip(pieces, spans)]
    return DataFileLayout(prefix, entries)


def stream(layout: DataFileLayout, written: list[WrittenPiece],
           known: list[list[str]] | None = None) -> Iterator[memoryview | bytes]:
    """Yield the file's bytes in large pieces and fill ``written`` with every piece's
    checksums (or ``known``, checksums computed before). Small pieces are coalesced to
    save system calls; large ones are hashed on a helper thread while they are written
    (both release the GIL)."""
    with ThreadPoolExecutor(1, thread_name_prefix="safeckpt-hash") as hasher:
        hashing: list[tuple[WrittenPiece, Future]] = []
        yield from _pieces(layout, written, hasher, hashing, known)
        for piece, future in hashing:
            piece.checksums = future.result()


def write_data_file(storage: "Storage", name: str, layout: DataFileLayout, written: list[WrittenPiece],
                    known: list[list[str]] | None = None) -> int:
    """Write a data file (see ``stream``) and return its size. A failed write leaves the
    stream suspended: it is closed here, so its hashing thread stops before this returns
    (left to the garbage collector, it was once closed inside another thread's start)."""
    parts = stream(layout, written, known)
    try:
        return storage.write_file(name, parts)
    finally:
        parts.close()


def _pieces(layout: DataFileLayout, written: list[WrittenPiece], hasher: ThreadPoolExecutor,
            hashing: list[tuple[WrittenPiece, Future]],
            known: list[list[str]] | None) -> Iterator[memoryview | bytes]:
    yield layout.header
    pending = bytearray()
    for i, (name, t, start, end) in enumerate(layout.entries):
        view = byte_view(to_storable(t, name))
        piece = WrittenPiece(name, start, end, known[i] if known is not None else [])
        written.append(piece)
        if end - start < COALESCE_BELOW:
            piece.checksums = piece.checksums or block_checksums(view)
            pending += view
            if len(pending) >= COALESCE_BUFFER:
                yield pending
                pending = bytearray()
            continue
        if not piece.checksums:
            hashing.append((piece, hasher.submit(block_checksums, view)))
        if pending:
            yield pending
            pending = bytearray()
        yield view
    if pending:
        yield pending


def read_header_length(prefix: bytes) -> int:
    """The header length stored in a data file's first 8 bytes."""
    return struct.unpack("<Q", prefix[:8])[0]
