"""Tiered storage: commit on a local disk, copy to the durable root in the background.

``CheckpointManager(root, local=PATH, keep_local=k)`` commits every save on the local
tier, then rank 0 copies it to ``root`` (data files first, the manifest last, byte for
byte); only the newest waiting checkpoint is copied. The local tier keeps the newest
``k`` (and whatever is being copied), ``root`` follows the retention rules, and
``restore`` takes the newest valid checkpoint of either tier, the local copy first.

Everything runs on real files under ``tmp_path``, real S3 servers on 127.0.0.1 (moto,
SeaweedFS; tests/s3servers.py) and real processes: a child SIGKILLed in the middle of
a durable copy (tests/helpers/tiered_child.py), a process that exits without
``close()``, and 2 gloo ranks (tests/helpers/tiered_dist_worker.py). Failures are
injected with ``safeckpt.testing.FaultyStorage`` and ``tiered_child.HookedStorage``
(a wrapper that can stop a durable write at a chosen byte); nothing is mocked.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

import safeckpt
from safeckpt.run import garbage
from safeckpt.format.folder import read_committed
from safeckpt.format.names import STEP_RE, step_folder
from safeckpt.format.manifest import is_shared
from safeckpt.storage import LocalStorage
from safeckpt.storage import open as open_storage
from safeckpt.testing import FaultyStorage

import save_child  # noqa: E402  (tests/helpers is on sys.path via conftest.py)
from s3servers import moto_server, seaweedfs_server  # noqa: E402,F401  (fixtures)
from test_object_store import _s3_store, s3store  # noqa: E402,F401  (s3store: a fixture)
from tiered_child import HookedStorage, TieredForkServer, half_then, read_events  # noqa: E402

pytestmark = pytest.mark.timeout(180)

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)
N = 20_000                 # float32 values of the main tensor: 80 KB
CHUNK = 4096               # incremental chunks: small, so a changed row is one chunk
HEADER_SLACK = 16 << 10    # a data file's safetensors header and alignment, generously


# --------------------------------------------------------------------------- states


def make_state(step: int) -> dict:
    """A state whose every value is a function of ``step``."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(N, generator=g), "b": torch.arange(500) + step},
            "opt": {"lr": 0.1 * step, "betas": [0.9, 0.99]}, "step": step}


def template() -> dict:
    return {"model": {"w": torch.full((N,), -1.0), "b": torch.full((500,), -1, dtype=torch.int64)},
            "opt": {"lr": -1.0, "betas": [0.0, 0.0]}, "step": -1}


def exact(got, want) -> bool:
    return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
            and torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)))


def mismatch(got: dict, want: dict, key: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` (tensors: dtype, shape and every byte)."""
    if isinstance(want, torch.Tensor):
        return [] if exact(got, want) else [f"{key}: not exactly the expected tensor"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{key}: keys {sorted(got) if isinstance(got, dict) else got!r} != {sorted(want)}"]
        return [p for k in want for p in mismatch(got[k], want[k], f"{key}.{k}" if key else k)]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{key}: {got!r:.80} is not a sequence of {len(want)}"]
        return [p for i, (g, w) in enumerate(zip(got, want)) for p in mismatch(g, w, f"{key}.{i}")]
    return [] if got == want else [f"{key}: {got!r} != {want!r}"]


def assert_state(got: dict, step: int, make=make_state) -> None:
    problems = mismatch(got, make(step))
    assert not problems, f"not exactly step {step}: {problems}"


# incremental: an embedding table of which one row changes per step, and a frozen tensor
EMB = (256, 64)            # float32: 64 KiB; a row is 256 bytes, a chunk 16 rows
FROZEN = (128, 128)        # float32: 64 KiB, never changes


def incr_state(step: int) -> dict:
    emb = torch.arange(EMB[0] * EMB[1], dtype=torch.float32).reshape(EMB) / 7
    for s in range(2, step + 1):
        emb[(s * 37) % EMB[0]] += 1000 * s  # one chunk changes per step
    frozen = torch.randn(FROZEN, generator=torch.Generator().manual_seed(11))
    return {"emb": emb, "frozen": frozen, "step": step}


def incr_template() -> dict:
    return {"emb": torch.full(EMB, -1.0), "frozen": torch.full(FROZEN, -1.0), "step": -1}


FULL_INCR = 4 * (EMB[0] * EMB[1] + FROZEN[0] * FROZEN[1])


# --------------------------------------------------------------------------- tiers


def tier_status(url, options: dict | None = None) -> dict[int, str]:
    """Every step folder of a tier: "ok" (committed), "incomplete" (no manifest) or
    "damaged" (a manifest that is not valid)."""
    root = open_storage(str(url), **(options or {}))
    out = {}
    for name, size in root.listdir().items():
        m = STEP_RE.fullmatch(name)
        if size is not None or m is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                read_committed(root.child(name))
                out[int(m.group(1))] = "ok"
            except safeckpt.CheckpointNotFoundError:
                out[int(m.group(1))] = "incomplete"
            except safeckpt.CorruptCheckpointError:
                out[int(m.group(1))] = "damaged"
    return out


def committed(url, options: dict | None = None) -> list[int]:
    return sorted(s for s, st in tier_status(url, options).items() if st == "ok")


def assert_committed_exact(url, options: dict | None = None, make=make_state) -> list[int]:
    """Every committed checkpoint of a tier verifies and loads exactly; returns their steps."""
    steps = committed(url, options)
    for step in steps:
        path = f"{url}/{step_folder(step)}"
        report = safeckpt.verify(path, storage_options=options)
        assert report.ok, f"committed {path} does not verify: {report.problems}"
        assert_state(safeckpt.load_state(path, storage_options=options), step, make)
    return steps


def data_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.name.startswith("data-")}


def flip_byte(path: Path, from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-from_end] ^= 0x01
    path.write_bytes(bytes(data))


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


@contextlib.contextmanager
def recorded():
    """Every warning, from any thread, while the block runs (Python < 3.14 warnings
    state is process-wide, so the replicator thread's warnings land here too)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen


def messages(seen) -> list[str]:
    return [str(w.message) for w in seen]


@pytest.fixture
def tiers(tmp_path):
    return tmp_path / "local", tmp_path / "durable"


# --------------------------------------------------------------------------- basics


def test_local_equal_to_root_raises(tmp_path, monkeypatch):
    root = tmp_path / "run"
    for local in (str(root), str(root) + "/", str(root) + "/.", LocalStorage(str(root))):
        with pytest.raises(ValueError, match="local"):
            safeckpt.CheckpointManager(str(root), local=local)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="local"):
        safeckpt.CheckpointManager(str(root), local="run")
    assert not root.exists()  # refused before anything was written
    # a different folder is fine, and nothing is written before the first save
    mgr = safeckpt.CheckpointManager(str(root), local=str(tmp_path / "fast"))
    assert mgr.tiers == [mgr.local, mgr.storage] and mgr.save_root is mgr.local
    mgr.close()


def test_five_saves_replicate_and_retain(tiers):
    local, durable = tiers
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3, keep_local=2)
    assert mgr.local.url == str(local) and mgr.storage.url == str(durable)
    assert mgr.save_root is mgr.local and mgr.tiers == [mgr.local, mgr.storage]
    for step in range(1, 6):
        info = mgr.save(step, make_state(step))
        assert info.path == str(local / step_folder(step))  # committed on the local tier
        mgr.wait()
        assert tier_status(durable).get(step) == "ok", f"step {step} not committed in the durable root"
    assert tier_status(durable) == {3: "ok", 4: "ok", 5: "ok"}     # keep_last=3
    assert tier_status(local) == {4: "ok", 5: "ok"}                 # keep_local=2
    assert sorted(os.listdir(local)) == [step_folder(4), step_folder(5)]
    assert mgr.steps() == [3, 4, 5] and mgr.latest_step() == 5
    assert mgr.path(5) == str(local / step_folder(5))
    assert mgr.path(3) == str(durable / step_folder(3))
    assert assert_committed_exact(durable) == [3, 4, 5]
    assert assert_committed_exact(local) == [4, 5]
    for step in (4, 5):  # the durable copy is the local checkpoint, byte for byte
        a, b = local / step_folder(step), durable / step_folder(step)
        assert sorted(os.listdir(a)) == sorted(os.listdir(b))
        for name in os.listdir(a):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # the writer lease is on the durable root, none on the local disk
    assert any(n.startswith("safeckpt-writer-") for n in os.listdir(durable))
    assert not any(n.startswith("safeckpt-writer-") for n in os.listdir(local))
    mgr.close()


def test_saves_without_waiting(tiers):
    local, durable = tiers
    with safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3, keep_local=2) as mgr:
        for step in range(1, 8):
            mgr.save(step, make_state(step))
        mgr.wait()
        steps = assert_committed_exact(durable)
        assert steps[-1] == 7 and len(steps) <= 3 and set(steps) <= set(range(1, 8))
        local_steps = assert_committed_exact(local)
        assert {6, 7} <= set(local_steps)
        assert mgr.steps() == sorted(set(steps) | set(local_steps))


def test_newest_waiting_copy_supersedes_queued_ones(tiers):
    """While step 1 is being copied, steps 2, 3, 4 commit locally: only 4 is copied next;
    local retention spares the step being copied and the one queued."""
    local, durable = tiers
    entered, release = threading.Event(), threading.Event()
    written: list[str] = []

    def on_write(rel, parts):
        written.append(rel)
        if rel.startswith(step_folder(1) + "/data-"):
            entered.set()
            assert release.wait(30)
        return parts

    root = HookedStorage(LocalStorage(str(durable)), on_write)
    mgr = safeckpt.CheckpointManager(root, local=str(local), keep_last=10, keep_local=2)
    try:
        mgr.save(1, make_state(1))
        assert entered.wait(10), "the copy of step 1 never started"
        for step in (2, 3, 4):
            mgr.save(step, make_state(step))
        # step 2 went (neither among the newest 2 nor being copied); 1 is being copied
        assert tier_status(local) == {1: "ok", 3: "ok", 4: "ok"}
        assert committed(durable) == []
    finally:
        release.set()
    mgr.wait()
    assert assert_committed_exact(durable) == [1, 4]
    assert not any(rel.startswith((step_folder(2), step_folder(3))) for rel in written), written
    assert not (durable / step_folder(2)).exists() and not (durable / step_folder(3)).exists()
    mgr.save(5, make_state(5))
    mgr.wait()
    assert tier_status(local) == {4: "ok", 5: "ok"}  # step 1 is no longer protected
    assert assert_committed_exact(durable) == [1, 4, 5]
    mgr.close()


def test_async_saves_are_replicated(tiers):
    local, durable = tiers
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=2, async_save=True)
    state = make_state(1)
    future = mgr.save(1, state)
    assert isinstance(future, safeckpt.SaveFuture)
    state["model"]["w"].fill_(12345.0)  # after the snapshot: must not reach either tier
    info = mgr.wait()
    assert info is not None and info.step == 1 and info.path == str(local / step_folder(1))
    assert assert_committed_exact(durable) == [1]
    for step in (2, 3):
        assert isinstance(mgr.save(step, make_state(step)), safeckpt.SaveFuture)
    mgr.close()  # commits the save in flight and finishes its durable copy
    steps = assert_committed_exact(durable)
    assert steps[-1] == 3 and len(steps) <= 2
    assert assert_committed_exact(local)[-1] == 3


# --------------------------------------------------------------------------- restore


def _three_saves(local, durable, **kw) -> None:
    with safeckpt.CheckpointManager(str(durable), local=str(local), **{"keep_last": 3, **kw}) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state(step))
            mgr.wait()
    assert committed(durable) == [1, 2, 3]


def test_local_tier_wiped_restores_from_durable(tiers):
    local, durable = tiers
    _three_saves(local, durable, keep_local=2)
    shutil.rmtree(local)  # a new node
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3, keep_local=2)
    state = template()
    with recorded() as seen:
        assert mgr.restore(state) == 3
    assert_state(state, 3)
    assert not [m for m in messages(seen) if "skipped" in m], messages(seen)
    assert mgr.path(3) == str(durable / step_folder(3)) and mgr.steps() == [1, 2, 3]
    for step in (4, 5):
        mgr.save(step, make_state(step))
    mgr.wait()
    assert assert_committed_exact(durable) == [3, 4, 5]
    assert assert_committed_exact(local) == [4, 5]
    mgr.close()


@pytest.mark.parametrize("damage", ["flip", "no_manifest"])
def test_durable_newest_damaged(tiers, damage):
    local, durable = tiers
    _three_saves(local, durable, keep_local=2)
    newest = durable / step_folder(3)
    if damage == "flip":
        flip_byte(newest / sorted(data_files(newest))[0])
    else:
        (newest / "manifest-000001.json").unlink()
    # the local copy of step 3 is intact: it wins
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3, keep_local=2)
    state = template()
    with recorded() as seen:
        assert mgr.restore(state) == 3
        mgr.wait()
    assert_state(state, 3)
    assert not [m for m in messages(seen) if "skipped" in m], messages(seen)
    if damage == "no_manifest":
        # the durable root lacked step 3: restore copied it again
        assert assert_committed_exact(durable) == [1, 2, 3]
        mgr.close()
        return
    mgr.close()
    # the local tier is gone too: an older durable step, with a warning naming step 3
    shutil.rmtree(local)
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3, keep_local=2)
    state = template()
    with pytest.warns(UserWarning) as seen:
        assert mgr.restore(state) == 2
    assert_state(state, 2)
    text = "\n".join(messages(seen))
    assert f"step 3 in {durable}" in text and "restored step 2" in text, text
    # nothing loads: CorruptCheckpointError naming every step (the docstring's promise)
    for step in (1, 2):
        folder = durable / step_folder(step)
        flip_byte(folder / sorted(data_files(folder))[0])
    with pytest.raises(safeckpt.CorruptCheckpointError) as exc:
        mgr.restore(template())
    for step in (1, 2, 3):
        assert f"step {step} in {durable}" in str(exc.value), str(exc.value)
    mgr.close()


def test_durable_newest_without_manifest_and_local_wiped(tiers):
    local, durable = tiers
    _three_saves(local, durable, keep_local=2)
    (durable / step_folder(3) / "manifest-000001.json").unlink()
    shutil.rmtree(local)
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3)
    state = template()
    with pytest.warns(UserWarning, match=f"(?s)restored step 2.*step 3 in {durable}"):
        assert mgr.restore(state) == 2
    assert_state(state, 2)
    mgr.close()


def test_local_corrupt_falls_back_to_durable_copy_of_same_step(tiers):
    local, durable = tiers
    _three_saves(local, durable, keep_local=2)
    folder = local / step_folder(3)
    flip_byte(folder / sorted(data_files(folder))[0])
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3, keep_local=2)
    state = template()
    with pytest.warns(UserWarning) as seen:
        assert mgr.restore(state) == 3
    assert_state(state, 3)
    text = "\n".join(messages(seen))
    assert f"restored step 3 from {durable}" in text and f"step 3 in {local}" in text, text
    assert "checksum" in text, text
    # training goes on
    mgr.save(4, make_state(4))
    mgr.wait()
    assert assert_committed_exact(durable) == [2, 3, 4]
    mgr.close()


def test_local_newer_than_durable_when_replication_fails(tiers):
    """Replication fails (EIO on every durable data write): the local tier runs ahead;
    a restart restores the local newest and finishes its durable copy."""
    local, durable = tiers
    faulty = FaultyStorage(LocalStorage(str(durable)))
    mgr = safeckpt.CheckpointManager(faulty, local=str(local), keep_last=5, keep_local=3)
    mgr.save(1, make_state(1))
    mgr.wait()
    faulty.inject("write_file", errno.EIO, path="data-")
    with recorded() as seen:
        for step in (2, 3):
            mgr.save(step, make_state(step))
            with pytest.raises(safeckpt.StorageError, match=step_folder(step)):
                mgr.wait()
    assert sum("failed" in m and "replicating" in m for m in messages(seen)) == 2, messages(seen)
    mgr.close()
    assert committed(durable) == [1] and committed(local) == [1, 2, 3]
    # a new job (the durable root without faults)
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=5, keep_local=3)
    assert mgr.steps() == [1, 2, 3] and mgr.latest_step() == 3
    state = template()
    assert mgr.restore(state) == 3
    assert_state(state, 3)
    mgr.wait()  # restore scheduled the copy the last job could not make
    assert assert_committed_exact(durable) == [1, 3]
    mgr.close()


def test_durable_newer_than_stale_local_tier(tmp_path):
    """A node's local folder left from an older job: the durable root is ahead."""
    durable, node_a, node_b = tmp_path / "durable", tmp_path / "node-a", tmp_path / "node-b"
    with safeckpt.CheckpointManager(str(durable), local=str(node_a), keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state(step))
            mgr.wait()
    with safeckpt.CheckpointManager(str(durable), local=str(node_b), keep_last=5) as mgr:
        state = template()
        assert mgr.restore(state) == 2
        assert_state(state, 2)
        for step in (3, 4):
            mgr.save(step, make_state(step))
            mgr.wait()
    assert committed(node_a) == [1, 2] and committed(durable) == [1, 2, 3, 4]
    mgr = safeckpt.CheckpointManager(str(durable), local=str(node_a), keep_last=5)
    assert mgr.steps() == [1, 2, 3, 4] and mgr.latest_step() == 4
    assert mgr.path(4) == str(durable / step_folder(4)) and mgr.path(2) == str(node_a / step_folder(2))
    state = template()
    assert mgr.restore(state) == 4
    assert_state(state, 4)
    mgr.save(5, make_state(5))
    mgr.wait()
    assert assert_committed_exact(durable) == [1, 2, 3, 4, 5]
    assert 5 in committed(node_a)
    mgr.close()


def test_another_roots_local_checkpoints_are_never_restored_uploaded_or_deleted(tmp_path):
    """Job X (durable root ``durable-x``) left steps 2 and 3 in a local folder; job Y
    committed step 2 in its own root, then runs with the same local folder. Y restores
    its own step 2 (warned of X's, never X's weights), lists and uploads nothing of
    X's, is refused (clearly) a save of a step the folder holds for X, saves other steps
    beside X's and its retention never deletes X's: X still restores its step 3."""
    shared, dx, dy = tmp_path / "local", tmp_path / "durable-x", tmp_path / "durable-y"

    def x_state(step: int) -> dict:  # X's checkpoint of a step: other values than Y's
        return make_state(step + 1000)

    with safeckpt.CheckpointManager(str(dx), local=str(shared), keep_last=3) as x:
        for step in (2, 3):
            x.save(step, x_state(step))
    with safeckpt.CheckpointManager(str(dy), local=str(tmp_path / "local-y")) as y:
        y.save(2, make_state(2))
    mgr = safeckpt.CheckpointManager(str(dy), local=str(shared), keep_last=3, keep_local=2)
    state = template()
    with recorded() as seen:
        assert mgr.restore(state) == 2
    assert_state(state, 2)
    foreign = [str(w.message) for w in seen if issubclass(w.category, safeckpt.ForeignRunWarning)]
    assert foreign and str(dx) in foreign[0] and step_folder(3) in foreign[0], messages(seen)
    assert mgr.steps() == [2] and mgr.latest_step() == 2 and mgr.path(2) == str(dy / step_folder(2))
    mgr.wait()
    assert committed(dy) == [2]  # X's step 3 was not uploaded
    with pytest.raises(safeckpt.CheckpointExistsError, match="durable-x"):
        mgr.save(3, make_state(3))
    for step in (4, 5, 6):
        mgr.save(step, make_state(step))
        mgr.wait()
    mgr.delete(2)  # Y's own step 2 (in Y's root), never X's local one
    mgr.close()
    assert assert_committed_exact(dy) == [4, 5, 6]
    assert committed(shared) == [2, 3, 5, 6]  # keep_local=2 kept Y's 5 and 6, and left X's alone
    shutil.rmtree(dx)
    with safeckpt.CheckpointManager(str(dx), local=str(shared), keep_last=3) as x:
        state = template()
        with recorded() as seen:
            assert x.restore(state) == 3
        assert_state(state, 1003)
    assert any(str(dy) in m and step_folder(6) in m for m in messages(seen)), messages(seen)  # Y's, in turn


@pytest.mark.parametrize("tier", ["local", "durable"])
def test_a_checkpoint_under_another_step_folder_counts_for_nothing(tiers, tier):
    """Step 2's folder copied to step 9 (in either tier): its manifest says step 2, not 9,
    so it is passed over (warned) and step 3 restores; nor is it listed as step 9."""
    local, durable = tiers
    _three_saves(local, durable, keep_local=3)
    root = local if tier == "local" else durable
    shutil.copytree(root / step_folder(2), root / step_folder(9))
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3, keep_local=3)
    state = template()
    with recorded() as seen:
        assert mgr.restore(state) == 3
    assert_state(state, 3)
    assert any(step_folder(9) in m and "step 2" in m for m in messages(seen)), messages(seen)
    assert mgr.steps() == [1, 2, 3] and mgr.latest_step() == 3
    mgr.close()
    if tier == "durable":  # the listing (safeckpt ls, verify) agrees with the manager
        rows = {row.step: row for row in safeckpt.list_checkpoints(durable)}
        assert rows[9].state is safeckpt.CheckpointState.CORRUPT and "step 2" in rows[9].problem, rows[9]
        assert rows[3].committed


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("how", ["enospc_before_write", "enospc_mid_write"])
def test_replication_failure_does_not_stop_training(tiers, how, caplog):
    local, durable = tiers
    fail = {"on": False}

    def on_write(rel, parts):
        if fail["on"] and "/data-" in rel:
            def enospc():
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return half_then(parts, enospc)
        return parts

    faulty = FaultyStorage(LocalStorage(str(durable)))
    root = HookedStorage(faulty, on_write) if how == "enospc_mid_write" else faulty
    mgr = safeckpt.CheckpointManager(root, local=str(local), keep_last=3, keep_local=2)
    mgr.save(1, make_state(1))
    mgr.wait()
    if how == "enospc_before_write":
        fault = faulty.inject("write_file", errno.ENOSPC, path="data-")
    else:
        fail["on"] = True
    caplog.set_level(logging.ERROR, logger="safeckpt")
    with recorded() as seen:
        info = mgr.save(2, make_state(2))  # returns: the local commit is the save
        # warned at once, without anyone calling wait() (nothing here may enter a
        # catch_warnings "ignore" block meanwhile: warnings state is process-wide, so it
        # would swallow the replicator thread's warning too)
        wait_until(lambda: any("replicating" in m for m in messages(seen)), 20, "the replication warning")
        assert info.step == 2 and committed(local) == [1, 2]
        with pytest.raises(safeckpt.StorageError) as exc:
            mgr.wait()
    [warning] = [w for w in seen if "replicating" in str(w.message)]
    assert issubclass(warning.category, UserWarning)
    assert f"replicating {step_folder(2)} to {durable} failed" in str(warning.message)
    assert exc.value.errno == errno.ENOSPC
    assert str(durable / step_folder(2)) in str(exc.value) and "space" in str(exc.value), str(exc.value)
    # reported once: the warning (a ReplicationWarning, which logging.captureWarnings routes
    # to the log), not also an error log line
    assert issubclass(warning.category, safeckpt.ReplicationWarning)
    assert not any("replicating" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    mgr.wait()  # the error was seen: raised once
    if how == "enospc_mid_write":
        torn = data_files(durable / step_folder(2))
        assert torn and all(size < min(data_files(local / step_folder(2)).values()) for size in torn.values())
    assert committed(durable) == [1]
    # the fault goes away: the next save is copied
    if how == "enospc_before_write":
        faulty.faults.remove(fault)
    else:
        fail["on"] = False
    mgr.save(3, make_state(3))
    mgr.wait()
    assert assert_committed_exact(durable) == [1, 3]
    assert tier_status(durable).get(2) != "ok"
    mgr.close()
    # an explicit collection removes what the failed copy left
    with safeckpt.CheckpointManager(str(durable), keep_last=3) as plain:
        plain.gc()
    assert not (durable / step_folder(2)).exists()
    assert assert_committed_exact(durable) == [1, 3]


def test_close_raises_an_unseen_replication_error(tiers):
    local, durable = tiers
    faulty = FaultyStorage(LocalStorage(str(durable)))
    faulty.inject("write_file", errno.EACCES, path="manifest-")
    mgr = safeckpt.CheckpointManager(faulty, local=str(local))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.save(1, make_state(1))
        with pytest.raises(safeckpt.StorageError, match="permission denied"):
            mgr.close()
    assert committed(durable) == [] and committed(local) == [1]


def test_unreachable_durable_root_does_not_stop_local_saves(tiers):
    """After the first save (which takes the writer lease on the durable root), every
    durable operation fails: saves still commit locally; the errors come at wait()."""
    local, durable = tiers
    faulty = FaultyStorage(LocalStorage(str(durable)))
    mgr = safeckpt.CheckpointManager(faulty, local=str(local), keep_last=3, keep_local=2)
    mgr.save(1, make_state(1))
    mgr.wait()
    outage = faulty.inject("*", errno.EIO)
    with recorded() as seen:
        for step in (2, 3):
            info = mgr.save(step, make_state(step))
            assert info.path == str(local / step_folder(step))
            with pytest.raises(safeckpt.StorageError) as exc:
                mgr.wait()
            assert exc.value.errno == errno.EIO and str(durable) in str(exc.value)
    assert sum("replicating" in m for m in messages(seen)) == 2, messages(seen)
    assert assert_committed_exact(local) == [2, 3]
    faulty.faults.remove(outage)
    mgr.save(4, make_state(4))
    mgr.wait()
    assert assert_committed_exact(durable) == [1, 4]
    mgr.close()


def test_durable_lease_fences_a_replaced_job(tmp_path):
    """Job B takes the durable root over: job A's saves still commit on A's local disk,
    but A's copies stop before their durable commit, with an error; B's saves win."""
    durable, node_a, node_b = tmp_path / "durable", tmp_path / "node-a", tmp_path / "node-b"
    a = safeckpt.CheckpointManager(str(durable), local=str(node_a), keep_last=5)
    a.save(1, make_state(1))
    a.wait()
    b = safeckpt.CheckpointManager(str(durable), local=str(node_b), keep_last=5)
    assert b.restore(template()) == 1
    b.save(2, make_state(2))
    b.wait()
    with recorded() as seen:
        a.save(3, make_state(1003))  # job A's step 3 (other values than B's)
        with pytest.raises(safeckpt.CheckpointExistsError, match="no longer owns"):
            a.wait()
    assert any("replicating" in m for m in messages(seen)), messages(seen)
    assert committed(node_a) == [1, 3] and committed(durable) == [1, 2]
    a.close()
    b.save(3, make_state(3))
    b.wait()
    assert assert_committed_exact(durable) == [1, 2, 3]  # B's step 3, exactly
    b.close()


def test_first_save_racing_a_copy_restore_scheduled(tiers):
    local, durable = tiers
    with safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=5) as first:
        for step in (1, 2):
            first.save(step, make_state(step))
            first.wait()
    (durable / step_folder(2) / "manifest-000001.json").unlink()  # killed before the commit
    main_in_acquire, copier_took_lease = threading.Event(), threading.Event()

    def on_write(rel, parts):
        copier = threading.current_thread().name == "safeckpt-replicate"
        if copier and rel.startswith(step_folder(2) + "/data-"):
            main_in_acquire.wait(3)  # the copy runs while the first save takes the lease
        if rel.startswith("safeckpt-writer-"):
            if not copier:
                main_in_acquire.set()
                copier_took_lease.wait(3)
            else:
                def then_signal():
                    yield from parts
                    copier_took_lease.set()
                return then_signal()
        return parts

    mgr = safeckpt.CheckpointManager(HookedStorage(LocalStorage(str(durable)), on_write),
                                     local=str(local), keep_last=5)
    assert mgr.restore(template()) == 2  # schedules the copy of step 2
    mgr.save(3, make_state(3))
    mgr.wait()
    assert assert_committed_exact(durable) == [1, 2, 3]
    mgr.close()


def test_stale_local_copy_of_a_step_the_durable_root_holds_differently(tmp_path):
    durable, node_a, node_b = tmp_path / "durable", tmp_path / "node-a", tmp_path / "node-b"
    faulty = FaultyStorage(LocalStorage(str(durable)))
    a = safeckpt.CheckpointManager(faulty, local=str(node_a), keep_last=5)
    a.save(1, make_state(1))
    a.wait()
    faulty.inject("write_file", errno.EIO, path=step_folder(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a.save(2, make_state(1002))  # node A's step 2 never reaches the durable root
        with pytest.raises(safeckpt.StorageError):
            a.wait()
    a.close()
    # the job is requeued on node B: it continues from step 1 and saves its own step 2
    with safeckpt.CheckpointManager(str(durable), local=str(node_b), keep_last=5) as b:
        assert b.restore(template()) == 1
        b.save(2, make_state(2))
        b.wait()
    assert committed(durable) == [1, 2] and committed(node_a) == [1, 2]
    # requeued again, on node A
    mgr = safeckpt.CheckpointManager(str(durable), local=str(node_a), keep_last=5)
    state = template()
    with pytest.warns(UserWarning, match="is passed over: the later save"):
        assert mgr.restore(state) == 2
    mgr.close()
    assert_state(state, 2)  # the step 2 the durable root holds, not node A's abandoned one


def test_a_damaged_local_checkpoint_is_not_committed_in_the_durable_root(tiers):
    local, durable = tiers
    entered, release = threading.Event(), threading.Event()

    def on_write(rel, parts):
        if rel.startswith(step_folder(2) + "/data-"):
            entered.set()
            release.wait(10)
        return parts

    mgr = safeckpt.CheckpointManager(HookedStorage(LocalStorage(str(durable)), on_write),
                                     local=str(local), keep_last=5)
    mgr.save(1, make_state(1))
    mgr.wait()
    mgr.save(2, make_state(2))
    assert entered.wait(10)
    folder = local / step_folder(2)
    flip_byte(folder / sorted(data_files(folder))[0])  # before its bytes are read for the copy
    release.set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mgr.wait()
        except safeckpt.CheckpointError:
            pass  # refusing the copy, with an error, is the right outcome
    mgr.close()
    assert assert_committed_exact(durable) == [1]  # never a committed checkpoint that fails verify


# --------------------------------------------------------------------------- incremental


def test_incremental_tiered(tiers):
    local, durable = tiers
    written: Counter = Counter()

    def on_write(rel, parts):
        written[rel] += 1
        return parts

    root = HookedStorage(LocalStorage(str(durable)), on_write)
    mgr = safeckpt.CheckpointManager(root, local=str(local), keep_last=3, keep_local=2,
                                     incremental=True, chunk_size=CHUNK)
    infos = {}
    for step in (1, 2, 3, 4):
        infos[step] = mgr.save(step, incr_state(step))
        mgr.wait()
    assert FULL_INCR <= infos[1].bytes < FULL_INCR + HEADER_SLACK
    for step in (2, 3, 4):  # one changed chunk each
        assert CHUNK <= infos[step].bytes < CHUNK + HEADER_SLACK and infos[step].shared_bytes > 0
    # every durable file was written exactly once
    assert written and max(written.values()) == 1, [k for k, v in written.items() if v > 1]
    copied = sum((durable / rel).stat().st_size for rel in written if "/data-" in rel)
    assert copied == sum(i.bytes for i in infos.values())
    # durable step folders hold only their own (changed) chunks, same as on the local tier
    assert committed(durable) == [2, 3, 4]
    for step in (2, 3, 4):
        own = data_files(durable / step_folder(step))
        assert sum(own.values()) == infos[step].bytes
        if (local / step_folder(step)).exists():
            assert own == data_files(local / step_folder(step))
    # step 1 was retired by durable retention but keeps the data later steps share
    assert garbage.RETIRED in os.listdir(durable / step_folder(1))
    m3 = read_committed(LocalStorage(str(durable / step_folder(3))))
    assert any(is_shared(n) and n.startswith(f"../{step_folder(1)}/") for n in m3.files)
    assert assert_committed_exact(durable, make=incr_state) == [2, 3, 4]
    mgr.close()
    # the local tier is gone: restore from the durable root, go on saving
    shutil.rmtree(local)
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3, keep_local=2,
                                     incremental=True, chunk_size=CHUNK)
    state = incr_template()
    assert mgr.restore(state) == 4
    assert_state(state, 4, incr_state)
    for step in (5, 6):
        mgr.save(step, incr_state(step))
    mgr.wait()
    assert assert_committed_exact(durable, make=incr_state)[-1] == 6
    assert assert_committed_exact(local, make=incr_state) == [5, 6]
    mgr.close()


def test_incremental_copy_brings_the_shared_files_of_a_failed_copy(tiers):
    """Step 2's copy fails half way through its data; step 3 shares step 2's chunks, so
    its copy brings them (replacing the torn file) and the durable step 3 loads alone."""
    local, durable = tiers
    fail = {"on": False}

    def on_write(rel, parts):
        if fail["on"] and rel.startswith(step_folder(2) + "/data-"):
            def enospc():
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return half_then(parts, enospc)
        return parts

    root = HookedStorage(LocalStorage(str(durable)), on_write)
    mgr = safeckpt.CheckpointManager(root, local=str(local), keep_last=3, keep_local=3,
                                     incremental=True, chunk_size=CHUNK)
    mgr.save(1, incr_state(1))
    mgr.wait()
    fail["on"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.save(2, incr_state(2))
        with pytest.raises(safeckpt.StorageError):
            mgr.wait()
    fail["on"] = False
    assert committed(durable) == [1]
    mgr.save(3, incr_state(3))
    mgr.wait()
    m3 = read_committed(LocalStorage(str(local / step_folder(3))))
    assert any(n.startswith(f"../{step_folder(2)}/") for n in m3.files), "step 3 shares nothing of step 2"
    assert data_files(durable / step_folder(2)) == data_files(local / step_folder(2))
    mgr.close()
    shutil.rmtree(local)
    assert assert_committed_exact(durable, make=incr_state) == [1, 3]
    mgr = safeckpt.CheckpointManager(str(durable), local=str(local), keep_last=3, incremental=True,
                                     chunk_size=CHUNK)
    state = incr_template()
    assert mgr.restore(state) == 3
    assert_state(state, 3, incr_state)
    mgr.close()


# --------------------------------------------------------------------------- object store


def test_durable_root_on_s3(s3store, tmp_path):
    local = tmp_path / "local"
    root, options = s3store.url("run"), s3store.options
    mgr = safeckpt.CheckpointManager(root, local=str(local), keep_last=2, keep_local=1,
                                     storage_options=options)
    for step in (1, 2, 3):
        mgr.save(step, make_state(step))
        mgr.wait()
        assert tier_status(root, options).get(step) == "ok"
    assert assert_committed_exact(root, options) == [2, 3]
    assert committed(local) == [3]
    assert mgr.steps() == [2, 3] and mgr.path(2) == f"{root}/{step_folder(2)}"
    mgr.close()
    shutil.rmtree(local)  # a new node
    mgr = safeckpt.CheckpointManager(root, local=str(local), keep_last=2, keep_local=1,
                                     storage_options=options)
    state = template()
    assert mgr.restore(state) == 3
    assert_state(state, 3)
    assert mgr.path(3) == f"{root}/{step_folder(3)}"
    mgr.save(4, make_state(4))
    mgr.wait()
    assert assert_committed_exact(root, options) == [3, 4]
    mgr.close()


# --------------------------------------------------------------------------- SIGKILL


@pytest.fixture(scope="module")
def tiered_server():
    server = TieredForkServer(SRC)
    yield server
    server.close()


def _kill_in_copy(server, tmp_path: Path, local: Path, durable: str, point: str,
                  options: dict | None = None) -> None:
    progress = str(tmp_path / f"progress-{point}.txt")
    pid = server.fork("tiered_kill", local=str(local), durable=durable, progress=progress,
                      point=point, steps=[1, 2], options=options)
    err = Path(progress + ".err")
    try:
        wait_until(lambda: ("stall", 2) in read_events(progress) or err.exists(), 60,
                   f"the child to stall in the durable copy at {point}")
    finally:
        status = server.kill(pid)
    assert not err.exists(), err.read_text()
    assert status["signal"] == signal.SIGKILL, status
    events = read_events(progress)
    assert ("copied", 1) in events and ("done", 2) in events, events


def _check_after_kill(durable: str, local: Path, options: dict | None = None) -> None:
    """The durable root on its own: step 1 intact, step 2 not committed; then a new job
    restores step 2 from the local tier and finishes its durable copy."""
    status = tier_status(durable, options)
    assert status.get(1) == "ok" and status.get(2) != "ok", status
    with pytest.raises((safeckpt.CheckpointNotFoundError, safeckpt.CorruptCheckpointError)):
        safeckpt.load(save_child.make_template(), f"{durable}/{step_folder(2)}", storage_options=options)
    assert_state(safeckpt.load_state(f"{durable}/{step_folder(1)}", storage_options=options), 1,
                 save_child.make_state)
    assert safeckpt.verify(f"{durable}/{step_folder(1)}", storage_options=options).ok
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = safeckpt.CheckpointManager(durable, storage_options=options)
        assert alone.steps() == [1]
        state = save_child.make_template()
        assert alone.restore(state) == 1
        assert save_child.state_mismatch(state, 1) is None
        alone.close()
    # the job restarts on the same node
    mgr = safeckpt.CheckpointManager(durable, local=str(local), keep_last=3, storage_options=options)
    state = save_child.make_template()
    assert mgr.restore(state) == 2 and mgr.path(2) == str(local / step_folder(2))
    assert save_child.state_mismatch(state, 2) is None
    mgr.wait()  # the copy restore scheduled
    assert assert_committed_exact(durable, options, make=save_child.make_state) == [1, 2]
    mgr.save(3, save_child.make_state(3))
    mgr.wait()
    assert assert_committed_exact(durable, options, make=save_child.make_state) == [1, 2, 3]
    mgr.close()


@pytest.mark.parametrize("point", ["mid_data", "before_manifest", "torn_manifest"])
def test_sigkill_during_replication(tiered_server, tmp_path, point):
    local, durable = tmp_path / "local", tmp_path / "durable"
    _kill_in_copy(tiered_server, tmp_path, local, str(durable), point)
    # what the kill left in the durable copy of step 2
    src, dst = local / step_folder(2), durable / step_folder(2)
    src_data, dst_data = data_files(src), data_files(dst)
    manifests = sorted(n for n in os.listdir(dst) if n.startswith("manifest-"))
    if point == "mid_data":
        assert len(dst_data) == 1 and all(dst_data[n] < src_data[n] for n in dst_data), (dst_data, src_data)
        assert manifests == []
    elif point == "before_manifest":
        assert dst_data == src_data and manifests == []
    else:
        assert dst_data == src_data and manifests == ["manifest-000001.json"]
        assert (dst / manifests[0]).stat().st_size < (src / manifests[0]).stat().st_size
    _check_after_kill(str(durable), local)
    # the repaired copy is the local checkpoint, byte for byte, and nothing else
    assert sorted(os.listdir(dst)) == sorted(os.listdir(src))
    for name in os.listdir(src):
        assert (src / name).read_bytes() == (dst / name).read_bytes(), name


def test_sigkill_during_replication_to_s3(tiered_server, moto_server, tmp_path):
    store = _s3_store(moto_server)
    root = store.url("run")
    _kill_in_copy(tiered_server, tmp_path, tmp_path / "local", root, "mid_data", store.options)
    _check_after_kill(root, tmp_path / "local", store.options)


def test_process_exit_without_close_finishes_the_copy(tiers):
    """The copier is not a daemon thread: a process that saves and returns from its main
    script (no close(), no wait()) still completes the durable copy before it exits."""
    local, durable = tiers
    script = textwrap.dedent(f"""
        import time
        import torch
        import safeckpt
        from safeckpt.storage import LocalStorage
        from tiered_child import HookedStorage

        def slow(rel, parts):
            if "/data-" in rel:
                time.sleep(1.0)  # the copy is surely still running when the script ends
            return parts

        g = torch.Generator().manual_seed(1)
        state = {{"model": {{"w": torch.randn({N}, generator=g), "b": torch.arange(500) + 1}},
                 "opt": {{"lr": 0.1, "betas": [0.9, 0.99]}}, "step": 1}}
        mgr = safeckpt.CheckpointManager(HookedStorage(LocalStorage({str(durable)!r}), slow),
                                         local={str(local)!r})
        mgr.save(1, state)
        print("saved", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(Path(__file__).parent / "helpers")]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "saved" in proc.stdout
    assert assert_committed_exact(durable) == [1]


# --------------------------------------------------------------------------- many ranks


DIST_ENV = {"DIST_WORKER_STEP_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def dist_server():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import tiered_dist_worker as tw

    # safeckpt reads SAFECKPT_TIMEOUT when the server imports it: a collective that no
    # rank answers fails after 8 s instead of 300
    server = tw.TieredForkServer(SRC, env={"SAFECKPT_TIMEOUT": "8"})
    yield server
    server.close()


def _durable_exact_2ranks(durable: Path, local: Path, step: int) -> None:
    import tiered_dist_worker as tw
    folder = durable / step_folder(step)
    assert safeckpt.verify(str(folder)).ok
    got = safeckpt.load_state(str(folder))
    assert exact(got["m"], tw.mat_full(step)) and exact(got["b"], tw.bias(step)) and got["step"] == step
    # rank 0 copied every rank's data file
    ranks = sorted(n.rsplit("-", 1)[1] for n in data_files(folder))
    assert ranks == ["r00000.safetensors", "r00001.safetensors"], ranks
    if (local / step_folder(step)).exists():
        assert data_files(folder) == data_files(local / step_folder(step))


def test_two_gloo_ranks_tiered(dist_server, tmp_path):
    """2 ranks, one node (a shared local folder): a save is copied by rank 0 with every
    rank's data; a new node restores it from the durable root on both ranks and saves on."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    saved = dist_server.launch(2, ["tiered_save2"], tmp_path, tmp_path / "launch-save", timeout=90,
                               env=DIST_ENV, opts={"steps": [1]})
    res = saved.results("tiered_save2")
    for r, data in enumerate(res):
        assert data["saves"] == {"1": {"steps": [1]}}, (r, data)
        assert data["loads"] == {"1": []}, (r, data)
        assert data["restored"] == 1 and data["restored_problems"] == [], (r, data)
    assert committed(durable) == [1] and committed(local) == [1]
    _durable_exact_2ranks(durable, local, 1)
    shutil.rmtree(local)  # a new node
    resumed = dist_server.launch(2, ["tiered_resume2"], tmp_path, tmp_path / "launch-resume", timeout=90,
                                 env=DIST_ENV, opts={"expect": 1, "next": 2})
    for r, data in enumerate(resumed.results("tiered_resume2")):
        assert data["restored"] == 1 and data["restored_problems"] == [], (r, data)
        assert data["steps"] == [1, 2] and data["path"] == str(local / step_folder(2)), (r, data)
    assert committed(durable) == [1, 2]
    _durable_exact_2ranks(durable, local, 2)


def test_two_gloo_ranks_tiered_several_saves(dist_server, tmp_path):
    durable, local = tmp_path / "durable", tmp_path / "local"
    saved = dist_server.launch(2, ["tiered_save2"], tmp_path, tmp_path / "launch-save", timeout=90,
                               env=DIST_ENV, opts={"steps": [1, 2, 3]})
    res = saved.results("tiered_save2")
    for r, data in enumerate(res):
        assert data["saves"] == {"1": {"steps": [1]}, "2": {"steps": [1, 2]}, "3": {"steps": [2, 3]}}, \
            (r, data["saves"])
        assert data["loads"] == {"2": [], "3": []}, (r, data)
        assert data["restored"] == 3 and data["restored_problems"] == [], (r, data)
    assert committed(durable) == [2, 3]
    for step in (2, 3):
        _durable_exact_2ranks(durable, local, step)
