"""Preemption: SIGTERM to a real training process makes it save its current step,
commit what is in flight and exit 0; the previous SIGTERM handler comes back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import safeckpt

from async_child import HERE as CHILD, read_log
from save_child import make_state, make_template, state_mismatch

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the child exited {proc.returncode} while waiting for {what}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_sigterm_makes_a_training_process_save_and_exit(tmp_path):
    root, progress = tmp_path / "run", str(tmp_path / "progress")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, str(CHILD), "train", str(root), progress],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        # let it train and start a few async saves, then preempt it mid-run
        _wait_for(lambda: len(read_log(progress).get("snap", [])) >= 2, 90, "two saves", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{err}"
    log = read_log(progress)
    final = log["final"][0]
    assert f"final {final}" in out
    assert log["committed"] == [final], "close() returned before the final save committed"
    assert log["handler_restored"] == [1], "close() did not restore the previous SIGTERM handler"
    assert final > max(log["snap"]), "the final save is of the step the loop was at"

    with safeckpt.CheckpointManager(root) as mgr:
        steps = mgr.steps()
        assert steps[-1] == final
        assert all(s in steps for s in log["snap"][-1:])  # the last periodic save committed too
        template = make_template()
        assert mgr.restore(template) == final
        assert state_mismatch(template, final) is None
        assert safeckpt.verify(mgr.path(final)).ok


def test_sigterm_sets_preempted_and_the_old_handler_comes_back(tmp_path):
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGTERM, previous)
    try:
        mgr = safeckpt.CheckpointManager(tmp_path / "run", handle_sigterm=True, async_save=True)
        assert signal.getsignal(signal.SIGTERM) is not previous
        assert not mgr.preempted
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not mgr.preempted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mgr.preempted and seen == []  # the manager took it; the process goes on
        fut = mgr.save(7, make_state(7))
        mgr.close()
        assert fut.done() and fut.result().step == 7
        assert signal.getsignal(signal.SIGTERM) is previous
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_without_handle_sigterm_the_handler_is_untouched(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with safeckpt.CheckpointManager(tmp_path / "run") as mgr:
        assert signal.getsignal(signal.SIGTERM) is before
        assert not mgr.preempted


def test_the_default_handler_comes_back_after_close(tmp_path):
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        mgr = safeckpt.CheckpointManager(tmp_path / "run", handle_sigterm=True)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.parametrize("order", ["lifo", "fifo"])
def test_two_managers_restore_the_original_handler(tmp_path, order):
    def original(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, original)
    try:
        a = safeckpt.CheckpointManager(tmp_path / "a", handle_sigterm=True)
        b = safeckpt.CheckpointManager(tmp_path / "b", handle_sigterm=True)
        for m in ((b, a) if order == "lifo" else (a, b)):
            m.close()
        assert signal.getsignal(signal.SIGTERM) is original
    finally:
        signal.signal(signal.SIGTERM, old)
