"""SIGKILL of a real process at random moments while it saves checkpoints.

A child process (forked from tests/helpers/save_child.py's server, so it pays no
``import torch``) saves step after step with ``CheckpointManager(keep_last=2)``; the
test SIGKILLs it after a seeded random delay, then restores with a fresh manager. The
newest committed step must come back with exactly that step's values, nothing
half-written may ever load, and the run must be able to go on saving.
"""

from __future__ import annotations

import os
import random
import signal
import time
import warnings
from pathlib import Path

import pytest

import safeckpt
from save_child import make_state, make_template, read_progress, state_mismatch

SEED = 20240611


def _wait_for_begins(progress: str, count: int, pid: int, timeout: float = 20.0) -> None:
    """Block until the child has begun its ``count``-th save."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        begun, _ = read_progress(progress)
        if len(begun) >= count:
            return
        if os.path.exists(progress + ".err"):
            return
        time.sleep(0.001)
    raise AssertionError(f"child {pid} did not begin save #{count} within {timeout}s")


def _check_child_was_killed(status: dict, progress: str) -> None:
    if status["signal"] != signal.SIGKILL:
        err = progress + ".err"
        detail = Path(err).read_text() if os.path.exists(err) else "(no traceback)"
        raise AssertionError(f"the saving child ended on its own ({status}) before the kill:\n{detail}")


def _restore_and_check(root: str, last_done: int | None, in_flight: int | None) -> int | None:
    """Restore with a fresh manager and check every invariant; return the restored step."""
    mgr = safeckpt.CheckpointManager(root, keep_last=2)
    state = make_template()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        restored = mgr.restore(state)
    latest = mgr.latest_step()
    assert restored == latest, f"restore() returned {restored} but latest_step() says {latest}"
    allowed = {s for s in (last_done, in_flight) if s is not None}
    if restored is None:
        assert last_done is None, f"step {last_done} had committed, but restore() found nothing"
    else:
        assert restored in allowed, (
            f"restored step {restored}; the last save known to have returned was {last_done} "
            f"and the one in flight {in_flight}")
        problem = state_mismatch(state, restored)
        assert problem is None, f"restored step {restored}: {problem}"
    # every checkpoint the manager calls committed must load whole and verify
    # (more than keep_last may be committed: a kill between a commit and its retention
    # leaves the old ones for the next successful save to delete)
    committed = mgr.steps()
    assert not committed or committed[-1] == restored
    for step in committed:
        problem = state_mismatch(safeckpt.load_state(mgr.path(step)), step)
        assert problem is None, f"committed step {step}: {problem}"
    return restored


def _kill_loop(fork_server, tmp_path, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    root = str(tmp_path / "run")
    save_s = fork_server.calibrate(str(tmp_path / "calibrate"))
    last_done: int | None = None
    stats = {"before_first_commit": 0, "inside_save": 0, "elsewhere": 0}
    for i in range(kills):
        progress = str(tmp_path / f"progress-{i}.txt")
        pid = fork_server.fork("manager_loop", root=root, progress=progress)
        if i < 2 or rng.random() < 0.6:
            # aimed: a random moment inside the k-th save of this child (the first
            # kills of the run land inside the very first save: before any commit)
            k = 1 if i < 2 else rng.randint(1, 3)
            _wait_for_begins(progress, k, pid)
            time.sleep(rng.uniform(0.0, 1.1 * save_s))
        else:
            # anywhere: making the state, saving, retention
            time.sleep(rng.uniform(0.0, 4.0 * save_s))
        status = fork_server.kill(pid)
        _check_child_was_killed(status, progress)
        begun, done = read_progress(progress)
        in_flight = begun[-1] if begun and (not done or done[-1] != begun[-1]) else None
        if done:
            last_done = done[-1]
        if last_done is None:
            stats["before_first_commit"] += 1
        elif in_flight is not None:
            stats["inside_save"] += 1
        else:
            stats["elsewhere"] += 1
        restored = _restore_and_check(root, last_done, in_flight)
        if restored is not None:
            last_done = restored
    # the run goes on: a resumed manager saves the next step and restores it
    mgr = safeckpt.CheckpointManager(root, keep_last=2)
    mgr.restore(make_template())
    nxt = 0 if last_done is None else last_done + 1
    mgr.save(nxt, make_state(nxt))
    state = make_template()
    assert mgr.restore(state) == nxt
    assert state_mismatch(state, nxt) is None
    assert mgr.steps()[-1] == nxt and len(mgr.steps()) <= 2
    print(f"{kills} kills, save takes {save_s * 1000:.0f} ms: {stats}; last step {nxt}")
    assert stats["inside_save"] > 0, f"no kill landed inside a save: {stats}"


def test_sigkill_during_manager_saves(fork_server, tmp_path):
    _kill_loop(fork_server, tmp_path, kills=20, seed=SEED)


@pytest.mark.slow
def test_sigkill_during_manager_saves_many(fork_server, tmp_path):
    _kill_loop(fork_server, tmp_path, kills=100, seed=SEED + 1)


def overwrite_kill_loop(fork_server, tmp_path, kills: int, seed: int, where: "Path | None" = None) -> None:
    """SIGKILL a child overwriting one checkpoint (on ``where``: another filesystem,
    default ``tmp_path``) at random moments; after each kill the path loads the last
    value saved or the one in flight, never a mix, and verifies."""
    rng = random.Random(seed)
    where = tmp_path if where is None else where
    path = str(where / "one")
    save_s = fork_server.calibrate(str(where / "calibrate"))
    last_done: int | None = None
    value = 0
    for i in range(kills):
        progress = str(tmp_path / f"progress-{i}.txt")
        pid = fork_server.fork("overwrite_loop", path=path, progress=progress, start=value)
        _wait_for_begins(progress, 1 if i == 0 else rng.randint(1, 3), pid)
        time.sleep(rng.uniform(0.0, 1.1 * save_s))
        status = fork_server.kill(pid)
        _check_child_was_killed(status, progress)
        begun, done = read_progress(progress)
        in_flight = begun[-1] if begun and (not done or done[-1] != begun[-1]) else None
        if done:
            last_done = done[-1]
        value = (begun[-1] if begun else value) + 1
        if last_done is None and not os.path.exists(path):
            continue
        try:
            state = safeckpt.load_state(path)
        except safeckpt.CheckpointNotFoundError:
            assert last_done is None, f"value {last_done} had committed at {path}, now nothing loads"
            continue
        got = state["step"]
        assert got in {last_done, in_flight}, (
            f"loaded value {got}; last returned save {last_done}, in flight {in_flight}")
        problem = state_mismatch(state, got)
        assert problem is None, f"a mix after a kill during overwrite: {problem}"
        assert safeckpt.verify(path).ok
        last_done = got
    # and the path can still be overwritten
    safeckpt.save(make_state(value), path, overwrite=True)
    assert state_mismatch(safeckpt.load_state(path), value) is None


def test_sigkill_during_overwrite_loads_old_or_new_never_a_mix(fork_server, tmp_path):
    overwrite_kill_loop(fork_server, tmp_path, kills=8, seed=SEED + 2)


@pytest.mark.slow
def test_sigkill_during_overwrite_many(fork_server, tmp_path):
    overwrite_kill_loop(fork_server, tmp_path, kills=50, seed=SEED + 3)


def test_sigkill_between_manifest_create_and_write_of_the_first_save(fork_server, tmp_path):
    """The first save of a run dies after creating its manifest file and before writing
    a byte to it. Nothing was ever committed, so a restart must start fresh (restore
    returns None, with a warning), not fail forever on the empty file."""
    root = tmp_path / "run"
    folder = root / "step-000000000"
    pid = fork_server.fork("crash_at", path=str(folder), value=0, point="empty_manifest",
                           overwrite=False)
    status = fork_server.wait(pid)
    assert status["signal"] == signal.SIGKILL, status
    assert (folder / "manifest-000001.json").stat().st_size == 0
    mgr = safeckpt.CheckpointManager(root, keep_last=2)
    assert mgr.latest_step() is None and mgr.steps() == []
    with pytest.warns(UserWarning, match="step 0"):
        assert mgr.restore(make_template()) is None
    mgr.save(0, make_state(0))
    state = make_template()
    assert mgr.restore(state) == 0
    assert state_mismatch(state, 0) is None


@pytest.mark.parametrize("resume", ["next", pytest.param("same", marks=pytest.mark.slow)])  # ~10 s each
def test_the_readme_training_loop_survives_kills(fork_server, tmp_path, resume):
    """The README's loop, SIGKILLed at random moments and restarted each time, ends with
    the weights of an uninterrupted run (``next``); written as ``restore(state) or 0``
    (``same``), each restart saves the restored step again, which replaces it."""
    import torch

    rng = random.Random(SEED)
    total, every = 4000, 20
    reference = tmp_path / "reference.pt"
    assert fork_server.wait(fork_server.fork("readme_loop", root=str(tmp_path / "ref"), result=str(reference),
                                             total=total, every=every, resume=resume))["code"] == 0
    result = tmp_path / "result.pt"
    kills = 0
    for attempt in range(12):
        pid = fork_server.fork("readme_loop", root=str(tmp_path / "run"), result=str(result), total=total,
                               every=every, resume=resume)
        if attempt < 6:
            time.sleep(rng.uniform(0.05, 0.6))
            status = fork_server.kill(pid)
            kills += status["signal"] == signal.SIGKILL
            if status["signal"] != signal.SIGKILL:
                assert status["code"] == 0, status
                break
        else:
            status = fork_server.wait(pid)
            assert status["code"] == 0, f"a restart of the loop failed: {status}"
            break
    assert kills >= 3, "the loop finished before it could be killed: make it longer"
    assert result.exists()
    got, want = torch.load(result), torch.load(reference)
    if resume == "next":
        assert all(torch.equal(got[k], want[k]) for k in want), "the resumed run differs from an uninterrupted one"
    assert safeckpt.CheckpointManager(tmp_path / "run").latest_step() == (total - 1) // every * every
