"""Sealing: turn a folder that another tool wrote into a committed safeckpt checkpoint.

A Hugging Face Trainer writes ``checkpoint-N`` straight into its final folder with no
commit marker, so a kill mid-save leaves a folder that looks like a checkpoint. ``seal``
lists every file under the folder (recursively), checksums each whole file, and
commits a manifest naming them, written last with an exclusive create. From then on
the folder obeys the one invariant: it is a checkpoint exactly when it holds a valid
manifest, ``verify`` reads every byte against the checksums, and deletion removes the
manifest first.

Sealing a folder that already holds a committed manifest writes one with a higher
sequence number: files safeckpt wrote itself (its data files) keep their records and
tensors, every other file is checksummed again, and the older manifests are retired
afterwards. So a save through ``safeckpt.save`` followed by ``seal`` gives one
checkpoint that covers both the tensors and the other tool's files.
"""

from __future__ import annotations

import os
import time


from ..protocol.checkpoint import CheckpointInfo, new_save_id, plain_values
from ..format.folder import retire
from ..format.checksum import BLOCK_SIZE, file_checksum
from ..protocol.commit import DATA_RE, read_existing, write_manifest
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidFileNameError
from ..format.manifest import FileEntry, Manifest, encode_values, is_shared, manifest_seq
from ..format.names import NAME_RULE, is_replace_temp, name_problem
from ..storage import Storage
from ..storage import open as open_storage

__all__ = ["seal"]



def _list_files(storage: Storage, prefix: str = "") -> dict[str, int]:
    """Every file under ``storage`` as ``relative/name -> size``, sub-folders included."""
    out: dict[str, int] = {}
    for name, size in sorted(storage.listdir().items()):
        rel = f"{prefix}{name}"
        if size is None:
            out.update(_list_files(storage.child(name), rel + "/"))
        else:
            out[rel] = size
    return out


def _checksum_of(storage: Storage, name: str, size: int) -> str:
    try:
        return file_checksum(storage, name, size)
    except EOFError as exc:
        raise CorruptCheckpointError(
            f"{storage.url}/{name} shrank while it was being sealed ({exc}); is another "
            "process still writing into this folder?") from exc


def _foreign(name: str) -> bool:
    """Files the seal checksums: everything except safeckpt's own manifests and data
    files, and the temporary files of its replacements (garbage of one interrupted)."""
    top = "/" not in name
    return not ((top and (manifest_seq(name) is not None or DATA_RE.fullmatch(name)))
                or is_replace_temp(name.rpartition("/")[2]))


def seal(path: str | os.PathLike[str] | Storage, *, storage_options: dict | None = None,
         metadata: dict | None = None, step: int | None = None,
         written: dict[str, tuple[int, str]] | None = None, world_size: int = 1,
         metrics: dict | None = None, run_id: str | None = None) -> CheckpointInfo:
    """Commit every file under ``path`` as one checkpoint: checksum each whole file and
    write a manifest naming them, last, with an exclusive create.

    Where ``path`` already holds a committed checkpoint, the new manifest gets the next
    sequence number and keeps that checkpoint's data files, tensors, values, metrics,
    step and metadata (``metadata`` is merged into it, ``step`` replaces it when given);
    older manifests are removed afterwards. Raises ``CheckpointNotFoundError`` for an empty or missing
    folder, ``InvalidFileNameError`` (a ``ValueError``) naming each file whose name a manifest
    cannot hold (docs/format.md §2.5) before anything is written, and ``CheckpointExistsError``
    when another process commits the same sequence first.

    ``written`` maps names to the ``(size, checksum)`` their writers computed while
    writing them (safeckpt's DeepSpeed engine): a file still of that size is not read
    again; ``world_size`` is how many processes wrote the files (recorded only).
    ``metrics`` are merged into the checkpoint's, and ``run_id`` names the run the
    checkpoint belongs to (a ``CheckpointManager``'s, whose retention then counts it)."""
    started = time.perf_counter()
    meta, scores = plain_values(metadata, "metadata"), plain_values(metrics, "metrics")
    encode_values(meta, "metadata")
    encode_values(scores, "metrics")
    if step is not None and type(step) is not int:
        raise TypeError(f"step must be an int or None, not {type(step).__name__}")
    storage = open_storage(path, **(storage_options or {}))
    existing, max_seq = read_existing(storage)
    listing = _list_files(storage)
    if not listing:
        raise CheckpointNotFoundError(f"nothing to seal at {storage.url}: the folder is empty or missing")
    names = sorted(n for n in listing if _foreign(n))
    bad = {name: why for name in names if (why := name_problem(name)) is not None}
    if bad:
        raise InvalidFileNameError(
            f"cannot seal {storage.url}: a manifest cannot name "
            + "; ".join(f"{name!r} ({why})" for name, why in bad.items())
            + f". A file name in a manifest must be {NAME_RULE}; rename or remove these files and seal again. "
            "Nothing was written.", bad)

    files: dict[str, FileEntry] = {}
    if existing is not None:  # safeckpt's own data files keep their records (and tensors)
        for f in existing.files.values():
            if is_shared(f.name):  # an incremental checkpoint's data in a sibling folder
                files[f.name] = f
            elif f.header_size is not None:
                if listing.get(f.name) != f.size:
                    raise CorruptCheckpointError(
                        f"cannot seal {storage.url}: its committed manifest names {f.name} with "
                        f"{f.size} bytes, the folder has {listing.get(f.name)}")
                files[f.name] = f
    storage.sync(names)
    written = written or {}
    for name in names:
        size = listing[name]
        known = written.get(name)
        files[name] = FileEntry(name, size, checksum=known[1] if known and known[0] == size
                                else _checksum_of(storage, name, size))
    after = {n: s for n, s in _list_files(storage).items() if n in files}
    changed = sorted(n for n in files if not is_shared(n) and after.get(n) != files[n].size)
    if changed:
        raise CorruptCheckpointError(
            f"cannot seal {storage.url}: {changed} changed while being sealed; is another process "
            "still writing into this folder?")

    manifest = Manifest(
        save_id=new_save_id(), seq=max_seq + 1, created=time.time(), world_size=world_size, files=files,
        tensors=existing.tensors if existing is not None else {},
        tree=existing.tree if existing is not None else None,
        step=step if step is not None else (existing.step if existing is not None else None),
        metadata={**(existing.metadata if existing is not None else {}), **meta},
        metrics={**(existing.metrics if existing is not None else {}), **scores},
        block_size=existing.block_size if existing is not None else BLOCK_SIZE,
        run_id=run_id if run_id is not None else (existing.run_id if existing is not None else None),
        version=existing.version if existing is not None else 1)
    write_manifest(storage, manifest, "seal")
    try:
        retire(storage, keep=manifest)
    except OSError:
        pass  # sealed; older manifests left behind are garbage, never a newer commit
    return CheckpointInfo(path=storage.url, save_id=manifest.save_id, seq=manifest.seq, step=manifest.step,
                          bytes=manifest.total_bytes, files=list(files), seconds=time.perf_counter() - started,
                          world_size=world_size, metadata=manifest.metadata)
