"""CheckpointManager: naming, listing, restore choice, retention."""

import os

import pytest
import torch

import safeckpt


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


def _step_folders(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def test_empty_root_restores_nothing(tmp_path):
    mgr = safeckpt.CheckpointManager(tmp_path / "run")
    state = _state(0)
    assert mgr.restore(state) is None
    assert mgr.steps() == [] and mgr.latest_step() is None
    assert torch.equal(state["w"], torch.zeros(4))


def test_steps_are_zero_padded_and_sorted_numerically(tmp_path):
    mgr = safeckpt.CheckpointManager(tmp_path)
    for step in (10000, 9, 9000):
        mgr.save(step, _state(step))
    assert _step_folders(tmp_path) == ["step-000000009", "step-000009000", "step-000010000"]
    assert mgr.steps() == [9, 9000, 10000]
    assert mgr.latest_step() == 10000


def test_restore_newest_and_by_step(tmp_path):
    with safeckpt.CheckpointManager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
        state = _state(0)
        assert mgr.restore(state) == 3
        assert state["step"] == 3 and torch.equal(state["w"], torch.full((4,), 3.0))
        assert mgr.restore(state, step=2) == 2
        assert state["step"] == 2 and torch.equal(state["w"], torch.full((4,), 2.0))
        with pytest.raises(safeckpt.CheckpointNotFoundError):
            mgr.restore(state, step=7)


def test_keep_last_keeps_newest(tmp_path):
    mgr = safeckpt.CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        mgr.save(step, _state(step))
    assert mgr.steps() == [4, 5]
    assert _step_folders(tmp_path) == ["step-000000004", "step-000000005"]


def test_a_run_replaces_its_own_step_but_never_another_runs(tmp_path):
    mgr = safeckpt.CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    mgr.save(1, _state(2))  # the same run saves step 1 again: replaced atomically
    state = _state(0)
    mgr.restore(state)
    assert state["step"] == 2
    assert len([n for n in os.listdir(mgr.path(1)) if n.startswith("manifest-")]) == 1
    other = safeckpt.CheckpointManager(tmp_path)  # a new run that did not restore
    with pytest.raises(safeckpt.CheckpointExistsError, match="committed checkpoint exists"):
        other.save(1, _state(3))
    mgr.restore(state)
    assert state["step"] == 2


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        safeckpt.CheckpointManager(tmp_path, keep_last=0)
    mgr = safeckpt.CheckpointManager(tmp_path)
    with pytest.raises(ValueError):
        mgr.save(-1, _state(1))
    mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(1, _state(1))


def test_metrics_and_metadata_are_recorded(tmp_path):
    mgr = safeckpt.CheckpointManager(tmp_path)
    info = mgr.save(5, _state(5), metrics={"loss": 0.5}, metadata={"run": "a"})
    assert info.step == 5 and info.bytes > 0 and info.metadata == {"run": "a"}
    from safeckpt.format.folder import read_committed
    from safeckpt.storage import open as open_storage
    m = read_committed(open_storage(mgr.path(5)))
    assert m.step == 5 and m.metrics == {"loss": 0.5} and m.metadata == {"run": "a"}


def test_paths_may_be_str_pathlike_or_file_urls(tmp_path):
    url = "file://" + str(tmp_path / "a b" / "ck")  # a space: not percent-encoded here
    safeckpt.save(_state(3), url)
    for path in (url, tmp_path / "a b" / "ck", str(tmp_path / "a b" / "ck")):
        got = safeckpt.load_state(path)
        assert got["step"] == 3 and torch.equal(got["w"], torch.full((4,), 3.0))
    mgr = safeckpt.CheckpointManager("file://" + str(tmp_path / "run"))
    mgr.save(1, _state(1))
    assert (tmp_path / "run" / "step-000000001").is_dir() and mgr.steps() == [1]


def test_a_run_replaces_a_step_restore_found_damaged(tmp_path):
    """restore() falls back past a corrupt step 200 to 100; the resumed run then saves
    step 200 again, replacing the damaged one, and the next restore takes it."""
    mgr = safeckpt.CheckpointManager(tmp_path)
    mgr.save(100, _state(100))
    mgr.save(200, _state(200))
    (data,) = [p for p in os.listdir(mgr.path(200)) if p.startswith("data-")]
    with open(os.path.join(mgr.path(200), data), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = safeckpt.CheckpointManager(tmp_path)
    state = _state(0)
    with pytest.warns(UserWarning, match="step 200"):
        assert resumed.restore(state) == 100
    resumed.save(200, _state(201))
    state = _state(0)
    assert safeckpt.CheckpointManager(tmp_path).restore(state) == 200 and state["step"] == 201


@pytest.mark.parametrize("kind", ["plain", "async_save", "local"])
def test_a_closed_manager_saves_restores_and_deletes_nothing(tmp_path, kind):
    """After close() (or its with-block) every call that writes, deletes or restores is
    refused with ManagerClosedError, a CheckpointError, and changes nothing; listing the
    root still works."""
    kwargs = {"plain": {}, "async_save": {"async_save": True}, "local": {"local": tmp_path / "local"}}[kind]
    with safeckpt.CheckpointManager(tmp_path / "run", **kwargs) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    calls = {"save": lambda: mgr.save(3, _state(3)), "restore": lambda: mgr.restore(_state(0)),
             "delete": lambda: mgr.delete(1), "gc": mgr.gc}
    for name, call in calls.items():
        with pytest.raises(safeckpt.ManagerClosedError, match="is closed") as err:
            call()
        assert isinstance(err.value, safeckpt.CheckpointError) and isinstance(err.value, RuntimeError), name
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert mgr.steps() == [1, 2]
