"""A save whose per-tensor work is all done before it returns to the training loop.

A background thread shares the GIL with the training: every microsecond of Python it
runs per tensor is a microsecond the training's Python does not run. So ``stage``
(on the caller's thread, a group of one) does all of it: phase 1, the data file's
layout, the copy of every piece into host buffers arranged as that file
(``StagingPool.stage``), the checksums of small pieces, and the manifest, built and
encoded with placeholders for the checksums of large pieces. ``finish`` (the
background thread) is left with what releases the GIL or costs the same for any
number of tensors: the writes, fsync, hashing large pieces in 16 MiB blocks, patching
their checksums into the encoded manifest, and the commit.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, cast

from ..format.checksum import ALGORITHM, BLOCK_SIZE
from .commit import Assignment, Intent, Report, SaveRun, write_manifest
from .datafile import WrittenPiece, hashed_while_written, write_parts
from ..format.manifest import Manifest, encode_body, encode_manifest, frame_parts
from ..format.names import data_file_name
from .staging import StagedFile, StagingPool
from .state import FlatState

_LETTERS = "ghijklmnopqrstuvwxyz"  # not hex digits: a placeholder is never a real checksum


class Placeholders:
    """Checksums not known yet, standing in the encoded manifest as unique strings of a
    real checksum's length, and replaced there once known: patching a few bytes per
    16 MiB block instead of encoding the manifest again after the write."""

    def __init__(self, pieces: list[WrittenPiece]) -> None:
        self.token = "".join(secrets.choice(_LETTERS) for _ in range(10))  # drawn per save
        self.slots: list[tuple[WrittenPiece, int]] = []
        for piece in pieces:
            blocks = max(1, -(-(piece.end - piece.start) // BLOCK_SIZE))
            piece.checksums = [self._text(len(self.slots) + k) for k in range(blocks)]
            self.slots += [(piece, k) for k in range(blocks)]
        self.body: bytearray | None = None
        self.at: list[int] = []

    def _text(self, n: int) -> str:
        return f"{ALGORITHM}:{self.token}{n:06x}"

    def encode(self, manifest: Manifest) -> None:
        """Encode ``manifest`` (holding the placeholders) and find every placeholder in it.
        Should a value of the state happen to contain one, ``result`` encodes afresh."""
        body = encode_body(manifest)
        pattern = re.compile(re.escape(f"{ALGORITHM}:{self.token}".encode()) + rb"([0-9a-f]{6})")
        found = {int(m.group(1), 16): m.start() for m in pattern.finditer(body)}
        if len(found) == len(self.slots) == sum(1 for _ in pattern.finditer(body)):
            self.body, self.at = bytearray(body), [found[n] for n in range(len(self.slots))]

    def result(self, manifest: Manifest) -> list:
        """The manifest's bytes, as parts to write, with the real checksums, once every
        piece is hashed."""
        if any(piece.checksums[k] == self._text(n) for n, (piece, k) in enumerate(self.slots)):
            raise RuntimeError("a large piece was not hashed before the commit")  # a bug, never a checkpoint
        if self.body is None:
            return [encode_manifest(manifest)]
        for at, (piece, k) in zip(self.at, self.slots):
            text = piece.checksums[k].encode()
            self.body[at:at + len(text)] = text
        return frame_parts(self.body)


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

    def stage(self, flatten: Any, pool: StagingPool) -> None:
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
            self.placeholders.encode(self.manifest)

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
        encoded = self.placeholders.result(manifest) if self.placeholders is not None else None
        write_manifest(self.storage, manifest, encoded=encoded)
        self.committed = True

