"""Runs of checkpoints: one folder per step, retention after commit, restore with
fallback, garbage collection, one writer per root, async saves and preemption.

In a distributed job every rank makes the same calls; rank 0 looks at the storage and
tells the others what it saw, so the ranks never branch on listings that disagree.
"""

from __future__ import annotations

import functools
import logging
import signal
from concurrent.futures import Future
from dataclasses import dataclass
import threading
import time
import uuid
from typing import Any, Callable, TypeVar, cast

from ..errors import CleanupWarning, ForeignRunWarning, SkippedCheckpointWarning, warn
from . import garbage
from .asyncsave import AsyncSaver, SaveFuture, background_group
from ..protocol.checkpoint import CheckpointInfo, load, log_save, save_request
from ..protocol.exchange import share_mode
from ..format.folder import retire
from ..format.folder import LOOKS, FolderState, CheckpointState, step_folders, step_state, survey
from ..protocol.incremental import CHUNK_SIZE, MIN_CHUNK_SIZE
from .tiered import Candidate, Replicator, belongs, tier_candidates, warn_foreign
from ..errors import (CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, ManagerClosedError,
                      StorageError, UnsupportedFormatError)
from ..protocol.group import SingleGroup, TorchGroup, resolve
from .lease import WriterLease
from ..format.manifest import Manifest
from ..format.names import RETIRED, step_folder
from .nodes import NodeLayout, NodeTier
from .retention import Retention
from ..storage import Storage
from ..storage import open as open_storage

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def _one_call_at_a_time(method: F) -> F:
    """A manager's saves, restores and deletions run one at a time, whichever threads
    call them: a save reads the newest checkpoint to share chunks with and its retention
    deletes older ones, which another thread's save in progress may be sharing."""
    @functools.wraps(method)
    def wrapper(self: "CheckpointManager", *args: Any, **kwargs: Any) -> Any:
        with self._calls:
            return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class Replaceable:
    """Which committed checkpoint of a step a manager's save may replace (atomically): one
    of this run (a loop resumed at the step it restored saves it again), a torn one (the
    manager holds the root's lease, so no other save is writing it) or one ``restore``
    found damaged; never another run's committed checkpoint, nor (refused with
    ``CheckpointExistsError``) one a local tier holds for another durable root than
    ``home`` (the durable root's URL when the save goes to a local tier). Plain data, so
    an async save's writer process can decide it."""

    run_id: str
    damaged: bool
    step: int
    where: str  # the step folder's URL, for the error
    home: str | None = None

    def __call__(self, old: "Manifest | None") -> bool:
        if old is not None and self.home is not None and not belongs(old, self.home):
            raise CheckpointExistsError(
                f"{self.where} holds a checkpoint of step {self.step} saved for another durable root "
                f"({old.durable_root or 'not named: an older safeckpt'}), which a save for {self.home} never "
                f"replaces: give each durable root its own local folder (local=)")
        return old is None or old.run_id == self.run_id or self.damaged


class CheckpointManager:
    """Saves numbered checkpoints under ``root`` and restores the newest valid one.

    Retention keeps the union of ``keep_last``, ``keep_best`` (by ``best_metric``,
    ``best_mode``) and ``keep_every``; it runs only after a newer checkpoint is
    committed, never deletes the newest, and only deletes checkpoints of this run (a
    new run started in an old root leaves the old run's checkpoints alone; a run that
    restored from one continues it). Only ``step-NNNNNNNNN`` folders and safeckpt's own
    files in them are ever touched. One manager writes a root at a time (see
    ``lease``); any thread may call it, and its saves, restores and deletions run one
    at a time. With ``async_save=True``, ``save`` returns a ``SaveFuture`` once the
    state is snapshotted. With ``handle_sigterm=True``, SIGTERM sets ``preempted``.

    With ``incremental=True`` each save writes only the chunks (``chunk_size`` bytes of
    a tensor at most) that the run's newest committed checkpoint does not already hold,
    and references the rest; every checkpoint still loads on its own, and data is
    deleted only when no committed checkpoint references it. Shared data is a single
    copy: ``full_every=N`` makes every N-th save write everything, so damage to one
    file cannot spread into all later checkpoints.

    With ``local=PATH`` saves commit on that (fast, node-local) disk and are copied to
    ``root`` in the background, data first and manifest last (see ``tiered``); the
    local tier keeps the newest ``keep_local``, ``root`` follows the retention rules,
    and ``restore`` takes the newest valid checkpoint of either tier, local first. When
    the ranks span several nodes, ``local`` is each node's own disk (see ``nodes``;
    ``local_replicas=1`` also keeps each node's files on the next node)."""

    def __init__(self, root: "str | Storage", *, keep_last: int | None = None,
                 keep_best: int | None = None, best_metric: str | None = None,
                 best_mode: str = "min", keep_every: int | None = None, async_save: bool = False,
                 process_group: Any = None, storage_options: dict | None = None,
                 allow_pickle: bool = False, handle_sigterm: bool = False,
                 incremental: bool = False, chunk_size: int = CHUNK_SIZE,
                 full_every: int | None = None, local: "str | Storage | None" = None,
                 keep_local: int = 2, local_replicas: int = 0) -> None:
        if type(chunk_size) is not int or chunk_size < MIN_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be an int of at least {MIN_CHUNK_SIZE} (bytes), not {chunk_size!r}")
        if full_every is not None and (type(full_every) is not int or full_every < 1):
            raise ValueError(f"full_every must be a positive int or None, not {full_every!r}")
        self.full_every = full_every
        self._saves = 0
        self.retention = Retention(keep_last, keep_best, best_metric, best_mode, keep_every)
        self.local_retention = Retention(keep_last=keep_local)
        self.chunk_size = chunk_size if incremental else None
        self.storage = open_storage(root, **(storage_options or {}))  # the durable root
        self.local = None if local is None else open_storage(local, **(storage_options or {}))
        if self.local is not None and self.local.url == self.storage.url:
            raise ValueError(f"local ({self.local.url}) must be another place than root")
        self.tiers = [self.storage] if self.local is None else [self.local, self.storage]
        self._replicator = None if self.local is None else Replicator(
            self.local, self.storage, lambda: [step_folder(s) for s in self._step_folders(self.storage)],
            before_commit=self._check_lease, after=self._after_replication,
            may_replace=lambda step: self._may_replace(step, self.storage))
        if local_replicas not in (0, 1):
            raise ValueError(f"local_replicas must be 0 or 1, not {local_replicas!r}")
        self.local_replicas = local_replicas
        self._nodes: NodeTier | None | bool = None if self.local is not None else False  # False: one node
        self.process_group = process_group
        self.allow_pickle = allow_pickle
        self.run_id = uuid.uuid4().hex[:16]
        self._group: SingleGroup | TorchGroup | None = None
        self._lease: WriterLease | None = None
        self._lease_lock = threading.Lock()
        self._calls = threading.RLock()  # see _one_call_at_a_time
        self._leased = False  # every rank: the first save took the lease (rank 0 holds it)
        self._saver = AsyncSaver() if async_save else None
        self._warned_foreign = False
        self._damaged: set[int] = set()  # steps restore() skipped: a save may replace them
        self._closed = False
        self._preempted = threading.Event()
        self._old_handler: Any = None
        if handle_sigterm:
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- ranks ---------------------------------------------------------------------------
    @property
    def group(self) -> SingleGroup | TorchGroup:
        if self._group is None:
            self._group = resolve(self.process_group)
        return self._group

    def _node_tier(self) -> "NodeTier | None":
        """The local tier across several nodes (``nodes``), decided on first use by every
        rank; then the manager's listings and retention are the durable root's."""
        if self._nodes is None:
            layout = NodeLayout.of(self.group)
            self._nodes = NodeTier(self, layout, self.local_replicas, may_replace=self._may_replace,
                                   check_lease=self._check_lease, after_durable=self._after_replication) \
                if len(layout.nodes) > 1 else False
            if self._nodes:
                self.tiers = [self.storage]
        return self._nodes if isinstance(self._nodes, NodeTier) else None

    def _on_rank0(self, fn: Any) -> Any:
        """Run ``fn`` on rank 0 and give every rank its result (or its error)."""
        result: Any = None
        if self.group.rank == 0:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                result = exc
        result = self.group.broadcast(result) if self.group.size > 1 else result
        if isinstance(result, Exception):
            raise result
        return result

    # -- listing ---------------------------------------------------------------------
    @property
    def save_root(self) -> Storage:
        """Where saves commit: the local tier, if there is one."""
        return self.tiers[0]

    def _step_folders(self, root: Storage | None = None) -> list[int]:
        return step_folders(root or self.save_root)

    def _read(self, step: int, root: Storage | None = None) -> FolderState:
        return step_state(root or self.save_root, step)

    def _survey(self, root: Storage, step: int | None = None, newest_only: bool = False
                ) -> list[tuple[int, FolderState]]:
        """``folder.survey`` of a tier (only ``step``, if given), newest first: checkpoints
        another process (or this one's background retention) deletes meanwhile never make
        a tier that always held one look empty; only this job's checkpoints count."""
        return survey(root, want=None if step is None else (lambda s: s == step), newest_only=newest_only,
                      counts=lambda m: not self._foreign(root, m))

    def _committed(self, root: Storage | None = None, complete: bool = False) -> dict[int, Manifest]:
        """Step -> manifest of the committed steps of this job's durable root, ascending;
        ``complete``: raise ``StorageError`` if a step folder cannot be read (retention
        must know every checkpoint that may share the data it deletes, and its metrics)."""
        root = root or self.save_root
        out: dict[int, Manifest] = {}
        for step, found in reversed(self._survey(root)):
            if complete and found.state is CheckpointState.UNREADABLE:
                raise StorageError(f"retention stopped: {found.problem}")
            if found.manifest is not None and not self._foreign(root, found.manifest):
                out[step] = found.manifest
        return out

    def _foreign(self, root: Storage, m: Manifest) -> bool:
        """A checkpoint in the local tier saved for another durable root (a job that used
        the folder before): never restored, listed, uploaded, replaced or deleted here."""
        return root is not self.storage and not belongs(m, self.storage.url)

    def _holds(self, step: int, root: Storage) -> bool:
        """Whether ``root`` holds a committed checkpoint of ``step`` of this job's root."""
        m = self._read(step, root).manifest
        return m is not None and not self._foreign(root, m)

    @_one_call_at_a_time
    def steps(self) -> list[int]:
        """Steps with a committed checkpoint (valid manifest) in any tier, ascending."""
        return self._on_rank0(lambda: sorted(set().union(*(self._committed(t) for t in self.tiers))))

    @_one_call_at_a_time
    def latest_step(self) -> int | None:
        """The newest committed step in any tier, or None."""
        def newest(root: Storage) -> int | None:
            return next((s for s, f in self._survey(root, newest_only=True)
                         if f.manifest is not None and not self._foreign(root, f.manifest)), None)
        return self._on_rank0(lambda: max((s for t in self.tiers if (s := newest(t)) is not None), default=None))

    @_one_call_at_a_time
    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives (the local tier's copy when it has one)."""
        def where() -> str:
            root = next((t for t in self.tiers if self._holds(step, t)), self.save_root)
            return root.child(step_folder(step)).url
        return self._on_rank0(where) if len(self.tiers) > 1 else self.save_root.child(step_folder(step)).url

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
        return self._closed

    # -- saving ----------------------------------------------------------------------
    @_one_call_at_a_time
    def save(self, step: int, state: dict, *, metrics: dict | None = None,
             metadata: dict | None = None) -> CheckpointInfo | SaveFuture:
        """Save ``state`` as the checkpoint of ``step``, then apply retention and
        garbage collection. Returns a ``SaveFuture`` when the manager is async."""
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        if self._saver is not None:
            self._saver.wait()  # one save in flight; an unseen error surfaces here
        if self._replicator is None or not self._leased:  # the same decision on every rank
            self._on_rank0(self._check_lease)  # a second job fails here, before writing anything
            self._leased = True
        nodes = self._node_tier()
        folder = (cast(Storage, self.local) if nodes else self.save_root).child(step_folder(step))  # nodes: local=
        group = background_group(self.process_group) if self._saver else self.group
        request = save_request(folder, metadata=metadata, metrics=metrics, step=step,
                               process_group=group, allow_pickle=self.allow_pickle,
                               before_commit=self._check_lease if self._replicator is None else None)
        request.run_id = self.run_id
        request.durable_root = None if self.local is None else self.storage.url
        request.overwrite = self._may_replace(step)
        if nodes:
            nodes.prepare(request)
        self._saves += 1
        if self.chunk_size is not None:
            request.chunk_size = self.chunk_size  # chunks are hashed even by a full save, to share later
            if not (self.full_every and self._saves % self.full_every == 0):
                request.base = lambda: self._base(step)
        if self._saver is not None:
            future = self._saver.submit(state, request, on_done=self._after_save)
            def remove_if_failed(f: Future) -> None:
                if Future.exception(f) is not None:  # the base method: looking must not mark it seen
                    self._remove_if_empty(folder)
            future.add_done_callback(remove_if_failed)
            return future
        try:
            info = request.run(request.flattener(state), _now())
        except BaseException:
            self._remove_if_empty(folder)
            raise
        self._after_save(info)
        return info

    def _may_replace(self, step: int, root: Storage | None = None) -> "Replaceable":
        """Which checkpoint of ``step`` a save into ``root`` (default: where saves commit)
        may replace (``Replaceable``); with a local tier, a loop resumed at the step it
        restored replaces its copy in the durable root too."""
        root = root or self.save_root
        home = None if root is self.storage else self.storage.url
        return Replaceable(self.run_id, step in self._damaged, step, root.child(step_folder(step)).url, home)

    def _remove_if_empty(self, folder: Storage) -> None:
        """After a failed save: drop its step folder if the save left it empty."""
        if self.group.rank == 0:
            _quietly(folder.remove_folder)

    def _after_save(self, info: CheckpointInfo, blocked_seconds: float | None = None) -> None:
        log_save(info, blocked_seconds)
        if self.group.rank != 0 or self._nodes:  # the node tier retains behind its uploads
            return
        retention = self.retention if self._replicator is None else self.local_retention
        copying = set() if self._replicator is None else self._replicator.in_flight
        try:
            self._retain(self.save_root, retention, info.step, {int(f[5:]) for f in copying},
                         fenced=self._replicator is None)
            garbage.collect(self.save_root, incomplete=False)
        except OSError as exc:  # the save is committed; a failed cleanup is not its error
            warn(f"saved step {info.step}, but cleaning up older checkpoints failed: {exc}", CleanupWarning)
        if self._replicator is not None:
            self._replicator.submit(step_folder(cast(int, info.step)))  # a manager's saves have steps

    def _after_replication(self, m: Manifest) -> None:
        """The replicator's thread, after a copy committed in the durable root."""
        self._retain(self.storage, self.retention, m.step)
        garbage.collect(self.storage, incomplete=False)

    def _base(self, step: int) -> tuple[str, Manifest] | None:
        """Rank 0: the newest committed checkpoint of this run, whose chunks a save shares."""
        for s in reversed(self._step_folders(self.save_root)):
            m = self._read(s, self.save_root).manifest if s != step else None
            if m is not None and m.run_id == self.run_id and not self._foreign(self.save_root, m):
                return step_folder(s), m
        return None

    def _check_lease(self) -> None:
        with self._lease_lock:  # the training thread and the replicator's both check it
            if self._lease is None:
                lease = WriterLease(self.storage, self.run_id)
                lease.acquire()
                self._lease = lease
            else:
                self._lease.check()

    def _retain(self, root: Storage, retention: Retention, just_saved: int | None,
                protect: "set[int] | frozenset[int]" = frozenset(), fenced: bool = True) -> None:
        if retention.keeps_all:
            return
        committed = self._committed(root, complete=True)
        mine = {s: m.metrics for s, m in committed.items() if m.run_id == self.run_id}
        others = sorted(s for s, m in committed.items() if m.run_id != self.run_id)
        if others and not self._warned_foreign:
            self._warned_foreign = True
            warn(f"{root.url} holds checkpoints of another run (steps {others}); retention leaves "
                 "them alone. Call restore() to continue that run, or delete them yourself", ForeignRunWarning)
        keep = retention.keep(mine, protect={just_saved, *protect} if just_saved is not None else set(protect))
        doomed = sorted(s for s in mine if s not in keep and s != max(committed))
        if doomed and fenced:
            self._check_lease()
        for step in doomed:
            self._delete(root, step, committed)
            del committed[step]

    @_one_call_at_a_time
    def retain(self, just_saved: int | None = None) -> None:
        """Apply the retention rules now, as after a save, keeping ``just_saved``: for
        checkpoints of this run committed another way (a folder another tool wrote,
        sealed with ``safeckpt.seal(..., run_id=mgr.run_id)``). Every rank calls it;
        rank 0 deletes."""
        self._check_open()
        if self.group.rank == 0:
            self._retain(self.save_root, self.retention, just_saved)

    @_one_call_at_a_time
    def delete(self, step: int) -> None:
        """Delete a checkpoint (from every tier): manifests first (durably), then the data
        no other checkpoint shares, then the folder. Shared data stays (the folder
        marked retired) until garbage collection finds nothing needs it."""
        self._check_open()
        self._check_lease()
        self.wait()
        for root in self.tiers:
            if (m := self._read(step, root).manifest) is None or not self._foreign(root, m):
                self._delete(root, step, self._committed(root, complete=True))

    def _delete(self, root: Storage, step: int, committed: dict[int, Manifest]) -> None:
        name = step_folder(step)
        folder = root.child(name)
        shared = garbage.shared_files({s: m for s, m in committed.items() if s != step}).get(name, set())
        try:  # before the manifests go: while it is deleted (or after a crash) the folder reads as
            # retired, never as a torn save, to readers in other processes and to gc
            folder.write_file(RETIRED, [b"retired by safeckpt: deleted, or holding data later checkpoints share\n"])
        except FileExistsError:
            pass
        retire(folder, keep=None, spare=shared)
        if not shared:
            folder.delete([RETIRED])  # last of its files: the folder stays marked until then
            _remove_empty_folders(folder)
            folder.remove_folder()
        log.info("deleted checkpoint of step %d from %s%s", step, root.url,
                 f" ({len(shared)} shared file(s) kept)" if shared else "")

    @_one_call_at_a_time
    def gc(self, *, dry_run: bool = False, min_age_s: float | None = None) -> list[str]:
        """Remove files of interrupted saves and data no committed checkpoint needs;
        never a committed checkpoint or a file safeckpt did not write. Call it between
        saves (the manager does, after each commit); ``min_age_s`` also spares saves
        younger than that, for use while another process may be saving. Returns what
        was (or would be) removed (with a local tier, prefixed by each tier's URL)."""
        self.wait()  # a save in flight is not garbage
        if not dry_run:
            self._check_open()
            self._check_lease()
        tiers = self.tiers if self._nodes is False or self.group.size == 1 else [self.storage]
        if len(tiers) == 1:  # a node's disk holds no manifest: gc is the node tier's retention
            return garbage.collect(self.storage, min_age_s=min_age_s, dry_run=dry_run)
        return [f"{t.url}/{name}" for t in tiers
                for name in garbage.collect(t, min_age_s=min_age_s, dry_run=dry_run)]

    # -- restoring ---------------------------------------------------------------------
    @_one_call_at_a_time
    def restore(self, state: dict, step: int | None = None, *, strict: bool = True,
                share_reads: "str | bool | None" = None) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state``; return its step.

        Incomplete saves and corrupt checkpoints are skipped with a warning naming each.
        With a local tier, a step is taken from the local disk when it holds a valid
        copy and from ``root`` otherwise. Returns None when no tier has a committed
        checkpoint; raises ``CorruptCheckpointError`` if committed ones exist but none
        loads (the state may then be partly overwritten). Restoring continues that
        checkpoint's run. ``share_reads``: as for ``load`` (bytes several ranks need are
        read once and sent between them)."""
        self._check_open()
        share_mode(share_reads)  # a bad value is refused before anything is read
        self.wait()
        if nodes := self._node_tier():
            return nodes.restore(state, step, strict)
        look = 1
        while True:
            try:
                return self._restore_newest(state, step, strict, share_reads, look_again=look < LOOKS)
            except _Changed:  # a checkpoint it tried was deleted or replaced while it loaded
                look += 1

    def _restore_newest(self, state: dict, step: int | None, strict: bool, share_reads: "str | bool | None",
                        look_again: bool) -> int | None:
        """``restore`` from one look at the tiers; raises ``_Changed`` (when ``look_again``)
        if a checkpoint failed to load because another process deleted or replaced it
        meanwhile (a reader racing a writer's retention): the tiers are then looked at again."""
        where = " and ".join(t.url for t in self.tiers)
        candidates = self._on_rank0(lambda: self._candidates(step))
        skipped: list[str] = []
        failed = False
        newest_seen: set[int] = set()
        for c in candidates:
            root = self.tiers[c.tier]
            first_of_tier = c.tier not in newest_seen
            newest_seen.add(c.tier)
            if c.state is CheckpointState.NEWER_FORMAT:  # resuming from an older step instead would lose work
                raise UnsupportedFormatError(c.problem)
            if c.state is CheckpointState.RETIRED:
                continue
            if c.state is not CheckpointState.COMMITTED:
                # a crash can leave only the newest save torn; older damage is corruption, and
                # an unreadable folder may hold a commit: nothing loading is then an error
                failed = failed or c.state is CheckpointState.UNREADABLE or (
                    c.state is CheckpointState.CORRUPT and (not first_of_tier or step is not None))
                why = "unreadable" if c.state is CheckpointState.UNREADABLE else "not committed"
                skipped.append(f"step {c.step} in {root.url}: {why} ({c.problem})")
                self._damaged.add(c.step)
                continue
            try:
                self._load(state, root, c.step, strict, share_reads)
            except (CheckpointNotFoundError, CorruptCheckpointError, StorageError) as exc:
                if look_again and self._on_rank0(lambda: self._replaced(root, c)):
                    raise _Changed from exc
                skipped.append(f"step {c.step} in {root.url}: {exc}")
                self._damaged.add(c.step)
                failed = True
                continue
            if skipped:
                warn(f"restored step {c.step} from {root.url}; skipped:\n  " + "\n  ".join(skipped),
                     SkippedCheckpointWarning)
            log.info("restored step %d from %s", c.step, root.url)
            self.run_id = c.run_id or self.run_id
            if c.tier == 0 and self._replicator is not None and self.group.rank == 0 \
                    and self._read(c.step, self.storage).state is not CheckpointState.COMMITTED:
                self._replicator.submit(step_folder(c.step))  # a copy the last job did not finish
            return c.step
        if failed:
            raise CorruptCheckpointError(
                f"no checkpoint {'' if step is None else f'of step {step} '}in {where} could be restored:\n  "
                + "\n  ".join(skipped))
        if step is not None:
            raise CheckpointNotFoundError(f"no committed checkpoint of step {step} in {where}"
                                          + "".join(f"; {s}" for s in skipped))
        if skipped:
            warn(f"no committed checkpoint in {where}; skipped:\n  " + "\n  ".join(skipped),
                 SkippedCheckpointWarning)
        return None

    def _replaced(self, root: Storage, c: Candidate) -> bool:
        """Rank 0: whether the checkpoint ``c`` is no longer the one its folder holds."""
        m = self._read(c.step, root).manifest
        return m is None or m.save_id != c.save_id

    def _candidates(self, step: int | None) -> list[Candidate]:
        """Rank 0: the step folders to try, in order."""
        listings = [list(reversed(self._survey(root, step))) for root in self.tiers]
        foreign = [(root.child(step_folder(s)).url, f.manifest) for root, listing in zip(self.tiers, listings)
                   for s, f in listing if f.manifest is not None and self._foreign(root, f.manifest)]
        if foreign:
            warn_foreign(self.storage.url, foreign)
        listings = [[(s, f) for s, f in listing if f.manifest is None or not self._foreign(root, f.manifest)]
                    for root, listing in zip(self.tiers, listings)]
        rows, notes = tier_candidates(listings, [t.url for t in self.tiers])
        if notes:
            warn("restore: " + "; ".join(notes), SkippedCheckpointWarning)
        return rows

    def _load(self, state: dict, root: Storage, step: int, strict: bool, share_reads: "str | bool | None") -> None:
        load(state, root.child(step_folder(step)), strict=strict, process_group=self.group,
             allow_pickle=self.allow_pickle, share_reads=share_reads)

    # -- preemption --------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self._closed:
            log.warning("SIGTERM received: finish this step, save, and exit (mgr.preempted is set)")
            self._preempted.set()
        if getattr(self._old_handler, "__func__", None) is CheckpointManager._on_sigterm:
            self._old_handler(signum, frame)  # another manager is preempted too

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``handle_sigterm=True``): save and exit."""
        return self._preempted.is_set()

    # -- lifecycle ---------------------------------------------------------------------
    def wait(self) -> CheckpointInfo | None:
        """Block until the save in flight has committed (and, with a local tier, been
        copied to ``root``); raise its error if nobody saw it."""
        info = self._saver.wait() if self._saver is not None else None
        if self._replicator is not None:
            self._replicator.wait()
        if isinstance(self._nodes, NodeTier):
            self._nodes.sync.wait()
        return info

    @_one_call_at_a_time
    def close(self) -> None:
        """Commit what is in flight; the manager cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._saver is not None:
                self._saver.close()
        finally:
            try:
                if self._replicator is not None:
                    self._replicator.close()
                if isinstance(self._nodes, NodeTier):
                    self._nodes.sync.wait()
            finally:
                self._restore_handler()

    def _restore_handler(self) -> None:
        if self._old_handler is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, _unwrap_closed(self._old_handler))

    def _check_open(self) -> None:
        """Saves, restores and deletions of a closed manager are refused (its lease, saver
        and copier are done); listing its root (``steps()``, ``path()``) still works."""
        if self._closed:
            raise ManagerClosedError(
                f"this CheckpointManager of {self.storage.url} is closed (close() ran, or its with-block "
                "ended): it saves, restores and deletes nothing more; create a new one to continue")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Changed(Exception):
    """A checkpoint ``restore`` tried was deleted or replaced while it loaded."""


def _now() -> float:
    return time.perf_counter()


def _unwrap_closed(handler: Any) -> Any:
    """The handler to reinstall: past any closed manager's, to what it replaced."""
    while getattr(handler, "__func__", None) is CheckpointManager._on_sigterm and handler.__self__._closed:
        handler = handler.__self__._old_handler
    return handler


def _remove_empty_folders(folder: Storage) -> None:
    """Remove the sub-folders of ``folder`` that deleting its files left empty (another
    tool's checkpoint sealed into it: a DeepSpeed tag under Accelerate)."""
    for name, size in folder.listdir().items():
        if size is None:
            sub = folder.child(name)
            _remove_empty_folders(sub)
            sub.remove_folder()


def _quietly(fn: Any) -> None:
    try:
        fn()
    except OSError:
        pass
