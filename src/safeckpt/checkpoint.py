"""One checkpoint: ``save``, ``load``, ``load_state`` and ``verify``.

The save protocol (DESIGN.md): write and fsync data files named with a fresh save id,
then write the manifest last; only then delete what an older manifest of the same
folder referenced (manifest first, data after). A checkpoint is committed exactly when
its folder holds a valid manifest; the valid one with the highest sequence wins.
"""

from __future__ import annotations

import functools
import gc
import os
import secrets
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from .checksum import checksum
from .datafile import WrittenChunk, plan_layout, stream
from .errors import (CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                     StateMismatchError)
from .manifest import (MANIFEST_RE, Chunk, FileEntry, Manifest, TensorEntry, decode_manifest,
                       encode_manifest, manifest_name)
from .reader import TensorReader
from .state import LoadPlanner, flatten
from .storage import Storage
from .storage import open as open_storage
from .tensors import dtype_name

PathLike = "str | os.PathLike[str] | Storage"
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class CheckpointInfo:
    """What a committed save produced."""

    path: str
    save_id: str
    seq: int
    step: int | None
    bytes: int
    files: list[str]
    seconds: float
    world_size: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass
class VerifyReport:
    """The result of reading every byte of a checkpoint."""

    path: str
    problems: list[str]
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok


def new_save_id() -> str:
    """Sortable by time, unique across ranks and attempts: ``<unix seconds hex><random>``."""
    return f"{int(time.time()):08x}{secrets.token_hex(6)}"


def data_file_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-r{rank:05d}.safetensors"


def manifest_seqs(listing: dict[str, int | None]) -> list[tuple[int, str]]:
    """(sequence, name) of every manifest file in a listing, highest first."""
    found = [(int(m.group(1)), name) for name in listing if (m := MANIFEST_RE.match(name))]
    return sorted(found, reverse=True)


def _check_files(storage: Storage, m: Manifest, listing: dict[str, int | None], where: str) -> None:
    for f in m.files.values():
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
    """The winning manifest of a checkpoint folder (see module docstring).

    Raises ``CheckpointNotFoundError`` when there is no manifest at all and
    ``CorruptCheckpointError`` (with every manifest's problem) when none is valid."""
    if listing is None:
        listing = storage.listdir()
    seqs = manifest_seqs(listing)
    if not seqs:
        what = "the folder is empty or missing" if not listing else \
            "it has no manifest (a save that never committed, or not a safeckpt checkpoint)"
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url}: {what}")
    problems = []
    for seq, name in seqs:
        where = f"{storage.url}/{name}"
        try:
            m = decode_manifest(storage.read(name), where)
            if m.seq != seq:
                raise CorruptCheckpointError(f"{where}: records sequence {m.seq}, its name says {seq}")
            _check_files(storage, m, listing, where)
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            warnings.warn(f"{storage.url}: using {name}; skipped newer manifests: " + "; ".join(problems),
                          stacklevel=3)
        return m
    raise CorruptCheckpointError(f"no valid manifest in {storage.url}: " + "; ".join(problems))


def gc_paused(fn: F) -> F:
    """Run ``fn`` with the cyclic garbage collector paused: walking states of many small
    tensors creates objects fast enough that collections would double a save's cost."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return wrapper  # type: ignore[return-value]


@gc_paused
def save(state: dict, path: PathLike, *, overwrite: bool = False, metadata: dict | None = None,
         process_group: Any = None, storage_options: dict | None = None,
         allow_pickle: bool = False, step: int | None = None,
         metrics: dict | None = None) -> CheckpointInfo:
    """Save ``state`` as a committed checkpoint at ``path`` (see DESIGN.md).

    Raises ``CheckpointExistsError`` if one is already committed there and
    ``overwrite`` is false; with ``overwrite`` the old one stays loadable until the new
    manifest is written. On any error nothing is committed and the files this save
    wrote are removed."""
    started = time.perf_counter()
    flat = flatten(state, allow_pickle)  # refuse bad state before touching storage
    storage = open_storage(path, **(storage_options or {}))
    listing = storage.listdir()
    old: Manifest | None = None
    try:
        old = read_committed(storage, listing)
    except (CheckpointNotFoundError, CorruptCheckpointError):
        pass
    if old is not None and not overwrite:
        raise CheckpointExistsError(
            f"a committed checkpoint exists at {storage.url} (step {old.step}); pass overwrite=True "
            "to replace it atomically, or save to another path")
    seq = max((s for s, _ in manifest_seqs(listing)), default=0) + 1
    save_id = new_save_id()
    data_name = data_file_name(save_id, 0)
    try:
        manifest = _write_data(storage, flat, data_name, save_id)
        manifest.seq, manifest.step = seq, step
        manifest.metadata, manifest.metrics = dict(metadata or {}), dict(metrics or {})
        try:
            storage.write_file(manifest_name(seq), [encode_manifest(manifest)])
        except FileExistsError as exc:
            raise CheckpointExistsError(
                f"another save committed {manifest_name(seq)} in {storage.url} at the same time; "
                "two writers are using one checkpoint path") from exc
    except BaseException:
        _remove_quietly(storage, [data_name])
        raise
    if old is not None:
        retire(storage, keep=manifest)
    return CheckpointInfo(path=storage.url, save_id=save_id, seq=seq, step=step,
                          bytes=manifest.total_bytes, files=list(manifest.files),
                          seconds=time.perf_counter() - started, metadata=manifest.metadata)


def _write_data(storage: Storage, flat, data_name: str, save_id: str) -> Manifest:
    items = list(flat.tensors.items())
    layout = plan_layout(items, {"format": "pt", "safeckpt_save_id": save_id})
    written: list[WrittenChunk] = []
    size = storage.write_file(data_name, stream(layout, written))
    tensors: dict[str, TensorEntry] = {}
    dtypes = {name: t for name, t in items}
    for w in written:
        t = dtypes[w.name]
        shape = list(t.shape)
        tensors[w.name] = TensorEntry(dtype_name(t.dtype), shape,
                                      [Chunk(data_name, w.start, w.end, w.checksum, [0] * len(shape), shape)])
    for alias, first in flat.aliases.items():
        tensors[alias] = tensors[first]
    header = layout.header
    files = {data_name: FileEntry(data_name, size, rank=0, header_size=len(header),
                                  header_checksum=checksum(header))}
    return Manifest(save_id=save_id, seq=0, created=time.time(), world_size=1, files=files,
                    tensors=tensors, tree=flat.tree)


def _remove_quietly(storage: Storage, names: list[str]) -> None:
    try:
        storage.delete(names)
    except OSError:
        pass


def retire(storage: Storage, keep: Manifest | None) -> None:
    """Delete every manifest other than ``keep`` (first, durably), then the data files
    only they referenced. With ``keep=None`` the checkpoint is deleted entirely."""
    listing = storage.listdir()
    others = [name for seq, name in manifest_seqs(listing) if keep is None or seq != keep.seq]
    doomed: set[str] = set()
    for name in others:
        try:
            doomed.update(decode_manifest(storage.read(name), name).files)
        except (CorruptCheckpointError, OSError):
            continue
    if keep is not None:
        doomed -= set(keep.files)
    storage.delete(others)
    storage.delete(sorted(doomed))


@gc_paused
def load(state: dict, path: PathLike, *, strict: bool = True, verify: bool = True,
         process_group: Any = None, storage_options: dict | None = None,
         allow_pickle: bool = False) -> None:
    """Load a checkpoint into ``state`` in place (see DESIGN.md).

    Every mismatch is found before anything is read, so ``StateMismatchError`` leaves
    ``state`` untouched; with ``strict=False`` what matches is loaded and the rest is
    reported in a warning."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, not {type(state).__name__}")
    storage = open_storage(path, **(storage_options or {}))
    manifest = read_committed(storage)
    planner = LoadPlanner(manifest.tensors, strict, allow_pickle)
    build = planner.plan(state, manifest.tree)
    if planner.problems:
        listing = "\n  ".join(planner.problems)
        if strict:
            raise StateMismatchError(
                f"the state does not match the checkpoint at {storage.url} ({len(planner.problems)} "
                f"problem(s)):\n  {listing}\nfix the state, or pass strict=False to load what matches")
        warnings.warn(f"loaded {storage.url} with strict=False; not loaded:\n  {listing}", stacklevel=2)
    TensorReader(storage, manifest, verify).run(planner.reads)
    build()


@gc_paused
def load_state(path: PathLike, *, verify: bool = True, storage_options: dict | None = None,
               allow_pickle: bool = False) -> dict:
    """The saved state as a new nested dict of CPU tensors and values."""
    storage = open_storage(path, **(storage_options or {}))
    manifest = read_committed(storage)
    planner = LoadPlanner(manifest.tensors, True, allow_pickle)
    build = planner.plan(None, manifest.tree)
    if planner.problems:
        raise CorruptCheckpointError(f"{storage.url}: " + "; ".join(planner.problems))
    TensorReader(storage, manifest, verify).run(planner.reads)
    return build()


@gc_paused
def verify(path: PathLike, *, storage_options: dict | None = None) -> VerifyReport:
    """Read every byte of a checkpoint and check every checksum; problems are collected,
    not raised. Raises ``CheckpointNotFoundError`` if there is nothing at ``path``."""
    storage = open_storage(path, **(storage_options or {}))
    try:
        manifest = read_committed(storage)
    except CorruptCheckpointError as exc:
        return VerifyReport(storage.url, [str(exc)])
    report = VerifyReport(storage.url, [])
    reader = TensorReader(storage, manifest, verify=True)
    for name, f in manifest.files.items():
        try:
            problems = reader.verify_file(name)
        except CorruptCheckpointError as exc:
            problems = [str(exc)]
        report.problems += problems
        report.bytes_checked += 0 if problems else f.size
    return report
