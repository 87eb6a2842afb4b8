"""Garbage collection: files safeckpt wrote that no committed checkpoint needs.

Only names safeckpt writes (``data-<save_id>-rNNNNN.safetensors`` and
``manifest-NNNNNN.json`` inside ``step-NNNNNNNNN`` folders) are ever considered;
anything else in the root is left alone. With ``min_age_s``, a save that may still be
running is left alone: one younger than ``min_age_s`` by the time its save id records
(never by file mtimes, which FUSE mounts get wrong), unless its writer was on this host
and its process is gone; ``protocol.leftovers`` has the rule.

Incremental checkpoints read data files of older sibling checkpoints, so collection is
by reachability: a data file stays while any committed checkpoint in the root names it.
A retired checkpoint whose files are still shared keeps them, with a ``RETIRED`` marker
that says the folder is no longer a checkpoint (and not one copied without its
manifest). Folders are read in ascending step order: a save commits its manifest
before the checkpoint it shares with is retired, and it has a higher step, so a
collection running meanwhile sees one or the other.
"""

from __future__ import annotations

import time

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, SkippedCheckpointWarning, UnsupportedFormatError, warn
from ..format import manifestcache
from ..format.folder import read_committed, shared_by_siblings, shared_files
from ..format.manifest import Manifest
from ..format.names import DATA_RE, RETIRED, manifest_seq, step_of
from ..protocol.leftovers import save_may_run
from ..storage import Storage



def garbage_in(folder: Storage, min_age_s: float | None = None, now: float | None = None,
               shared: "set[str] | frozenset[str] | None" = None,
               spare_damaged: bool = False) -> tuple[list[str], list[str]]:
    """(manifests, data files) in one checkpoint folder that nothing committed needs.

    ``shared`` are its files that committed checkpoints in other folders read (None:
    look at the sibling folders). The ``RETIRED`` marker counts as a manifest, and goes
    once no shared data is left. With ``spare_damaged``, a well-formed manifest whose
    files are missing is kept with the files it names (a stale listing of a network
    filesystem must never make a checkpoint look like garbage)."""
    now = time.time() if now is None else now
    listing = folder.listdir()
    try:
        committed = read_committed(folder, listing)
    except UnsupportedFormatError:
        return [], []  # written by a newer safeckpt: nothing here is ours to judge
    except (CheckpointNotFoundError, CorruptCheckpointError):
        committed = None
    needed = set(committed.files) if committed else set()
    damaged = _well_formed(folder, listing) if committed is None and spare_damaged else {}
    for kept in damaged.values():
        needed |= set(kept.files)
    if shared is None:
        candidates = [n for n in listing if DATA_RE.fullmatch(n) and n not in needed]
        shared = shared_by_siblings(folder) if candidates else set()
    needed |= set(shared)
    data, live = [], False
    for name in listing:
        m = DATA_RE.fullmatch(name)
        if m is None or name in needed:
            continue
        if save_may_run(folder, name, m.group(1), min_age_s, now):
            live = True  # a save may still be running here: leave its manifest slot alone too
            continue
        data.append(name)
    manifests = [] if live else [n for n in listing if (s := manifest_seq(n)) is not None
                                 and (committed is None or s != committed.seq) and n not in damaged]
    if RETIRED in listing and committed is None and not live and not needed.intersection(listing):
        manifests.append(RETIRED)
    if committed is None and not manifests and not data:
        return [], []
    return manifests, sorted(data)


def collect(root: Storage, *, min_age_s: float | None = None, dry_run: bool = False,
            incomplete: bool = True) -> list[str]:
    """Remove garbage under ``root`` (manifests first, then data, then empty folders);
    return what was (or, with ``dry_run``, would be) removed, as ``folder/name``.

    With ``incomplete=False`` only folders that hold a manifest (or are retired) are
    cleaned (what a manager does by itself after each save): a folder with no manifest
    at all could also be a checkpoint copied in without its manifest, and a well-formed
    manifest whose files seem missing may be a stale listing, so only an explicit
    collection removes those. Incomplete multipart uploads older than ``min_age_s``
    (default an hour) are aborted on object stores."""
    removed: list[str] = []
    now = time.time()
    folders = sorted(name for name, size in root.listdir().items() if size is None and step_of(name) is not None)
    committed: list[Manifest] = []
    for name in folders:
        try:
            committed.append(read_committed(root.child(name)))
        except UnsupportedFormatError:
            warn(f"{root.url}/{name} was written by a newer safeckpt and may share data with other "
                 "checkpoints: garbage collection skipped; upgrade safeckpt", SkippedCheckpointWarning)
            return removed
        except (CheckpointNotFoundError, CorruptCheckpointError):
            continue
    shared = shared_files(committed)
    for name in folders:
        folder = root.child(name)
        if not incomplete and not any(manifest_seq(n) is not None or n == RETIRED for n in folder.listdir()):
            continue
        manifests, data = garbage_in(folder, min_age_s, now, shared.get(name, set()), spare_damaged=not incomplete)
        removed += [f"{name}/{n}" for n in manifests + data]
        if not dry_run and (manifests or data):
            markers = [RETIRED] if RETIRED in manifests else []
            folder.delete([n for n in manifests if n != RETIRED])
            folder.delete(data)
            folder.delete(markers)  # last: while shared data is left, the folder stays marked
            folder.remove_folder()
    abort_uploads = getattr(root, "abort_stale_uploads", None)
    if abort_uploads is not None and not dry_run:
        abort_uploads(older_than=3600.0 if min_age_s is None else min_age_s)
    return removed



def _well_formed(folder: Storage, listing: dict[str, int | None]) -> dict[str, Manifest]:
    """Manifests of a folder that decode (whatever the state of the files they name)."""
    out = {}
    for name in listing:
        if manifest_seq(name) is not None:
            try:
                out[name] = manifestcache.decode(folder.read(name), f"{folder.url}/{name}")
            except (CorruptCheckpointError, OSError):
                continue
    return out
