"""One checkpoint: ``save``, ``load``, ``load_state`` and ``verify``.

A checkpoint is committed exactly when its folder holds a valid manifest; the valid
one with the highest sequence wins. ``commit.SaveRun`` writes one (data first,
manifest last); deletion goes the other way (``retire``: manifests first, data after).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeVar, Union

import torch

from ..errors import PartialLoadWarning, warn
from ..format import codec
from .. import errors as errors_module
from .commit import SaveRun, read_existing
from ..errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from .group import resolve
from ..format.manifest import (Manifest, decode_manifest, encode_values, manifest_name)
from ..format.plan import overlap
from .exchange import share_mode, share_reads
from .reader import ReadWork, TensorReader, chunks_needed, read_box
from .state import FlatState, LoadPlanner, flatten
from ..format.folder import LOOKS, read_committed
from ..storage import Storage
from ..storage import open as open_storage

PathLike = Union[str, "os.PathLike[str]", Storage]  # a path, file:// or other storage URL, or a Storage
log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class CheckpointInfo:
    """What a committed save produced."""

    path: str
    save_id: str
    seq: int
    step: int | None
    bytes: int  #: bytes this save wrote (the files in its own folder)
    files: list[str]
    seconds: float
    world_size: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    shared_bytes: int = 0  #: incremental saves: size of the earlier checkpoints' files it reads

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


def log_save(info: "CheckpointInfo", blocked_seconds: float | None = None) -> None:
    """Every committed save, whoever made it (save, async_save, the manager), on logger
    ``safeckpt`` at INFO: step, bytes, seconds, GB/s, and for an async save the time
    the caller was blocked."""
    blocked = "" if blocked_seconds is None else f", caller blocked {blocked_seconds:.3f}s"
    log.info("saved %s%d bytes in %.3fs (%.2f GB/s)%s to %s", "" if info.step is None else f"step {info.step}: ",
             info.bytes, info.seconds, info.gbps, blocked, info.path)


def new_save_id() -> str:
    """Sortable by time, unique across ranks and attempts: ``<unix seconds hex><random>``."""
    return f"{int(time.time()):08x}{secrets.token_hex(6)}"


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


def plain_values(values: dict | None, what: str) -> dict:
    """Metadata and metrics as plain values: one-element tensors and NumPy scalars become
    Python numbers; a non-dict is refused before anything is written."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise TypeError(f"{what} must be a dict, not {type(values).__name__}")
    out = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        elif hasattr(v, "item") and type(v).__module__ == "numpy":
            v = v.item()
        out[k] = plain_values(v, what) if isinstance(v, dict) else v
    return out


@dataclass
class SaveRequest:
    """Everything about one save except the state: where, by which ranks, and how."""

    storage: Storage
    group: Any
    overwrite: "bool | Callable[[Manifest | None], bool]" = False  # see SaveRun
    step: int | None = None
    metadata: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    allow_pickle: bool = False
    before_commit: Callable[[], None] | None = None  # rank 0, just before the manifest
    run_id: str | None = None
    durable_root: str | None = None  # a save on a local tier: the durable root it belongs to
    chunk_size: int | None = None  # incremental: share chunks with ``base``'s checkpoint
    base: Callable[[], "tuple[str, Manifest] | None"] | None = None  # rank 0: (sibling folder, manifest)
    runner: Callable[..., SaveRun] = SaveRun  # the protocol; the node tier commits on many disks
    save_id: str | None = None  # drawn before the save (by a process that hands the save to another one)

    def flattener(self, state: dict) -> Callable[[], FlatState]:
        """How this rank turns ``state`` into pieces; a bad state is refused before
        anything is written (in a group, the refusal is reported to every rank)."""
        if self.group.size == 1:
            flat = flatten(state, self.allow_pickle)
            return lambda: flat
        return lambda: flatten(state, self.allow_pickle, self.group.rank)

    def start(self, runner: "Callable[..., SaveRun] | None" = None) -> SaveRun:
        """The protocol's run for this save, not yet started (``runner``: its class)."""
        return (runner or self.runner)(self.group, self.storage, overwrite=self.overwrite, step=self.step,
                                       metadata=self.metadata, metrics=self.metrics,
                                       new_save_id=new_save_id if self.save_id is None else lambda: self.save_id,
                                       existing=read_existing, before_commit=self.before_commit,
                                       run_id=self.run_id, durable_root=self.durable_root,
                                       chunk_size=self.chunk_size, base=self.base)

    @property
    def stageable(self) -> bool:
        """Whether every per-tensor step can run before the data is written: a full save
        by one process with the plain protocol (``staged.StagedRun``)."""
        return self.group.size == 1 and self.chunk_size is None and self.runner is SaveRun

    def run(self, flattener: Callable[[], FlatState], started: float) -> CheckpointInfo:
        """Run the commit protocol; returns once the checkpoint is committed."""
        return self.info(self.start().run(flattener), started)

    def info(self, manifest: Manifest, started: float) -> CheckpointInfo:
        """What the committed save of ``manifest`` (begun at ``started``) produced."""
        return CheckpointInfo(path=self.storage.url, save_id=manifest.save_id, seq=manifest.seq,
                              step=self.step, bytes=manifest.total_bytes, files=list(manifest.files),
                              seconds=time.perf_counter() - started, world_size=manifest.world_size,
                              metadata=manifest.metadata, shared_bytes=manifest.shared_files_bytes)


def save_request(path: PathLike, *, overwrite: bool = False, metadata: dict | None = None,
                 process_group: Any = None, storage_options: dict | None = None,
                 allow_pickle: bool = False, step: int | None = None, metrics: dict | None = None,
                 before_commit: Callable[[], None] | None = None) -> SaveRequest:
    """Validate the arguments of a save (metadata and metrics are refused here, before
    anything is written) and resolve its storage and group."""
    metadata, metrics = plain_values(metadata, "metadata"), plain_values(metrics, "metrics")
    encode_values(metadata, "metadata"), encode_values(metrics, "metrics")
    return SaveRequest(open_storage(path, **(storage_options or {})), resolve(process_group),
                       overwrite, step, metadata, metrics, allow_pickle, before_commit)


@gc_paused
def save(state: dict, path: PathLike, *, overwrite: bool = False, metadata: dict | None = None,
         process_group: Any = None, storage_options: dict | None = None,
         allow_pickle: bool = False, step: int | None = None,
         metrics: dict | None = None) -> CheckpointInfo:
    """Save ``state`` as a committed checkpoint at ``path`` (see the README).

    Inside a torch.distributed job every rank calls it; each writes only its part and
    rank 0 commits. Raises ``CheckpointExistsError`` if a checkpoint is committed there
    and ``overwrite`` is false; with ``overwrite`` the old one stays loadable until the
    new manifest is written. On any error nothing is committed, the files this save
    wrote are removed, and every rank raises."""
    started = time.perf_counter()
    request = save_request(path, overwrite=overwrite, metadata=metadata, process_group=process_group,
                           storage_options=storage_options, allow_pickle=allow_pickle, step=step,
                           metrics=metrics)
    info = request.run(request.flattener(state), started)
    log_save(info)
    return info


def committed_for_group(storage: Storage, group: Any) -> Manifest:
    """Rank 0 picks the manifest and sends its bytes, so every rank loads the same one
    even where listings disagree (NFS attribute caches)."""
    if group.size == 1:
        return read_committed(storage)
    choice: Any = None
    if group.rank == 0:
        try:
            m = read_committed(storage)
            name = manifest_name(m.seq)
            choice = (name, storage.read(name))
        except CheckpointError as exc:
            choice = exc
    choice = group.broadcast(choice)
    if isinstance(choice, BaseException):
        raise choice
    name, data = choice
    return decode_manifest(data, f"{storage.url}/{name}")


def _agree(group: Any, error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed; all raise together or none does."""
    if group.size == 1:
        if error is not None:
            raise error
        return
    failures = group.all_gather(None if error is None else (type(error).__name__, str(error)))
    failed = {r: f for r, f in enumerate(failures) if f is not None}
    if not failed:
        return
    if error is not None:
        raise error
    kind = getattr(errors_module, next(iter(failed.values()))[0], CheckpointError)
    if not (isinstance(kind, type) and issubclass(kind, CheckpointError)):
        kind = CheckpointError
    lines = "\n  ".join(f"rank {r}: {name}: {msg}" for r, (name, msg) in sorted(failed.items()))
    raise kind(f"{what} failed on rank(s) {sorted(failed)}:\n  {lines}")


def _only(tree: Any, keys: "str | Iterable", url: str) -> Any:
    """The saved tree restricted to some top-level keys; a single ``str`` is one key
    (``keys="model"``), not its characters."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    saved = dict(codec.items_of(tree, "", False)) if codec.tag_of(tree) in ("object", "$dict") else {}
    missing = [k for k in keys if k not in saved]
    if missing:
        raise StateMismatchError(f"the checkpoint at {url} holds no {missing}", keys=missing, missing=missing,
                                 problems=[f"{k}: missing from the checkpoint" for k in missing])
    return {"$dict": [[codec.encode_leaf_or_tuple(k, "", False), saved[k]] for k in keys]}


@gc_paused
def load(state: dict, path: PathLike, *, strict: bool = True, verify: bool = True,
         process_group: Any = None, storage_options: dict | None = None,
         allow_pickle: bool = False, keys: "str | Iterable | None" = None,
         share_reads: "str | bool | None" = None) -> None:
    """Load a checkpoint into ``state`` in place (see the README).

    Each rank reads only the bytes of its own part. Every mismatch is found before
    anything is read, so ``StateMismatchError`` leaves ``state`` untouched; with
    ``strict=False`` what matches is loaded and the rest is reported in a warning.
    ``keys`` loads only those top-level keys (``state`` holds just them; one ``str`` is
    one key), leaving the checkpoint's others unread. In a distributed job, a failure on any rank raises on
    every rank, and bytes several ranks need are read once and sent between them
    (``share_reads``: ``"auto"``, ``"job"``, ``"node"`` or ``"off"``, the same on
    every rank; default ``$SAFECKPT_SHARE_READS``, else ``"auto"``; see ``exchange``)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, not {type(state).__name__}")
    started = time.perf_counter()
    share = share_mode(share_reads)
    group = resolve(process_group)
    storage = open_storage(path, **(storage_options or {}))
    manifest, look = committed_for_group(storage, group), 1
    while True:
        try:
            load_manifest(state, storage, manifest, group, strict=strict, verify=verify,
                          allow_pickle=allow_pickle, keys=keys, started=started, share=share)
            return
        except CheckpointError:  # every rank raises one together (or none does)
            newer = replaced(storage, group, manifest) if look < LOOKS else None
            if newer is None:
                raise
            manifest, look = newer, look + 1


def replaced(storage: Storage, group: Any, m: Manifest) -> Manifest | None:
    """The folder's winning manifest, if it is no longer ``m``: another process replaced
    the checkpoint while it was read (``save(overwrite=True)`` retires the old version's
    files after committing), so a reader looks again instead of reporting files it saw
    deleted. None when ``m`` still wins; raises ``CheckpointNotFoundError`` when the
    checkpoint was deleted meanwhile. Every rank of ``group`` calls it and gets one answer."""
    now = committed_for_group(storage, group)
    return None if (now.seq, now.save_id) == (m.seq, m.save_id) else now


def load_manifest(state: dict, storage: Storage, manifest: Manifest, group: Any, *, strict: bool = True,
                  verify: bool = True, allow_pickle: bool = False, keys: "str | Iterable | None" = None,
                  before_read: "Callable[[set[str]], None] | None" = None, started: float | None = None,
                  share: str | None = None) -> None:
    """``load`` of a manifest every rank already holds; ``before_read`` (a collective
    when given: every rank calls it) gets the files this rank will read, before any
    tensor is read (the node tier brings missing ones from a peer there; its ranks read
    their own node's disk, so they share reads only when ``share`` says so).
    ``started``: when the load began, for its log line."""
    started = time.perf_counter() if started is None else started
    share = share_mode(share) if share is not None or before_read is None else "off"
    planner = LoadPlanner(manifest.tensors, strict, allow_pickle, group.rank, group.size)
    error: BaseException | None = None
    try:
        tree = manifest.tree if keys is None else _only(manifest.tree, keys, storage.url)
        build = planner.plan(state, tree)
        planner.refuse_shared_memory(manifest.tie_of)
        if planner.problems and strict:
            listing = "\n  ".join(planner.problems)
            raise planner.error(
                f"the state does not match the checkpoint at {storage.url} ({len(planner.problems)} "
                f"problem(s)):\n  {listing}\nfix the state, or pass strict=False to load what matches")
        planner.load_early()
    except CheckpointError as exc:
        error = exc
    _agree_or_undo(group, error, f"loading {storage.url}", planner)
    if planner.problems:
        warn(f"loaded {storage.url} with strict=False; not loaded:\n  " + "\n  ".join(planner.problems),
             PartialLoadWarning)
    if before_read is not None:
        before_read(files_read(planner.reads))
    reader = TensorReader(storage, manifest, verify)
    work: ReadWork | None = None
    try:
        work = reader.plan(planner.reads)
    except CheckpointError as exc:
        error = exc
    try:
        shared = share_reads(reader, work, group, share)  # every rank takes part, even one that failed
        if work is not None:
            if shared is None:
                reader.fetch(work)
            if shared is not False:  # False: another rank's read failed; the agreement raises it
                reader.finish(work)
                build()
    except CheckpointError as exc:
        error = error or exc
    _agree_or_undo(group, error, f"loading {storage.url}", planner)
    _log_load(storage, planner, started)


def files_read(reads: list) -> set[str]:
    """The data files these reads touch: those with a chunk that meets a read's box."""
    out: set[str] = set()
    for r, chunks in zip(reads, chunks_needed(reads)):
        box = read_box(r)
        out |= {c.file for c in chunks if overlap(box, (tuple(c.offsets), tuple(c.shape))) is not None}
    return out


def _agree_or_undo(group: Any, error: BaseException | None, what: str, planner: LoadPlanner) -> None:
    """``_agree``; when any rank failed, the objects already loaded get their state back."""
    try:
        _agree(group, error, what)
    except BaseException:
        planner.undo()
        raise


@gc_paused
def load_state(path: PathLike, *, verify: bool = True, storage_options: dict | None = None,
               allow_pickle: bool = False, keys: "str | Iterable | None" = None) -> dict:
    """The saved state as a new nested dict of full CPU tensors and values (rank-local
    values come back as a list indexed by rank); ``keys``: only those top-level keys (one
    ``str`` is one key)."""
    started = time.perf_counter()
    storage = open_storage(path, **(storage_options or {}))
    group = resolve(None)
    manifest, look = read_committed(storage), 1
    while True:
        try:
            return _new_state(storage, manifest, verify, allow_pickle, keys, started)
        except CorruptCheckpointError:  # a data file missing: deleted by an overwrite meanwhile?
            newer = replaced(storage, group, manifest) if look < LOOKS else None
            if newer is None:
                raise
            manifest, look = newer, look + 1


def _new_state(storage: Storage, manifest: Manifest, verify: bool, allow_pickle: bool, keys: "str | Iterable | None",
               started: float) -> dict:
    """``load_state`` of one manifest."""
    planner = LoadPlanner(manifest.tensors, True, allow_pickle)
    tree = manifest.tree if keys is None else _only(manifest.tree, keys, storage.url)
    build = planner.plan(None, tree)
    if planner.problems:
        raise CorruptCheckpointError(f"{storage.url}: " + "; ".join(planner.problems))
    TensorReader(storage, manifest, verify).run(planner.reads)
    _log_load(storage, planner, started)
    return build()


def _log_load(storage: Storage, planner: LoadPlanner, started: float) -> None:
    seconds = time.perf_counter() - started
    nbytes = sum(t.nbytes for r in planner.reads if (t := r.dest if r.dest is not None else r.result) is not None)
    log.info("loaded %s: %d tensor(s), %d bytes in %.3fs (%.2f GB/s)", storage.url, len(planner.reads), nbytes,
             seconds, nbytes / seconds / 1e9 if seconds > 0 else 0.0)


@gc_paused
def verify(path: PathLike, *, storage_options: dict | None = None) -> VerifyReport:
    """Read every byte of a checkpoint and check every checksum; problems are collected,
    not raised. Raises ``CheckpointNotFoundError`` if there is nothing at ``path``."""
    storage = open_storage(path, **(storage_options or {}))
    group = resolve(None)
    try:
        manifest, look = read_committed(storage), 1
        while True:
            report = _verified(storage, manifest)
            newer = replaced(storage, group, manifest) if not report.ok and look < LOOKS else None
            if newer is None:
                return report
            manifest, look = newer, look + 1  # replaced while it was read: verify what wins now
    except CorruptCheckpointError as exc:
        return VerifyReport(storage.url, [str(exc)])


def _verified(storage: Storage, manifest: Manifest) -> VerifyReport:
    """``verify`` of one manifest."""
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
