"""Folders of files another tool wrote, sealed: what the Transformers and Accelerate
integrations share.

A Trainer's ``checkpoint-N`` and an ``accelerator.save_state`` folder hold the tools'
own files, written where the tools write them (no staging folder, no rename). Once
every process has finished writing, the main process seals the folder
(``safeckpt.seal``: each file checksummed, the manifest written last), so the folder is
a checkpoint exactly when its seal is valid. Only sealed folders count: resuming takes
the newest one whose every byte matches its seal, and deleting one removes its manifest
first, so a crash mid-delete never leaves a folder that still looks sealed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Iterable

import torch

from ..errors import (CheckpointError, CorruptCheckpointError, SafeckptWarning, SkippedCheckpointWarning,
                      UnsupportedFormatError, warn)
from ..format import manifestcache
from ..format.folder import CheckpointState, folder_state, manifest_seqs, retire
from ..format.manifest import Manifest
from ..protocol.checkpoint import verify
from ..protocol.reader import TensorReader
from ..storage import Storage
from ..storage import open as open_storage

NOT_SEALED = ("not sealed: it has no safeckpt manifest (a save that never finished, or a folder "
              "written without safeckpt)")


def barrier() -> None:
    """Wait until every process got here (each writes files of its own: RNG states, shards)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def sealed_or_why(path: str, covers: Collection[str] = ()) -> Manifest | str:
    """The seal of ``path``, or why it has none. Sealed means a valid manifest (every
    file it names present with its size) that also names every file in ``covers``."""
    found = folder_state(open_storage(path))
    if found.state is CheckpointState.NEWER_FORMAT:
        raise UnsupportedFormatError(found.problem)  # never passed over for an older checkpoint
    if found.manifest is None:
        if found.state in (CheckpointState.CORRUPT, CheckpointState.UNREADABLE):
            return f"{'damaged' if found.state is CheckpointState.CORRUPT else 'unreadable'}: {found.problem}"
        return NOT_SEALED
    missing = sorted(set(covers) - set(found.manifest.files))
    if missing:
        return f"not sealed: its manifest does not cover {', '.join(missing)} (a save interrupted before its seal)"
    return found.manifest


def seal_problem(path: str, covers: Collection[str] = (), *, full: bool = True) -> str | None:
    """None when ``path`` is sealed (see ``sealed_or_why``) and, with ``full``, every byte
    matches its checksums; else why it is not a checkpoint to resume from."""
    try:
        found = sealed_or_why(path, covers)
        if isinstance(found, str):
            return found
        if full:
            report = verify(path)
            if not report.ok:
                return "corrupt: " + "; ".join(report.problems)
    except (CheckpointError, OSError) as exc:
        if isinstance(exc, UnsupportedFormatError):
            raise
        return f"unreadable: {exc}"
    return None


def newest_intact(paths: Iterable[str], covers: Collection[str] = (), *, who: str) -> str | None:
    """The first of ``paths`` (give them newest first) that is sealed and intact; each
    one passed over is named in a ``SkippedCheckpointWarning``."""
    for path in paths:
        why = seal_problem(path, covers)
        if why is None:
            return path
        warn(f"{who}: skipping {path}: {why}", SkippedCheckpointWarning)
    return None


def check_named(path: str, covers: Collection[str] = ()) -> None:
    """Before resuming from a folder the user named: it must carry a seal, and every
    file the seal names that is still there must match its checksum. Files removed or
    added since the seal (a checkpoint re-sharded by hand) are reported with a warning
    and left to the tool's own loader, unless the seal also holds safeckpt's own data
    (read only through a seal that matches); anything else raises
    ``CorruptCheckpointError``."""
    if seal_problem(path, covers) is None:
        return
    storage = open_storage(path)
    listing = storage.listdir()
    seal = seal_of(path)
    if seal is None or not set(covers) <= set(seal.files):
        raise CorruptCheckpointError(
            f"cannot resume from {path}: {sealed_or_why(path, covers)}. If it is a complete checkpoint written "
            f"without safeckpt, seal it first: safeckpt.seal({path!r})")
    reader = TensorReader(storage, seal, verify=True)
    gone, bad = [], []
    for name, f in seal.files.items():
        size = listing.get(name) if "/" not in name else _size(storage, name)
        if size is None:
            gone.append(name)
        elif size != f.size:
            bad.append(f"{name} has {size} bytes, its seal says {f.size}")
        else:
            bad += reader.verify_file(name)
    if seal.tensors and gone:  # safeckpt's own data is read through the seal: it must hold
        bad.append(f"{', '.join(gone)} removed since it was sealed, and its safeckpt data loads only "
                   "through a seal that matches the folder")
    if bad or not gone:
        raise CorruptCheckpointError(f"cannot resume from {path}: " + "; ".join(bad or [str(seal_problem(path, covers))]))
    warn(f"resuming from {path}, which changed after it was sealed: {', '.join(gone)} removed; "
         "what the folder holds now is loaded without a checksum", SafeckptWarning)


def seal_of(path: str) -> Manifest | None:
    """The newest manifest of ``path`` that decodes, whether or not the files it names
    are still there (what the folder was sealed as); None when there is none."""
    storage = open_storage(path)
    for _, name in manifest_seqs(storage.listdir()):
        try:
            return manifestcache.decode(storage.read(name), f"{storage.url}/{name}")
        except (CorruptCheckpointError, OSError):
            continue
    return None


def _size(storage: Storage, name: str) -> int | None:
    try:
        return storage.size(name)
    except FileNotFoundError:
        return None


def unseal(path: str) -> None:
    """Remove the seal of a folder (every manifest, durably); its files stay."""
    retire(open_storage(path), keep=None)


def remove_folder(path: str) -> None:
    """Delete a folder: its manifests first (durably), then everything else."""
    if not os.path.isdir(path):
        return
    unseal(path)
    shutil.rmtree(path)
