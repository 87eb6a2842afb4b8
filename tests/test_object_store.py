"""Object stores through the fsspec backend, against real S3 servers on 127.0.0.1.

Every guarantee of the core (round trip, verify, no silent overwrite, atomic
overwrite, corruption detected, torn manifests never committed, manager retention and
fallback) runs on moto, on SeaweedFS and on ``memory://``; the object-store traps run on
the S3 servers: racing creates of one manifest name, the zero-byte conditional create,
stale listings, multipart uploads, PUTs with an unknown outcome, wrong credentials and
missing buckets, a SIGKILL of the SeaweedFS server between saves and a SIGKILL of a
saving process. Google Cloud Storage (gcsfs on fake-gcs-server) and Azure Blob Storage
(adlfs on Azurite) run the same guarantees behind ``slow``, and one default cell each:
racing saves and racing writer leases on the server, exactly one winning. Servers come
from tests/s3servers.py and tests/storageservers.py (skipped cleanly when missing).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import safeckpt
from safeckpt.storage import open as open_storage

pytest.importorskip("fsspec", reason="the fsspec backend needs fsspec (pip install 'safeckpt[s3]')")

from s3servers import S3Server, moto_server, s3_bucket, seaweedfs_server  # noqa: E402,F401
from storageservers import azurite_server, gcs_server  # noqa: E402,F401
from safeckpt.storage import StorageWrapper  # noqa: E402
from safeckpt.storage.fsspec import FsspecStorage  # noqa: E402
from safeckpt.storage.s3 import S3Storage  # noqa: E402

MiB = 1 << 20


@dataclass
class Store:
    """Where a test's checkpoints go: a fresh bucket (or memory:// root)."""

    kind: str
    root: str
    options: dict
    server: "S3Server | None" = None

    def url(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def fs(self):
        """A separate filesystem instance for poking at raw objects."""
        if self.server is not None:
            return self.server.fs()
        import fsspec

        return fsspec.filesystem("memory")

    def path(self, url: str) -> str:
        return url.split("://", 1)[1] if self.server is not None else "/" + url.split("://", 1)[1].lstrip("/")

    def get(self, url: str) -> bytes:
        return self.fs().cat_file(self.path(url))

    def put(self, url: str, data: bytes) -> None:
        """Overwrite (or create) an object behind safeckpt's back."""
        self.fs().pipe_file(self.path(url), data)

    def remove(self, url: str) -> None:
        self.fs().rm_file(self.path(url))

    def storage(self, *parts: str, **extra) -> FsspecStorage:
        st = open_storage(self.url(*parts), **self.options, **extra)
        assert isinstance(st, FsspecStorage)
        return st


def _s3_store(server: S3Server) -> Store:
    return Store(server.name, f"s3://{s3_bucket(server)}/runs", server.options, server)


#: the emulators of the other clouds: (fixture, URL scheme)
CLOUDS = {"gcs": ("gcs_server", "gs"), "azure": ("azurite_server", "az")}


def _cloud_store(server, scheme: str) -> Store:
    return Store(server.name, f"{scheme}://{server.bucket()}/runs", server.options, server)


@pytest.fixture(params=["moto", "seaweedfs", "memory", pytest.param("gcs", marks=pytest.mark.slow),
                        pytest.param("azure", marks=pytest.mark.slow)])
def store(request) -> Store:
    if request.param == "memory":
        root = f"memory://safeckpt-test-{uuid.uuid4().hex[:12]}"
        yield Store("memory", root, {})
        import fsspec

        fsspec.filesystem("memory").rm("/" + root.split("://", 1)[1], recursive=True)
        return
    if request.param in CLOUDS:
        fixture, scheme = CLOUDS[request.param]
        yield _cloud_store(request.getfixturevalue(fixture), scheme)
        return
    yield _s3_store(request.getfixturevalue(f"{request.param}_server"))


@pytest.fixture(params=["moto", "seaweedfs"])
def s3store(request) -> Store:
    return _s3_store(request.getfixturevalue(f"{request.param}_server"))


def make_state(step: int, n: int = 50_000) -> dict:
    """A state whose every value is a function of ``step``."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.arange(1000) + step},
            "opt": {"lr": 0.1 * step, "betas": [0.9, 0.99]}, "step": step}


def template(n: int = 50_000) -> dict:
    return {"model": {"w": torch.zeros(n), "b": torch.zeros(1000, dtype=torch.int64)},
            "opt": {"lr": -1.0, "betas": [0.0, 0.0]}, "step": -1}


def assert_state(got: dict, step: int, n: int = 50_000) -> None:
    want = make_state(step, n)
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["model"]["b"], want["model"]["b"])
    assert got["opt"] == want["opt"] and got["step"] == step


def data_objects(store: Store, url: str) -> list[str]:
    listing = open_storage(url, **store.options).listdir()
    return sorted(n for n in listing if n.startswith("data-"))


def flip_byte(store: Store, url: str, offset_from_end: int = 100) -> None:
    data = bytearray(store.get(url))
    data[-offset_from_end] ^= 0x01
    store.put(url, bytes(data))


# -- the core guarantees, on every store ------------------------------------------------
def test_round_trip_and_verify(store):
    url = store.url("ck")
    info = safeckpt.save(make_state(1), url, storage_options=store.options)
    assert info.path == url or info.path.rstrip("/") == url.replace("memory://", "memory:///")
    state = template()
    safeckpt.load(state, url, storage_options=store.options)
    assert_state(state, 1)
    assert_state(safeckpt.load_state(url, storage_options=store.options), 1)
    report = safeckpt.verify(url, storage_options=store.options)
    assert report.ok, report.problems
    assert report.bytes_checked > 50_000 * 4


def test_exists_without_overwrite_and_atomic_overwrite(store):
    url = store.url("ck")
    safeckpt.save(make_state(1), url, storage_options=store.options)
    first_data = data_objects(store, url)
    with pytest.raises(safeckpt.CheckpointExistsError) as exc:
        safeckpt.save(make_state(2), url, storage_options=store.options)
    assert isinstance(exc.value, FileExistsError) and "overwrite=True" in str(exc.value)
    assert_state(safeckpt.load_state(url, storage_options=store.options), 1)
    safeckpt.save(make_state(2), url, overwrite=True, storage_options=store.options)
    assert_state(safeckpt.load_state(url, storage_options=store.options), 2)
    listing = open_storage(url, **store.options).listdir()
    assert "manifest-000001.json" not in listing and "manifest-000002.json" in listing
    assert not set(first_data) & set(listing), "the replaced version's data was not removed"


def test_flipped_byte_in_data_object_is_detected(store):
    url = store.url("ck")
    safeckpt.save(make_state(1), url, storage_options=store.options)
    [data] = data_objects(store, url)
    flip_byte(store, f"{url}/{data}")
    with pytest.raises(safeckpt.CorruptCheckpointError, match="checksum"):
        safeckpt.load(template(), url, storage_options=store.options)
    report = safeckpt.verify(url, storage_options=store.options)
    assert not report.ok and data in " ".join(report.problems)


def test_missing_data_object_is_detected(store):
    url = store.url("ck")
    safeckpt.save(make_state(1), url, storage_options=store.options)
    [data] = data_objects(store, url)
    store.remove(f"{url}/{data}")
    with pytest.raises(safeckpt.CorruptCheckpointError, match="missing"):
        safeckpt.load(template(), url, storage_options=store.options)
    assert not safeckpt.verify(url, storage_options=store.options).ok


def test_torn_manifest_object_is_not_committed(store):
    # a truncated newer manifest next to a committed one: the committed one wins
    url = store.url("a")
    safeckpt.save(make_state(1), url, storage_options=store.options)
    manifest = store.get(f"{url}/manifest-000001.json")
    store.put(f"{url}/manifest-000002.json", manifest[: len(manifest) // 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_state(safeckpt.load_state(url, storage_options=store.options), 1)
    # the only manifest torn: not a committed checkpoint
    url_b = store.url("b")
    safeckpt.save(make_state(2), url_b, storage_options=store.options)
    manifest = store.get(f"{url_b}/manifest-000001.json")
    store.put(f"{url_b}/manifest-000001.json", manifest[:-7])
    with pytest.raises(safeckpt.CorruptCheckpointError):
        safeckpt.load(template(), url_b, storage_options=store.options)
    assert not safeckpt.verify(url_b, storage_options=store.options).ok


def test_manager_retention_restore_and_fallback(store):
    root = store.url("run")
    with safeckpt.CheckpointManager(root, keep_last=2, storage_options=store.options) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, make_state(step))
        assert mgr.steps() == [200, 300]
        assert open_storage(f"{root}/step-000000100", **store.options).listdir() == {}
        state = template()
        assert mgr.restore(state) == 300
        assert_state(state, 300)
        [data] = data_objects(store, mgr.path(300))
        flip_byte(store, f"{mgr.path(300)}/{data}")
        state = template()
        with pytest.warns(UserWarning, match="step 300"):
            assert mgr.restore(state) == 200
        assert_state(state, 200)


def test_manager_on_a_storage_object_keeps_its_options(store):
    """The same run through a ``Storage`` object built once (the options live in it)."""
    root = open_storage(store.url("run"), **store.options)
    mgr = safeckpt.CheckpointManager(root, keep_last=1)
    mgr.save(1, make_state(1))
    mgr.save(2, make_state(2))
    assert mgr.steps() == [2]
    state = template()
    assert mgr.restore(state) == 2
    assert_state(state, 2)


@pytest.mark.slow
def test_dcp_writer_and_reader(store):
    from test_real_filesystems import dcp_round_trip

    dcp_round_trip(store.url("dcp"), store.options)


# -- object-store traps, on the real servers ---------------------------------------------
def _race(store: Store, name: str, writers: int) -> tuple[list[int], list[BaseException], "FsspecStorage"]:
    storage = store.storage("race")
    barrier = threading.Barrier(writers)
    wins: list[int] = []
    losses: list[BaseException] = []

    def write(i: int) -> None:
        body = json.dumps({"writer": i, "pad": "x" * 200}).encode()
        barrier.wait()
        try:
            storage.write_file(name, [body])
            wins.append(i)
        except BaseException as exc:  # noqa: BLE001
            losses.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return wins, losses, storage


def test_racing_creates_of_one_manifest_name_exactly_one_wins(s3store):
    # (SeaweedFS serializes conditional creates of one key: each extra loser waits ~1 s)
    writers = 8 if s3store.kind == "moto" else 4
    for round_ in range(2):
        name = f"manifest-{round_ + 1:06d}.json"
        wins, losses, storage = _race(s3store, name, writers=writers)
        assert len(wins) == 1, (wins, losses)
        assert len(losses) == writers - 1 and all(isinstance(e, FileExistsError) for e in losses), losses
        assert json.loads(storage.read(name))["writer"] == wins[0]


def test_racing_saves_to_one_path_exactly_one_commits(s3store):
    url = s3store.url("ck")
    results: dict[int, object] = {}
    barrier = threading.Barrier(2)

    def run(step: int) -> None:
        barrier.wait()
        try:
            results[step] = safeckpt.save(make_state(step), url, storage_options=s3store.options)
        except BaseException as exc:  # noqa: BLE001
            results[step] = exc

    threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [s for s, r in results.items() if isinstance(r, safeckpt.CheckpointInfo)]
    losers = [r for r in results.values() if not isinstance(r, safeckpt.CheckpointInfo)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], safeckpt.CheckpointExistsError), losers
    assert_state(safeckpt.load_state(url, storage_options=s3store.options), winners[0])
    assert len(data_objects(s3store, url)) == 1, "the losing save left its data behind"


class MeetAt(StorageWrapper):
    """The real storage, but a create of a file named ``prefix...`` first waits until
    ``parties`` writers are about to create it: every one of them has looked at the
    folder before any creates, the race that exclusive create must decide."""

    def __init__(self, inner, prefix: str, parties: int) -> None:
        super().__init__(inner)
        self.prefix = prefix
        self.barrier = threading.Barrier(parties)

    def write_file(self, name, parts):
        if name.startswith(self.prefix):
            self.barrier.wait(60)
        return self.inner.write_file(name, parts)


def _in_threads(fn, args: list) -> list:
    """``fn(arg)`` for each arg on its own thread, at once; each result or error."""
    results: list = [None] * len(args)

    def run(i: int) -> None:
        try:
            results[i] = fn(args[i])
        except BaseException as exc:  # noqa: BLE001 - judged by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_gcs_racing_saves_without_overwrite_exactly_one_commits(gcs_server):
    """Both saves looked at the folder and found it empty; gcsfs's "xb" is a resumable
    upload whose precondition fake-gcs-server does not enforce, so both used to commit
    manifest-000001.json and one checkpoint was silently replaced by the other."""
    store = _cloud_store(gcs_server, "gs")
    racing = MeetAt(store.storage("ck"), "manifest-", parties=2)
    results = _in_threads(lambda step: safeckpt.save(make_state(step), racing), [1, 2])
    winners = [step for step, r in zip([1, 2], results) if isinstance(r, safeckpt.CheckpointInfo)]
    losers = [r for r in results if not isinstance(r, safeckpt.CheckpointInfo)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], safeckpt.CheckpointExistsError), losers
    assert "another writer committed" in str(losers[0])
    assert_state(safeckpt.load_state(store.url("ck"), storage_options=store.options), winners[0])
    # through the store's own API: one manifest, the winner's data only
    objects = sorted(p.rsplit("/", 1)[1] for p in gcs_server.fs(fresh=True).find(store.path(store.url("ck"))))
    assert objects == ["data-" + results[winners[0] - 1].save_id + "-r00000.safetensors", "manifest-000001.json"]


def test_azure_writer_lease_is_exclusive_and_claimed(azurite_server):
    """adlfs creates with If-None-Match: * and Azurite enforces it: the manager's lease
    is exclusive there, so no WeakStorageWarning (it used to warn for every fsspec store);
    two managers taking one root at the same moment: exactly one gets it."""
    from safeckpt.run.lease import WriterLease

    store = _cloud_store(azurite_server, "az")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr = safeckpt.CheckpointManager(store.url("run"), keep_last=1, storage_options=store.options)
        for step in (1, 2):
            mgr.save(step, make_state(step))
    assert mgr.steps() == [2]
    assert_state(safeckpt.load_state(mgr.path(2), storage_options=store.options), 2)
    racing = MeetAt(store.storage("race"), "safeckpt-writer-", parties=2)
    results = _in_threads(lambda lease: lease.acquire(), [WriterLease(racing, f"run{i}") for i in range(2)])
    errors = [r for r in results if r is not None]
    assert len(errors) == 1 and isinstance(errors[0], safeckpt.CheckpointExistsError), results
    assert "at the same moment" in str(errors[0])
    objects = sorted(p.rsplit("/", 1)[1] for p in azurite_server.fs(fresh=True).find(store.path(store.url("race"))))
    assert objects == ["safeckpt-writer-000000001.json"]


def test_zero_byte_create_is_exclusive(s3store):
    """s3fs's "xb" mode sends no If-None-Match for an empty file and overwrites; ours refuses."""
    storage = s3store.storage("zero")
    assert storage.write_file("empty", []) == 0
    with pytest.raises(FileExistsError):
        storage.write_file("empty", [b""])
    with pytest.raises(FileExistsError):
        storage.write_file("empty", [b"not empty"])
    assert storage.read("empty") == b"" and storage.listdir() == {"empty": 0}
    storage.write_file("full", [b"abc"])
    with pytest.raises(FileExistsError):
        storage.write_file("full", [])
    assert storage.read("full") == b"abc"


def test_listing_is_never_stale_across_filesystem_instances(s3store):
    a = s3store.storage("shared", skip_instance_cache=True)
    b = s3store.storage("shared", skip_instance_cache=True)
    assert a.fs is not b.fs
    a.write_file("one", [b"1"])
    assert set(b.listdir()) == {"one"}
    b.fs.ls(b.path, detail=True)  # fill b's s3fs listing cache
    a.write_file("two", [b"22"])
    assert b.listdir() == {"one": 1, "two": 2}
    # the same through the public API: a save by one instance, seen by a manager on the other
    root_a = s3store.storage("run", skip_instance_cache=True)
    root_b = s3store.storage("run", skip_instance_cache=True)
    mgr_b = safeckpt.CheckpointManager(root_b)
    assert mgr_b.steps() == []
    safeckpt.CheckpointManager(root_a).save(5, make_state(5))
    assert mgr_b.steps() == [5] and mgr_b.latest_step() == 5


def test_multipart_upload_streams_parts_and_is_exclusive(s3store, monkeypatch):
    storage = s3store.storage("big", part_size=5 * MiB, parallel_parts=3)
    payload = torch.arange(3 * MiB + 12345, dtype=torch.int32)  # ~12 MiB: 3 parts of 5 MiB
    raw = payload.numpy().tobytes()
    pieces = [b"header!!", memoryview(payload.numpy()).cast("B"), bytearray(b"t" * 1000)]
    expected = b"header!!" + raw + b"t" * 1000
    assert storage.write_file("blob", pieces) == len(expected)
    assert storage.listdir() == {"blob": len(expected)}
    got = bytearray(len(expected))
    storage.read_into("blob", 0, memoryview(got))
    assert got == expected
    assert storage.read("blob", 5 * MiB - 10, 20) == expected[5 * MiB - 10: 5 * MiB + 10]
    # a large read is split into byte ranges fetched concurrently, in batches
    import safeckpt.storage.fsspec as backend

    monkeypatch.setattr(backend, "READ_PIECE", 1 * MiB)
    got = bytearray(len(expected) - 3)
    storage.read_into("blob", 3, memoryview(got))
    assert got == expected[3:]
    monkeypatch.undo()
    with pytest.raises(FileExistsError):
        storage.write_file("blob", [b"x" * (11 * MiB)])
    assert storage.read("blob", 0, 8) == b"header!!"
    uploads = storage._call("list_multipart_uploads", Bucket=storage.bucket, Prefix=storage.prefix)
    assert not uploads.get("Uploads"), "a failed multipart upload was not aborted"
    with pytest.raises(EOFError):
        storage.read_into("blob", len(expected) - 4, memoryview(bytearray(8)))
    # a whole checkpoint whose data file is a multipart upload
    state = {"w": torch.randn(3 * MiB), "step": 1}
    safeckpt.save(state, storage.child("ck"))
    loaded = safeckpt.load_state(storage.child("ck"))
    assert torch.equal(loaded["w"], state["w"])


def _fake_error(status: int, code: str) -> OSError:
    from botocore.exceptions import ClientError

    cause = ClientError({"Error": {"Code": code, "Message": f"injected {status}"},
                         "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    err = OSError(5, f"injected {status}")
    err.__cause__ = cause
    return err


def _inject(storage: FsspecStorage, monkeypatch, *, status: int, code: str, perform: bool) -> None:
    """The next PUT fails with ``status``; ``perform`` says whether it happened anyway."""
    real = storage._call
    armed = [True]

    def call(method, **kwargs):
        if method == "put_object" and armed[0]:
            armed[0] = False
            if perform:
                real(method, **kwargs)
            raise _fake_error(status, code)
        return real(method, **kwargs)

    monkeypatch.setattr(storage, "_call", call)


def test_put_with_unknown_outcome_is_verified_by_reading_back(s3store, monkeypatch):
    storage = s3store.storage("ambiguous")
    # a 503 whose PUT in fact happened: success
    _inject(storage, monkeypatch, status=503, code="ServiceUnavailable", perform=True)
    storage.write_file("manifest-000001.json", [b'{"ours": 1}'])
    assert storage.read("manifest-000001.json") == b'{"ours": 1}'
    # a retry of our own successful PUT answered 412: still success
    _inject(storage, monkeypatch, status=412, code="PreconditionFailed", perform=True)
    storage.write_file("manifest-000002.json", [b'{"ours": 2}'])
    assert storage.read("manifest-000002.json") == b'{"ours": 2}'
    # a 500 whose PUT did not happen: a clear error, nothing committed
    _inject(storage, monkeypatch, status=500, code="InternalError", perform=False)
    with pytest.raises(safeckpt.StorageError, match="HTTP 500"):
        storage.write_file("manifest-000003.json", [b'{"ours": 3}'])
    assert "manifest-000003.json" not in storage.listdir()
    # another writer's object under the name: 412 is a lost race
    storage.write_file("manifest-000004.json", [b'{"theirs": 4}'])
    monkeypatch.undo()
    with pytest.raises(FileExistsError):
        storage.write_file("manifest-000004.json", [b'{"ours": 4}'])
    assert storage.read("manifest-000004.json") == b'{"theirs": 4}'


def test_missing_bucket_is_a_clear_error(s3store):
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ck"
    with pytest.raises(safeckpt.StorageError, match="bucket .* does not exist"):
        safeckpt.save(make_state(1), url, storage_options=s3store.options)
    with pytest.raises(safeckpt.StorageError, match="does not exist"):
        safeckpt.load(template(), url, storage_options=s3store.options)


def test_wrong_credentials_are_a_clear_error(seaweedfs_server):
    store = _s3_store(seaweedfs_server)
    bad = dict(store.options, secret="wrong-secret", skip_instance_cache=True)
    with pytest.raises(safeckpt.StorageError, match="credentials"):
        safeckpt.save(make_state(1), store.url("ck"), storage_options=bad)
    safeckpt.save(make_state(1), store.url("ck"), storage_options=store.options)
    with pytest.raises(safeckpt.StorageError, match="credentials"):
        safeckpt.load(template(), store.url("ck"), storage_options=bad)


def test_memory_url_routes_to_fsspec():
    st = open_storage("memory://safeckpt-routing/x")
    assert isinstance(st, FsspecStorage) and st.url.startswith("memory://")
    # memory's "xb" is check-then-create, and its files are visible from their creation
    assert not st.atomic_write and not st.exclusive_create
    from safeckpt.storage.s3 import S3Storage
    assert FsspecStorage.atomic_write and S3Storage.exclusive_create and not FsspecStorage.exclusive_create


def test_a_write_that_fails_midway_leaves_nothing(store):
    storage = store.storage("failing", part_size=5 * MiB)

    def parts():
        yield b"x" * (3 * MiB)
        yield b"y" * (4 * MiB)  # on S3 the first part (5 MiB) is uploaded by now
        yield b"z" * (4 * MiB)
        raise RuntimeError("the state could not be read")

    with pytest.raises(RuntimeError):
        storage.write_file("data", parts())
    assert "data" not in storage.listdir()
    if store.kind == "azurite":
        # its staged blocks keep the name taken (Azure drops uncommitted blocks after a
        # week); harmless: a data file's name is never used twice (its save id)
        return
    storage.write_file("data", [b"ok"])  # the name is still free
    assert storage.read("data") == b"ok"
    if isinstance(storage, S3Storage):
        uploads = storage._call("list_multipart_uploads", Bucket=storage.bucket, Prefix=storage.prefix)
        assert not uploads.get("Uploads"), "the failed multipart upload was not aborted"


def test_a_replacement_is_one_conditional_upload_of_the_final_object(s3store, monkeypatch):
    """``open_replace`` on S3 (Lightning's ``last.ckpt``): the object appears whole when
    its upload completes (a multipart upload here), and the upload is conditional on the
    version it started from, so another writer's object is never silently overwritten."""
    storage = s3store.storage("replace", part_size=5 * MiB, parallel_parts=2)
    storage.replace_file("last.ckpt", [b"old"])
    big = bytes(range(256)) * (11 * MiB // 256)  # three parts
    with storage.open_replace("last.ckpt") as out:
        out.write(memoryview(big)[:7 * MiB])
        out.write(memoryview(big)[7 * MiB:])
        assert storage.read("last.ckpt") == b"old", "the new object showed before its upload completed"
    assert storage.read("last.ckpt") == big and storage.listdir() == {"last.ckpt": len(big)}
    # one PUT, then a multipart upload (moto 5 ignores If-Match on CompleteMultipartUpload,
    # which AWS and SeaweedFS honour)
    for size in (10, 11 * MiB) if s3store.kind != "moto" else (10,):
        out = storage.open_replace("last.ckpt")
        out.write(b"o" * size)
        theirs = f"theirs, against {size}".encode()
        s3store.put(storage.url + "/last.ckpt", theirs)  # another writer, meanwhile
        with pytest.raises(safeckpt.StorageError, match="another writer changed it"):
            out.commit()
        assert storage.read("last.ckpt") == theirs
    uploads = storage._call("list_multipart_uploads", Bucket=storage.bucket, Prefix=storage.prefix)
    assert not uploads.get("Uploads"), "a refused multipart replacement was not aborted"

    # a store that does not implement the condition (501): the upload goes through without it
    real = storage._call
    refused = []

    def call(method, **kwargs):
        if "IfMatch" in kwargs:
            refused.append(method)
            raise _fake_error(501, "NotImplemented")
        return real(method, **kwargs)
    monkeypatch.setattr(storage, "_call", call)
    storage.replace_file("last.ckpt", [b"new"])
    assert refused == ["put_object"] and storage.read("last.ckpt") == b"new"


# -- crashes ------------------------------------------------------------------------------
def test_seaweedfs_kill9_between_saves(seaweedfs_server):
    store = _s3_store(seaweedfs_server)
    root = store.storage("run")
    mgr = safeckpt.CheckpointManager(root, keep_last=2)
    mgr.save(1, make_state(1))
    seaweedfs_server.kill9()
    seaweedfs_server.start()
    assert mgr.steps() == [1]
    state = template()
    assert mgr.restore(state) == 1
    assert_state(state, 1)
    mgr.save(2, make_state(2))
    fresh = safeckpt.CheckpointManager(store.storage("run", skip_instance_cache=True))
    assert fresh.steps() == [1, 2]
    state = template()
    assert fresh.restore(state) == 2
    assert_state(state, 2)
    assert safeckpt.verify(root.child("step-000000001")).ok


CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
import safeckpt
from safeckpt.storage import open as open_storage

def state(step):
    return {"w": torch.arange(3 << 20, dtype=torch.float32) + step,
            "v": torch.full((1000,), step, dtype=torch.int64), "step": step}

root = open_storage(sys.argv[1], part_size=5 << 20, parallel_parts=2, **json.loads(sys.argv[2]))
mgr = safeckpt.CheckpointManager(root, keep_last=2)
step = 0
while step < 200:
    step += 1
    print(f"begin {step}", flush=True)
    mgr.save(step, state(step))
    print(f"done {step}", flush=True)
"""


def _child_state(step: int) -> dict:
    return {"w": torch.arange(3 << 20, dtype=torch.float32) + step,
            "v": torch.full((1000,), step, dtype=torch.int64), "step": step}


@pytest.mark.parametrize("server", ["moto", pytest.param("gcs", marks=pytest.mark.slow),
                                    pytest.param("azure", marks=pytest.mark.slow)])
def test_sigkill_of_a_saving_process_keeps_the_last_commit(request, server):
    if server in CLOUDS:
        fixture, scheme = CLOUDS[server]
        store = _cloud_store(request.getfixturevalue(fixture), scheme)
    else:
        store = _s3_store(request.getfixturevalue("moto_server"))
    src = str(Path(safeckpt.__file__).resolve().parent.parent)
    rng = random.Random(1234)
    for round_ in range(2):
        url = store.url(f"run{round_}")
        proc = subprocess.Popen([sys.executable, "-c", CHILD, url, json.dumps(store.options), src],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        started = time.monotonic()
        try:
            while not any(line == "done 2" for line in lines):
                line = proc.stdout.readline().strip()
                if not line:
                    pytest.fail(f"child exited early: {proc.wait()} {proc.stderr.read()[-3000:]}")
                lines.append(line)
                assert time.monotonic() - started < 60
            t_save = (time.monotonic() - started) / 4  # rough: imports + 2 saves
            time.sleep(rng.uniform(0.0, min(t_save, 0.8)))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        lines += proc.stdout.read().splitlines()  # (communicate() would skip buffered lines)
        proc.stdout.close()
        proc.stderr.close()
        done = [int(line.split()[1]) for line in lines if line.startswith("done")]
        begun = [int(line.split()[1]) for line in lines if line.startswith("begin")]
        root = store.storage(f"run{round_}", skip_instance_cache=True)
        mgr = safeckpt.CheckpointManager(root, keep_last=2)
        latest = mgr.latest_step()
        assert latest is not None and max(done) <= latest <= max(begun), (latest, done, begun)
        restored = {"w": torch.zeros(3 << 20), "v": torch.zeros(1000, dtype=torch.int64), "step": -1}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert mgr.restore(restored) == latest
        # the save the kill interrupted is skipped by name, never loaded
        assert all("not committed" in str(w.message) for w in seen), [str(w.message) for w in seen]
        want = _child_state(latest)
        assert torch.equal(restored["w"], want["w"]) and torch.equal(restored["v"], want["v"])
        assert restored["step"] == latest
        # a killed multipart upload is garbage until aborted; the run goes on saving
        if isinstance(root, S3Storage):
            root.abort_stale_uploads(older_than=0)
            assert not root._call("list_multipart_uploads", Bucket=root.bucket,
                                  Prefix=root.prefix + "/").get("Uploads")
        mgr.save(latest + 1, _child_state(latest + 1))
        assert mgr.latest_step() == latest + 1
