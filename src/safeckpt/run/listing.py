"""What a run root holds: one status per checkpoint folder, for people and programs
(``safeckpt ls``, ``verify``, the integrations) without building a manager."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..format.folder import CheckpointState, as_step, folder_state, step_folders
from ..format.names import step_folder
from ..errors import StorageError
from ..storage import Storage
from ..storage import open as open_storage


@dataclass(frozen=True)
class CheckpointStatus:
    """One checkpoint folder: its state and, when committed, what its manifest records.

    ``bytes`` are the folder's own files; ``shared_bytes`` the data it reads from older
    checkpoints of an incremental run. ``problem`` says why a folder is not committed."""

    path: str
    step: int | None
    state: CheckpointState
    problem: str = ""
    bytes: int = 0
    shared_bytes: int = 0
    file_count: int = 0
    tensor_count: int | None = None
    created: float | None = None
    world_size: int | None = None
    save_id: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def committed(self) -> bool:
        return self.state is CheckpointState.COMMITTED


def checkpoint_status(folder: Storage, step: int | None = None) -> CheckpointStatus:
    """The status of one checkpoint folder (``step`` as its folder name says, if known)."""
    try:
        listing: dict[str, int | None] | None = folder.listdir()
    except StorageError:
        listing = None  # folder_state tries once more and reports the folder unreadable
    found = as_step(folder_state(folder, listing), folder.url, step)
    m = found.manifest
    if m is None:
        listing = listing or {}
        return CheckpointStatus(folder.url, step, found.state, found.problem,
                                bytes=sum(s for s in listing.values() if s is not None),
                                file_count=sum(1 for s in listing.values() if s is not None))
    return CheckpointStatus(folder.url, m.step if step is None else step, found.state, bytes=m.total_bytes,
                            shared_bytes=m.shared_bytes(), file_count=len(m.files), tensor_count=len(m.tensors),
                            created=m.created, world_size=m.world_size, save_id=m.save_id,
                            metrics=m.metrics, metadata=m.metadata)  # the manifest is ours (manifestcache)


def list_checkpoints(root: "str | os.PathLike[str] | Storage", *,
                     storage_options: dict[str, Any] | None = None) -> list[CheckpointStatus]:
    """Every step folder of a run root (``step-NNNNNNNNN``, docs/format.md §2.4), oldest
    first, with its status; a folder that cannot be read is a row in state
    ``UNREADABLE`` (a root that cannot be listed raises ``StorageError``). Reads only
    (manifests and listings); nothing is written or repaired."""
    storage = open_storage(root, **(storage_options or {}))
    return [checkpoint_status(storage.child(step_folder(step)), step) for step in step_folders(storage)]
