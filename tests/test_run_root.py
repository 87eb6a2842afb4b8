"""What a run root holds, as the manager, ``list_checkpoints`` and ``safeckpt ls`` see it
(issue 24, items 10 and 13): an old step that cannot be read is reported and passed
over, never blocking the newer ones; only a step's own folder name (``step-`` and the
step zero-padded to 9 digits) is a step; names from storage and manifests are escaped
in every command's text output, so a newline in one cannot forge a row.

Faults are real errors on real files: ``FaultyStorage`` raises EACCES or EIO on one
step's listing or manifest read (the tests run as root, whom ``chmod 000`` does not
stop), and the command line reaches it through a storage scheme registered in-process.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

import safeckpt
from safeckpt import CheckpointState
from safeckpt.cli import main as cli
from safeckpt.errors import CleanupWarning, SkippedCheckpointWarning
from safeckpt.storage import LocalStorage, register, registry
from safeckpt.testing import FaultyStorage

OLD = "step-000000001"


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


@pytest.fixture
def root(tmp_path) -> Path:
    """A run root with steps 1, 2 and 3."""
    path = tmp_path / "run"
    with safeckpt.CheckpointManager(path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    return path


def _faulty(root: Path, op: str, error: int, path: str) -> FaultyStorage:
    storage = FaultyStorage(LocalStorage(str(root)))
    storage.inject(op, error, path=path)
    return storage


def _scheme(monkeypatch, storage: FaultyStorage) -> str:
    """A URL the command line opens as ``storage`` (a scheme registered in this process)."""
    monkeypatch.setattr(registry, "_openers", {})
    register("faulty", lambda url, **options: storage)
    return "faulty://run"


# --------------------------------------------------------------------------- item 10: an unreadable step


FAULTS = {"the folder cannot be listed (EACCES)": ("listdir", errno.EACCES, OLD),
          "the manifest cannot be read (EIO)": ("read", errno.EIO, f"{OLD}/manifest-")}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_unreadable_old_step_is_reported_and_the_others_restore(root, fault):
    """Before: steps(), restore() and list_checkpoints raised StorageError for the whole
    root although steps 2 and 3 were whole."""
    storage = _faulty(root, *FAULTS[fault])
    with pytest.warns(SkippedCheckpointWarning, match=OLD):
        rows = safeckpt.list_checkpoints(storage)
    assert [(r.step, r.state) for r in rows] == [(1, CheckpointState.UNREADABLE), (2, CheckpointState.COMMITTED),
                                                 (3, CheckpointState.COMMITTED)]
    assert OLD in rows[0].problem and ("Permission denied" in rows[0].problem or "I/O" in rows[0].problem)
    mgr = safeckpt.CheckpointManager(storage)
    with pytest.warns(SkippedCheckpointWarning, match=OLD):
        assert mgr.steps() == [2, 3]
    assert mgr.latest_step() == 3
    target = _state(0)
    assert mgr.restore(target) == 3 and torch.equal(target["w"], torch.full((4,), 3.0))
    assert mgr.restore(target, step=2) == 2 and torch.equal(target["w"], torch.full((4,), 2.0))
    with pytest.raises(safeckpt.CheckpointError, match=OLD):
        mgr.restore(target, step=1)  # asked for by name: an error, never "not found"
    mgr.close()


def test_retention_deletes_nothing_while_a_step_cannot_be_read(root):
    """Retention must know every checkpoint that may share the data it deletes (and its
    metrics): with step 1 unreadable it deletes nothing and says so; the save commits."""
    storage = _faulty(root, "listdir", errno.EACCES, OLD)
    mgr = safeckpt.CheckpointManager(storage, keep_last=1)
    with pytest.warns(CleanupWarning, match=OLD):
        mgr.save(4, _state(4))
    mgr.close()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-000000001", "step-000000002", "step-000000003", "step-000000004"]


def test_a_root_unreadable_as_a_whole_or_in_every_step_is_an_error(root):
    """Only what can be passed over is: a root that cannot be listed stays a StorageError,
    and when no step can be read restore() raises instead of starting from scratch."""
    whole = _faulty(root, "listdir", errno.EACCES, str(root))
    for call in (lambda: safeckpt.list_checkpoints(whole), safeckpt.CheckpointManager(whole).steps,
                 lambda: safeckpt.CheckpointManager(whole).restore(_state(0))):
        with pytest.raises(safeckpt.StorageError):
            call()
    every = _faulty(root, "listdir", errno.EIO, "step-")
    with pytest.warns(SkippedCheckpointWarning):
        with pytest.raises(safeckpt.CheckpointError, match="could be restored"):
            safeckpt.CheckpointManager(every).restore(_state(0))


def test_ls_and_verify_show_an_unreadable_step_and_go_on(root, monkeypatch, capsys):
    url = _scheme(monkeypatch, _faulty(root, "listdir", errno.EACCES, OLD))
    assert cli(["ls", url]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "folder(s)" not in line]
    assert [(r[0], r[-1]) for r in rows] == [("1", "UNREADABLE"), ("2", "committed"), ("3", "committed")], out
    assert "1 unreadable" in out and f"step 1: cannot list {root}/{OLD}" in out, out
    assert cli(["ls", "--json", url]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in listed] == ["unreadable", "committed", "committed"]
    assert OLD in listed[0]["problems"][0]
    assert cli(["verify", url]) == 1  # a folder it could not check is a finding
    out = capsys.readouterr().out
    assert f"UNREADABLE    {root}/{OLD}" in out and out.count("every checksum matches") == 2, out


# --------------------------------------------------------------------------- item 13: step folder names


def test_only_a_steps_own_folder_name_is_a_step(root, capsys):
    """``step-0000000002`` (ten digits) was listed as a second step 2, and a committed
    ``step-0000000009`` as an empty step 9 at a path that does not exist, which
    restore() skipped. Neither is a step now: not listed, restored, counted or collected."""
    shutil.copytree(root / "step-000000002", root / "step-0000000002")
    orphan = root / "step-0000000002" / "data-6b0d5db39b2b576721a0-r00000.safetensors"
    orphan.write_bytes(b"not named by any manifest")
    safeckpt.save(_state(9), root / "step-0000000009")
    mgr = safeckpt.CheckpointManager(root)
    assert mgr.steps() == [1, 2, 3] and mgr.latest_step() == 3
    rows = safeckpt.list_checkpoints(root)
    assert [(r.step, Path(r.path).name, r.state) for r in rows] == [
        (s, f"step-00000000{s}", CheckpointState.COMMITTED) for s in (1, 2, 3)]
    assert mgr.gc() == [] and orphan.exists()  # not a step folder: gc leaves it alone
    mgr.close()
    assert cli(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "3 checkpoint folder(s)" in out and "ignored (not step folder names" in out
    assert "step-0000000002, step-0000000009" in out


def test_step_names_parse_by_one_rule():
    from safeckpt.format.names import step_folder, step_of

    for step in (0, 7, 999_999_999, 1_000_000_000, 12_345_678_901):
        assert step_of(step_folder(step)) == step
    for name in ("step-0000000002", "step-00000002", "step-01000000000", "step-1e3", "step-+00000002",
                 "step-٠٠٠٠٠٠٠٠٢", "step-000000002 ", "step-000000002\n", "Step-000000002"):
        assert step_of(name) is None, name


# --------------------------------------------------------------------------- item 13: names escaped


FORGED = "FORGED   9  committed"


def test_a_newline_in_a_name_cannot_forge_a_line_of_any_command(tmp_path, capsys):
    """A folder, file or tensor name holding a newline (or another control character)
    printed as it is made a line of its own: ``safeckpt ls`` showed a forged committed
    row. Every command's text escapes names (``\\n``); ``--json`` keeps them exact."""
    evil = f"x\n{FORGED}"
    outer = tmp_path / f"o\x1b[2J{evil}"  # a terminal escape and a newline in the root's own name
    good, bad = outer / "good", outer / evil
    state = {"w": torch.ones(2), f"t\r\n{FORGED}": torch.zeros(1)}
    safeckpt.save(state, good)
    safeckpt.save(state, bad)
    runs = {"ls": ["ls", str(outer)], "show": ["show", str(bad)], "verify": ["verify", str(outer)],
            "diff": ["diff", str(good), str(tmp_path / "other")], "gc": ["gc", str(bad), "--dry-run"]}
    safeckpt.save({"w": torch.zeros(2)}, tmp_path / "other")
    for name, args in runs.items():
        cli(args)
        captured = capsys.readouterr()
        for line in (captured.out + captured.err).splitlines():
            assert FORGED not in line or "\\n" + FORGED in line, (name, line)
            assert "\x1b" not in line and "\r" not in line, (name, line)
        assert name not in ("ls", "show") or "\\n" + FORGED in captured.out, (name, captured.out)
    assert cli(["ls", "--json", str(outer)]) == 0
    paths = {Path(r["path"]).name for r in json.loads(capsys.readouterr().out)}
    assert paths == {"good", evil}
