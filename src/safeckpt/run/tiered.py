"""Two tiers: commit on a fast local disk, then copy to the durable root in the background.

A copy follows the rule every save follows: each data file first, durable on return,
the manifest last, so the durable copy is committed exactly when it is complete and a
crash at any point leaves at most garbage there. A copy replaces the durable root's
checkpoint of the same step only where the manager may replace it (one of its run: a
loop resumed at the step it restored saves it again), atomically, as an overwrite does:
its manifest gets the next sequence number there and the old one is retired after it.
Incremental checkpoints name files of earlier checkpoints (``../step-.../data-...``);
the copy brings along each such file the durable root does not already hold under a
committed manifest. Only the newest waiting checkpoint is copied: a newer one
supersedes older ones that have not started yet.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, Collection, Iterator, NamedTuple, Sequence

from ..errors import ForeignRunWarning, ReplicationWarning, warn
from ..format.checksum import RunningChecksum, matches
from ..format.folder import FolderState, CheckpointState, read_committed
from ..protocol.commit import DATA_RE, read_existing, retire_replaced, write_manifest
from ..errors import CheckpointError, CorruptCheckpointError, SaveAbortedError
from ..format.manifest import Manifest, manifest_name, manifest_seq, root_path
from ..format.names import step_of
from ..storage import Storage

log = logging.getLogger(__name__)
COPY_BLOCK = 16 << 20


Check = tuple[int, int, str]  # bytes [start, end) of a file must have this checksum


def file_checks(m: Manifest) -> dict[str, list[Check]]:
    """Every byte range of each data file that the manifest records a checksum for."""
    out: dict[str, set[Check]] = {n: {(0, f.header_size, f.header_checksum)} for n, f in m.files.items()
                                  if f.header_size is not None and f.header_checksum is not None}
    for t in m.tensors.values():
        for c in t.chunks:
            ranges = out.setdefault(c.file, set())
            for i, expected in enumerate(c.checksums):
                lo = c.start + i * m.block_size
                ranges.add((lo, min(lo + m.block_size, c.end), expected))
    return {n: sorted(r) for n, r in out.items()}


def checked_parts(storage: Storage, name: str, size: int, checks: list[Check],
                   whole: str | None) -> Iterator[bytes]:
    """A file's bytes in blocks, each range in ``checks`` (and, for a sealed file, the
    ``whole`` file) checked as it passes: a copy never commits bytes that rotted."""
    running = RunningChecksum() if whole else None
    offset = first = 0
    while offset < size:
        end, last = min(size, offset + COPY_BLOCK), first
        while last < len(checks) and checks[last][0] < end:  # never cut a checked range
            end = max(end, checks[last][1])
            last += 1
        data = storage.read(name, offset, end - offset)
        for start, stop, expected in checks[first:last]:
            if not matches(memoryview(data)[start - offset:stop - offset], expected):
                raise CorruptCheckpointError(
                    f"{storage.url}/{name}: bytes {start}-{stop} fail their checksum; the local copy is "
                    "damaged and is not replicated (the durable root keeps its older checkpoints)")
        if running is not None:
            running.update(data)
        first = last
        yield data
        offset = end
    if running is not None and running.value != whole:
        raise CorruptCheckpointError(f"{storage.url}/{name}: fails its checksum; not replicated")


def copy_file(src: Storage, src_name: str, dst: Storage, dst_name: str, size: int,
              checks: Sequence[Check] = (), whole: str | None = None) -> None:
    """Copy one immutable file, checking it on the way; durable at the destination on return."""
    parts = checked_parts(src, src_name, size, list(checks), whole) if size else [b""]
    written = dst.write_file(dst_name, parts)
    if written != size:
        raise SaveAbortedError(f"copying {src.url}/{src_name} to {dst.url}/{dst_name} wrote {written} "
                               f"bytes, expected {size} (did the source change?)")


def belongs(m: Manifest, home: str) -> bool:
    """Whether a local tier's checkpoint was saved for the durable root ``home`` (its
    URL): only then may a job with that root restore, upload, replace or delete it (a
    local folder another job used before holds that job's checkpoints)."""
    return m.durable_root == home


def warn_foreign(home: str, found: list[tuple[str, Manifest]]) -> None:
    """Tell a restoring job of the checkpoints (``(where, manifest)``) of another durable
    root than its own (``home``) that it found in its local tier, and passed over."""
    lines = [f"{where}: step {m.step} (save {m.save_id}) for {m.durable_root or 'a durable root it does not name'}"
             for where, m in found]
    warn(f"restore: the local tier holds checkpoints of another durable root than {home}; they are never "
         "restored, uploaded or deleted here (give each durable root its own local folder):\n  "
         + "\n  ".join(lines), ForeignRunWarning)


def committed_files(root: Storage, folders: list[str]) -> set[str]:
    """``folder/file`` of every file a committed checkpoint under ``root`` names: these
    are complete and durable, so a copy never needs to write them again."""
    out: set[str] = set()
    for folder in folders:
        try:
            m = read_committed(root.child(folder))
        except CheckpointError:
            continue
        out |= {root_path(folder, name) for name in m.files}
    return out


def replicate(local: Storage, durable: Storage, folder: str, trusted: set[str],
              before_commit: Callable[[], None] = lambda: None, to: str | None = None,
              may_replace: Callable[[Manifest | None], bool] | None = None) -> Manifest:
    """Copy the committed checkpoint ``folder`` from ``local`` to ``durable`` (as folder
    ``to``, default the same name): data files first, the manifest last
    (``before_commit`` runs just before it: the writer lease check). ``trusted``
    (``folder/file`` of the files committed checkpoints in the durable root name) are
    not copied again. A different checkpoint committed there is replaced (``commit_copy``)
    where ``may_replace(it)`` says so, and refused otherwise. Returns the manifest the
    durable root holds afterwards."""
    src, dst = local.child(folder), durable.child(to or folder)
    m = read_committed(src)
    old, _ = read_existing(dst)
    if old is not None:
        if old.save_id == m.save_id:
            return old
        if may_replace is None or not may_replace(old):
            raise SaveAbortedError(
                f"{dst.url} already holds a different checkpoint of step {m.step} (save {old.save_id} of run "
                f"{old.run_id}, local {m.save_id} of run {m.run_id}): another job wrote this durable root; "
                "not replacing it")
    checks = file_checks(m)
    for name, f in m.files.items():
        if root_path(folder, name) in trusted:
            continue
        (s_store, s_name), (d_store, d_name) = src.locate(name), dst.locate(name)
        d_store.delete([d_name])  # a leftover of an interrupted copy: no committed manifest names it
        copy_file(s_store, s_name, d_store, d_name, f.size, checks.get(name, ()), f.checksum)
    spare = {n for n in dst.listdir() if root_path(to or folder, n) in trusted}
    return commit_copy(dst, m, src.read(manifest_name(m.seq)), old, before_commit, spare)


def commit_copy(dst: Storage, m: Manifest, data: bytes, old: Manifest | None,
                before_commit: Callable[[], None], spare: Collection[str] = ()) -> Manifest:
    """Commit the copy of checkpoint ``m`` (its manifest's bytes: ``data``), whose files
    are in ``dst`` now, replacing ``old`` (what ``dst`` holds committed, None if nothing)
    atomically, as an overwrite does: torn manifests and data of interrupted copies go
    first, the copy's manifest is written byte for byte (or, when its number is not
    above ``old``'s, renumbered after it), and ``old`` with the data only it names is
    retired after it. ``spare``: files there that committed checkpoints share. Returns the
    manifest written."""
    final = m if old is None or m.seq > old.seq else dataclasses.replace(m, seq=old.seq + 1)
    keep = {*m.files, *(old.files if old is not None else ()), *spare}
    old_name = None if old is None else manifest_name(old.seq)
    dst.delete([n for n in dst.listdir() if (manifest_seq(n) is not None and n != old_name)
                or (DATA_RE.fullmatch(n) and n not in keep)])
    before_commit()
    if final is m:
        dst.write_file(manifest_name(m.seq), [data])
    else:
        write_manifest(dst, final, "copy")
    read_committed(dst)  # the copy must be committed now, or this raises what is wrong
    retire_replaced(dst, old, final)
    return final


class Replicator:
    """Rank 0's background copier from the local tier to the durable root.

    ``submit(folder)`` queues a committed local checkpoint; a newer one replaces one that
    has not started. The writer lease is held on the durable root and checked before
    each durable commit and deletion (``before_commit``), so an unreachable durable
    root never stops a local save (after the first, which takes the lease). The worker
    thread is not a daemon, so a process that exits without ``close()`` still finishes
    the copy in progress. Errors are logged and warned at once (training goes on) and
    raised by ``wait()``/``close()``. ``after(manifest)`` runs after each copy (the
    durable tier's retention); ``may_replace(step)`` says which durable checkpoint of
    that step a copy may replace (``replicate``)."""

    def __init__(self, local: Storage, durable: Storage, list_folders: Callable[[], list[str]], *,
                 before_commit: Callable[[], None], after: Callable[[Manifest], None],
                 may_replace: Callable[[int], Callable[[Manifest | None], bool]]) -> None:
        self.local = local
        self.durable = durable
        self.list_folders = list_folders
        self.before_commit = before_commit
        self.after = after
        self.may_replace = may_replace  # step -> which durable checkpoint of it a copy may replace
        self._lock = threading.Condition()
        self._pending: str | None = None
        self._busy: str | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, folder: str) -> None:
        with self._lock:
            self._pending = folder
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="safeckpt-replicate")
                self._thread.start()

    @property
    def in_flight(self) -> set[str]:
        """Folders queued or being copied (local retention must keep them)."""
        with self._lock:
            return {f for f in (self._pending, self._busy) if f is not None}

    def _work(self) -> None:
        while True:
            with self._lock:
                folder, self._pending, self._busy = self._pending, None, self._pending
                if folder is None:
                    self._thread = None
                    self._lock.notify_all()
                    return
            try:
                self._copy(folder)
            except Exception as exc:  # noqa: BLE001 - kept for wait()/close(); training goes on
                with self._lock:
                    self._error = exc
                warn(f"replicating {folder} to {self.durable.url} failed (the local copy is intact; the "
                     f"next save retries): {exc}", ReplicationWarning)
            except BaseException as exc:  # the thread is told to die (a simulated crash): stop
                with self._lock:
                    self._error, self._pending, self._busy, self._thread = exc, None, None, None
                    self._lock.notify_all()
                return
            finally:
                with self._lock:
                    self._busy = None

    def _copy(self, folder: str) -> None:
        # read afresh each time: the durable tier's retention may have deleted files since
        step = step_of(folder)
        m = replicate(self.local, self.durable, folder, committed_files(self.durable, self.list_folders()),
                      self.before_commit, may_replace=None if step is None else self.may_replace(step))
        log.info("replicated step %s to %s", m.step, self.durable.child(folder).url)
        self.after(m)

    def wait(self) -> None:
        """Block until every queued copy is done; raise the last error nobody saw."""
        with self._lock:
            while self._thread is not None:
                self._lock.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self.wait()


class Candidate(NamedTuple):
    """A step folder a restore may try: its tier, state, and run id and save id or problem."""

    step: int
    tier: int
    state: CheckpointState
    run_id: str | None
    problem: str
    save_id: str | None = None


def tier_candidates(listings: list[list[tuple[int, FolderState]]], names: list[str]
                    ) -> tuple[list[Candidate], list[str]]:
    """Restore order across tiers: newest step first; for one step, the first tier (the
    local disk) first. Each listing holds (step, folder state) of one tier, named in
    ``names``. When the tiers hold *different* saves of one step (a node's copy that
    never reached the durable root, which another node then wrote), only the later save
    is a candidate; the notes say which copy was passed over."""
    newest: dict[int, Manifest] = {}
    for listing in listings:
        for step, found in listing:
            m = found.manifest
            if m is not None and (step not in newest or m.created > newest[step].created):
                newest[step] = m
    rows, notes = [], []
    for tier, listing in enumerate(listings):
        for step, found in listing:
            m = found.manifest
            if m is not None and m.save_id != newest[step].save_id:
                notes.append(f"step {step} in {names[tier]} (save {m.save_id}) is passed over: the "
                             f"later save {newest[step].save_id} of the same step is in another tier")
                continue
            rows.append(Candidate(step, tier, found.state, m.run_id if m else None, found.problem,
                                  m.save_id if m else None))
    return sorted(rows, key=lambda r: (-r.step, r.tier)), notes
