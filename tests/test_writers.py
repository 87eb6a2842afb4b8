"""Two managers on one root: a live writer elsewhere makes the second fail fast; a
dead one is taken over; a writer that was taken over is fenced and changes nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import safeckpt

from async_child import read_log
from save_child import make_state, make_template, state_mismatch


def _state(step: int) -> dict:
    return {"w": torch.full((8,), float(step)), "step": step}


def _folders(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.name.startswith(("data-", "manifest-"))}


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def holder(fork_server, tmp_path):
    """A live process on this host whose manager keeps saving into ``tmp_path/run``."""
    root = tmp_path / "run"
    progress = str(tmp_path / "holder-progress")
    pid = fork_server.fork("manager_loop", root=str(root), progress=progress, keep_last=2, limit_s=60)
    _wait_for(lambda: read_log_done(progress), 30, "the other job's first commit")
    alive = [True]
    yield root, pid, progress, alive
    if alive[0]:
        fork_server.kill(pid)


def read_log_done(progress: str) -> list[int]:
    return read_log(progress).get("done", [])


def test_a_second_writer_in_a_live_process_fails_fast(holder, fork_server, tmp_path):
    root, pid, progress, _ = holder
    mgr = safeckpt.CheckpointManager(root, keep_last=1)
    started = time.monotonic()
    with pytest.raises(safeckpt.CheckpointExistsError) as err:
        mgr.save(1_000_000, _state(1))
    assert time.monotonic() - started < 10
    assert f"pid {pid}" in str(err.value), str(err.value)
    assert isinstance(err.value, FileExistsError)
    assert not (root / "step-001000000").exists()  # nothing of ours was left behind
    with pytest.raises(safeckpt.CheckpointExistsError, match=f"pid {pid}"):
        mgr.gc()  # nor may it clean up the other job's root
    # the other job goes on undisturbed
    n = len(read_log_done(progress))
    _wait_for(lambda: len(read_log_done(progress)) > n + 1, 30, "the other job to keep saving")
    mgr.close()


def test_an_async_second_writer_fails_fast_too(holder):
    root, pid, _, _ = holder
    mgr = safeckpt.CheckpointManager(root, async_save=True)
    with pytest.raises(safeckpt.CheckpointExistsError, match=f"pid {pid}"):
        mgr.save(1_000_000, _state(1)).result(timeout=60)
    mgr.close()


def test_the_lease_of_a_dead_process_is_taken_over(holder, fork_server):
    root, pid, progress, alive = holder
    fork_server.kill(pid)  # the other job is gone (and reaped)
    alive[0] = False
    done = read_log_done(progress)
    with pytest.warns(UserWarning, match="another run"):
        mgr = safeckpt.CheckpointManager(root, keep_last=1)
        mgr.save(1_000_000, make_state(1))
        mgr.save(1_000_001, make_state(2))
    assert mgr.steps()[-1] == 1_000_001 and 1_000_000 not in mgr.steps()
    # the dead job's checkpoints (another run) are left alone; its newest restores exactly
    theirs = [s for s in mgr.steps() if s < 1_000_000]
    assert theirs and max(theirs) >= max(done)
    assert state_mismatch(safeckpt.load_state(mgr.path(max(theirs))), max(theirs)) is None
    mgr.close()


def test_a_writer_that_was_taken_over_is_fenced(tmp_path):
    root = tmp_path / "run"
    first = safeckpt.CheckpointManager(root, keep_last=1)
    first.save(1, _state(1))
    first.save(2, _state(2))
    assert _folders(root) == [2]

    second = safeckpt.CheckpointManager(root, keep_last=1)  # the same process: takes over
    assert second.restore(_state(-1)) == 2  # continues the run (same run id as the first)
    second.save(3, _state(3))
    assert _folders(root) == [3]
    snapshot = _tree(root)

    with pytest.raises(safeckpt.CheckpointExistsError, match="no longer owns"):
        first.save(4, _state(4))
    assert _tree(root) == snapshot and _folders(root) == [3]  # nothing written, nothing deleted
    with pytest.raises(safeckpt.CheckpointExistsError):
        first.save(3, _state(33))  # cannot overwrite the second one's checkpoint
    with pytest.raises(safeckpt.CheckpointExistsError):
        first.gc()
    assert _tree(root) == snapshot

    second.save(5, _state(5))  # the new holder is unaffected
    assert _folders(root) == [5]
    first.close()
    second.close()


def test_a_fenced_writer_cannot_delete(tmp_path):
    root = tmp_path / "run"
    first = safeckpt.CheckpointManager(root)
    first.save(1, _state(1))
    second = safeckpt.CheckpointManager(root)
    second.save(2, _state(2))
    with pytest.raises(safeckpt.CheckpointExistsError):
        first.delete(2)
    assert _folders(root) == [1, 2]
    first.close()
    second.close()


def test_a_fenced_async_writer_raises_and_retains_nothing(tmp_path):
    root = tmp_path / "run"
    first = safeckpt.CheckpointManager(root, keep_last=1, async_save=True)
    first.save(1, make_state(1)).result(timeout=60)
    second = safeckpt.CheckpointManager(root, keep_last=1)
    with pytest.warns(UserWarning, match="another run"):
        second.save(2, make_state(2))  # another run, takes the root
    snapshot = _tree(root)
    with pytest.raises(safeckpt.CheckpointExistsError, match="no longer owns"):
        first.save(3, make_state(3))  # fenced: refused before anything is written
    assert _tree(root) == snapshot
    assert _folders(root) == [1, 2], "the failed async save left its (empty) step folder behind"
    first.close()
    t = make_template()
    assert second.restore(t) == 2 and state_mismatch(t, 2) is None
    second.close()


def _lease(pid: object) -> bytes:
    import json
    import socket

    from safeckpt.protocol.leftovers import THIS_HOST
    return json.dumps({"run_id": "r", "host": THIS_HOST, "pid": pid, "token": "t", "created": 1.0,
                       "hostname": socket.gethostname()}).encode()


UNREADABLE_LEASES = {"pid as a string": _lease(str(os.getpid())), "pid 2**70": _lease(2**70),
                     "pid 0 (the process group)": _lease(0), "pid -1 (every process)": _lease(-1),
                     "pid 1.5": _lease(1.5), "pid true": _lease(True), "a JSON list": b"[1, 2]",
                     "not JSON": b"\xff{", "nested too deeply": b"[" * 100_000,
                     "too big to be a lease": _lease(os.getpid()) + b" " * (1 << 20),
                     "a folder under a lease's name": None}


@pytest.mark.parametrize("kind", list(UNREADABLE_LEASES))
def test_an_unreadable_lease_is_taken_over(tmp_path, kind):
    """docs/format.md §2.7: a lease that cannot be read is taken over (with a warning),
    never asked about (pid 0 and -1 ask for a process group, every process: alive) and
    never a crash (TypeError, OverflowError) or a root blocked for good."""
    root = tmp_path / "run"
    root.mkdir()
    lease = root / "safeckpt-writer-000000001.json"
    if UNREADABLE_LEASES[kind] is None:
        lease.mkdir()
        (lease / "keep").write_bytes(b"x")
    else:
        lease.write_bytes(UNREADABLE_LEASES[kind])
    with pytest.warns(safeckpt.LeaseWarning, match="safeckpt-writer-000000001.json is not a readable writer lease"):
        mgr = safeckpt.CheckpointManager(root)
        mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert mgr.steps() == [1, 2] and (root / "safeckpt-writer-000000002.json").is_file()
    if UNREADABLE_LEASES[kind] is None:
        assert (lease / "keep").read_bytes() == b"x"  # not ours: never deleted
    mgr.close()
