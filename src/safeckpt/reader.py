"""Reading tensors: byte ranges from data files straight into tensor memory, checked.

Adjacent small chunks of one file are read with one call and split; large chunks are
read directly into the destination tensor when its memory can take them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checksum import checksum
from .datafile import read_header_length
from .errors import CorruptCheckpointError
from .manifest import Chunk, Manifest, TensorEntry
from .state import Read
from .storage import Storage
from .tensors import byte_view, dtype_from_name

COALESCE_BELOW = 1 << 20
COALESCE_MAX = 16 << 20


@dataclass
class _Job:
    name: str
    chunk: Chunk
    out: memoryview


def _box(chunk: Chunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.shape))


def _direct(dest: torch.Tensor, entry: TensorEntry, dtype: torch.dtype) -> bool:
    """Can the single chunk of ``entry`` be read straight into ``dest``'s memory?"""
    return (len(entry.chunks) == 1 and dest.device.type == "cpu" and dest.dtype == dtype
            and dest.is_contiguous() and list(dest.shape) == entry.shape)


class TensorReader:
    """Reads the tensors of one committed checkpoint."""

    def __init__(self, storage: Storage, manifest: Manifest, verify: bool) -> None:
        self.storage = storage
        self.manifest = manifest
        self.verify = verify

    def run(self, reads: list[Read]) -> None:
        """Fill every ``Read``: its ``dest`` in place, or a new tensor in ``result``."""
        if self.verify:
            self.check_headers({c.file for r in reads for c in r.entry.chunks})
        jobs: list[_Job] = []
        copies: list[tuple[torch.Tensor, tuple[slice, ...], torch.Tensor]] = []
        fresh: dict[tuple, torch.Tensor] = {}
        for read in reads:
            entry = read.entry
            dtype = dtype_from_name(entry.dtype, read.name)
            if read.dest is None:
                key = (entry.dtype, tuple(entry.shape), tuple((c.file, c.start) for c in entry.chunks))
                if key in fresh:  # tied tensors come back as one tensor
                    read.result = fresh[key]
                    continue
                read.result = fresh[key] = torch.empty(entry.shape, dtype=dtype)
            target = read.dest if read.dest is not None else read.result
            if _direct(target, entry, dtype):
                jobs.append(_Job(read.name, entry.chunks[0], byte_view(target)))
                continue
            for chunk in entry.chunks:
                tmp = torch.empty(chunk.shape, dtype=dtype)
                jobs.append(_Job(read.name, chunk, byte_view(tmp)))
                copies.append((target, _box(chunk), tmp))
        self._read(jobs)
        with torch.no_grad():
            for target, box, tmp in copies:
                target[box].copy_(tmp)

    def check_headers(self, files: set[str]) -> None:
        """Data files' headers must match the checksums the manifest recorded."""
        for name in sorted(files):
            f = self.manifest.files[name]
            if f.header_size is None:
                continue
            data = self.read_bytes(name, 0, f.header_size)
            if checksum(data) != f.header_checksum:
                raise CorruptCheckpointError(
                    f"{self.storage.url}/{name}: the safetensors header does not match its checksum "
                    "(the file was altered or damaged); restore from another checkpoint")

    def read_bytes(self, name: str, offset: int, size: int) -> bytes:
        out = bytearray(size)
        self._read_into(name, offset, memoryview(out))
        return bytes(out)

    def _read_into(self, name: str, offset: int, out: memoryview) -> None:
        try:
            self.storage.read_into(name, offset, out)
        except (EOFError, FileNotFoundError) as exc:
            raise CorruptCheckpointError(
                f"{self.storage.url}/{name}: {exc} (the file is truncated or missing)") from exc

    def _read(self, jobs: list[_Job]) -> None:
        jobs.sort(key=lambda j: (j.chunk.file, j.chunk.start))
        i = 0
        while i < len(jobs):
            run = [jobs[i]]
            size = len(jobs[i].out)
            while (i + len(run) < len(jobs) and size < COALESCE_MAX
                   and (nxt := jobs[i + len(run)]).chunk.file == run[-1].chunk.file
                   and nxt.chunk.start == run[-1].chunk.end and len(nxt.out) < COALESCE_BELOW
                   and len(run[-1].out) < COALESCE_BELOW):
                run.append(nxt)
                size += len(nxt.out)
            i += len(run)
            self._read_run(run, size)

    def _read_run(self, run: list[_Job], size: int) -> None:
        first = run[0].chunk
        if len(run) == 1:
            self._read_into(first.file, first.start, run[0].out)
        else:
            buf = memoryview(bytearray(size))
            self._read_into(first.file, first.start, buf)
            pos = 0
            for job in run:
                n = len(job.out)
                job.out[:] = buf[pos:pos + n]
                pos += n
        if self.verify:
            for job in run:
                self.check_chunk(job.name, job.chunk, job.out)

    def check_chunk(self, name: str, chunk: Chunk, data: memoryview) -> None:
        """Raise ``CorruptCheckpointError`` naming file and tensor if ``data`` is not what was saved."""
        if checksum(data) != chunk.checksum:
            raise CorruptCheckpointError(
                f"{self.storage.url}/{chunk.file}: tensor {name!r} (bytes {chunk.start}-{chunk.end}) "
                "fails its checksum: the data is corrupt; restore from another checkpoint")

    def verify_file(self, name: str) -> list[str]:
        """Read every byte of one data file and return its problems (empty when sound)."""
        f = self.manifest.files[name]
        where = f"{self.storage.url}/{name}"
        if f.header_size is None:  # a sealed file written by another tool
            ok = f.checksum is None or checksum(self.read_bytes(name, 0, f.size)) == f.checksum
            return [] if ok else [f"{where}: fails its checksum (altered or damaged)"]
        prefix = self.read_bytes(name, 0, min(8, f.size))
        claimed = read_header_length(prefix) if len(prefix) == 8 else None
        if claimed is None or claimed + 8 > f.size or claimed + 8 != f.header_size:
            return [f"{where}: the safetensors header claims {claimed} bytes; the file has {f.size} "
                    f"and the manifest recorded {f.header_size - 8}"]
        problems = []
        checks = [lambda: self.check_headers({name})]
        seen = set()
        for tname, entry in self.manifest.tensors.items():
            for chunk in entry.chunks:
                if chunk.file == name and (chunk.start, chunk.end) not in seen:
                    seen.add((chunk.start, chunk.end))
                    checks.append(lambda t=tname, c=chunk: self.check_chunk(
                        t, c, memoryview(self.read_bytes(name, c.start, c.end - c.start))))
        for check in checks:
            try:
                check()
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
        return problems
