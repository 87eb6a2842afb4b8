"""Lightning's own ``.ckpt`` files, made safe: ``SafeCheckpointIO()``'s default layout.

What the upstream Lightning checkpoint tests rely on, each checked here on our own
runs (the same small training as tests/test_integration_lightning.py, which also has
the kill-and-resume tests of both layouts): every checkpoint is a regular file holding
the bytes ``torch.save`` writes, so ``os.path.isfile``, ``torch.load``, ``pl_load``,
``load_from_checkpoint`` and a stock Trainer read it, and the folder holds nothing else;
``save_last="link"`` works and removing a link never touches its target; ``weights_only``
means what it means to ``torch.load``. What the plugin adds over stock: a kill or power
cut at any storage operation of a save keeps a whole checkpoint on every storage
profile; a flipped byte or a torn file is refused (stock ``torch.load`` loads it) and
``ckpt_path="last"`` falls back to the newest intact checkpoint; async saves write the
same bytes, from a snapshot, and their errors surface; the checkpoint is never
serialized into memory first.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
import tracemalloc
import types
import warnings
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.utilities.cloud_io import _load as pl_load  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.errors import SafeckptWarning, SkippedCheckpointWarning  # noqa: E402
from safeckpt.integrations.lightning import (SafeCheckpointIO, SafeModelParallelStrategy,  # noqa: E402
                                             load_from_checkpoint)
from safeckpt.interop.torchfile import check_torch_file  # noqa: E402
from safeckpt.testing import PROFILES, Fault, FaultyStorage, crash_points  # noqa: E402
from test_integration_lightning import (FINAL, MAX_STEPS, SEED, Net, RecordingIO, final_state, fit,  # noqa: E402
                                        make_loader, make_model, same, training_part)


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An uninterrupted run in the default layout; keeps what it saved and ended with."""
    dirpath = tmp_path_factory.mktemp("lightning-file") / "ckpts"
    recorder_io = RecordingIO()
    model, trainer, _ = fit(str(dirpath), seed=SEED, plugin=recorder_io)
    return {"dir": dirpath, "saved": recorder_io.saved, "final": final_state(model, trainer)}


def copy_run(run, tmp_path) -> Path:
    dirpath = tmp_path / "ckpts"
    shutil.copytree(run["dir"], dirpath, symlinks=True)
    return dirpath


# -- what stock tools see -----------------------------------------------------------------------
def test_every_checkpoint_is_the_file_torch_save_writes_and_stock_tools_read_it(run):
    dirpath = run["dir"]
    assert set(os.listdir(dirpath)) == FINAL, "the folder holds more than Lightning's files"
    for name in sorted(FINAL):
        path = dirpath / name
        assert path.is_file()
        assert path.read_bytes() == torch_bytes(run["saved"][name]), f"{name}: not torch.save's bytes"
        same(torch.load(path, weights_only=True), run["saved"][name], name)
        same(pl_load(str(path)), run["saved"][name], name)
    last = str(dirpath / "last.ckpt")
    model = Net.load_from_checkpoint(last)  # Lightning's own
    same(dict(model.state_dict()), dict(run["final"]["model"]), "load_from_checkpoint")
    same(dict(load_from_checkpoint(Net, last).state_dict()), dict(run["final"]["model"]), "ours")
    assert isinstance(SafeCheckpointIO(), TorchCheckpointIO)  # what code that checks the default sees


def test_a_stock_trainer_resumes_from_the_files(run, tmp_path):
    dirpath = copy_run(run, tmp_path)
    model, trainer, recorder = fit(str(dirpath), seed=SEED + 1, plugin=None, ckpt_path=str(dirpath / "last.ckpt"),
                                   max_steps=MAX_STEPS + 4)
    assert recorder.start_step == MAX_STEPS and trainer.global_step == MAX_STEPS + 4


def test_stock_load_from_checkpoint_reads_files_only_ours_reads_folders_too(run, tmp_path):
    """``LightningModule.load_from_checkpoint`` and ``pl_load`` open the path with fsspec:
    no plugin takes part, so a folder is out of their reach."""
    folder = tmp_path / "folder.ckpt"
    SafeCheckpointIO(layout="folder").save_checkpoint(run["saved"]["last.ckpt"], str(folder))
    with pytest.raises(IsADirectoryError):
        Net.load_from_checkpoint(str(folder))
    same(dict(load_from_checkpoint(Net, str(folder)).state_dict()), dict(run["final"]["model"]), "folder")


# -- kills and power cuts at every storage operation of a save -----------------------------------
def small_checkpoint(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"global_step": step, "epoch": step // 4, "state_dict": {"w": torch.randn(300_000, generator=g)},
            "loops": {"fit_loop": {"step": step}}, "hyper_parameters": {"lr": 0.05}}


@pytest.mark.parametrize("profile", PROFILES)
def test_a_crash_at_every_operation_of_a_save_leaves_a_whole_checkpoint(profile):
    old, new = small_checkpoint(8), small_checkpoint(12)
    plugin = SafeCheckpointIO()

    def setup(root):
        plugin.save_checkpoint(old, root.child("last.ckpt"))

    points = 0
    for point in crash_points(lambda root: plugin.save_checkpoint(new, root.child("last.ckpt")), profile,
                              setup=setup, power_cuts=1):
        points += 1
        data = point.storage.read("last.ckpt")
        f = io.BytesIO(data)
        if profile == "fuse-object" and point.outcome == "kill" and data not in (torch_bytes(old), torch_bytes(new)):
            with pytest.raises(safeckpt.CorruptCheckpointError):  # the part a killed copy left: refused
                check_torch_file(f, str(point))
            continue
        assert check_torch_file(f, str(point))
        got = torch.load(f, weights_only=True)
        want = new if not point.crashed else (new if got["global_step"] == 12 else old)
        same(got, want, str(point))
    assert points > 2


# -- corruption: refused, and "last" falls back ------------------------------------------------------
def flip_a_tensor_byte(path: Path) -> None:
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size // 2] ^= 0x40
    path.write_bytes(data)


def test_a_flipped_byte_is_refused_and_last_falls_back_to_the_newest_intact(run, tmp_path):
    dirpath = copy_run(run, tmp_path)
    last = dirpath / "last.ckpt"
    flip_a_tensor_byte(last)
    stock = torch.load(last, weights_only=True)  # stock Lightning loads the changed value, silently
    assert not all(torch.equal(stock["state_dict"][k], v) for k, v in run["saved"]["last.ckpt"]["state_dict"].items())

    plugin = SafeCheckpointIO()
    with pytest.warns(SkippedCheckpointWarning, match=r"last\.ckpt failed its check.*epoch=4-step=20\.ckpt"):
        got = plugin.load_checkpoint(str(last))
    same(got, run["saved"]["epoch=4-step=20.ckpt"], "fallback")  # the top-k file of the same step
    with pytest.raises(safeckpt.CorruptCheckpointError, match="Bad CRC-32"):
        SafeCheckpointIO(fallback=False).load_checkpoint(str(last))
    SafeCheckpointIO(verify=False).load_checkpoint(str(last))  # the opt-out loads what is there

    # a named checkpoint is never swapped for another
    flip_a_tensor_byte(dirpath / "epoch=3-step=16.ckpt")
    with pytest.raises(safeckpt.CorruptCheckpointError, match=r"epoch=3-step=16\.ckpt"):
        plugin.load_checkpoint(str(dirpath / "epoch=3-step=16.ckpt"))

    # fit(ckpt_path="last") resumes from the intact one: it trains on exactly as a resume
    # from the intact last.ckpt does (and not as one from the changed value)
    resumed = [fit(str(d), seed=SEED + 1, plugin=SafeCheckpointIO(), ckpt_path="last", max_steps=MAX_STEPS + 4)
               for d in (dirpath, copy_run(run, tmp_path / "intact"))]
    assert [r[2].start_step for r in resumed] == [MAX_STEPS, MAX_STEPS]
    same(final_state(*resumed[0][:2]), final_state(*resumed[1][:2]), "resumed")


def test_a_torn_last_is_refused_and_nothing_intact_is_a_clear_error(run, tmp_path):
    dirpath = copy_run(run, tmp_path)
    last = dirpath / "last.ckpt"
    last.write_bytes(last.read_bytes()[:-100])  # what a stock rename without fsync can leave
    with pytest.warns(SkippedCheckpointWarning):
        got = SafeCheckpointIO().load_checkpoint(str(last))
    assert got["global_step"] == MAX_STEPS
    for name in FINAL - {"last.ckpt"}:
        (dirpath / name).write_bytes(b"")
    with pytest.raises(safeckpt.CorruptCheckpointError, match="no intact checkpoint"):
        SafeCheckpointIO().load_checkpoint(str(last))


# -- save_last="link" ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_save_last_link_with_every_epoch_kept_keeps_every_checkpoint(tmp_path, layout):
    """Issue 24, item 2: with ``save_top_k=-1`` and a ``last-{epoch}`` name, removing the
    previous "last" link deleted the checkpoint it pointed to and killed the fit."""
    dirpath = tmp_path / "ckpts"
    checkpoint = ModelCheckpoint(dirpath=str(dirpath), filename="{epoch}", save_top_k=-1, save_last="link")
    checkpoint.CHECKPOINT_NAME_LAST = "last-{epoch}"
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[checkpoint],
                         plugins=[SafeCheckpointIO(layout=layout)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(make_model(SEED), make_loader())
    assert set(os.listdir(dirpath)) == {"epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt", "last-epoch=2.ckpt"}
    assert os.readlink(dirpath / "last-epoch=2.ckpt") == "epoch=2.ckpt"
    plugin = SafeCheckpointIO()
    for epoch in range(3):
        assert plugin.load_checkpoint(str(dirpath / f"epoch={epoch}.ckpt"))["global_step"] == 4 * (epoch + 1)


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_removing_a_link_never_touches_what_it_points_to(run, tmp_path, layout):
    checkpoint = run["saved"]["epoch=4-step=20.ckpt"]
    target, link = tmp_path / "epoch=4-step=20.ckpt", tmp_path / "last.ckpt"
    SafeCheckpointIO(layout=layout).save_checkpoint(checkpoint, str(target))
    removers = [SafeCheckpointIO().remove_checkpoint, SafeCheckpointIO(layout="folder").remove_checkpoint,
                SafeModelParallelStrategy().remove_checkpoint]
    for remove in removers:
        os.symlink(target.name, link)
        remove(str(link))
        assert not os.path.lexists(link)
        same(training_part(SafeCheckpointIO().load_checkpoint(str(target))), training_part(checkpoint), "target")
    # a save to the link's name replaces the link, never writes through it
    os.symlink(target.name, link)
    SafeCheckpointIO(layout=layout).save_checkpoint(run["saved"]["last.ckpt@8"], str(link))
    assert not link.is_symlink()
    assert SafeCheckpointIO().load_checkpoint(str(link))["global_step"] == 8
    same(training_part(SafeCheckpointIO().load_checkpoint(str(target))), training_part(checkpoint), "target")


def test_switching_layouts_replaces_the_checkpoint_under_the_name(run, tmp_path):
    path = str(tmp_path / "last.ckpt")
    SafeCheckpointIO(layout="folder").save_checkpoint(run["saved"]["last.ckpt@8"], path)
    SafeCheckpointIO().save_checkpoint(run["saved"]["last.ckpt@12"], path)
    assert os.path.isfile(path) and torch.load(path, weights_only=True)["global_step"] == 12
    SafeCheckpointIO(layout="folder").save_checkpoint(run["saved"]["last.ckpt@16"], path)
    assert safeckpt.verify(path).ok and SafeCheckpointIO().load_checkpoint(path)["global_step"] == 16
    assert os.listdir(tmp_path) == ["last.ckpt"]


# -- weights_only, as torch.load has it ------------------------------------------------------------
def test_weights_only_means_what_it_means_to_torch_load(tmp_path):
    path = str(tmp_path / "x.ckpt")
    checkpoint = {"global_step": 1, "state_dict": {"w": torch.ones(2)},
                  "hyper_parameters": {"cfg": types.SimpleNamespace(depth=3)}}
    SafeCheckpointIO().save_checkpoint(checkpoint, path)  # torch.save pickles it, as stock does
    with pytest.raises(pickle.UnpicklingError):
        SafeCheckpointIO().load_checkpoint(path)  # torch.load's default: weights only
    with pytest.raises(pickle.UnpicklingError):
        SafeCheckpointIO(allow_pickle=True).load_checkpoint(path, weights_only=True)
    for got in (SafeCheckpointIO().load_checkpoint(path, weights_only=False),
                SafeCheckpointIO(allow_pickle=True).load_checkpoint(path)):
        assert got["hyper_parameters"]["cfg"] == types.SimpleNamespace(depth=3)


# -- async -------------------------------------------------------------------------------------------
class NoCopy:
    """A value that pickles but refuses ``copy.deepcopy``."""

    def __deepcopy__(self, memo):
        raise TypeError("no copies")


def test_an_async_save_writes_the_bytes_of_the_state_it_was_given(tmp_path):
    lin = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(lin.parameters())
    lin(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    w = torch.arange(100.0)
    checkpoint = {"global_step": 7, "state_dict": {"w": w, "view": w[10:20], "b": torch.arange(5)},
                  "param": lin.weight, "optimizer_states": [optimizer.state_dict()], "hp": (1, "x")}
    expected = torch_bytes(checkpoint)
    plugin = SafeCheckpointIO(async_save=True)
    plugin.save_checkpoint(checkpoint, str(tmp_path / "a.ckpt"))
    w.add_(1)             # the next step changes the state at once
    with torch.no_grad():
        lin.weight.mul_(2)
    checkpoint["global_step"] = 8
    plugin.teardown()
    assert (tmp_path / "a.ckpt").read_bytes() == expected

    checkpoint["odd"] = NoCopy()  # the save is made at once instead
    with pytest.warns(SafeckptWarning, match="saved synchronously"):
        plugin.save_checkpoint(checkpoint, str(tmp_path / "b.ckpt"))
    plugin.teardown()
    assert torch.load(tmp_path / "b.ckpt", weights_only=False)["global_step"] == 8


class DiskFullIO(SafeCheckpointIO):
    """Every file it writes fails as a full disk would, at the rename."""

    def _storage(self, url, options):
        return FaultyStorage(super()._storage(url, options), faults=[Fault("replace", errno.ENOSPC)])


def test_an_async_save_error_surfaces_at_the_next_call_and_at_teardown(run, tmp_path):
    checkpoint, path = run["saved"]["last.ckpt"], str(tmp_path / "last.ckpt")
    SafeCheckpointIO().save_checkpoint(run["saved"]["last.ckpt@8"], path)
    plugin = DiskFullIO(async_save=True)
    plugin.save_checkpoint(checkpoint, path)  # returns: the write fails in the background
    with pytest.raises(safeckpt.StorageError, match="disk is full"):
        plugin.save_checkpoint(checkpoint, path)
    plugin.save_checkpoint(checkpoint, path)
    with pytest.raises(safeckpt.StorageError, match="disk is full"):
        plugin.teardown()
    assert torch.load(path, weights_only=True)["global_step"] == 8  # the old file, whole
    assert os.listdir(tmp_path) == ["last.ckpt"]

    # in a fit: the error stops the training instead of being lost
    with pytest.raises(safeckpt.StorageError, match="disk is full"):
        fit(str(tmp_path / "fit"), seed=SEED, plugin=DiskFullIO(async_save=True), max_steps=8)


# -- memory ------------------------------------------------------------------------------------------
def test_a_save_streams_the_checkpoint_instead_of_serializing_it_in_memory_first(tmp_path):
    checkpoint = {"global_step": 1, "state_dict": {"w": torch.zeros(8 << 20, dtype=torch.uint8)}}  # 8 MiB
    peaks = {}
    for name, plugin in (("stock", TorchCheckpointIO()), ("safeckpt", SafeCheckpointIO())):
        tracemalloc.start()
        plugin.save_checkpoint(checkpoint, str(tmp_path / f"{name}.ckpt"))
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks["stock"] > 8 << 20, peaks  # the measurement sees stock's BytesIO
    assert peaks["safeckpt"] < 2 << 20, peaks
    assert (tmp_path / "stock.ckpt").read_bytes() == (tmp_path / "safeckpt.ckpt").read_bytes()
