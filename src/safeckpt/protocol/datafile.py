"""Data files: standard safetensors files written by streaming tensor memory to storage.

Layout: 8-byte little-endian header length N, N bytes of JSON header (padded with
spaces to a multiple of 8), then every piece's bytes back to back. The manifest
records each piece's absolute byte range and block checksums, and the header's
checksum, so every byte of the file is covered.
"""

from __future__ import annotations

import ctypes
import functools
import json
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]  # json.dumps' own, in C
from typing import TYPE_CHECKING, Generator, Iterable, Iterator

import torch

from ..format.checksum import block_checksums, slice_checksums
from ..format.tensors import SAFETENSORS_DTYPES, byte_view, nbytes_of, to_storable

if TYPE_CHECKING:
    from ..storage import Storage

COALESCE_BELOW = 1 << 20  # pieces smaller than this are gathered into one write
COALESCE_BUFFER = 1 << 20  # a fresh region that stays in cache while it is filled, hashed and written: a
# save's copy of 20,000 small tensors into fresh 8 MiB regions cost 1.7x (staged saves reuse theirs: STAGED_REGION)


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


def plan_layout(pieces: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> DataFileLayout:
    """Place pieces back to back after a safetensors header (no data is touched).
    ``__metadata__`` is reserved by safetensors: a tensor of that name is stored as
    ``___metadata__`` (the manifest keeps the real name). The header is the text
    ``json.dumps`` writes for it (compact separators), joined from a few short strings
    per piece, the part after the name made once per dtype and shape: a dict and a JSON
    encoder cost several times more per piece."""
    offset = 0
    starts = []
    texts = ['{"__metadata__":' + json.dumps(metadata, separators=(",", ":"))]
    add, quote, described = texts.append, encode_basestring_ascii, _described
    for name, t in pieces:
        text, n = described(t.dtype, t.shape)
        add(f',{quote("_" + name if name == "__metadata__" else name)}{text}{offset},{offset + n}]}}')
        starts.append(offset)
        offset += n
    starts.append(offset)
    texts.append("}")
    header = "".join(texts).encode()
    header += b" " * (-len(header) % 8)
    prefix = struct.pack("<Q", len(header)) + header
    base = len(prefix)
    entries = [(name, t, base + a, base + b) for (name, t), a, b in zip(pieces, starts, starts[1:])]
    return DataFileLayout(prefix, entries)


@functools.lru_cache(maxsize=4096)
def _described(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[str, int]:
    """A header entry's text between its name and its offsets, and its size in bytes,
    for a dtype and shape (states hold few distinct ones). Dtypes safetensors does not
    know are stored as their raw bytes (``U8``)."""
    n = nbytes_of(shape, dtype)
    code = SAFETENSORS_DTYPES.get(dtype)
    dims = ",".join(map(str, shape)) if code else str(n)
    return f':{{"dtype":"{code or "U8"}","shape":[{dims}],"data_offsets":[', n


def stream(layout: DataFileLayout, written: list[WrittenPiece],
           known: list[list[str]] | None = None) -> Generator[memoryview | bytes, None, None]:
    """Yield the file's bytes in large pieces and fill ``written`` with every piece's
    checksums (or ``known``, checksums computed before). Small pieces are coalesced to
    save system calls; large ones are hashed on a helper thread while they are written
    (both release the GIL)."""
    return hashed_while_written(_pieces(layout, written, known))


def hashed_while_written(parts: Iterable[tuple["memoryview | bytes", WrittenPiece | None]]
                         ) -> Generator[memoryview | bytes, None, None]:
    """Yield each part's bytes; a part that comes with a piece is hashed on a helper
    thread while it is written, its checksums filled into ``piece.checksums`` in place
    (whoever holds that list, a manifest being built, sees them)."""
    with ThreadPoolExecutor(1, thread_name_prefix="safeckpt-hash") as hasher:
        hashing: list[tuple[WrittenPiece, Future]] = []
        for data, piece in parts:
            if piece is not None:
                hashing.append((piece, hasher.submit(block_checksums, data)))
            yield data
        for piece, future in hashing:
            piece.checksums[:] = future.result()


def write_data_file(storage: "Storage", name: str, layout: DataFileLayout, written: list[WrittenPiece],
                    known: list[list[str]] | None = None) -> int:
    """Write a data file (see ``stream``) and return its size."""
    return write_parts(storage, name, stream(layout, written, known))


def write_parts(storage: "Storage", name: str, parts: Generator[memoryview | bytes, None, None]) -> int:
    """Write a file from a generator of its bytes and return its size. A failed write
    leaves the generator suspended: it is closed here, so its hashing thread stops before
    this returns (left to the garbage collector, it was once closed inside another
    thread's start)."""
    try:
        return storage.write_file(name, parts)
    finally:
        parts.close()


def runs(entries: list[tuple[str, torch.Tensor, int, int]], region: int | None = None
         ) -> Iterator[tuple[int, int, bool]]:
    """The entries of a layout as ``(first, stop, small)``: runs of consecutive small
    pieces, gathered into one region of about ``region`` bytes (one write; default
    ``COALESCE_BUFFER``), and each large piece alone."""
    below, buffer = COALESCE_BELOW, COALESCE_BUFFER if region is None else region
    i, n = 0, len(entries)
    while i < n:
        base = entries[i][2]
        if entries[i][3] - base >= below:
            yield i, i + 1, False
            i += 1
            continue
        j = i + 1  # pieces are back to back: a region's size so far is where the next piece starts
        while j < n and entries[j][3] - entries[j][2] < below and entries[j][2] - base < buffer:
            j += 1
        yield i, j, True
        i = j


def _pieces(layout: DataFileLayout, written: list[WrittenPiece],
            known: list[list[str]] | None) -> Iterator[tuple["memoryview | bytes", WrittenPiece | None]]:
    yield layout.header, None
    entries = layout.entries
    for i, j, small in runs(entries):
        if small:
            yield _small_run(entries[i:j], i, entries[j - 1][3] - entries[i][2], written, known), None
            continue
        name, t, start, end = entries[i]
        piece = WrittenPiece(name, start, end, known[i] if known is not None else [])
        written.append(piece)
        yield byte_view(to_storable(t, name)), (None if piece.checksums else piece)


def _small_run(run: list[tuple[str, torch.Tensor, int, int]], first: int, size: int,
               written: list[WrittenPiece], known: list[list[str]] | None) -> memoryview:
    """Consecutive small pieces copied into one buffer (one ``memmove`` from each
    tensor's memory, no torch op per piece) and hashed as slices of it in one loop
    (``slice_checksums``): a few microseconds per piece."""
    region = bytearray(size)
    view = memoryview(region)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region)) - run[0][2] if size else 0
    move = ctypes.memmove
    for name, t, start, end in run:
        if end > start:
            src = to_storable(t, name)  # held: a copy (of a strided view, a GPU tensor) must outlive the move
            move(address + start, src.data_ptr(), end - start)
    names, starts, ends = zip(*((name, start, end) for name, _, start, end in run))
    sums = known[first:first + len(run)] if known is not None else region_checksums(view, run)
    written.extend(map(WrittenPiece, names, starts, ends, sums))
    return view


def region_checksums(region: memoryview, run: list[tuple[str, torch.Tensor, int, int]]) -> list[list[str]]:
    """The checksums of a run of small pieces packed back to back in ``region``."""
    base = run[0][2]
    return slice_checksums(region, [(start - base, end - base) for _, _, start, end in run])
