"""PyTorch Lightning: ``Trainer(plugins=[SafeCheckpointIO()])`` with the real library,
in both layouts: Lightning's own ``.ckpt`` file (the default) and a safeckpt folder.

The run: a small MLP on fixed random data, 4 batches an epoch, 20 steps, and
``ModelCheckpoint(monitor="train_loss", save_top_k=2, save_last=True,
every_n_train_steps=4)`` (saves at the end of each epoch: Lightning resumes bit-exactly
only there unless the dataloader is resumable). An uninterrupted reference run in this
process records every checkpoint dict Lightning hands the plugin. The kill tests run
the same training in a child process (this file run as a script) that SIGKILLs itself
inside a save: half way through writing the file, or once every byte is durable and
before the commit (the folder's manifest, the file's rename); a second, fresh process
started from a different random model resumes with ``trainer.fit(ckpt_path="last")``
(for the file layout also with a stock Trainer, no plugin) and must end with the
reference run's weights, optimizer and scheduler, bit for bit, and the reference run's
set of checkpoints. tests/test_lightning_compat.py has the file layout's own cases.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO  # noqa: E402
from torch import nn  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.integrations.lightning import (SafeCheckpointIO, load_from_checkpoint,  # noqa: E402
                                             remove_interrupted_saves)
from safeckpt.storage import LocalStorage, StorageWrapper  # noqa: E402
from safeckpt.testing import FaultyStorage, crash_points  # noqa: E402

MAX_STEPS = 20
BATCHES_PER_EPOCH = 4
SAVE_EVERY = 4            # = BATCHES_PER_EPOCH: every save is at an epoch's end
SEED, OTHER_SEED = 0, 12345
FINAL = {"epoch=3-step=16.ckpt", "epoch=4-step=20.ckpt", "last.ckpt"}  # top-2 by loss + last


# -- the training, shared by the tests and the child processes -----------------------------
class Net(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05, betas: tuple = (0.9, 0.99)) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, betas=self.hparams.betas)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(2024)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 8, generator=g)
    y = torch.randn(8 * BATCHES_PER_EPOCH, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def make_model(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


class Recorder(Callback):
    """The step the fit started at and the loss at every save step."""

    def __init__(self) -> None:
        self.start_step: int | None = None
        self.losses: dict[int, float] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % SAVE_EVERY == 0:
            self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])


class KillingIO(SafeCheckpointIO):
    """SIGKILLs its own process in the ``n``-th save to ``name`` (``kill_at="name:n"``):
    once every byte is durable and before the commit (the folder layout's manifest, the
    file layout's rename), or with ``"name:n:mid"`` (file layout) at the 10th of the
    writes ``torch.save`` makes into the file, half way through it."""

    def __init__(self, kill_at: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.kill_name, _, rest = kill_at.partition(":")
        n, _, self.kill_where = rest.partition(":")
        self.kill_n = int(n or 0)
        self.seen = 0

    def _due(self, name: str) -> bool:
        if self.kill_name and name == self.kill_name:
            self.seen += 1
            return self.seen == self.kill_n
        return False

    def _before_commit(self, url: str) -> None:
        if self.kill_where != "mid" and self._due(os.path.basename(url)):
            os.kill(os.getpid(), signal.SIGKILL)

    def _storage(self, url, options):
        storage = super()._storage(url, options)
        if self.kill_where != "mid":
            return storage
        io = self

        class Dying(StorageWrapper):
            def open_replace(self, name):
                out = super().open_replace(name)
                if not io._due(name):
                    return out
                real_write, calls = out.write, [0]

                def write(data):
                    calls[0] += 1
                    if calls[0] == 10:
                        real_write(memoryview(data)[:len(data) // 2])
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real_write(data)
                out.write = write
                return out
        return Dying(storage)


class RecordingIO(SafeCheckpointIO):
    """Keeps a deep copy of every checkpoint dict Lightning hands it, by file name (the
    newest) and by ``name@global_step``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.saved: dict[str, dict] = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        name = os.path.basename(str(path))
        self.saved[name] = self.saved[f"{name}@{checkpoint['global_step']}"] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def make_plugin(mode: str, io: SafeCheckpointIO | None = None, **kwargs):
    """``sync``, ``async`` (our async mode), ``wrapper`` (Lightning's AsyncCheckpointIO
    around the sync plugin), ``wrapper+async`` or ``stock`` (no plugin: Lightning's own
    TorchCheckpointIO)."""
    if mode == "stock":
        return None
    if io is None:
        io = KillingIO(async_save=mode.endswith("async"), **kwargs)
    return AsyncCheckpointIO(io) if mode.startswith("wrapper") else io


def fit(dirpath: str, *, seed: int, plugin, ckpt_path: str | None = None, max_steps: int = MAX_STEPS,
        devices: int = 1):
    """Train with the standard callbacks; returns (model, trainer, recorder)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child processes run (OMP_NUM_THREADS=1): same numbers
    model = make_model(seed)
    recorder = Recorder()
    checkpoint = ModelCheckpoint(dirpath=dirpath, filename="{epoch}-{step}", monitor="train_loss", mode="min",
                                 save_top_k=2, save_last=True, every_n_train_steps=SAVE_EVERY,
                                 enable_version_counter=False)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=devices, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[checkpoint, recorder], plugins=[plugin] if plugin is not None else [],
                         default_root_dir=dirpath)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
    finally:
        torch.set_num_threads(threads)
    return model, trainer, recorder


def final_state(model: Net, trainer: pl.Trainer) -> dict:
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": copy.deepcopy(trainer.optimizers[0].state_dict()),
            "sched": copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict())}


def child_main(args: dict) -> None:
    """One child process: train (maybe killed mid-save), or resume and report."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    layout = args.get("layout", "folder")
    plugin = make_plugin(args["mode"], kill_at=args.get("kill_at", ""), layout=layout)
    if args.get("devices", 1) > 1:  # DDP: resume within the same launch, then report
        fit(args["dir"], seed=args["seed"], plugin=plugin, max_steps=12, devices=args["devices"])
        plugin = make_plugin(args["mode"], layout=layout)
        args = {**args, "seed": OTHER_SEED, "ckpt_path": "last"}
    model, trainer, recorder = fit(args["dir"], seed=args["seed"], plugin=plugin, ckpt_path=args.get("ckpt_path"),
                                   devices=args.get("devices", 1))
    if trainer.global_rank != 0:
        return
    io = plugin.checkpoint_io if isinstance(plugin, AsyncCheckpointIO) else plugin
    if io is not None:
        io.teardown()  # Lightning's wrapper does not tear down the plugin it wraps
    if args.get("out"):
        torch.save({**final_state(model, trainer), "start_step": recorder.start_step,
                    "ckpt_path": str(trainer.ckpt_path)}, args["out"])


# -- checks ---------------------------------------------------------------------------------
def same(a, b, where: str = "") -> None:
    """Equal values of exactly the same types, tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def training_part(checkpoint: dict) -> dict:
    """What must be identical between two runs that trained the same way."""
    return {k: checkpoint[k] for k in ("epoch", "global_step", "state_dict", "optimizer_states",
                                       "lr_schedulers", "hyper_parameters")}


def folder_files(path: Path) -> tuple[list[str], list[str]]:
    names = sorted(os.listdir(path))
    return ([n for n in names if n.startswith("manifest-")], [n for n in names if n.startswith("data-")])


def check_final_folder(dirpath: Path, reference: dict, leaks_allowed: bool = False, layout: str = "folder") -> None:
    """The reference run's checkpoints, each verifiable, clean, and holding exactly the
    reference's training state of its step (a file: loaded by stock ``torch.load``).
    ``leaks_allowed``: Lightning's ``AsyncCheckpointIO`` runs ``remove_checkpoint`` at
    once, before the saves it still has queued, so a checkpoint removed before its own
    queued save ran stays behind (whole: it must still verify and hold its step's exact
    state)."""
    io = SafeCheckpointIO(layout="folder")
    names = set(os.listdir(dirpath))
    assert FINAL <= names, f"missing {FINAL - names}"
    assert leaks_allowed or names == FINAL, f"not removed: {names - FINAL}"
    for name in sorted(names):
        path = dirpath / name
        if layout == "file":
            assert path.is_file(), name
            loaded = torch.load(path, weights_only=True)
        else:
            report = safeckpt.verify(str(path))
            assert report.ok, report.problems
            manifests, data = folder_files(path)
            assert len(manifests) == 1 and len(data) == 1, f"{name}: leftovers {manifests + data}"
            loaded = io.load_checkpoint(str(path))
        same(training_part(loaded), training_part(reference["saved"][name]), name)


# -- the reference run ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run with the sync plugin; keeps what it saved and ended with."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    dirpath = tmp_path_factory.mktemp("lightning-ref") / "ckpts"
    io = RecordingIO(layout="folder")
    model, trainer, recorder = fit(str(dirpath), seed=SEED, plugin=io)
    return {"dir": dirpath, "io": io, "saved": io.saved, "losses": recorder.losses,
            "final": final_state(model, trainer)}


def test_every_checkpoint_is_a_verified_safeckpt_folder_with_the_right_top_k(reference):
    dirpath, saved = reference["dir"], reference["saved"]
    losses = reference["losses"]
    assert sorted(losses) == [4, 8, 12, 16, 20]
    # top-k by train_loss (mode min): the two lowest losses among the save steps, + last
    best = sorted(losses, key=losses.get)[:2]
    expected = {f"epoch={s // BATCHES_PER_EPOCH - 1}-step={s}.ckpt" for s in best} | {"last.ckpt"}
    assert expected == FINAL
    assert set(os.listdir(dirpath)) == expected
    io = SafeCheckpointIO(layout="folder")
    for name in sorted(expected):
        path = str(dirpath / name)
        assert safeckpt.verify(path).ok
        manifests, data = folder_files(dirpath / name)
        assert len(manifests) == 1 and len(data) == 1
        # every value Lightning put in the checkpoint comes back with its exact type
        loaded = io.load_checkpoint(path)
        same(loaded, saved[name], name)
        same(io.load_checkpoint(path, weights_only=True), saved[name], name)
        info = json.loads((dirpath / name / manifests[0]).read_text())
        assert info["safeckpt"]["step"] == saved[name]["global_step"]
    # the run's own state in the newest checkpoint: last.ckpt was re-saved 5 times
    last = io.load_checkpoint(str(dirpath / "last.ckpt"))
    assert last["global_step"] == MAX_STEPS
    same(dict(last["state_dict"]), reference["final"]["model"], "state_dict")
    ckpt_state = next(v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert set(map(os.path.basename, ckpt_state["best_k_models"])) == expected - {"last.ckpt"}
    assert last["hyper_parameters"] == {"hidden": 16, "lr": 0.05, "betas": (0.9, 0.99)}


def test_load_from_checkpoint_and_map_location(reference):
    path = str(reference["dir"] / "last.ckpt")
    model = load_from_checkpoint(Net, path, weights_only=True)
    same(dict(model.state_dict()), dict(reference["final"]["model"]), "state_dict")
    assert model.hparams.betas == (0.9, 0.99)
    assert load_from_checkpoint(Net, path, hidden=16).hparams.hidden == 16
    io = SafeCheckpointIO()
    meta = io.load_checkpoint(path, map_location="meta")
    assert all(t.device.type == "meta" for t in meta["state_dict"].values())
    moved = io.load_checkpoint(path, map_location=lambda t, loc: t.to(torch.float64))
    assert all(t.dtype == torch.float64 for t in moved["state_dict"].values())
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(str(reference["dir"] / "nothing.ckpt"))


# -- kill mid-save, resume in a fresh process -------------------------------------------------
def run_child(args: dict, timeout: float = 240.0) -> subprocess.CompletedProcess:
    src = str(Path(safeckpt.__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, __file__, json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=timeout)


KILLS = [
    # (layout, mode, kill_at, how the fresh process resumes)
    # the 3rd save of last.ckpt (step 12), overwriting step 8's: the atomic replacement
    pytest.param("folder", "sync", "last.ckpt:3", "sync", id="folder-sync-kill-in-last", marks=pytest.mark.slow),
    # the default layout: killed half way through streaming last.ckpt; a stock Trainer
    # (no plugin) resumes from what is left
    pytest.param("file", "sync", "last.ckpt:3:mid", "stock", id="file-sync-kill-mid-write-in-last-stock-resume"),
    pytest.param("file", "sync", "last.ckpt:3", "sync", id="file-sync-kill-before-rename-in-last",
                 marks=pytest.mark.slow),
    # the first save of epoch=2-step=12.ckpt, committed in the background by our async
    # mode while the training thread waits in remove_checkpoint to delete step 4
    pytest.param("folder", "async", "epoch=2-step=12.ckpt:1", "async", id="folder-async-kill-in-top-k",
                 marks=pytest.mark.slow),
    pytest.param("file", "async", "epoch=2-step=12.ckpt:1", "async", id="file-async-kill-in-top-k",
                 marks=pytest.mark.slow),
    pytest.param("folder", "wrapper", "last.ckpt:3", "wrapper", id="folder-lightning-async-wrapper-kill-in-last",
                 marks=pytest.mark.slow),
    pytest.param("file", "wrapper", "last.ckpt:3:mid", "wrapper", id="file-lightning-async-wrapper-kill-in-last",
                 marks=pytest.mark.slow),
]


def hidden_temporaries(dirpath: Path) -> list[str]:
    return sorted(n for n in os.listdir(dirpath) if n.startswith("."))


@pytest.mark.parametrize("layout,mode,kill_at,resume", KILLS)
def test_sigkill_mid_save_then_fit_ckpt_last_resumes_bit_exact(reference, tmp_path, layout, mode, kill_at, resume):
    dirpath = tmp_path / "ckpts"
    killed = run_child({"mode": mode, "dir": str(dirpath), "seed": SEED, "kill_at": kill_at, "layout": layout})
    assert killed.returncode == -signal.SIGKILL, (
        f"the child was to be SIGKILLed mid-save, it ended with {killed.returncode}:\n{killed.stderr[-3000:]}")

    # what the kill left: last.ckpt still holds step 8, whole; nothing half-written loads
    last = dirpath / "last.ckpt"
    killed_name = kill_at.partition(":")[0]
    if layout == "file":
        got = torch.load(last, weights_only=True)  # stock torch.load
        same(training_part(got), training_part(reference["saved"]["last.ckpt@8"]), "last@8")
        assert killed_name == "last.ckpt" or killed_name not in os.listdir(dirpath)  # never committed
        assert [n for n in hidden_temporaries(dirpath) if killed_name in n], "the killed save's temporary file"
        for name in (n for n in os.listdir(dirpath) if not n.startswith(".")):
            torch.load(dirpath / name, weights_only=True)
    else:
        io = SafeCheckpointIO(layout="folder")
        assert safeckpt.verify(str(last)).ok
        same(training_part(io.load_checkpoint(str(last))), training_part(reference["saved"]["last.ckpt@8"]),
             "last@8")
        manifests, data = folder_files(dirpath / killed_name)
        if killed_name == "last.ckpt":
            assert len(manifests) == 1 and len(data) == 2  # step 8's, plus the killed save's data
        else:
            assert manifests == [] and len(data) == 1     # never committed: not a checkpoint
            with pytest.raises(safeckpt.CheckpointNotFoundError):
                safeckpt.verify(str(dirpath / killed_name))
        for name in os.listdir(dirpath):
            if name != killed_name:
                assert safeckpt.verify(str(dirpath / name)).ok, name

    # a fresh process, from a different random model, resumes from last.ckpt (step 8)
    out = tmp_path / "resumed.pt"
    resumed = run_child({"mode": resume, "dir": str(dirpath), "seed": OTHER_SEED, "ckpt_path": "last",
                         "out": str(out), "layout": layout})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert got["start_step"] == 8 and os.path.basename(got["ckpt_path"]) == "last.ckpt"
    same(got["model"], reference["final"]["model"], "model")
    same(got["optim"], reference["final"]["optim"], "optim")
    same(got["sched"], reference["final"]["sched"], "sched")
    if resume == "stock":  # Lightning's own plugin leaves our temporary file; ours clears it
        assert remove_interrupted_saves(str(dirpath)) and not hidden_temporaries(dirpath)
    check_final_folder(dirpath, reference, leaks_allowed=mode.startswith("wrapper"), layout=layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_ddp_saves_on_rank_zero_alone_and_resumes(tmp_path, layout):
    """Lightning calls the plugin on global rank 0 only: the save must not wait for the
    other ranks (a collective would hang). Two CPU ranks train to step 12, then a new
    fit, from another random model, resumes from last.ckpt on both ranks to step 20."""
    dirpath, out = tmp_path / "ckpts", tmp_path / "ddp.pt"
    proc = run_child({"mode": "sync", "dir": str(dirpath), "seed": SEED, "devices": 2, "out": str(out),
                      "layout": layout}, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert got["start_step"] == 12
    names = set(os.listdir(dirpath))
    assert "last.ckpt" in names and len(names) == 3, names
    io = SafeCheckpointIO()
    for name in sorted(names):
        if layout == "file":
            assert (dirpath / name).is_file(), name
            continue
        assert safeckpt.verify(str(dirpath / name)).ok, name
        manifests, data = folder_files(dirpath / name)
        assert len(manifests) == 1 and len(data) == 1, name
    last = io.load_checkpoint(str(dirpath / "last.ckpt"))
    assert last["global_step"] == MAX_STEPS
    same(dict(last["state_dict"]), got["model"], "state_dict")


# -- removal: synchronous and manifest-first --------------------------------------------------
def test_remove_checkpoint_deletes_the_manifest_first(reference, tmp_path):
    checkpoint = reference["saved"]["epoch=4-step=20.ckpt"]
    path = tmp_path / "epoch=9-step=99.ckpt"
    io = SafeCheckpointIO(layout="folder")
    io.save_checkpoint(checkpoint, str(path))
    spy = FaultyStorage(LocalStorage(str(path)))
    io.remove_checkpoint(spy)
    assert not path.exists()
    deletes = [p for _, kind, p in spy.counter.log if kind == "delete"]
    assert deletes and "manifest-" in deletes[0] and "data-" in deletes[-1], deletes
    io.remove_checkpoint(str(path))  # already gone: fine, like Lightning's own plugin

    # crashed at every storage operation of a removal (and by power cuts): the checkpoint
    # is either whole or not a checkpoint at all, never a manifest without its data
    def setup(root):
        io.save_checkpoint(checkpoint, root.child("x.ckpt"))

    def remove(root):
        io.remove_checkpoint(root.child("x.ckpt"))

    points = 0
    for profile in ("posix", "object-store"):
        for point in crash_points(remove, profile, setup=setup, power_cuts=1):
            points += 1
            folder = point.storage.child("x.ckpt")
            try:
                loaded = io.load_checkpoint(folder)
            except safeckpt.CheckpointNotFoundError:
                assert not any(n.startswith("manifest-") for n in folder.listdir()), point
                continue
            assert point.crashed, f"{point}: the removal returned, but the checkpoint still loads"
            same(loaded, checkpoint, str(point))
    assert points > 5


def slow_storage(folder: Path) -> FaultyStorage:
    """``folder`` where each data file's write (folder layout) and each file's rename
    (file layout) takes half a second."""
    return FaultyStorage(LocalStorage(str(folder)), latency={"write_file": 0.5, "replace": 0.5})


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_remove_waits_for_the_async_save_in_flight(reference, tmp_path, layout):
    checkpoint = reference["saved"]["epoch=4-step=20.ckpt"]
    io = SafeCheckpointIO(async_save=True, layout=layout)
    old, new = tmp_path / "old.ckpt", tmp_path / "new.ckpt"
    io.save_checkpoint(checkpoint, str(old))
    io.wait()
    io.save_checkpoint(checkpoint, slow_storage(tmp_path).child("new.ckpt"))
    io.remove_checkpoint(str(old))  # returns only after new.ckpt is committed
    assert not old.exists()
    same(training_part(io.load_checkpoint(str(new))), training_part(checkpoint), "new.ckpt")
    io.teardown()


# -- async: our mode snapshots; Lightning's wrapper ---------------------------------------------
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_async_mode_snapshots_before_save_returns(tmp_path, layout):
    w = torch.zeros(1000)
    checkpoint = {"global_step": 1, "state_dict": {"w": w}, "loops": {"n": [1]}}
    io = SafeCheckpointIO(async_save=True, layout=layout)
    slow = slow_storage(tmp_path).child("a.ckpt")
    started = time.perf_counter()
    io.save_checkpoint(checkpoint, slow)
    assert time.perf_counter() - started < 0.5, "the async save waited for the write"
    w.add_(1)                             # the next training step, while the write is pending
    checkpoint["global_step"] = 2
    checkpoint["loops"]["n"].append(2)
    io.teardown()
    got = io.load_checkpoint(str(tmp_path / "a.ckpt"))
    assert got["global_step"] == 1 and got["loops"] == {"n": [1]}
    assert torch.equal(got["state_dict"]["w"], torch.zeros(1000)), "the save mixed two steps"


def test_lightning_async_wrapper_alone_snapshots_only_if_it_clones(tmp_path):
    """Lightning's AsyncCheckpointIO hands the dict to the wrapped plugin later, on its
    thread. Versions that do not clone the tensors first (before ``_clone_tensor``)
    let that plugin see the next step's weights under this step's ``global_step``."""
    from lightning.pytorch.plugins.io import async_plugin

    gate = threading.Event()
    seen: dict = {}

    class SlowIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            gate.wait(10)
            seen.update(step=checkpoint["global_step"], w=checkpoint["state_dict"]["w"].clone())

    w = torch.zeros(4)
    wrapper = AsyncCheckpointIO(SlowIO())
    wrapper.save_checkpoint({"global_step": 1, "state_dict": {"w": w}}, str(tmp_path / "x.ckpt"))
    w.add_(1)
    gate.set()
    wrapper.teardown()
    mixed = seen["step"] == 1 and not torch.equal(seen["w"], torch.zeros(4))
    assert mixed == (not hasattr(async_plugin, "_clone_tensor"))


@pytest.mark.parametrize("layout,mode", [
    ("folder", "async"), ("folder", "wrapper"), ("folder", "wrapper+async"), ("file", "async"),
    pytest.param("file", "wrapper", marks=pytest.mark.slow), pytest.param("file", "wrapper+async", marks=pytest.mark.slow)])
def test_async_fits_save_exactly_what_the_sync_run_saved(reference, tmp_path, layout, mode):
    dirpath = tmp_path / "ckpts"
    plugin = make_plugin(mode, io=RecordingIO(async_save=mode.endswith("async"), layout=layout))
    model, trainer, _ = fit(str(dirpath), seed=SEED, plugin=plugin)
    io = plugin.checkpoint_io if isinstance(plugin, AsyncCheckpointIO) else plugin
    io.teardown()  # the wrapper does not tear down the plugin it wraps
    same(final_state(model, trainer)["model"], reference["final"]["model"], "model")
    check_final_folder(dirpath, reference, leaks_allowed=mode.startswith("wrapper"), layout=layout)


@pytest.mark.parametrize("layout", ["folder", "file"])
def test_a_removal_waits_for_the_save_another_thread_is_writing(tmp_path, monkeypatch, layout):
    """Lightning's AsyncCheckpointIO saves on its own thread and removes on the trainer's:
    a removal of the checkpoint being written waits for that save (stock torch.save
    writes into an unlinked file and never fails; a folder removed under its writer
    failed the save), then removes it whole."""
    held, go = threading.Event(), threading.Event()
    real_write, real_replace = LocalStorage.write_file, LocalStorage.open_replace

    def hold() -> None:
        held.set()
        assert go.wait(30)

    def write_file(self, name, parts):
        if name.startswith("manifest-"):
            hold()
        return real_write(self, name, parts)

    def open_replace(self, name, *args, **kwargs):
        if name == "x.ckpt":
            hold()
        return real_replace(self, name, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "write_file", write_file)
    monkeypatch.setattr(LocalStorage, "open_replace", open_replace)
    io, path = SafeCheckpointIO(layout=layout), tmp_path / "x.ckpt"
    errors: list = []

    def save() -> None:
        try:
            io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(3)}}, path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    saver = threading.Thread(target=save)
    saver.start()
    assert held.wait(30)
    remover = threading.Thread(target=io.remove_checkpoint, args=(path,))
    remover.start()
    remover.join(0.5)
    assert remover.is_alive(), "the checkpoint was removed while its save was writing it"
    go.set()
    saver.join(30)
    remover.join(30)
    assert not errors and not remover.is_alive()
    assert not path.exists()


# -- values a Lightning checkpoint may hold -----------------------------------------------------
def test_unstorable_values_are_refused_with_a_clear_opt_in(tmp_path):
    """The folder layout stores no pickle unless told to (the file layout is torch.save's
    pickle, and loads under torch.load's weights_only rule: test_lightning_compat.py)."""
    checkpoint = {"global_step": 3, "state_dict": {"w": torch.ones(2)},
                  "hyper_parameters": {"lr": 0.1, "cfg": types.SimpleNamespace(depth=3)}}
    path = str(tmp_path / "x.ckpt")
    with pytest.raises(safeckpt.UnsafeObjectError) as err:
        SafeCheckpointIO(layout="folder").save_checkpoint(checkpoint, path)
    assert "hyper_parameters.cfg" in str(err.value) and "allow_pickle=True" in str(err.value)
    assert not os.path.exists(path) or not os.listdir(path)  # refused before anything was written
    with pytest.raises(safeckpt.UnsafeObjectError):
        SafeCheckpointIO(async_save=True, layout="folder").save_checkpoint(checkpoint, path)

    trusting = SafeCheckpointIO(allow_pickle=True, layout="folder")
    trusting.save_checkpoint(checkpoint, path)
    assert safeckpt.verify(path).ok
    with pytest.raises(safeckpt.UnsafeObjectError, match="allow_pickle=True"):
        SafeCheckpointIO(layout="folder").load_checkpoint(path)
    with pytest.raises(safeckpt.UnsafeObjectError, match="weights_only=True"):
        trusting.load_checkpoint(path, weights_only=True)
    got = trusting.load_checkpoint(path)
    assert got["hyper_parameters"]["cfg"] == types.SimpleNamespace(depth=3)
    # weights_only=False from the caller is the same opt-in, as it is for torch.load
    got = SafeCheckpointIO(layout="folder").load_checkpoint(path, weights_only=False)
    assert got["hyper_parameters"]["cfg"] == types.SimpleNamespace(depth=3)

    # a module among the hyper-parameters would come back as a dict: refused, even with pickle
    checkpoint["hyper_parameters"]["net"] = nn.Linear(2, 2)
    for io in (SafeCheckpointIO(layout="folder"), trusting, SafeCheckpointIO(async_save=True, layout="folder")):
        with pytest.raises(safeckpt.UnsafeObjectError, match=r"hyper_parameters\.net.*save_hyperparameters\(ignore"):
            io.save_checkpoint(checkpoint, str(tmp_path / "y.ckpt"))


def test_plain_torch_checkpoints_load_safely_and_are_removed(tmp_path, reference):
    """A run switched to the plugin can still resume from, and rotate away, the torch
    files it wrote before."""
    path = str(tmp_path / "old.ckpt")
    TorchCheckpointIO().save_checkpoint(reference["saved"]["epoch=4-step=20.ckpt"], path)
    got = SafeCheckpointIO().load_checkpoint(path, weights_only=True)
    same(got["state_dict"], reference["saved"]["epoch=4-step=20.ckpt"]["state_dict"], "state_dict")
    SafeCheckpointIO().remove_checkpoint(path)
    assert not os.path.exists(path)


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_fsspec_url_run(reference, layout):
    """Any URL: here fsspec's in-memory filesystem."""
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://safeckpt-lightning-{os.getpid()}/ckpts"
    fs = fsspec.filesystem("memory")
    try:
        fit(root, seed=SEED, plugin=SafeCheckpointIO(layout=layout))
        names = {os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
        assert names == FINAL
        for name in sorted(FINAL):
            url = f"{root}/{name}"
            if layout == "file":
                with fs.open(url, "rb") as f:
                    assert torch.load(f, weights_only=True)["global_step"] == reference["saved"][name]["global_step"]
            else:
                assert safeckpt.verify(url).ok
            same(training_part(SafeCheckpointIO().load_checkpoint(url)),
                 training_part(reference["saved"][name]), name)
    finally:
        fs.rm(f"memory://safeckpt-lightning-{os.getpid()}", recursive=True)


def test_remove_interrupted_saves(reference, tmp_path):
    checkpoint = reference["saved"]["epoch=4-step=20.ckpt"]
    io = SafeCheckpointIO(layout="folder")
    io.save_checkpoint(checkpoint, str(tmp_path / "good.ckpt"))
    # a save killed before its commit: data, no manifest
    (tmp_path / "cut.ckpt").mkdir()
    data = next(n for n in os.listdir(tmp_path / "good.ckpt") if n.startswith("data-"))
    (tmp_path / "cut.ckpt" / data).write_bytes(b"\0" * 64)
    (tmp_path / "notes.txt").write_text("not ours")
    # a file-layout save killed before its rename: a hidden temporary file
    temp = ".last.ckpt.safeckpt-0123456789ab.tmp"
    (tmp_path / temp).write_bytes(b"PK")
    expected = [temp, f"cut.ckpt/{data}"]
    assert remove_interrupted_saves(str(tmp_path), dry_run=True) == expected
    assert remove_interrupted_saves(str(tmp_path)) == expected
    assert sorted(os.listdir(tmp_path)) == ["good.ckpt", "notes.txt"]
    assert safeckpt.verify(str(tmp_path / "good.ckpt")).ok


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
