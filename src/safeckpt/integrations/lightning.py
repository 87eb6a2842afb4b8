"""PyTorch Lightning: the checkpoints the Trainer writes, made safe.

    trainer = Trainer(plugins=[SafeCheckpointIO()])

``SafeCheckpointIO`` is a Lightning ``CheckpointIO`` plugin with two layouts.

**The file layout (the default)** writes the ``.ckpt`` file stock Lightning writes,
the same bytes ``torch.save`` makes, so ``torch.load``, ``pl_load``,
``load_from_checkpoint``, a stock ``Trainer(ckpt_path=...)`` and
``ModelCheckpoint(save_last="link")`` work unchanged. What it adds over stock
Lightning (which serializes into a ``BytesIO`` and renames through an fsspec
transaction, with no fsync):

- the file replaces the old one atomically and is durable before it is visible
  (``Storage.open_replace``: a temporary name in the same folder, fsync, rename,
  folder fsync; one PUT of the final object on an object store; bounded retries of a
  rename Windows refuses while another process holds the file; a copy under the final
  name where a FUSE mount refuses rename), so a kill or a power cut leaves the old
  complete file or the new complete one;
- ``torch.save`` streams into the file: no second copy of the checkpoint in memory;
- before a load, the archive's zip structure and the CRC-32 ``torch.save`` records for
  every record are checked (``verify=True``), so a torn or changed file is refused
  instead of loading wrong values; when the refused file is a ``last*.ckpt``, the
  newest intact checkpoint in its folder is loaded instead, with a warning
  (``fallback=True``), which is what ``fit(ckpt_path="last")`` resumes from;
- with ``async_save=True`` a save returns once the tensors are copied to host memory
  and the file is written in the background (bytes identical to a synchronous save);
- ``remove_checkpoint`` never follows a symbolic link: removing ``save_last="link"``'s
  link removes the link, never the checkpoint it points to.

**The folder layout** (``SafeCheckpointIO(layout="folder")``) makes every path a
safeckpt checkpoint folder (a manifest written last over safetensors data files): no
pickle at all (values that need it are refused unless ``allow_pickle=True``),
``safeckpt verify`` / ``load_state`` on each path, and what the sharded strategies use.
A re-save of a path replaces it atomically (the old one loads until the new manifest
exists); ``remove_checkpoint`` deletes manifest first.

Either plugin loads both layouts (and plain torch files), so a run can switch.
``weights_only`` is honoured as ``torch.load`` honours it; ``allow_pickle=True``
makes ``weights_only=None`` mean False.

Lightning's sharded strategies write their checkpoints themselves through
torch.distributed.checkpoint and never call a ``CheckpointIO``. For them,
``SafeModelParallelStrategy`` and ``SafeFSDPStrategy`` (drop-ins for
``ModelParallelStrategy`` and ``FSDPStrategy(state_dict_type="sharded")``, same
arguments) save and load sharded checkpoints through ``safeckpt.dcp`` in the folder
layout: every rank writes its shards, rank 0 commits one manifest that also holds what
Lightning keeps in ``meta.pt`` (epoch, loops, callbacks, hyper-parameters), so
``ModelCheckpoint``'s rotation (which runs after the save returns) never deletes a
checkpoint before its replacement is committed, and ``fit(ckpt_path="last")`` resumes
from a committed one.

``LightningModule.load_from_checkpoint`` and ``pl_load`` open the path with fsspec and
hand the stream to ``torch.load``; no plugin or strategy takes part, so they read the
file layout only. ``load_from_checkpoint(cls, path)`` here reads both.

Only ``lightning.pytorch`` (the ``lightning`` package) is supported: the classes of the
separate ``pytorch_lightning`` package are different objects. DeepSpeed's checkpoints
are not covered; see docs/integrations.md.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

try:
    import lightning
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning_utilities.core.apply_func import apply_to_collection
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "safeckpt.integrations.lightning needs PyTorch Lightning >= 2.2: pip install "
        "'safeckpt[lightning]' (it builds on `lightning.pytorch`; the separate "
        f"`pytorch_lightning` package is not supported) [{_exc}]") from _exc

from ..errors import (CleanupWarning, CorruptCheckpointError, SafeckptWarning, SkippedCheckpointWarning,
                      UnsafeObjectError, warn)
from ..format.folder import retire
from ..format.manifest import manifest_seq
from ..format.tree import child_key
from ..interop.torchfile import check_torch_file, host_snapshot, write_torch_file
from ..protocol.checkpoint import CheckpointInfo, gc_paused, load_state, save_request
from ..protocol.checkpoint import verify as safeckpt_verify
from ..protocol.commit import DATA_RE
from ..protocol.group import SingleGroup
from ..protocol.staging import StagingPool
from ..protocol.state import is_stateful
from ..run.asyncsave import AsyncSaver
from ..run.garbage import garbage_in
from ..storage import LocalStorage, Storage, is_remote
from ..format.names import is_replace_temp
from ..storage import open as open_storage

__all__ = ["SafeCheckpointIO", "SafeModelParallelStrategy", "SafeFSDPStrategy", "load_from_checkpoint",
           "remove_checkpoint_at", "remove_interrupted_saves", "LAYOUTS"]

log = logging.getLogger(__name__)

MIN_LIGHTNING = (2, 2)
_SAVER_LOCK = threading.Lock()  # makes and drops the plugins' savers (a lock per plugin would not pickle)
_WRITING: dict[str, int] = {}  # checkpoints being written by a save_checkpoint call, by URL
_WRITTEN = threading.Condition()  # guards _WRITING; notified when a save_checkpoint call returns
LAYOUTS = ("file", "folder")  # SafeCheckpointIO(layout=...): Lightning's .ckpt file, or a safeckpt folder


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


if _version_tuple(lightning.__version__) < MIN_LIGHTNING:  # pragma: no cover
    raise ImportError(f"safeckpt.integrations.lightning needs lightning >= 2.2, found {lightning.__version__}; "
                      "pip install -U 'safeckpt[lightning]'")

_UNSAFE_HINT = (
    "A Lightning checkpoint holds the module's hyper-parameters (save_hyperparameters) and "
    "whatever on_save_checkpoint adds: leave the value out (save_hyperparameters(ignore=[...])), "
    "store it as plain values, or opt in with SafeCheckpointIO(allow_pickle=True) -- loading it "
    "then runs code from the checkpoint and needs the same opt-in")


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` that saves safely (see the module docstring). A
    ``TorchCheckpointIO``, as its files are, whose every method is its own.

    ``layout``: ``"file"`` (Lightning's own ``.ckpt`` file) or ``"folder"`` (a safeckpt
    checkpoint folder). ``async_save``: return from a save once the state is
    snapshotted (tensors copied to host memory) and write it in a background thread; at
    most one save is in flight, and its error is raised by the next save, removal, load
    or ``teardown``. ``allow_pickle``: folder layout, store values the restricted codec
    refuses with pickle; both layouts, ``weights_only=None`` loads with pickle.
    ``verify``: check a file's CRC-32s, a folder's checksums, on load. ``fallback``: a
    ``last*.ckpt`` that fails its check gives way to the newest intact checkpoint in
    its folder. ``storage_options``: for fsspec URLs (merged with those Lightning
    passes per save)."""

    def __init__(self, *, layout: str = "file", async_save: bool = False, allow_pickle: bool = False,
                 verify: bool = True, fallback: bool = True, storage_options: dict | None = None) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"SafeCheckpointIO(layout={layout!r}): choose one of {', '.join(map(repr, LAYOUTS))}")
        self.layout = layout
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.fallback = fallback
        self.storage_options = dict(storage_options or {})
        self._saver: AsyncSaver | None = None

    # -- save -----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` at ``path`` in this plugin's layout, atomically replacing
        a checkpoint already there. Called by Lightning on the global-zero rank only,
        so it never waits for the other ranks."""
        if not isinstance(checkpoint, dict):
            raise TypeError(f"a Lightning checkpoint is a dict, not {type(checkpoint).__name__}")
        options = self._options(storage_options)
        url = _url(path)
        with _WRITTEN:
            _WRITING[url] = _WRITING.get(url, 0) + 1
        try:
            if self.layout == "file":
                self._save_file(checkpoint, path, options)
            else:
                self._save_folder(checkpoint, path, options)
        finally:
            with _WRITTEN:
                _WRITING[url] -= 1
                if not _WRITING[url]:
                    del _WRITING[url]
                _WRITTEN.notify_all()

    def _storage(self, url: str, options: dict) -> Storage:
        """The storage of the folder ``url`` that a file-layout checkpoint is written
        into (a subclass may wrap it: the tests kill the process mid-write there)."""
        return open_storage(url, **options)

    def _save_file(self, checkpoint: dict, path: Any, options: dict) -> None:
        folder, name = self._place(path, options)
        url = _url(path)
        _clear_for_file(folder, name)
        started = time.perf_counter()
        if self.async_save:
            def prepare(pool: StagingPool) -> Callable[[], int]:
                snapshot = host_snapshot(checkpoint, pool)

                def work() -> int:
                    try:
                        return write_torch_file(snapshot.value, folder, name, lambda: self._before_commit(url))
                    finally:
                        snapshot.release()
                return work
            try:
                self._async_saver().submit_prepared(
                    prepare, lambda size, blocked: _log_file(url, size, started, blocked))
                return
            except Exception as exc:  # noqa: BLE001 - a value deepcopy refuses: save it now instead
                warn(f"{url} was saved synchronously: the checkpoint holds a value that cannot be copied "
                     f"for a background save ({type(exc).__name__}: {exc})", SafeckptWarning)
        size = write_torch_file(checkpoint, folder, name, lambda: self._before_commit(url))
        _log_file(url, size, started, 0.0)

    def _place(self, path: Any, options: dict) -> tuple[Storage, str]:
        """The storage of the folder a checkpoint file goes in, and the file's name."""
        if isinstance(path, Storage):
            return path.parent(), path.url.rstrip("/").rsplit("/", 1)[-1]
        text = os.fspath(path)
        if is_remote(text):
            parent, _, name = text.rstrip("/").rpartition("/")
        else:
            parent, name = os.path.split(os.path.abspath(text.removeprefix("file://")))
        return self._storage(parent, options), name

    def _save_folder(self, checkpoint: dict, path: Any, options: dict) -> None:
        url = _url(path)
        _refuse_stateful(checkpoint, url)
        if not isinstance(path, Storage) and not is_remote(url) and (os.path.islink(url) or os.path.isfile(url)):
            # save_last="link"'s link (replace the link, never its target), or a file the
            # file layout wrote: a folder cannot replace either in one step
            os.unlink(url)
        request = save_request(path, overwrite=True, metadata=_metadata(checkpoint),
                               process_group=SingleGroup(), storage_options=options,
                               allow_pickle=self.allow_pickle, step=_step(checkpoint),
                               before_commit=lambda: self._before_commit(url))
        folder = request.storage
        if not self.async_save:
            started = time.perf_counter()
            info = _run_sync(request, checkpoint, url, started)
            self._after_commit(folder, info)
            return
        try:
            self._async_saver().submit(checkpoint, request, on_done=lambda info, blocked: self._after_commit(folder, info))
        except UnsafeObjectError as exc:
            raise UnsafeObjectError(f"cannot save the Lightning checkpoint {url}: {exc}. {_UNSAFE_HINT}") from exc

    def _before_commit(self, url: str) -> None:
        """Called once every byte of a save to ``url`` is durable (the folder layout's
        data files, the file layout's temporary file) and just before it is committed
        (the manifest; the rename). A no-op; a subclass may override it (the tests kill
        the process here)."""

    def _after_commit(self, folder: Storage, info: CheckpointInfo) -> None:
        """Remove what interrupted saves into the same path left (data files without a
        manifest); the new checkpoint is committed, so nothing loadable is touched."""
        try:
            manifests, data = garbage_in(folder)
            folder.delete(manifests)
            folder.delete(data)
        except Exception as exc:  # noqa: BLE001 - the save itself succeeded
            warn(f"saved {info.path}, but could not remove files of interrupted saves there: {exc}",
                 CleanupWarning)
        log.debug("lightning checkpoint committed: %s (%d bytes, %.3fs)", info.path, info.bytes, info.seconds)

    # -- load -----------------------------------------------------------------------------
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path`` (a file or a folder, whatever this plugin's
        layout) as Lightning's dict. A file is checked first (``verify``) and loaded
        with ``torch.load``; a ``last*.ckpt`` that fails the check gives way to the
        newest intact checkpoint in its folder (``fallback``). A folder's tensors come
        back on the CPU (or moved by ``map_location``: a device, a ``{"cpu": device}``
        dict, or a callable applied to each tensor) and its values never run code
        unless pickle is allowed."""
        self.wait()
        options = self._options(None)
        if not _is_file(path, options):
            return self._load_folder(path, map_location, weights_only, options)
        try:
            return self._load_file(_url(path), map_location, weights_only, options)
        except CorruptCheckpointError as exc:
            if not (self.fallback and _is_last_name(_url(path))):
                raise
            instead = self._newest_intact(_url(path), options)
            if instead is None:
                raise CorruptCheckpointError(f"{exc}; no intact checkpoint in its folder to fall back to") from exc
            warn(f"{_url(path)} failed its check ({exc}); loading {instead}, the newest intact checkpoint "
                 "in its folder, instead", SkippedCheckpointWarning)
            if _is_file(instead, options):
                return self._load_file(instead, map_location, weights_only, options)
            return self._load_folder(instead, map_location, weights_only, options)

    def _allow_pickle(self, weights_only: bool | None) -> bool:
        return weights_only is False or (weights_only is None and self.allow_pickle)

    def _load_file(self, url: str, map_location: Any, weights_only: bool | None, options: dict) -> dict[str, Any]:
        with get_filesystem(url, **options).open(url, "rb") as f:
            if self.verify:
                check_torch_file(f, url)
            wo = False if self._allow_pickle(weights_only) else weights_only
            return torch.load(f, map_location=map_location or "cpu", weights_only=wo)

    def _load_folder(self, path: Any, map_location: Any, weights_only: bool | None, options: dict) -> dict[str, Any]:
        allow_pickle = self._allow_pickle(weights_only)
        try:
            checkpoint = load_state(path, verify=self.verify, storage_options=options, allow_pickle=allow_pickle)
        except UnsafeObjectError as exc:
            how = ("weights_only=True refuses them" if weights_only
                   else "load with weights_only=False or SafeCheckpointIO(allow_pickle=True), and only if you "
                        "trust who wrote it")
            raise UnsafeObjectError(f"{exc} ({_url(path)} holds pickled values; {how})") from exc
        return _map_location(checkpoint, map_location)

    def _newest_intact(self, url: str, options: dict) -> str | None:
        """The newest checkpoint (by modification time, as Lightning picks "last") in
        the folder of ``url``, other than it, that passes its check."""
        fs = get_filesystem(url, **options)
        folder = url.rstrip("/").rpartition("/")[0] if is_remote(url) else os.path.dirname(os.path.abspath(url))
        try:
            names = [p for p in fs.ls(folder, detail=False) if str(p).endswith(".ckpt")]
        except OSError:
            return None

        def modified(p: str) -> float:
            try:
                return fs.modified(p).timestamp()
            except Exception:  # noqa: BLE001 - unknown: last
                return 0.0
        here = os.path.basename(url.rstrip("/"))
        for candidate in sorted(names, key=modified, reverse=True):
            where = fs.unstrip_protocol(candidate) if is_remote(url) else str(candidate)
            if os.path.basename(where.rstrip("/")) == here:
                continue
            if _intact(where, options):
                return where
        return None

    # -- remove ---------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``: a file (or a symbolic link: the link
        itself, never what it points to), or a safeckpt folder (its manifests first, from
        then on it is not a checkpoint, then its data files, then the folder if nothing
        else is in it). Waits for an async save in flight first, so a checkpoint is never
        deleted before the one that replaces it is committed (and raises if that save
        failed), and for a save of ``path`` another thread is running (Lightning's
        ``AsyncCheckpointIO`` saves on its thread and removes on the trainer's): the
        folder is never removed under its writer."""
        self.wait()
        url = _url(path)
        with _WRITTEN:
            _WRITTEN.wait_for(lambda: url not in _WRITING)
        remove_checkpoint_at(path, self._options(None))

    # -- lifetime -------------------------------------------------------------------------
    def _async_saver(self) -> AsyncSaver:
        """This plugin's saver, made once even when several threads save at once."""
        with _SAVER_LOCK:
            if self._saver is None:
                self._saver = AsyncSaver()
            return self._saver

    def wait(self) -> Any:
        """Wait for the async save in flight (if any); raise its error if nobody saw it."""
        return self._saver.wait() if self._saver is not None else None

    def teardown(self) -> None:
        """Called by Lightning at the end of fit/validate/test: waits for the save in
        flight and releases the host staging buffers."""
        with _SAVER_LOCK:
            saver, self._saver = self._saver, None
        if saver is not None:
            saver.close()

    def _options(self, per_call: Any | None) -> dict:
        if per_call is not None and not isinstance(per_call, dict):
            raise TypeError(f"SafeCheckpointIO: storage_options must be a dict of fsspec options, "
                            f"not {type(per_call).__name__}")
        return {**self.storage_options, **(per_call or {})}


def _log_file(url: str, size: int, started: float, blocked: float) -> None:
    log.debug("lightning checkpoint written: %s (%d bytes, %.3fs, %.3fs blocked)", url, size,
              time.perf_counter() - started, blocked)


def _clear_for_file(folder: Storage, name: str) -> None:
    """A safeckpt folder at ``name`` (the run saved in the folder layout before) gives
    way to the file: a file cannot replace a folder in one step, so the folder goes
    first, manifest first (a kill in between leaves no checkpoint under this name; the
    others in the folder stay)."""
    if folder.listdir().get(name, 0) is None and _is_safeckpt_folder(folder.child(name)):
        _remove_folder(folder.child(name))


def _is_last_name(url: str) -> bool:
    """A name ``ModelCheckpoint`` gives its "last" checkpoint (``last.ckpt``,
    ``last-v1.ckpt``, ``last-{epoch}.ckpt``), which stands for the newest."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return os.path.basename(url.rstrip("/")).startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST)


def _intact(where: str, options: dict) -> bool:
    """Whether the checkpoint at ``where`` (a file or a folder) passes its check."""
    try:
        if _is_file(where, options):
            with get_filesystem(where, **options).open(where, "rb") as f:
                check_torch_file(f, where)
            return True
        return safeckpt_verify(where, storage_options=options).ok
    except Exception:  # noqa: BLE001 - unreadable counts as not intact
        return False


def remove_checkpoint_at(path: Any, options: dict | None = None) -> None:
    """Remove the checkpoint at ``path`` without ever following a symbolic link (see
    ``SafeCheckpointIO.remove_checkpoint``). A folder that is not a safeckpt checkpoint
    (a stock strategy's) is removed as Lightning removes it."""
    options = options or {}
    if isinstance(path, Storage):
        _remove_folder(path)
        return
    url = _url(path)
    if not is_remote(url):
        local = os.path.abspath(url.removeprefix("file://"))
        try:
            mode = os.lstat(local).st_mode
        except FileNotFoundError:
            return
        parent, name = os.path.split(local)
        if not stat.S_ISDIR(mode):  # a file or a link: unlink it, durably
            LocalStorage(parent).delete([name])
            return
    else:
        parent, _, name = url.rstrip("/").rpartition("/")
        size = open_storage(parent, **options).listdir().get(name, -1)
        if size == -1:
            return
        if size is not None:
            open_storage(parent, **options).delete([name])
            return
    folder = open_storage(url, **options)
    if _is_safeckpt_folder(folder):
        _remove_folder(folder)
    else:
        get_filesystem(url, **options).rm(url, recursive=True)


def _remove_folder(storage: Storage) -> None:
    """A safeckpt folder: manifests first, then data, then the folder if empty."""
    retire(storage, keep=None)
    storage.remove_folder()
    left = storage.listdir()
    if left:
        warn(f"removed the checkpoint {storage.url}, but the folder still holds files safeckpt "
             f"did not write, so it was kept: {sorted(left)[:5]}", CleanupWarning)

if TYPE_CHECKING:  # what the mixin is mixed into: the strategy's methods and properties
    from lightning.pytorch.strategies import ParallelStrategy as _StrategyBase
else:
    _StrategyBase = object


class _SafeShardedCheckpoints(_StrategyBase):
    """Sharded save, load and removal of a Lightning strategy through ``safeckpt.dcp``
    (mixed into a subclass of the strategy; the full-state-dict path is Lightning's)."""

    _MODEL_KEY = "state_dict"  # the key Lightning saves the module's state under
    _META_KEY = "meta"         # what Lightning keeps in meta.pt, saved in the same commit

    def _sharded(self) -> bool:
        raise NotImplementedError

    def _storage(self, path: str) -> Storage:
        """The storage of the checkpoint at ``path`` (a subclass may wrap it)."""
        return open_storage(path)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        import torch.distributed.checkpoint as dcp

        from ..dcp import Writer

        path = str(self.broadcast(str(filepath)))  # every rank saves to rank 0's path
        state = {self._MODEL_KEY: checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self.is_global_zero:
            _refuse_stateful(checkpoint, path)
            if "://" not in path and (os.path.islink(path) or os.path.isfile(path)):
                os.unlink(path)  # a plain torch checkpoint was saved here before, or save_last="link"'s link
        dcp.save(state, storage_writer=Writer(self._storage(path), step=_step(checkpoint),
                                              metadata=_metadata(checkpoint), extra={self._META_KEY: checkpoint}))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(self.broadcast(str(checkpoint_path)))
        if not _is_safeckpt_folder(path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        self._load_sharded(path)
        return load_state(self._storage(path), keys=[self._META_KEY])[self._META_KEY]

    def _load_sharded(self, path: str) -> None:
        """Load the module's (and, when fitting, the optimizers') shards in place."""
        raise NotImplementedError

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint_at(filepath)  # never through a link (save_last="link")

    def _fitting(self) -> bool:
        from lightning.pytorch.trainer.states import TrainerFn

        assert self.lightning_module is not None  # loading runs on a strategy set up for a module
        return self.lightning_module.trainer.state.fn == TrainerFn.FITTING and bool(self.optimizers)


class SafeModelParallelStrategy(_SafeShardedCheckpoints, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel) whose distributed checkpoints
    are safeckpt checkpoints (see the module docstring); same arguments."""

    def _sharded(self) -> bool:
        return self._save_distributed_checkpoint

    def _load_sharded(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_optimizer_state_dict)

        from ..dcp import Reader

        assert self.model is not None and self.lightning_module is not None  # set up before loading
        state: dict[str, Any] = {self._MODEL_KEY: get_model_state_dict(self.model)}
        dcp.load(state, storage_reader=Reader(self._storage(path)))
        self.model.load_state_dict(state[self._MODEL_KEY], strict=self.lightning_module.strict_loading)
        if not self._fitting():
            return
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(state, storage_reader=Reader(self._storage(path)))
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[key],
                                     options=StateDictOptions(cpu_offload=True))


class SafeFSDPStrategy(_SafeShardedCheckpoints, FSDPStrategy):
    """``FSDPStrategy`` whose ``state_dict_type="sharded"`` checkpoints are safeckpt
    checkpoints (see the module docstring); same arguments."""

    _MODEL_KEY = "model"

    def _sharded(self) -> bool:
        return self._state_dict_type == "sharded"

    def _load_sharded(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from ..dcp import Reader

        assert self.model is not None and self.lightning_module is not None  # set up before loading
        # Lightning annotates this context manager as a Generator
        with _get_sharded_state_dict_context(self.model):  # type: ignore[attr-defined]
            state = {self._MODEL_KEY: self.model.state_dict()}
            dcp.load(state, storage_reader=Reader(self._storage(path)))
            self.model.load_state_dict(state[self._MODEL_KEY], strict=self.lightning_module.strict_loading)
            if not self._fitting():
                return
            for idx, optimizer in enumerate(self.optimizers):
                key = f"optimizer_{idx}"
                optim_state = load_sharded_optimizer_state_dict(
                    model_state_dict=state[self._MODEL_KEY], optimizer_key=key,
                    storage_reader=Reader(self._storage(path)))
                optimizer.load_state_dict(FSDP.optim_state_dict_to_load(
                    optim_state_dict=optim_state[key], model=self.model, optim=optimizer))


def _is_safeckpt_folder(path: Any) -> bool:
    """A folder safeckpt wrote into (committed or not): it holds a manifest or a data file."""
    try:
        names = open_storage(path).listdir()
    except Exception:  # noqa: BLE001 - a file, or nothing: not ours
        return False
    return any(manifest_seq(n) is not None or DATA_RE.fullmatch(n) for n in names)


@gc_paused
def _run_sync(request: Any, checkpoint: dict, url: str, started: float) -> CheckpointInfo:
    try:
        flattener = request.flattener(checkpoint)
    except UnsafeObjectError as exc:
        raise UnsafeObjectError(f"cannot save the Lightning checkpoint {url}: {exc}. {_UNSAFE_HINT}") from exc
    return request.run(flattener, started)


def _refuse_stateful(value: Any, url: str, key: str = "") -> None:
    """Everything Lightning itself puts in a checkpoint is already plain state. An
    object with ``state_dict()`` there (a module passed to ``save_hyperparameters``)
    would be stored as its state and come back as a dict: refuse it instead."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_stateful(v, url, child_key(key, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _refuse_stateful(v, url, f"{key}.{i}" if key else str(i))
    elif is_stateful(value):
        kind = type(value).__name__
        raise UnsafeObjectError(
            f"cannot save the Lightning checkpoint {url}: the value at {key!r} is a {kind}, an object "
            f"with state_dict(); it would be stored as its state and load back as a dict, not a {kind}. "
            "Lightning saves the weights of submodules anyway: leave it out of the hyper-parameters "
            "(save_hyperparameters(ignore=[...])), or store its state_dict() yourself")


def _url(path: Any) -> str:
    return path.url if isinstance(path, Storage) else os.fspath(path)


def _is_file(path: Any, options: dict) -> bool:
    """Whether ``path`` is a plain file (a torch checkpoint), not a safeckpt folder."""
    if isinstance(path, Storage):
        return False
    text = os.fspath(path)
    if not is_remote(text):
        return os.path.isfile(text.removeprefix("file://"))
    try:
        return bool(get_filesystem(text, **options).isfile(text))
    except Exception:  # noqa: BLE001 - undecidable here: let safeckpt open it and report
        return False


def _step(checkpoint: dict) -> int | None:
    step = checkpoint.get("global_step")
    return step if type(step) is int else None


def _metadata(checkpoint: dict) -> dict:
    meta: dict[str, Any] = {"writer": "lightning"}
    for key, name in (("pytorch-lightning_version", "lightning_version"), ("epoch", "epoch")):
        value = checkpoint.get(key)
        if type(value) in (int, str):
            meta[name] = value
    return meta


def _map_location(checkpoint: dict, map_location: Any) -> dict:
    if map_location is None:
        return checkpoint
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        if target is None:
            return checkpoint
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(target))
    if isinstance(map_location, (str, torch.device, int)):
        return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))
    if callable(map_location):
        def move(t: torch.Tensor) -> torch.Tensor:
            out = map_location(t, "cpu")
            return out if isinstance(out, torch.Tensor) else t
        return apply_to_collection(checkpoint, torch.Tensor, move)
    raise TypeError(f"unsupported map_location {map_location!r}")


def load_from_checkpoint(cls: Any, path: Any, *, map_location: Any = None, strict: bool | None = None,
                         weights_only: bool | None = None, allow_pickle: bool = False,
                         storage_options: dict | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path)`` for a safeckpt checkpoint: Lightning's own
    ``load_from_checkpoint`` reads the path with ``torch.load`` and cannot open a folder.
    ``cls`` is a ``LightningModule`` or ``LightningDataModule`` subclass; ``kwargs``
    override saved hyper-parameters, as in Lightning."""
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.core.saving import _load_state
        from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
    except ImportError as exc:  # pragma: no cover - private Lightning API moved
        raise ImportError(f"load_from_checkpoint does not support lightning {lightning.__version__} "
                          f"({exc}); load the dict with SafeCheckpointIO().load_checkpoint(path) and call "
                          "model.load_state_dict(checkpoint['state_dict'])") from exc
    io = SafeCheckpointIO(allow_pickle=allow_pickle, storage_options=storage_options)
    checkpoint = io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=_url(path))
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def remove_interrupted_saves(dirpath: Any, *, storage_options: dict | None = None,
                             dry_run: bool = False) -> list[str]:
    """Remove what saves killed before their commit left in a ``ModelCheckpoint``
    directory: the hidden temporary files of the file layout
    (``.last.ckpt.safeckpt-<id>.tmp``), folders holding safeckpt data files but no
    committed checkpoint, and stray data files in committed ones. Returns what was (or
    would be) removed, as ``name`` or ``folder/name``. Only safeckpt's own file names are
    touched; call it while nothing is saving into ``dirpath`` (for example before
    ``trainer.fit(ckpt_path="last")``)."""
    root = open_storage(dirpath, **(storage_options or {}))
    removed: list[str] = []
    for name, size in sorted(root.listdir().items()):
        if size is not None:
            if is_replace_temp(name):
                removed.append(name)
                if not dry_run:
                    root.delete([name])
            continue
        folder = root.child(name)
        manifests, data = garbage_in(folder)
        removed += [f"{name}/{n}" for n in manifests + data]
        if not dry_run and (manifests or data):
            folder.delete(manifests)
            folder.delete(data)
            folder.remove_folder()
    return removed
