"""Crash-safe ``save_state`` / ``load_state`` for Hugging Face Accelerate.

    from safeckpt.integrations.accelerate import load_state, save_state

    start = load_state(accelerator, "runs/exp1") or 0      # newest valid step, or None
    for step in range(start + 1, steps + 1):
        ...
        if step % 100 == 0:
            save_state(accelerator, "runs/exp1", step, keep_last=3)

By default (``layout="accelerate"``) each step's folder ``root/step-NNNNNNNNN`` holds
exactly the files ``accelerator.save_state(folder)`` writes (``model.safetensors``,
``optimizer.bin``, ``scheduler.bin``, ``random_states_N.pkl``, ``custom_checkpoint_N.pkl``,
FSDP and DeepSpeed shards...), written by Accelerate where it writes them; once every
process has finished, the main process seals the folder (``safeckpt.seal``: every file
checksummed, the manifest written last). A stock ``accelerator.load_state(folder)``
loads any sealed folder. Unlike ``Accelerator.save_state(total_limit=...)``, which
deletes old checkpoints *before* writing the new one, retention runs only after the new
one is sealed, counts sealed folders only, and restoring takes the newest folder whose
every byte matches its seal, falling back past torn or corrupt ones.

``layout="safeckpt"`` saves everything ``accelerator.prepare`` and
``register_for_checkpointing`` know about as one safeckpt checkpoint instead (no
pickles, any storage URL safeckpt opens, FSDP shards that load on another number of
processes): the prepared models (unwrapped, so the names do not depend on DDP),
optimizers, schedulers, the gradient scaler, registered custom objects, stateful
dataloaders, ``accelerator.step`` and each process's Python, NumPy and torch RNG states.
``load_state`` reads either layout (the newest committed checkpoint's decides).

Every process calls both functions (they are collective under torch.distributed).
One ``CheckpointManager`` is kept per accelerator and root; the retention options
(``keep_last``, ``keep_best``, ``best_metric``, ``keep_every``, ``async_save``...) apply
when it is created, by the first call, or pass your own manager as ``root``.
"""

from __future__ import annotations

import os
import random
import threading
import weakref
from typing import Any, cast

import numpy as np
import torch

try:
    import accelerate
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("safeckpt.integrations.accelerate needs accelerate: "
                      "pip install 'safeckpt[hf]'") from exc

from ..errors import CheckpointExistsError, CheckpointNotFoundError, PartialLoadWarning, SafeckptWarning, SkippedCheckpointWarning, warn
from ..format.folder import CheckpointState, folder_state, step_folders
from ..format.names import step_folder
from ..interop.sealing import seal
from ..run.asyncsave import SaveFuture
from ..protocol.checkpoint import CheckpointInfo
from ..run.manager import CheckpointManager
from ..run.retention import Retention
from ..protocol.shards import RankLocal
from ..storage import LocalStorage, Storage, is_remote
from ._sealed import newest_intact, remove_folder
from ._fsdp import ShardedModel, ShardedOptimizer, is_fsdp, owner

__all__ = ["LAYOUTS", "checkpoint_manager", "load_state", "rng_states", "save_state", "set_rng_states"]

#: ``layout`` values of ``save_state``: Accelerate's own files, sealed (the default), or
#: one safeckpt checkpoint
LAYOUTS = ("accelerate", "safeckpt")

_MANAGERS: weakref.WeakKeyDictionary[Any, dict[str, CheckpointManager]] = weakref.WeakKeyDictionary()
_MANAGERS_LOCK = threading.Lock()
_UNSUPPORTED = {DistributedType.MEGATRON_LM: "Megatron-LM", DistributedType.XLA: "torch_xla"}


_RETENTION = ("keep_last", "keep_best", "best_metric", "best_mode", "keep_every")


def checkpoint_manager(accelerator: Any, root: str | os.PathLike[str] | Storage | CheckpointManager,
                       **options: Any) -> CheckpointManager:
    """The ``CheckpointManager`` this accelerator uses for ``root``, created on first use
    with ``options`` (a manager passed as ``root`` is used as it is). Later calls may
    change the retention options (``keep_last``, ``keep_best``, ``best_metric``,
    ``best_mode``, ``keep_every``), so ``load_state(acc, root)`` followed by
    ``save_state(acc, root, step, keep_last=3)`` keeps 3; other options only apply
    when the manager is created."""
    if isinstance(root, CheckpointManager):
        return root
    if isinstance(root, Storage):
        key = root.url
    else:
        text = os.fspath(root)
        key = text if is_remote(text) else os.path.abspath(text)
    with _MANAGERS_LOCK:  # two threads asking at once get one manager, not two writers of one root
        managers = _MANAGERS.setdefault(accelerator, {})
        mgr = managers.get(key)
        if mgr is None or mgr.closed:
            # open_storage (in CheckpointManager) takes a PathLike too; its annotation says str
            mgr = managers[key] = CheckpointManager(cast("str | Storage", root), **options)
            return mgr
    retention = {k: v for k, v in options.items() if k in _RETENTION}
    if retention:
        current = {k: getattr(mgr.retention, k) for k in _RETENTION}
        if any(current[k] != v for k, v in retention.items()):
            mgr.retention = Retention(**{**current, **retention})
    others = sorted(k for k in options if k not in _RETENTION)
    if others:
        warn(f"options {others} ignored: this accelerator already has a checkpoint manager "
             f"for {key} (they apply when it is created)", SafeckptWarning)
    return mgr


def rng_states() -> dict:
    """This process's Python, NumPy and torch (CPU, and CUDA where present) generator
    states; reading them does not advance any generator."""
    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict) -> None:
    """Inverse of ``rng_states``."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        if len(states["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states["cuda"])
        else:
            warn(f"the checkpoint holds CUDA RNG states for {len(states['cuda'])} devices, this "
                 f"process sees {torch.cuda.device_count()}; CUDA RNG states not restored", PartialLoadWarning)


def _check(accelerator: Any) -> None:
    kind = _UNSUPPORTED.get(accelerator.distributed_type)
    if kind is not None:
        raise NotImplementedError(
            f"safeckpt.integrations.accelerate does not support {kind} yet (the engine writes its own "
            "checkpoints); use accelerator.save_state for it")


def _unwrap(accelerator: Any, model: Any) -> Any:
    try:
        return accelerator.unwrap_model(model, keep_torch_compile=False)
    except TypeError:  # older accelerate
        return accelerator.unwrap_model(model)


def _state(accelerator: Any, rng: Any) -> dict:
    sharded = [m for m in accelerator._models if is_fsdp(m)]

    def optimizer(opt: Any) -> Any:
        model = owner(sharded, opt) if sharded else None
        return opt if model is None else ShardedOptimizer(model, opt)

    state = {
        "models": [ShardedModel(m) if is_fsdp(m) else _unwrap(accelerator, m) for m in accelerator._models],
        "optimizers": [optimizer(o) for o in accelerator._optimizers],
        "schedulers": list(accelerator._schedulers),
        "custom_objects": list(accelerator._custom_objects),
        "dataloaders": [dl for dl in accelerator._dataloaders if getattr(dl, "use_stateful_dataloader", False)],
        "step": accelerator.step,
        "rng": rng,
    }
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    return state


def save_state(accelerator: Any, root: str | os.PathLike[str] | Storage | CheckpointManager, step: int, *,
               metrics: dict | None = None, metadata: dict | None = None, layout: str | None = None,
               **manager_options: Any) -> CheckpointInfo | SaveFuture:
    """Save everything the accelerator tracks as the checkpoint of ``step`` under
    ``root``; retention (``keep_last=`` ...) runs after the commit. Call it on every
    process. ``layout="accelerate"``: ``accelerator.save_state`` writes the step folder
    (``root`` must be a folder every process sees), then it is sealed; returns the
    seal's ``CheckpointInfo``. ``layout="safeckpt"``: returns what
    ``CheckpointManager.save`` returns. By default, ``"accelerate"`` for a local folder
    and ``"safeckpt"`` for other URLs (``s3://...``) and managers with a local tier,
    where ``accelerator.save_state`` cannot write."""
    _check(accelerator)
    if layout not in (None, *LAYOUTS):
        raise ValueError(f"layout must be one of {LAYOUTS} (or None), not {layout!r}")
    mgr = checkpoint_manager(accelerator, root, **manager_options)
    if layout is None:
        layout = "accelerate" if _writable_folder(mgr) else "safeckpt"
    meta = {"integration": "accelerate", "accelerate_version": accelerate.__version__, "layout": layout,
            **(metadata or {})}
    if layout == "accelerate":
        return _save_files(accelerator, mgr, step, metrics, meta)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return _save_deepspeed(accelerator, mgr, step, metrics, meta)
    return mgr.save(step, _state(accelerator, RankLocal(rng_states())), metrics=metrics, metadata=meta)


def load_state(accelerator: Any, root: str | os.PathLike[str] | Storage | CheckpointManager,
               step: int | None = None, *, strict: bool = True, **manager_options: Any) -> int | None:
    """Restore the newest valid checkpoint under ``root`` (or ``step``) into everything
    the accelerator tracks, RNG states and ``accelerator.step`` included. Returns the
    step restored, or None when ``root`` holds no checkpoint (nothing is changed). Torn
    or corrupt newer checkpoints are skipped with a warning. Call it on every process,
    after ``accelerator.prepare`` and ``register_for_checkpointing``. Sealed folders of
    Accelerate's own files are loaded by ``accelerator.load_state`` once every byte
    matched its seal (``strict`` applies to the safeckpt layout)."""
    _check(accelerator)
    mgr = checkpoint_manager(accelerator, root, **manager_options)
    if _on_main(mgr, lambda: _newest_layout(mgr.save_root)) == "accelerate":
        return _restore_files(accelerator, mgr, step)
    rng = RankLocal(None)
    state = _state(accelerator, rng)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        restored = _restore_deepspeed(accelerator, mgr, state, step, strict)
    else:
        restored = mgr.restore(state, step, strict=strict)
    if restored is None:
        return None
    accelerator.step = state["step"]
    if rng.value is not None:
        set_rng_states(rng.value)
    else:
        warn(f"step {restored} under {mgr.storage.url}: RNG states not restored (saved by "
             "another number of processes?); reproducibility is not guaranteed", PartialLoadWarning)
    return restored


# -- Accelerate's own files, sealed --------------------------------------------------------

def _on_main(mgr: CheckpointManager, fn: Any) -> Any:
    """Run ``fn`` on the main process and give every process its result (or its error)."""
    group = mgr.group
    result: Any = None
    if group.rank == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - raised on every process below
            result = exc
    result = group.broadcast(result) if group.size > 1 else result
    if isinstance(result, Exception):
        raise result
    return result


def _newest_layout(root: Storage) -> str:
    """The layout of the newest committed checkpoint under ``root`` (the default when
    there is none)."""
    for step in reversed(step_folders(root)):
        m = folder_state(root.child(step_folder(step))).manifest
        if m is not None:
            return str(m.metadata.get("layout", "safeckpt"))
    return "accelerate"


def _writable_folder(mgr: CheckpointManager) -> bool:
    """Whether ``accelerator.save_state`` can write the manager's step folders: a local
    (or mounted) root without a local tier."""
    return isinstance(mgr.save_root, LocalStorage) and mgr.local is None


def _folder(mgr: CheckpointManager, step: int) -> str:
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    if not _writable_folder(mgr):
        raise ValueError(f"save_state(layout='accelerate') writes with accelerator.save_state, which needs a "
                         f"folder every process sees, not {mgr.save_root.url} (or a local tier); use "
                         "layout='safeckpt' for object stores and other URLs")
    return os.path.join(cast(LocalStorage, mgr.save_root).path, step_folder(step))


def _clear(mgr: CheckpointManager, step: int, path: str) -> None:
    """Before writing ``path``: a folder there is removed (manifest first), unless it is a
    committed checkpoint of another run (as ``CheckpointManager.save`` refuses to
    replace one)."""
    found = folder_state(mgr.save_root.child(step_folder(step)))
    if found.state is CheckpointState.COMMITTED and found.manifest is not None \
            and found.manifest.run_id != mgr.run_id:
        raise CheckpointExistsError(
            f"{path} holds a committed checkpoint of another run; load_state() it to continue that run, "
            "or save to another root")
    remove_folder(path)


def _save_files(accelerator: Any, mgr: CheckpointManager, step: int, metrics: dict | None,
                meta: dict) -> CheckpointInfo:
    path = _folder(mgr, step)
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("save_state(layout='accelerate') names the folder from root and step; turn off "
                         "ProjectConfiguration(automatic_checkpoint_naming=True), which writes elsewhere and "
                         "deletes old checkpoints before the new one is written")
    _on_main(mgr, lambda: _clear(mgr, step, path))
    accelerator.save_state(path)
    mgr.group.all_gather(None)  # every process has written its files

    def commit() -> CheckpointInfo:
        info = seal(path, step=step, metrics=metrics, metadata=meta, run_id=mgr.run_id, world_size=mgr.group.size)
        mgr.retain(step)
        return info
    return _on_main(mgr, commit)


def _restore_files(accelerator: Any, mgr: CheckpointManager, step: int | None) -> int | None:
    def pick() -> tuple[int, str, str | None] | None:
        root = mgr.save_root
        steps = [s for s in step_folders(root) if step in (None, s)]
        path = newest_intact((root.child(step_folder(s)).url for s in reversed(steps)),
                                     who=f"load_state({root.url})")
        if path is None:
            return None
        m = folder_state(root.child(os.path.basename(path))).manifest
        assert m is not None and m.step is not None  # sealed, with its step
        return m.step, path, m.run_id
    found = _on_main(mgr, pick)
    if found is None:
        if step is not None:
            raise CheckpointNotFoundError(f"no sealed, intact checkpoint of step {step} under {mgr.storage.url}")
        return None
    restored, path, run_id = found
    accelerator.load_state(path)
    mgr.run_id = run_id or mgr.run_id  # continue the run it belongs to
    return int(restored)


# -- DeepSpeed ---------------------------------------------------------------------------
# Each prepared DeepSpeed engine writes its own checkpoint (model, optimizer, its
# scheduler) as a tag of the step folder, named as Accelerate names it, through
# safeckpt's checkpoint engine (committed on its own); then the manager commits the
# rest (RNG states, step, other schedulers, custom objects, dataloaders) in the same
# folder, and a seal covers both in one manifest. Restoring loads the engines' tags
# (verified) and then the rest, falling back to older steps past a corrupt one.

def _engines(accelerator: Any) -> list[tuple[str, Any]]:
    from accelerate.utils.constants import MODEL_NAME
    from .deepspeed import install
    return [(MODEL_NAME if i == 0 else f"{MODEL_NAME}_{i}", install(m)) for i, m in enumerate(accelerator._models)]


def _deepspeed_state(accelerator: Any, state: dict) -> dict:
    from accelerate.utils import DeepSpeedSchedulerWrapper
    rest = {k: v for k, v in state.items() if k not in ("models", "optimizers")}
    rest["schedulers"] = [s for s in state["schedulers"] if not isinstance(s, DeepSpeedSchedulerWrapper)]
    return rest


def _save_deepspeed(accelerator: Any, mgr: CheckpointManager, step: int, metrics: dict | None,
                    meta: dict) -> CheckpointInfo:
    from ..format.names import step_folder
    from ..interop.sealing import seal
    folder = mgr.save_root.child(step_folder(step))
    for tag, engine in _engines(accelerator):
        engine.save_checkpoint(folder.url, tag, save_latest=False)
    info = mgr.save(step, _deepspeed_state(accelerator, _state(accelerator, RankLocal(rng_states()))),
                    metrics=metrics, metadata=meta)
    if isinstance(info, SaveFuture):
        info = info.result()
    if mgr.group.rank == 0:
        seal(folder)  # one manifest over the engines' tags and the rest
    mgr.group.all_gather(None)
    return info


def _restore_deepspeed(accelerator: Any, mgr: CheckpointManager, state: dict, step: int | None,
                       strict: bool) -> int | None:
    from ..errors import CorruptCheckpointError
    steps = mgr.steps() if step is None else [step]
    skipped = []
    for s in reversed(steps):
        try:
            for tag, engine in _engines(accelerator):
                engine.load_checkpoint(mgr.path(s), tag)
            return mgr.restore(_deepspeed_state(accelerator, state), s, strict=strict)
        except CorruptCheckpointError as exc:
            if step is not None:
                raise
            skipped.append(f"step {s}: {exc}")
            warn(f"restore: skipping step {s} under {mgr.storage.url}: {exc}", SkippedCheckpointWarning)
    if skipped:
        raise CorruptCheckpointError(f"no checkpoint under {mgr.storage.url} could be restored:\n  "
                                     + "\n  ".join(skipped))
    return None
