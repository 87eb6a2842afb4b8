"""Host buffers that an async save copies the state into, reused from save to save.

Two ways to fill them: ``snapshot`` copies every piece into a buffer of its own (a
save whose layout is decided later, by the ranks together), and ``stage`` copies the
pieces into buffers arranged as the data file they will become (small pieces packed
into regions of about 8 MiB, one write each; large pieces in a buffer each), and
checksums the small ones while they are in cache. Either way host memory is one copy
of the state's tensors; buffers a save no longer needs are dropped. Buffers are
pinned where a piece lives on a GPU, so its copy is a DMA the host does not wait for
piece by piece: one synchronization per save.
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from typing import Callable, Protocol, Union

import torch

from .datafile import DataFileLayout, WrittenPiece, region_checksums, runs
from .state import FlatState, Piece
from ..format.tensors import byte_view, holds_values

Part = Union[bytes, memoryview]
STAGED_REGION = 8 << 20  # staged regions are reused from save to save, so their size costs no page faults;
# fewer writes are fewer GIL handoffs on the background thread (each may wait a switch interval)


@dataclass
class StagedFile:
    """A data file in host memory: its parts in file order, each with the piece still
    to hash while it is written (large pieces) or ``None``, and every piece's record."""

    parts: list[tuple[Part, WrittenPiece | None]]
    written: list[WrittenPiece]


class Stager(Protocol):
    """What arranges a data file's bytes for a staged save: ``StagingPool`` (copies) or
    ``arena.BufferStager`` (slices of a buffer that already holds them)."""

    def stage(self, layout: DataFileLayout) -> StagedFile: ...


def staged_file(layout: DataFileLayout, place: "Callable[[int, int, bool], tuple[memoryview, bool]]",
                landed: "Callable[[], None]" = lambda: None) -> StagedFile:
    """The parts of ``layout``'s data file, in order: ``place(first, stop, small)`` gives
    the bytes of each run of entries (``runs``: a region of small pieces, or one large
    piece) and whether they can be hashed now; those that cannot are hashed after
    ``landed()`` (copies from a GPU still in flight). Small pieces get their checksums
    here, while their region is in cache; a large piece is hashed while it is written."""
    entries = layout.entries
    parts: list[tuple[Part, WrittenPiece | None]] = [(layout.header, None)]
    written: list[WrittenPiece] = []
    later: list[tuple[int, int, memoryview]] = []
    for i, j, small in runs(entries, STAGED_REGION):
        data, now = place(i, j, small)
        if not small:
            name, _, start, end = entries[i]
            piece = WrittenPiece(name, start, end)
            written.append(piece)
            parts.append((data, piece))
            continue
        run = entries[i:j]
        parts.append((data, None))
        sums: list[list[str]] = region_checksums(data, run) if now else [[] for _ in run]
        written += map(WrittenPiece, map(_NAME, run), map(_START, run), map(_END, run), sums)
        if not now:
            later.append((i, j, data))
    landed()
    for i, j, data in later:
        for w, checksums in zip(written[i:j], region_checksums(data, entries[i:j])):
            w.checksums[:] = checksums
    return StagedFile(parts, written)


def bytes_of(src: torch.Tensor) -> torch.Tensor:
    """The values of a tensor as a flat ``uint8`` tensor on its device."""
    return src.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def synchronize(devices: "set[torch.device]") -> None:
    """Wait for the asynchronous copies from these GPUs (each device has its own queue)."""
    for device in devices:
        torch.cuda.synchronize(device)


_NAME, _TENSOR, _START, _END = (operator.itemgetter(k) for k in range(4))  # of a layout entry
_IS_CUDA = operator.attrgetter("is_cuda")


class StagingPool:
    """Host buffers keyed by piece name (or region), reused while shape and dtype stay."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, shape: "torch.Size | tuple[int, ...]", dtype: torch.dtype,
                pinned: bool) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype or (pinned and not buf.is_pinned()):
            buf = self.buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        return buf

    def _keep_only(self, keys: "set[str] | dict") -> None:
        for key in [k for k in self.buffers if k not in keys]:
            del self.buffers[key]

    @staticmethod
    def _copy(buf: torch.Tensor, src: torch.Tensor, pending: set) -> None:
        """Copy ``src`` into a buffer of its shape and dtype; a copy from a GPU is
        asynchronous, and its device is added to ``pending`` (synchronized once)."""
        if holds_values(src):  # one ``memmove``: no torch op, the GIL released
            if buf.nbytes:
                ctypes.memmove(buf.data_ptr(), src.data_ptr(), buf.nbytes)
            return
        buf.copy_(src.detach(), non_blocking=src.is_cuda)
        if src.is_cuda:
            pending.add(src.device)

    def snapshot(self, flat: FlatState) -> FlatState:
        """Copy every piece into a buffer of its own; returns a FlatState that owns the
        copies."""
        pieces: dict[str, Piece] = {}
        pending: set[torch.device] = set()
        for name, piece in flat.pieces.items():
            src = piece.tensor
            buf = self._buffer(name, src.shape, src.dtype, src.is_cuda)
            self._copy(buf, src, pending)
            pieces[name] = Piece(buf, piece.info)
        synchronize(pending)  # the non-blocking copies must land before we return
        self._keep_only(pieces)
        return FlatState(flat.tree, pieces, flat.aliases, flat.has_local)

    def stage(self, layout: DataFileLayout) -> StagedFile:
        """Copy the pieces of ``layout`` (the source tensors) into buffers arranged as
        its data file. Small pieces are checksummed here; a large piece's
        ``WrittenPiece`` has no checksums yet (they are computed while it is written)."""
        entries = layout.entries
        keys: set[str] = set()
        pending: set[torch.device] = set()

        def place(i: int, j: int, small: bool) -> tuple[memoryview, bool]:
            if not small:
                name, src = entries[i][0], entries[i][1]
                key = "piece:" + name
                buf = self._buffer(key, src.shape, src.dtype, src.is_cuda)
                self._copy(buf, src, pending)
                pinned = False  # hashed while it is written, after the copies landed
            else:
                run = entries[i:j]
                key = f"region:{len(keys)}"  # one buffer per region: each is written after all are filled
                pinned = any(map(_IS_CUDA, map(_TENSOR, run)))
                buf = self._buffer(key, (run[-1][3] - run[0][2],), torch.uint8, pinned)
                self._fill_region(buf, run, pending)
            keys.add(key)
            return byte_view(buf), not pinned  # copied from a GPU: hashed once the copies landed

        file = staged_file(layout, place, lambda: synchronize(pending))  # the copies land before we return
        self._keep_only(keys)
        return file

    @staticmethod
    def _fill_region(buf: torch.Tensor, run: list[tuple[str, torch.Tensor, int, int]], pending: set) -> None:
        """Copy consecutive small pieces into their region's buffer: one ``memmove`` each
        from a plain CPU tensor, a torch copy (asynchronous from a GPU) otherwise."""
        base = run[0][2]
        address, move = buf.data_ptr() - base, ctypes.memmove
        for _, src, start, end in run:
            if end == start:
                continue
            if holds_values(src):  # one ``memmove``: no torch op, the GIL released
                move(address + start, src.data_ptr(), end - start)
            else:
                buf[start - base:end - base].copy_(bytes_of(src), non_blocking=src.is_cuda)
                if src.is_cuda:
                    pending.add(src.device)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
