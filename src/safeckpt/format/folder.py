"""A checkpoint folder on storage: which manifest wins, what state the folder is in
(committed, torn, corrupt, of a newer format, empty or retired), which of its files
sibling checkpoints read, and the order in which its old versions are deleted.

``CheckpointManager`` (listing, restore, retention), garbage collection, ``seal``, the
integrations and every ``safeckpt`` command judge a folder through this module, so they
always agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import (CheckpointNotFoundError, CorruptCheckpointError, SkippedCheckpointWarning, StorageError,
                      UnsupportedFormatError, warn)
from ..storage import Storage
from . import manifestcache
from .manifest import Manifest
from .states import CheckpointState
from .names import DATA_RE, RETIRED as RETIRED_MARKER, is_shared, manifest_seq, shared_location, step_folder, step_of


_RETIRED_WHY = "deleted by retention; holds data later checkpoints share"


@dataclass(frozen=True)
class FolderState:
    """A folder's state, with its manifest when committed and the problem otherwise."""

    state: CheckpointState
    manifest: Manifest | None = None
    problem: str = ""


def folder_state(folder: Storage, listing: dict[str, int | None] | None = None) -> FolderState:
    """Judge one checkpoint folder (never raises for what it finds in it). One that
    cannot be listed or whose manifest cannot be read is ``UNREADABLE``, with a warning:
    callers go on with the other folders of a run root (an old step that lost its
    permissions must not block the newer ones), and none takes it for absent."""
    try:
        if listing is None:
            listing = folder.listdir()
        return _judged(folder, listing)
    except StorageError as exc:
        warn(f"{folder.url} cannot be read and is passed over: {exc}", SkippedCheckpointWarning)
        return FolderState(CheckpointState.UNREADABLE, problem=str(exc))


def _judged(folder: Storage, listing: dict[str, int | None]) -> FolderState:
    try:
        return FolderState(CheckpointState.COMMITTED, read_committed(folder, listing))
    except UnsupportedFormatError as exc:
        return FolderState(CheckpointState.NEWER_FORMAT, problem=str(exc))
    except CheckpointNotFoundError as exc:
        if RETIRED_MARKER in listing:
            return FolderState(CheckpointState.RETIRED, problem=_RETIRED_WHY)
        return FolderState(CheckpointState.TORN if listing else CheckpointState.EMPTY, problem=str(exc))
    except CorruptCheckpointError as exc:
        return FolderState(CheckpointState.CORRUPT, problem=str(exc))


def step_folders(root: Storage) -> list[int]:
    """The steps of a run root's step folders (``names.step_of``), ascending."""
    return sorted(step for name, size in root.listdir().items()
                  if size is None and (step := step_of(name)) is not None)


def step_state(root: Storage, step: int) -> FolderState:
    """The state of a run root's folder of ``step`` (see ``as_step``)."""
    folder = root.child(step_folder(step))
    return as_step(folder_state(folder), folder.url, step)


def as_step(found: FolderState, url: str, step: int | None) -> FolderState:
    """``found``, the state of the folder ``url``, as the folder of ``step``: a checkpoint
    of another step (a folder copied or renamed by hand) is not a checkpoint of this one
    (corrupt, saying which step it holds). ``step`` None: any step."""
    if step is not None and found.manifest is not None and found.manifest.step not in (None, step):
        return FolderState(CheckpointState.CORRUPT, problem=(
            f"{url} holds the checkpoint of step {found.manifest.step}, not of step {step} (copied or "
            "renamed by hand?); it counts for nothing here"))
    return found


def committed_steps(root: Storage) -> dict[int, Manifest]:
    """Step -> manifest of every committed checkpoint of a run root (by ``step_state``)."""
    return {s: m for s in step_folders(root) if (m := step_state(root, s).manifest) is not None}


def manifest_seqs(listing: dict[str, int | None]) -> list[tuple[int, str]]:
    """(sequence, name) of every manifest file in a listing, highest first (a folder
    with a manifest's name is not one)."""
    return sorted(((s, n) for n, size in listing.items() if size is not None and (s := manifest_seq(n)) is not None),
                  reverse=True)


def _check_files(storage: Storage, m: Manifest, listing: dict[str, int | None], where: str) -> None:
    siblings: dict[str, dict[str, int | None]] = {}  # each sibling folder listed once
    for f in m.files.values():
        if is_shared(f.name):
            folder, file = shared_location(f.name)
            if folder not in siblings:
                siblings[folder] = storage.parent().child(folder).listdir()
            size = siblings[folder].get(file)
        else:
            size = listing.get(f.name) if "/" not in f.name else _size_or_none(storage, f.name)
        if size is None:
            raise CorruptCheckpointError(f"{where}: names {f.name}, which is missing")
        if size != f.size:
            raise CorruptCheckpointError(
                f"{where}: {f.name} has {size} bytes, the manifest says {f.size} (truncated or altered)")


def _size_or_none(storage: Storage, name: str) -> int | None:
    try:
        return storage.size(name)
    except FileNotFoundError:
        return None


def read_committed(storage: Storage, listing: dict[str, int | None] | None = None) -> Manifest:
    """The winning manifest of a checkpoint folder.

    Raises ``CheckpointNotFoundError`` when there is no manifest at all,
    ``UnsupportedFormatError`` when the newest is from a newer safeckpt (never falling
    back past it), and ``CorruptCheckpointError`` with every manifest's problem when
    none is valid."""
    if listing is None:
        listing = storage.listdir()
    seqs = manifest_seqs(listing)
    if not seqs:
        what = _nothing_listed(storage) if not listing else \
            "it has no manifest (a save that never committed, or not a safeckpt checkpoint)"
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url}: {what}")
    problems = []
    for seq, name in seqs:
        where = f"{storage.url}/{name}"
        try:
            m = manifestcache.decode(storage.read(name), where)
            if m.seq != seq:
                raise CorruptCheckpointError(f"{where}: records sequence {m.seq}, its name says {seq}")
            _check_files(storage, m, listing, where)
        except UnsupportedFormatError:
            raise
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            warn(f"{storage.url}: using {name}; skipped newer manifests: " + "; ".join(problems),
                 SkippedCheckpointWarning)
        return m
    raise CorruptCheckpointError(f"no valid manifest in {storage.url}: " + "; ".join(problems))


_ABSENT = object()


def _nothing_listed(storage: Storage) -> str:
    """Why a path lists nothing, in words: it names a file (``load_state("trainer.pt")``),
    an empty folder, or nothing at all, as its parent's listing says (on an object store
    an empty folder does not exist). Asked only to word an error, on any backend."""
    try:
        found = storage.parent().listdir().get(storage.url.rstrip("/").rpartition("/")[2], _ABSENT)
    except Exception:  # noqa: BLE001 - only to choose the words of an error
        return "the folder is empty or missing"
    if found is _ABSENT:
        return "there is no such folder"
    return "the folder is empty" if found is None else "it is a file, not a checkpoint folder"


def retire(storage: Storage, keep: Manifest | None, spare: "set[str] | frozenset[str]" = frozenset()) -> None:
    """Delete the manifests older than ``keep`` (first, durably), then the data files
    only they referenced. A manifest newer than ``keep`` is a concurrent writer's
    commit: it is never deleted, nor any file it names, and while one cannot be read (it
    may still be written) no data is deleted at all (garbage collection gets it later).
    With ``keep=None`` the checkpoint is deleted entirely, including data files of
    interrupted saves into the same folder. ``spare`` are files other checkpoints share.
    Files of sibling checkpoints are never touched here: whether another checkpoint
    still needs them is for ``garbage.collect`` to decide."""
    listing = storage.listdir()
    seqs = manifest_seqs(listing)
    older = [name for seq, name in seqs if keep is None or seq < keep.seq]
    doomed: set[str] = {n for n in listing if DATA_RE.fullmatch(n)} if keep is None else set()
    for name in older:
        try:
            doomed.update(manifestcache.decode(storage.read(name), name).files)
        except (CorruptCheckpointError, OSError):
            continue
    needed = set(keep.files) if keep is not None else set()
    unknown = False  # a newer commit in progress: what it names is unknown
    for name in (name for seq, name in seqs if keep is not None and seq > keep.seq):
        try:
            needed.update(manifestcache.decode(storage.read(name), name).files)
        except (CorruptCheckpointError, OSError):
            unknown = True
            break
    storage.delete(older)
    if not unknown:
        storage.delete(sorted(n for n in doomed - needed if not is_shared(n) and n not in spare))


def shared_files(manifests: "Mapping[Any, Manifest] | list[Manifest]") -> dict[str, set[str]]:
    """Sibling folder -> its files that these committed manifests read."""
    out: dict[str, set[str]] = {}
    for m in (manifests.values() if isinstance(manifests, dict) else manifests):
        for name in m.files:
            if is_shared(name):
                folder, file = shared_location(name)
                out.setdefault(folder, set()).add(file)
    return out


def shared_by_siblings(folder: Storage) -> set[str]:
    """Files of ``folder`` that committed checkpoints in its sibling step folders read."""
    try:
        parent = folder.parent()
    except StorageError:
        return set()  # no sibling could ever have referenced it: saving one needs the parent
    name = folder.url.rstrip("/").rsplit("/", 1)[-1]
    manifests = []
    for sibling, size in sorted(parent.listdir().items()):
        if size is None and sibling != name and step_of(sibling) is not None:
            try:
                manifests.append(read_committed(parent.child(sibling)))
            except (CheckpointNotFoundError, CorruptCheckpointError):
                continue
    return shared_files(manifests).get(name, set())
