"""Retention: the union of keep_last, keep_best and keep_every; deletion only after a
newer commit, never the newest; a run never deletes another run's checkpoints."""

from __future__ import annotations

import errno
import math
import os
import warnings

import pytest
import torch

import safeckpt
from safeckpt.run.retention import Retention
from safeckpt.storage.local import LocalStorage
from safeckpt.testing import FaultyStorage


def _state(step: int) -> dict:
    return {"w": torch.full((8,), float(step)), "step": step}


def _folders(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))


def _restores_exactly(mgr: safeckpt.CheckpointManager, step: int) -> None:
    state = _state(-1)
    assert mgr.restore(state, step=step) == step
    assert torch.equal(state["w"], torch.full((8,), float(step))) and state["step"] == step


LOSSES = {1: 5.0, 2: 4.0, 3: 0.5, 4: 3.0, 5: 2.0, 6: 1.5, 7: 1.0, 8: 0.9}  # best: step 3


@pytest.mark.parametrize("async_save", [False, True])
def test_union_of_rules(tmp_path, async_save):
    with safeckpt.CheckpointManager(tmp_path, keep_last=2, keep_best=1, best_metric="loss",
                                    keep_every=4, async_save=async_save) as mgr:
        for step in range(1, 9):
            mgr.save(step, _state(step), metrics={"loss": LOSSES[step]})
    assert mgr.steps() == [3, 4, 7, 8]
    assert _folders(tmp_path) == [3, 4, 7, 8]  # deleted entirely, no leftovers
    with safeckpt.CheckpointManager(tmp_path) as reader:
        for step in (3, 4, 7, 8):
            _restores_exactly(reader, step)


def test_keep_best_max_mode(tmp_path):
    acc = {1: 0.1, 2: 0.9, 3: 0.3, 4: 0.2, 5: 0.25}
    with safeckpt.CheckpointManager(tmp_path, keep_last=1, keep_best=2, best_metric="acc",
                                    best_mode="max") as mgr:
        for step, a in acc.items():
            mgr.save(step, _state(step), metrics={"acc": a})
    assert mgr.steps() == [2, 3, 5]  # best two by max: 2 (0.9), 3 (0.3); last: 5


def test_keep_best_ignores_missing_and_nan_metrics(tmp_path):
    metrics = {1: {"loss": 2.0}, 2: {"loss": float("nan")}, 3: {}, 4: {"loss": float("inf")},
               5: {"loss": 1.0}, 6: {"other": 0.0}, 7: {"loss": "low"}, 8: {"acc": 1.0}}
    with safeckpt.CheckpointManager(tmp_path, keep_last=1, keep_best=1, best_metric="loss") as mgr:
        for step, m in metrics.items():
            mgr.save(step, _state(step), metrics=m)
    assert mgr.steps() == [5, 8]  # the best finite loss, and the newest


def test_keep_best_with_no_metric_at_all_keeps_only_the_others(tmp_path):
    with safeckpt.CheckpointManager(tmp_path, keep_last=2, keep_best=3, best_metric="loss") as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step))
    assert mgr.steps() == [4, 5]


def test_best_ties_prefer_the_newer(tmp_path):
    with safeckpt.CheckpointManager(tmp_path, keep_last=1, keep_best=1, best_metric="loss") as mgr:
        for step, loss in ((1, 1.0), (2, 1.0), (3, 2.0)):
            mgr.save(step, _state(step), metrics={"loss": loss})
    assert mgr.steps() == [2, 3]


def test_newest_is_never_deleted(tmp_path):
    # keep_every alone would keep nothing of 1..3; the newest stays anyway
    with safeckpt.CheckpointManager(tmp_path, keep_every=10) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
            assert mgr.latest_step() == step
        assert mgr.steps() == [3]
        # keep_best whose best is old: the newest (worse) one stays too
    with safeckpt.CheckpointManager(tmp_path / "b", keep_best=1, best_metric="loss") as mgr:
        mgr.save(1, _state(1), metrics={"loss": 0.1})
        mgr.save(2, _state(2), metrics={"loss": 9.0})
        assert mgr.steps() == [1, 2]
        mgr.save(3, _state(3), metrics={"loss": 8.0})
        assert mgr.steps() == [1, 3]


def test_retention_agrees_with_the_pure_rules():
    r = Retention(keep_last=2, keep_best=1, best_metric="loss", keep_every=4)
    metrics = {s: {"loss": l} for s, l in LOSSES.items()}
    assert r.keep(metrics) == {3, 4, 7, 8}
    assert Retention().keep(metrics) == set(LOSSES)  # no rule: keep everything
    assert Retention(keep_last=1).keep({}) == set()


def test_nothing_is_deleted_when_the_newer_save_fails(tmp_path):
    storage = FaultyStorage(LocalStorage(tmp_path))
    mgr = safeckpt.CheckpointManager(storage, keep_last=1)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert mgr.steps() == [2]
    storage.inject("write_file", errno.ENOSPC, path="manifest-")  # the commit itself fails
    with pytest.raises(safeckpt.StorageError):
        mgr.save(3, _state(3))
    storage.inject("write_file", errno.ENOSPC, path="data-")
    with pytest.raises(safeckpt.StorageError):
        mgr.save(4, _state(4))
    storage.faults.clear()
    assert mgr.steps() == [2] and _folders(tmp_path) == [2]
    _restores_exactly(mgr, 2)
    assert [op for op in storage.log if op[1] in ("delete", "remove_folder") and "step-000000002" in op[2]] == []
    mgr.save(5, _state(5))
    assert mgr.steps() == [5]
    mgr.close()


def test_nothing_is_deleted_when_an_async_save_fails(tmp_path):
    storage = FaultyStorage(LocalStorage(tmp_path))
    mgr = safeckpt.CheckpointManager(storage, keep_last=1, async_save=True)
    mgr.save(1, _state(1)).result(timeout=60)
    storage.inject("write_file", errno.ENOSPC, path="data-")
    with pytest.raises(safeckpt.StorageError):
        mgr.save(2, _state(2)).result(timeout=60)
    assert mgr.steps() == [1]
    storage.faults.clear()
    mgr.close()


# --------------------------------------------------------------------------- runs


def _run_a(root) -> None:
    with safeckpt.CheckpointManager(root) as mgr:  # no retention: keeps everything
        for step in (1, 2, 3):
            mgr.save(step, _state(step))


def test_a_new_run_never_deletes_another_runs_checkpoints(tmp_path):
    _run_a(tmp_path)
    with pytest.warns(UserWarning, match=r"another run.*\[1, 2, 3\]"):
        mgr = safeckpt.CheckpointManager(tmp_path, keep_last=1)
        mgr.save(10, _state(10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not on every save
        mgr.save(11, _state(11))
        mgr.save(12, _state(12))
    mgr.close()
    assert _folders(tmp_path) == [1, 2, 3, 12]  # its own 10 and 11 went; run A's stayed
    with safeckpt.CheckpointManager(tmp_path) as reader:
        for step in (1, 2, 3, 12):
            _restores_exactly(reader, step)


def test_a_new_run_keeps_another_runs_checkpoints_even_when_they_are_newer(tmp_path):
    _run_a(tmp_path)
    with pytest.warns(UserWarning, match="another run"):
        with safeckpt.CheckpointManager(tmp_path, keep_last=1, async_save=True) as mgr:
            mgr.save(0, _state(0)).result(timeout=60)
    assert _folders(tmp_path) == [0, 1, 2, 3]


def test_restore_continues_the_run_and_its_retention(tmp_path):
    _run_a(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # continuing the run is not "another run"
        with safeckpt.CheckpointManager(tmp_path, keep_last=2) as mgr:
            state = _state(-1)
            assert mgr.restore(state) == 3 and state["step"] == 3
            mgr.save(4, _state(4))
            mgr.save(5, _state(5))
    assert _folders(tmp_path) == [4, 5]


def test_restore_of_a_given_step_continues_the_run(tmp_path):
    _run_a(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with safeckpt.CheckpointManager(tmp_path, keep_last=1) as mgr:
            assert mgr.restore(_state(-1), step=2) == 2
            mgr.save(4, _state(4))
    assert _folders(tmp_path) == [4]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs", [
    {"keep_best": 1},                                   # no best_metric
    {"keep_best": 1, "best_metric": ""},
    {"keep_last": 0},
    {"keep_last": -1},
    {"keep_every": 0},
    {"keep_best": 0, "best_metric": "loss"},
    {"keep_last": 1.5},
    {"keep_last": True},
    {"keep_best": 1, "best_metric": "loss", "best_mode": "maximum"},
    {"best_mode": "MIN"},
])
def test_bad_retention_is_a_value_error(tmp_path, kwargs):
    with pytest.raises(ValueError):
        Retention(**kwargs)
    with pytest.raises(ValueError):
        safeckpt.CheckpointManager(tmp_path, **kwargs)
    assert not os.listdir(tmp_path)  # refused before anything was written


def test_nan_is_never_best():
    r = Retention(keep_best=1, best_metric="loss", best_mode="max")
    assert r.best({1: {"loss": math.nan}, 2: {"loss": 1.0}, 3: {"loss": True}}) == [2]


@pytest.mark.parametrize("mode, best", [("min", -math.inf), ("max", math.inf)])
def test_an_infinite_metric_is_the_extreme_it_is(tmp_path, mode, best):
    """A loss of -inf is the lowest there is (and an accuracy of +inf the highest): kept
    as the best, never passed over as if it were NaN."""
    with safeckpt.CheckpointManager(tmp_path, keep_last=1, keep_best=1, best_metric="m", best_mode=mode) as mgr:
        for step, value in ((1, 1.0), (2, best), (3, 0.5), (4, -best), (5, 2.0)):
            mgr.save(step, _state(step), metrics={"m": value})
    assert mgr.steps() == [2, 5]
    assert Retention(keep_best=2, best_metric="m", best_mode=mode).best(
        {1: {"m": 1.0}, 2: {"m": best}, 3: {"m": -best}}) == [2, 1, 3]
