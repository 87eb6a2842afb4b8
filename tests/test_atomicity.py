"""A checkpoint is committed all at once or not at all, and an old one is never lost
before a new one is committed: overwrite, failed saves, crashes (raised and real
SIGKILL), retention order, and what the manager may and may not touch."""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path

import pytest

import safeckpt
from safeckpt.storage.local import LocalStorage
from save_child import make_state, make_template, state_mismatch


def _snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: relative path -> (sha256, mtime_ns)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = (hashlib.sha256(p.read_bytes()).hexdigest(),
                                               p.stat().st_mtime_ns)
    return out


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def _loads_as(path, step: int) -> None:
    problem = state_mismatch(safeckpt.load_state(path), step)
    assert problem is None, f"{path}: {problem}"


class Crash(Exception):
    """Stands for the process dying at that point."""


def _fail_on_manifest_write(monkeypatch, exc: BaseException = None, only_in: str | None = None) -> list:
    """Make ``LocalStorage.write_file`` raise when it is asked to write a manifest
    (the data file has been written by then)."""
    real = LocalStorage.write_file
    calls = []

    def write_file(self, name, parts):
        calls.append((self.path, name))
        if name.startswith("manifest-") and (only_in is None or self.path.endswith(only_in)):
            raise exc if exc is not None else Crash(f"simulated crash writing {name}")
        return real(self, name, parts)
    monkeypatch.setattr(LocalStorage, "write_file", write_file)
    return calls


# --------------------------------------------------------------------------- one path


def test_save_over_existing_without_overwrite_raises_and_keeps_old(tmp_path):
    path = tmp_path / "ckpt"
    safeckpt.save(make_state(1), path)
    before = _snapshot(path)
    with pytest.raises(safeckpt.CheckpointExistsError) as exc:
        safeckpt.save(make_state(2), path)
    assert isinstance(exc.value, FileExistsError)
    assert str(path) in str(exc.value) and "overwrite" in str(exc.value)
    assert _snapshot(path) == before
    _loads_as(path, 1)


def test_successful_overwrite_leaves_only_the_new_files(tmp_path):
    path = tmp_path / "ckpt"
    old = safeckpt.save(make_state(1), path)
    new = safeckpt.save(make_state(2), path, overwrite=True)
    assert new.save_id != old.save_id
    assert _files(path) == {"manifest-000002.json", *new.files}
    assert not set(old.files) & _files(path)
    _loads_as(path, 2)
    assert safeckpt.verify(path).ok


@pytest.mark.parametrize("exc", [Crash("simulated crash"), KeyboardInterrupt()],
                         ids=["exception", "KeyboardInterrupt"])
def test_overwrite_failing_at_the_manifest_keeps_the_old_one(tmp_path, monkeypatch, exc):
    path = tmp_path / "ckpt"
    safeckpt.save(make_state(1), path)
    before = _snapshot(path)
    calls = _fail_on_manifest_write(monkeypatch, exc)
    with pytest.raises(type(exc)):
        safeckpt.save(make_state(2), path, overwrite=True)
    assert [n for _, n in calls][0].startswith("data-"), "the data file should be written first"
    monkeypatch.undo()
    assert _snapshot(path) == before, "the failed save's data file was left behind or the old one changed"
    _loads_as(path, 1)


@pytest.mark.parametrize("point, survivor", [
    ("mid_data", "old"), ("before_manifest", "old"), ("torn_manifest", "old"),
    ("before_retire", "new"), ("mid_retire", "new"),
])
def test_sigkill_during_overwrite_keeps_old_or_new(fork_server, tmp_path, point, survivor):
    path = tmp_path / "ckpt"
    safeckpt.save(make_state(1), path)
    pid = fork_server.fork("crash_at", path=str(path), value=2, point=point)
    status = fork_server.wait(pid)
    err = Path(str(path) + ".err")
    assert status["signal"] == 9, f"child did not die at {point}: {status} {err.read_text() if err.exists() else ''}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn newer manifest is skipped with a warning
        _loads_as(path, 1 if survivor == "old" else 2)
        assert safeckpt.verify(path).ok
        # the path can be overwritten again and then holds only the newest value
        safeckpt.save(make_state(3), path, overwrite=True)
    _loads_as(path, 3)


@pytest.mark.parametrize("exc", [Crash("boom while streaming"), KeyboardInterrupt()],
                         ids=["exception", "KeyboardInterrupt"])
@pytest.mark.parametrize("over_old", [False, True], ids=["fresh", "overwrite"])
def test_save_failing_while_streaming_leaves_no_files(tmp_path, monkeypatch, exc, over_old):
    path = tmp_path / "ckpt"
    if over_old:
        safeckpt.save(make_state(1), path)
    before = _snapshot(path) if over_old else {}
    real_write = LocalStorage.write_file

    def write_file(self, name, parts):
        if not name.startswith("data-"):
            return real_write(self, name, parts)

        def failing_parts():  # the data file is created and partly written, then this
            for i, part in enumerate(parts):
                if i == 2:
                    raise exc
                yield part
        return real_write(self, name, failing_parts())
    monkeypatch.setattr(LocalStorage, "write_file", write_file)
    with pytest.raises(type(exc)):
        safeckpt.save(make_state(2), path, overwrite=over_old)
    monkeypatch.undo()
    if over_old:
        assert _snapshot(path) == before
        _loads_as(path, 1)
    else:
        assert _files(path) == set(), f"a failed save left {_files(path)}"
        with pytest.raises(safeckpt.CheckpointNotFoundError):
            safeckpt.load_state(path)


# --------------------------------------------------------------------------- manager


def test_retention_never_deletes_before_the_new_save_commits(tmp_path, monkeypatch):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, keep_last=2)
    mgr.save(1, make_state(1))
    mgr.save(2, make_state(2))
    _fail_on_manifest_write(monkeypatch, only_in="step-000000003")
    with pytest.raises(Crash):
        mgr.save(3, make_state(3))
    monkeypatch.undo()
    assert mgr.steps() == [1, 2]
    _loads_as(mgr.path(1), 1)
    _loads_as(mgr.path(2), 2)
    assert not list(Path(mgr.path(3)).glob("data-*")), "the failed save left its data file"

    # a successful save of step 3: every deletion comes after its manifest is written
    events = []
    real_write, real_unlink = LocalStorage.write_file, os.unlink

    def write_file(self, name, parts):
        n = real_write(self, name, parts)
        events.append(("wrote", os.path.join(self.path, name)))
        return n

    def unlink(p, *a, **k):
        events.append(("unlink", os.fspath(p)))
        return real_unlink(p, *a, **k)
    monkeypatch.setattr(LocalStorage, "write_file", write_file)
    monkeypatch.setattr(os, "unlink", unlink)
    mgr.save(3, make_state(3))
    monkeypatch.undo()
    committed_at = events.index(("wrote", os.path.join(mgr.path(3), "manifest-000001.json")))
    first_unlink = next(i for i, e in enumerate(events) if e[0] == "unlink")
    assert committed_at < first_unlink, events
    assert mgr.steps() == [2, 3]


def test_deletion_removes_the_manifest_first_durably_then_data(tmp_path, monkeypatch):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, keep_last=1)
    mgr.save(1, make_state(1))
    doomed = Path(mgr.path(1))
    (data,) = doomed.glob("data-*")
    events = []
    real_unlink, real_fsync, real_rmdir = os.unlink, os.fsync, os.rmdir

    def unlink(p, *a, **k):
        events.append(("unlink", os.path.basename(os.fspath(p))))
        return real_unlink(p, *a, **k)

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rmdir(p, *a, **k):
        events.append(("rmdir", os.fspath(p)))
        return real_rmdir(p, *a, **k)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rmdir", rmdir)
    mgr.save(2, make_state(2))
    monkeypatch.undo()
    i_manifest = events.index(("unlink", "manifest-000001.json"))
    i_data = events.index(("unlink", data.name))
    synced = [i for i, e in enumerate(events) if e == ("fsync", str(doomed))]
    assert i_manifest < i_data, events
    assert any(i_manifest < i < i_data for i in synced), \
        f"the manifest's deletion was not made durable before the data was deleted: {events}"
    assert ("rmdir", str(doomed)) in events and not doomed.exists()
    assert mgr.steps() == [2]


@pytest.mark.parametrize("older, newer", [(9000, 10000), (999_999_999, 1_000_000_000)])
def test_retention_orders_steps_numerically(tmp_path, older, newer):
    """transformers #27138: names sorted as strings deleted 10000+ and kept 9000."""
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, keep_last=1)
    mgr.save(older, make_state(1))
    mgr.save(newer, make_state(2))
    assert mgr.steps() == [newer]
    assert mgr.latest_step() == newer
    state = make_template()
    assert safeckpt.CheckpointManager(root).restore(state) == newer
    assert state_mismatch(state, 2) is None
    assert not Path(mgr.path(older)).exists()


def test_manager_never_touches_foreign_files(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "checkpoint-100").mkdir()
    (root / "checkpoint-100" / "model.safetensors").write_bytes(b"x" * 100)
    (root / "notes.txt").write_text("my notes")
    (root / "step-abc").mkdir()
    (root / "step-abc" / "manifest-000001.json").write_text("not ours")
    (root / "step-12").mkdir()  # too few digits to be ours
    (root / "step-12" / "data").write_text("x")
    (root / "step-000000001").mkdir()  # our name, but no manifest: not provably ours
    (root / "step-000000001" / "README").write_text("copied here without its manifest")
    (root / "step-000000002.tar").write_bytes(b"tar")
    before = _snapshot(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr = safeckpt.CheckpointManager(root, keep_last=1)
        for step in (10, 20, 30):
            mgr.save(step, make_state(step))
        assert mgr.steps() == [30]
        state = make_template()
        assert mgr.restore(state) == 30
    assert state_mismatch(state, 30) is None
    after = _snapshot(root)
    ours = ("step-000000030/", "safeckpt-writer-")  # the checkpoint kept, and the writer lease
    foreign_after = {k: v for k, v in after.items() if not k.startswith(ours)}
    assert foreign_after == before
    assert {p.name for p in root.iterdir()} == {
        "checkpoint-100", "notes.txt", "step-abc", "step-12", "step-000000001",
        "step-000000002.tar", "step-000000030", "safeckpt-writer-000000001.json"}


def test_incomplete_newer_step_is_skipped_with_a_warning(tmp_path):
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root, keep_last=2)
    mgr.save(100, make_state(100))
    (data,) = Path(mgr.path(100)).glob("data-*")
    incomplete = root / "step-000000200"
    incomplete.mkdir()
    shutil.copyfile(data, incomplete / data.name.replace(data.name[5:13], "ffffffff"))
    assert mgr.latest_step() == 100
    assert mgr.steps() == [100]
    state = make_template()
    with pytest.warns(UserWarning, match="step 200"):
        assert mgr.restore(state) == 100
    assert state_mismatch(state, 100) is None
    # a new attempt at step 200 commits normally next to the leftover
    mgr.save(200, make_state(200))
    assert mgr.steps() == [100, 200] and mgr.latest_step() == 200
    state = make_template()
    assert mgr.restore(state) == 200
    assert state_mismatch(state, 200) is None
