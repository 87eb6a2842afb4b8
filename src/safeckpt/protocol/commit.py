"""The save protocol over a group of ranks (one process is a group of one).

1. Every rank flattens its state and sends rank 0 a description (never tensor data;
   its pieces as columns, ``PieceColumns``). Rank 0 checks that the ranks agree (path,
   step, shared values, shapes), draws the save id, and assigns each distinct piece to
   exactly one rank, balanced by bytes (numpy over every rank's pieces at once).
2. Every rank writes and fsyncs one data file named with the save id and its rank,
   and reports sizes and checksums (as columns, ``Written``). Rank 0 checks it can see
   every file (shared storage), then writes the manifest last.
   Incremental saves first hash their chunks; rank 0 answers which are new, and the
   manifest references the others where an earlier checkpoint of the run holds them.
3. Rank 0 broadcasts the outcome. On any failure nobody commits: every rank deletes
   what it wrote and raises, naming every failing rank and its error.
"""

from __future__ import annotations

import dataclasses
import operator
import secrets
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import numpy as np

from ..errors import CleanupWarning, warn
from ..format.checksum import BLOCK_SIZE, checksum
from ..format.folder import read_committed, retire, shared_by_siblings
from .datafile import DataFileLayout, WrittenPiece, plan_layout, write_data_file
from ..format.names import DATA_RE, data_file_name  # noqa: F401
from .leftovers import WRITER_KEY, clear_aborted, writer_tag
from .incremental import ChunkDigest, Source, Stored, chunk_key, digest_pieces, plan_reuse, reuse_index
from ..errors import (CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, SaveAbortedError,
                     UnsupportedFormatError)
from .group import SingleGroup, TorchGroup
from ..format.compact import Checksums, ChunkColumns, TableBuilder
from ..format.manifest import (WRITE_VERSION, Chunk, FileEntry, Manifest, encode_manifest, is_shared, manifest_name,
                       manifest_seq)
from ..format.pieces import PieceColumns, first_seen, unpad
from ..format.tree import child_key
from ..format.plan import PlanError, WritePlan, assign_writes, check_shards
from .plancache import PlanCache, Planned, Probe, fill_locals, layout_key, plans_of, split_locals, tree_digest
from .state import FlatState
from ..storage import Storage

VISIBILITY_WAIT_S = 5.0


@dataclass
class Intent:
    """Phase 1, every rank to rank 0."""

    url: str
    step: int | None
    pieces: PieceColumns  # columns, not an object per piece: rank 0 plans them all with numpy
    aliases: dict[str, str]
    tree: Any
    error: str | None = None
    has_local: bool = False
    digest: str | None = None  # of ``tree``'s exact JSON (``tree_digest``), when it holds no $local


@dataclass
class Assignment:
    """Phase 1 answer, rank 0 to each rank."""

    save_id: str = ""
    seq: int = 0
    write: list[str] = field(default_factory=list)
    abort: str | None = None
    errors: dict[int, str] = field(default_factory=dict)
    exists: bool = False
    chunks: list[int] = field(default_factory=list)  # incremental: indices of the new chunks
    plan_id: str = ""  # the plan's id, kept by every rank (``plancache``)
    replan: bool = False  # answer to a probe: some layout changed, plan in full


@dataclass
class Written:
    """A rank's ``WrittenPiece`` list as columns, in the order of its data file (which
    is the order of its ``Assignment.write``): byte ranges and block checksums."""

    start: np.ndarray
    end: np.ndarray
    sums: Checksums

    @classmethod
    def of(cls, pieces: list[WrittenPiece]) -> "Written":
        n = len(pieces)
        return cls(np.fromiter(map(_START, pieces), np.int64, n), np.fromiter(map(_END, pieces), np.int64, n),
                   Checksums.parse(list(map(_CHECKSUMS, pieces))))


@dataclass
class Report:
    """Phase 2, every rank to rank 0."""

    file: FileEntry | None = None
    written: list[WrittenPiece] = field(default_factory=list)
    error: str | None = None
    columns: Written | None = None  # ``written`` as columns, as a rank sends it (``compact``)

    def compact(self) -> "Report":
        """This report with its pieces as columns: small to send, quick for rank 0."""
        return Report(self.file, [], self.error, Written.of(self.written))

    def pieces(self) -> Written:
        return self.columns if self.columns is not None else Written.of(self.written)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def file_metadata(save_id: str) -> dict[str, str]:
    """The safetensors ``__metadata__`` of a save's data files: the save and the process
    writing it (by which a later save tells a dead writer's leftovers, ``leftovers``)."""
    return {"format": "pt", "safeckpt_save_id": save_id, WRITER_KEY: writer_tag()}




class SaveRun:
    """One save by one rank; ``run()`` returns the committed manifest's summary (its
    files and fields, without the tensor table and tree, which only rank 0 holds)."""

    #: whether the folder's manifests name every file a committed save owns there, so that
    #: a data file none names is an aborted save's (``clear_aborted``); a subclass whose
    #: folders record their files otherwise (the node tier's holding records) says no
    manifests_name_all_files = True

    def __init__(self, group: SingleGroup | TorchGroup, storage: Storage, *,
                 overwrite: "bool | Callable[[Manifest | None], bool]",
                 step: int | None, metadata: dict, metrics: dict, new_save_id: Any,
                 existing: Any, before_commit: Any = None, run_id: str | None = None,
                 durable_root: str | None = None, chunk_size: int | None = None, base: Any = None) -> None:
        self.group = group
        self.storage = storage
        self.overwrite = overwrite  # or, given the committed manifest (None: only torn ones), whether to replace
        self.step = step
        self.metadata = metadata
        self.metrics = metrics
        self.new_save_id = new_save_id
        self.existing = existing  # (storage) -> (committed Manifest | None, max seq seen)
        self.before_commit = before_commit  # rank 0, e.g. a writer lease check
        self.run_id = run_id
        self.durable_root = durable_root  # recorded in the manifest (a local tier's save)
        self.chunk_size = chunk_size  # set: an incremental save with chunks of this size
        self.base = base  # rank 0: () -> (sibling folder, Manifest) to share chunks with, or None
        self.index: dict[tuple[str, int], Stored] = {}
        self.digests: list[list[ChunkDigest]] = []  # rank 0: every rank's chunks
        self.own: list[tuple[ChunkDigest, Any]] = []  # this rank's chunks and their tensors
        self.writes: list[list[int]] = []
        self.sources: dict[tuple[int, int], Source] = {}
        self.local_error: BaseException | None = None
        self.old: Manifest | None = None
        self.tree: Any = None  # rank 0: the merged tree of every rank
        self.plan: WritePlan | None = None  # rank 0: who writes which piece
        self.committed = False
        self.where = storage.url  # what the ranks must agree they save to
        self.kept: Planned | None = None  # the plan cache's entry of this save's plan
        self.digest: str | None = None  # this rank's tree_digest of its tree, once computed

    def run(self, flatten: Any) -> Manifest:
        return self.finish(*self.prepare(flatten))

    def prepare(self, flatten: Any) -> "tuple[FlatState | None, list[Intent], Assignment]":
        """Phase 1 (and the chunk hashes of an incremental save): this rank's pieces,
        every rank's intent (rank 0 only) and what this rank writes. Raises, on every
        rank, when the save is refused or failed. A group that keeps plans first asks
        whether every rank's layout is the one of a kept plan (``plancache``)."""
        flat = self._guard(flatten)
        pieces = self._guard(lambda: PieceColumns.of([p.info for p in flat.pieces.values()] if flat else []))
        cache = plans_of(self.group) if self.group.size > 1 and self.chunk_size is None else None
        key = None
        if cache is not None:
            if flat is not None and pieces is not None:
                key = self._guard(lambda: layout_key(self.where, pieces, flat.aliases, self.group.rank,
                                                     self.group.size))
            reused = self._reuse(flat, cache, key)
            if reused is not None:
                return reused
            cache.planned += 1
        if self.group.size > 1 and flat is not None and not flat.has_local and self.digest is None:
            self.digest = self._guard(lambda: tree_digest(flat.tree))
        intent = Intent(self.where, self.step, pieces if pieces is not None else PieceColumns.of([]),
                        flat.aliases if flat else {}, flat.tree if flat else None,
                        describe_error(self.local_error) if self.local_error else None,
                        flat.has_local if flat else False, self.digest)
        intents = self.group.gather(intent)
        plans = self._plan(cast("list[Intent]", intents)) if self.group.rank == 0 else None  # gathered on rank 0
        mine: Assignment = self.group.scatter(plans)
        if mine.abort:
            self._raise(mine.abort, mine.errors, mine.exists)
        if cache is not None and key is not None:
            self.kept = Planned(mine.plan_id, list(mine.write), self.plan,
                                [Intent(i.url, i.step, PieceColumns.of([]), i.aliases, None)
                                 for i in cast("list[Intent]", intents or [])])
            cache.put(key, self.kept)
        if self.chunk_size is not None:
            self._deduplicate(flat, mine)
        return flat, cast("list[Intent]", intents), mine

    def _reuse(self, flat: FlatState | None, cache: PlanCache,
               key: str | None) -> "tuple[FlatState | None, list[Intent], Assignment] | None":
        """Phase 1 with a kept plan: every rank sends the id of the plan its layout is
        part of (and a digest of its values); when all name rank 0's, nobody sends its
        pieces and rank 0 plans nothing. None when the ranks must plan in full."""
        kept = cache.get(key) if key is not None else None
        probe = self._guard(lambda: self._probe(cast(FlatState, flat), kept)) if flat is not None else None
        if self.local_error is not None:
            probe = Probe(self.where, self.step, None, "", None, describe_error(self.local_error))
        probes = self.group.gather(probe)
        answer = self._decide(self.group.size, [p.error for p in cast("list[Probe]", probes)],
                              lambda: self._answer(cast("list[Probe]", probes), cast(FlatState, flat), kept)) \
            if self.group.rank == 0 else None
        mine: Assignment = self.group.scatter(answer)
        if mine.abort:
            self._raise(mine.abort, mine.errors, mine.exists)
        if mine.replan or kept is None:
            return None
        cache.reused += 1
        self.kept = kept
        mine.write = list(kept.write)
        return flat, kept.intents, mine

    def _probe(self, flat: FlatState, kept: Planned | None) -> Probe:
        blank, values = split_locals(flat.tree) if flat.has_local else (flat.tree, None)
        digest = tree_digest(blank)
        if not flat.has_local:
            self.digest = digest  # the same digest, should the ranks plan in full
        return Probe(self.where, self.step, kept.plan_id if kept is not None else None, digest, values)

    def _answer(self, probes: list[Probe], flat: FlatState, kept: Planned | None) -> list[Assignment]:
        """Rank 0: reuse ``kept`` when every rank named it, for the same folder, step and
        shared values; else every rank plans again (which also finds what is wrong)."""
        first = probes[0]
        if kept is None or any((p.plan, p.url, p.step, p.tree) != (kept.plan_id, first.url, first.step, first.tree)
                               for p in probes):
            return [Assignment(replan=True)] * len(probes)
        self.tree = flat.tree if first.values is None else \
            fill_locals(split_locals(flat.tree)[0], [cast(list, p.values) for p in probes])
        self.plan = kept.plan
        save_id, seq = self._claim()
        return [Assignment(save_id, seq, plan_id=kept.plan_id)] * len(probes)

    def finish(self, flat: FlatState | None, intents: list[Intent], mine: Assignment) -> Manifest:
        """Phases 2 and 3: write this rank's data file, then rank 0 commits."""
        report = self._write(flat, mine)
        try:
            reports = self.group.gather(report)
            outcome = self._commit(intents, cast("list[Report]", reports), mine) \
                if self.group.rank == 0 else None
            outcome = self.group.broadcast(outcome)
        except BaseException:  # interrupted (or lost the other ranks) before the outcome
            if report.file is not None and not self.committed:
                self._remove(report.file.name)
            raise
        if isinstance(outcome, tuple):
            if report.file is not None:
                self._remove(report.file.name)
            self._raise(*outcome)
        return outcome

    # -- phase 1 ---------------------------------------------------------------------
    def _guard(self, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # reported to every rank, re-raised below
            self.local_error = exc
            return None

    def _plan(self, intents: list[Intent]) -> list[Assignment]:
        return self._decide(len(intents), [i.error for i in intents], lambda: self._assign(intents))

    def _decide(self, size: int, failures: list[str | None], assign: Any) -> list[Assignment]:
        """Rank 0: ``assign()``, unless a rank failed; a refusal or failure of its own
        becomes every rank's abort."""
        errors = {r: e for r, e in enumerate(failures) if e}
        if not errors:
            try:
                return assign()
            except (PlanError, CheckpointExistsError, UnsupportedFormatError) as exc:
                if isinstance(exc, UnsupportedFormatError):
                    self.local_error = exc  # one process re-raises it as it is
                abort = Assignment(abort=str(exc), exists=isinstance(exc, CheckpointExistsError))
                return [abort] * size
            except Exception as exc:  # rank 0 failed to plan: report it, never hang
                self.local_error = exc
                errors = {0: describe_error(exc)}
        return [Assignment(abort=abort_summary(self.storage.url, errors), errors=errors)] * size

    def _assign(self, intents: list[Intent]) -> list[Assignment]:
        _check_agreement(intents)
        self.tree = merge_trees([i.tree for i in intents], digests=[i.digest for i in intents])
        plan = assign_writes([i.pieces for i in intents])
        check_shards(plan)
        save_id, seq = self._claim()
        self.plan = plan
        plan_id = secrets.token_hex(8) if len(intents) > 1 else ""
        return [Assignment(save_id, seq, plan.names(rank), plan_id=plan_id) for rank in range(len(intents))]

    def _claim(self) -> tuple[str, int]:
        """Rank 0: the folder's committed manifest and a new save id and sequence number
        (refused when the folder holds a checkpoint this save may not replace)."""
        self.old, max_seq = self.existing(self.storage)
        refuse_existing(self.storage, self.old, max_seq, self.overwrite)
        if self.manifests_name_all_files:
            try:  # killed saves' files: their space is this save's (a small disk fills otherwise)
                clear_aborted(self.storage, self.old)
            except OSError:
                pass  # best effort: garbage collection removes them later
        if self.chunk_size is not None and self.base is not None:
            self.index = reuse_index(self.base(), self.chunk_size)
        return self.new_save_id(), max_seq + 1

    # -- phase 2a: incremental saves -----------------------------------------------------
    def _deduplicate(self, flat: FlatState, mine: Assignment) -> None:
        """Hash this rank's chunks; rank 0 answers which ones no checkpoint holds yet."""
        pieces = [(n, flat.pieces[n].tensor, flat.pieces[n].info.offsets) for n in mine.write]
        chunk_size = cast(int, self.chunk_size)  # an incremental save
        result = self._guard(lambda: digest_pieces(pieces, chunk_size))
        digests, views = result if result is not None else ([], [])
        self.own = list(zip(digests, views))
        error = describe_error(cast(BaseException, self.local_error)) if result is None else None
        gathered = cast("list[Any]", self.group.gather((digests, error)))  # used on rank 0 only
        plans = None
        if self.group.rank == 0:
            errors = {r: e for r, (_, e) in enumerate(gathered) if e}
            if errors:
                plans = [Assignment(abort=abort_summary(self.storage.url, errors), errors=errors)] * self.group.size
            else:
                self.digests = [d for d, _ in gathered]
                self.writes, self.sources = plan_reuse(self.index, self.digests)
                plans = [Assignment(chunks=w) for w in self.writes]
        answer: Assignment = self.group.scatter(plans)
        if answer.abort:
            self._raise(answer.abort, answer.errors, answer.exists)
        mine.chunks = answer.chunks
        shapes = {n: flat.pieces[n].info.shape for n in mine.write}
        mine.write = [chunk_key(digests[i], digests[i].shape == shapes[digests[i].name]) for i in answer.chunks]

    # -- phase 2 ---------------------------------------------------------------------
    def _write(self, flat: FlatState | None, mine: Assignment) -> Report:
        """Write this rank's data file; the report it sends rank 0 (or its error)."""
        if not mine.write:
            return Report()
        name = data_file_name(mine.save_id, self.group.rank)
        try:
            return self._sent(self._write_file(cast(FlatState, flat), mine, name))  # a rank with writes has pieces
        except BaseException as exc:
            if not isinstance(exc, FileExistsError):
                self._remove(name)
            if not isinstance(exc, Exception):  # interrupted: clean up, do not report
                raise
            self.local_error = exc
            return Report(error=describe_error(exc))

    def _sent(self, report: Report) -> Report:
        """What this rank sends rank 0: the pieces of a full save as columns. One process
        keeps its objects (a staged save fills their checksums in place) and incremental
        saves their chunks."""
        return report.compact() if self.group.size > 1 and self.chunk_size is None else report

    def _write_file(self, flat: FlatState, mine: Assignment, name: str) -> Report:
        """Write this rank's data file ``name``; its entry and where each piece landed."""
        known = None
        if self.chunk_size is None:
            layout = self._layout(flat, mine)
        else:
            items = [(key, self.own[i][1]) for key, i in zip(mine.write, mine.chunks)]
            known = [[self.own[i][0].digest] for i in mine.chunks]
            layout = plan_layout(items, file_metadata(mine.save_id))
        written: list[WrittenPiece] = []
        size = write_data_file(self.storage, name, layout, written, known)
        return Report(self._file_entry(name, layout, size), written)

    @staticmethod
    def _layout(flat: FlatState, mine: Assignment) -> DataFileLayout:
        """Where each piece this rank writes goes in its data file."""
        return plan_layout([(n, flat.pieces[n].tensor) for n in mine.write], file_metadata(mine.save_id))

    def _file_entry(self, name: str, layout: DataFileLayout, size: int) -> FileEntry:
        return FileEntry(name, size, rank=self.group.rank, header_size=len(layout.header),
                         header_checksum=checksum(layout.header))

    def _commit(self, intents: list[Intent], reports: list[Report], mine: Assignment) -> Manifest | tuple:
        errors = {r: rep.error for r, rep in enumerate(reports) if rep.error}
        try:
            if not errors:
                manifest = self._build_manifest(intents, reports, mine)
                self._check_visible(reports)
                self._check_shared(manifest)
                if self.before_commit is not None:
                    self.before_commit()
                self._write_manifest(manifest)
                self._retire_old(manifest)
                return dataclasses.replace(manifest, tensors={}, tree=None)  # small to broadcast
        except Exception as exc:
            self.local_error = exc
            errors = {0: describe_error(exc)}
        return (abort_summary(self.storage.url, errors), errors, False)

    def _build_manifest(self, intents: list[Intent], reports: list[Report], mine: Assignment) -> Manifest:
        """The manifest (format 3): its tensor table filled straight from the reports."""
        files = {rep.file.name: rep.file for rep in reports if rep.file is not None}
        incremental = self.chunk_size is not None
        block = cast(int, self.chunk_size) if incremental else BLOCK_SIZE
        kept = self.kept
        if kept is not None and kept.table is not None:
            tensors = kept.refill(list(files), *_written(reports, cast("list[int]", kept.counts)))
        else:
            table = TableBuilder()
            if incremental:
                self._add_chunks(intents, reports, files, table)
                order = None
            else:
                order = self._add_pieces(cast(WritePlan, self.plan), reports, table)
            for intent in intents:
                for alias, first in intent.aliases.items():
                    table.alias(alias, first)
            tensors = table.build(list(files), block)
            if kept is not None and order is not None:  # the next save of this plan refills this table
                kept.keep(tensors, order[table.source], np.diff(cast(WritePlan, self.plan).at).tolist(),
                          *_ranges(reports))
        return Manifest(save_id=mine.save_id, seq=mine.seq, created=time.time(),
                        world_size=len(intents), files=files, tensors=tensors,
                        tree=self.tree, step=self.step, metadata=self.metadata, metrics=self.metrics,
                        run_id=self.run_id, durable_root=self.durable_root, block_size=block,
                        version=WRITE_VERSION)

    @staticmethod
    def _add_pieces(plan: WritePlan, reports: list[Report], table: TableBuilder) -> np.ndarray:
        """Every piece a rank wrote is one chunk: its box from the plan, its bytes and
        checksums from the rank's report (in the plan's order), added as columns in
        the order returned (of the reports' pieces, rank after rank)."""
        p = plan.pieces
        files, counts, written = [], [], []
        for rank, (rep, cols) in enumerate(zip(reports, _reported(reports, np.diff(plan.at).tolist()))):
            if cols is not None:
                files.append(cast(FileEntry, rep.file).name)
                counts.append(len(cols.start))
                written.append(cols)
        code = p.code[plan.rows]
        tensors = first_seen(code, len(p.names))
        lead = p.first[tensors]
        index = np.zeros(len(p.names), dtype=np.int64)
        index[tensors] = [table.tensor(p.names[c], p.dtypes[d], tuple(shape[:k])) for c, d, shape, k in
                          zip(tensors.tolist(), p.dtype[lead].tolist(), p.global_shape[lead].tolist(),
                              p.ndim[lead].tolist())]
        tensor = index[code]
        order = np.argsort(tensor, kind="stable")  # tensor after tensor, as the table holds them
        rows = plan.rows[order]
        ndim = p.ndim[rows].astype(np.int64)
        empty = np.zeros(0, np.int64)
        table.add(ChunkColumns(files, np.repeat(np.arange(len(files), dtype=np.int64), counts)[order], tensor[order],
                               np.concatenate([w.start for w in written] or [empty])[order],
                               np.concatenate([w.end for w in written] or [empty])[order],
                               Checksums.join([w.sums for w in written]).take(order), ndim,
                               unpad(p.offsets, rows, ndim), unpad(p.shape, rows, ndim)))
        return order

    def _add_chunks(self, intents: list[Intent], reports: list[Report], files: dict[str, FileEntry],
                    table: TableBuilder) -> None:
        """Incremental saves: every chunk, written now or found in an earlier checkpoint."""
        written: dict[tuple[int, int], Chunk] = {}
        for rank, rep in enumerate(reports):
            for i, w in zip(self.writes[rank], rep.written):  # written pieces imply a file
                written[(rank, i)] = Chunk(cast(FileEntry, rep.file).name, w.start, w.end, w.checksums, [], [])
        for rank, digests in enumerate(self.digests):
            infos = {p.name: p for p in intents[rank].pieces.infos()}
            for i, d in enumerate(digests):
                held = written.get((rank, i))
                if held is None:
                    source = self.sources[(rank, i)]
                    if isinstance(source, Stored):
                        files.setdefault(source.file.name, source.file)
                        held = dataclasses.replace(source.chunk, file=source.file.name)
                    else:
                        held = written[source]
                info = infos[d.name]
                table.chunk(table.tensor(d.name, info.dtype, info.global_shape), held.file, held.start, held.end,
                            held.checksums, d.offsets, d.shape)

    def _check_shared(self, manifest: Manifest) -> None:
        """Files shared with earlier checkpoints must still be there as they were listed."""
        for f in manifest.files.values():
            if not is_shared(f.name):
                continue
            try:
                size = self.storage.size(f.name)
            except FileNotFoundError:
                size = None
            if size != f.size:
                raise SaveAbortedError(
                    f"{self.storage.url}/{f.name}, which this incremental save shares with an earlier "
                    f"checkpoint, is {'missing' if size is None else f'{size} bytes, not {f.size}'}: was "
                    "it deleted by hand or by a gc of another process? Save again: the next save "
                    "writes every chunk it cannot share")

    def _check_visible(self, reports: list[Report]) -> None:
        check_visible(self.storage, [(r, rep.file) for r, rep in enumerate(reports) if rep.file is not None])

    def _write_manifest(self, manifest: Manifest) -> None:
        write_manifest(self.storage, manifest)
        self.committed = True

    def _retire_old(self, manifest: Manifest) -> None:
        retire_replaced(self.storage, self.old, manifest)

    # -- failure ---------------------------------------------------------------------
    def _remove(self, name: str) -> None:
        remove_quietly(self.storage, [name])

    def _raise(self, message: str, errors: dict[int, str], exists: bool) -> None:
        if exists:
            raise CheckpointExistsError(message)
        if self.group.size == 1 and self.local_error is not None:
            raise self.local_error
        cause = self.local_error
        raise SaveAbortedError(message, errors) from cause


def _reported(reports: list[Report], counts: list[int]) -> list[Written | None]:
    """Each rank's written pieces (None: no file), checked against the ``counts`` the
    plan gave the ranks to write."""
    out = []
    for rank, (rep, given) in enumerate(zip(reports, counts)):
        cols = rep.pieces() if rep.file is not None else None
        if (0 if cols is None else len(cols.start)) != given:
            raise SaveAbortedError(f"rank {rank} reported other pieces than the {given} it was given to write")
        out.append(cols)
    return out


def _written(reports: list[Report], counts: list[int]) -> tuple[np.ndarray, np.ndarray, Checksums]:
    """The reports' byte ranges and checksums, rank after rank, checked against the
    ``counts`` of pieces the plan gave the ranks."""
    cols = [c for c in _reported(reports, counts) if c is not None]
    return (*_ranges(reports, cols), Checksums.join([c.sums for c in cols]))


def _ranges(reports: list[Report], cols: "list[Written] | None" = None) -> tuple[np.ndarray, np.ndarray]:
    """The reports' byte ranges (start, end), rank after rank."""
    cols = [r.pieces() for r in reports if r.file is not None] if cols is None else cols
    empty = np.zeros(0, np.int64)
    return np.concatenate([c.start for c in cols] or [empty]), np.concatenate([c.end for c in cols] or [empty])


EXISTS = "Checkpoint already exists"  # DCP's words for this refusal: code that matches them keeps working


def refuse_existing(storage: Storage, old: Manifest | None, max_seq: int,
                    overwrite: "bool | Callable[[Manifest | None], bool]") -> None:
    """Raise ``CheckpointExistsError`` unless a save may go ahead in a folder whose
    committed manifest is ``old`` and whose highest manifest number is ``max_seq``.
    A manifest that is not valid is never replaced unasked: it may be the commit of a
    save that is running right now (``overwrite``, a bool or a function of ``old``)."""
    if not max_seq or (overwrite(old) if callable(overwrite) else overwrite):
        return
    if old is not None:
        step = "" if old.step is None else f" (step {old.step})"
        raise CheckpointExistsError(
            f"{EXISTS}: a committed checkpoint exists at {storage.url}{step}; pass overwrite=True to replace it "
            "atomically, or save to another path")
    raise CheckpointExistsError(
        f"{EXISTS}: {storage.url} holds a manifest that is not valid: left by a save that crashed while writing "
        "it, or being written right now by another save; pass overwrite=True to replace it")


def check_visible(storage: Storage, files: list[tuple[int, FileEntry]]) -> None:
    """Rank 0 must see every rank's file (``(rank, entry)``), or the checkpoint could
    never be loaded."""
    unseen = not_visible(storage, {f.name: f.size for _, f in files})
    missing = [(r, f) for r, f in files if f.name in unseen]
    if missing:
        named = ", ".join(f"rank {r}: {f.name}" for r, f in missing)
        raise SaveAbortedError(
            f"rank 0 cannot see files other ranks wrote to {storage.url} ({named}): the "
            "storage is not shared between the ranks (node-local disks?); save to a shared "
            "filesystem or an object store")


def retire_replaced(storage: Storage, old: Manifest | None, manifest: Manifest) -> None:
    """After a commit over ``old``: delete its manifest, then the data only it used."""
    if old is None:
        return
    try:
        # an incremental checkpoint's files may be read by later ones: spare those
        spare = shared_by_siblings(storage) if old.version >= 2 else set()
        retire(storage, keep=manifest, spare=spare)
    except OSError as exc:  # committed; leftovers are garbage for gc, not an error
        warn(f"saved {storage.url}, but removing the replaced version failed: {exc}", CleanupWarning)


def remove_quietly(storage: Storage, names: list[str]) -> None:
    """Best-effort removal of a failed save's files (what is left is garbage for gc)."""
    try:
        storage.delete(names)
    except OSError:
        pass


def not_visible(storage: Storage, sizes: dict[str, int]) -> set[str]:
    """The files of ``sizes`` that ``storage`` does not list with that size, after waiting
    up to ``VISIBILITY_WAIT_S`` (network filesystems may show a new file late)."""
    deadline = time.monotonic() + VISIBILITY_WAIT_S
    while True:
        listing = storage.listdir()
        missing = {name for name, size in sizes.items() if listing.get(name) != size}
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


def abort_summary(url: str, errors: dict[int, str]) -> str:
    ranks = ", ".join(str(r) for r in sorted(errors))
    lines = "\n  ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    return (f"save to {url} aborted on every rank; nothing was committed and the previous "
            f"checkpoint is untouched. Failed on rank(s) {ranks}:\n  {lines}")


def _check_agreement(intents: list[Intent]) -> None:
    first = intents[0]
    for rank, intent in enumerate(intents[1:], start=1):
        if intent.url != first.url or intent.step != first.step:
            raise PlanError(
                f"the ranks disagree on what to save: rank 0 saves step {first.step} to {first.url}, "
                f"rank {rank} step {intent.step} to {intent.url} (did a rank resume from another checkpoint?)")


_START, _END, _CHECKSUMS = operator.attrgetter("start"), operator.attrgetter("end"), operator.attrgetter("checksums")


def merge_trees(trees: list[Any], key: str = "", digests: "list[str | None] | None" = None) -> Any:
    """The saved tree: shared values must be the same on every rank, in their exact
    encoded form (``1``, ``1.0`` and ``True`` differ, and so do ``0.0`` and ``-0.0``,
    which Python's ``==`` calls equal); rank-local values (``{"$local": x}``) are
    collected into ``{"$local": [x_rank0, x_rank1, ...]}``. ``digests``: each rank's
    ``tree_digest`` of its tree (None where it holds ``$local``)."""
    first = trees[0]
    if len(trees) == 1 or (digests and digests[0] is not None and digests.count(digests[0]) == len(digests)):
        return first  # the common case: every rank's tree has the same JSON
    if isinstance(first, dict) and all(isinstance(t, dict) and t.keys() == first.keys() for t in trees):
        if first.keys() == {"$local"}:
            return {"$local": [t["$local"] for t in trees]}
        tagged = len(first) == 1 and next(iter(first)).startswith("$")  # a tag's argument keeps the value's key
        return {k: merge_trees([t[k] for t in trees], key if tagged else child_key(key, k)) for k in first}
    if isinstance(first, list) and all(isinstance(t, list) and len(t) == len(first) for t in trees):
        return [merge_trees([t[i] for t in trees], child_key(key, i)) for i in range(len(first))]
    differ = [r for r, t in enumerate(trees) if not _same_leaf(t, first)]
    if not differ:
        return first
    raise PlanError(
        f"the value at {key or '<root>'!r} differs between rank 0 and rank(s) {differ}; values that "
        "differ per rank must be wrapped in safeckpt.RankLocal (they are then saved per rank)")


def _same_leaf(a: Any, b: Any) -> bool:
    """Two encoded values (leaves, or containers of different shapes) are the same value:
    the same JSON type, and a float the same bits (a NaN equals a NaN of the same bits)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


def write_manifest(storage: Storage, manifest: Manifest, what: str = "save") -> None:
    """The commit: write the manifest,
    the last file of a save, never over another one (two writers of one folder: exactly
    one commits each sequence number). On return it is durable."""
    name = manifest_name(manifest.seq)
    try:
        storage.write_file(name, [encode_manifest(manifest)])
    except FileExistsError as exc:
        if name not in storage.listdir():  # listings show regular files only
            raise CheckpointExistsError(
                f"{storage.url}/{name} exists but is not a regular file (a FIFO, socket or link, which "
                "safeckpt never writes): remove it and save again") from exc
        raise CheckpointExistsError(
            f"another writer committed {name} in {storage.url} while this {what} was running; two "
            "writers are using one checkpoint path (its checkpoint stays as that writer left it)") from exc
    except BaseException:  # it may be complete on disk even though its fsync failed
        remove_quietly(storage, [name])
        raise


def read_existing(storage: Storage) -> tuple[Manifest | None, int]:
    """The committed manifest of a folder (if any) and the highest manifest sequence seen."""
    listing = storage.listdir()
    max_seq = max((s for n in listing if (s := manifest_seq(n)) is not None), default=0)  # folders too
    try:
        return read_committed(storage, listing), max_seq
    except UnsupportedFormatError:
        raise  # never write over a checkpoint this version cannot read
    except (CheckpointNotFoundError, CorruptCheckpointError):
        return None, max_seq
