"""Durability and storage failures: fsync order, nothing staged elsewhere, file modes,
fsync errors, a full disk, a read-only filesystem, permission denied.

System calls are observed by wrapping the real ones (``os.fsync``, ``os.open``), so
the files really are written; full and read-only disks are real tmpfs mounts (the
tests skip when mounting is not allowed)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch

import safeckpt
from save_child import make_state, make_template, state_mismatch


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def _small(value: float, n: int = 25_000) -> dict:
    return {"w": torch.full((n,), value), "step": int(value)}


def _loads_small(path, value: float, n: int = 25_000) -> None:
    got = safeckpt.load_state(path)
    assert got["step"] == int(value) and torch.equal(got["w"], torch.full((n,), value))


class Syscalls:
    """Records os.open (with O_CREAT), os.mkdir and os.fsync in order, by path."""

    def __init__(self, monkeypatch, fsync_hook=None) -> None:
        self.events: list[tuple[str, str]] = []
        real_open, real_mkdir, real_fsync = os.open, os.mkdir, os.fsync
        self.fsync_hook = fsync_hook

        def open_(path, flags, *a, **k):
            fd = real_open(path, flags, *a, **k)
            if flags & os.O_CREAT:
                self.events.append(("create", os.path.abspath(os.fspath(path))))
            return fd

        def mkdir(path, *a, **k):
            real_mkdir(path, *a, **k)
            self.events.append(("mkdir", os.path.abspath(os.fspath(path))))

        def fsync(fd):
            path = _fd_path(fd)
            self.events.append(("fsync", path))
            if self.fsync_hook is not None:
                self.fsync_hook(fd, path)
            return real_fsync(fd)

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "fsync", fsync)

    def index(self, kind: str, path: str, after: int = -1) -> int:
        for i, e in enumerate(self.events):
            if i > after and e == (kind, path):
                return i
        raise AssertionError(f"no {kind} of {path} after event {after}: {self.events}")

    def count(self, kind: str, path: str) -> int:
        return sum(1 for e in self.events if e == (kind, path))


# --------------------------------------------------------------------------- fsync


def test_data_then_manifest_each_fsynced_with_their_folder(tmp_path, monkeypatch):
    calls = Syscalls(monkeypatch)
    ckpt = tmp_path / "new" / "ckpt"
    info = safeckpt.save(make_state(1), ckpt)
    monkeypatch.undo()
    (data_name,) = info.files
    data, manifest, folder = str(ckpt / data_name), str(ckpt / "manifest-000001.json"), str(ckpt)

    created_data = calls.index("create", data)
    synced_data = calls.index("fsync", data, created_data)
    synced_folder_1 = calls.index("fsync", folder, synced_data)
    created_manifest = calls.index("create", manifest)
    synced_manifest = calls.index("fsync", manifest, created_manifest)
    synced_folder_2 = calls.index("fsync", folder, synced_manifest)
    assert synced_data < created_manifest, "the data file must be durable before the manifest exists"
    assert synced_folder_1 < created_manifest, "the data file's folder entry must be durable before the manifest"
    assert synced_folder_2 > synced_manifest
    # new folders are made durable in their parents before anything is committed in them
    for made in (tmp_path / "new", ckpt):
        mk = calls.index("mkdir", str(made))
        assert calls.index("fsync", str(made.parent), mk) < created_manifest
    assert state_mismatch(safeckpt.load_state(ckpt), 1) is None


def test_a_data_file_is_handed_to_the_disk_while_it_is_written_and_fsynced_after(tmp_path, monkeypatch):
    """The kernel is asked to write a data file to the disk as it is written, 16 MiB at a
    time, in order, without gaps (``sync_file_range``: a hint, not durability), and the
    file is still fsynced after its last byte. Without the hint the disk started only at
    the fsync: a 1 GiB save took 1.6x the time it takes with it."""
    from safeckpt.storage import local
    if local._sync_file_range is None:
        pytest.skip("no sync_file_range here (Linux only)")
    events: list[tuple] = []
    real_hint, real_fsync = local.OSFileSystem.start_writeback, local.OSFileSystem.fsync

    def hint(self, fd, offset, length):
        events.append(("hint", _fd_path(fd), offset, length))
        return real_hint(self, fd, offset, length)

    def fsync(self, fd):
        events.append(("fsync", _fd_path(fd)))
        return real_fsync(self, fd)

    monkeypatch.setattr(local.OSFileSystem, "start_writeback", hint)
    monkeypatch.setattr(local.OSFileSystem, "fsync", fsync)
    state = {"w": [torch.full((3 << 20,), float(i)) for i in range(4)]}  # 4 pieces of 12 MiB
    info = safeckpt.save(state, tmp_path / "ckpt")
    data = str(tmp_path / "ckpt" / info.files[0])
    hints = [(e[2], e[3]) for e in events if e[:2] == ("hint", data)]
    assert len(hints) >= 2 and all(n >= local.WRITEBACK_EVERY for _, n in hints), hints
    assert [a for a, _ in hints] == [0, *(a + n for a, n in hints[:-1])], "gaps or overlaps in the ranges"
    assert events.index(("fsync", data)) > max(i for i, e in enumerate(events) if e[:2] == ("hint", data))
    got = safeckpt.load_state(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(got["w"], state["w"]))


def test_fsync_eio_on_data_file_aborts_and_is_never_retried(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    safeckpt.save(_small(1.0), path)
    before = _files(path)

    def hook(fd, p):
        if os.path.basename(p).startswith("data-"):
            raise OSError(errno.EIO, "Input/output error")
    calls = Syscalls(monkeypatch, hook)
    with pytest.raises(safeckpt.StorageError) as exc:
        safeckpt.save(_small(2.0), path, overwrite=True)
    monkeypatch.undo()
    data_syncs = [p for k, p in calls.events if k == "fsync" and os.path.basename(p).startswith("data-")]
    assert len(data_syncs) == 1, f"fsync after EIO must never be retried: {data_syncs}"
    assert exc.value.errno == errno.EIO and isinstance(exc.value, OSError)
    assert "I/O error" in str(exc.value) and data_syncs[0] in str(exc.value)
    assert not any(k == "create" and "manifest-" in p for k, p in calls.events), "a manifest was written"
    assert _files(path) == before
    _loads_small(path, 1.0)


@pytest.mark.parametrize("over_old", [False, True], ids=["fresh", "overwrite"])
def test_fsync_eio_on_manifest_aborts_and_leaves_no_manifest(tmp_path, monkeypatch, over_old):
    path = tmp_path / "ckpt"
    if over_old:
        safeckpt.save(_small(1.0), path)
    before = _files(path)

    def hook(fd, p):
        if os.path.basename(p).startswith("manifest-"):
            raise OSError(errno.EIO, "Input/output error")
    calls = Syscalls(monkeypatch, hook)
    with pytest.raises(safeckpt.StorageError) as exc:
        safeckpt.save(_small(2.0), path, overwrite=over_old)
    monkeypatch.undo()
    manifest_syncs = [p for k, p in calls.events if k == "fsync" and "manifest-" in p]
    assert len(manifest_syncs) == 1, manifest_syncs
    assert "I/O error" in str(exc.value) and manifest_syncs[0] in str(exc.value)
    # the save failed, so it must leave nothing: not its data, and not a manifest
    assert _files(path) == before, f"the failed save left {_files(path) - before}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old one loads cleanly, nothing newer to skip
        if over_old:
            _loads_small(path, 1.0)
        else:
            with pytest.raises(safeckpt.CheckpointNotFoundError):
                safeckpt.load_state(path)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_folder_fsync_refused_is_tolerated(tmp_path, monkeypatch, code):
    def hook(fd, p):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
    calls = Syscalls(monkeypatch, hook)
    path = tmp_path / "ckpt"
    safeckpt.save(_small(1.0), path)
    safeckpt.save(_small(2.0), path, overwrite=True)
    monkeypatch.undo()
    assert calls.count("fsync", str(path)) >= 2, "the folder fsync should have been tried"
    _loads_small(path, 2.0)


@pytest.mark.parametrize("when", ["after_data", "after_manifest"])
def test_folder_fsync_eio_aborts_the_save(tmp_path, monkeypatch, when):
    """EIO on the folder's fsync: the new entry may not be durable, so the save fails
    and leaves the folder as it was (the old checkpoint loads with nothing to skip)."""
    path = tmp_path / "ckpt"
    safeckpt.save(_small(1.0), path)
    before = _files(path)

    def hook(fd, p):
        if p == str(path) and stat.S_ISDIR(os.fstat(fd).st_mode):
            if when == "after_data" or (path / "manifest-000002.json").exists():
                raise OSError(errno.EIO, "Input/output error")
    Syscalls(monkeypatch, hook)
    with pytest.raises(safeckpt.StorageError) as exc:
        safeckpt.save(_small(2.0), path, overwrite=True)
    monkeypatch.undo()
    assert "I/O error" in str(exc.value) and str(path) in str(exc.value)
    assert _files(path) == before, f"the failed save left {_files(path) - before}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loads_small(path, 1.0)


# --------------------------------------------------------------------------- where and how files are created


def test_nothing_is_created_outside_the_checkpoint_folder(tmp_path, monkeypatch):
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    root = tmp_path / "run"
    calls = Syscalls(monkeypatch)
    mgr = safeckpt.CheckpointManager(root, keep_last=1)
    mgr.save(1, make_state(1))
    mgr.save(2, make_state(2))
    safeckpt.save(make_state(3), mgr.path(2), overwrite=True)
    state = make_template()
    assert mgr.restore(state) == 2
    monkeypatch.undo()
    assert state_mismatch(state, 3) is None
    assert list(scratch.iterdir()) == [], "something was staged in TMPDIR"
    strays = [(k, p) for k, p in calls.events if k in ("create", "mkdir")
              and not (p == str(root) or p.startswith(str(root) + os.sep))]
    assert not strays, f"created outside the run folder: {strays}"


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o027, 0o640, 0o750), (0o002, 0o664, 0o775)])
def test_created_files_and_folders_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    root = tmp_path / "run"
    old = os.umask(umask)
    try:
        mgr = safeckpt.CheckpointManager(root)
        mgr.save(5, make_state(5))
        safeckpt.save(make_state(6), mgr.path(5), overwrite=True)
    finally:
        os.umask(old)
    folder = Path(mgr.path(5))
    for d in (root, folder):
        assert stat.S_IMODE(d.stat().st_mode) == dir_mode, f"{d}: {oct(d.stat().st_mode)}"
    files = list(folder.iterdir())
    assert len(files) == 2
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == file_mode, f"{f}: {oct(f.stat().st_mode)}"


# --------------------------------------------------------------------------- real filesystems that refuse


@contextlib.contextmanager
def _tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at tmp_path/mnt (skips when mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs mounted at tmp_path/mnt."""
    with _tmpfs(tmp_path, "2m") as mnt:
        yield mnt


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_full_disk_while_writing_data(small_fs):
    mgr = safeckpt.CheckpointManager(small_fs / "run")
    mgr.save(1, _small(1.0))
    big = {"w": torch.full((3 << 20 >> 2,), 2.0), "step": 2}  # 3 MiB on a 2 MiB disk
    with pytest.raises(safeckpt.StorageError) as exc:
        mgr.save(2, big)
    msg = str(exc.value)
    assert exc.value.errno == errno.ENOSPC
    assert "disk is full" in msg and mgr.path(2) in msg, msg
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    _loads_small(mgr.path(1), 1.0)
    assert _files(Path(mgr.path(2))) == set(), "the failed save's partial data was left behind"
    # the space is back: a save that fits, fits
    mgr.save(2, _small(2.0, n=1 << 18))  # 1 MiB
    assert mgr.steps() == [1, 2]
    _loads_small(mgr.path(2), 2.0, n=1 << 18)


def test_full_disk_while_writing_the_manifest(small_fs, tmp_path):
    """The data file takes the last free page, so only the manifest's write fails."""
    mgr = safeckpt.CheckpointManager(small_fs / "run")
    mgr.save(1, _small(1.0))
    free = _free_bytes(small_fs)
    # measure the header size of such a data file on a normal disk
    probe = safeckpt.save({"x": torch.zeros(free - 4096, dtype=torch.uint8)}, tmp_path / "probe")
    header = probe.bytes - (free - 4096)
    n = free - 64 - header
    with pytest.raises(safeckpt.StorageError) as exc:
        mgr.save(2, {"x": torch.zeros(n, dtype=torch.uint8)})
    msg = str(exc.value)
    assert "disk is full" in msg and "manifest-000001.json" in msg, msg
    assert mgr.steps() == [1]
    _loads_small(mgr.path(1), 1.0)
    assert _files(Path(mgr.path(2))) == set(), \
        f"the failed save left {_files(Path(mgr.path(2)))} (an empty manifest is not a commit, but it is litter)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing half-written to skip
        state = _small(0.0)
        assert mgr.restore(state) == 1
    mgr.save(2, _small(2.0))
    assert mgr.steps() == [1, 2]


def test_read_only_filesystem(small_fs):
    mgr = safeckpt.CheckpointManager(small_fs / "run")
    mgr.save(1, _small(1.0))
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
    with pytest.raises(safeckpt.StorageError) as exc:
        mgr.save(2, _small(2.0))
    assert "read-only" in str(exc.value) and mgr.path(2) in str(exc.value), str(exc.value)
    assert exc.value.errno == errno.EROFS
    with pytest.raises(safeckpt.StorageError) as exc:
        safeckpt.save(_small(3.0), mgr.path(1), overwrite=True)
    assert "read-only" in str(exc.value)
    # what is there still loads
    state = _small(0.0)
    assert mgr.restore(state) == 1
    assert torch.equal(state["w"], torch.full((25_000,), 1.0))
    assert safeckpt.verify(mgr.path(1)).ok


def test_permission_denied(fork_server, tmp_path):
    """As root nothing is denied, so a forked child drops to nobody (65534) first."""
    base = Path(tempfile.mkdtemp(prefix="safeckpt-perm-", dir="/tmp"))
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir(mode=0o555)
        locked.chmod(0o555)
        results = []
        for target in (locked / "ckpt", locked):  # a folder it cannot make / write into
            result = tmp_path / f"result-{len(results)}.json"
            pid = fork_server.fork("save_as", path=str(target), result=str(result), uid=65534, gid=65534)
            status = fork_server.wait(pid)
            assert status["code"] == 0, status
            results.append((target, json.loads(result.read_text())))
        for target, out in results:
            assert not out["ok"], f"saving to {target} as nobody succeeded"
            assert out["is_storage_error"], out
            assert out["errno"] == errno.EACCES, out
            assert "permission denied" in out["message"] and str(target) in out["message"], out
        assert list(locked.iterdir()) == []
    finally:
        for p in sorted(base.rglob("*"), reverse=True):
            p.chmod(0o755)
        subprocess.run(["rm", "-rf", str(base)])


def test_failed_and_good_saves_alternating_on_a_full_disk_never_hang(tmp_path):
    """A disk that fills partway into an 8 MiB data file, a failing save and a good one
    in turn, round after round: every failed save stops its hashing thread before it
    returns (a suspended stream left for the garbage collector once closed its pool
    inside another thread's start and deadlocked), and the loop ends well within a
    deadline, with the collector made to run as often as it can."""
    with _tmpfs(tmp_path, "5m") as mnt:
        _alternate_failing_and_good_saves(mnt)


def _alternate_failing_and_good_saves(mnt: Path) -> None:
    script = f"""
import gc, threading, torch, safeckpt
mgr = safeckpt.CheckpointManager({str(mnt / "run")!r}, keep_last=1)
big, good = {{"w": torch.ones(2 << 20)}}, {{"w": torch.ones(3 << 17)}}  # 8 MiB, 1.5 MiB
for i in range(60):
    try:
        mgr.save(2 * i, big)
        raise SystemExit("8 MiB fit on a 5 MiB disk")
    except safeckpt.StorageError:
        pass
    left = [t.name for t in threading.enumerate() if t.name.startswith("safeckpt-")]
    assert not left, f"round {{i}}: threads of the failed save still running: {{left}}"
    gc.set_threshold(1)  # collections at every allocation, thread starts included
    for _ in range(3):
        t = threading.Thread(target=len, args=((),))
        t.start()
        t.join()
    gc.set_threshold(700)
    mgr.save(2 * i + 1, good)
assert mgr.steps() == [119]
print("OK")
"""
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the alternating full-disk loop hung")
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
