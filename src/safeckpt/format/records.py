"""The plain records a manifest is made of (files, chunks, tensors), apart from the
manifest's codec so that the compact tables (``compact``) can build them too."""

from __future__ import annotations

from dataclasses import dataclass, field

from .plan import Box, overlap


@dataclass
class FileEntry:
    """One immutable file of the checkpoint."""

    name: str
    size: int
    rank: int | None = None
    header_size: int | None = None      # data files: bytes covered by header_checksum
    header_checksum: str | None = None
    checksum: str | None = None         # sealed foreign files: checksum of the whole file


@dataclass
class Chunk:
    """A box of a logical tensor stored as one contiguous row-major byte range of a
    file, with one checksum per ``block_size`` bytes."""

    file: str
    start: int
    end: int
    checksums: list[str]
    offsets: list[int]
    shape: list[int]


@dataclass
class TensorEntry:
    """A logical tensor: dtype, global shape and the chunks that cover it."""

    dtype: str
    shape: list[int]
    chunks: list[Chunk] = field(default_factory=list)
    tied_to: str | None = None  # format 2: the tensor this one is tied to (same storage)

    def meeting(self, box: Box) -> list[Chunk]:
        """The chunks whose boxes meet ``box`` (what a rank reading ``box`` needs)."""
        if len(self.chunks) == 1:
            return self.chunks
        return [c for c in self.chunks if overlap(box, (tuple(c.offsets), tuple(c.shape))) is not None]


