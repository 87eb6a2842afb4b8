"""The local tier on several nodes, no shared filesystem between them.

Nodes are simulated on one machine: real gloo ranks grouped by ``SAFECKPT_NODE_ID``
(the test hook that overrides the host name), each node with a local folder of its
own (``local-a``, ``local-b``) and one durable root shared by all
(tests/helpers/nodes_dist_worker.py). The ranks of one node see only their node's
folder; nothing is mocked, kills are real SIGKILLs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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


def launch(server, tmp_path: Path, scenario: str, name: str, nodes: list[str], **opts):
    res = server.launch(len(nodes), [scenario], tmp_path, tmp_path / name, timeout=90, env=ENV,
                        opts={"nodes": nodes, **opts})
    return res


def holdings(tmp_path: Path, node: str, step: int) -> dict:
    """save id -> files the node's folder holds of that save (under a valid record)."""
    folder = LocalStorage(str(tmp_path / f"local-{node}" / step_folder(step)))
    return {sid: sorted(h.files) for sid, h in read_holdings(folder).items()}


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
