"""The local tier on several nodes, no shared filesystem between them.

Nodes are simulated on one machine: real gloo ranks grouped by ``SAFECKPT_NODE_ID``
(the test hook that overrides the host name), each node with a local folder of its
own (``local-a``, ``local-b``) and one durable root shared by all
(tests/helpers/nodes_dist_worker.py). The ranks of one node see only their node's
folder; nothing is mocked, kills are real SIGKILLs.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.format.names import step_folder  # noqa: E402
from safeckpt.run.nodes import read_holdings  # noqa: E402
from safeckpt.storage import LocalStorage  # noqa: E402

import tiered_dist_worker as tw  # noqa: E402  (tests/helpers is on sys.path via conftest.py)
from s3servers import moto_server, s3_bucket  # noqa: E402,F401  (moto_server: a fixture)

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = pytest.mark.timeout(180)

SRC = str(Path(safeckpt.__file__).resolve().parent.parent)
ENV = {"DIST_WORKER_STEP_TIMEOUT": "60"}
TWO_BY_TWO = ["a", "a", "b", "b"]


@pytest.fixture(scope="module")
def server():
    import nodes_dist_worker as nw
    # a collective no rank answers fails after 8 s (a killed node), not 300
    srv = nw.NodesForkServer(SRC, env={"SAFECKPT_TIMEOUT": "8"})
    yield srv
    srv.close()


def launch(server, tmp_path: Path, scenario: str, name: str, nodes: list[str], timeout: float = 90, **opts):
    res = server.launch(len(nodes), [scenario], tmp_path, tmp_path / name, timeout=timeout, env=ENV,
                        opts={"nodes": nodes, **opts})
    return res


def holdings(tmp_path: Path, node: str, step: int, home: Path | None = None) -> dict:
    """save id -> files the node's folder holds of that save (under a valid record of
    the durable root ``home``, default ``durable``)."""
    folder = LocalStorage(str(tmp_path / f"local-{node}" / step_folder(step)))
    return {sid: sorted(h.files) for sid, h in read_holdings(folder, step, str(home or tmp_path / "durable")).items()}


def durable_exact(tmp_path: Path, step: int) -> None:
    folder = tmp_path / "durable" / step_folder(step)
    assert safeckpt.verify(str(folder)).ok
    got = safeckpt.load_state(str(folder))
    assert torch.equal(got["m"], tw.mat_full(step)) and torch.equal(got["b"], tw.bias(step))
    assert got["step"] == step


def committed(root: Path) -> list[int]:
    out = []
    for p in sorted(root.glob("step-*")):
        try:
            safeckpt.protocol.checkpoint.read_committed(LocalStorage(str(p)))
            out.append(int(p.name[5:]))
        except safeckpt.CheckpointError:
            pass
    return out


def save(server, tmp_path, steps, nodes=TWO_BY_TWO, name="save", **opts) -> list[dict]:
    res = launch(server, tmp_path, "nodes_save", name, nodes, steps=steps, **opts).results("nodes_save")
    return res


def restore(server, tmp_path, expect, nodes=TWO_BY_TWO, name="restore", **opts) -> list[dict]:
    res = launch(server, tmp_path, "nodes_restore", name, nodes, expect=expect, **opts).results("nodes_restore")
    for r, data in enumerate(res):
        assert data["restore"]["raised"] is None, (r, data["restore"])
        assert data["restored"] == expect and data["problems"] == [], (r, data)
    return res


def test_save_writes_each_nodes_part_to_its_own_disk_and_restores_bit_exact(server, tmp_path):
    res = save(server, tmp_path, [1, 2, 3])
    for r, data in enumerate(res):
        assert all(s["raised"] is None for s in data["saves"].values()), (r, data)
        assert data["steps"] == [2, 3], (r, data)  # the durable root's retention: keep_last=2
    assert committed(tmp_path / "durable") == [2, 3]
    for step in (2, 3):
        durable_exact(tmp_path, step)
    # each node holds its own ranks' files, under a record of the committed save
    sid = safeckpt.protocol.checkpoint.read_committed(LocalStorage(str(tmp_path / "durable" / step_folder(3)))).save_id
    a, b = holdings(tmp_path, "a", 3), holdings(tmp_path, "b", 3)
    assert list(a) == [sid] and sorted(f.rsplit("-", 1)[1] for f in a[sid]) == ["r00000.safetensors", "r00001.safetensors"], a
    assert sorted(f.rsplit("-", 1)[1] for f in b[sid]) == ["r00002.safetensors", "r00003.safetensors"], b
    assert not (tmp_path / "local-a" / step_folder(3) / f"data-{sid}-r00002.safetensors").exists()
    # the local tier keeps 2 per node; no manifest on a node's disk (no node holds all files)
    assert sorted(p.name for p in (tmp_path / "local-a").glob("step-*")) == [step_folder(2), step_folder(3)]
    assert not list((tmp_path / "local-b").glob("step-*/manifest-*"))
    # a fresh job reads from the local disks even with the durable root's step 3 gone
    shutil.rmtree(tmp_path / "durable" / step_folder(3))
    restore(server, tmp_path, 3)


def test_node_with_empty_disk_falls_back_to_durable_root(server, tmp_path):
    save(server, tmp_path, [1, 2])
    shutil.rmtree(tmp_path / "local-b")  # node b was replaced
    res = restore(server, tmp_path, 2, next=3)
    for r, data in enumerate(res):
        assert data["next"]["raised"] is None, (r, data)
    assert committed(tmp_path / "durable") == [2, 3]
    durable_exact(tmp_path, 3)


def test_peer_replica_restores_a_lost_node_without_the_durable_root(server, tmp_path):
    save(server, tmp_path, [1, 2], replicas=1)
    sid = safeckpt.protocol.checkpoint.read_committed(LocalStorage(str(tmp_path / "durable" / step_folder(2)))).save_id
    # node a holds node b's files too, and b holds a's
    assert len(holdings(tmp_path, "a", 2)[sid]) == 4 and len(holdings(tmp_path, "b", 2)[sid]) == 4
    shutil.rmtree(tmp_path / "local-b")
    shutil.rmtree(tmp_path / "durable")
    restore(server, tmp_path, 2, replicas=1)
    # node b got its files back from node a, and recorded them; with them on every
    # node's disk, the restoring job uploaded step 2 to the (new) durable root
    assert len(holdings(tmp_path, "b", 2)[sid]) >= 2
    assert committed(tmp_path / "durable") == [2]
    durable_exact(tmp_path, 2)


def test_async_saves(server, tmp_path):
    res = save(server, tmp_path, [1, 2], async_save=True, replicas=1)
    assert all(s["raised"] is None for data in res for s in data["saves"].values()), res
    assert committed(tmp_path / "durable") == [1, 2]
    durable_exact(tmp_path, 2)
    shutil.rmtree(tmp_path / "local-a")
    shutil.rmtree(tmp_path / "durable")
    restore(server, tmp_path, 2, replicas=1)


def test_nodes_that_share_one_local_folder(server, tmp_path):
    """A "local" path that is in fact shared (NFS): each node records its own part
    under its own record name, and the folder holds the whole save."""
    shared = {"local_of": {"b": "a"}}
    save(server, tmp_path, [1, 2], **shared)
    assert not (tmp_path / "local-b").exists()
    assert len(next(iter(holdings(tmp_path, "a", 2).values()))) == 4
    shutil.rmtree(tmp_path / "durable" / step_folder(2))
    restore(server, tmp_path, 2, **shared)


def test_restore_on_three_ranks_reshards(server, tmp_path):
    save(server, tmp_path, [1])
    restore(server, tmp_path, 1, nodes=["a", "a", "b"])


def test_restore_on_three_ranks_from_local_disks_only(server, tmp_path):
    save(server, tmp_path, [1], replicas=1)
    shutil.rmtree(tmp_path / "durable")
    restore(server, tmp_path, 1, nodes=["a", "b", "b"], replicas=1)


@pytest.mark.parametrize("kill", ["local", "durable"])
def test_sigkill_of_one_node_during_a_save(server, tmp_path, kill):
    """Node b's ranks die once their step-2 file is on their disk (before the commit
    decision: nothing of step 2 counts) or once it is uploaded (after the decision:
    step 2 is committed on every node's disk but never durable)."""
    res = launch(server, tmp_path, "nodes_save", "save", TWO_BY_TWO, steps=[1, 2], kill_step=2, kill=kill,
                 victims=[2, 3])
    for r in (0, 1):
        data = res.results("nodes_save", ranks=[r])[0]
        assert data["saves"]["1"]["raised"] is None, data
        assert data["saves"]["2"]["is_save_aborted"], data["saves"]["2"]
    assert committed(tmp_path / "durable") == [1]
    if kill == "local":
        # node a has step 2's files, but no record: an aborted save
        assert holdings(tmp_path, "a", 2) == {} and holdings(tmp_path, "b", 2) == {}
        restore(server, tmp_path, 1, name="restore-after-kill")
    else:
        assert holdings(tmp_path, "a", 2) and holdings(tmp_path, "b", 2)
        restore(server, tmp_path, 2, name="restore-after-kill", next=3)
        # the restoring job uploaded step 2, which the killed one had not finished
        assert committed(tmp_path / "durable") == [2, 3]
        durable_exact(tmp_path, 2)
        durable_exact(tmp_path, 3)


def test_stale_local_copy_of_an_aborted_save_next_to_a_committed_one(server, tmp_path):
    """Step 2 committed; a resumed job saves step 2 again and the whole job is SIGKILLed
    once every rank's file is on its disk: each node holds the aborted attempt's data
    next to the committed copy, which is what restores."""
    save(server, tmp_path, [1, 2])
    before = {node: holdings(tmp_path, node, 2) for node in "ab"}
    launch(server, tmp_path, "nodes_save", "resave", TWO_BY_TWO, steps=[2], kill_step=2, kill="local",
           victims=[0, 1, 2, 3], restore=True)
    for node in "ab":
        files = {p.name for p in (tmp_path / f"local-{node}" / step_folder(2)).glob("data-*")}
        assert len({f.split("-")[1] for f in files}) == 2, files  # two saves' files side by side
        assert holdings(tmp_path, node, 2).keys() == before[node].keys()
    shutil.rmtree(tmp_path / "durable" / step_folder(2))  # step 2 only on the local disks
    restore(server, tmp_path, 2)


def test_sigkill_during_peer_replication_keeps_the_last_fully_replicated_step(server, tmp_path):
    """Node b's first rank dies while storing node a's replica of step 2 (decided and
    recorded on both disks, not yet replicated nor durable). Both disks restore step 2;
    with node b's disk lost as well, step 2 is not whole anywhere, and step 1 (fully
    replicated and durable) restores instead: never the half of step 2. A job restoring
    step 2 from both disks uploads it, which the killed job never did."""
    res = launch(server, tmp_path, "nodes_save", "save", TWO_BY_TWO, steps=[1, 2], kill_step=2, kill="peer",
                 victims=[2], replicas=1)
    for r in (0, 1, 3):
        data = res.results("nodes_save", ranks=[r])[0]
        assert data["saves"]["1"]["raised"] is None, data
        assert data["saves"]["2"]["is_save_aborted"], (r, data["saves"]["2"])
    assert committed(tmp_path / "durable") == [1]
    assert all(len(next(iter(holdings(tmp_path, n, 2).values()))) == 2 for n in "ab")  # own files only
    saved = tmp_path / "local-b-saved"
    shutil.move(tmp_path / "local-b", saved)
    res = restore(server, tmp_path, 1, name="restore-a-only", replicas=1)
    assert any("step 2" in w and "passed over" in w for w in res[0]["warnings"]), res[0]["warnings"]
    shutil.rmtree(tmp_path / "local-b")
    shutil.move(saved, tmp_path / "local-b")
    restore(server, tmp_path, 2, name="restore-both", replicas=1)
    assert committed(tmp_path / "durable") == [1, 2]  # the restoring job uploaded step 2
    durable_exact(tmp_path, 2)


def test_a_node_dying_before_it_records_a_resave_keeps_the_copy_it_replaces(server, tmp_path):
    """Step 2 is committed on both disks only (its upload never finished); a resumed job
    restores it and saves step 2 again, and node b's ranks die once that save is decided,
    before b records it. Node a has recorded the new save but must keep the one it
    replaces: that is the only copy of step 2 whole on the disks."""
    save(server, tmp_path, [1, 2])
    shutil.rmtree(tmp_path / "durable" / step_folder(2))
    res = launch(server, tmp_path, "nodes_save", "resave", TWO_BY_TWO, steps=[2], kill_step=2, kill="record",
                 victims=[2, 3], restore=True)
    for r in (0, 1):
        data = res.results("nodes_save", ranks=[r])[0]
        assert data["restored"] == 2 and data["saves"]["2"]["is_save_aborted"], data
    assert len(holdings(tmp_path, "a", 2)) == 2 and len(holdings(tmp_path, "b", 2)) == 1  # a: both saves
    shutil.rmtree(tmp_path / "durable" / step_folder(2), ignore_errors=True)  # what the restore uploaded
    res = restore(server, tmp_path, 2, name="restore-after-kill")
    assert any("passed over" in w for w in res[0]["warnings"]), res[0]["warnings"]  # the undecided half


def test_a_resave_of_the_restored_step_while_its_upload_runs(server, tmp_path):
    """Step 2 is on the local disks only; a resumed job restores it (and uploads it
    behind the restore) and at once saves step 2 again, replicated. The upload's
    clean-up never touches the newer save; in the end both tiers hold the new save
    alone, and it restores."""
    save(server, tmp_path, [1, 2], replicas=1)
    shutil.rmtree(tmp_path / "durable" / step_folder(2))
    res = save(server, tmp_path, [2], name="resave", restore=True, replicas=1)
    assert all(d["restored"] == 2 and d["saves"]["2"]["raised"] is None for d in res), res
    sid = safeckpt.protocol.checkpoint.read_committed(LocalStorage(str(tmp_path / "durable" / step_folder(2)))).save_id
    for node in "ab":
        assert list(holdings(tmp_path, node, 2)) == [sid], (node, holdings(tmp_path, node, 2))
        assert {p.name.split("-")[1] for p in (tmp_path / f"local-{node}" / step_folder(2)).glob("data-*")} == {sid}
    durable_exact(tmp_path, 2)
    shutil.rmtree(tmp_path / "durable")
    restore(server, tmp_path, 2, replicas=1)


def test_a_replica_that_fails_keeps_each_nodes_older_steps(server, tmp_path):
    """keep_local=1: node b dies storing node a's replica of step 2. Node a must not
    delete step 1, the last step whole on its disk alone: with node b and the durable
    root both lost, step 1 restores from node a's disk."""
    res = launch(server, tmp_path, "nodes_save", "save", TWO_BY_TWO, steps=[1, 2], kill_step=2, kill="peer",
                 victims=[2], replicas=1, keep_local=1)
    data = res.results("nodes_save", ranks=[0])[0]
    assert data["saves"]["2"]["is_save_aborted"], data
    assert holdings(tmp_path, "a", 1) and holdings(tmp_path, "a", 2)
    shutil.rmtree(tmp_path / "local-b")
    shutil.rmtree(tmp_path / "durable")
    restore(server, tmp_path, 1, name="restore-a-only", replicas=1, keep_local=1)


def test_a_replica_that_fails_on_a_durable_save_does_not_stop_local_retention(server, tmp_path):
    """keep_local=1: node b cannot store node a's replica of step 2 (nobody dies); step 2
    is durable all the same, so each node deletes step 1 (the disks do not fill up), and
    every rank is told the replica is incomplete."""
    res = launch(server, tmp_path, "nodes_save", "save", TWO_BY_TWO, steps=[1, 2], kill_step=2, kill="refuse-peer",
                 victims=[2], replicas=1, keep_local=1)
    for r, data in enumerate(res.results("nodes_save")):
        assert data["saves"]["2"]["is_save_aborted"] and "peer replica" in data["saves"]["2"]["message"], (r, data)
    assert committed(tmp_path / "durable") == [1, 2]
    durable_exact(tmp_path, 2)
    assert not (tmp_path / "local-a" / step_folder(1)).exists() and not (tmp_path / "local-b" / step_folder(1)).exists()
    restore(server, tmp_path, 2, replicas=1, keep_local=1)


def test_corrupt_local_copy_falls_back_to_the_durable_copy(server, tmp_path):
    save(server, tmp_path, [1, 2])
    victim = next((tmp_path / "local-a" / step_folder(2)).glob("data-*-r00000.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # a rotted byte in a tensor: the record still matches by size
    victim.write_bytes(bytes(data))
    res = restore(server, tmp_path, 2)
    for data in res:
        assert any("reading the durable copy" in w and "checksum" in w for w in data["warnings"]), data


@pytest.mark.slow
def test_durable_root_on_s3(server, moto_server, tmp_path):
    """The durable root on an S3 server (moto): every rank uploads its own files there,
    rank 0 the manifest last; a node's wiped disk restores from the peer, and the next
    save's upload lands beside."""
    url, options = f"s3://{s3_bucket(moto_server)}/run", moto_server.options
    remote = {"durable_url": url, "storage_options": options, "replicas": 1}
    save(server, tmp_path, [1], **remote)
    shutil.rmtree(tmp_path / "local-b")
    res = restore(server, tmp_path, 1, next=2, **remote)
    assert all(data["next"]["raised"] is None for data in res), res
    for step in (1, 2):
        folder = f"{url}/{step_folder(step)}"
        assert safeckpt.verify(folder, storage_options=options).ok
        got = safeckpt.load_state(folder, storage_options=options)
        assert torch.equal(got["m"], tw.mat_full(step)) and got["step"] == step
    assert not (tmp_path / "durable").exists()


@pytest.mark.slow
def test_sigkill_during_the_upload_to_s3(server, moto_server, tmp_path):
    """Node b's ranks die once their step-2 file is in the bucket, before rank 0 writes
    the durable manifest: the bucket holds no manifest of step 2, its step 1 restores,
    and with node b's disk lost too, node a's disk (its own files and b's replica)
    restores step 2 bit-exact; that job uploads step 2, which the killed one never did."""
    from safeckpt.protocol.checkpoint import read_committed
    from safeckpt.format.manifest import manifest_seq
    from safeckpt.storage import open as open_storage
    url, options = f"s3://{s3_bucket(moto_server)}/run", moto_server.options
    remote = {"durable_url": url, "storage_options": options, "replicas": 1}
    res = launch(server, tmp_path, "nodes_save", "save", TWO_BY_TWO, steps=[1, 2], kill_step=2, kill="durable",
                 victims=[2, 3], **remote)
    for r in (0, 1):
        data = res.results("nodes_save", ranks=[r])[0]
        assert data["saves"]["1"]["raised"] is None, data
        assert data["saves"]["2"]["is_save_aborted"], data["saves"]["2"]
    durable = open_storage(url, **options)
    step2 = durable.child(step_folder(2)).listdir()
    assert any(n.startswith("data-") for n in step2), step2  # the upload was under way ...
    assert not [n for n in step2 if manifest_seq(n) is not None], step2  # ... and never committed
    assert read_committed(durable.child(step_folder(1))).step == 1
    got = safeckpt.load_state(f"{url}/{step_folder(1)}", storage_options=options)
    assert torch.equal(got["m"], tw.mat_full(1)) and torch.equal(got["b"], tw.bias(1)) and got["step"] == 1
    shutil.rmtree(tmp_path / "local-b")
    restore(server, tmp_path, 2, name="restore-after-kill", **remote)
    assert safeckpt.verify(f"{url}/{step_folder(2)}", storage_options=options).ok
    got = safeckpt.load_state(f"{url}/{step_folder(2)}", storage_options=options)
    assert torch.equal(got["m"], tw.mat_full(2)) and got["step"] == 2


def test_unsupported_options_are_refused_before_anything_is_written(server, tmp_path):
    for r, data in enumerate(launch(server, tmp_path, "nodes_refused", "refused", TWO_BY_TWO)
                             .results("nodes_refused")):
        for name, res in data.items():
            assert res["raised"] == "ValueError", (r, name, res)
    assert not list(tmp_path.glob("local-*/step-*")) and not list(tmp_path.glob("durable/step-*"))


# -- foreign, misplaced and malformed records (issue 24) ---------------------------------


def test_another_roots_node_records_are_never_restored_uploaded_or_deleted(server, tmp_path):
    """Job X (durable root ``durable-x``) left steps 2 and 3 on the nodes' folders; job Y
    committed step 2 in its own durable root, then runs on the same node folders. Y
    restores its own step 2 (warned of X's records, never X's weights), uploads nothing
    of X's, saves steps 3 and 4 (step 3 beside X's records) and its retention
    (keep_local=1) deletes its own step 3, never X's records or files: X still restores
    its step 3 from the nodes' disks, bit for bit."""
    x = {"durable_url": str(tmp_path / "durable-x"), "salt": 1000}
    save(server, tmp_path, [2, 3], name="save-x", **x)
    x_held = {(n, s): holdings(tmp_path, n, s, home=tmp_path / "durable-x") for n in "ab" for s in (2, 3)}
    assert all(x_held.values()), x_held
    save(server, tmp_path, [2], name="save-y", local_of={"a": "ya", "b": "yb"})
    res = restore(server, tmp_path, 2, name="restore-y", then=[3, 4], keep_local=1)
    assert "ForeignRunWarning" in res[0]["categories"], res[0]["warnings"]
    assert any("durable-x" in w for w in res[0]["warnings"]), res[0]["warnings"]
    for r, data in enumerate(res):
        assert all(s["raised"] is None for s in data["then"].values()), (r, data["then"])
    assert committed(tmp_path / "durable") == [3, 4]
    for step in (3, 4):
        durable_exact(tmp_path, step)
    assert holdings(tmp_path, "a", 3) == {} and holdings(tmp_path, "a", 4)  # Y's own step 3 went
    for (n, s), held in x_held.items():  # X's records and files, untouched by Y's retention
        assert holdings(tmp_path, n, s, home=tmp_path / "durable-x") == held
    shutil.rmtree(tmp_path / "durable-x")
    restore(server, tmp_path, 3, name="restore-x", expect_salt=1000, **x)


def test_a_record_under_another_step_folder_counts_for_nothing(server, tmp_path):
    """Each node's step-2 folder copied to step-9: its records name step 2, not 9, and
    count for nothing (warned); step 3, whole on the nodes and durable, restores."""
    save(server, tmp_path, [2, 3])
    for node in "ab":
        shutil.copytree(tmp_path / f"local-{node}" / step_folder(2), tmp_path / f"local-{node}" / step_folder(9))
    res = restore(server, tmp_path, 3)
    assert any(step_folder(9) in w and "step 2" in w for w in res[0]["warnings"]), res[0]["warnings"]


def test_a_rotted_peer_replica_of_the_newest_step_falls_back_to_an_older_whole_step(server, tmp_path):
    """Node b and the durable root are lost; node a holds steps 1 and 2 whole (its own
    files and b's replica), but its replica of b's step-2 file rotted. Restoring step 2
    fails on every rank together; step 1, whole on node a, restores instead (warned)."""
    save(server, tmp_path, [1, 2], replicas=1)
    shutil.rmtree(tmp_path / "local-b")
    shutil.rmtree(tmp_path / "durable")
    victim = next((tmp_path / "local-a" / step_folder(2)).glob("data-*-r00002.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-50] ^= 0x10  # a tensor byte: the record still matches by size
    victim.write_bytes(bytes(data))
    res = restore(server, tmp_path, 1, replicas=1)
    assert any(step_folder(2) in w and "checksum" in w for w in res[0]["warnings"]), res[0]["warnings"]


# Crafted records (tests/helpers/nodes_dist_worker.py ``craft``): each is written into a
# node's folder in turn, every rank restores; the answer is always step 3, bit for bit.
BAD_VALUES = [None, True, -1, 1.5, 10 ** 30, 2 ** 63, 1e308, "12", "", [], {}, [1, 2], {"x": 1}, "x" * 300]
BAD_NAMES = ["../data-0-r00000.safetensors", "/etc/passwd", "", "a/b", "data-zz-r00000.safetensors",
             "holds-x.json", "step-000000003", "\n"]
NAMED_CASES = [  # the issue's own, then one per field
    {"node": "a", "step": 3, "name": "same", "mutation": {"kind": "key", "key": "files", "value": ["x"]}},
    {"node": "b", "step": 3, "name": "same", "mutation": {"kind": "drop", "key": "files"}},
    {"node": "a", "step": 3, "name": "same", "mutation": {"kind": "drop", "key": "manifest"}},
    {"node": "a", "step": 3, "name": "new", "mutation": {"kind": "key", "key": "manifest", "value": 7}},
    {"node": "b", "step": 3, "name": "same", "mutation": {"kind": "key", "key": "node", "value": [1]}},
    {"node": "a", "step": 3, "name": "same", "mutation": {"kind": "size", "value": 10 ** 30}},
    {"node": "a", "step": 3, "name": "same", "mutation": {"kind": "size", "value": 1e308}},
    {"node": "b", "step": 3, "name": "same", "mutation": {"kind": "size", "value": True}},
    {"node": "a", "step": 3, "name": "new", "mutation": {"kind": "name", "value": "../../step-000000002/x"}},
    {"node": "a", "step": 3, "name": "same", "mutation": {"kind": "body", "value": [1, 2]}},
    {"node": "b", "step": 3, "name": "same", "mutation": {"kind": "raw", "how": "truncated"}},
    {"node": "a", "step": 3, "name": "same", "mutation": {"kind": "raw", "how": "binary"}},
    {"node": "a", "step": 4, "name": "new", "mutation": {"kind": "copy"}},
    {"node": "b", "step": 9, "name": "same", "mutation": {"kind": "manifest", "field": "step", "value": 9}},
    {"node": "a", "step": 4, "name": "same", "mutation": {"kind": "manifest", "field": "step", "value": 4}},
    {"node": "a", "step": 3, "name": "new", "mutation": {"kind": "manifest", "field": "save_id", "value": "0" * 8}},
    {"node": "b", "step": 3, "name": "same", "mutation": {"kind": "manifest", "field": "durable_root", "value": "/x"}},
    {"node": "a", "step": 3, "name": "new", "mutation": {"kind": "other-node"}},
    {"node": "a", "step": 4, "name": "new", "mutation": {"kind": "other-node"}},
    {"node": "b", "step": 3, "name": "new", "mutation": {"kind": "key", "key": "node", "value": "c"}},
]


def run_cases(server, tmp_path, cases: list[dict], timeout: float = 90) -> None:
    res = launch(server, tmp_path, "nodes_crafted", "crafted", TWO_BY_TWO, cases=cases, expect=3, timeout=timeout)
    every = res.results("nodes_crafted")
    for i, case in enumerate(cases):
        for r, ranks in enumerate(every):
            data = ranks[i]
            assert data["restore"]["raised"] is None, (case, r, data["restore"])
            assert data["restored"] == 3 and data["problems"] == [], (case, r, data)


def test_malformed_records_count_for_nothing_on_every_rank(server, tmp_path):
    """Records with a valid checksum and a wrong shape (``files`` a list, keys missing,
    wrong types, huge numbers, ``..`` paths), torn ones, misplaced ones, another node's
    and another root's: each counts for nothing, every rank restores step 3 (whole on
    the nodes and durable) bit for bit, none raises or waits for another. So does a
    node whose folder cannot be read at all."""
    save(server, tmp_path, [2, 3])
    run_cases(server, tmp_path, NAMED_CASES)
    # a node whose folder cannot even be listed (EIO) holds nothing; its ranks read the durable copy
    res = restore(server, tmp_path, 3, unreadable="b")
    assert any("node b" in w and "Input/output error" in w for w in res[0]["warnings"]), res[0]["warnings"]


# Hypothesis draws the cases: every field of a record, and of the manifest it embeds,
# set to any JSON value (out of range, of the wrong type, huge, nested), the framing
# broken, valid records copied where they do not belong.
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
                    | st.sampled_from(BAD_VALUES), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
RECORD_KEYS = st.sampled_from(["files", "manifest", "node"])
MANIFEST_FIELDS = st.sampled_from(["step", "save_id", "seq", "world_size", "created", "durable_root", "run_id",
                                   "files", "tensors", "tree", "format_version", "block_size", "metadata"])
MUTATIONS = st.one_of(
    st.fixed_dictionaries({"kind": st.just("key"), "key": RECORD_KEYS, "value": JSON}),
    st.fixed_dictionaries({"kind": st.just("drop"), "key": RECORD_KEYS}),
    st.fixed_dictionaries({"kind": st.just("size"), "value": JSON | st.integers(-1, 1 << 20)}),
    st.fixed_dictionaries({"kind": st.just("name"), "value": st.sampled_from(BAD_NAMES) | st.text(max_size=40)}),
    st.fixed_dictionaries({"kind": st.just("body"), "value": JSON}),
    st.fixed_dictionaries({"kind": st.just("manifest"), "field": MANIFEST_FIELDS,
                           "value": JSON | st.sampled_from([1, 2, 4, 9])}),
    st.fixed_dictionaries({"kind": st.just("raw"), "how": st.sampled_from(
        ["bad-checksum", "no-checksum", "truncated", "extra-line", "empty", "not-json", "binary"])}),
    st.fixed_dictionaries({"kind": st.sampled_from(["copy", "other-node"])}),
)
CASES = st.fixed_dictionaries({"node": st.sampled_from("ab"), "step": st.sampled_from([3, 3, 4, 9, 1]),
                               "name": st.sampled_from(["same", "new"]), "mutation": MUTATIONS})
_DRAWN = dict(deadline=None, database=None, phases=[Phase.explicit, Phase.generate],  # no shrinking: a launch per try
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])


def drawn_cases(seed: int, count: int) -> list[dict]:
    """``count`` cases drawn at random (seeded) from the same kinds as ``CASES``: one
    launch must see many kinds, and a Hypothesis example that small starts minimal."""
    rnd = random.Random(seed)

    def value(depth: int = 0) -> object:
        makers = [lambda: rnd.choice(BAD_VALUES), lambda: rnd.choice([-(1 << 70), -1, 0, 7, 1 << 64, 10 ** 400]),
                  lambda: rnd.choice([float("nan"), float("inf"), -0.0, 1e-320, 1e308]),
                  lambda: rnd.choice(BAD_NAMES), lambda: rnd.random() < 0.5,
                  lambda: "".join(chr(rnd.randrange(1, 0x2FF)) for _ in range(rnd.randrange(30)))]
        if depth < 2:  # nested, two levels at most
            makers += [lambda: [value(depth + 1) for _ in range(rnd.randrange(4))],
                       lambda: {str(value(depth + 1))[:8]: value(depth + 1) for _ in range(rnd.randrange(4))}]
        return rnd.choice(makers)()

    fields = ["step", "save_id", "seq", "world_size", "created", "durable_root", "run_id", "files", "tensors",
              "tree", "format_version", "block_size", "metadata"]
    kinds = [
        lambda: {"kind": "key", "key": rnd.choice(["files", "manifest", "node"]), "value": value()},
        lambda: {"kind": "drop", "key": rnd.choice(["files", "manifest", "node"])},
        lambda: {"kind": "size", "value": rnd.choice([value(), rnd.randrange(-1, 1 << 20)])},
        lambda: {"kind": "name", "value": rnd.choice(BAD_NAMES + [str(value())[:40]])},
        lambda: {"kind": "body", "value": value()},
        lambda: {"kind": "manifest", "field": rnd.choice(fields), "value": rnd.choice([value(), 1, 2, 4, 9])},
        lambda: {"kind": "raw", "how": rnd.choice(["bad-checksum", "no-checksum", "truncated", "extra-line",
                                                   "empty", "not-json", "binary"])},
        lambda: {"kind": rnd.choice(["copy", "other-node"])},
    ]
    return [{"node": rnd.choice("ab"), "step": rnd.choice([3, 3, 3, 4, 9, 1]), "name": rnd.choice(["same", "new"]),
             "mutation": rnd.choice(kinds)()} for _ in range(count)]


def test_randomly_crafted_records_never_change_what_restores(server, tmp_path):
    save(server, tmp_path, [2, 3])
    run_cases(server, tmp_path, drawn_cases(seed=24, count=20))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(max_examples=6, **_DRAWN)
@given(cases=st.lists(CASES, min_size=60, max_size=60))
def test_randomly_crafted_records_never_change_what_restores_slow(server, tmp_path_factory, cases):
    root = tmp_path_factory.mktemp("crafted")
    save(server, root, [2, 3])
    run_cases(server, root, cases, timeout=600)


@pytest.fixture(scope="module")
def one_record(tmp_path_factory):
    """A node's folder of step 3: one data file and the valid own record of its save
    (for the durable root ``HOME``); the record's bytes."""
    import dataclasses
    from safeckpt.format.manifest import encode_manifest
    from safeckpt.run.nodes import write_record
    folder = tmp_path_factory.mktemp("node") / step_folder(3)
    safeckpt.save({"w": torch.arange(1000.0)}, str(folder), step=3)
    m = safeckpt.protocol.checkpoint.read_committed(LocalStorage(str(folder)))
    for manifest in folder.glob("manifest-*"):
        manifest.unlink()  # a node's folder holds records, never a manifest
    data = encode_manifest(dataclasses.replace(m, durable_root=HOME))
    write_record(LocalStorage(str(folder)), data, "a", {n: f.size for n, f in m.files.items()}, "own", m.save_id)
    record = next(folder.glob("holds-*"))
    return folder, record.read_bytes(), {n: f.size for n, f in m.files.items()}, m.save_id


HOME = "/durable"


@settings(max_examples=150, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutation=MUTATIONS, step=st.sampled_from([3, 3, 4]), same_name=st.booleans())
def test_a_crafted_record_never_raises_nor_makes_a_folder_hold_more(one_record, mutation, step, same_name):
    """Read in-process (hundreds of records a second): whatever a record holds, reading
    the folder never raises, and the folder never holds a file, size or save beyond
    what is truly there (the real save's data file)."""
    import nodes_dist_worker as nw
    from safeckpt.run.nodes import holdings, read_records
    folder, base, files, sid = one_record
    real = next(folder.glob("holds-*"))
    target = real if same_name else folder / real.name.replace("-own-", "-own0x-")
    target.write_bytes(nw.craft(base, mutation, base))
    try:
        held = holdings(read_records(LocalStorage(str(folder)), step), HOME)
    finally:
        if same_name:
            target.write_bytes(base)
        else:
            target.unlink()
    assert set(held) <= {sid}, held
    for h in held.values():
        assert h.files.items() <= files.items() and h.manifest.step == step == 3, (mutation, h)
