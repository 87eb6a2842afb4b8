"""Many small whole tensors of a format-3 table, read as a few large requests.

The general reader (``reader.py``) builds a ``Chunk``, a job and a memoryview per tensor.
For the common case of a load -- a tensor saved as one chunk, read whole into a
contiguous CPU tensor of its dtype -- that Python work, not the disk, bounded a load of
many small tensors (optimizer states, norms, adapters). Here such tensors are planned
as numpy columns of the table (file, start, length), sorted and cut into runs of
adjacent bytes; each run is read with one request into one buffer, then every tensor in
it is checked (one checksum, compared as raw digest bytes) and moved into place with
one ``memcpy``: about a microsecond of Python per tensor.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

import numpy as np
import torch

from ..format.checksum import raw_digest
from ..format.compact import ALGORITHM_WIDTH, TensorTable
from .state import Read


def _memcpy_holding_the_gil() -> Callable[[int, int, int], object]:
    """libc's ``memcpy`` called without releasing the GIL. ``ctypes.memmove`` releases it,
    and with several reading threads each small copy then waits to take it back (up to a
    switch interval): that convoy, not the copying, cost most of a load of small tensors."""
    try:
        memcpy = ctypes.PyDLL(None).memcpy
    except (AttributeError, OSError, TypeError):  # no process-wide symbols (Windows)
        return ctypes.memmove
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    memcpy.restype = ctypes.c_void_p
    return memcpy


_memcpy = _memcpy_holding_the_gil()
ReadInto = Callable[[str, int, memoryview], None]
Failed = Callable[[int, int, memoryview], None]  # member, chunk row, its bytes: raises the reader's error


class BatchedReads:
    """Whole one-chunk tensors of one table, collected by ``add`` and read by ``run``."""

    def __init__(self, table: TensorTable) -> None:
        self.table = table
        self.rows: list[int] = []  # the chunk row of each tensor
        self.dests: list[torch.Tensor] = []
        self.reads: list[Read] = []

    def add(self, read: Read, row: int, dest: torch.Tensor) -> None:
        self.reads.append(read)
        self.rows.append(row)
        self.dests.append(dest)

    def keep_below(self, below: int) -> list[tuple[Read, torch.Tensor]]:
        """Keep the tensors of one checksum block smaller than ``below`` bytes whose
        chunk holds exactly their bytes; return the others (read the general way)."""
        t = self.table
        rows = np.asarray(self.rows, dtype=np.int64)
        length = t.c_length[rows]
        nbytes = np.fromiter((d.nbytes for d in self.dests), dtype=np.int64, count=len(self.dests))
        keep = (length > 0) & (length < below) & (t.c_sums[rows] == 1) & (length == nbytes)
        if keep.all():
            return []
        out = [(self.reads[k], self.dests[k]) for k in np.flatnonzero(~keep).tolist()]
        kept = np.flatnonzero(keep).tolist()
        self.rows = [self.rows[k] for k in kept]
        self.dests = [self.dests[k] for k in kept]
        self.reads = [self.reads[k] for k in kept]
        return out

    def files(self) -> set[str]:
        """The data files these reads touch."""
        found = np.unique(self.table.c_file[np.asarray(self.rows, dtype=np.int64)])
        return {self.table.file_names[f] for f in found.tolist()}

    def runs(self, most: int) -> list[tuple[int, int, int, list[int]]]:
        """``(file, start, end, members)``: members' bytes adjacent in one file, each run
        at most about ``most`` bytes (a new run starts at every ``most`` boundary)."""
        rows = np.asarray(self.rows, dtype=np.int64)
        t = self.table
        file, start, length = t.c_file[rows], t.c_start[rows], t.c_length[rows]
        order = np.lexsort((start, file))
        file, start, length = file[order], start[order], length[order]
        gap = np.ones(len(rows), dtype=bool)
        gap[1:] = (file[1:] != file[:-1]) | (start[1:] != start[:-1] + length[:-1])
        heads = np.flatnonzero(gap)
        part = (start - start[heads][np.cumsum(gap) - 1]) // most  # position in its segment, in `most`s
        new = gap.copy()
        new[1:] |= part[1:] != part[:-1]
        at = np.flatnonzero(new).tolist() + [len(rows)]
        ends = (start + length).tolist()
        files, starts, members = file.tolist(), start.tolist(), order.tolist()
        return [(files[a], starts[a], ends[b - 1], members[a:b]) for a, b in zip(at, at[1:])]

    def tasks(self, read_into: ReadInto, verify: bool, most: int, failed: Failed) -> list[Callable[[], None]]:
        """One read per run (the reader runs them on its threads); each fills its
        destinations, and a checksum mismatch calls ``failed`` with the member's position."""
        return [functools.partial(self._read_run, run, read_into, verify, failed) for run in self.runs(most)]

    def _read_run(self, run: tuple[int, int, int, list[int]], read_into: ReadInto, verify: bool,
                  failed: Failed) -> None:
        file, lo, hi, members = run
        t = self.table
        buf = np.empty(hi - lo, dtype=np.uint8)  # uninitialised: every byte is read over
        view = memoryview(buf)  # type: ignore[arg-type]  # an ndarray is a buffer
        read_into(t.file_names[file], lo, view)
        rows = np.asarray([self.rows[k] for k in members], dtype=np.int64)
        offs, lengths = (t.c_start[rows] - lo).tolist(), t.c_length[rows].tolist()
        if verify:
            self._check(rows, [view[a:a + n] for a, n in zip(offs, lengths)], members, failed)
        base, dests = buf.ctypes.data, self.dests
        for k, a, n in zip(members, offs, lengths):
            _memcpy(dests[k].data_ptr(), base + a, n)

    def _check(self, rows: np.ndarray, pieces: list[memoryview], members: list[int], failed: Failed) -> None:
        """Compare the pieces' digests with the table's, all at once per algorithm."""
        t = self.table
        algs = t.c_alg[rows]
        for a in np.unique(algs).tolist():
            name = t.algorithms[a]
            width, hash_of = ALGORITHM_WIDTH[name], raw_digest(name)
            ks = np.flatnonzero(algs == a)
            want = np.frombuffer(t.digests, dtype=np.uint8)[
                (t.digest_at[rows[ks]][:, None] + np.arange(width)).ravel()].tobytes()
            got = b"".join([hash_of(pieces[k]) for k in ks.tolist()])
            if got != want:
                bad = next(k for j, k in enumerate(ks.tolist()) if got[j * width:(j + 1) * width]
                           != want[j * width:(j + 1) * width])
                failed(members[bad], int(rows[bad]), pieces[bad])
