"""Filesystem quirks on the real disk: no rename, no folder fsync, fsync EIO.

Object-store FUSE mounts have no rename (ENOTSUP), staging across devices gives EXDEV,
Windows refuses a replace while a reader holds the file (PermissionError) and refuses
folder fsync; some filesystems answer folder fsync with EINVAL. safeckpt needs none of
these calls, so saves, overwrites and manager retention must work and load exactly.
An EIO from fsync means the kernel may have dropped the pages: the save must abort
with StorageError, never retry the fsync, and leave the previous checkpoint intact.
"""

from __future__ import annotations

import errno
import os
import stat
import warnings

import pytest
import torch

import safeckpt
from safeckpt.format.folder import read_committed
from safeckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.arange(seed, seed + 8)},
            "optim": {"lr": 0.01 * seed, "step": seed}, "epoch": seed}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _is_dir_fd(fd: int) -> bool:
    try:
        return stat.S_ISDIR(os.fstat(fd).st_mode)
    except OSError:
        return False


RENAME_ERRORS = {
    "ENOTSUP": lambda *a, **k: _raise(OSError(errno.ENOTSUP, "Operation not supported")),
    "EXDEV": lambda *a, **k: _raise(OSError(errno.EXDEV, "Invalid cross-device link")),
    "PermissionError": lambda *a, **k: _raise(PermissionError(errno.EACCES, "Access is denied (WinError 5)")),
}


def _raise(exc: BaseException):
    raise exc


@pytest.fixture(params=sorted(RENAME_ERRORS))
def no_rename(request, monkeypatch):
    """os.rename / os.replace / os.link fail, and folder fsync fails with EINVAL."""
    fail = RENAME_ERRORS[request.param]
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        fail()

    for name in ("rename", "replace", "link"):
        monkeypatch.setattr(os, name, failing)
    real_fsync = os.fsync

    def fsync(fd):
        if _is_dir_fd(fd):
            calls.append(("fsync-dir", fd))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_save_and_load_without_rename_or_folder_fsync(tmp_path, no_rename):
    state = _state(1)
    safeckpt.save(state, tmp_path / "ckpt")
    assert _same(safeckpt.load_state(tmp_path / "ckpt"), state)
    assert safeckpt.verify(tmp_path / "ckpt").ok
    assert any(c[0] == "fsync-dir" for c in no_rename), "the folder fsync was attempted (and refused)"
    assert not [c for c in no_rename if c[0] != "fsync-dir"], "safeckpt must not need rename/replace/link"


def test_overwrite_without_rename_or_folder_fsync(tmp_path, no_rename):
    path = tmp_path / "ckpt"
    safeckpt.save(_state(1), path)
    safeckpt.save(_state(2), path, overwrite=True)
    assert _same(safeckpt.load_state(path), _state(2))
    safeckpt.save(_state(3), path, overwrite=True)
    assert _same(safeckpt.load_state(path), _state(3))
    assert len([n for n in os.listdir(path) if n.startswith("manifest-")]) == 1
    assert len([n for n in os.listdir(path) if n.startswith("data-")]) == 1


def test_manager_retention_without_rename_or_folder_fsync(tmp_path, no_rename):
    mgr = safeckpt.CheckpointManager(tmp_path / "run", keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, _state(step))
    assert mgr.steps() == [3, 4]
    assert sorted(n for n in os.listdir(tmp_path / "run") if n.startswith("step-")) == [
        "step-000000003", "step-000000004"]
    state = _state(0)
    assert mgr.restore(state) == 4
    assert _same(state, _state(4))
    assert _same(safeckpt.load_state(mgr.path(3)), _state(3))


def test_windows_like_folder_open_refused(tmp_path, monkeypatch):
    """Windows cannot open a folder for fsync (PermissionError): skipped, save works."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.path.isdir(path):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    mgr = safeckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    for step in (1, 2):
        mgr.save(step, _state(step))
    assert mgr.steps() == [2]
    assert _same(safeckpt.load_state(mgr.path(2)), _state(2))


# -- EIO from fsync: abort, never retry ------------------------------------------------

class _FsyncEIO:
    """os.fsync that fails with EIO on the ``nth`` file (not folder) fsync and counts."""

    def __init__(self, nth: int) -> None:
        self.nth = nth
        self.file_calls: list[str] = []
        self.real = os.fsync

    def __call__(self, fd: int) -> None:
        if _is_dir_fd(fd):
            return self.real(fd)
        self.file_calls.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else str(fd))
        if len(self.file_calls) == self.nth:
            raise OSError(errno.EIO, "Input/output error")
        return self.real(fd)


def _committed_state(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            read_committed(safeckpt.storage.open(path))
        except (CheckpointNotFoundError, CorruptCheckpointError):
            return None
        return safeckpt.load_state(path)


@pytest.mark.parametrize("which", ["data", "manifest"])
def test_fsync_eio_aborts_the_save_and_is_never_retried(tmp_path, monkeypatch, which):
    path = tmp_path / "ckpt"
    safeckpt.save(_state(1), path)
    before = set(os.listdir(path))
    eio = _FsyncEIO(nth=1 if which == "data" else 2)
    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(StorageError) as info:
        safeckpt.save(_state(2), path, overwrite=True)
    assert info.value.errno == errno.EIO
    assert "I/O error" in str(info.value) and str(path) in str(info.value)
    # fsync was called once per file up to the failing one; the failing one never again
    assert len(eio.file_calls) == eio.nth, eio.file_calls
    assert len(set(eio.file_calls)) == len(eio.file_calls), f"an fsync was retried: {eio.file_calls}"
    monkeypatch.setattr(os, "fsync", eio.real)
    # nothing committed, the previous checkpoint intact, the failed save's files removed
    assert _same(_committed_state(path), _state(1))
    assert set(os.listdir(path)) == before, f"the failed save left {set(os.listdir(path)) - before}"
    # and the next save works
    safeckpt.save(_state(3), path, overwrite=True)
    assert _same(safeckpt.load_state(path), _state(3))


def test_fsync_eio_on_first_save_leaves_nothing_committed(tmp_path, monkeypatch):
    eio = _FsyncEIO(nth=1)
    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(StorageError):
        safeckpt.save(_state(1), tmp_path / "ckpt")
    assert len(eio.file_calls) == 1
    monkeypatch.setattr(os, "fsync", eio.real)
    assert _committed_state(tmp_path / "ckpt") is None
    assert safeckpt.CheckpointManager(tmp_path).steps() == []
