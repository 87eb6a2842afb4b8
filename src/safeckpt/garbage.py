"""Garbage collection: files safeckpt wrote that no committed checkpoint needs.

Only names safeckpt writes (``data-<save_id>-rNNNNN.safetensors`` and
``manifest-NNNNNN.json`` inside ``step-NNNNNNNNN`` folders) are ever considered;
anything else in the root is left alone. A save that may still be running is
protected by its save id: with ``min_age_s``, no save younger than that is touched,
by the time its id records (never by file mtimes, which FUSE mounts get wrong).
"""

from __future__ import annotations

import re
import time
from .checkpoint import read_committed
from .commit import DATA_RE
from .errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from .manifest import manifest_seq
from .storage import Storage

STEP_RE = re.compile(r"step-([0-9]{9,})", re.ASCII)


def save_id_age(save_id: str, now: float) -> float:
    """Seconds since the save with this id started (its id begins with unix seconds)."""
    try:
        return now - int(save_id[:8], 16)
    except ValueError:
        return float("inf")


def garbage_in(folder: Storage, min_age_s: float | None = None,
               now: float | None = None) -> tuple[list[str], list[str]]:
    """(manifests, data files) in one checkpoint folder that nothing committed needs."""
    now = time.time() if now is None else now
    listing = folder.listdir()
    try:
        committed = read_committed(folder, listing)
    except UnsupportedFormatError:
        return [], []  # written by a newer safeckpt: nothing here is ours to judge
    except (CheckpointNotFoundError, CorruptCheckpointError):
        committed = None
    needed = set(committed.files) if committed else set()
    data, live = [], False
    for name in listing:
        m = DATA_RE.fullmatch(name)
        if m is None or name in needed:
            continue
        if min_age_s is not None and save_id_age(m.group(1), now) < min_age_s:
            live = True  # a save may still be running here: leave its manifest slot alone too
            continue
        data.append(name)
    manifests = [] if live else [n for n in listing if (s := manifest_seq(n)) is not None
                                 and (committed is None or s != committed.seq)]
    if committed is None and not manifests and not data:
        return [], []
    return manifests, sorted(data)


def collect(root: Storage, *, min_age_s: float | None = None, dry_run: bool = False,
            incomplete: bool = True) -> list[str]:
    """Remove garbage under ``root`` (manifests first, then data, then empty folders);
    return what was (or, with ``dry_run``, would be) removed, as ``folder/name``.

    With ``incomplete=False`` only folders that hold a committed checkpoint are cleaned
    (what a manager does by itself after each save): a folder with no manifest at all
    could also be a checkpoint copied in without its manifest, so only an explicit
    collection removes it. Incomplete multipart uploads older than ``min_age_s``
    (default an hour) are aborted on object stores."""
    removed: list[str] = []
    now = time.time()
    for name, size in sorted(root.listdir().items()):
        if size is not None or not STEP_RE.fullmatch(name):
            continue
        folder = root.child(name)
        if not incomplete and not any(manifest_seq(n) is not None for n in folder.listdir()):
            continue
        manifests, data = garbage_in(folder, min_age_s, now)
        removed += [f"{name}/{n}" for n in manifests + data]
        if not dry_run and (manifests or data):
            folder.delete(manifests)
            folder.delete(data)
            folder.remove_folder()
    abort_uploads = getattr(root, "abort_stale_uploads", None)
    if abort_uploads is not None and not dry_run:
        abort_uploads(older_than=3600.0 if min_age_s is None else min_age_s)
    return removed
