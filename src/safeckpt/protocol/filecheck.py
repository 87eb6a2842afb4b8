"""Reading a committed checkpoint's files back and checking them against its manifest:
block checksums, data file headers, whole files. Bytes only, never tensors, so
``safeckpt verify`` does not import torch; ``reader.TensorReader`` builds on it.
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Callable

from ..errors import CorruptCheckpointError
from ..format.checksum import checksum, file_checksum, matches
from ..format.manifest import Chunk, Manifest
from ..storage import Storage


def read_header_length(prefix: "bytes | memoryview") -> int:
    """The header length stored in a data file's first 8 bytes."""
    return struct.unpack("<Q", prefix[:8])[0]


class CheckedFiles:
    """The files of one committed checkpoint, read by name and checked block by block."""

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self.storage = storage
        self.manifest = manifest
        self._located: dict[str, tuple[Storage, str]] = {}  # shared files live in sibling folders

    def read_bytes(self, name: str, offset: int, size: int) -> memoryview:
        out = memoryview(bytearray(size))
        self.read_into(name, offset, out)
        return out

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        try:
            located = self._located.get(name)
            if located is None:
                located = self._located[name] = self.storage.locate(name)
            located[0].read_into(located[1], offset, out)
        except (EOFError, FileNotFoundError) as exc:
            raise CorruptCheckpointError(
                f"{self.storage.url}/{name}: {exc} (the file is truncated or missing)") from exc

    def check_block(self, name: str, chunk: Chunk, index: int, data: bytes | memoryview) -> None:
        lo = chunk.start + index * self.manifest.block_size
        self.check_bytes(chunk.file, lo, data, chunk.checksums[index], f"tensor {name!r}")

    def check_bytes(self, file: str, start: int, data: bytes | memoryview, expected: str, what: str) -> None:
        """Raise ``CorruptCheckpointError`` unless ``data``, bytes of ``file`` from
        ``start`` (``what`` they hold, for the message), has checksum ``expected``."""
        if not matches(data, expected):
            raise CorruptCheckpointError(
                f"{self.storage.url}/{file}: {what} (bytes {start}-{start + len(data)}) "
                "fails its checksum: the data is corrupt; restore from another checkpoint")

    def check_blocks(self, name: str, chunk: Chunk, data: memoryview) -> None:
        block = self.manifest.block_size
        for index in range(len(chunk.checksums)):
            self.check_block(name, chunk, index, data[index * block:(index + 1) * block])

    def verify_chunk(self, name: str, chunk: Chunk) -> None:
        """Check every block of a chunk, holding one block in memory at a time."""
        block = self.manifest.block_size
        for index in range(len(chunk.checksums)):
            lo = chunk.start + index * block
            self.check_block(name, chunk, index, self.read_bytes(chunk.file, lo, min(block, chunk.end - lo)))

    def check_headers(self, files: set[str]) -> None:
        """Data files' headers must match the checksums the manifest recorded."""
        for name in sorted(files):
            f = self.manifest.files[name]
            if f.header_size is None:
                continue
            if checksum(self.read_bytes(name, 0, f.header_size)) != f.header_checksum:
                raise CorruptCheckpointError(
                    f"{self.storage.url}/{name}: the safetensors header does not match its checksum "
                    "(the file was altered or damaged); restore from another checkpoint")

    def verify_file(self, name: str) -> list[str]:
        """Read every byte of one file and return its problems (empty when sound)."""
        f = self.manifest.files[name]
        where = f"{self.storage.url}/{name}"
        if f.header_size is None:  # a sealed file written by another tool
            ok = f.checksum is None or file_checksum(*self.storage.locate(name), f.size) == f.checksum
            return [] if ok else [f"{where}: fails its checksum (altered or damaged)"]
        prefix = self.read_bytes(name, 0, min(8, f.size))
        claimed = read_header_length(prefix) if len(prefix) == 8 else None
        if claimed is None or claimed + 8 != f.header_size:
            return [f"{where}: the safetensors header claims {claimed} bytes; the file has {f.size} "
                    f"and the manifest recorded {f.header_size - 8}"]
        problems = []
        checks: list[Callable[[], Any]] = [lambda: self.check_headers({name})]
        seen = set()
        for tname, c in self.manifest.chunks_in(name):
            if (c.start, c.end) not in seen:
                seen.add((c.start, c.end))
                checks.append(functools.partial(self.verify_chunk, tname, c))
        for check in checks:
            try:
                check()
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
        return problems
