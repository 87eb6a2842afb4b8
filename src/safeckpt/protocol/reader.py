"""Reading tensors: only the byte ranges a rank needs, straight into tensor memory,
checked block by block.

A chunk that exactly fills a contiguous CPU destination is read into it directly.
Otherwise the overlap of the chunk with the destination box is read as contiguous
byte runs into a buffer of the overlap's size and copied into place. With
verification on, every block a read touches is read whole and checked.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import torch

from ..errors import CorruptCheckpointError
from ..format.compact import TableEntry, TensorTable
from ..format.manifest import Chunk, Manifest
from ..format.plan import Box, byte_runs, overlap, volume
from ..format.transformed import StoredChunk, is_transformed
from . import transforms
from .batchread import BatchedReads
from .filecheck import CheckedFiles
from .state import Read
from ..storage import Storage
from ..format.tensors import byte_view, dtype_from_name, holds_values

COALESCE_BELOW = 1 << 20
COALESCE_MAX = 16 << 20
READ_THREADS = 4


@dataclass
class Job:
    """Bytes of one chunk to read: ``runs`` (start within the chunk, length), in order,
    land back to back in ``out``."""

    name: str
    chunk: Chunk
    runs: list[tuple[int, int]]
    out: memoryview
    whole: bool  # the runs are the whole chunk (decided once: it is asked per neighbour)


@dataclass
class ReadWork:
    """A load's reads as planned (``TensorReader.plan``): the chunks' bytes to read
    (``jobs``, and small whole tensors in ``batched``), then what ``finish`` does with
    them (stream transforms undone, buffers copied into their tensors)."""

    batched: list[BatchedReads]
    jobs: list[Job] = field(default_factory=list)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    decodes: list[tuple[Job, torch.Tensor]] = field(default_factory=list)


def read_box(read: Read) -> Box:
    """The box of the tensor a read fills: its own, or the whole tensor."""
    return read.box or ((0,) * len(read.entry.shape), tuple(read.entry.shape))


def chunks_needed(reads: list[Read]) -> list[list[Chunk]]:
    """For each read, the chunks that meet its box (``read_box``): one batch per format-3
    table (``TensorTable.meeting_many``), entry by entry otherwise."""
    boxes = list(map(read_box, reads))
    out: list[list[Chunk]] = [[] for _ in reads]
    tables: dict[int, tuple[TensorTable, list[int]]] = {}
    for k, r in enumerate(reads):
        if isinstance(r.entry, TableEntry):
            tables.setdefault(id(r.entry.table), (r.entry.table, []))[1].append(k)
        else:
            out[k] = r.entry.meeting(boxes[k])
    for table, ks in tables.values():
        found = table.meeting_many([cast(TableEntry, reads[k].entry).i for k in ks], [boxes[k] for k in ks])
        for k, chunks in zip(ks, found):
            out[k] = chunks
    return out


def _takes_bytes(dest: torch.Tensor, dtype: torch.dtype) -> bool:
    """Saved bytes of ``dtype`` may be read straight into ``dest``'s memory: a CPU tensor
    of that dtype whose memory is its values (``holds_values``). Any other target (a
    conjugate or negative view, a strided view, a GPU tensor) gets them through ``copy_``,
    which stores what was saved as its values."""
    return dest.dtype == dtype and holds_values(dest)


def _whole(dest: torch.Tensor, dtype: torch.dtype, box: Box | None, shape: list[int]) -> bool:
    """``box`` is the whole of a tensor of ``shape``, read straight into ``dest`` (``_takes_bytes``)."""
    return (_takes_bytes(dest, dtype) and list(dest.shape) == shape
            and (box is None or (not any(box[0]) and list(box[1]) == shape)))


def _job_runs(jobs: list[Job], below: int, most: int) -> list[list[Job]]:
    """Jobs in file order, neighbours of whole small chunks gathered into one read of at
    most about ``most`` bytes."""
    jobs = sorted(jobs, key=lambda j: (j.chunk.file, j.chunk.start))
    runs: list[list[Job]] = []
    i = 0
    while i < len(jobs):
        run = [jobs[i]]
        size = len(jobs[i].out)
        while (i + len(run) < len(jobs) and size < most and len(run[-1].out) < below
               and (nxt := jobs[i + len(run)]).whole and run[-1].whole
               and nxt.chunk.file == run[-1].chunk.file and nxt.chunk.start == run[-1].chunk.end
               and len(nxt.out) < below):
            run.append(nxt)
            size += len(nxt.out)
        i += len(run)
        runs.append(run)
    return runs


def _in_threads(tasks: list[Callable[[], None]]) -> None:
    """Run the reads on a few threads: reads release the GIL, and on object stores each
    one is a round trip worth overlapping (one alone runs here)."""
    if len(tasks) == 1:
        tasks[0]()
        return
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="safeckpt-read") as pool:
        for future in [pool.submit(task) for task in tasks]:
            future.result()


def _relative(inner: Box, outer_offsets: tuple[int, ...]) -> Box:
    return tuple(o - b for o, b in zip(inner[0], outer_offsets)), inner[1]


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(*box))


class TensorReader(CheckedFiles):
    """Reads the tensors of one committed checkpoint."""

    def __init__(self, storage: Storage, manifest: Manifest, verify: bool, transforms: Any = None) -> None:
        super().__init__(storage, manifest)
        self.verify = verify
        self.transforms = transforms  # a DCP ExtensionRegistry for transformed chunks (DCP's default when None)

    # -- planning --------------------------------------------------------------------
    def run(self, reads: list[Read]) -> None:
        """Fill every ``Read``: its ``dest`` in place, or a new tensor in ``result``.
        Small whole tensors of format-3 tables go in batches (``batchread``), the rest
        chunk by chunk."""
        work = self.plan(reads)
        self.fetch(work)
        self.finish(work)

    def plan(self, reads: list[Read]) -> ReadWork:
        """What filling ``reads`` takes: the byte ranges to read and where they land (a
        fresh tensor is made here for each read without a ``dest``)."""
        below, most = self._coalescing()
        batches: dict[int, BatchedReads] = {}
        general: list[tuple[Read, torch.Tensor]] = []
        fresh: dict[tuple, torch.Tensor] = {}
        for read in reads:
            entry = read.entry
            dtype = dtype_from_name(entry.dtype, read.name)
            if read.dest is None:
                key = self.manifest.tie_of(read.name, entry)
                if key in fresh and volume(entry.shape):  # tied tensors come back as one tensor
                    read.result = fresh[key]
                    continue
                read.result = fresh[key] = torch.empty(entry.shape, dtype=dtype)
            dest = read.dest if read.dest is not None else read.result
            assert dest is not None  # a fresh tensor was made just above
            if type(entry) is TableEntry and entry.only_chunk >= 0 and _whole(dest, dtype, read.box, entry.shape):
                batch = batches.get(id(entry.table))
                if batch is None:
                    batch = batches[id(entry.table)] = BatchedReads(entry.table)
                batch.add(read, entry.only_chunk, dest)
            else:
                general.append((read, dest))
        for batch in batches.values():
            general += batch.keep_below(below)
        work = ReadWork([b for b in batches.values() if b.rows])
        for (read, dest), chunks in zip(general, chunks_needed([r for r, _ in general])):
            self._plan_read(read.name, chunks, dest, read_box(read), dtype_from_name(read.entry.dtype, read.name),
                            work.jobs, work.copies, work.decodes)
        return work

    def fetch(self, work: ReadWork) -> None:
        """Read (and check) every byte of ``work`` from storage, on a few threads."""
        below, most = self._coalescing()
        if self.verify:
            self.check_headers({j.chunk.file for j in work.jobs}.union(*(b.files() for b in work.batched)))
        tasks: list[Callable[[], None]] = [functools.partial(self._read_run, run)
                                           for run in _job_runs(work.jobs, below, most)]
        for batch in work.batched:
            tasks += batch.tasks(self.read_into, self.verify, most, self._batch_failed(batch))
        _in_threads(tasks)

    def finish(self, work: ReadWork) -> None:
        """Once every byte of ``work`` is in place: undo stream transforms, copy the
        bytes read into buffers to their tensors."""
        self._decode(work.decodes)
        with torch.no_grad():
            for target, tmp in work.copies:
                target.copy_(tmp)

    def _batch_failed(self, batch: BatchedReads) -> Callable[[int, int, memoryview], None]:
        """What a batch calls when a tensor fails its checksum: the general check's error."""
        def failed(k: int, row: int, data: memoryview) -> None:
            self.check_block(batch.reads[k].name, batch.table.chunks_at([row])[0], 0, data)
        return failed

    def _coalescing(self) -> tuple[int, int]:
        """(pieces below this size are read together, the most bytes one read gathers)."""
        below = getattr(self.storage, "merge_reads_below", COALESCE_BELOW)
        return below, max(COALESCE_MAX, 2 * below)

    def _plan_read(self, name: str, chunks: list[Chunk], dest: torch.Tensor, box: Box,
                   dtype: torch.dtype, jobs: list[Job], copies: list, decodes: list) -> None:
        """Jobs (and copies) that fill ``box`` of the tensor from ``chunks``: those that
        meet the box (``meeting``), or all of them. A transformed chunk is read whole and
        decoded (``decodes``) into a tensor of its box, copied from there."""
        if len(chunks) == 1 and not is_transformed(chunks[0]) and _whole(dest, dtype, box, list(chunks[0].shape)):
            chunk = chunks[0]  # the common case: one whole chunk straight into its tensor
            jobs.append(Job(name, chunk, [(0, chunk.end - chunk.start)], byte_view(dest), True))
            return
        covered = 0
        for chunk in chunks:
            cbox = (tuple(chunk.offsets), tuple(chunk.shape))
            ov = overlap(box, cbox) if volume(box[1]) else None
            if ov is None:
                continue
            covered += volume(ov[1])
            if is_transformed(chunk):
                stored = Job(name, chunk, [(0, chunk.end - chunk.start)], memoryview(bytearray(chunk.end - chunk.start)),
                              True)
                jobs.append(stored)
                decoded = torch.empty(cbox[1], dtype=dtype)
                decodes.append((stored, decoded))
                copies.append((dest[_slices(_relative(ov, box[0]))], decoded[_slices(_relative(ov, cbox[0]))]))
                continue
            direct = ov == cbox == box and _takes_bytes(dest, dtype)
            tmp = dest if direct else torch.empty(ov[1], dtype=dtype)
            runs = byte_runs(cbox[1], _relative(ov, cbox[0]), dtype.itemsize)
            jobs.append(Job(name, chunk, runs, byte_view(tmp), runs == [(0, chunk.end - chunk.start)]))
            if not direct:
                copies.append((dest[_slices(_relative(ov, box[0]))], tmp))
        if covered != volume(box[1]):
            raise CorruptCheckpointError(
                f"{self.storage.url}: tensor {name!r} has no saved data for part of box "
                f"{list(box[0])}+{list(box[1])}")

    # -- execution -------------------------------------------------------------------
    def _decode(self, decodes: list[tuple[Job, torch.Tensor]]) -> None:
        """Undo the stream transforms of the transformed chunks read (and checked)."""
        if decodes and self.transforms is None:
            self.transforms = transforms.default_registry()
        for job, decoded in decodes:
            chunk = cast(StoredChunk, job.chunk)
            transforms.decode(chunk.transforms, job.out, byte_view(decoded), self.transforms,
                              f"{self.storage.url}/{chunk.file}: tensor {job.name!r}")

    def _read_run(self, run: list[Job]) -> None:
        if len(run) > 1:
            self._read_coalesced(run, sum(len(j.out) for j in run))
        elif not run[0].whole:
            self._read_partial(run[0])
        else:
            job = run[0]
            self.read_into(job.chunk.file, job.chunk.start, job.out)
            if self.verify:
                self.check_blocks(job.name, job.chunk, job.out)

    def _read_coalesced(self, run: list[Job], size: int) -> None:
        buf = memoryview(bytearray(size))
        self.read_into(run[0].chunk.file, run[0].chunk.start, buf)
        pos = 0
        for job in run:
            n = len(job.out)
            job.out[:] = buf[pos:pos + n]
            pos += n
            if self.verify:
                self.check_blocks(job.name, job.chunk, job.out)

    def _read_partial(self, job: Job) -> None:
        """Read the blocks the runs touch (whole blocks when verifying), copy the runs out."""
        block = self.manifest.block_size
        chunk = job.chunk
        pos = 0
        for start, length in job.runs:
            end = start + length
            while start < end:
                b = start // block
                b_start, b_end = b * block, min((b + 1) * block, chunk.end - chunk.start)
                lo, hi = (b_start, b_end) if self.verify else (start, min(end, b_end))
                buf = self.read_bytes(chunk.file, chunk.start + lo, hi - lo)
                if self.verify:
                    self.check_block(job.name, chunk, b, buf)
                take = min(end, b_end) - start
                job.out[pos:pos + take] = buf[start - lo:start - lo + take]
                pos += take
                start += take
