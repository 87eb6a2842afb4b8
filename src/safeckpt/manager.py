"""Runs of checkpoints: one folder per step, retention after commit, restore with fallback.

In a distributed job every rank makes the same calls; rank 0 looks at the storage and
tells the others what it saw, so the ranks never branch on listings that disagree.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

from .checkpoint import CheckpointInfo, load, read_committed, retire, save
from .errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .group import SingleGroup, TorchGroup, resolve
from .storage import Storage
from .storage import open as open_storage

log = logging.getLogger("safeckpt")
STEP_RE = re.compile(r"step-([0-9]{9,})", re.ASCII)


def step_folder(step: int) -> str:
    """Zero-padded so names sort like numbers: ``step-000000100``."""
    return f"step-{step:09d}"


class CheckpointManager:
    """Saves numbered checkpoints under ``root`` and restores the newest valid one.

    A checkpoint is deleted by retention only after a newer one is committed, and the
    newest committed checkpoint is never deleted. Only ``step-NNNNNNNNN`` folders that
    hold safeckpt manifests are ever touched; other files in ``root`` are left alone."""

    def __init__(self, root: "str | Storage", *, keep_last: int | None = None,
                 process_group: Any = None, storage_options: dict | None = None,
                 allow_pickle: bool = False) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (got {keep_last}); use None to keep all")
        self.storage = open_storage(root, **(storage_options or {}))
        self.keep_last = keep_last
        self.process_group = process_group
        self.allow_pickle = allow_pickle
        self._group: SingleGroup | TorchGroup | None = None
        self._closed = False

    @property
    def group(self) -> SingleGroup | TorchGroup:
        if self._group is None:
            self._group = resolve(self.process_group)
        return self._group

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
    def _step_folders(self) -> list[int]:
        found = [int(m.group(1)) for name, size in self.storage.listdir().items()
                 if size is None and (m := STEP_RE.fullmatch(name))]
        return sorted(found)

    def _not_committed(self, step: int) -> str | None:
        """None when ``step`` has a committed checkpoint, else why not."""
        return self._status(step)[1]

    def _status(self, step: int) -> tuple[str, str | None]:
        """("ok", None), ("incomplete", why) when no manifest exists (a save that never
        committed), or ("damaged", why) when a manifest exists but is not valid."""
        try:
            read_committed(self.storage.child(step_folder(step)))
            return "ok", None
        except CheckpointNotFoundError as exc:
            return "incomplete", str(exc)
        except CorruptCheckpointError as exc:
            return "damaged", str(exc)

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint (valid manifest), ascending."""
        return self._on_rank0(lambda: [s for s in self._step_folders() if self._not_committed(s) is None])

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        def newest() -> int | None:
            return next((s for s in reversed(self._step_folders()) if self._not_committed(s) is None), None)
        return self._on_rank0(newest)

    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives."""
        return self.storage.child(step_folder(step)).url

    # -- saving ----------------------------------------------------------------------
    def save(self, step: int, state: dict, *, metrics: dict | None = None,
             metadata: dict | None = None) -> CheckpointInfo:
        """Save ``state`` as the checkpoint of ``step``, then apply retention."""
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        folder = self.storage.child(step_folder(step))
        try:
            info = save(state, folder, metadata=metadata, metrics=metrics, step=step,
                        process_group=self.group, allow_pickle=self.allow_pickle)
        except BaseException:
            if self.group.rank == 0:
                _quietly(folder.remove_folder)  # only if the failed save left it empty
            raise
        log.info("saved step %d: %d bytes in %.3fs (%.2f GB/s) to %s",
                 step, info.bytes, info.seconds, info.gbps, info.path)
        if self.group.rank == 0:
            self._retain(just_saved=step)
        return info

    def _retain(self, just_saved: int) -> None:
        if self.keep_last is None:
            return
        committed = [s for s in self._step_folders() if self._not_committed(s) is None]
        for step in committed[:-self.keep_last]:
            if step == just_saved:
                continue  # an out-of-order save is kept until a later save retires it
            try:
                self.delete(step)
            except OSError as exc:  # the save is committed; a failed cleanup is not its error
                warnings.warn(f"retention could not delete step {step}: {exc}", stacklevel=3)

    def delete(self, step: int) -> None:
        """Delete a checkpoint: manifests first (durably), then its data, then the folder."""
        folder = self.storage.child(step_folder(step))
        retire(folder, keep=None)
        folder.remove_folder()
        log.info("deleted checkpoint of step %d", step)

    # -- restoring ---------------------------------------------------------------------
    def restore(self, state: dict, step: int | None = None, *, strict: bool = True) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state``; return its step.

        Incomplete saves and corrupt checkpoints are skipped with a warning naming each.
        Returns None when the root has no committed checkpoint; raises
        ``CorruptCheckpointError`` if committed ones exist but none loads (the state
        may then be partly overwritten)."""
        self._check_open()
        if step is not None:
            self._load(state, step, strict)
            return step
        candidates = self._on_rank0(
            lambda: [(s, *self._status(s)) for s in reversed(self._step_folders())])
        skipped: list[str] = []
        failed = False
        for i, (candidate, status, why_not) in enumerate(candidates):
            if status != "ok":
                # a crash can leave only the newest save torn; older damage is corruption
                failed = failed or (status == "damaged" and i > 0)
                skipped.append(f"step {candidate}: not committed ({why_not})")
                continue
            try:
                self._load(state, candidate, strict)
            except (CheckpointNotFoundError, CorruptCheckpointError, StorageError) as exc:
                skipped.append(f"step {candidate}: {exc}")
                failed = True
                continue
            if skipped:
                warnings.warn(f"restored step {candidate} from {self.storage.url}; skipped:\n  "
                              + "\n  ".join(skipped), stacklevel=2)
            log.info("restored step %d from %s", candidate, self.storage.url)
            return candidate
        if failed:
            raise CorruptCheckpointError(
                f"no checkpoint in {self.storage.url} could be restored:\n  " + "\n  ".join(skipped))
        if skipped:
            warnings.warn(f"no committed checkpoint in {self.storage.url}; skipped:\n  "
                          + "\n  ".join(skipped), stacklevel=2)
        return None

    def _load(self, state: dict, step: int, strict: bool) -> None:
        load(state, self.storage.child(step_folder(step)), strict=strict,
             process_group=self.group, allow_pickle=self.allow_pickle)

    # -- lifecycle ---------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every save has committed (saves are synchronous for now)."""

    def close(self) -> None:
        """Finish pending work; the manager cannot be used afterwards."""
        self.wait()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quietly(fn: Any) -> None:
    try:
        fn()
    except OSError:
        pass
