"""Local saves on real filesystems other than the machine's own disk: XFS and btrfs on
loop devices (40 MB ones that fill up, and a read-only remount), and FUSE mounts of a
SeaweedFS bucket -- rclone without its cache, rclone with its write-back cache, s3fs --
whose objects are checked through the S3 API as well.

By default one short cell per storage runs: on XFS, saves SIGKILLed again and again
must not fill the disk (each later save clears what the killed ones left); on btrfs,
save, overwrite, the manager, a full disk and a read-only remount; on each mount, the
same round trip with every file in the bucket, and on rclone's write-back cache the
warning that its fsync is not durable. Behind ``slow``: kills during overwrites,
safeckpt.dcp and the conformance suite on every one of them, and the bucket without
any checkpoint right after an overwrite through rclone's write-back cache. The storages
come from tests/storageservers.py and skip with the reason where a tool is missing.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import safeckpt
from s3servers import seaweedfs_server  # noqa: F401
from save_child import make_state, make_template, state_mismatch
from storageservers import FUSE_KINDS, bucket_mount, loop_filesystem, remount_read_only
from safeckpt.format.names import DATA_RE
from safeckpt.storage import LocalStorage
from safeckpt.testing import StorageTests
from test_kill import overwrite_kill_loop

DISKS = ("xfs", "btrfs")


def small(step: int, n: int = 64 << 10) -> dict:
    """A 256 KiB state whose values are a function of ``step``."""
    return {"w": torch.arange(n, dtype=torch.float32) + step, "step": step}


def assert_small(got: dict, step: int, n: int = 64 << 10) -> None:
    assert got["step"] == step and torch.equal(got["w"], torch.arange(n, dtype=torch.float32) + step)


def tree(folder: Path) -> dict[str, int]:
    """Every file under ``folder``: relative path -> size."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_in_bucket(m, sub: str = "") -> None:
    """The bucket holds exactly the files the mount shows under ``sub`` (S3 API)."""
    where = m.path / sub if sub else m.path
    assert m.objects(sub) == {os.path.join(sub, k) if sub else k: v for k, v in tree(where).items()}


def exercise(root: Path) -> None:
    """Save, load, refuse a second save, overwrite atomically, and run a manager with
    retention and restore, all in ``root``; what is left is exactly the committed files."""
    path = root / "ck"
    safeckpt.save(small(1), path)
    assert_small(safeckpt.load_state(path), 1)
    with pytest.raises(safeckpt.CheckpointExistsError):
        safeckpt.save(small(2), path)
    safeckpt.save(small(2), path, overwrite=True)
    assert_small(safeckpt.load_state(path), 2)
    assert safeckpt.verify(path).ok
    names = sorted(os.listdir(path))
    assert len(names) == 2 and names[1] == "manifest-000002.json" and DATA_RE.fullmatch(names[0]), names
    with safeckpt.CheckpointManager(root / "run", keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, small(step))
        assert mgr.steps() == [2, 3]
        state = small(0)
        assert mgr.restore(state) == 3
        assert_small(state, 3)
    assert sorted(p.name for p in (root / "run").iterdir() if p.name.startswith("step-")) == \
        ["step-000000002", "step-000000003"]


@pytest.fixture(params=DISKS)
def disk(request, tmp_path):
    """A fresh 128 MB filesystem of each kind on a loop device (room for the kill loop's
    calibration saves beside its checkpoint)."""
    with loop_filesystem(request.param, 128, tmp_path / request.param) as mnt:
        yield mnt


@pytest.fixture
def xfs(tmp_path):
    with loop_filesystem("xfs", 40, tmp_path / "xfs") as mnt:
        yield mnt


@pytest.fixture
def btrfs(tmp_path):
    with loop_filesystem("btrfs", 40, tmp_path / "btrfs") as mnt:
        yield mnt


@pytest.fixture(params=FUSE_KINDS)
def mount(request, tmp_path):
    """A fresh bucket of the SeaweedFS server mounted by each FUSE daemon."""
    with bucket_mount(request.param, request.getfixturevalue("seaweedfs_server"), tmp_path / "fuse") as m:
        yield m


@pytest.fixture
def durable_mount(request, tmp_path):
    """``mount``, for the tests that run with the mounts whose close is durable."""
    with bucket_mount(request.param, request.getfixturevalue("seaweedfs_server"), tmp_path / "fuse") as m:
        yield m


DURABLE = [k for k in FUSE_KINDS if k != "rclone-writes"]


# --------------------------------------------------------------------------- default cells

def test_xfs_killed_saves_do_not_fill_a_small_disk(fork_server, xfs):
    """Each save below is SIGKILLed while writing its ~6 MB data file. Its partial file
    used to stay until someone ran ``safeckpt gc``, and after a few kills every later
    save failed with ENOSPC on this 40 MB disk; now each save first clears what saves
    killed before it left there (their writers are dead), and the last good checkpoint
    stays loadable throughout."""
    path = xfs / "ck"
    safeckpt.save(make_state(0), path)
    for value in range(1, 13):
        status = fork_server.wait(fork_server.fork("crash_at", path=str(path), value=value, point="mid_data"))
        err = Path(f"{path}.err")
        assert status["signal"] == signal.SIGKILL, (status, err.read_text() if err.exists() else "")
        assert state_mismatch(safeckpt.load_state(path), 0) is None
    leftovers = [n for n in os.listdir(path) if DATA_RE.fullmatch(n)]
    assert len(leftovers) == 2, leftovers  # the committed data file and the last killed one
    safeckpt.save(make_state(13), path, overwrite=True)
    state = make_template()
    safeckpt.load(state, path)
    assert state_mismatch(state, 13) is None
    assert len(os.listdir(path)) == 2


def test_btrfs_saves_a_full_disk_and_a_read_only_remount(btrfs):
    exercise(btrfs)
    mgr = safeckpt.CheckpointManager(btrfs / "run", keep_last=2)
    with pytest.raises(safeckpt.StorageError) as info:
        mgr.save(4, {"w": torch.ones(15 << 20)})  # 60 MB on a 40 MB disk
    assert info.value.errno == errno.ENOSPC and "disk is full" in str(info.value)
    assert mgr.steps() == [2, 3]
    assert not (btrfs / "run" / "step-000000004").exists() or not os.listdir(btrfs / "run" / "step-000000004")
    remount_read_only(btrfs)
    with pytest.raises(safeckpt.StorageError) as info:
        mgr.save(5, small(5))
    assert info.value.errno == errno.EROFS and "read-only" in str(info.value)
    state = small(0)
    assert mgr.restore(state) == 3
    assert_small(state, 3)
    assert safeckpt.verify(mgr.path(2)).ok


@pytest.mark.parametrize("durable_mount", DURABLE, indirect=True)
def test_a_bucket_mount_saves_and_the_bucket_holds_every_file(durable_mount):
    """rclone without its cache and s3fs upload a file when it is closed (s3fs also when
    fsynced): every save is in the bucket when it returns, seen through the S3 API."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", safeckpt.WeakStorageWarning)
        exercise(durable_mount.path)
    assert_in_bucket(durable_mount)


def test_rclone_write_back_cache_is_warned_about(tmp_path, seaweedfs_server):
    """With --vfs-cache-mode writes, fsync and close return before rclone uploads a
    file; a save there used to pass in silence."""
    with bucket_mount("rclone-writes", seaweedfs_server, tmp_path / "fuse") as m:
        with pytest.warns(safeckpt.WeakStorageWarning, match="--vfs-cache-mode off") as seen:
            safeckpt.save(small(1), m.path / "ck")
        assert "--vfs-cache-mode writes" in str(seen[0].message) and str(m.path) in str(seen[0].message)
        assert_small(safeckpt.load_state(m.path / "ck"), 1)


# --------------------------------------------------------------------------- slow cells

@pytest.mark.slow
def test_rclone_write_back_cache_leaves_the_bucket_without_a_checkpoint(tmp_path, seaweedfs_server):
    """What the warning is about: right after an overwrite through the write-back cache
    the bucket holds neither the old manifest (deleted at once) nor the new one (uploaded
    seconds later); a machine lost then has no checkpoint."""
    with bucket_mount("rclone-writes", seaweedfs_server, tmp_path / "fuse") as m:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", safeckpt.WeakStorageWarning)
            safeckpt.save(small(1), m.path / "ck")
            deadline = time.monotonic() + 30
            while "ck/manifest-000001.json" not in m.objects():
                assert time.monotonic() < deadline, m.objects()
                time.sleep(0.2)
            safeckpt.save(small(2), m.path / "ck", overwrite=True)
        assert not [k for k in m.objects("ck") if k.startswith("ck/manifest-")], m.objects("ck")


@pytest.mark.slow
@pytest.mark.parametrize("disk", DISKS, indirect=True)
def test_disk_round_trip(disk):
    exercise(disk)


@pytest.mark.slow
@pytest.mark.parametrize("disk", DISKS, indirect=True)
def test_kills_during_overwrites_on_a_disk(fork_server, tmp_path, disk):
    overwrite_kill_loop(fork_server, tmp_path, kills=6, seed=26, where=disk)


@pytest.mark.slow
@pytest.mark.parametrize("durable_mount", DURABLE, indirect=True)
def test_kills_during_overwrites_on_a_bucket_mount(fork_server, tmp_path, durable_mount):
    """A killed writer's partial file is uploaded as a short object (the kernel closes
    it for the dead process); the checkpoint loads old or new, never a mix."""
    overwrite_kill_loop(fork_server, tmp_path, kills=4, seed=27, where=durable_mount.path)
    assert_in_bucket(durable_mount, "one")


def dcp_round_trip(path: "Path | str", storage_options: dict | None = None) -> None:
    """``torch.distributed.checkpoint`` through ``safeckpt.dcp`` at ``path``: saved twice
    (the second replaces the first), loaded back exactly, verified."""
    import torch.distributed.checkpoint as dcp

    import safeckpt.dcp

    options = storage_options or {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        for seed in (1, 2):
            state = {"model": {"w": torch.randn(64, 8, generator=torch.Generator().manual_seed(seed)),
                               "b": torch.arange(8) + seed}}
            dcp.save(state, storage_writer=safeckpt.dcp.Writer(path, storage_options=options))
        target = {"model": {"w": torch.zeros(64, 8), "b": torch.zeros(8, dtype=torch.int64)}}
        dcp.load(target, storage_reader=safeckpt.dcp.Reader(path, storage_options=options))
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and torch.equal(target["model"]["b"],
                                                                                   state["model"]["b"])
    assert safeckpt.verify(path, storage_options=options).ok


@pytest.mark.slow
@pytest.mark.parametrize("disk", DISKS, indirect=True)
def test_dcp_on_a_disk(disk):
    dcp_round_trip(disk / "dcp")


@pytest.mark.slow
@pytest.mark.parametrize("durable_mount", DURABLE, indirect=True)
def test_dcp_on_a_bucket_mount(durable_mount):
    dcp_round_trip(durable_mount.path / "dcp")
    assert_in_bucket(durable_mount, "dcp")


@pytest.mark.slow
@pytest.mark.parametrize("storage", [*DISKS, *DURABLE])
class TestConformance(StorageTests):
    """``StorageTests`` on a folder of each filesystem and mount."""

    @pytest.fixture(autouse=True)
    def _where(self, request, tmp_path, storage):
        if storage in DISKS:
            with loop_filesystem(storage, 40, tmp_path / storage) as mnt:
                self.where = mnt
                yield
            return
        with bucket_mount(storage, request.getfixturevalue("seaweedfs_server"), tmp_path / "fuse") as m:
            self.where = m.path
            yield

    def make_storage(self):
        return LocalStorage(self.where / uuid.uuid4().hex)
