"""Async saves: true snapshots, errors that never disappear, reused staging buffers,
one save in flight, SIGKILL during async saves, concurrent collectives, logging."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import safeckpt
from safeckpt.run import writer
from safeckpt.storage.local import LocalStorage
from safeckpt.testing import FaultyStorage

import writer_faults  # tests/helpers
from async_child import HERE as CHILD, AsyncForkServer, fill, read_log
from save_child import make_state, make_template, state_mismatch

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def async_server():
    server = AsyncForkServer(src=SRC)
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _no_error_left_behind():
    """A test must never leave an unseen error in the shared ``async_save`` saver."""
    yield
    from safeckpt.run import asyncsave
    if asyncsave._default is not None:
        asyncsave._default.wait()


def _wait_done(fut, timeout: float = 60.0) -> None:
    """Wait for a future without looking at its outcome (``result``/``exception`` would
    count as having seen its error)."""
    done, _ = concurrent.futures.wait([fut], timeout=timeout)
    assert done, "the async save did not finish"


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --------------------------------------------------------------------------- snapshots

BIG_F32 = 25_000_000   # 100 MB
BIG_I64 = 12_500_000   # 100 MB


def _big_state() -> dict:
    return {
        "model": {"a": torch.arange(BIG_F32, dtype=torch.float32),
                  "b": torch.arange(BIG_I64, dtype=torch.int64) * 3},
        "small": [torch.full((33 + i,), float(i)) for i in range(8)],
        "step": 100,
        "name": "at call time",
        "cfg": {"lr": 0.5},
    }


def test_async_save_is_a_snapshot_at_call_time(tmp_path, async_mode):
    state = _big_state()
    path = tmp_path / "ckpt"
    fut = safeckpt.async_save(state, path)
    # the training goes on at once: every tensor changes in place, values are replaced
    running = not fut.done()
    state["model"]["a"].add_(1.0)
    state["model"]["b"].neg_()
    for t in state["small"]:
        t.fill_(-7.0)
    state["step"] = 999
    state["name"] = "changed"
    state["cfg"]["lr"] = 0.1
    state["model"]["a"] = torch.zeros(3)  # and a tensor is replaced by another one

    assert isinstance(fut, concurrent.futures.Future) and isinstance(fut, safeckpt.SaveFuture)
    info = fut.result(timeout=120)
    assert isinstance(info, safeckpt.CheckpointInfo)
    assert info.bytes >= 200_000_000
    assert running, "the save committed before the call returned: nothing was in the background"
    assert 0 < fut.blocked_seconds < info.seconds, (fut.blocked_seconds, info.seconds)

    got = safeckpt.load_state(path)
    assert torch.equal(got["model"]["a"], torch.arange(BIG_F32, dtype=torch.float32))
    assert torch.equal(got["model"]["b"], torch.arange(BIG_I64, dtype=torch.int64) * 3)
    for i, t in enumerate(got["small"]):
        assert torch.equal(t, torch.full((33 + i,), float(i)))
    assert got["step"] == 100 and got["name"] == "at call time" and got["cfg"] == {"lr": 0.5}
    assert safeckpt.verify(path).ok


def test_manager_async_save_is_a_snapshot(tmp_path, async_mode):
    held = tmp_path / "run@held"  # the background write starts only after the mutation
    with safeckpt.CheckpointManager(held, async_save=True) as mgr:
        state = make_state(1)
        fut = mgr.save(1, state, metrics={"loss": 1.0})
        assert isinstance(fut, safeckpt.SaveFuture)
        fill(state, 2)  # changed in place right after the call, before a byte is written
        assert not fut.done()
        writer_faults.release(held)
        info = fut.result(timeout=60)
        assert info.step == 1 and isinstance(info, safeckpt.CheckpointInfo)
        assert fut.blocked_seconds <= info.seconds
        mgr.save(2, state).result(timeout=60)
        fill(state, 3)
        assert mgr.steps() == [1, 2]
        assert state_mismatch(safeckpt.load_state(mgr.path(1)), 1) is None
        assert state_mismatch(safeckpt.load_state(mgr.path(2)), 2) is None
        template = make_template()
        assert mgr.restore(template) == 2
        assert state_mismatch(template, 2) is None


# --------------------------------------------------------------------------- errors


def test_result_raises_the_background_error(tmp_path, async_mode):
    fut = safeckpt.async_save(make_state(1), tmp_path / "x@full")
    with pytest.raises(safeckpt.StorageError) as err:
        fut.result(timeout=60)
    assert err.value.errno == errno.ENOSPC
    assert "full" in str(err.value) and str(tmp_path / "x@full") in str(err.value)
    with pytest.raises(safeckpt.CheckpointNotFoundError):
        safeckpt.load_state(tmp_path / "x@full")  # nothing committed
    # seen once, never raised again: the next save just works
    info = safeckpt.async_save(make_state(2), tmp_path / "ok").result(timeout=60)
    assert info.bytes > 0
    assert state_mismatch(safeckpt.load_state(tmp_path / "ok"), 2) is None


def test_unseen_async_save_error_is_raised_by_the_next_async_save(tmp_path, async_mode):
    fut = safeckpt.async_save(make_state(1), tmp_path / "x@full")
    _wait_done(fut)
    with pytest.raises(safeckpt.StorageError):
        safeckpt.async_save(make_state(2), tmp_path / "next")
    # raised once; the following save works
    safeckpt.async_save(make_state(3), tmp_path / "next").result(timeout=60)
    assert state_mismatch(safeckpt.load_state(tmp_path / "next"), 3) is None


def _failed_unseen_save(tmp_path) -> tuple[safeckpt.CheckpointManager, object]:
    """An async manager with step 1 committed and step 2 failed (ENOSPC), unseen; its
    disk works again afterwards."""
    root = tmp_path / "run@full"
    writer_faults.heal(root)
    mgr = safeckpt.CheckpointManager(root, async_save=True)
    mgr.save(1, make_state(1)).result(timeout=60)
    writer_faults.fail(root)
    fut = mgr.save(2, make_state(2))
    _wait_done(fut)
    writer_faults.heal(root)
    assert mgr.steps() == [1]
    return mgr, fut


def test_unseen_error_is_raised_by_the_next_manager_save(tmp_path, async_mode):
    mgr, _ = _failed_unseen_save(tmp_path)
    with pytest.raises(safeckpt.StorageError) as err:
        mgr.save(3, make_state(3))
    assert err.value.errno == errno.ENOSPC
    mgr.wait()  # seen: not raised again
    assert mgr.steps() == [1], "the save that raised the old error must not have started"
    mgr.save(3, make_state(3)).result(timeout=60)
    mgr.close()
    assert mgr.steps() == [1, 3]


def test_unseen_error_is_raised_by_wait_once(tmp_path, async_mode):
    mgr, _ = _failed_unseen_save(tmp_path)
    with pytest.raises(safeckpt.StorageError):
        mgr.wait()
    assert mgr.wait() is None
    mgr.save(3, make_state(3)).result(timeout=60)
    mgr.close()
    assert mgr.steps() == [1, 3]


def test_unseen_error_is_raised_by_close_once(tmp_path, async_mode):
    mgr, _ = _failed_unseen_save(tmp_path)
    with pytest.raises(safeckpt.StorageError):
        mgr.close()
    mgr.close()  # closed; nothing to raise twice
    with pytest.raises(RuntimeError):
        mgr.save(3, make_state(3))


def test_error_seen_through_result_is_not_raised_again(tmp_path, async_mode):
    mgr, fut = _failed_unseen_save(tmp_path)
    assert isinstance(fut.exception(), safeckpt.StorageError)  # looked at: seen
    assert mgr.wait() is None
    mgr.save(3, make_state(3)).result(timeout=60)
    mgr.close()
    assert mgr.steps() == [1, 3]


def test_faulty_storage_enospc_reaches_the_future(tmp_path):
    storage = FaultyStorage(LocalStorage(tmp_path / "run"))
    mgr = safeckpt.CheckpointManager(storage, async_save=True, keep_last=1)
    mgr.save(1, make_state(1)).result(timeout=60)
    storage.inject("write_file", errno.ENOSPC, path="data-")
    fut = mgr.save(2, make_state(2))
    with pytest.raises(safeckpt.StorageError) as err:
        fut.result(timeout=60)
    assert err.value.errno == errno.ENOSPC
    storage.faults.clear()
    assert mgr.steps() == [1]  # the previous checkpoint is untouched (and not retired)
    template = make_template()
    assert mgr.restore(template) == 1 and state_mismatch(template, 1) is None
    mgr.close()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_unseen_error_is_printed_at_exit(tmp_path, mode):
    proc = subprocess.run([sys.executable, str(CHILD), "fail_unobserved", str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                               writer.ENV: mode})
    assert "returned" in proc.stdout, proc.stderr
    err = proc.stderr
    # both failed saves (the async_save one and the manager's) are reported, with the cause
    reported = [line for line in err.splitlines() if "safeckpt" in line and "fail" in line]
    assert len(reported) >= 2, err
    assert str(tmp_path / "plain@full") in err, err
    assert str(tmp_path / "run@full") in err, err
    assert "disk is full" in err or "ENOSPC" in err or "No space" in err, err
    assert "seen" in proc.stdout and str(tmp_path / "seen@full") not in err, "a seen error was reported again"


# --------------------------------------------------------------------------- buffers, one in flight


def _tensor_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in
               [state["model"]["w"], state["model"]["r"], *state["small"]])


def _staging(saver) -> tuple[dict, int]:
    """Where a saver's staging copy lives (buffer -> address) and its size in bytes: the
    shared buffer of saves the writer process commits, else host buffers of this process."""
    buffer = saver.arena.buffer
    if buffer is not None:
        assert not saver.pool.buffers, "two staging copies"
        return {buffer.id: buffer.address}, buffer.size
    return {name: (id(buf), buf.data_ptr()) for name, buf in saver.pool.buffers.items()}, saver.pool.nbytes


def test_staging_buffers_are_reused_and_one_save_is_in_flight(tmp_path, async_mode):
    held = tmp_path / "run@held"
    mgr = safeckpt.CheckpointManager(held, async_save=True)
    state = make_state(1)
    fut1 = mgr.save(1, state)
    first, nbytes = _staging(mgr._saver)
    assert first and nbytes == _tensor_bytes(state)  # the documented bound: one copy
    assert not fut1.done()  # held before its data file

    threading.Timer(0.5, writer_faults.release, args=(held,)).start()
    fill(state, 2)
    started = time.perf_counter()
    fut2 = mgr.save(2, state)
    waited = time.perf_counter() - started
    assert fut1.done(), "a second save started while the first was still in flight"
    assert waited >= 0.3, f"the second save returned after {waited:.3f}s, before the first committed"
    assert fut1.result().step == 1
    assert _staging(mgr._saver) == (first, nbytes), "the staging buffers were reallocated for the same state"
    assert fut2.result(timeout=60).step == 2
    mgr.close()
    assert state_mismatch(safeckpt.load_state(mgr.path(1)), 1) is None
    assert state_mismatch(safeckpt.load_state(mgr.path(2)), 2) is None


def test_async_save_function_reuses_its_buffers(tmp_path, async_mode):
    from safeckpt.run import asyncsave
    state = make_state(1)
    safeckpt.async_save(state, tmp_path / "a").result(timeout=60)
    first, nbytes = _staging(asyncsave._default)
    assert first
    assert nbytes >= _tensor_bytes(state)
    fill(state, 2)
    safeckpt.async_save(state, tmp_path / "b").result(timeout=60)
    assert _staging(asyncsave._default) == (first, nbytes)
    assert state_mismatch(safeckpt.load_state(tmp_path / "a"), 1) is None
    assert state_mismatch(safeckpt.load_state(tmp_path / "b"), 2) is None


def test_async_save_function_keeps_one_save_in_flight(tmp_path, async_mode):
    held = tmp_path / "first@held"
    fut1 = safeckpt.async_save(make_state(1), held)
    assert not fut1.done()
    threading.Timer(0.5, writer_faults.release, args=(held,)).start()
    started = time.perf_counter()
    fut2 = safeckpt.async_save(make_state(2), tmp_path / "second")
    assert fut1.done() and time.perf_counter() - started >= 0.3
    assert fut2.result(timeout=60).path.endswith("second")
    assert state_mismatch(safeckpt.load_state(held), 1) is None
    assert state_mismatch(safeckpt.load_state(tmp_path / "second"), 2) is None


def test_async_saves_from_two_threads_at_once_each_commit_their_own_state(tmp_path, monkeypatch, async_mode):
    """Thread A is held just after its state was copied into the shared saver's host
    buffers, before its save starts; thread B calls ``async_save`` meanwhile. B must not
    copy its state into the buffers A's save is about to write (it used to: A committed
    B's bytes, with checksums computed over them)."""
    from safeckpt.protocol.arena import ArenaStaging
    from safeckpt.protocol.staging import StagingPool
    stager = ArenaStaging if async_mode == "process" else StagingPool
    real = stager.stage
    a_staged, b_returned = threading.Event(), threading.Event()

    def stage(self, layout):
        staged = real(self, layout)
        if threading.current_thread().name == "A":
            a_staged.set()
            b_returned.wait(1.0)  # B cannot return before A's save started: A goes on after 1 s
        return staged

    monkeypatch.setattr(stager, "stage", stage)
    states = {name: make_state(i + 1) for i, name in enumerate("AB")}
    futures = {}

    def save(name: str) -> None:
        futures[name] = safeckpt.async_save(states[name], tmp_path / name)
        if name == "B":
            b_returned.set()
        fill(states[name], 9)  # the call returned: the training changes its state

    a = threading.Thread(target=save, args=("A",), name="A")
    a.start()
    assert a_staged.wait(60)
    b = threading.Thread(target=save, args=("B",), name="B")
    b.start()
    a.join(60)
    b.join(60)
    for i, name in enumerate("AB"):
        futures[name].result(timeout=60)
        assert state_mismatch(safeckpt.load_state(tmp_path / name), i + 1) is None, name
        assert safeckpt.verify(tmp_path / name).ok, name


def test_the_shared_saver_is_made_once_whichever_threads_call_first(tmp_path, monkeypatch):
    """``async_save`` calls share one saver (one save in flight, one set of buffers), even
    when several threads make the first call at once."""
    from safeckpt.run import asyncsave
    monkeypatch.setattr(asyncsave, "_default", None)
    made = []
    real_init = asyncsave.AsyncSaver.__init__

    def init(self):
        made.append(self)
        time.sleep(0.2)  # a slow first construction: the others call meanwhile
        real_init(self)

    monkeypatch.setattr(asyncsave.AsyncSaver, "__init__", init)
    barrier = threading.Barrier(3)
    futures = []

    def save(i: int) -> None:
        barrier.wait()
        futures.append(safeckpt.async_save({"w": torch.full((8,), float(i))}, tmp_path / str(i)))

    threads = [threading.Thread(target=save, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(futures) == 3 and all(f.result(timeout=60) for f in futures)
    assert len(made) == 1, f"{len(made)} shared savers were made"
    for i in range(3):
        assert torch.equal(safeckpt.load_state(tmp_path / str(i))["w"], torch.full((8,), float(i)))


# --------------------------------------------------------------------------- SIGKILL


def _kill_during_async_saves(server, tmp_path: Path, kills: int, seed: int) -> None:
    """Kill after kill, the saves of one run go to the writer process, then to a thread
    (the child's writer process is started before the loop of saves: seconds)."""
    rng = random.Random(seed)
    root = tmp_path / "run"
    committed_seen: list[int] = []
    for i in range(kills):
        progress = str(tmp_path / f"progress-{i}")
        pid = server.fork("async_loop", root=str(root), progress=progress, keep_last=2, limit_s=60,
                          writer=("process", "thread")[i % 2])
        _wait_for(lambda: "start" in read_log(progress), 60, "the child to restore")
        time.sleep(rng.uniform(0.0, 1.0))
        res = server.kill(pid)
        err = Path(progress + ".err")
        assert res["signal"] == 9, (res, err.read_text() if err.exists() else "")
        log = read_log(progress)
        assert "fail" not in log, f"kill {i}: an async save failed in the child: {log}"
        assert log["start"] == [committed_seen[-1] + 1 if committed_seen else 0], \
            f"kill {i}: the child resumed at {log['start']}, the last commit was {committed_seen[-1:]}"

        mgr = safeckpt.CheckpointManager(root)
        latest = mgr.latest_step()
        done = log.get("done", [])
        if done:
            assert latest is not None and latest >= max(done), \
                f"kill {i}: step {max(done)} reported committed, newest committed is {latest}"
        if committed_seen:
            assert latest is not None and latest >= committed_seen[-1]
        if latest is not None:
            template = make_template()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert mgr.restore(template) == latest
            # only the save the kill interrupted may be skipped, and only as not committed
            for w in caught:
                assert "not committed" in str(w.message) and str(w.message).count("step ") == 2, \
                    str(w.message)
            problem = state_mismatch(template, latest)
            assert problem is None, f"kill {i}: step {latest} restored wrong: {problem}"
            committed_seen.append(latest)
        mgr.close()
    assert committed_seen and committed_seen[-1] >= kills // 2, \
        f"the run hardly progressed: {committed_seen}"


def test_sigkill_during_async_saves(async_server, tmp_path):
    _kill_during_async_saves(async_server, tmp_path, kills=8, seed=5)


@pytest.mark.slow
def test_sigkill_during_async_saves_many(async_server, tmp_path):
    _kill_during_async_saves(async_server, tmp_path, kills=40, seed=int(time.time()))


# --------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(server, tmp_path: Path, world: int) -> list[dict]:
    root, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    port = _free_port()
    pids = [server.fork("dist_async", rank=r, world=world, port=port, root=str(root), out=str(out),
                        progress=str(out / f"rank{r}"), limit_s=60)
            for r in range(world)]
    exits = [server.wait(pid) for pid in pids]
    reports = []
    for r, ex in enumerate(exits):
        err = out / f"rank{r}.err"
        path = out / f"rank{r}.json"
        assert ex["code"] == 0 and path.exists(), \
            f"rank {r} exited {ex}: {err.read_text() if err.exists() else 'no traceback (hang? see faulthandler)'}"
        reports.append(json.loads(path.read_text()))
    return reports


@pytest.mark.parametrize("world", [2, 4])
def test_async_save_beside_concurrent_collectives(async_server, tmp_path, world):
    from async_child import dist_state
    reports = _run_ranks(async_server, tmp_path, world)
    for rep in reports:
        assert "error" not in rep, f"rank {rep['rank']}: {rep['error']}"
        assert rep["wrong"] == [], f"rank {rep['rank']}: all_reduce gave wrong results {rep['wrong'][:3]}"
        assert [i["step"] for i in rep["info"]] == [1, 2]
        assert all(i["world_size"] == world for i in rep["info"])
        assert rep["steps"] == [2]  # keep_last=1: step 1 retired after step 2 committed
        assert rep["restored"] == 2 and rep["exact"], f"rank {rep['rank']} restored wrong values"
    for k in range(2):  # the collectives really ran while the save was in flight
        assert sum(rep["overlapped"][k] for rep in reports) > 0, [r["overlapped"] for r in reports]
    got = safeckpt.load_state(tmp_path / "run" / "step-000000002")
    want = dist_state(2)
    assert torch.equal(got["model"]["a"], want["model"]["a"]) and got["step"] == 2


# --------------------------------------------------------------------------- logging

_NUM = r"[0-9]+(?:\.[0-9]+)?"


def _save_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "safeckpt"]  # loggers by module


def test_a_manager_save_is_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="safeckpt")
    with safeckpt.CheckpointManager(tmp_path / "run") as mgr:
        info = mgr.save(123, make_state(1))
    msgs = _save_records(caplog)
    hit = [m for m in msgs if re.search(r"\bstep\D{0,3}123\b", m) and str(info.bytes) in m
           and "GB/s" in m and re.search(_NUM + r"\s*s\b", m)]
    assert hit, msgs


def test_an_async_manager_save_is_logged_with_blocked_seconds(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="safeckpt")
    with safeckpt.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        info = mgr.save(456, make_state(1)).result(timeout=60)
    msgs = _save_records(caplog)
    hit = [m for m in msgs if re.search(r"\bstep\D{0,3}456\b", m) and str(info.bytes) in m
           and "GB/s" in m and re.search(r"blocked\D{0,10}" + _NUM, m)]
    assert hit, f"no record names the step, bytes, seconds, GB/s and blocked seconds: {msgs}"


def test_plain_saves_and_loads_are_logged(tmp_path, caplog):
    """Not only the manager: ``save``, ``load`` and ``load_state`` log at INFO too."""
    caplog.set_level(logging.INFO, logger="safeckpt")
    state = make_state(1)
    info = safeckpt.save(state, tmp_path / "c", step=7)
    safeckpt.load(state, tmp_path / "c")
    safeckpt.load_state(tmp_path / "c")
    msgs = _save_records(caplog)
    assert [m for m in msgs if m.startswith("saved step 7: ") and str(info.bytes) in m and "GB/s" in m], msgs
    loads = [m for m in msgs if m.startswith(f"loaded {info.path}: ") and "GB/s" in m]
    assert len(loads) == 2, msgs


@pytest.mark.parametrize("how", ["async_save", "manager"])
def test_a_save_in_flight_when_the_script_ends_is_committed(tmp_path, how):
    """A script whose last line starts an async save of a few MB exits while the save
    still writes; it is finished and committed before the interpreter goes (the save
    needs thread pools, which concurrent.futures closes early in the exit)."""
    path = tmp_path / "ckpt"
    start = {"async_save": f"safeckpt.async_save(state, {str(path)!r})",
             "manager": f"m = safeckpt.CheckpointManager({str(path)!r}, async_save=True); m.save(1, state)"}[how]
    script = ("import torch, safeckpt\n"
              "state = {'w': torch.arange(1 << 21, dtype=torch.float32), 'step': 1}\n" + start + "\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0 and "safeckpt" not in proc.stderr, proc.stderr
    got = safeckpt.load_state(path if how == "async_save" else path / "step-000000001")
    assert torch.equal(got["w"], torch.arange(1 << 21, dtype=torch.float32)) and got["step"] == 1


def test_without_memfd_async_saves_run_on_a_thread(tmp_path):
    """Where no shared memfd buffer can be made (Windows, macOS: no ``os.memfd_create``),
    an async save is snapshotted and committed by a thread of the saving process; no
    writer process starts. A fresh interpreter, as the platform check runs at import."""
    script = f"""
import os, sys, torch
del os.memfd_create  # as on Windows and macOS
import safeckpt
from safeckpt.run import asyncsave, writer
state = {{"w": torch.arange(1 << 20, dtype=torch.float32), "step": 3}}
fut = safeckpt.async_save(state, {str(tmp_path / "ckpt")!r})
state["w"].zero_()  # after the snapshot: never saved
fut.result(timeout=120)
assert not writer.SUPPORTED and writer.current_pid() is None, "a writer process was started"
assert asyncsave._default.arena.buffer is None and asyncsave._default.pool.buffers, "not staged on the thread path"
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr
    got = safeckpt.load_state(tmp_path / "ckpt")
    assert got["step"] == 3 and torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32))
