"""Crash-safe checkpoints for the Hugging Face ``Trainer``: its own files, sealed.

The ``Trainer`` writes ``output_dir/checkpoint-N`` file by file with no commit marker,
so a kill mid-save leaves a folder that looks like a checkpoint. Both ways in keep every
file the Trainer writes (``model.safetensors``, ``config.json``, ``optimizer.pt``,
``scheduler.pt``, ``rng_state*.pth``, ``trainer_state.json``, tokenizer files, DeepSpeed
and FSDP shards), written where the Trainer writes them, and seal the folder once every
process has finished (``safeckpt.seal``: a checksum of every file and a manifest,
written last by the main process). ``from_pretrained("out/checkpoint-500")``, the Hub
upload and scripts that read those files keep working.

``SafeCheckpointCallback`` (public callback API only, so it survives Trainer versions)::

    trainer = Trainer(..., callbacks=[SafeCheckpointCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

``SafeTrainer`` (or ``SafeTrainerMixin`` on your own ``Trainer`` subclass) does the same
and also guards resuming: ``train(resume_from_checkpoint=True)`` takes the newest sealed,
intact checkpoint, a named one must match its seal, and ``load_best_model_at_end`` loads
only a sealed one. ``SafeTrainer(..., checkpoint_layout="safeckpt")`` writes the
optimizer, scheduler, scaler, RNG states and trainer state through safeckpt itself (no
torch pickles; FSDP shards that load on another number of processes) next to the
Trainer's model files, under the same seal. It overrides private ``Trainer`` methods,
so it checks the transformers version and refuses unsupported ones.

Rotation (``save_total_limit``) keeps what the Trainer keeps, counting sealed
checkpoints only, after the new one is sealed, never deleting the newest sealed one or
the best one, manifest first. ``last_checkpoint(output_dir)`` is the newest sealed
``checkpoint-N`` whose every byte matches its checksums;
``transformers.trainer_utils.get_last_checkpoint`` picks the highest number even when
that save never finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

try:
    import transformers
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("safeckpt.integrations.transformers needs transformers: "
                      "pip install 'safeckpt[hf]'") from exc
from packaging.version import Version

from ..errors import CleanupWarning, PartialLoadWarning, SafeckptWarning, SkippedCheckpointWarning, warn
from ..format import codec
from ..protocol.checkpoint import load as safeckpt_load
from ..protocol.checkpoint import save
from ..format.manifest import Manifest
from ..interop.sealing import seal
from ..protocol.shards import RankLocal
from ._sealed import (barrier, check_named, newest_intact, remove_folder, seal_of, seal_problem, sealed_or_why,
                      unseal)
from ._fsdp import ShardedModel, ShardedOptimizer, is_fsdp

__all__ = [
    "LAYOUTS",
    "SUPPORTED_TRANSFORMERS",
    "SafeCheckpointCallback",
    "SafeTrainer",
    "SafeTrainerMixin",
    "check_transformers_version",
    "last_checkpoint",
]

log = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.bin"
CHECKPOINT_RE = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-([0-9]+)")
#: transformers versions whose private Trainer methods SafeTrainer overrides (tested: 5.24)
SUPPORTED_TRANSFORMERS = (Version("5.0"), Version("6.0"))
#: ``checkpoint_layout`` values: the Trainer's own files, sealed (the default), or
#: safeckpt's data file for everything but the model files
LAYOUTS = ("trainer", "safeckpt")
_KIND = "transformers.SafeTrainer"
_PER_RANK_FIELDS = ("is_local_process_zero", "is_world_process_zero")
_FROM_ARGS: Any = object()


# -- finding checkpoints ---------------------------------------------------------------

def _checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` folder, oldest first."""
    try:
        names = os.listdir(output_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        m = CHECKPOINT_RE.fullmatch(name)
        path = os.path.join(os.fspath(output_dir), name)
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def _committed(path: str) -> Manifest | str:
    """The seal of a Trainer checkpoint, or why it has none. It must also cover
    ``trainer_state.json`` (``Trainer.train`` reads it; the safeckpt layout commits its
    tensors before the seal covers the rest)."""
    return sealed_or_why(path, (TRAINER_STATE_NAME,))


def checkpoint_problem(path: str, *, full: bool = True) -> str | None:
    """None when ``path`` is a sealed Trainer checkpoint whose every byte matches its
    checksums (``full=False``: only the manifest and file sizes are checked), else why
    it is not."""
    return seal_problem(path, (TRAINER_STATE_NAME,), full=full)


def last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` that is sealed and intact (every
    checksum verified), for ``trainer.train(resume_from_checkpoint=...)``.

    Newer folders that are incomplete (a save killed before its seal) or corrupt are
    skipped with a warning naming each. None when there is no such checkpoint, or the
    folder is empty or missing."""
    return newest_intact((path for _, path in reversed(_checkpoints(output_dir))),
                                 (TRAINER_STATE_NAME,), who="last_checkpoint")


# -- rotation --------------------------------------------------------------------------

def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def rotate(output_dir: str, limit: int | None, *, best: str | None, just_saved: str | None) -> list[str]:
    """The Trainer's ``save_total_limit`` rule over sealed checkpoints: keep
    ``max(limit, protected)`` of them, where the newest sealed one, the best one and
    the one just saved are protected, and delete the oldest others, manifest first.
    Folders that are not sealed are neither counted nor touched. Returns the deleted
    paths."""
    if limit is None or limit <= 0:
        return []
    sealed = [path for _, path in _checkpoints(output_dir) if not isinstance(_committed(path), str)]
    if not sealed:
        return []
    protected = [p for p in sealed if any(_same(p, k) for k in (sealed[-1], best, just_saved))]
    remaining = len(sealed)
    deleted = []
    for path in sealed:
        if remaining <= max(limit, len(protected)):
            break
        if path in protected:
            continue
        try:
            remove_folder(path)
        except OSError as exc:
            warn(f"could not delete old checkpoint {path}: {exc}", CleanupWarning)
            continue
        log.info("deleted %s (save_total_limit=%s)", path, limit)
        deleted.append(path)
        remaining -= 1
    return deleted


def _seal(path: str, step: int, sealed_by: str) -> None:
    info = seal(path, step=step, metadata={"sealed_by": f"safeckpt.integrations.transformers.{sealed_by}",
                                           "transformers_version": transformers.__version__})
    log.info("sealed %s (%d files, %d bytes, %.3fs)", path, len(info.files), info.bytes, info.seconds)


def _may_save(args: Any, control: Any) -> bool:
    """Whether the Trainer may save at the end of this step or epoch: it is going to, or
    with ``save_strategy="best"`` it evaluates first and decides after. (A window opened
    for any evaluation would stay open when nothing saves, hiding ``save_total_limit``
    from the Trainer's last rotation at the end of training.)"""
    return bool(control.should_save or (args.save_strategy == SaveStrategy.BEST and control.should_evaluate))


def _new_best(args: Any, state: Any, metrics: dict | None) -> bool:
    """Whether this evaluation is a new best by the Trainer's rule
    (``metric_for_best_model``, ``greater_is_better``), the one moment
    ``save_strategy="best"`` saves. Read in ``on_evaluate``, before the Trainer updates
    ``state.best_metric``."""
    name = args.metric_for_best_model
    if name is None:
        return False
    value = (metrics or {}).get(name if name.startswith("eval_") else f"eval_{name}")
    if value is None:
        return False  # another evaluation dataset's metric, or the Trainer raises KeyError
    best = state.best_metric
    if best is None:
        best = float("-inf") if args.greater_is_better else float("inf")
    return bool(value > best if args.greater_is_better else value < best)


@contextlib.contextmanager
def _trainer_rotation_off(args: Any) -> Iterator[None]:
    """The Trainer's own rotation deletes old checkpoints before the new one is sealed
    (and counts unsealed folders); the integration rotates after the seal instead."""
    limit, args.save_total_limit = args.save_total_limit, None
    try:
        yield
    finally:
        args.save_total_limit = limit


# -- the callback ----------------------------------------------------------------------

class SafeCheckpointCallback(TrainerCallback):
    """Seal every ``checkpoint-N`` the Trainer writes and rotate safely.

    At the end of a step or epoch that may save, the Trainer's own rotation is switched
    off until the save is sealed (``args.save_total_limit`` reads None only in that
    window). A folder an older run left at that step is deleted (manifest first) only
    once the Trainer is going to write it: at once when it does not evaluate first, else
    in the first ``on_evaluate`` that decides a save (``control.should_save``, or with
    ``save_strategy="best"`` a new best by the Trainer's rule), so a checkpoint the
    resumed run does not replace is kept, as the stock Trainer keeps it. In ``on_save`` (synchronously: callbacks listed before
    this one have run) every process has finished, the main process seals the folder,
    then deletes sealed checkpoints beyond ``save_total_limit`` as the Trainer would,
    manifest first, never the newest sealed one nor ``state.best_model_checkpoint``.
    ``save_total_limit`` defaults to the TrainingArguments' value."""

    def __init__(self, save_total_limit: int | None = _FROM_ARGS) -> None:
        self.save_total_limit = save_total_limit
        self._window: contextlib.ExitStack | None = None
        self._pending = False  # in a window: an older run's folder at this step not yet dealt with
        self._older: str | None = None  # the save id of the seal an older run left at this step

    def _close_window(self) -> None:
        if self._window is not None:
            self._window.close()
            self._window = None
        self._pending = False

    def _before_save(self, args: Any, state: Any, control: Any) -> None:
        self._close_window()  # a window that ended without a save
        self._older = _seal_id(_folder(args, state)) if args.should_save else None
        if not _may_save(args, control):
            return
        self._open_window(args)
        if not control.should_evaluate:  # nothing comes between this and the save
            self._clear(args, state)

    def _open_window(self, args: Any) -> None:
        """Switch the Trainer's rotation off until the save of this step is sealed."""
        self._window = contextlib.ExitStack()
        self._window.enter_context(_trainer_rotation_off(args))
        self._pending = True

    def _clear(self, args: Any, state: Any) -> None:
        """The Trainer is going to save this step: delete the folder an older run left
        there (manifest first) before any process writes into it."""
        self._pending = False
        if args.should_save:
            remove_folder(_folder(args, state))
        barrier()  # no process writes into the folder while it is being removed

    def on_step_end(self, args, state, control, **kwargs):
        self._before_save(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._before_save(args, state, control)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        # once per evaluation dataset, each with its own metrics (the same on every process)
        if self._window is None and control.should_save:
            self._open_window(args)  # a callback listed before this one decided a save in its on_evaluate
        if not self._pending:
            return
        if _new_best(args, state, metrics) if args.save_strategy == SaveStrategy.BEST else control.should_save:
            self._clear(args, state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._close_window()

    def on_train_end(self, args, state, control, **kwargs):
        self._close_window()

    def on_save(self, args, state, control, **kwargs):
        self._close_window()
        barrier()  # every process has written its files
        if not args.should_save:
            return
        path = _folder(args, state)
        if not os.path.isdir(path):
            warn(f"SafeCheckpointCallback: the Trainer saved, but {path} does not exist "
                 "(hyperparameter search runs are not supported); nothing sealed", SafeckptWarning)
            return
        found = _seal_id(path)
        if found is not None and found == self._older:  # written over a checkpoint not expected to be saved
            unseal(path)
            warn(f"SafeCheckpointCallback: the Trainer saved {path} into the sealed checkpoint an older run "
                 "left there, which SafeCheckpointCallback did not expect to be written (a callback listed after "
                 "it changed control.should_save, or a Trainer with its own rule for the best checkpoint). Its "
                 "files may mix both saves, so it is not sealed and nothing resumes from it. List "
                 "SafeCheckpointCallback after callbacks that change control.should_save, or use SafeTrainer.",
                 SafeckptWarning)
            return
        _seal(path, state.global_step, "SafeCheckpointCallback")
        limit = args.save_total_limit if self.save_total_limit is _FROM_ARGS else self.save_total_limit
        rotate(args.output_dir, limit, best=state.best_model_checkpoint, just_saved=path)


def _folder(args: Any, state: Any) -> str:
    """The ``checkpoint-N`` the Trainer saves at this step."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def _seal_id(path: str) -> str | None:
    """The save id of the seal of ``path``; None when it has none (or does not exist)."""
    m = seal_of(path) if os.path.isdir(path) else None
    return m.save_id if m is not None else None


# -- SafeTrainer -----------------------------------------------------------------------

def check_transformers_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` unless ``version`` (default: the installed transformers) is
    one whose Trainer internals ``SafeTrainer`` was written for."""
    found = Version(version if version is not None else transformers.__version__)
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= Version(found.base_version) < high:
        raise RuntimeError(
            f"safeckpt's SafeTrainer supports transformers >={low},<{high}, but transformers "
            f"{found} is installed. SafeTrainer overrides private Trainer methods whose behaviour "
            f"changes between versions, so it refuses to run rather than save or resume wrongly. "
            f"Install a supported version (pip install 'transformers>={low},<{high}'), or use "
            "SafeCheckpointCallback, which needs only the public callback API and works with any version.")


def rng_states() -> dict:
    """Python, NumPy and torch (CPU, and CUDA where present) generator states."""
    out = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    return out


def set_rng_states(states: dict) -> None:
    """Inverse of ``rng_states``."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            warn(f"the checkpoint holds CUDA RNG states for {len(cuda)} devices, this process "
                 f"sees {torch.cuda.device_count()}; CUDA RNG states not restored", PartialLoadWarning)


def load_keys(state: dict, path: str, *, process_group: Any = None) -> None:
    """Load the top-level keys of ``state`` from the checkpoint at ``path``, strictly
    within each key, leaving the checkpoint's other keys unread (the Trainer restores
    model, optimizer and RNG at three different moments)."""
    safeckpt_load(state, path, keys=list(state), process_group=process_group)


def _safe_manifest(path: str | None) -> Manifest | None:
    """The seal of a checkpoint written in the safeckpt layout; None for any other
    (the Trainer's own files), which the Trainer's own code then loads."""
    m = seal_of(path) if path is not None and os.path.isdir(path) else None
    return m if m is not None and m.metadata.get("integration") == _KIND else None


if TYPE_CHECKING:  # what the mixin is mixed into: the Trainer's attributes and methods
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class SafeTrainerMixin(_TrainerBase):
    """Put before ``Trainer`` (or your subclass of it) in the bases:
    ``class MyTrainer(SafeTrainerMixin, MyBaseTrainer)``.

    ``checkpoint_layout="trainer"`` (the default): every ``checkpoint-N`` holds the
    Trainer's own files, written by the Trainer where it writes them, sealed once every
    process has finished (DeepSpeed and FSDP shards included); Hub pushes of
    checkpoints start after the seal. ``checkpoint_layout="safeckpt"``: the model files
    are the Trainer's (``model.safetensors`` and ``config.json``: ``from_pretrained``
    loads the folder), everything else (optimizer, scheduler, scaler, per-process RNG
    states, trainer state) is one safeckpt data file, no torch pickle; with FSDP the
    model and optimizer are saved as their sharded state dicts and load on another
    number of processes; with DeepSpeed the engine writes its own files through
    safeckpt's checkpoint engine (``safeckpt.integrations.deepspeed``). Either way the
    whole folder is one seal, and ``train(resume_from_checkpoint=True)`` resumes from
    ``last_checkpoint(output_dir)``. XLA and SageMaker MP are refused."""

    def __init__(self, *args: Any, checkpoint_layout: str = "trainer", **kwargs: Any) -> None:
        check_transformers_version()
        if checkpoint_layout not in LAYOUTS:
            raise ValueError(f"checkpoint_layout must be one of {LAYOUTS}, not {checkpoint_layout!r}")
        super().__init__(*args, **kwargs)
        self.checkpoint_layout = checkpoint_layout
        self._safeckpt_pushes: list[str] | None = None  # Hub pushes held back until the seal
        unsupported = [name for name, on in (
            ("torch_xla", _xla()), ("SageMaker model parallel", _sagemaker_mp())) if on]
        if unsupported:
            raise NotImplementedError(
                f"SafeTrainer does not support {', '.join(unsupported)} yet (their checkpoints are written "
                "by the engine itself); use a plain Trainer with SafeCheckpointCallback to seal them")
        if checkpoint_layout == "safeckpt":
            if self.args.push_to_hub:
                warn("SafeTrainer(checkpoint_layout='safeckpt') does not push intermediate checkpoints to the "
                     "Hub; trainer.push_to_hub() / save_model() still do", SafeckptWarning)
            if getattr(self, "is_deepspeed_enabled", False):
                from .deepspeed import install_on_prepare
                install_on_prepare(self.accelerator)

    # -- saving --------------------------------------------------------------------------
    def _safeckpt_model(self, model: Any = None) -> Any:
        """The model as saved and loaded: an FSDP model as its sharded state dict."""
        model = self.model if model is None else model
        return ShardedModel(model) if is_fsdp(model) else model

    def _safeckpt_optimizer(self) -> Any:
        return ShardedOptimizer(self.model, self.optimizer) if is_fsdp(self.model) else self.optimizer

    def _safeckpt_state(self) -> dict:
        state: dict = {"model": self._safeckpt_model()} if is_fsdp(self.model) else {}
        if not self.args.save_only_model:
            state["optimizer"] = self._safeckpt_optimizer()
            state["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            rng = rng_states()
            state["rng"] = RankLocal(rng) if self.args.world_size > 1 else rng
        trainer_state = dataclasses.asdict(self.state)
        for name in _PER_RANK_FIELDS:
            trainer_state.pop(name, None)
        # per process: its log history holds timings (eval_runtime...) that differ by rank
        state["trainer_state"] = RankLocal(trainer_state) if self.args.world_size > 1 else trainer_state
        return state

    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """Write ``checkpoint-N`` (a folder an older run left there is deleted first,
        manifest first), seal it once every process has written its files, then rotate
        and push."""
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            remove_folder(output_dir)
        barrier()
        self._safeckpt_pushes = []
        try:
            with _trainer_rotation_off(self.args):
                if self.checkpoint_layout == "safeckpt" and not getattr(self, "is_deepspeed_enabled", False):
                    self._safeckpt_write(trial, run_dir, output_dir)
                else:
                    super()._save_checkpoint(model, trial, *args, **kwargs)
            barrier()  # every process has written its files
            if self.args.should_save:
                _seal(output_dir, self.state.global_step, f"SafeTrainer ({self.checkpoint_layout} layout)")
                rotate(run_dir, self.args.save_total_limit, best=self.state.best_model_checkpoint,
                       just_saved=output_dir)
            pushes = self._safeckpt_pushes
        finally:
            self._safeckpt_pushes = None
        for folder in pushes:
            super()._push_from_checkpoint(folder)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._safeckpt_pushes is not None:  # inside a save: pushed once sealed
            self._safeckpt_pushes.append(checkpoint_folder)
            return
        super()._push_from_checkpoint(checkpoint_folder)

    def _safeckpt_write(self, trial: Any, run_dir: str, output_dir: str) -> None:
        """The safeckpt layout: the Trainer's model files (``save_model``; an FSDP model
        is saved as its shards instead), then one safeckpt checkpoint of the rest,
        committed over every process."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self._safeckpt_track_best(run_dir, output_dir)
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            callbacks = cast(dict, self.state.stateful_callbacks)  # annotated a list; TrainerState makes a dict
            if isinstance(callbacks[name], list):
                callbacks[name].append(cb.state())
            else:
                callbacks[name] = cb.state()
        if not is_fsdp(self.model):  # (an FSDP model goes into the data file as its shards)
            self.save_model(output_dir, _internal_call=True)
        state = self._safeckpt_state()
        if self.args.should_save:
            with contextlib.suppress(FileNotFoundError):  # a pickle of the arguments, which nothing reads back
                os.remove(os.path.join(output_dir, TRAINING_ARGS_NAME))
            os.makedirs(output_dir, exist_ok=True)
            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
        save(state, output_dir, overwrite=True, step=self.state.global_step,
             metadata={"integration": _KIND, "transformers_version": transformers.__version__})

    def _safeckpt_track_best(self, run_dir: str, output_dir: str) -> None:
        """As ``Trainer._save_checkpoint``: point ``best_model_checkpoint`` at the best
        step's folder when it exists (or is the one being written)."""
        best_step = getattr(self.state, "best_global_step", None)
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and best_step:
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            if best_dir == output_dir or os.path.exists(best_dir):
                self.state.best_model_checkpoint = best_dir

    # -- resuming ------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``resume_from_checkpoint=True`` means ``last_checkpoint(output_dir)``; a named
        folder must match its seal (``check_named``)."""
        if resume_from_checkpoint is True:
            assert self.args.output_dir is not None  # TrainingArguments fills in a default
            resume_from_checkpoint = last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir}): "
                                 "no checkpoint-N there is sealed with every file matching its checksums")
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)) and os.path.isdir(resume_from_checkpoint):
            check_named(os.fspath(resume_from_checkpoint), (TRAINER_STATE_NAME,))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        m = _safe_manifest(resume_from_checkpoint)
        if m is None or "model" not in m.tree:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_keys({"model": self._safeckpt_model(model)}, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        m = _safe_manifest(checkpoint)
        if m is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        assert checkpoint is not None  # a manifest was found there
        targets = {"optimizer": self._safeckpt_optimizer() if self.optimizer is not None else None,
                   "scheduler": self.lr_scheduler,
                   "scaler": getattr(self.accelerator, "scaler", None)}
        parts = {k: v for k, v in targets.items() if v is not None and k in m.tree}
        if parts:
            load_keys(parts, checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        m = _safe_manifest(checkpoint)
        if m is None:
            return super()._load_rng_state(checkpoint)
        assert checkpoint is not None  # a manifest was found there
        if "rng" not in m.tree:
            log.info("%s holds no RNG state (save_only_model?); reproducibility is not guaranteed", checkpoint)
            return
        saved = m.tree["rng"]
        world = self.args.world_size
        if codec.tag_of(saved) == "$local":
            ranks = len(saved["$local"])
            if ranks != world:
                warn(f"{checkpoint} holds RNG states of {ranks} processes, this run has {world}; "
                     "RNG states not restored, reproducibility is not guaranteed", PartialLoadWarning)
                return
            holder: dict = {"rng": RankLocal(None)}
            load_keys(holder, checkpoint)
            set_rng_states(holder["rng"].value)
            return
        if world > 1:
            warn(f"{checkpoint} was saved by one process, this run has {world}; "
                 "RNG states not restored, reproducibility is not guaranteed", PartialLoadWarning)
            return
        holder = {"rng": None}
        load_keys(holder, checkpoint)
        set_rng_states(holder["rng"])

    def _load_best_model(self) -> None:
        """Only a sealed, intact best checkpoint is loaded; otherwise the model stays as
        trained, with a warning (as the Trainer does when the files are missing)."""
        best = self.state.best_model_checkpoint
        assert best is not None  # the Trainer calls this only when it is set
        why = checkpoint_problem(best)
        if why is not None:
            warn(f"load_best_model_at_end: not loading {best}: {why}; the model stays as trained",
                 SkippedCheckpointWarning)
            return
        m = _safe_manifest(best)
        if m is None or "model" not in m.tree:
            return super()._load_best_model()
        log.info("loading best model from %s (score: %s)", best, self.state.best_metric)
        load_keys({"model": self._safeckpt_model()}, best)


def _xla() -> bool:
    from transformers.utils import is_torch_xla_available
    return bool(is_torch_xla_available())


def _sagemaker_mp() -> bool:
    from transformers.utils import is_sagemaker_mp_enabled
    return bool(is_sagemaker_mp_enabled())


class SafeTrainer(SafeTrainerMixin, Trainer):
    """A ``transformers.Trainer`` whose checkpoints are sealed and resumed safely
    (see ``SafeTrainerMixin``; ``checkpoint_layout="safeckpt"`` for no pickles)."""
