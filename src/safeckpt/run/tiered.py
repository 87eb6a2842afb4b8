"""Two tiers: commit on a fast local disk, then copy to the durable root in the background.

A copy follows the rule every save follows: each data file first, durable on return,
the manifest last and byte for byte, so the durable copy is committed exactly when it
is complete and a crash at any point leaves at most garbage there. Incremental
checkpoints name files of earlier checkpoints (``../step-.../data-...``); the copy
brings along each such file the durable root does not already hold under a committed
manifest. Only the newest waiting checkpoint is copied: a newer one supersedes older
ones that have not started yet.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterator, NamedTuple, Sequence

from ..errors import ForeignRunWarning, ReplicationWarning, warn
from ..format.checksum import RunningChecksum, matches
from ..format.folder import FolderState, CheckpointState, read_committed
from ..protocol.commit import DATA_RE
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, SaveAbortedError
from ..format.manifest import Manifest, manifest_name, manifest_seq, root_path
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
              before_commit: Callable[[], None] = lambda: None, to: str | None = None) -> Manifest:
    """Copy the committed checkpoint ``folder`` from ``local`` to ``durable`` (as folder
    ``to``, default the same name): data files first, the manifest last
    (``before_commit`` runs just before it: the writer lease check). ``trusted``
    (``folder/file`` of the files committed checkpoints in the durable root name) are
    not copied again. Returns the manifest."""
    src, dst = local.child(folder), durable.child(to or folder)
    m = read_committed(src)
    there = dst.listdir()
    try:
        done = read_committed(dst, there)
    except (CheckpointNotFoundError, CorruptCheckpointError):
        done = None
    if done is not None:
        if done.save_id != m.save_id:
            raise SaveAbortedError(
                f"{dst.url} already holds a different checkpoint of step {m.step} (save {done.save_id}, "
                f"local {m.save_id}): another job wrote this durable root; not replacing it")
        return m
    checks = file_checks(m)
    for name, f in m.files.items():
        if root_path(folder, name) in trusted:
            continue
        (s_store, s_name), (d_store, d_name) = src.locate(name), dst.locate(name)
        d_store.delete([d_name])  # a leftover of an interrupted copy: no committed manifest names it
        copy_file(s_store, s_name, d_store, d_name, f.size, checks.get(name, ()), f.checksum)
    name = manifest_name(m.seq)
    stale = [n for n in there if manifest_seq(n) is not None
             or (DATA_RE.fullmatch(n) and n not in m.files and f"{folder}/{n}" not in trusted)]
    dst.delete(stale)  # torn manifests and data of an interrupted copy of another attempt
    before_commit()
    dst.write_file(name, [src.read(name)])
    read_committed(dst)  # the copy must be committed now, or this raises what is wrong
    return m


class Replicator:
    """Rank 0's background copier from the local tier to the durable root.

    ``submit(folder)`` queues a committed local checkpoint; a newer one replaces one that
    has not started. The writer lease is held on the durable root and checked before
    each durable commit and deletion (``before_commit``), so an unreachable durable
    root never stops a local save (after the first, which takes the lease). The worker
    thread is not a daemon, so a process that exits without ``close()`` still finishes
    the copy in progress. Errors are logged and warned at once (training goes on) and
    raised by ``wait()``/``close()``. ``after(manifest)`` runs after each copy (the
    durable tier's retention)."""

    def __init__(self, local: Storage, durable: Storage, list_folders: Callable[[], list[str]], *,
                 before_commit: Callable[[], None], after: Callable[[Manifest], None]) -> None:
        self.local = local
        self.durable = durable
        self.list_folders = list_folders
        self.before_commit = before_commit
        self.after = after
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
        m = replicate(self.local, self.durable, folder, committed_files(self.durable, self.list_folders()),
                      self.before_commit)
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
    """A step folder a restore may try: its tier, state, and run id or problem."""

    step: int
    tier: int
    state: CheckpointState
    run_id: str | None
    problem: str


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
            rows.append(Candidate(step, tier, found.state, m.run_id if m else None, found.problem))
    return sorted(rows, key=lambda r: (-r.step, r.tier)), notes
