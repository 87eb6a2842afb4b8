"""Runs of checkpoints: one folder per step, retention after commit, restore with fallback."""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

from .checkpoint import CheckpointInfo, load, read_committed, retire, save
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .storage import Storage
from .storage import open as open_storage

log = logging.getLogger("safeckpt")
STEP_RE = re.compile(r"^step-(\d{9,})$")


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
        self._closed = False

    # -- listing ---------------------------------------------------------------------
    def _step_folders(self) -> list[int]:
        found = [int(m.group(1)) for name, size in self.storage.listdir().items()
                 if size is None and (m := STEP_RE.match(name))]
        return sorted(found)

    def _committed(self, step: int) -> bool:
        try:
            read_committed(self.storage.child(step_folder(step)))
            return True
        except (CheckpointNotFoundError, CorruptCheckpointError):
            return False

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint (valid manifest), ascending."""
        return [s for s in self._step_folders() if self._committed(s)]

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        for step in reversed(self._step_folders()):
            if self._committed(step):
                return step
        return None

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
        info = save(state, self.storage.child(step_folder(step)), metadata=metadata, metrics=metrics,
                    step=step, process_group=self.process_group, allow_pickle=self.allow_pickle)
        log.info("saved step %d: %d bytes in %.3fs (%.2f GB/s) to %s",
                 step, info.bytes, info.seconds, info.gbps, info.path)
        self._retain()
        return info

    def _retain(self) -> None:
        if self.keep_last is None:
            return
        committed = self.steps()
        for step in committed[:-self.keep_last]:
            self.delete(step)

    def delete(self, step: int) -> None:
        """Delete a checkpoint: manifests first (durably), then its data, then the folder."""
        folder = self.storage.child(step_folder(step))
        retire(folder, keep=None)
        folder.remove_folder()
        log.info("deleted checkpoint of step %d", step)

    # -- restoring ---------------------------------------------------------------------
    def restore(self, state: dict, step: int | None = None, *, strict: bool = True) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state``; return its step.

        Corrupt or incomplete checkpoints are skipped with a warning naming each. Returns
        None when the root has no committed checkpoint; raises if committed ones exist
        but none loads (the state may then be partly overwritten)."""
        self._check_open()
        if step is not None:
            load(state, self.path(step), strict=strict, allow_pickle=self.allow_pickle)
            return step
        skipped: list[str] = []
        failures: list[CheckpointError] = []
        for candidate in reversed(self._step_folders()):
            try:
                load(state, self.path(candidate), strict=strict, allow_pickle=self.allow_pickle)
            except (CheckpointNotFoundError, CorruptCheckpointError, StorageError) as exc:
                skipped.append(f"step {candidate}: {exc}")
                if not isinstance(exc, CheckpointNotFoundError):
                    failures.append(exc)
                continue
            if skipped:
                warnings.warn(f"restored step {candidate} from {self.storage.url}; skipped:\n  "
                              + "\n  ".join(skipped), stacklevel=2)
            log.info("restored step %d from %s", candidate, self.storage.url)
            return candidate
        if failures:
            raise CorruptCheckpointError(
                f"no checkpoint in {self.storage.url} could be restored:\n  " + "\n  ".join(skipped))
        if skipped:
            warnings.warn(f"no committed checkpoint in {self.storage.url}; skipped:\n  "
                          + "\n  ".join(skipped), stacklevel=2)
        return None

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
