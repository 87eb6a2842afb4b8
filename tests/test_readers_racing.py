"""Readers racing a writer: retention, ``delete()`` and ``save(overwrite=True)`` delete
files a reader has just listed. A writer only deletes a checkpoint after committing a
newer one, so a reader must look again (never report a file it saw deleted as a plain
``FileNotFoundError``, a corrupt checkpoint or an empty root) and find what is committed.

Each race is injected at its exact point, not left to luck: ``at_first`` wraps a
``LocalStorage`` method so that the first matching call runs the writer's whole action
(a real save with retention, a real overwrite) just before doing its own work on the
files it was given. Everything else is real: files under ``tmp_path``, real managers.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

import safeckpt
from safeckpt import CheckpointState
from safeckpt.cli import main as cli
from safeckpt.storage import LocalStorage

pytestmark = pytest.mark.timeout(60)

OLD = "step-000000001"


def _state(v: float) -> dict:
    return {"w": torch.full((256,), float(v)), "step": int(v)}


@contextlib.contextmanager
def at_first(monkeypatch, method: str, match: Callable[[LocalStorage, tuple], bool],
             action: Callable[[], None]) -> Iterator[list[bool]]:
    """Run ``action`` once, inside the first ``LocalStorage.<method>`` call that
    ``match(storage, args)`` picks, before that call does its work. Yields a list that
    holds True once it ran (a test asserts the race really happened)."""
    original = getattr(LocalStorage, method)
    fired: list[bool] = []

    @functools.wraps(original)
    def hooked(self, *args, **kwargs):
        if not fired and match(self, args):
            fired.append(True)  # first: the action's own calls must not fire it again
            action()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, method, hooked)
    yield fired
    monkeypatch.setattr(LocalStorage, method, original)


def _reads_old_manifest(storage: LocalStorage, args: tuple) -> bool:
    return storage.path.endswith(OLD) and args[0].startswith("manifest-")


def _reads_old_data(storage: LocalStorage, args: tuple) -> bool:
    return storage.path.endswith(OLD) and args[0].startswith("data-")


@pytest.fixture
def writer(tmp_path):
    """A manager keeping one checkpoint, which has committed step 1; ``writer.next()``
    saves step 2, and its retention deletes step 1."""
    mgr = safeckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    mgr.save(1, _state(1))
    mgr.next = lambda: mgr.save(2, _state(2))
    yield mgr
    mgr.close()


# --------------------------------------------------------------------------- listing a run root


@pytest.mark.parametrize("reader", ["list_checkpoints", "steps", "latest_step", "ls"])
def test_listing_a_root_while_retention_deletes_the_step_it_reads(writer, monkeypatch, capsys, reader):
    """Between the root's listing and the read of step 1's manifest, the writer commits
    step 2 and deletes step 1: the reader looks again and reports step 2 committed,
    never a FileNotFoundError, an empty root, or step 1 as CORRUPT."""
    root = writer.storage.path
    other = safeckpt.CheckpointManager(root)  # another process's manager: reads only
    readers = {"list_checkpoints": lambda: [(c.step, c.state) for c in safeckpt.list_checkpoints(root)
                                            if c.state is not CheckpointState.RETIRED],
               "steps": other.steps, "latest_step": other.latest_step,
               "ls": lambda: (cli(["ls", root]), capsys.readouterr().out)[1]}
    with at_first(monkeypatch, "read", _reads_old_manifest, writer.next) as fired:
        got = readers[reader]()
    assert fired
    expected = {"list_checkpoints": [(2, CheckpointState.COMMITTED)], "steps": [2], "latest_step": 2}
    if reader == "ls":
        assert not {"corrupt", "torn", "empty"} & set(got.split()) and "1 committed" in got, got
    else:
        assert got == expected[reader]


def test_steps_of_a_manager_racing_its_own_save(tmp_path, monkeypatch):
    """The manager's own save (another thread's, or its background work) retires step 1
    while ``steps()``/``latest_step()`` read it: they find step 2."""
    mgr = safeckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    mgr.save(1, _state(1))
    with at_first(monkeypatch, "read", _reads_old_manifest, lambda: mgr.save(2, _state(2))) as fired:
        assert mgr.steps() == [2]
    assert fired
    mgr.save(3, _state(3))
    three = lambda s, a: s.path.endswith("step-000000003") and a[0].startswith("manifest-")  # noqa: E731
    with at_first(monkeypatch, "read", three, lambda: mgr.save(4, _state(4))) as fired:
        assert mgr.latest_step() == 4
    assert fired
    mgr.close()


def test_restore_while_retention_deletes_the_step_it_loads(writer, monkeypatch):
    """Another process restores step 1; while it reads step 1's data the writer commits
    step 2 and deletes step 1: restore looks again and restores step 2, without a
    warning about a skipped checkpoint (nothing was damaged)."""
    state = _state(0)
    with at_first(monkeypatch, "read_into", _reads_old_data, writer.next) as fired:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step = safeckpt.CheckpointManager(writer.storage.path).restore(state)
    assert fired
    assert step == 2 and state["w"][0].item() == 2.0 and state["step"] == 2


# --------------------------------------------------------------------------- one checkpoint replaced


@pytest.fixture
def replaced(tmp_path):
    """A checkpoint folder holding version 1; calling the fixture's value overwrites it
    with version 2 (which retires version 1's manifest and data)."""
    path = str(tmp_path / "ckpt")
    safeckpt.save(_state(1), path)
    return path, lambda: safeckpt.save({"w": torch.full((256,), 2.0), "step": 2}, path, overwrite=True)


@pytest.mark.parametrize("when", ["manifest", "data"])
def test_load_state_and_verify_while_the_checkpoint_is_overwritten(replaced, monkeypatch, when):
    """``save(overwrite=True)`` retires the old version while a reader reads its manifest
    or its data: ``load_state``, ``load`` and ``verify`` read the new version."""
    path, overwrite = replaced
    ckpt = lambda s, a: s.path == path and a[0].startswith("manifest-" if when == "manifest" else "data-")  # noqa: E731
    method = "read" if when == "manifest" else "read_into"
    with at_first(monkeypatch, method, ckpt, overwrite) as fired:
        got = safeckpt.load_state(path)
    assert fired and got["w"][0].item() == 2.0 and got["step"] == 2

    safeckpt.save(_state(1), path, overwrite=True)
    with at_first(monkeypatch, method, ckpt, overwrite) as fired:
        report = safeckpt.verify(path)
    assert fired and report.ok, report.problems

    safeckpt.save(_state(1), path, overwrite=True)
    state = _state(0)
    with at_first(monkeypatch, method, ckpt, overwrite) as fired:
        safeckpt.load(state, path)
    assert fired and state["w"][0].item() == 2.0


def test_a_checkpoint_deleted_while_it_is_loaded_is_a_typed_error(replaced, monkeypatch):
    """Deleted for good (no newer version to read): a CheckpointError, never a plain
    FileNotFoundError."""
    path, _ = replaced
    gone = lambda: [p.unlink() for p in Path(path).iterdir()]  # noqa: E731
    ckpt = lambda s, a: s.path == path and a[0].startswith("data-")  # noqa: E731
    with at_first(monkeypatch, "read_into", ckpt, gone) as fired, pytest.raises(safeckpt.CheckpointError):
        safeckpt.load_state(path)
    assert fired


def test_a_manifest_shorter_than_its_listing_is_read_again(replaced, monkeypatch):
    """Seen in two writers overwriting one path while a reader reads it (attack repro 09):
    the manifest read is shorter than the listing said (another file under its name by
    then). The reader lists the folder again and reads what is committed: never a plain
    EOFError. Injected: version 2 commits and version 1's manifest is cut short between
    the listing and the read."""
    path, overwrite = replaced

    def cut_short() -> None:
        overwrite()
        (Path(path) / "manifest-000001.json").write_bytes(b"{")  # under the old name: a shorter file

    ckpt = lambda s, a: s.path == path and a[0] == "manifest-000001.json"  # noqa: E731
    with at_first(monkeypatch, "read_into", ckpt, cut_short) as fired:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the stray "{" is a torn manifest below the committed one
            got = safeckpt.load_state(path)
    assert fired and got["w"][0].item() == 2.0
