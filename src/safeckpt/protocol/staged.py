"""A save whose per-tensor work is all done before it returns to the training loop.

A background thread shares the GIL with the training: every microsecond of Python it
runs per tensor is a microsecond the training's Python does not run. So ``stage``
(on the caller's thread, a group of one) does all of it: phase 1, the data file's
layout, the copy of every piece into host buffers arranged as that file
(``StagingPool.stage``), the checksums of small pieces, and the manifest, built with
placeholders for the checksums of large pieces. ``finish`` (the background thread) is
left with what releases the GIL or costs the same for any number of tensors: the
writes, fsync, hashing large pieces in 16 MiB blocks, patching their checksums into the
manifest's table, encoding it (vectorized) and the commit.

The async writer process (``run.writer``) runs the same two halves one after the other,
with ``arena.BufferStager`` in place of ``StagingPool``: there the pieces are already in
a shared buffer laid out as the data file, and ``stage`` only slices it.
"""

from __future__ import annotations

import secrets
from typing import Any, cast

from ..format.checksum import ALGORITHM, BLOCK_SIZE
from .commit import Assignment, Intent, Report, SaveRun, write_manifest
from .datafile import WrittenPiece, hashed_while_written, write_parts
from ..format.compact import TensorTable
from ..format.manifest import Manifest
from ..format.names import data_file_name
from .staging import StagedFile, Stager
from .state import FlatState

class Placeholders:
    """Checksums not known yet: stand-in digests (a random token per save and a counter)
    in the manifest's tensor table, replaced in the table's digest bytes once the large
    pieces are hashed; the manifest is then encoded once, with numpy, in milliseconds for
    any number of tensors."""

    def __init__(self, pieces: list[WrittenPiece]) -> None:
        self.token = secrets.token_hex(5)  # 10 hex digits + 6 of a counter: one xxh3_64 digest
        self.slots: list[tuple[WrittenPiece, int]] = []
        for piece in pieces:
            blocks = max(1, -(-(piece.end - piece.start) // BLOCK_SIZE))
            piece.checksums = [self._text(len(self.slots) + k) for k in range(blocks)]
            self.slots += [(piece, k) for k in range(blocks)]
        self.at: list[int] | None = None

    def _text(self, n: int) -> str:
        return f"{ALGORITHM}:{self.token}{n:06x}"

    def locate(self, table: TensorTable) -> None:
        """Find each stand-in in the table's digests. Should one not be there exactly once
        (a real digest equal to it), ``patch`` says so and the table is built again."""
        at = []
        for n in range(len(self.slots)):
            raw = bytes.fromhex(self._text(n).partition(":")[2])
            i = table.digests.find(raw)
            if i < 0 or table.digests.find(raw, i + 1) >= 0:
                return
            at.append(i)
        self.at = at

    def patch(self, table: TensorTable) -> bool:
        """Put the real checksums into ``table``; False when it must be built again."""
        if any(piece.checksums[k] == self._text(n) for n, (piece, k) in enumerate(self.slots)):
            raise RuntimeError("a large piece was not hashed before the commit")  # a bug, never a checkpoint
        if self.at is None:
            return False
        digests = bytearray(table.digests)
        for i, (piece, k) in zip(self.at, self.slots):
            raw = bytes.fromhex(piece.checksums[k].partition(":")[2])
            digests[i:i + len(raw)] = raw
        table.digests = bytes(digests)
        return True


class StagedRun(SaveRun):
    """``SaveRun`` for one process, split in ``stage`` (the caller's thread, every
    per-tensor step) and ``finish`` (any thread, see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.file: StagedFile | None = None
        self.report = Report()
        self.manifest: Manifest | None = None
        self.placeholders: Placeholders | None = None
        self.prepared: tuple[FlatState | None, list[Intent], Assignment] | None = None

    def stage(self, flatten: Any, pool: Stager) -> None:
        """Phase 1, then the state copied into ``pool`` as its data file, and the manifest."""
        assert self.group.size == 1 and self.chunk_size is None, "staged saves are full saves of one process"
        self.prepared = flat, intents, mine = self.prepare(flatten)
        if mine.write:
            name = data_file_name(mine.save_id, self.group.rank)
            layout = self._layout(cast(FlatState, flat), mine)
            self.file = pool.stage(layout)
            self.report = Report(self._file_entry(name, layout, layout.size), self.file.written)
            self.placeholders = Placeholders([p for _, p in self.file.parts if p is not None])
        self.manifest = super()._build_manifest(intents, [self.report], mine)
        if self.placeholders is not None:
            self.placeholders.locate(cast(TensorTable, self.manifest.tensors))

    def finish_staged(self) -> Manifest:
        """Write the staged file and commit; returns as ``run`` does."""
        assert self.prepared is not None, "stage() first"
        return self.finish(*self.prepared)

    def _write_file(self, flat: FlatState, mine: Assignment, name: str) -> Report:
        file = cast(StagedFile, self.file)
        size = write_parts(self.storage, name, hashed_while_written(file.parts))
        assert self.report.file is not None and size == self.report.file.size, "the staged layout changed"
        return self.report

    def _build_manifest(self, intents: list[Intent], reports: list[Report], mine: Assignment) -> Manifest:
        return cast(Manifest, self.manifest)  # built by stage(); the hashing filled in its large pieces

    def _write_manifest(self, manifest: Manifest) -> None:
        if self.placeholders is not None and not self.placeholders.patch(cast(TensorTable, manifest.tensors)):
            _, intents, mine = cast(tuple, self.prepared)  # the hashing filled in the report's pieces
            manifest.tensors = super()._build_manifest(intents, [self.report], mine).tensors
        write_manifest(self.storage, manifest)
        self.committed = True

