"""Shared-memory staging: an async save by one process hands its state to a writer
process through one buffer both map.

The caller (the training thread) walks the state and copies every tensor into the
buffer, laid out as the data file after its header (pieces back to back, in the order
the file holds them); everything else a save does per tensor (pieces, the data file's
layout, checksums, the manifest) runs in the writer process, on its own interpreter
(``run.writer``). The caller hands over a ``Handover``: the pickled tree and, when the
layout changed, the pieces.

The buffer (``SharedBuffer``) is a ``memfd``: anonymous shared memory that the kernel
frees once no process maps it, so a killed process leaks none. It is reused from save
to save (pages already faulted in) and pinned when tensors live on a GPU (their copies
are then DMAs, one synchronization per save).

The caller's work per tensor is what correctness needs and no more. ``ArenaStaging``
keeps the layout of the previous save and checks, one C-level pass per attribute,
that the state has the same names, shapes and dtypes, its tensors at the same
addresses, contiguous, without a lazy negation or conjugation (so their memory is
their values) as they were; then the bytes are copied, small tensors by one C loop of
slice assignments, large ones by a ``memmove`` each (``_Copies``). Any difference plans
the layout again with ``pieces_of``, which makes the checks of a synchronous save; a
layout with tensors that do not hold their values in order copies each with torch.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import mmap
import operator
import os
import pickle
import secrets
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..format.tensors import dtype_from_name, holds_values
from .datafile import COALESCE_BELOW, DataFileLayout
from .staging import StagedFile, bytes_of, staged_file, synchronize
from .state import FlatState, Piece, Walk, name_tensors, pieces_of, view_key

#: where a writer process can map the buffer: Linux (``memfd_create``, descriptors sent
#: over a Unix socket)
SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "memfd_create")

_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")
_COMPLEX = {torch.complex32, torch.complex64, torch.complex128}


class SharedBuffer:
    """Host memory another process can map: a ``memfd``, mapped read-write here and
    resized to what a save needs (grown when short, shrunk when less than half is
    used, so it stays one copy of the state). ``id`` names it to the writer, which
    receives its descriptor once."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("safeckpt-staging")
        self.id = secrets.token_hex(8)
        self.owner = os.getpid()  # a forked child makes a buffer of its own
        self.size = 0
        self.pinned = False
        self._map: mmap.mmap | None = None
        self.tensor = torch.empty(0, dtype=torch.uint8)  # the mapping, for torch copies into it

    def fit(self, size: int) -> None:
        if size <= self.size and (2 * size >= self.size or size == 0):
            return
        self._unmap()
        os.ftruncate(self.fd, size)
        self.size = size
        if size:
            self._map = mmap.mmap(self.fd, size)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def memory(self) -> memoryview:
        """The whole mapping, writable (release it before the buffer is resized)."""
        return memoryview(self._map) if self._map is not None else memoryview(bytearray())

    def view(self, size: int) -> memoryview:
        """The first ``size`` bytes, read-only (what a save staged)."""
        return memoryview(self._map).toreadonly()[:size] if self._map is not None else memoryview(b"")

    def pin(self) -> None:
        """Page-lock the mapping, so copies from a GPU into it are asynchronous DMAs."""
        if self.pinned or not self.size:
            return
        code = torch.cuda.cudart().cudaHostRegister(self.address, self.size, 1)  # portable: any context
        self.pinned = int(code) == 0  # else copies are still right, only synchronous

    def _unmap(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        _close(self._map)
        self._map = None

    def close(self) -> None:
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class MappedBuffer:
    """The writer's read-only mapping of a ``SharedBuffer`` whose descriptor it received."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None

    def view(self, size: int) -> memoryview:
        """The first ``size`` bytes (the buffer was resized to them before the save)."""
        if self._map is None or len(self._map) != size:
            self._unmap()
            self._map = mmap.mmap(self.fd, size, prot=mmap.PROT_READ) if size else None
        return memoryview(self._map) if self._map is not None else memoryview(b"")

    def _unmap(self) -> None:
        _close(self._map)
        self._map = None

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)


def _close(mapping: "mmap.mmap | None") -> None:
    """Unmap now, or, while a view of it is still alive, when the last one goes."""
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:
            pass


@dataclass
class Handover:
    """What the writer process gets besides the buffer's bytes (pickled, small): the
    tree, and the pieces when the layout is new to it (``plan`` numbers layouts)."""

    buffer: str
    size: int
    plan: int
    tree: bytes
    has_local: bool
    pieces: bytes | None = None  # pickled (PieceInfo list in buffer order, aliases, names); None: it has them

    def without_pieces(self) -> "Handover":
        return Handover(self.buffer, self.size, self.plan, self.tree, self.has_local)


@dataclass
class _Layout:
    """How a state was staged, kept while the next states match it (``ArenaStaging``)."""

    plan: int
    names: list[str]
    boxes: dict[int, tuple[str, Any]]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    pointers: list[int]
    taken: list[int] | None    # the walk index of each piece written, in buffer order (None: all, in order)
    starts: list[int]          # where each piece written starts in the buffer
    sizes: list[int]
    size: int
    direct: bool               # every piece a contiguous CPU tensor holding its values: copied as bytes
    shared: list[tuple[int, tuple]]  # (walk index, view key) of tensors whose memory starts at another's
    pieces: bytes              # pickled for the writer: the pieces, the aliases and every tensor's name
    complex: bool = False
    copies: "_Copies | None" = None  # a direct layout's copies (``copy``)

    def matches(self, walked: Walk, pointers: list[int]) -> bool:
        """``walked`` may be staged as this layout was: every tensor as before but its
        values (see the module docstring). Tensors sharing an address are compared by
        their whole view only where some tensor does not hold its values in order: else
        the same address, shape and dtype are the same view."""
        tensors = walked.tensors
        if walked.names != self.names or walked.boxes != self.boxes or pointers != self.pointers:
            return False
        if list(map(_SHAPE, tensors)) != self.shapes or list(map(_DTYPE, tensors)) != self.dtypes:
            return False
        direct = (all(map(torch.Tensor.is_contiguous, tensors)) and not any(map(torch.Tensor.is_neg, tensors))
                  and not (self.complex and any(map(torch.Tensor.is_conj, tensors))))
        if direct != self.direct:
            return False
        boxes = walked.boxes
        return direct or all(view_key(tensors[i], *_kind_offsets(boxes, i, tensors[i])) == key
                             for i, key in self.shared)

    def copy(self, buffer: SharedBuffer, pointers: list[int]) -> None:
        """Copy a direct layout's pieces, at ``pointers`` (the layout's), into ``buffer``."""
        if self.copies is None:
            written = pointers if self.taken is None else [pointers[i] for i in self.taken]
            self.copies = _Copies(written, self.starts, self.sizes)
        self.copies.run(buffer)


class _Copies:
    """The copies of a direct layout, prepared once: small pieces as slice assignments
    between memoryviews (a C loop over them: about a third of the Python work of a
    ``ctypes.memmove`` each, and the GIL kept), large ones as ``memmove`` (the GIL
    released while megabytes move). The source views hold no reference: they are read
    only while a state that matches the layout (its tensors at these addresses, alive)
    is being copied."""

    def __init__(self, pointers: list[int], starts: list[int], sizes: list[int]) -> None:
        small = [k for k, n in enumerate(sizes) if 0 < n < COALESCE_BELOW]
        self.slices = [slice(starts[k], starts[k] + sizes[k]) for k in small]
        self.sources = [_raw_view(pointers[k], sizes[k], _PYBUF_READ) for k in small]
        self.large = [(starts[k], pointers[k], n) for k, n in enumerate(sizes) if n >= COALESCE_BELOW]

    def run(self, buffer: SharedBuffer) -> None:
        with buffer.memory() as memory:
            collections.deque(map(_SET, itertools.repeat(memory), self.slices, self.sources), maxlen=0)
        base = buffer.address
        for start, pointer, size in self.large:
            ctypes.memmove(base + start, pointer, size)


_SET: Any = operator.setitem  # memoryview[slice] = view, through ``map``: a C loop
_raw_view = ctypes.pythonapi.PyMemoryView_FromMemory  # (address, size, PyBUF_READ): a view owning nothing
_raw_view.restype = ctypes.py_object
_raw_view.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PYBUF_READ = 0x100


def _kind_offsets(boxes: dict[int, tuple[str, Any]], i: int, t: torch.Tensor) -> tuple[str, tuple]:
    kind, box = boxes.get(i, ("replicated", None))
    return kind, ((0,) * t.dim() if box is None else box[1])


class ArenaStaging:
    """The caller's side: one ``SharedBuffer`` and the layout of the last state staged
    into it (see the module docstring). One per saver: a saver stages one save at a time."""

    def __init__(self) -> None:
        self.buffer: SharedBuffer | None = None
        self.layout: _Layout | None = None
        self._plans = itertools.count(1)

    def stage(self, walked: Walk) -> Handover:
        """Copy the tensors of ``walked`` into the buffer; what the writer needs besides."""
        if self.buffer is None or self.buffer.owner != os.getpid():
            self.buffer, self.layout = SharedBuffer(), None  # a forked child never writes into its parent's
        tensors = walked.tensors
        try:
            pointers = list(map(torch.Tensor.data_ptr, tensors))
        except RuntimeError:  # a tensor without memory (sparse, meta...): planned to say so
            pointers = []
        layout = self.layout
        if layout is None or not layout.matches(walked, pointers):
            layout = self.layout = self._plan(walked)
        buffer = self.buffer
        buffer.fit(layout.size)
        if layout.direct:
            layout.copy(buffer, pointers)
        else:
            self._copy(layout, tensors, buffer)
        return Handover(buffer.id, layout.size, layout.plan, pickle.dumps(walked.tree, pickle.HIGHEST_PROTOCOL),
                        walked.has_local, layout.pieces)

    def _plan(self, walked: Walk) -> _Layout:
        """Lay out a state afresh: ``pieces_of`` checks every tensor and finds ties."""
        flat = pieces_of(walked)
        tensors = walked.tensors
        index = {name: i for i, name in enumerate(walked.names)}
        taken = [index[name] for name in flat.pieces] if flat.aliases else None
        written = [p.tensor for p in flat.pieces.values()]
        infos = [p.info for p in flat.pieces.values()]
        sizes = [info.nbytes for info in infos]
        starts = list(itertools.accumulate(sizes, initial=0))
        pointers = list(map(torch.Tensor.data_ptr, tensors))
        seen = collections.Counter(p for p, t in zip(pointers, tensors) if t.nbytes)
        shared = [(i, view_key(t, *_kind_offsets(walked.boxes, i, t))) for i, (p, t) in
                  enumerate(zip(pointers, tensors)) if t.nbytes and seen[p] > 1]
        dtypes = list(map(_DTYPE, tensors))
        portable = [info._replace(global_shape=tuple(info.global_shape), offsets=tuple(info.offsets),
                                  shape=tuple(info.shape)) for info in infos]
        return _Layout(next(self._plans), list(walked.names), dict(walked.boxes), list(map(_SHAPE, tensors)), dtypes,
                       pointers, taken, starts[:-1], sizes, starts[-1], all(map(holds_values, written)), shared,
                       pickle.dumps((portable, flat.aliases, walked.names), pickle.HIGHEST_PROTOCOL),
                       complex=any(d in _COMPLEX for d in dtypes))

    @staticmethod
    def _copy(layout: _Layout, tensors: list[torch.Tensor], buffer: SharedBuffer) -> None:
        """Copy each piece by itself: a torch copy where its memory is not its values or
        lives on a GPU (asynchronous into a pinned buffer; synchronized once)."""
        if any(t.is_cuda for t in tensors):
            buffer.pin()
        written = tensors if layout.taken is None else [tensors[i] for i in layout.taken]
        pending: set[torch.device] = set()
        base, whole = buffer.address, buffer.tensor
        for start, size, t in zip(layout.starts, layout.sizes, written):
            if not size:
                continue
            if holds_values(t):
                ctypes.memmove(base + start, t.data_ptr(), size)
                continue
            whole[start:start + size].copy_(bytes_of(t), non_blocking=t.is_cuda)
            if t.is_cuda:
                pending.add(t.device)
        synchronize(pending)

    def close(self) -> None:
        if self.buffer is not None and self.buffer.owner == os.getpid():
            self.buffer.close()
        self.buffer, self.layout = None, None


class WriterPlans:
    """The writer's side of ``ArenaStaging``: the pieces of the newest layout of each
    saver (meta tensors of their shape and dtype: the writer reads bytes, never values)."""

    def __init__(self) -> None:
        self.plans: dict[Any, tuple[int, dict[str, Piece], dict[str, str], list[str], list[int]]] = {}

    def flat_state(self, saver: Any, handover: Handover) -> tuple[FlatState, list[int]]:
        """The FlatState a save hands over, and where each of its pieces starts in the buffer."""
        if handover.pieces is not None:
            infos, aliases, names = pickle.loads(handover.pieces)
            pieces = {info.name: Piece(torch.empty(info.shape, dtype=dtype_from_name(info.dtype, info.name),
                                                   device="meta"), info) for info in infos}
            starts = list(itertools.accumulate((info.nbytes for info in infos), initial=0))[:-1]
            self.plans[saver] = (handover.plan, pieces, aliases, names, starts)
        plan, pieces, aliases, names, starts = self.plans[saver]
        assert plan == handover.plan, "a save handed over without the pieces of its layout"
        tree = name_tensors(pickle.loads(handover.tree), names)
        return FlatState(tree, pieces, aliases, handover.has_local), starts

    def forget(self, saver: Any) -> None:
        self.plans.pop(saver, None)


class BufferStager:
    """Stands in for ``StagingPool`` in the writer process: the data file's parts are
    slices of the mapped buffer, which already holds the pieces in the file's order."""

    def __init__(self, data: memoryview, starts: list[int]) -> None:
        self.data = data
        self.starts = starts

    def stage(self, layout: DataFileLayout) -> StagedFile:
        header = len(layout.header)
        entries = layout.entries
        if [e[2] - header for e in entries] != self.starts:
            raise AssertionError("the data file's layout is not the buffer's")  # a bug, never a checkpoint

        def place(i: int, j: int, small: bool) -> tuple[memoryview, bool]:
            return self.data[entries[i][2] - header:entries[j - 1][3] - header], True

        return staged_file(layout, place)
