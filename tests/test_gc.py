"""Garbage collection: removes what aborted saves left, never a committed checkpoint,
never a file safeckpt did not write, never a save that may still be running."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import pytest

import safeckpt
from safeckpt.format.manifest import frame
from safeckpt.protocol.checkpoint import new_save_id
from safeckpt.storage.local import LocalStorage

from save_child import make_state, state_mismatch


def _tree(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root`` with its size and first bytes (folders as ``name/``)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d)) + "/"] = (0, b"")
        for f in filenames:
            p = Path(dirpath, f)
            out[os.path.normpath(os.path.join(rel, f))] = (p.stat().st_size, p.read_bytes()[:64])
    return out


def _crash(fork_server, path: Path, value: int, point: str, overwrite: bool = False) -> None:
    """A real process saving ``make_state(value)`` to ``path``, SIGKILLed at ``point``."""
    pid = fork_server.fork("crash_at", path=str(path), value=value, point=point, overwrite=overwrite)
    res = fork_server.wait(pid)
    err = Path(str(path) + ".err")
    assert res["signal"] == 9, (res, err.read_text() if err.exists() else "")


def _foreign(root: Path) -> None:
    """Things another tool (or a person) put in the run root."""
    (root / "checkpoint-100").mkdir(parents=True)
    (root / "checkpoint-100" / "model.safetensors").write_bytes(b"x" * 100)
    (root / "checkpoint-100" / "data-0123456789abcdef-r00000.safetensors").write_bytes(b"y" * 10)
    (root / "notes.txt").write_text("lr sweep, do not delete")
    (root / "step-abc").mkdir()
    (root / "step-abc" / "data-0123456789abcdef-r00000.safetensors").write_bytes(b"z" * 10)
    (root / "step-000000005").mkdir()
    (root / "step-000000005" / "README").write_text("not safeckpt's")
    (root / "step-000000006").mkdir()
    (root / "step-000000006" / "train.log").write_text("a log")
    (root / "step-00000007").mkdir()  # 8 digits: not a safeckpt step folder
    (root / "step-00000007" / "manifest-000001.json").write_text("{}")
    (root / "data-0123456789abcdef-r00000.safetensors").write_bytes(b"at the root")  # not in a step folder


FOREIGN = {"checkpoint-100/", "checkpoint-100/model.safetensors",
           "checkpoint-100/data-0123456789abcdef-r00000.safetensors", "notes.txt", "step-abc/",
           "step-abc/data-0123456789abcdef-r00000.safetensors", "step-000000005/",
           "step-000000005/README", "step-000000006/", "step-000000006/train.log",
           "step-00000007/", "step-00000007/manifest-000001.json",
           "data-0123456789abcdef-r00000.safetensors"}


@pytest.fixture
def messy_root(tmp_path, fork_server):
    """A run root with committed checkpoints 1, 2, 3 (2 overwritten once, and that
    overwrite killed before it retired the old version), an aborted save at step 4
    (data, no manifest), a torn manifest at step 0, older than every committed one (killed mid-manifest), and foreign
    files. Returns (root, manager, expected garbage)."""
    root = tmp_path / "run"
    mgr = safeckpt.CheckpointManager(root)
    for step in (1, 2, 3):
        mgr.save(step, make_state(step))
    _crash(fork_server, root / "step-000000002", 22, "before_retire", overwrite=True)
    _crash(fork_server, root / "step-000000004", 4, "before_manifest")
    _crash(fork_server, root / "step-000000000", 9, "torn_manifest")
    _foreign(root)
    listing2 = set(os.listdir(root / "step-000000002"))
    assert "manifest-000002.json" in listing2 and "manifest-000001.json" in listing2
    new_files = set(safeckpt.protocol.checkpoint.read_committed(LocalStorage(root / "step-000000002")).files)
    old2 = {f"step-000000002/{n}" for n in listing2 - new_files - {"manifest-000002.json"}}
    step4 = {f"step-000000004/{n}" for n in os.listdir(root / "step-000000004")}
    step0 = {f"step-000000000/{n}" for n in os.listdir(root / "step-000000000")}
    assert any(n.endswith("manifest-000001.json") for n in step0) and len(step0) == 2
    assert len(step4) == 1 and len(old2) == 2
    return root, mgr, old2 | step4 | step0


def _committed_ok(root: Path, steps: dict[int, int]) -> None:
    with safeckpt.CheckpointManager(root) as reader:
        assert reader.steps() == sorted(steps)
        for step, value in steps.items():
            assert state_mismatch(safeckpt.load_state(reader.path(step)), value) is None
            assert safeckpt.verify(reader.path(step)).ok


def test_gc_removes_aborted_saves_only(messy_root):
    root, mgr, garbage = messy_root
    before = _tree(root)
    removed = mgr.gc()
    assert set(removed) == garbage, (sorted(removed), sorted(garbage))
    after = _tree(root)
    assert set(before) - set(after) == garbage | {"step-000000004/", "step-000000000/"}
    for name in FOREIGN:
        assert after.get(name) == before[name], f"gc touched {name}"
    _committed_ok(root, {1: 1, 2: 22, 3: 3})
    assert mgr.gc() == []  # nothing left to do
    mgr.close()


def test_gc_dry_run_changes_nothing(messy_root):
    root, mgr, garbage = messy_root
    before = _tree(root)
    assert set(mgr.gc(dry_run=True)) == garbage
    assert _tree(root) == before
    mgr.close()


def test_a_save_runs_gc_after_its_commit(messy_root):
    """After its commit a save cleans folders that hold manifests; a folder with data
    and no manifest at all (it could be a checkpoint copied in without its manifest,
    orbax #394) is left to an explicit gc."""
    root, mgr, garbage = messy_root
    mgr.save(10, make_state(10))
    names = set(_tree(root))
    step4 = {n for n in garbage if n.startswith("step-000000004/")}
    assert not names & (garbage - step4)
    assert step4 <= names
    assert FOREIGN <= names
    assert sorted(mgr.gc()) == sorted(step4)
    _committed_ok(root, {1: 1, 2: 22, 3: 3, 10: 10})
    mgr.close()


def test_gc_never_removes_a_committed_checkpoint(tmp_path):
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state(step))
        safeckpt.save(make_state(33), mgr.path(3), overwrite=True)  # a committed overwrite
        before = _tree(root)
        assert mgr.gc() == []
        assert mgr.gc(min_age_s=0) == []
    assert _tree(root) == before
    _committed_ok(root, {1: 1, 2: 2, 3: 33})


def test_a_save_leaves_alone_a_finished_manifest_it_cannot_read(tmp_path):
    """A manifest whose frame and checksum are intact was finished by its writer: when
    this reader refuses its content (a reader's bug, a stricter rule), the cleanup after
    a save must not take the checkpoint for a torn save's leftovers and delete it."""
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
        folder = Path(mgr.path(1))
        manifest = next(folder.glob("manifest-*.json"))
        data = manifest.read_bytes()
        body = json.loads(data[len(b'{"safeckpt":'):data.rindex(b',"checksum":')])
        body["tree"] = {"$dtype": "int"}  # an alias the decoder refuses
        manifest.write_bytes(frame(json.dumps(body).encode()))
        before = _tree(root)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", safeckpt.SafeckptWarning)
            mgr.save(2, make_state(2))
            kept = {n for n in before if n.startswith("step-000000001/") and not n.endswith("/")}
            assert kept <= set(_tree(root))
            assert set(mgr.gc(dry_run=True)) == kept  # an explicit gc is asked to remove it


def test_gc_leaves_a_folder_with_foreign_files_and_an_aborted_save(tmp_path, fork_server):
    root = tmp_path / "run"
    _crash(fork_server, root / "step-000000004", 4, "before_manifest")
    (root / "step-000000004" / "notes.md").write_text("mine")
    with safeckpt.CheckpointManager(root) as mgr:
        removed = mgr.gc()
    assert len(removed) == 1 and removed[0].startswith("step-000000004/data-")
    assert os.listdir(root / "step-000000004") == ["notes.md"]


# --------------------------------------------------------------------------- live saves


def _aborted_data(folder: Path, save_id: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / f"data-{save_id}-r00000.safetensors"
    p.write_bytes(b"\0" * 128)
    return p


def test_min_age_protects_a_young_save_by_its_id_not_its_mtime(tmp_path):
    """A save whose writer cannot be asked (another host, or a file too short to name
    it) may still be running while its id is young, whatever the file's mtime says."""
    root = tmp_path / "run"
    young = _aborted_data(root / "step-000000004", new_save_id())  # just now, writer unknown
    os.utime(young, (0, 0))  # the filesystem claims 1970 (FUSE mounts get mtimes wrong)
    # an old aborted save whose file looks brand new: its id records 1970
    old = _aborted_data(root / "step-000000005", "00000001" + "ab" * 6)
    with safeckpt.CheckpointManager(root) as mgr:
        assert mgr.gc(min_age_s=3600, dry_run=True) == ["step-000000005/" + old.name]
        assert mgr.gc(min_age_s=3600) == ["step-000000005/" + old.name]
        assert young.exists() and not old.exists()
        assert mgr.gc() == ["step-000000004/" + young.name]  # without a grace period it goes
    assert not young.exists()


def test_min_age_spares_no_save_whose_writer_is_known_dead(tmp_path, fork_server):
    """A save killed on this host names its writer, whose process is gone: however young,
    it is garbage at once (the rule the writer lease uses: a dead process on this host
    holds nothing)."""
    root = tmp_path / "run"
    _crash(fork_server, root / "step-000000004", 4, "before_manifest")  # just now
    young = next((root / "step-000000004").iterdir())
    with safeckpt.CheckpointManager(root) as mgr:
        assert mgr.gc(min_age_s=3600) == ["step-000000004/" + young.name]
    assert not young.exists()


def test_min_age_protects_the_whole_folder_of_a_young_save(tmp_path):
    root = tmp_path / "run"
    folder = root / "step-000000004"
    young = _aborted_data(folder, new_save_id())
    (folder / "manifest-000001.json").write_bytes(b'{"torn')  # a manifest being written
    with safeckpt.CheckpointManager(root) as mgr:
        assert mgr.gc(min_age_s=3600) == []
    assert young.exists() and (folder / "manifest-000001.json").exists()


def test_gc_during_an_in_flight_async_save_leaves_it_alone(tmp_path, monkeypatch):
    """The manager's own save in flight is a live writer: a gc() call (by the user, a
    callback, another thread) must not delete the files it is about to commit."""
    gate, at_manifest = threading.Event(), threading.Event()
    real = LocalStorage.write_file

    def write_file(self, name, parts):
        if name.startswith("manifest-") and self.path.endswith("step-000000002"):
            at_manifest.set()
            assert gate.wait(30)
        return real(self, name, parts)

    monkeypatch.setattr(LocalStorage, "write_file", write_file)
    monkeypatch.setenv("SAFECKPT_ASYNC_WRITER", "thread")  # the hook is in this process
    mgr = safeckpt.CheckpointManager(tmp_path / "run", async_save=True)
    mgr.save(1, make_state(1)).result(timeout=60)
    fut = mgr.save(2, make_state(2))
    assert at_manifest.wait(30)  # its data file is written, its manifest not yet
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("removed", mgr.gc()))
    t.start()
    t.join(1.0)
    gate.set()
    t.join(30)
    info = fut.result(timeout=60)  # reported committed...
    report = safeckpt.verify(info.path)  # ...so it must be whole
    assert not [n for n in result.get("removed", []) if n.startswith("step-000000002/")], (result, report)
    assert report.ok, report.problems
    assert state_mismatch(safeckpt.load_state(info.path), 2) is None
    mgr.close()
