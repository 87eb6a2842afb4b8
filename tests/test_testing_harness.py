"""safeckpt.testing itself: crashes, power cuts, injected errors, and the docs example."""

from __future__ import annotations

import errno
import os
import re
import time
import warnings
from pathlib import Path

import expected_warnings
import pytest
import torch

import safeckpt
from safeckpt.format.folder import read_committed
from safeckpt.errors import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from safeckpt.storage import LocalStorage
from safeckpt.testing import (DISK_PROFILES, Fault, FaultyStorage, MemoryObjectStore, SimulatedCrash,
                              SimulatedDisk, crash_points, storage_for_profile)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 4, generator=g), "b": torch.arange(seed, seed + 4), "step": seed}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _committed(storage) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            read_committed(storage)
            return True
        except (CheckpointNotFoundError, CorruptCheckpointError):
            return False


# -- the docs example runs as written ----------------------------------------------------

def test_docs_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    namespace: dict = {}
    for code in blocks[:2]:  # the two complete examples (the third is an API sketch)
        exec(compile(code, str(DOCS), "exec"), namespace)
    tests = [fn for name, fn in namespace.items() if name.startswith("test_")]
    assert len(tests) == 2
    for fn in tests:
        with expected_warnings.only():  # a crash in the example may tear a newer manifest
            fn()


# -- crashes -------------------------------------------------------------------------------

def test_simulated_crash_is_not_swallowed_and_the_process_stays_dead():
    storage = FaultyStorage(storage_for_profile("object-store")[0], crash_after=2)
    with pytest.raises(SimulatedCrash):
        try:
            safeckpt.save(_state(1), storage.child("ckpt"))
        except Exception:  # library-style cleanup must not catch it
            pytest.fail("SimulatedCrash was caught by except Exception")
    assert not issubclass(SimulatedCrash, Exception)
    with pytest.raises(SimulatedCrash):
        storage.listdir()  # every later operation crashes too
    storage.revive()
    storage.listdir()


def test_crash_points_counts_and_covers_every_operation():
    seen = []
    points = list(crash_points(lambda root: safeckpt.save(_state(1), root.child("c")), "posix", power_cuts=1))
    total = points[0].total
    assert {p.k for p in points} == set(range(1, total + 2))
    assert {p.outcome for p in points} == {"kill", "drop", "power-cut#0"}
    assert all(p.crashed for p in points if p.k <= total)
    assert not any(p.crashed for p in points if p.k == total + 1)
    for p in points:
        seen.append(p.op.split(" ")[0])
    assert {"open", "write", "fsync", "fsync_dir", "close", "mkdir"} <= set(seen)


def test_torn_write_at_storage_level_leaves_a_partial_file():
    bucket_storage, disk = storage_for_profile("posix")
    faulty = FaultyStorage(bucket_storage, crash_after=1, seed=3)
    with pytest.raises(SimulatedCrash):
        faulty.write_file("x.bin", [b"a" * 1000, b"b" * 1000])
    data = disk.files("/ckpt").get("x.bin", b"")
    assert len(data) < 2000 and data == (b"a" * 1000 + b"b" * 1000)[:len(data)]


# -- the power cut model -----------------------------------------------------------------

def _write(disk: SimulatedDisk, path: str, data: bytes, *, fsync: bool, dir_fsync: bool) -> None:
    fd = disk.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    disk.write(fd, data)
    if fsync:
        disk.fsync(fd)
    disk.close(fd)
    if dir_fsync:
        dfd = disk.open(os.path.dirname(path), os.O_RDONLY)
        disk.fsync(dfd)
        disk.close(dfd)


def test_posix_power_cut_loses_unsynced_data_and_entries():
    disk = SimulatedDisk("posix")
    disk.makedirs("/d")
    _write(disk, "/d/synced", b"x" * 100, fsync=True, dir_fsync=True)
    _write(disk, "/d/no-dir-fsync", b"y" * 100, fsync=True, dir_fsync=False)
    a = disk.clone()
    a.crash(mode="drop")
    assert a.files("/d") == {"synced": b"x" * 100}
    b = disk.clone()
    b.crash(mode="keep")
    assert b.files("/d") == {"synced": b"x" * 100, "no-dir-fsync": b"y" * 100}
    # data written but not fsynced: the entry survives (folder synced), the bytes do not
    _write(disk, "/d/no-fsync", b"z" * 100, fsync=False, dir_fsync=True)
    disk.crash(mode="drop")
    assert disk.files("/d")["no-fsync"] == b""


def test_random_power_cut_tears_unsynced_writes():
    kinds = set()
    for seed in range(60):
        disk = SimulatedDisk("nfs")
        disk.makedirs("/d")
        fd = disk.open("/d/f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        for i in range(4):
            disk.write(fd, bytes([65 + i]) * 50)
        disk.crash(seed)
        data = disk.files("/d")["f"]  # nfs: the entry is durable at once
        assert len(data) <= 200
        for i in range(4):
            seg = data[50 * i:50 * i + 50]
            kinds.add("kept" if seg == bytes([65 + i]) * 50 else
                      "dropped" if seg.strip(b"\0") == b"" else "torn")
    assert kinds == {"kept", "dropped", "torn"}


def test_fuse_object_uploads_on_close_and_a_killed_writers_file_as_far_as_it_got():
    """As measured on rclone and s3fs mounts of a bucket (test_real_filesystems.py):
    rclone uploads nothing on fsync, only on close, so a power cut after the fsync loses
    the file; a killed writer's file is closed by the kernel and uploaded as it stands,
    a short object, never garbage."""
    disk = SimulatedDisk("fuse-object")
    disk.makedirs("/d")
    fd = disk.open("/d/f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    disk.write(fd, b"q" * 100)
    disk.fsync(fd)
    disk.crash(mode="drop")
    assert disk.files("/d") == {}
    fd = disk.open("/d/f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    disk.write(fd, b"q" * 100)
    disk.crash(mode="keep")  # SIGKILL while writing: the first 100 of more bytes
    assert disk.files("/d") == {"f": b"q" * 100}
    with pytest.raises(OSError) as info:  # uploaded: an immutable object now
        disk.write(disk.open("/d/f", os.O_WRONLY), b"more")
    assert info.value.errno == errno.EPERM


def test_fuse_object_files_are_whole_or_absent_after_a_power_cut():
    for seed in range(20):
        disk = SimulatedDisk("fuse-object")
        disk.makedirs("/d")
        fd = disk.open("/d/f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        disk.write(fd, b"q" * 100)
        disk.crash(seed)
        assert disk.files("/d") == {}
        _write(disk, "/d/g", b"r" * 100, fsync=False, dir_fsync=False)  # uploaded on close
        disk.crash(seed)
        assert disk.files("/d") == {"g": b"r" * 100}
    with pytest.raises(OSError) as info:
        disk.rename("/d/g", "/d/h")
    assert info.value.errno == errno.ENOTSUP


def test_windows_folder_fsync_is_refused_but_saves_are_durable():
    storage, disk = storage_for_profile("windows")
    with pytest.raises(PermissionError):
        disk.open("/ckpt", os.O_RDONLY)
    safeckpt.save(_state(1), storage.child("c"))
    disk.crash(mode="drop")
    assert _same(safeckpt.load_state(storage.child("c")), _state(1))
    assert DISK_PROFILES["windows"].replace_open_fails


def test_harness_catches_a_storage_that_skips_fsync():
    """A backend that never fsyncs passes every ordinary test; the harness finds it."""

    class NoFsync:
        def __init__(self, fs):
            self.fs = fs

        def __getattr__(self, name):
            return getattr(self.fs, name)

        def fsync(self, fd):
            return None

    def save(root):
        safeckpt.save(_state(1), LocalStorage(root.path, fs=NoFsync(root.fs)).child("c"))

    lost = [p for p in crash_points(save, "posix", power_cuts=0)
            if not p.crashed and not _committed(p.storage.child("c"))]
    assert lost, "a save that returned without fsync should be lost by the power cut"


# -- injected errors ---------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["posix", "object-store"])
def test_enospc_after_n_bytes(profile):
    storage, _ = storage_for_profile(profile)
    safeckpt.save(_state(1), storage.child("c"))
    faulty = FaultyStorage(storage, enospc_after_bytes=300)
    with pytest.raises(StorageError, match="disk is full") as info:
        safeckpt.save(_state(2), faulty.child("c"), overwrite=True)
    assert info.value.errno == errno.ENOSPC and "/c/" in str(info.value)
    assert _same(safeckpt.load_state(storage.child("c")), _state(1))
    assert len([n for n in storage.child("c").listdir() if n.startswith("data-")]) == 1


def test_simulated_disk_capacity_gives_enospc():
    storage, disk = storage_for_profile("posix")
    disk.capacity = 200
    with pytest.raises(StorageError, match="disk is full"):
        safeckpt.save(_state(1), storage.child("c"))
    assert not _committed(storage.child("c"))


@pytest.mark.parametrize("code, words", [(errno.EACCES, "permission denied"),
                                         (errno.EROFS, "read-only")])
def test_eacces_and_erofs_are_clear_storage_errors(code, words):
    storage, _ = storage_for_profile("posix")
    safeckpt.save(_state(1), storage.child("c"))
    faulty = FaultyStorage(storage, faults=[Fault("write_file", code)])
    with pytest.raises(StorageError, match=words):
        safeckpt.save(_state(2), faulty.child("c"), overwrite=True)
    ro = FaultyStorage(storage, read_only=True)
    with pytest.raises(StorageError, match="read-only"):
        safeckpt.save(_state(2), ro.child("d"))
    assert _same(safeckpt.load_state(storage.child("c")), _state(1))


def test_eio_on_read_fails_the_load_with_storage_error():
    storage, _ = storage_for_profile("posix")
    safeckpt.save(_state(1), storage.child("c"))
    faulty = FaultyStorage(storage, faults=[Fault("read", errno.EIO, path="data-")])
    with pytest.raises(StorageError, match="I/O error"):
        safeckpt.load_state(faulty.child("c"))


@pytest.mark.parametrize("which", ["data-", "manifest-"])
def test_eio_on_fsync_aborts_the_save_and_is_never_retried(which):
    storage, disk = storage_for_profile("posix")
    safeckpt.save(_state(1), storage.child("c"))
    disk.inject("fsync", errno.EIO, path=which)
    start = len(disk.log)
    with pytest.raises(StorageError, match="I/O error"):
        safeckpt.save(_state(2), storage.child("c"), overwrite=True)
    fsyncs = [path for _, kind, path in disk.log[start:] if kind == "fsync" and which in path]
    assert len(fsyncs) == 1, fsyncs
    assert _same(safeckpt.load_state(storage.child("c")), _state(1))


def test_transient_errors_go_away():
    storage, _ = storage_for_profile("object-store")
    faulty = FaultyStorage(storage, faults=[Fault("write_file", errno.EIO, times=1)])
    with pytest.raises(StorageError):
        safeckpt.save(_state(1), faulty.child("c"))
    safeckpt.save(_state(1), faulty.child("c"))
    assert _same(safeckpt.load_state(storage.child("c")), _state(1))


def test_stale_listing_never_silently_replaces_a_committed_checkpoint():
    storage, _ = storage_for_profile("posix")
    faulty = FaultyStorage(storage, stale_listings=2)
    safeckpt.save(_state(1), faulty.child("c"))
    assert "manifest-000001.json" not in faulty.child("c").listdir()  # predates the commit
    try:
        safeckpt.save(_state(2), faulty.child("c"), overwrite=True)
    except CheckpointExistsError:
        pass  # the exclusive create caught the stale view: refused, nothing lost
    got = safeckpt.load_state(storage.child("c"))
    assert _same(got, _state(1)) or _same(got, _state(2))


def test_ambiguous_put_on_the_object_store():
    storage, bucket = storage_for_profile("object-store")
    safeckpt.save(_state(1), storage.child("c"))
    bucket.inject("put", errno.EIO, path="manifest-", effect="after")  # the PUT happened
    with pytest.raises(StorageError):
        safeckpt.save(_state(2), storage.child("c"), overwrite=True)
    got = safeckpt.load_state(storage.child("c"))
    assert _same(got, _state(1)) or _same(got, _state(2))


def test_object_store_conditional_create():
    store = MemoryObjectStore()
    store.write_file("a", [b"1"])
    with pytest.raises(FileExistsError):
        store.write_file("a", [b"2"])
    assert store.read("a") == b"1"
    assert store.listdir() == {"a": 1}


def test_latency():
    storage, _ = storage_for_profile("object-store")
    faulty = FaultyStorage(storage, latency=0.01)
    started = time.perf_counter()
    for _ in range(5):
        faulty.listdir()
    assert time.perf_counter() - started >= 0.05
