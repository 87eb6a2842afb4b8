"""Crash-safe checkpoints for DeepSpeed (ZeRO 1, 2 and 3): a checkpoint engine.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    safeckpt.integrations.deepspeed.install(engine, keep_last=3)
    engine.load_checkpoint(ckpt_dir)                 # the newest committed tag, verified
    ...
    engine.save_checkpoint(ckpt_dir)                 # committed when it returns, on every rank

DeepSpeed's own ``save_checkpoint`` writes ``torch.save`` files straight into
``<dir>/<tag>/`` and then ``latest`` with a plain ``open()``: a kill leaves ``latest``
naming a half-written tag, and a re-save overwrites a tag in place. With the engine
installed the files keep DeepSpeed's names and format (``zero_to_fp32.py`` and
DeepSpeed itself read them as before), and safeckpt's protocol commits them:

- every rank writes each of its files once (exclusive create, fsynced) and checksums it
  while writing; a rank whose write fails reports it instead of raising at once, so the
  ranks stay in step with DeepSpeed's collectives;
- in ``commit`` (DeepSpeed calls it on every rank after all files are written) rank 0
  gathers every rank's report and, when all succeeded and it can see every file, seals
  the tag folder (``safeckpt.seal``: a manifest naming every file with size and
  checksum, written last). Any failure aborts the tag on every rank with
  ``SaveAbortedError`` naming each failing rank, and the attempt's files are removed;
- ``latest`` is replaced atomically (``Storage.open_replace``: temporary file, fsync,
  rename) only after the commit, so it never names an uncommitted tag;
- a tag that already has files (a committed tag saved again, or a torn attempt) is
  never touched before the new save commits: the save goes to a staging folder
  ``<tag>.safeckpt-<save id>``, is committed there, ``latest`` moves to it, and only
  then is the old tag deleted (manifest first) and the staging copy copied into
  ``<tag>`` (data first, manifest last), ``latest`` moved back and the staging folder
  removed. Whatever the moment of a crash, a committed version of the tag exists;
- retention (``keep_last``) runs on rank 0 after a commit and deletes only committed
  tags this engine wrote, manifest first, never the one just saved.

``load_checkpoint(dir)`` (``tag=None``) loads the newest committed tag (by step, then
commit time; ``latest`` is not trusted), verifying every checksum of it on rank 0 first
and falling back past torn and corrupt tags with a warning; each file DeepSpeed then
reads is checked against the manifest again on the rank that reads it. Files are
unpickled with ``torch.load(weights_only=True)``, which builds only tensors, containers
and primitive values, plus the four DeepSpeed classes its ZeRO files hold
(``SAFE_GLOBALS``); ``install(..., allow_pickle=True)`` allows any pickle (needed when
``client_state`` holds other objects).

DeepSpeed reads its checkpoints with ``glob``, ``os.path`` and ``open()``, so the
checkpoint folder must be a local path: a local disk or a network or FUSE filesystem
mounted on every rank (NFS, Lustre, GPFS, a Mountpoint-S3 or GCSFuse mount). Where the
filesystem cannot rename, ``latest`` is copied under its name after the commit (a
process killed during that copy may leave it torn on such a mount; loading through the
engine never reads it).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, cast

import torch

try:
    import deepspeed
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("safeckpt.integrations.deepspeed needs deepspeed: "
                      "pip install 'safeckpt[deepspeed]'") from exc

from ..errors import CleanupWarning, SkippedCheckpointWarning, warn
from ..protocol.checkpoint import committed_for_group, new_save_id, verify
from ..format.folder import read_committed, retire
from ..format.checksum import checksum, matches
from ..protocol.commit import abort_summary, describe_error, not_visible
from ..errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, SaveAbortedError,
                      StorageError, UnsafeObjectError)
from ..protocol.group import resolve
from ..format.manifest import Manifest
from ..run.retention import Retention
from ..interop.sealing import seal
from ..storage import LocalStorage, Storage
from ..storage import open as open_storage
from ..run.tiered import replicate

__all__ = ["SAFE_GLOBALS", "SafeCheckpointEngine", "committed_tags", "install", "install_on_prepare"]

log = logging.getLogger(__name__)

KIND = "deepspeed"  #: ``metadata["integration"]`` of a tag this engine committed
LATEST = "latest"
_STAGING_RE = re.compile(r"(?P<tag>.+)\.safeckpt-(?P<save_id>[0-9a-f]+)", re.ASCII)
_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
_DEEPSPEED_FILES = ("_model_states.pt", "_optim_states.pt")


def _safe_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


#: the classes besides tensors and plain values that DeepSpeed's ZeRO files pickle, and
#: the only ones ``weights_only`` loading may build (their state is set, no code runs)
SAFE_GLOBALS = _safe_globals()


# -- storage helpers -------------------------------------------------------------------

def _local(path: str, storage_options: dict) -> LocalStorage:
    storage = open_storage(path, **storage_options)
    if not isinstance(storage, LocalStorage):
        raise StorageError(
            f"{path}: DeepSpeed reads and writes its checkpoints through the local filesystem "
            "(os.makedirs, glob, open), so its checkpoint folder must be a local path: a local disk "
            "or a network or FUSE filesystem mounted on every rank, not a URL")
    return storage


def remove_tree(storage: Storage) -> None:
    """Delete a folder: its manifests first (durably, so a crash never leaves a folder
    that looks committed), then every other file and sub-folder."""
    retire(storage, keep=None)
    for name, size in storage.listdir().items():
        if size is None:
            remove_tree(storage.child(name))
    storage.delete([n for n, size in storage.listdir().items() if size is not None])
    storage.remove_folder()


def replace_file(root: LocalStorage, name: str, data: bytes) -> None:
    """Make ``root/name`` hold ``data``, atomically (``Storage.open_replace``: a durable
    temporary file renamed over it; where the filesystem cannot rename, a copy under the
    final name)."""
    root.replace_file(name, [data])


def _serialize(state: Any, zipfile: bool) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf, _use_new_zipfile_serialization=zipfile)
    return buf.getvalue()


# -- which tags are committed ----------------------------------------------------------

@dataclass
class Tag:
    """A committed DeepSpeed tag: the folder holding it (the tag's own name, or a staging
    folder of a re-save whose copy into the tag was interrupted) and its manifest."""

    folder: str
    manifest: Manifest

    @property
    def tag(self) -> str:
        return str(self.manifest.metadata.get("tag", self.folder))

    @property
    def staging(self) -> bool:
        return self.folder != self.tag

    @property
    def order(self) -> tuple:
        return (self.manifest.step or 0, self.manifest.created, not self.staging)


def scan(root: Storage) -> tuple[list[Tag], list[str]]:
    """Rank 0: the committed tags under ``root``, newest first, and why each other
    sub-folder is not one (for warnings)."""
    tags, skipped = [], []
    for name, size in sorted(root.listdir().items()):
        if size is not None:
            continue
        folder = root.child(name)
        listing = folder.listdir()
        try:
            m = read_committed(folder, listing)
        except CheckpointNotFoundError:
            if any(n.endswith(_DEEPSPEED_FILES) for n in listing):
                skipped.append(f"{name}: not committed (a save that never finished, or one written "
                               "without safeckpt)")
            continue
        except CorruptCheckpointError as exc:
            skipped.append(f"{name}: damaged ({exc})")
            continue
        if m.metadata.get("integration") == KIND:
            tags.append(Tag(name, m))
    return sorted(tags, key=lambda t: t.order, reverse=True), skipped


def committed_tags(save_dir: str | os.PathLike[str], *, storage_options: dict | None = None) -> list[str]:
    """The committed tags in a DeepSpeed checkpoint folder, newest first (no verification)."""
    tags, _ = scan(_local(os.fspath(save_dir), dict(storage_options or {})))
    seen: list[str] = []
    for t in tags:
        if t.tag not in seen:
            seen.append(t.tag)
    return seen


# -- the engine ------------------------------------------------------------------------

@dataclass
class _Save:
    """One ``save_checkpoint`` on this rank, from ``create`` to ``commit``."""

    root: LocalStorage
    tag: str
    folder: str          # where the files go: the tag, or a staging folder
    save_id: str
    step: int | None
    save_latest: bool
    files: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (size, checksum)
    error: BaseException | None = None
    done: bool = False

    @property
    def tag_path(self) -> str:
        return os.path.join(self.root.path, self.tag)


class SafeCheckpointEngine(CheckpointEngine):
    """DeepSpeed's ``CheckpointEngine`` through safeckpt's commit protocol (see the module
    docstring). ``install`` puts it on an initialized engine and wraps the engine's
    ``save_checkpoint`` / ``load_checkpoint`` around it."""

    def __init__(self, *, keep_last: int | None = None, storage_options: dict | None = None,
                 allow_pickle: bool = False, zipfile_serialization: bool = False) -> None:
        super().__init__(None)
        self.name = "safeckpt"
        self.retention = Retention(keep_last=keep_last)
        self.storage_options = dict(storage_options or {})
        self.allow_pickle = allow_pickle
        self.zipfile_serialization = zipfile_serialization
        self._pending: tuple[bool, int | None] | None = None  # set by save_checkpoint: (save_latest, step)
        self._save: _Save | None = None
        self._loading: dict[str, Manifest] = {}  # folder path -> its manifest, during load_checkpoint

    def begin(self, save_latest: bool, step: int | None) -> None:
        """``save_checkpoint`` is starting (the wrapped one calls this; DeepSpeed itself is
        told ``save_latest=False``: ``latest`` moves in ``commit``)."""
        self._pending = (save_latest, step)
        self._save = None

    def end(self) -> None:
        self._pending = None
        self._save = None

    # -- DeepSpeed's calls, in order -----------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        """Every rank, at the start of a save: rank 0 decides where the files go."""
        if self._pending is None:  # not from save_checkpoint (save_16bit_model): no tag to commit
            return
        save_latest, step = self._pending
        group = resolve(None)
        plan: Any = None
        if group.rank == 0:
            try:
                plan = self._plan(info.save_dir, info.tag)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                plan = exc
        plan = group.broadcast(plan) if group.size > 1 else plan
        if isinstance(plan, Exception):
            raise plan
        folder, save_id = plan
        self._save = _Save(_local(info.save_dir, self.storage_options), info.tag, folder, save_id, step,
                           save_latest)

    def _plan(self, save_dir: str, tag: str) -> tuple[str, str]:
        root = _local(save_dir, self.storage_options)
        save_id = new_save_id()
        if root.child(tag).listdir():  # never touch what is there before the new save commits
            return f"{tag}.safeckpt-{save_id}", save_id
        return tag, save_id

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Write one of this rank's files once, durably, checksummed. A failure is kept
        for ``commit`` (which aborts the tag on every rank) instead of raised here, so
        this rank stays in step with DeepSpeed's collectives."""
        s = self._save
        if s is None:
            self._save_outside(state_dict, path)
            return
        rel = os.path.relpath(os.path.abspath(path), s.tag_path)
        if rel.startswith(os.pardir) or os.sep in rel:
            s.error = s.error or ValueError(
                f"DeepSpeed saved {path}, outside the tag folder {s.tag_path}; this engine commits "
                "only the files of the tag (MoE expert files in sub-folders are not supported)")
            return
        if s.error is not None:
            return
        folder = s.root.child(s.folder)
        try:
            data = _serialize(state_dict, self.zipfile_serialization)
            folder.write_file(rel, [data])
            s.files[rel] = (len(data), checksum(data))
        except Exception as exc:  # noqa: BLE001 - reported in commit()
            s.error = exc
            if not isinstance(exc, FileExistsError):
                _quietly(lambda: folder.delete([rel]))

    def _save_outside(self, state_dict: Any, path: str) -> None:
        """A file outside any tag (``save_16bit_model``'s export): replaced atomically."""
        folder, name = os.path.split(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        replace_file(_local(folder, self.storage_options), name,
                     _serialize(state_dict, self.zipfile_serialization))

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every rank, after all files are written: one commit for the whole tag."""
        if self._save is None:
            return True
        self._finish(None)
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read one file of a committed tag, check it against the manifest, unpickle it
        with ``weights_only`` (see ``SAFE_GLOBALS``)."""
        folder, name = os.path.split(os.path.abspath(path))
        storage = _local(folder, self.storage_options)
        m = self._loading.get(folder) or read_committed(storage)
        entry = m.files.get(name)
        if entry is None:
            raise CorruptCheckpointError(
                f"DeepSpeed asked for {path}, which the committed checkpoint in {folder} does not hold")
        try:
            data = storage.read(name)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{path} is missing from the committed checkpoint") from exc
        if len(data) != entry.size or entry.checksum is None or not matches(data, entry.checksum):
            raise CorruptCheckpointError(
                f"{path} does not match the checksum committed in {folder} (it was damaged or altered "
                "after the save); load another tag")
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                return torch.load(io.BytesIO(data), map_location=map_location, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as exc:
            raise UnsafeObjectError(
                f"{path} holds objects beyond DeepSpeed's format, which loading would have to run code "
                f"for ({exc}); if you trust this checkpoint (e.g. your own client_state objects), "
                "install the engine with allow_pickle=True") from exc

    # -- the commit ----------------------------------------------------------------------
    def _finish(self, error: BaseException | None) -> None:
        s = self._save
        assert s is not None  # called only while a save is open
        s.done = True
        group = resolve(None)
        failure = error or s.error
        report = (s.files, describe_error(failure) if failure is not None else None)
        reports = group.gather(report)
        outcome = self._commit(s, cast(list, reports)) if group.rank == 0 else None  # rank 0 gathers
        outcome = group.broadcast(outcome) if group.size > 1 else outcome
        if outcome is not None:
            message, errors = outcome
            if group.size == 1 and failure is not None:
                raise failure
            raise SaveAbortedError(message, errors) from failure

    def _commit(self, s: _Save, reports: list) -> tuple[str, dict[int, str]] | None:
        """Rank 0: seal the tag, or abort it; None when committed."""
        errors = {r: e for r, (_, e) in enumerate(reports) if e}
        folder = s.root.child(s.folder)
        try:
            if not errors:
                written = {name: entry for files, _ in reports for name, entry in files.items()}
                unseen = not_visible(folder, {name: size for name, (size, _) in written.items()})
                if unseen:
                    raise SaveAbortedError(
                        f"rank 0 cannot see {sorted(unseen)}, which other ranks wrote to {folder.url}: the "
                        "storage is not shared between the ranks (node-local disks?); save to a shared filesystem")
                seal(folder, step=s.step, written=written, world_size=len(reports),
                     metadata={"integration": KIND, "tag": s.tag, "deepspeed_version": deepspeed.__version__})
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            errors = {0: describe_error(exc)}
        if errors:
            _quietly(lambda: remove_tree(folder))  # the attempt's files: nothing was there before
            return abort_summary(s.tag_path, errors), errors
        try:
            self._after_commit(s)
        except (CheckpointError, OSError) as exc:  # committed; what is left is tidied by the next save
            warn(f"committed {s.tag_path}, but updating {LATEST} or cleaning up failed: {exc}", CleanupWarning)
        return None

    def _after_commit(self, s: _Save) -> None:
        """Rank 0: ``latest``, a staged re-save moved into its tag, retention."""
        if s.folder != s.tag:
            if s.save_latest:
                replace_file(s.root, LATEST, s.folder.encode())
            remove_tree(s.root.child(s.tag))  # the new version is committed in the staging folder
            replicate(s.root, s.root, s.folder, set(), to=s.tag)
        if s.save_latest:
            replace_file(s.root, LATEST, s.tag.encode())
        if s.folder != s.tag:
            remove_tree(s.root.child(s.folder))
        self._tidy(s)

    def _tidy(self, s: _Save) -> None:
        """Rank 0, after a commit: temporary files and staging folders of killed or
        finished re-saves, then tags beyond ``keep_last`` (only committed ones this
        engine wrote)."""
        root = s.root
        tags, _ = scan(root)
        real = {t.tag: t for t in tags if not t.staging}
        listing = root.listdir()
        root.delete([n for n, size in listing.items() if size is not None and _STAGING_RE.fullmatch(n)])
        for name, size in listing.items():  # (files: temporaries of replace_file that a crash left)
            m = _STAGING_RE.fullmatch(name)
            if size is not None or m is None or name == s.folder:
                continue
            mine = next((t for t in tags if t.folder == name), None)
            done = real.get(m.group("tag"))
            if mine is None or (done is not None and done.order[:2] >= mine.order[:2]):
                remove_tree(root.child(name))
        if self.retention.keeps_all:
            return
        assert self.retention.keep_last is not None  # an engine's only rule
        newest: dict[str, Tag] = {}
        for t in scan(root)[0]:
            newest.setdefault(t.tag, t)
        ordered = sorted(newest.values(), key=lambda t: t.order)
        keep = {t.tag for t in ordered[-self.retention.keep_last:]} | {s.tag}
        for t in scan(root)[0]:
            if t.tag not in keep:
                remove_tree(root.child(t.folder))
                log.info("deleted DeepSpeed tag %s from %s (keep_last=%s)", t.tag, root.url,
                         self.retention.keep_last)

    # -- loading -------------------------------------------------------------------------
    def choose(self, load_dir: str, tag: str | None) -> str | None:
        """Every rank: the folder to load (rank 0 decides, after verifying it), or None
        when ``load_dir`` holds no committed tag and none was asked for."""
        group = resolve(None)
        choice: Any = None
        if group.rank == 0:
            try:
                choice = self._choose(load_dir, tag)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                choice = exc
        choice = group.broadcast(choice) if group.size > 1 else choice
        if isinstance(choice, Exception):
            raise choice
        if choice is None:
            return None
        folder = _local(os.path.join(load_dir, choice), self.storage_options)
        self._loading[folder.path] = committed_for_group(folder, group)
        return choice

    def _choose(self, load_dir: str, tag: str | None) -> str | None:
        root = _local(load_dir, self.storage_options)
        tags, skipped = scan(root)
        if tag is not None:
            tags = [t for t in tags if tag in (t.tag, t.folder)]
            skipped = [s for s in skipped if s.startswith(f"{tag}:")]
        problems: list[str] = []
        for t in tags:
            report = verify(root.child(t.folder))
            if report.ok:
                if problems or skipped:
                    warn(f"loading {t.tag} from {root.url}/{t.folder}; skipped newer or "
                         "uncommitted tags:\n  " + "\n  ".join(skipped + problems), SkippedCheckpointWarning)
                return t.folder
            problems.append(f"{t.folder}: corrupt: " + "; ".join(report.problems))
        if problems:
            raise CorruptCheckpointError(f"no tag in {root.url} could be loaded:\n  " + "\n  ".join(problems))
        if tag is not None:
            raise CheckpointNotFoundError(f"no committed DeepSpeed checkpoint of tag {tag!r} in {root.url}"
                                          + "".join(f"; {s}" for s in skipped))
        if skipped:
            warn(f"no committed DeepSpeed checkpoint in {root.url}; skipped:\n  "
                 + "\n  ".join(skipped), SkippedCheckpointWarning)
        return None

    def loaded(self) -> None:
        self._loading.clear()


def _quietly(fn: Any) -> None:
    try:
        fn()
    except OSError:
        pass


# -- installing ------------------------------------------------------------------------

def install(engine: Any, *, keep_last: int | None = None, storage_options: dict | None = None,
            allow_pickle: bool = False) -> Any:
    """Make ``engine`` (a ``deepspeed.DeepSpeedEngine``) save and load through safeckpt;
    returns it. Call it on every rank after ``deepspeed.initialize``; calling it again
    replaces the options."""
    if getattr(engine, "_safeckpt_engine", None) is not None:
        old: SafeCheckpointEngine = engine._safeckpt_engine
        old.retention = Retention(keep_last=keep_last)
        old.storage_options = dict(storage_options or {})
        old.allow_pickle = allow_pickle
        return engine
    previous = engine.checkpoint_engine
    if previous is not None and previous.is_decoupled():
        raise ValueError("safeckpt's checkpoint engine replaces DeepSpeed's decoupled (asynchronous) "
                         "checkpoint writer; remove checkpoint.writer.decoupled from the DeepSpeed config")
    ckpt = SafeCheckpointEngine(keep_last=keep_last, storage_options=storage_options, allow_pickle=allow_pickle,
                                zipfile_serialization=getattr(previous, "zipfile_serialization", False))
    engine.checkpoint_engine = ckpt
    engine._safeckpt_engine = ckpt
    engine.save_checkpoint = _wrap_save(engine, ckpt, engine.save_checkpoint)
    engine.load_checkpoint = _wrap_load(ckpt, engine.load_checkpoint)
    engine._copy_recovery_script = _copy_recovery_script
    return engine


def install_on_prepare(accelerator: Any, **options: Any) -> None:
    """Install the engine on every DeepSpeed engine ``accelerator.prepare`` returns from
    now on (the Hugging Face Trainer prepares its engine and loads a checkpoint into it
    in one method, with no hook in between). Idempotent."""
    if getattr(accelerator.prepare, "_safeckpt", False):
        return
    prepare = accelerator.prepare

    @functools.wraps(prepare)
    def prepare_and_install(*args: Any, **kwargs: Any) -> Any:
        result = prepare(*args, **kwargs)
        for obj in result if isinstance(result, tuple) else (result,):
            if isinstance(obj, deepspeed.DeepSpeedEngine):
                install(obj, **options)
        return result
    cast(Any, prepare_and_install)._safeckpt = True
    accelerator.prepare = prepare_and_install


def _wrap_save(engine: Any, ckpt: SafeCheckpointEngine, original: Any) -> Any:
    @functools.wraps(original)
    def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True, **kwargs):  # noqa: B006 - DeepSpeed's
        ckpt.begin(save_latest, int(engine.global_steps))
        try:  # DeepSpeed must not write ``latest`` itself: the engine does, after the commit
            return original(save_dir, tag, client_state=client_state, save_latest=False, **kwargs)
        except BaseException as exc:
            if ckpt._save is not None and not ckpt._save.done and isinstance(exc, Exception):
                ckpt._finish(exc)  # this rank failed outside save(): abort the tag on every rank
            raise
        finally:
            ckpt.end()
    return save_checkpoint


def _wrap_load(ckpt: SafeCheckpointEngine, original: Any) -> Any:
    @functools.wraps(original)
    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        folder = ckpt.choose(load_dir, None if tag is None else str(tag))
        if folder is None:
            return None, None
        try:
            return original(load_dir, folder, *args, **kwargs)
        finally:
            ckpt.loaded()
    return load_checkpoint


def _copy_recovery_script(save_path: str) -> None:
    """Rank 0: DeepSpeed's ``zero_to_fp32.py`` (and ``zero_to_torch.py``) next to the
    tags, replaced atomically and only when their content changed (DeepSpeed copies
    them over the old ones in place at every save)."""
    scripts = os.path.join(os.path.dirname(deepspeed.__file__), "utils")
    root = LocalStorage(save_path)
    for script in _RECOVERY_SCRIPTS:
        with open(os.path.join(scripts, script), "rb") as f:
            data = f.read()
        dst = os.path.join(save_path, script)
        try:
            with open(dst, "rb") as f:
                if f.read() == data:
                    continue
        except FileNotFoundError:
            pass
        replace_file(root, script, data)
        try:
            os.chmod(dst, os.stat(dst).st_mode | 0o111)
        except OSError:
            pass
