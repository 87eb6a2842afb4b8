"""The async writer process (``safeckpt.run.writer``): an async save by one process is
copied into a shared buffer by the caller and committed by another process.

Faults injected on the real processes: the writer SIGKILLed in the middle of a save
and right after its commit, the saving process SIGKILLed with a save in flight, the
interpreter exiting with one in flight, a fork with one in flight, a writer that cannot
start; and states changed in place between saves, which must never be staged by the
layout of the save before (the caller's fast path)."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import safeckpt
import writer_faults  # tests/helpers
from safeckpt.format.folder import read_committed
from safeckpt.protocol.checkpoint import SaveRequest
from safeckpt.run import asyncsave, garbage, writer
from safeckpt.storage import open as open_storage
from safeckpt.storage.local import LocalStorage
from safeckpt.testing import FaultyStorage

pytestmark = pytest.mark.skipif(not writer.SUPPORTED, reason="the writer process needs Linux (memfd)")
SRC = str(Path(safeckpt.__file__).resolve().parent.parent)
HELPERS = str(Path(__file__).resolve().parent / "helpers")


@pytest.fixture(autouse=True)
def _processes(faulty_writer, monkeypatch):
    """Saves go to the writer process (with the faults of writer_faults.py); no test
    leaves an unseen error in the shared saver."""
    monkeypatch.setenv(writer.ENV, "process")
    yield
    if asyncsave._default is not None:
        asyncsave._default.wait()


def _state(seed: int, mib: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(mib << 18, generator=g), "b": torch.randn(300, generator=g)},
            "opt": [torch.full((50 + i,), float(seed * 100 + i)) for i in range(200)],
            "step": seed}


def _same(got: dict, want: dict) -> bool:
    return (got["step"] == want["step"] and torch.equal(got["model"]["w"], want["model"]["w"])
            and torch.equal(got["model"]["b"], want["model"]["b"])
            and all(torch.equal(a, b) for a, b in zip(got["opt"], want["opt"])))


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie no one reaped yet is gone too
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


# -- the writer dies ----------------------------------------------------------------

@pytest.mark.parametrize("when", ["writing its data file", "held before its data file"])
def test_a_writer_killed_mid_save_fails_the_save_typed_and_the_next_save_works(tmp_path, when):
    path = tmp_path / ("ckpt@held" if when.startswith("held") else "ckpt@midway")
    old, new = _state(1), _state(2, mib=64)  # a 256 MiB data file
    safeckpt.async_save(old, tmp_path / "warm").result(timeout=120)  # the writer runs
    safeckpt.save(old, path)
    before = _files(path)
    pid = writer.current_pid()
    fut = safeckpt.async_save(new, path, overwrite=True)
    if when.startswith("held"):
        time.sleep(0.3)  # the writer waits for a gate it never gets
    else:  # the writer wrote part of its data file and waits for the gate before the rest
        def written() -> int:
            return sum((path / n).stat().st_size for n in set(_files(path)) - set(before))
        _wait_for(written, 60, "the first bytes of the new data file")
        assert written() < new["model"]["w"].nbytes
    assert not fut.done()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(safeckpt.SaveAbortedError) as err:
        fut.result(timeout=60)
    message = str(err.value)
    assert isinstance(err.value, safeckpt.WriterDiedError) and f"pid {pid}" in message, message
    assert "signal 9 (SIGKILL)" in message and str(path) in message and "nothing was committed" in message
    assert _files(path) == before, "the dead writer's data file was left behind"
    assert _same(safeckpt.load_state(path), old) and safeckpt.verify(path).ok
    writer_faults.release(path)  # (a folder ending in @held: the next save goes through)
    safeckpt.async_save(_state(3), path, overwrite=True).result(timeout=120)  # a new writer
    assert writer.current_pid() not in (None, pid)
    assert _same(safeckpt.load_state(path), _state(3))


def test_a_writer_dying_after_its_commit_reports_the_save_as_committed(tmp_path):
    """The manifest was written (and fsynced) before the writer died: the save
    happened, and says so, however the writer ended."""
    path = tmp_path / "ckpt@die"
    pid = writer.current_pid()
    info = safeckpt.async_save(_state(4), path).result(timeout=120)
    assert writer.current_pid() != pid or pid is None
    assert info.save_id == read_committed(open_storage(path)).save_id
    assert _same(safeckpt.load_state(path), _state(4)) and safeckpt.verify(path).ok


def test_a_writer_that_cannot_start_leaves_the_saves_to_this_process(tmp_path, monkeypatch):
    writer.stop()
    monkeypatch.setattr(writer, "COMMAND", [sys.executable, "-c", "import sys; sys.exit(3)"])
    monkeypatch.setattr(writer, "_broken", None)
    with pytest.warns(safeckpt.errors.SafeckptWarning, match="could not start"):
        safeckpt.async_save(_state(5), tmp_path / "a").result(timeout=120)
    assert _same(safeckpt.load_state(tmp_path / "a"), _state(5))
    safeckpt.async_save(_state(6), tmp_path / "b").result(timeout=120)  # on a thread now
    assert writer.current_pid() is None and asyncsave._default.arena.buffer is None
    assert _same(safeckpt.load_state(tmp_path / "b"), _state(6))
    writer.stop()


def test_a_local_tier_save_in_the_writer_names_its_durable_root(tmp_path):
    """A manager's async save to its local tier is committed by the writer process with
    the durable root it belongs to, so the manager restores it and its retention keeps
    it as its own (a local checkpoint without it is another root's: never touched)."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    with safeckpt.CheckpointManager(str(durable), local=str(local), async_save=True) as mgr:
        pid = writer.current_pid()
        mgr.save(1, _state(1)).result(timeout=120)
        assert writer.current_pid() not in (None, pid) or pid is not None, "not saved by the writer process"
    manifest = read_committed(open_storage(local / "step-000000001"))
    assert manifest.durable_root == open_storage(durable).url
    state = _state(9)
    with safeckpt.CheckpointManager(str(durable), local=str(local)) as mgr:
        assert mgr.restore(state) == 1
    assert _same(state, _state(1))


def test_every_field_of_a_save_request_reaches_the_writer_or_keeps_the_save_here():
    """A field added to ``SaveRequest`` is carried by ``writer.Job`` or makes ``job_for``
    keep the save in this process; else the writer would commit without it."""
    kept_here = {"storage", "group", "before_commit", "chunk_size", "base", "runner",  # checked by job_for
                 "allow_pickle", "save_id"}  # the state is flattened here; the writer draws its own id
    carried = {f.name for f in dataclasses.fields(writer.Job)}
    assert {f.name for f in dataclasses.fields(SaveRequest)} - kept_here <= carried


# -- the saving process ends -------------------------------------------------------

def _child(code: str, tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{SRC!r}, {HELPERS!r}]
        import torch, safeckpt, writer_faults
        from safeckpt.run import writer
        writer.COMMAND = writer_faults.writer_command()
        os.environ[writer.ENV] = "process"
    """) + textwrap.dedent(code))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_exit_with_a_save_in_flight_commits_it_and_stops_the_writer(tmp_path):
    child = _child(f"""
        state = {{"w": torch.arange(16 << 20, dtype=torch.float32), "step": 7}}
        fut = safeckpt.async_save(state, {str(tmp_path / "ckpt")!r})
        state["w"].zero_()
        import time
        while writer.current_pid() is None:  # started by the save's thread
            time.sleep(0.01)
        print(writer.current_pid(), fut.done(), flush=True)
    """, tmp_path)
    out, err = child.communicate(timeout=180)
    assert child.returncode == 0, err
    pid, done = out.split()
    assert done == "False", "the save was over before the interpreter exited: nothing was in flight"
    got = safeckpt.load_state(tmp_path / "ckpt")
    assert got["step"] == 7 and torch.equal(got["w"], torch.arange(16 << 20, dtype=torch.float32))
    _wait_for(lambda: _gone(int(pid)), 10, "the writer to exit")


def test_a_killed_saving_process_takes_its_writer_with_it(tmp_path):
    """SIGKILL of the process whose save is in flight: its writer dies at once and
    commits nothing, even when the save could go on afterwards."""
    held = tmp_path / "ckpt@held"
    child = _child(f"""
        fut = safeckpt.async_save({{"w": torch.ones(1000)}}, {str(held)!r})
        import time
        while not os.path.isdir({str(held)!r}):  # the writer runs the save: it made the folder, holds its data
            time.sleep(0.01)
        print(writer.current_pid(), flush=True)
        time.sleep(600)
    """, tmp_path)
    pid = int(child.stdout.readline())
    child.kill()
    child.wait(30)
    _wait_for(lambda: _gone(pid), 10, "the writer to die with its saving process")
    writer_faults.release(held)  # were it alive, it would now write and commit
    time.sleep(0.5)
    assert not held.exists() or not [n for n in _files(held) if n.startswith("manifest-")]


# -- fork ---------------------------------------------------------------------------

def test_a_forked_child_saves_with_its_own_writer_and_buffer(tmp_path):
    """The parent's save is held in flight, staged in its shared buffer, when the
    process forks; the child saves a state of the same layout. Had the child copied
    into the buffer it inherited (shared memory), the parent would commit its bytes."""
    safeckpt.async_save(_state(1), tmp_path / "warm").result(timeout=120)
    parent_writer = writer.current_pid()
    held = tmp_path / "parent@held"
    fut = safeckpt.async_save(_state(2), held)
    pid = os.fork()
    if pid == 0:  # the child: saves, reports, never returns into pytest
        code = 1
        try:
            safeckpt.async_save(_state(3), tmp_path / "child").result(timeout=120)
            code = 0 if writer.current_pid() not in (None, parent_writer) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    writer_faults.release(held)
    fut.result(timeout=120)
    assert _same(safeckpt.load_state(held), _state(2)) and safeckpt.verify(held).ok
    assert _same(safeckpt.load_state(tmp_path / "child"), _state(3))


# -- the caller's fast path ----------------------------------------------------------

def test_a_state_changed_in_place_between_saves_commits_what_it_holds(tmp_path):
    """Between saves of one state its tensors change shape, strides, dtype view, ties
    and negation bits in place, at the same addresses: each save commits what the state
    holds at its call, exactly as a synchronous save does."""
    base = torch.randn(64, 64)
    state = {"a": base, "b": torch.randn(1000), "c": torch.randn(30, 30), "n": torch.arange(12.0),
             "tied": base, "e": torch.empty(0), "i": torch.arange(40, dtype=torch.int32)}
    plain = state["b"]
    steps = [  # each tensor that stops holding its values in order gets them back the step after
        ("as it is", lambda s: None),
        ("values changed", lambda s: s["b"].mul_(2)),
        ("a negative view", lambda s: s.__setitem__("b", plain._neg_view())),
        ("the plain tensor again", lambda s: s.__setitem__("b", plain)),
        ("transposed in place", lambda s: s["c"].t_()),
        ("a tie at one address broken by the view", lambda s: s.__setitem__("tied", base.t())),
        ("the tie again", lambda s: s.__setitem__("tied", base)),
        ("transposed back", lambda s: s["c"].t_()),
        ("another tensor of the same shape", lambda s: s.__setitem__("b", torch.randn(1000))),
        ("shape changed in place", lambda s: s["n"].unsqueeze_(0)),
        ("a tie broken", lambda s: s.__setitem__("tied", base.clone())),
        ("a tie made", lambda s: s.__setitem__("tied", s["a"])),
        ("a view of another dtype", lambda s: s.__setitem__("i", s["i"].view(torch.float32))),
        ("resized smaller", lambda s: s["b"].resize_(10)),
        ("a transposed view of the same memory", lambda s: s.__setitem__("a", base.t())),
    ]
    for i, (what, change) in enumerate(steps):
        change(state)
        safeckpt.async_save(state, tmp_path / f"a{i}").result(timeout=60)
        safeckpt.save(state, tmp_path / f"s{i}")
        got, want = safeckpt.load_state(tmp_path / f"a{i}"), safeckpt.load_state(tmp_path / f"s{i}")
        assert got.keys() == want.keys(), what
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k}"
        assert safeckpt.verify(tmp_path / f"a{i}").ok, what


def test_one_staging_copy_reused_resized_and_released(tmp_path):
    """The shared buffer holds one copy of the state's tensors: the same memory from save
    to save, shrunk for a smaller state, freed for a save that stages elsewhere; the
    writer maps it and keeps no copy of its own."""
    saver = asyncsave.AsyncSaver()
    try:
        big, small = _state(1, mib=64), _state(2, mib=8)
        nbytes = sum(t.nbytes for t in [*big["model"].values(), *big["opt"]])
        saver.submit(big, safeckpt.protocol.checkpoint.save_request(tmp_path / "a")).result(timeout=120)
        buffer = saver.arena.buffer
        first = (buffer.id, buffer.address, buffer.size)
        assert buffer.size == nbytes and not saver.pool.buffers
        pid = writer.current_pid()
        anon = _rss_anon(pid)
        saver.submit(big, safeckpt.protocol.checkpoint.save_request(tmp_path / "b")).result(timeout=120)
        assert (buffer.id, buffer.address, buffer.size) == first
        assert _rss_anon(pid) - anon < 32 << 20, "the writer holds a copy of what it wrote"
        saver.submit(small, safeckpt.protocol.checkpoint.save_request(tmp_path / "c")).result(timeout=120)
        assert saver.arena.buffer.size < nbytes // 2
        faulty = FaultyStorage(LocalStorage(tmp_path / "d"))  # not for a writer process: staged here
        saver.submit(small, safeckpt.protocol.checkpoint.save_request(faulty)).result(timeout=120)
        assert saver.arena.buffer is None and saver.pool.buffers
        for name, want in (("a", big), ("b", big), ("c", small), ("d", small)):
            assert _same(safeckpt.load_state(tmp_path / name), want), name
    finally:
        saver.close()


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def test_warnings_of_the_writer_reach_the_caller(tmp_path):
    """A warning the protocol issues in the writer process is issued here: an overwrite
    commits, but the replaced version cannot be deleted (garbage for gc)."""
    path = tmp_path / "ckpt@keep"
    safeckpt.save(_state(1), path)
    old = set(_files(path))
    with pytest.warns(safeckpt.errors.CleanupWarning, match="removing the replaced version failed"):
        safeckpt.async_save(_state(2), path, overwrite=True).result(timeout=120)
    assert _same(safeckpt.load_state(path), _state(2))
    assert old & set(_files(path)), "the replaced version was deleted after all"


def _staging_buffers(pid: int) -> int:
    """How many shared staging buffers process ``pid`` holds open (by descriptors: a
    mapping holds one of its own)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:safeckpt-staging"):
                found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass  # closed meanwhile
    return len(found)


def test_a_saver_never_closed_frees_its_buffer_here_and_in_the_writer(tmp_path):
    """A saver dropped without ``close`` (a manager nobody closed): the garbage collector
    frees its shared buffer in this process and has the writer let go of it too, so
    savers made and dropped one after another hold no staging copy each."""
    safeckpt.async_save(_state(1), tmp_path / "warm").result(timeout=120)  # the writer runs
    pid = writer.current_pid()
    here, there = _staging_buffers(os.getpid()), _staging_buffers(pid)
    for i in range(3):
        saver = asyncsave.AsyncSaver()
        saver.submit(_state(i), safeckpt.protocol.checkpoint.save_request(tmp_path / f"s{i}")).result(timeout=120)
        assert _staging_buffers(os.getpid()) == here + 1
        del saver
        gc.collect()
    assert _staging_buffers(os.getpid()) == here
    safeckpt.async_save(_state(5), tmp_path / "last").result(timeout=120)  # carries what could not go at once
    _wait_for(lambda: _staging_buffers(pid) <= there, 10, "the writer to let go of the dropped buffers")
    assert writer.current_pid() == pid


def test_gc_while_the_writer_holds_a_managers_save_leaves_it_alone(tmp_path):
    """A manager's save in the writer process is a live writer of its folder: gc() from
    another thread (or an explicit ``safeckpt gc``) while the writer is part way through
    the data file must leave the save whole."""
    root = tmp_path / "run@midway"
    with safeckpt.CheckpointManager(root, async_save=True) as mgr:
        fut = mgr.save(2, _state(2, mib=32))
        folder = root / "step-000000002"
        _wait_for(lambda: folder.exists() and any(p.stat().st_size for p in folder.iterdir()), 60,
                  "the first bytes of the data file")
        removed: dict = {}
        t = threading.Thread(target=lambda: removed.setdefault("by_manager", mgr.gc()))
        t.start()
        removed["explicit"] = garbage.collect(open_storage(str(root)), min_age_s=3600)  # `safeckpt gc`
        t.join(1.0)
        writer_faults.release(root)
        info = fut.result(timeout=120)
        t.join(60)
    assert not [n for names in removed.values() for n in names if n.startswith("step-000000002/")], removed
    assert safeckpt.verify(info.path).ok and _same(safeckpt.load_state(info.path), _state(2, mib=32))


def test_a_writer_that_never_says_it_is_ready_is_given_up(tmp_path, monkeypatch):
    """An interpreter that starts but never answers (an embedding host as
    ``sys.executable``, a program that hangs) must not hang the save: after the start
    timeout the writer is killed, the save finishes on a thread here with a warning, and
    later saves run on a thread."""
    writer.stop()
    monkeypatch.setattr(writer, "COMMAND", ["sleep", "600"])  # runs, never answers
    monkeypatch.setattr(writer, "READY_S", 1.0)
    monkeypatch.setattr(writer, "_broken", None)
    state = _state(5, mib=1)
    with pytest.warns(safeckpt.SafeckptWarning, match="did not answer within 1 s"):
        info = safeckpt.async_save(state, tmp_path / "c").result(timeout=60)
    assert _same(safeckpt.load_state(info.path), state) and safeckpt.verify(info.path).ok
    assert writer.current_pid() is None
    safeckpt.async_save(_state(6, mib=1), tmp_path / "d").result(timeout=60)  # on a thread, no new writer
    assert writer.current_pid() is None


def test_a_save_after_the_process_changed_its_umask_is_made_as_a_sync_save_would(tmp_path):
    """The writer writes as the saving process was when it started: after ``os.umask``
    (or a change of effective user) a save runs on a thread here, so its files get the
    same permissions a synchronous save gives them."""
    safeckpt.async_save(_state(1, mib=1), tmp_path / "warm").result(timeout=120)  # the writer runs
    assert writer.current_pid() is not None
    old = os.umask(0o077)
    try:
        safeckpt.save(_state(2, mib=1), tmp_path / "sync")
        safeckpt.async_save(_state(2, mib=1), tmp_path / "async").result(timeout=120)
    finally:
        os.umask(old)

    def modes(path: Path) -> list:
        return [oct(path.stat().st_mode & 0o777)] + sorted(oct(p.stat().st_mode & 0o777) for p in path.iterdir())
    assert modes(tmp_path / "async") == modes(tmp_path / "sync") == ["0o700", "0o600", "0o600"]
