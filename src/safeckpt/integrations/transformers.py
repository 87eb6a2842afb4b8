"""Crash-safe checkpoints for the Hugging Face ``Trainer``.

Two ways in, both keeping the Trainer's ``output_dir/checkpoint-N`` layout:

``SafeCheckpointCallback`` (public callback API only, so it survives Trainer
versions): after the Trainer writes ``checkpoint-N`` it *seals* the folder
(``safeckpt.seal``: a checksum of every file and a manifest, written last), and it
takes rotation over from the Trainer, whose own rotation deletes with ``rmtree``
before the new checkpoint is complete::

    trainer = Trainer(..., callbacks=[SafeCheckpointCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

``SafeTrainer`` (or ``SafeTrainerMixin`` on your own ``Trainer`` subclass) writes the
model, optimizer, scheduler, scaler, RNG states and trainer state through safeckpt
itself (no torch pickles) and resumes from them. It overrides private ``Trainer``
methods, so it checks the transformers version and refuses unsupported ones.

``last_checkpoint(output_dir)`` is the newest ``checkpoint-N`` that is sealed and
whose every byte matches its checksums; ``transformers.trainer_utils.
get_last_checkpoint`` picks the highest number even when that save never finished.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import shutil
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
from ..protocol.checkpoint import save, verify
from ..format.folder import CheckpointState, folder_state, read_committed, retire
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from ..format.manifest import Manifest, manifest_seq
from ..protocol.reader import TensorReader
from ..interop.sealing import seal
from ..protocol.shards import RankLocal
from ..storage import open as open_storage
from ._fsdp import ShardedModel, ShardedOptimizer, is_fsdp

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "SafeCheckpointCallback",
    "SafeTrainer",
    "SafeTrainerMixin",
    "check_transformers_version",
    "last_checkpoint",
]

log = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_RE = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-([0-9]+)")
#: transformers versions whose private Trainer methods SafeTrainer overrides (tested: 5.24)
SUPPORTED_TRANSFORMERS = (Version("5.0"), Version("6.0"))
_KIND = "transformers.SafeTrainer"
_LIMIT_ATTR = "_safeckpt_save_total_limit"  # the user's save_total_limit, kept on the args
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
    """The manifest of a sealed Trainer checkpoint, or why it is not one. Sealed means a
    valid manifest that also covers ``trainer_state.json`` (``Trainer.train`` reads it)."""
    found = folder_state(open_storage(path))
    if found.state is CheckpointState.NEWER_FORMAT:
        raise UnsupportedFormatError(found.problem)  # never passed over for an older checkpoint
    if found.manifest is None:
        if found.state is CheckpointState.CORRUPT:
            return f"damaged: {found.problem}"
        return ("not sealed: it has no safeckpt manifest (a save that never finished, or one "
                "written without SafeCheckpointCallback / SafeTrainer)")
    if TRAINER_STATE_NAME not in found.manifest.files:
        return (f"not sealed: its manifest does not cover {TRAINER_STATE_NAME} (a save "
                "interrupted before its seal)")
    return found.manifest


def checkpoint_problem(path: str, *, full: bool = True) -> str | None:
    """None when ``path`` is a sealed Trainer checkpoint whose every byte matches its
    checksums (``full=False``: only the manifest and file sizes are checked), else why
    it is not."""
    try:
        found = _committed(path)
        if isinstance(found, str):
            return found
        if full:
            report = verify(path)
            if not report.ok:
                return "corrupt: " + "; ".join(report.problems)
    except (CheckpointError, OSError) as exc:
        return f"unreadable: {exc}"
    return None


def last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` that is sealed and intact (every
    checksum verified), for ``trainer.train(resume_from_checkpoint=...)``.

    Newer folders that are incomplete (a save killed before its seal) or corrupt are
    skipped with a warning naming each. None when there is no such checkpoint, or the
    folder is empty or missing."""
    for _, path in reversed(_checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warn(f"last_checkpoint: skipping {path}: {problem}", SkippedCheckpointWarning)
    return None


# -- rotation --------------------------------------------------------------------------

def take_over_rotation(args: Any) -> int | None:
    """Remember the user's ``args.save_total_limit`` and set it to None, so that the
    Trainer never deletes a checkpoint itself (it does so before the new one is complete,
    and at the end of training). Idempotent: the user's value is kept on ``args``."""
    if not hasattr(args, _LIMIT_ATTR):
        object.__setattr__(args, _LIMIT_ATTR, args.save_total_limit)
    args.save_total_limit = None
    return getattr(args, _LIMIT_ATTR)


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def delete_checkpoint(path: str) -> None:
    """Delete a checkpoint folder: its manifests first (durably, so a crash mid-delete
    never leaves a folder that looks sealed), then everything else."""
    retire(open_storage(path), keep=None)
    shutil.rmtree(path)


def rotate(output_dir: str, limit: int | None, *, best: str | None, just_saved: str | None) -> list[str]:
    """Keep the newest ``limit`` sealed checkpoints plus the best one (and always the
    newest sealed and the one just saved); delete the other sealed ones. Folders that
    are not sealed are never touched here. Returns the deleted paths."""
    if limit is None or limit <= 0:
        return []
    sealed = [path for _, path in _checkpoints(output_dir) if not isinstance(_committed(path), str)]
    if not sealed:
        return []
    keep = sealed[-limit:] + [sealed[-1]]
    deleted = []
    for path in sealed:
        if any(_same(path, k) for k in (*keep, best, just_saved)):
            continue
        try:
            delete_checkpoint(path)
        except OSError as exc:
            warn(f"could not delete old checkpoint {path}: {exc}", CleanupWarning)
            continue
        log.info("deleted %s (save_total_limit=%s)", path, limit)
        deleted.append(path)
    return deleted


def _barrier() -> None:
    """Every rank has written its files (the Trainer writes per-rank RNG files)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _unseal(path: str) -> None:
    """Remove the manifests of a folder the Trainer is about to write into again (a
    resumed run re-saving a step), so it never looks sealed while being rewritten."""
    storage = open_storage(path)
    manifests = sorted((n for n in storage.listdir() if manifest_seq(n) is not None), reverse=True)
    if manifests:
        storage.delete(manifests)


# -- the callback ----------------------------------------------------------------------

class SafeCheckpointCallback(TrainerCallback):
    """Seal every ``checkpoint-N`` the Trainer writes and do its rotation safely.

    In ``on_save`` (synchronously: callbacks listed before this one have run) it seals
    the folder; then it deletes older sealed checkpoints beyond ``save_total_limit``,
    manifest first, never the newest sealed one nor ``state.best_model_checkpoint``.
    ``save_total_limit`` defaults to the TrainingArguments' value, which the callback
    sets to None so that the Trainer never deletes anything itself."""

    def __init__(self, save_total_limit: int | None = _FROM_ARGS) -> None:
        self.save_total_limit = save_total_limit

    def _take_over(self, args: Any) -> None:
        limit = take_over_rotation(args)
        if self.save_total_limit is _FROM_ARGS:
            self.save_total_limit = limit

    def on_init_end(self, args, state, control, **kwargs):
        self._take_over(args)

    def on_train_begin(self, args, state, control, **kwargs):
        self._take_over(args)  # added with trainer.add_callback() after __init__

    def _before_save(self, args, state, control) -> None:
        if control.should_save and args.should_save:
            path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if os.path.isdir(path):
                _unseal(path)

    def on_step_end(self, args, state, control, **kwargs):
        self._before_save(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._before_save(args, state, control)

    def on_save(self, args, state, control, **kwargs):
        self._take_over(args)
        _barrier()
        if not args.should_save:
            return
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(path):
            warn(f"SafeCheckpointCallback: the Trainer saved, but {path} does not exist "
                 "(hyperparameter search runs are not supported); nothing sealed", SafeckptWarning)
            return
        info = seal(path, step=state.global_step,
                    metadata={"sealed_by": "safeckpt.integrations.transformers.SafeCheckpointCallback",
                              "transformers_version": transformers.__version__})
        log.info("sealed %s (%d files, %d bytes, %.3fs)", path, len(info.files), info.bytes, info.seconds)
        rotate(args.output_dir, self.save_total_limit, best=state.best_model_checkpoint, just_saved=path)


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
    """The manifest of a SafeTrainer checkpoint; None for any other kind of checkpoint
    (a plain or sealed Trainer checkpoint), which the Trainer's own code then loads."""
    if path is None:
        return None
    try:
        m = read_committed(open_storage(path))
    except CheckpointNotFoundError:
        return None
    return m if m.metadata.get("integration") == _KIND else None


def _check_safe_checkpoint(path: str) -> None:
    """Before resuming from a SafeTrainer checkpoint: it must be sealed, and the files
    the Trainer reads itself (trainer_state.json) must match their checksums; its
    tensors are checked as they are loaded."""
    m = _safe_manifest(path)
    if m is None:
        return
    found = _committed(path)
    if isinstance(found, str):
        raise CorruptCheckpointError(f"cannot resume from {path}: {found}; "
                                     "use last_checkpoint(output_dir) to find the newest intact one")
    reader = TensorReader(open_storage(path), found, verify=True)
    problems = [p for f in found.files.values() if f.header_size is None for p in reader.verify_file(f.name)]
    if problems:
        raise CorruptCheckpointError(f"cannot resume from {path}: " + "; ".join(problems))

if TYPE_CHECKING:  # what the mixin is mixed into: the Trainer's attributes and methods
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class SafeTrainerMixin(_TrainerBase):
    """Put before ``Trainer`` (or your subclass of it) in the bases:
    ``class MyTrainer(SafeTrainerMixin, MyBaseTrainer)``.

    Checkpoints keep the ``checkpoint-N`` layout but hold one safeckpt checkpoint
    (model, optimizer, scheduler, scaler, per-rank RNG states and the trainer state,
    no pickles) plus ``trainer_state.json``, sealed together. Resuming accepts these and
    ordinary Trainer checkpoints; ``train(resume_from_checkpoint=True)`` resumes from
    ``last_checkpoint(output_dir)``. With FSDP (FSDP2 or FSDP1) the model and optimizer
    are saved as their sharded state dicts, each process writing its shards, and load on
    another number of processes. With DeepSpeed, the engine writes its own files through
    safeckpt's checkpoint engine (``safeckpt.integrations.deepspeed``) and the whole
    ``checkpoint-N`` is sealed as one checkpoint. XLA and SageMaker MP are refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_transformers_version()
        super().__init__(*args, **kwargs)
        unsupported = [name for name, on in (
            ("torch_xla", _xla()), ("SageMaker model parallel", _sagemaker_mp())) if on]
        if unsupported:
            raise NotImplementedError(
                f"SafeTrainer does not support {', '.join(unsupported)} yet (their checkpoints are written "
                "by the engine itself); use a plain Trainer with SafeCheckpointCallback to seal them")
        if self.args.push_to_hub:
            warn("SafeTrainer does not push intermediate checkpoints to the Hub; "
                 "trainer.push_to_hub() / save_model() still do", SafeckptWarning)
        self._safeckpt_limit = take_over_rotation(self.args)
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
        state: dict = {"model": self._safeckpt_model()}
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
        if getattr(self, "is_deepspeed_enabled", False):
            return self._safeckpt_save_deepspeed(model, trial, *args, **kwargs)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, folder)
        if self.args.should_save and os.path.isdir(output_dir):
            delete_checkpoint(output_dir)  # a stale or interrupted save of this step: unseal, then remove
        self._safeckpt_track_best(run_dir, output_dir)
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            callbacks = cast(dict, self.state.stateful_callbacks)  # annotated a list; TrainerState makes a dict
            if isinstance(callbacks[name], list):
                callbacks[name].append(cb.state())
            else:
                callbacks[name] = cb.state()
        state = self._safeckpt_state()
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
        save(state, output_dir, overwrite=True, step=self.state.global_step,
             metadata={"integration": _KIND, "transformers_version": transformers.__version__})
        if self.args.should_save:
            seal(output_dir)  # one checkpoint covering the tensors and trainer_state.json
            rotate(run_dir, self._safeckpt_limit, best=self.state.best_model_checkpoint, just_saved=output_dir)

    def _safeckpt_save_deepspeed(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """The Trainer writes ``checkpoint-N`` as usual (DeepSpeed's ``global_stepN/`` goes
        through safeckpt's engine: committed on its own, ``latest`` moved after it), then
        the whole folder, RNG files and trainer state included, is sealed as one commit."""
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(output_dir):
            delete_checkpoint(output_dir)  # a stale or interrupted save of this step: unseal, then remove
        _barrier()
        super()._save_checkpoint(model, trial, *args, **kwargs)
        _barrier()  # every rank's files are written
        if self.args.should_save:
            seal(output_dir, step=self.state.global_step,
                 metadata={"sealed_by": "safeckpt.integrations.transformers.SafeTrainer (DeepSpeed)",
                           "transformers_version": transformers.__version__})
            rotate(run_dir, self._safeckpt_limit, best=self.state.best_model_checkpoint, just_saved=output_dir)

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
        if resume_from_checkpoint is True:
            assert self.args.output_dir is not None  # TrainingArguments fills in a default
            resume_from_checkpoint = last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no sealed, intact checkpoint in {self.args.output_dir} to resume from")
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            _check_safe_checkpoint(os.fspath(resume_from_checkpoint))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if _safe_manifest(resume_from_checkpoint) is None:
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
        if _safe_manifest(self.state.best_model_checkpoint) is None:
            return super()._load_best_model()
        assert self.state.best_model_checkpoint is not None  # a manifest was found there
        log.info("loading best model from %s (score: %s)", self.state.best_model_checkpoint, self.state.best_metric)
        load_keys({"model": self._safeckpt_model()}, self.state.best_model_checkpoint)


def _xla() -> bool:
    from transformers.utils import is_torch_xla_available
    return bool(is_torch_xla_available())


def _sagemaker_mp() -> bool:
    from transformers.utils import is_sagemaker_mp_enabled
    return bool(is_sagemaker_mp_enabled())


class SafeTrainer(SafeTrainerMixin, Trainer):
    """A ``transformers.Trainer`` whose checkpoints are safeckpt checkpoints
    (see ``SafeTrainerMixin``)."""
