"""PyTorch Lightning: every checkpoint the Trainer writes becomes a safeckpt checkpoint.

    trainer = Trainer(plugins=[SafeCheckpointIO()])

``SafeCheckpointIO`` is a Lightning ``CheckpointIO`` plugin. Every path Lightning
saves to (``epoch=0-step=4.ckpt``, ``last.ckpt``, ``trainer.save_checkpoint(path)``)
becomes a safeckpt checkpoint *folder* at that path, on any URL safeckpt can open:

- a save is committed only when its manifest is written, so a kill mid-save never
  leaves a checkpoint that looks valid; re-saving the same path (``save_last=True``
  writes ``last.ckpt`` again and again) replaces it atomically: the old one loads
  until the new manifest exists;
- loading never runs code from the checkpoint: tensors are raw bytes and every other
  value goes through safeckpt's restricted decoder (``weights_only=True`` is always
  honoured; values that need pickle load only with ``allow_pickle=True``);
- ``remove_checkpoint`` (top-k rotation) deletes the manifest first, then the data,
  and returns when the checkpoint is gone;
- with ``async_save=True`` a save returns once the tensors are copied to host memory
  and commits in the background; a removal or load waits for it first.

Lightning's sharded strategies write their checkpoints themselves through
torch.distributed.checkpoint and never call a ``CheckpointIO``. For them,
``SafeModelParallelStrategy`` and ``SafeFSDPStrategy`` (drop-ins for
``ModelParallelStrategy`` and ``FSDPStrategy(state_dict_type="sharded")``, same
arguments) save and load sharded checkpoints through ``safeckpt.dcp``: every rank writes
its shards, rank 0 commits one manifest that also holds what Lightning keeps in
``meta.pt`` (epoch, loops, callbacks, hyper-parameters), so ``ModelCheckpoint``'s
rotation (which runs after the save returns) never deletes a checkpoint before its
replacement is committed, and ``fit(ckpt_path="last")`` resumes from a committed one.

Only ``lightning.pytorch`` (the ``lightning`` package) is supported: the classes of the
separate ``pytorch_lightning`` package are different objects. DeepSpeed's checkpoints
are not covered; see docs/integrations.md.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch

try:
    import lightning
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning_utilities.core.apply_func import apply_to_collection
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "safeckpt.integrations.lightning needs PyTorch Lightning >= 2.2: pip install "
        "'safeckpt[lightning]' (it builds on `lightning.pytorch`; the separate "
        f"`pytorch_lightning` package is not supported) [{_exc}]") from _exc

from ..errors import CleanupWarning, warn
from ..run.asyncsave import AsyncSaver
from ..protocol.checkpoint import CheckpointInfo, gc_paused, load_state, save_request
from ..format.folder import retire
from ..protocol.commit import DATA_RE
from ..errors import UnsafeObjectError
from ..format.manifest import manifest_seq
from ..run.garbage import garbage_in
from ..protocol.group import SingleGroup
from ..protocol.state import is_stateful
from ..storage import Storage, is_remote
from ..storage import open as open_storage

__all__ = ["SafeCheckpointIO", "SafeModelParallelStrategy", "SafeFSDPStrategy", "load_from_checkpoint",
           "remove_interrupted_saves"]

log = logging.getLogger(__name__)

MIN_LIGHTNING = (2, 2)


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


class SafeCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves through safeckpt (see module docstring).

    ``async_save``: return from a save once the state is snapshotted (tensors copied to
    host memory, other values encoded) and commit in a background thread; at most one
    save is in flight. ``allow_pickle``: store values the restricted codec refuses with
    pickle, and load them (never when ``weights_only=True``). ``verify``: check every
    chunk's checksum on load. ``storage_options``: for fsspec URLs (merged with those
    Lightning passes per save)."""

    def __init__(self, *, async_save: bool = False, allow_pickle: bool = False, verify: bool = True,
                 storage_options: dict | None = None) -> None:
        super().__init__()
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.storage_options = dict(storage_options or {})
        self._saver: AsyncSaver | None = None

    # -- save -----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as a safeckpt folder at ``path``, atomically replacing a
        checkpoint already there. Called by Lightning on the global-zero rank only, so
        it never waits for the other ranks."""
        if not isinstance(checkpoint, dict):
            raise TypeError(f"a Lightning checkpoint is a dict, not {type(checkpoint).__name__}")
        url = _url(path)
        _refuse_stateful(checkpoint, url)
        request = save_request(path, overwrite=True, metadata=_metadata(checkpoint),
                               process_group=SingleGroup(), storage_options=self._options(storage_options),
                               allow_pickle=self.allow_pickle, step=_step(checkpoint),
                               before_commit=lambda: self._before_commit(url))
        folder = request.storage
        if not self.async_save:
            started = time.perf_counter()
            info = _run_sync(request, checkpoint, url, started)
            self._after_commit(folder, info)
            return
        if self._saver is None:
            self._saver = AsyncSaver()
        try:
            self._saver.submit(checkpoint, request, on_done=lambda info, blocked: self._after_commit(folder, info))
        except UnsafeObjectError as exc:
            raise UnsafeObjectError(f"cannot save the Lightning checkpoint {url}: {exc}. {_UNSAFE_HINT}") from exc

    def _before_commit(self, url: str) -> None:
        """Called after the data files of a save to ``url`` are durable and just before
        its manifest is written (the commit). A no-op; a subclass may override it (the
        tests kill the process here)."""

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
        """The checkpoint at ``path`` as Lightning's dict, tensors on the CPU (or moved by
        ``map_location``: a device, a ``{"cpu": device}`` dict, or a callable applied to
        each tensor). Never runs code from the checkpoint unless the plugin was made with
        ``allow_pickle=True`` and ``weights_only`` is not True. A plain torch file (a
        checkpoint from before the switch to safeckpt) is read with ``torch.load``
        under the same rule."""
        self.wait()
        allow_pickle = self.allow_pickle and weights_only is not True
        options = self._options(None)
        if _is_file(path, options):
            with get_filesystem(path, **options).open(_url(path), "rb") as f:
                return torch.load(f, map_location=map_location or "cpu", weights_only=not allow_pickle)
        try:
            checkpoint = load_state(path, verify=self.verify, storage_options=options, allow_pickle=allow_pickle)
        except UnsafeObjectError as exc:
            how = ("weights_only=True refuses them" if self.allow_pickle
                   else "load with SafeCheckpointIO(allow_pickle=True), and only if you trust who wrote it")
            raise UnsafeObjectError(f"{exc} ({_url(path)} holds pickled values; {how})") from exc
        return _map_location(checkpoint, map_location)

    # -- remove ---------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``: its manifests first (from then on it is not
        a checkpoint), then its data files, then the folder if nothing else is in it.
        Waits for an async save in flight first, so a checkpoint is never deleted before
        the one that replaces it is committed (and raises if that save failed)."""
        self.wait()
        options = self._options(None)
        if _is_file(path, options):  # a plain torch checkpoint
            fs = get_filesystem(path, **options)
            fs.rm(_url(path))
            return
        storage = open_storage(path, **options)
        retire(storage, keep=None)
        storage.remove_folder()
        left = storage.listdir()
        if left:
            warn(f"removed the checkpoint {storage.url}, but the folder still holds files safeckpt "
                 f"did not write, so it was kept: {sorted(left)[:5]}", CleanupWarning)

    # -- lifetime -------------------------------------------------------------------------
    def wait(self) -> CheckpointInfo | None:
        """Wait for the async save in flight (if any); raise its error if nobody saw it."""
        return self._saver.wait() if self._saver is not None else None

    def teardown(self) -> None:
        """Called by Lightning at the end of fit/validate/test: waits for the save in
        flight and releases the host staging buffers."""
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close()

    def _options(self, per_call: Any | None) -> dict:
        if per_call is not None and not isinstance(per_call, dict):
            raise TypeError(f"SafeCheckpointIO: storage_options must be a dict of fsspec options, "
                            f"not {type(per_call).__name__}")
        return {**self.storage_options, **(per_call or {})}

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
            if "://" not in path and os.path.isfile(path):  # a plain torch checkpoint was saved here before
                os.unlink(path)
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
            if _is_safeckpt_folder(str(filepath)):
                SafeCheckpointIO().remove_checkpoint(self._storage(str(filepath)))
            else:
                super().remove_checkpoint(filepath)

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


def _is_safeckpt_folder(path: str) -> bool:
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
            _refuse_stateful(v, url, f"{key}.{k}" if key else str(k))
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
    directory: folders holding safeckpt data files but no committed checkpoint, and
    stray data files in committed ones. Returns what was (or would be) removed, as
    ``folder/name``. Only safeckpt's own file names are touched; call it while nothing
    is saving into ``dirpath`` (for example before ``trainer.fit(ckpt_path="last")``)."""
    root = open_storage(dirpath, **(storage_options or {}))
    removed: list[str] = []
    for name, size in sorted(root.listdir().items()):
        if size is not None:
            continue
        folder = root.child(name)
        manifests, data = garbage_in(folder)
        removed += [f"{name}/{n}" for n in manifests + data]
        if not dry_run and (manifests or data):
            folder.delete(manifests)
            folder.delete(data)
            folder.remove_folder()
    return removed
