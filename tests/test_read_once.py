"""Read once, share: ranks that need the same saved bytes read them from storage once
and send them to each other (``protocol/exchange.py``), on real gloo ranks.

Every load goes through a storage that counts the bytes each rank reads
(tests/helpers/share_dist_worker.py): a replicated (DDP) state on 2, 3 and 4 ranks reads
1.0x the checkpoint with sharing and N x without it, loads bit-identical either way;
resharded loads whose ranks overlap partly read each saved byte once; a rank whose
reads fail (EIO) or a corrupt block makes every rank raise a typed error naming the
rank and the file, with no hang; a rank killed mid-exchange is an error on the others
within the timeout. The plan itself (``format/sharing.py``) is checked as a pure
function.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.format.manifest import manifest_seq  # noqa: E402
from safeckpt.format.sharing import Needers, Spans, plan_sharing  # noqa: E402
from safeckpt.protocol.exchange import share_mode  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)
ENV = {"SAFECKPT_TIMEOUT": "30", "DIST_WORKER_STEP_TIMEOUT": "60"}
BLOCK = 16 << 20
EVERY = ["off", "job", "auto", "auto_nodes", "node_scope", "env_off", "env_job", "unverified"]
FEW = ["off", "job", "node_scope"]  # on 2 and 4 ranks; every case on 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per world size (its scenarios batched), and the checkpoints' root."""
    import share_dist_worker as sw

    root = tmp_path_factory.mktemp("share")
    out = tmp_path_factory.mktemp("launches")
    server = sw.ShareForkServer(SRC)
    launches = {}
    try:
        for world, scenarios in ((2, ["share_ddp"]), (3, ["share_ddp", "share_reshard", "share_fail", "share_bounded"]),
                                 (4, ["share_ddp", "share_reshard"])):
            opts = {} if world == 3 else {"cases": FEW}
            launches[world] = server.launch(world, scenarios, root, out / f"w{world}", timeout=200, env=ENV,
                                            opts=opts)
        yield launches, root
    finally:
        server.close()


def checkpoint_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of the data files, bytes of the checkpoint: data files and the manifest)."""
    data = sum(p.stat().st_size for p in folder.glob("data-*"))
    manifest = sum(p.stat().st_size for p in folder.iterdir() if manifest_seq(p.name) is not None)
    return data, data + manifest


def loaded(res: list[dict], case: str) -> None:
    for r, d in enumerate(res):
        got = d[case]
        assert not got["raised"], f"rank {r}, {case}: {got['raised']}: {got['message']}\n{got.get('traceback')}"
        assert got["problems"] == [], f"rank {r}, {case}: not bit-identical: {got['problems']}"


def total_read(res: list[dict], case: str) -> int:
    return sum(d[case]["bytes"] for d in res)


# --------------------------------------------------------------------------- DDP


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_replicated_load_reads_the_checkpoint_once(runs, world):
    launches, root = runs
    res = launches[world].results("share_ddp")
    data, whole = checkpoint_bytes(root / f"ddp-{world}")
    cases = EVERY if world == 3 else FEW
    for case in cases:
        loaded(res, case)
    # sharing: every saved byte read once in all (the manifest by rank 0; each reader also
    # checks the headers of the files it reads: a few KB)
    for case in {"job", "auto_nodes", "env_job", "unverified"} & set(cases):
        got = total_read(res, case)
        assert data <= got <= whole * 1.002, (
            f"{world} ranks, {case}: read {got} bytes in all for a checkpoint of {whole} ({got / whole:.3f}x); "
            f"per rank: {[d[case]['bytes'] for d in res]}")
        readers = [d[case]["bytes"] for d in res if d[case]["bytes"] > 0]
        assert len(readers) >= 2, f"{case}: one rank read everything: {[d[case]['bytes'] for d in res]}"
    # without sharing (and by default on one node's local files: its page cache reads
    # them once), every rank reads every byte
    for case in {"off", "auto", "env_off"} & set(cases):
        got = total_read(res, case)
        assert world * data <= got <= world * whole, f"{world} ranks, {case}: read {got} bytes, expected {world}x"
    # one copy per node with the node scope (two simulated nodes)
    got = total_read(res, "node_scope")
    assert 2 * data <= got <= 2 * whole * 1.002, f"node scope on 2 nodes: read {got} ({got / whole:.2f}x)"


@pytest.mark.parametrize("world", [3])
def test_manager_restore_shares_its_reads(runs, world):
    launches, root = runs
    res = launches[world].results("share_ddp")
    loaded(res, "restore")
    data, whole = checkpoint_bytes(root / f"mgr-{world}" / "step-000000005")
    got = total_read(res, "restore")
    assert data <= got <= whole + 3 * (whole - data) + 65536, f"restore read {got} bytes of a {whole}-byte checkpoint"


# --------------------------------------------------------------------------- resharding


@pytest.mark.parametrize("world", [3, 4])
def test_resharded_loads_with_partial_overlaps_read_each_byte_once(runs, world):
    launches, root = runs
    res = launches[world].results("share_reshard")
    data, whole = checkpoint_bytes(root / f"reshard-{world}")
    for case in ("rows_off", "rows_job", "cols_off", "cols_job"):
        loaded(res, case)
    for layout in ("rows", "cols"):
        shared, alone = total_read(res, f"{layout}_job"), total_read(res, f"{layout}_off")
        assert data <= shared <= whole * 1.01, f"{layout}: shared load read {shared} of {whole}"
        assert alone > 1.3 * data, f"{layout}: without sharing the ranks read only {alone} of {data}: no overlap?"


def test_a_rank_holds_a_bounded_window_of_buffers(runs):
    """2,000 small tensors (10 MB), every message through a buffer, windows of 1 MiB: no
    rank ever holds more than its reads of two windows and its receipts of one."""
    launches, _ = runs
    res = launches[3].results("share_bounded")
    for r, d in enumerate(res):
        assert not d["raised"] and d["problems"] == [], (r, d.get("message"), d["problems"][:5])
        bound = 3 * d["window"] + d["message"]
        assert 0 < d["peak"] <= bound, f"rank {r} held {d['peak']} bytes of buffers at once (bound {bound})"
        assert d["peak"] < d["total"] / 2, (r, d["peak"], d["total"])
    assert sum(d["bytes"] for d in res) < 1.05 * res[0]["total"]


# --------------------------------------------------------------------------- failures


def test_a_rank_whose_reads_fail_fails_every_rank(runs):
    launches, _ = runs
    res = launches[3].results("share_fail")
    for r, d in enumerate(res):
        got = d["eio"]
        assert got["raised"] == "StorageError" and got["is_checkpoint_error"], (r, got)
        assert "rank 1" in got["message"] and "data-" in got["message"] and "I/O error" in got["message"], (
            f"rank {r}: the error must name the failing rank and file: {got['message']}")
        assert got["seconds"] < 20, f"rank {r} took {got['seconds']:.1f}s to fail"
    loaded(res, "after")


def test_a_corrupt_block_read_by_one_rank_fails_every_rank(runs):
    launches, _ = runs
    res = launches[3].results("share_fail")
    file = res[0]["corrupted"]
    named = set()
    for r, d in enumerate(res):
        got = d["corrupt"]
        assert got["raised"] == "CorruptCheckpointError", (r, got)
        assert file in got["message"] and "fails its checksum" in got["message"] and "'big'" in got["message"], (
            r, got["message"])
        named.add(next(w for w in got["message"].replace(",", " ").split("rank ")[1:] if w[:1].isdigit())[:1])
    assert len(named) == 1, f"the ranks name different readers: {named}"


def test_a_rank_killed_during_a_shared_load_is_an_error_on_the_others(tmp_path):
    import share_dist_worker as sw

    server = sw.ShareForkServer(SRC)
    try:
        started = time.monotonic()
        run = server.launch(3, ["share_killed"], tmp_path, tmp_path / "out", timeout=120,
                            env={**ENV, "SAFECKPT_TIMEOUT": "20"}, opts={"victim": 1})
    finally:
        server.close()
    assert run.status[1]["signal"] == 9, run.describe()
    for r, d in zip((0, 2), run.results("share_killed", ranks=[0, 2])):
        got = d["load"]
        assert got["raised"] and got["is_checkpoint_error"], (r, got)
        assert got["seconds"] < 40, f"rank {r} needed {got['seconds']:.0f}s (SAFECKPT_TIMEOUT=20)"
    assert time.monotonic() - started < 100


# --------------------------------------------------------------------------- the plan


def test_the_plan_reads_each_span_once_split_by_bytes():
    m = 1 << 20
    spans = Spans.of([0] * 8 + [1] * 3, [i * BLOCK for i in range(8)] + [100, 200, 300],
                     [BLOCK] * 8 + [100] * 3)
    plan = plan_sharing([Needers(spans, [0, 1, 2, 3])], 4, m, 4 * m)
    assert sorted(np.bincount(plan.reader, weights=plan.u_length, minlength=4).tolist()) == \
        [2 * BLOCK, 2 * BLOCK, 2 * BLOCK, 2 * BLOCK + 300]
    assert plan.shared_bytes == spans.nbytes and plan.saved_bytes() == 3 * spans.nbytes
    small = [k for k in range(len(plan.file)) if plan.file[k] == 1]
    assert len(small) == 1 and plan.count[small[0]] == 3, "adjacent small spans are one request"
    assert [plan.receivers(k) for k in plan.shared[:4].tolist()] != [[]] * 4
    covered = sorted(k for lo, hi in plan.windows for k in plan.shared[lo:hi].tolist())
    assert covered == sorted(plan.shared.tolist())
    first_readers = plan.m_reader[plan.shared[:4]].tolist()
    assert sorted(first_readers) == [0, 1, 2, 3], f"the readers take turns: {first_readers}"


def test_the_plan_for_partial_overlaps_and_nodes():
    a, b = Spans.of([0, 0], [0, 10], [10, 10]), Spans.of([0, 0], [10, 20], [10, 10])
    plan = plan_sharing([Needers(a, [0]), Needers(b, [1])], 2, 1 << 20, 1 << 20)
    assert plan.shared_bytes == 10 and plan.u_start.tolist() == [0, 10, 20]
    assert plan.reader.tolist()[0] == 0 and plan.reader.tolist()[2] == 1
    assert [plan.receivers(k) for k in plan.shared.tolist()] == [[1 - plan.reader[1]]]
    every = Spans.of([0, 0], [0, BLOCK], [BLOCK, BLOCK])
    per_node = plan_sharing([Needers(every, [0, 1], 0), Needers(every, [2, 3], 1)], 4, BLOCK, BLOCK)
    assert per_node.saved_bytes() == 2 * every.nbytes, "each node reads every byte once"
    assert plan_sharing([], 2, 1, 1).shared.size == 0


def test_share_mode_values(monkeypatch):
    monkeypatch.delenv("SAFECKPT_SHARE_READS", raising=False)
    assert share_mode(None) == "auto" and share_mode(True) == "job" and share_mode(False) == "off"
    monkeypatch.setenv("SAFECKPT_SHARE_READS", "Node")
    assert share_mode(None) == "node" and share_mode("off") == "off"
    with pytest.raises(ValueError, match="share_reads"):
        share_mode("always")
