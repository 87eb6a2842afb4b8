"""Read once, share: ranks that need the same saved bytes read them from storage once
and send them to each other (the plan: ``format/sharing``).

A load's planned reads (``reader.ReadWork``) become this rank's *needs*: every whole
checksum block of a chunk it reads from (a span), and where those bytes land. The
ranks compare digests of their spans (under DDP every rank needs the same ones and
nothing more is sent), learn the distinct lists, and every rank computes the same
plan. They then walk its messages window by window: readers read and verify their
messages of a window ahead (a thread pool), every rank learns with one all-reduce
whether every reader succeeded, then readers send and the others receive, straight
into their tensors where a message is one whole block of one tensor, else through a
buffer that lives for the window. What a rank needs alone it reads itself. A read that
fails stops every rank at that window: the failing rank raises its error (naming it
and the file), the others return ``False`` and the load's agreement raises the same
error, typed, on every rank.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, StorageError
from ..format.compact import ALGORITHM_WIDTH
from ..format.sharing import Needers, SharePlan, Spans, plan_sharing
from ..storage import is_remote
from .batchread import BatchedReads
from .group import CollectiveError, TorchGroup, can_use_nccl, device_group, node_id
from .reader import READ_THREADS, Job, ReadWork, TensorReader
from ..format.tensors import byte_view

log = logging.getLogger(__name__)

SHARE_ENV = "SAFECKPT_SHARE_READS"  # auto | job | node | off
TRANSPORT_ENV = "SAFECKPT_SHARE_TRANSPORT"  # gloo (default) | nccl
MODES = ("auto", "job", "node", "off")
MESSAGE_BYTES = 16 << 20  # a message: one request and one send
WINDOW_BYTES = 64 << 20  # the bytes in flight between the ranks at a time
MIN_SHARED_BYTES = 1 << 20  # below this, sharing saves less than its round trips cost
DISTINCT_BROADCASTS = 16  # up to this many distinct lists of spans travel by broadcast


def share_mode(value: "str | bool | None") -> str:
    """The sharing mode of a load: ``value`` (True: ``"job"``, False: ``"off"``), else
    ``$SAFECKPT_SHARE_READS``, else ``"auto"``."""
    if value is None:
        value = os.environ.get(SHARE_ENV) or "auto"
    if value is True or value is False:
        return "job" if value else "off"
    mode = str(value).strip().lower()
    if mode not in MODES:
        raise ValueError(f"share_reads must be one of {', '.join(MODES)} (or True/False), not {value!r}")
    return mode


class Needs:
    """The spans this rank reads and where their bytes land: span ``i`` is bytes
    ``start[i]:start[i] + length[i]`` of file ``file[i]``, with checksum ``sums[i]``;
    ``deliveries[i]`` lists ``(offset in the span, length, target)``."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.file_index = {n: i for i, n in enumerate(files)}
        self.at: dict[tuple[int, int, int], int] = {}
        self.file: list[int] = []
        self.start: list[int] = []
        self.length: list[int] = []
        self.sums: list[str] = []
        self.what: list[str] = []  # the tensor a span holds, for messages
        self.deliveries: list[list[tuple[int, int, memoryview]]] = []
        self.empty: list[tuple[str, int, str, str]] = []  # chunks of no bytes: (file, start, checksum, what)

    def add(self, file: str, start: int, length: int, checksum: str, what: str, offset: int, target: memoryview) -> None:
        key = (self.file_index[file], start, length)
        i = self.at.get(key)
        if i is None:
            i = self.at[key] = len(self.file)
            self.file.append(key[0])
            self.start.append(start)
            self.length.append(length)
            self.sums.append(checksum)
            self.what.append(what)
            self.deliveries.append([])
        self.deliveries[i].append((offset, len(target), target))

    def add_job(self, job: Job, block: int) -> None:
        """A chunk's runs, cut at its checksum blocks."""
        chunk, pos = job.chunk, 0
        size = chunk.end - chunk.start
        what = f"tensor {job.name!r}"
        if not size:  # nothing to read or send; its checksum is still checked
            self.empty.append((chunk.file, chunk.start, chunk.checksums[0], what))
        for start, length in job.runs:
            end = start + length
            while start < end:
                b = start // block
                lo, hi = b * block, min((b + 1) * block, size)
                take = min(end, hi) - start
                self.add(chunk.file, chunk.start + lo, hi - lo, chunk.checksums[b], what, start - lo,
                         job.out[pos:pos + take])
                pos += take
                start += take

    def add_batch(self, batch: BatchedReads) -> None:
        """Small whole tensors of one chunk and one checksum each."""
        t = batch.table
        rows = np.asarray(batch.rows, dtype=np.int64)
        lo = t.digest_at[rows].tolist()
        algs = [t.algorithms[a] for a in t.c_alg[rows].tolist()]
        for k, (file, start, length) in enumerate(zip(t.c_file[rows].tolist(), t.c_start[rows].tolist(),
                                                      t.c_length[rows].tolist())):
            digest = t.digests[lo[k]:lo[k] + ALGORITHM_WIDTH[algs[k]]].hex()
            self.add(t.file_names[file], start, length, f"{algs[k]}:{digest}", f"tensor {batch.reads[k].name!r}",
                     0, byte_view(batch.dests[k]))

    @classmethod
    def of(cls, work: ReadWork, files: list[str], block: int) -> "Needs":
        needs = cls(files)
        for job in work.jobs:
            needs.add_job(job, block)
        for batch in work.batched:
            needs.add_batch(batch)
        return needs

    def spans(self) -> Spans:
        return Spans.of(self.file, self.start, self.length)

    def deliver(self, i: int, data: memoryview) -> None:
        for offset, length, target in self.deliveries[i]:
            target[:] = data[offset:offset + length]

    def direct(self, i: int) -> memoryview | None:
        """The one target that takes span ``i`` whole, if it has just that one."""
        found = self.deliveries[i]
        if len(found) == 1 and found[0][0] == 0 and found[0][1] == self.length[i]:
            return found[0][2]
        return None


class Transport:
    """Moves message bytes between ranks: over the group's own gloo connections, or
    through a GPU buffer over a dedicated NCCL group (host bytes in, host bytes out)."""

    def __init__(self, group: TorchGroup, nccl: Any = None) -> None:
        self.group = group
        self.nccl = nccl
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl is not None else None
        if nccl is not None:
            group.connect(nccl, self.device)

    def exchange(self, sends: list[tuple[memoryview, int, int]], recvs: list[tuple[memoryview, int, int]]) -> None:
        host = lambda buf: torch.frombuffer(buf, dtype=torch.uint8)  # noqa: E731 - a view, no copy
        if self.nccl is None:
            self.group.exchange([(host(b), r, t) for b, r, t in sends], [(host(b), r, t) for b, r, t in recvs])
            return
        out = [torch.empty(len(b), dtype=torch.uint8, device=self.device) for b, _, _ in recvs]
        self.group.exchange([(host(b).to(self.device), r, t) for b, r, t in sends],
                            [(o, r, t) for o, (_, r, t) in zip(out, recvs)], self.nccl)
        for (b, _, _), o in zip(recvs, out):
            host(b).copy_(o)


def _buffer(n: int) -> memoryview:
    """Room for ``n`` bytes, not zeroed: every byte is read or received over."""
    return memoryview(np.empty(n, dtype=np.uint8)).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer


class Exchange:
    """One rank's part of a shared load (see the module docstring)."""

    def __init__(self, reader: TensorReader, needs: Needs, plan: SharePlan, group: TorchGroup,
                 transport: Transport) -> None:
        self.reader, self.needs, self.plan, self.group, self.transport = reader, needs, plan, group, transport
        self.me = group.rank
        self.bytes_read = 0
        self.bytes_received = 0
        self._lock = threading.Lock()
        self._headers: dict[str, threading.Lock] = {}
        self._checked: set[str] = set()

    def _span(self, u: int) -> int:
        p = self.plan
        return self.needs.at[(int(p.u_file[u]), int(p.u_start[u]), int(p.u_length[u]))]

    def _direct(self, k: int) -> memoryview | None:
        """A message of one span with one whole target goes straight into it."""
        units = self.plan.message_units(k)
        return self.needs.direct(self._span(int(units[0]))) if len(units) == 1 else None

    def _parts(self, k: int, buf: memoryview) -> list[tuple[int, memoryview]]:
        """(this rank's span, its bytes in ``buf``) for each span of message ``k``."""
        p, lo = self.plan, int(self.plan.start[k])
        return [(self._span(u), buf[int(p.u_start[u]) - lo:int(p.u_start[u] + p.u_length[u]) - lo])
                for u in p.message_units(k).tolist()]

    def _read(self, k: int) -> memoryview:
        """Read message ``k`` (this rank is its reader), check every span of it and put
        the bytes in place here; the bytes, for the others."""
        direct = self._direct(k)
        p, needs = self.plan, self.needs
        buf = direct if direct is not None else _buffer(int(p.end[k] - p.start[k]))
        file = needs.files[int(p.file[k])]
        try:
            self._check_header(file)
            self.reader.read_into(file, int(p.start[k]), buf)
            for i, data in self._parts(k, buf):
                if self.reader.verify:
                    self.reader.check_bytes(file, needs.start[i], data, needs.sums[i], needs.what[i])
                if direct is None:
                    needs.deliver(i, data)
        except Exception as exc:
            receivers = p.receivers(k)
            raise self._failure(exc, f"reading {self.reader.storage.url}/{file}"
                                     + (f" for rank(s) {receivers}" if receivers else "")) from exc
        with self._lock:
            self.bytes_read += len(buf)
        return buf

    def _read_alone(self, k: int) -> None:
        """Read a message only this rank needs; its buffer is dropped at once."""
        self._read(k)

    def _check_header(self, file: str) -> None:
        """The first read of a file from storage checks its header (when verifying)."""
        if not self.reader.verify:
            return
        with self._lock:
            lock = self._headers.setdefault(file, threading.Lock())
        with lock:  # the other threads reading this file wait for the check
            if file not in self._checked:
                self.reader.check_headers({file})
                self._checked.add(file)

    def _failure(self, exc: BaseException, doing: str) -> CheckpointError:
        """``exc`` as a typed error that names this rank (the others raise it too)."""
        kind = type(exc) if isinstance(exc, CheckpointError) else StorageError if isinstance(exc, OSError) \
            else CheckpointError
        return kind(f"rank {self.me}, {doing}: {exc}")

    def run(self) -> bool:
        """Fill this rank's needs. Returns False when another rank's read failed (this
        rank's targets are then incomplete); raises this rank's own failure. Within the
        windows a local failure is only reported through the agreement, so every rank
        leaves them at the same window."""
        p, me = self.plan, self.me
        windows = p.windows
        private = p.private(me).tolist()
        reads: dict[int, Future] = {}
        pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="safeckpt-share")
        submitted = 0
        failure: BaseException | None = None

        def submit_through(w: int) -> None:  # the reads of windows up to w, then the private ones
            nonlocal submitted
            while submitted <= min(w, len(windows) - 1):
                lo, hi = windows[submitted]
                for k in p.shared[lo:hi].tolist():
                    if p.m_reader[k] == me:
                        reads[k] = pool.submit(self._read, k)
                submitted += 1
                if submitted == len(windows):
                    for k in private:
                        reads[k] = pool.submit(self._read_alone, k)

        try:
            for w, (lo, hi) in enumerate(windows):
                submit_through(w + 1)
                window = p.shared[lo:hi].tolist()
                mine = [k for k in window if p.m_reader[k] == me]
                if failure is None:
                    failure = next((e for k in mine if (e := reads[k].exception()) is not None), None)
                if self.group.any(failure is not None):
                    if failure is not None:
                        raise failure
                    return False
                try:
                    self._send_and_receive(window, {k: reads.pop(k).result() for k in mine})
                except CollectiveError:
                    raise
                except Exception as exc:  # noqa: BLE001 - reported at the next window, or raised after
                    failure = self._failure(exc, "putting received bytes in place")
            for k in private:
                reads.pop(k).result()
            for file, start, checksum, what in self.needs.empty:
                self.reader.check_bytes(file, start, b"", checksum, what)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if failure is not None:
            raise failure
        return True

    def _send_and_receive(self, window: list[int], sent: dict[int, memoryview]) -> None:
        """One window: this rank's messages to their receivers, the others' to this
        rank; received bytes put in place."""
        p, me = self.plan, self.me
        sends: list[tuple[memoryview, int, int]] = []
        recvs: list[tuple[memoryview, int, int]] = []
        staged: list[tuple[int, memoryview]] = []
        for tag, k in enumerate(window):
            receivers = p.receivers(k)
            if k in sent:
                sends += [(sent[k], r, tag) for r in receivers]
            elif me in receivers:
                buf = self._direct(k)
                if buf is None:
                    buf = _buffer(int(p.end[k] - p.start[k]))
                    staged.append((k, buf))
                recvs.append((buf, int(p.m_reader[k]), tag))
                self.bytes_received += len(buf)
        self.transport.exchange(sends, recvs)
        for k, buf in staged:
            for i, data in self._parts(k, buf):
                self.needs.deliver(i, data)


def _distinct(group: TorchGroup, digests: list[str], spans: Spans) -> dict[str, Spans]:
    """Every distinct list of spans, by digest: one broadcast per list from the first
    rank holding it, or, when the lists are many (every rank its own), one all-gather
    of the lists (ranks repeating an earlier list send none)."""
    first = {d: digests.index(d) for d in dict.fromkeys(digests)}
    mine = spans if first[digests[group.rank]] == group.rank else None
    if len(first) <= DISTINCT_BROADCASTS:
        return {d: group.broadcast(mine if r == group.rank else None, r) for d, r in first.items()}
    gathered = group.all_gather(mine)
    return {d: gathered[r] for d, r in first.items()}


def _classes(scope: str, nodes: list[str], digests: list[str], lists: dict[str, Spans]) -> list[Needers]:
    """The ranks grouped by what they need (and by node, when each node reads for itself)."""
    keys: dict[tuple[str, str], list[int]] = {}
    for rank, digest in enumerate(digests):
        keys.setdefault((digest, nodes[rank] if scope == "node" else ""), []).append(rank)
    node_index = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    return [Needers(lists[d], ranks, node_index.get(n, 0)) for (d, n), ranks in keys.items()]


def share_reads(reader: TensorReader, work: ReadWork | None, group: Any, mode: str) -> bool | None:
    """Fill ``work`` with the other ranks of ``group`` (a collective: every rank calls
    it with the same ``mode``, also one whose planning failed: ``work`` None). Returns
    None when sharing does not pay (the caller reads ``work`` itself, as without
    sharing), True once filled, False when another rank's read failed; raises this
    rank's own failure."""
    if mode == "off" or not isinstance(group, TorchGroup) or group.size < 2:
        return None
    try:
        needs = None if work is None else Needs.of(work, list(reader.manifest.files), reader.manifest.block_size)
    except Exception:  # noqa: BLE001 - no rank shares; this one's own reads raise it again
        needs = None
    spans = needs.spans() if needs is not None else Spans.of([], [], [])
    wants_nccl = os.environ.get(TRANSPORT_ENV, "gloo").lower() == "nccl" and can_use_nccl(group)
    told = group.all_gather((node_id(), spans.digest(), needs is not None, wants_nccl))
    nodes, digests = [t[0] for t in told], [t[1] for t in told]
    scope = mode if mode != "auto" else ("job" if is_remote(reader.storage.url) or len(set(nodes)) > 1 else "off")
    if scope == "off" or not all(t[2] for t in told) or needs is None:
        return None
    lists = {digests[0]: spans} if len(set(digests)) == 1 else _distinct(group, digests, spans)
    plan = plan_sharing(_classes(scope, nodes, digests, lists), group.size, MESSAGE_BYTES, WINDOW_BYTES)
    if plan.shared_bytes < MIN_SHARED_BYTES:
        return None
    nccl = device_group(group) if all(t[3] for t in told) else None
    exchange = Exchange(reader, needs, plan, group, Transport(group, nccl))
    done = exchange.run()
    log.debug("rank %d shared a load of %s: read %d bytes, received %d (%s scope, %s)", group.rank,
              reader.storage.url, exchange.bytes_read, exchange.bytes_received, scope, "nccl" if nccl else "gloo")
    return done
