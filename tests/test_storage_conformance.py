"""``safeckpt.testing.StorageTests`` against every backend in the tree: local folders,
the simulated disks of every profile, the in-memory object store, fsspec's memory://,
a fault-injecting wrapper, S3 on real moto and SeaweedFS servers, Azure Blob Storage on
Azurite and Google Cloud Storage on fake-gcs-server (the last two behind ``slow``: their
default cells are in test_object_store.py), and local folders on XFS, btrfs and FUSE
mounts of a bucket in test_real_filesystems.py."""

from __future__ import annotations

import uuid

import pytest

from safeckpt.storage import LocalStorage, open as open_storage
from safeckpt.testing import FaultyStorage, MemoryObjectStore, StorageTests, storage_for_profile
from s3servers import moto_server, s3_bucket, seaweedfs_server  # noqa: F401
from storageservers import azurite_server, gcs_server  # noqa: F401


class TestLocal(StorageTests):
    @pytest.fixture(autouse=True)
    def _folder(self, tmp_path):
        self.folder = tmp_path

    def make_storage(self):
        return LocalStorage(self.folder / uuid.uuid4().hex)


class TestLocalFollowingSymlinks(TestLocal):
    def make_storage(self):
        return open_storage(self.folder / uuid.uuid4().hex, follow_symlinks=True)


@pytest.mark.parametrize("profile", ["posix", "nfs", "windows", "fuse-object", "object-store"])
class TestSimulated(StorageTests):
    @pytest.fixture(autouse=True)
    def _profile(self, profile):
        self.profile = profile

    def make_storage(self):
        return storage_for_profile(self.profile)[0]


class TestMemoryObjectStore(StorageTests):
    def make_storage(self):
        return MemoryObjectStore(prefix=uuid.uuid4().hex)


class TestFaultyWrapper(StorageTests):
    @pytest.fixture(autouse=True)
    def _folder(self, tmp_path):
        self.folder = tmp_path

    def make_storage(self):
        return FaultyStorage(LocalStorage(self.folder / uuid.uuid4().hex))


class TestFsspecMemory(StorageTests):
    def make_storage(self):
        pytest.importorskip("fsspec")
        return open_storage(f"memory://safeckpt-conf/{uuid.uuid4().hex}")


@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
class TestS3(StorageTests):
    @pytest.fixture(autouse=True)
    def _server(self, request, server):
        self.server = request.getfixturevalue(f"{server}_server")

    def make_storage(self):
        return open_storage(f"s3://{s3_bucket(self.server)}/{uuid.uuid4().hex}", **self.server.options)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["gs", "az"])
class TestGCSAndAzure(StorageTests):
    """gcsfs on fake-gcs-server and adlfs on Azurite: both claim exclusive create, so the
    racing-creates rule runs against the servers."""

    @pytest.fixture(autouse=True)
    def _server(self, request, scheme):
        self.scheme = scheme
        self.server = request.getfixturevalue("gcs_server" if scheme == "gs" else "azurite_server")

    def make_storage(self):
        st = open_storage(f"{self.scheme}://{self.server.bucket()}/{uuid.uuid4().hex}", **self.server.options)
        assert st.exclusive_create
        return st


# --------------------------------------------------------------------------- the registry

PLUGIN = '''
from safeckpt.testing import MemoryObjectStore, ObjectBucket

BUCKET = ObjectBucket()


def open_url(url, **options):
    return MemoryObjectStore(BUCKET, url.split("://", 1)[1])
'''


def test_a_backend_declared_by_an_entry_point_is_found(tmp_path, monkeypatch):
    """A third-party package declares ``[safeckpt.storage] plugmem = mod:open_url``;
    every API then takes ``plugmem://`` URLs, without any import by the user."""
    import sys

    import torch

    import safeckpt
    from safeckpt.storage import registry

    (tmp_path / "safeckpt_plugmem.py").write_text(PLUGIN)
    dist = tmp_path / "safeckpt_plugmem-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: safeckpt-plugmem\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[safeckpt.storage]\nplugmem = safeckpt_plugmem:open_url\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_openers", {})
    safeckpt.save({"w": torch.arange(4.0)}, "plugmem://run/ck")
    assert torch.equal(safeckpt.load_state("plugmem://run/ck")["w"], torch.arange(4.0))
    assert sys.modules["safeckpt_plugmem"].BUCKET.files("run/ck")


def test_register_a_scheme_in_process(monkeypatch):
    import safeckpt
    from safeckpt.storage import register, registry
    from safeckpt.testing import ObjectBucket

    monkeypatch.setattr(registry, "_openers", {})
    bucket = ObjectBucket()
    register("mine", lambda url, **o: MemoryObjectStore(bucket, url.split("://", 1)[1]))
    with pytest.raises(ValueError, match="already registered"):
        register("mine", lambda url, **o: None)
    with pytest.raises(ValueError):
        register("file", lambda url, **o: None)
    mgr = safeckpt.CheckpointManager("mine://root")
    mgr.save(1, {"step": 1})
    assert safeckpt.CheckpointManager("mine://root").steps() == [1]


def test_the_lease_warns_where_creates_are_not_exclusive():
    import safeckpt

    pytest.importorskip("fsspec")
    mgr = safeckpt.CheckpointManager(f"memory://safeckpt-lease/{uuid.uuid4().hex}")
    with pytest.warns(UserWarning, match="cannot create files exclusively"):
        mgr.save(1, {"step": 1})
