"""``Storage.open_replace``: one file under a fixed name (Lightning's ``last.ckpt``,
DeepSpeed's ``latest``) replaced atomically on every storage profile.

The rule, checked at every storage operation of a replacement, for a process kill and
for power cuts (every unsynced write kept, dropped or torn; every unsynced folder change
kept or undone): the name holds the old complete file or the new complete one, and
once ``replace_file`` returned, the new one, whatever the power does next. The one
exception is stated by the FUSE profile: a process killed while the final name is being
written may leave the mount uploading the part it had (a prefix of the new file), which
is why readers check what they read. Also: Windows' refusals while another process holds
the file open are retried, and the sequence stock Lightning uses (no fsync) loses the
file on the same simulated disk, so the test can fail.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

import safeckpt
from safeckpt.storage import LocalStorage
from safeckpt.storage import local as local_backend
from safeckpt.testing import PROFILES, SimulatedDisk, crash_points, storage_for_profile

OLD = bytes(range(256)) * 12                       # 3 KiB
NEW = b"new!" * ((3 << 19) // 4)                   # 1.5 MiB in three writes (small ones are gathered)


def new_parts():
    view = memoryview(NEW)
    return [view[:100], view[100:(1 << 20) + 100], view[(1 << 20) + 100:]]


def content(storage) -> bytes | None:
    return storage.read("last.ckpt") if "last.ckpt" in storage.listdir() else None


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("first", [False, True], ids=["over-an-old-file", "first-save"])
def test_the_name_holds_the_old_or_the_new_file_at_every_crash_point(profile, first):
    def setup(root):
        if not first:
            root.replace_file("last.ckpt", [OLD])

    points = 0
    for point in crash_points(lambda root: root.replace_file("last.ckpt", new_parts()), profile,
                              setup=setup, power_cuts=2):
        points += 1
        got = content(point.storage)
        before = None if first else OLD
        if not point.crashed:
            assert got == NEW, f"{point}: the replacement returned but did not last"
        elif profile == "fuse-object" and point.outcome == "kill" and got not in (before, NEW):
            assert got is not None and NEW.startswith(got), f"{point}: {len(got)} bytes that are not a prefix"
        else:
            assert got in (before, NEW), f"{point}: {None if got is None else len(got)} bytes of neither file"
        # whatever a killed replacement left (a temporary file) goes with the next one
        point.storage.replace_file("last.ckpt", [b"next"])
        assert point.storage.listdir() == {"last.ckpt": 4}, point
    assert points > (1 if profile == "object-store" else 30), points


def test_stock_lightnings_sequence_loses_the_file_on_the_same_disk():
    """What ``fsspec``'s transaction does on a local disk: write a temporary file, close
    it, rename it over the name; no fsync of the file or the folder. A power cut after
    the rename can leave the name with neither file: the harness sees it."""
    def stock(root):
        disk = root.fs
        tmp = os.path.join(root.path, "tmp123")
        fd = disk.open(tmp, os.O_WRONLY | os.O_CREAT)
        disk.write(fd, NEW)
        disk.close(fd)
        disk.replace(tmp, os.path.join(root.path, "last.ckpt"))

    bad = [p for p in crash_points(stock, "posix", setup=lambda root: root.replace_file("last.ckpt", [OLD]),
                                   power_cuts=4)
           if content(p.storage) not in (OLD, NEW)]
    assert bad, "the harness did not catch a rename without fsync"


def test_windows_retries_while_another_process_holds_the_file(monkeypatch):
    monkeypatch.setattr(local_backend, "REPLACE_RETRY_DELAYS", (0.01,) * 20)
    storage, disk = storage_for_profile("windows")
    storage.replace_file("last.ckpt", [OLD])
    reader = disk.open_reader("/ckpt/last.ckpt")  # another process reads the old checkpoint
    threading.Timer(0.05, reader.close).start()
    started = time.perf_counter()
    storage.replace_file("last.ckpt", [b"new"])
    assert storage.read("last.ckpt") == b"new" and time.perf_counter() - started >= 0.04
    assert storage.listdir() == {"last.ckpt": 3}

    # a holder that never lets go: a clear error once the retries are spent, the old file kept
    monkeypatch.setattr(local_backend, "REPLACE_RETRY_DELAYS", (0.0,) * 3)
    fault = disk.inject("rename", errno.EACCES)
    with pytest.raises(safeckpt.StorageError, match="permission denied"):
        storage.replace_file("last.ckpt", [b"newer"])
    assert fault.fired == 4  # the first try and three retries
    assert storage.read("last.ckpt") == b"new" and storage.listdir() == {"last.ckpt": 3}


def test_a_rename_refused_for_a_reason_other_than_another_holder_is_not_retried():
    storage, disk = storage_for_profile("posix")
    storage.replace_file("last.ckpt", [OLD])
    fault = disk.inject("rename", errno.EROFS)
    with pytest.raises(safeckpt.StorageError, match="read-only"):
        storage.replace_file("last.ckpt", [b"new"])
    assert fault.fired == 1 and storage.read("last.ckpt") == OLD


def test_fuse_mount_without_rename_gets_the_final_name_written_whole():
    storage, disk = storage_for_profile("fuse-object")
    storage.replace_file("last.ckpt", [OLD])
    storage.replace_file("last.ckpt", new_parts())
    assert storage.read("last.ckpt") == NEW and storage.listdir() == {"last.ckpt": len(NEW)}
    kinds = [kind for _, kind, _ in disk.log]
    assert "rename" in kinds  # tried, refused (ENOTSUP), then the copy under the final name


def test_a_replacement_replaces_a_symbolic_link_itself(tmp_path):
    (tmp_path / "epoch=0.ckpt").write_bytes(OLD)
    os.symlink("epoch=0.ckpt", tmp_path / "last.ckpt")
    LocalStorage(tmp_path).replace_file("last.ckpt", [b"new"])
    assert not os.path.islink(tmp_path / "last.ckpt")
    assert (tmp_path / "last.ckpt").read_bytes() == b"new"
    assert (tmp_path / "epoch=0.ckpt").read_bytes() == OLD, "the replacement wrote through the link"


def test_a_real_folder_gets_a_durable_file_and_no_temporary_name_is_left(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else str(fd))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    storage = LocalStorage(tmp_path / "ckpts")
    storage.replace_file("last.ckpt", new_parts())
    assert (tmp_path / "ckpts" / "last.ckpt").read_bytes() == NEW
    assert os.listdir(tmp_path / "ckpts") == ["last.ckpt"]
    if os.path.exists("/proc/self/fd"):
        assert any(".last.ckpt.safeckpt-" in s for s in synced), synced        # the file, before the rename
        assert synced[-1] == str(tmp_path / "ckpts"), synced                    # its folder, after


def test_simulated_disk_o_trunc_on_a_fuse_mount_replaces_at_upload():
    disk = SimulatedDisk("fuse-object")
    disk.makedirs("/d")
    fd = disk.open("/d/f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    disk.write(fd, b"old")
    disk.close(fd)
    fd = disk.open("/d/f", os.O_WRONLY | os.O_TRUNC)
    disk.write(fd, b"new data")
    assert disk.files("/d") == {"f": b"old"}, "the mount showed the new object before its upload"
    disk.close(fd)
    assert disk.files("/d") == {"f": b"new data"}
