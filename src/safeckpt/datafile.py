"""Data files: standard safetensors files written by streaming tensor memory to storage.

Layout: 8-byte little-endian header length N, N bytes of JSON header (padded with
spaces to a multiple of 8), then every tensor's bytes back to back. The manifest
records each tensor's absolute byte range and checksum, and the header's checksum,
so every byte of the file is covered.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from .checksum import checksum
from .tensors import SAFETENSORS_DTYPES, byte_view, nbytes_of, to_storable

COALESCE_BELOW = 1 << 20  # tensors smaller than this are gathered into one write
COALESCE_BUFFER = 8 << 20


@dataclass
class WrittenChunk:
    """Where one tensor landed in a data file."""

    name: str
    start: int
    end: int
    checksum: str


@dataclass
class DataFileLayout:
    """The header of a data file and where each tensor goes; computed before writing."""

    header: bytes
    entries: list[tuple[str, torch.Tensor, int, int]]  # name, tensor, start, end

    @property
    def size(self) -> int:
        return self.entries[-1][3] if self.entries else len(self.header)


def plan_layout(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> DataFileLayout:
    """Place contiguous CPU tensors back to back after a safetensors header."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    spans = []
    for name, t in tensors:
        n = nbytes_of(t.shape, t.dtype)
        code = SAFETENSORS_DTYPES.get(t.dtype)
        shape = list(t.shape) if code else [n]
        header[name] = {"dtype": code or "U8", "shape": shape, "data_offsets": [offset, offset + n]}
        spans.append((offset, offset + n))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    base = len(prefix)
    entries = [(name, t, base + a, base + b) for (name, t), (a, b) in zip(tensors, spans)]
    return DataFileLayout(prefix, entries)


def stream(layout: DataFileLayout, chunks_out: list[WrittenChunk]) -> Iterator[memoryview | bytes]:
    """Yield the file's bytes in large pieces and fill ``chunks_out`` with every tensor's
    checksum. Small tensors are coalesced to save system calls; large ones are hashed on
    a helper thread while the previous piece is written (both release the GIL)."""
    with ThreadPoolExecutor(1, thread_name_prefix="safeckpt-hash") as hasher:
        pending_sums: list[tuple[WrittenChunk, Future]] = []
        yield from _pieces(layout, chunks_out, hasher, pending_sums)
        for chunk, future in pending_sums:
            chunk.checksum = future.result()


def _pieces(layout: DataFileLayout, chunks_out: list[WrittenChunk], hasher: ThreadPoolExecutor,
            pending_sums: list[tuple[WrittenChunk, Future]]) -> Iterator[memoryview | bytes]:
    yield layout.header
    pending = bytearray()
    for name, t, start, end in layout.entries:
        t = to_storable(t, name)
        view = byte_view(t)
        chunk = WrittenChunk(name, start, end, "")
        chunks_out.append(chunk)
        if end - start < COALESCE_BELOW:
            chunk.checksum = checksum(view)
            pending += view
            if len(pending) >= COALESCE_BUFFER:
                yield pending
                pending = bytearray()
            continue
        pending_sums.append((chunk, hasher.submit(checksum, view)))
        if pending:
            yield pending
            pending = bytearray()
        yield view
    if pending:
        yield pending


def read_header_length(prefix: bytes) -> int:
    """The header length stored in a data file's first 8 bytes."""
    return struct.unpack("<Q", prefix[:8])[0]
