"""Simulated nodes on real gloo ranks, for tests/test_multinode.py.

``opts["nodes"]`` names each rank's node (``SAFECKPT_NODE_ID``, the test hook that
overrides the host name); a node's ranks share ``ROOT/local-<node>`` and nothing else
(``opts["local_of"]`` maps a node to another node's folder: nodes sharing one),
every rank shares ``ROOT/durable`` (or ``opts["durable_url"]``, an S3 test server). Scenarios are added to ``dist_worker.SCENARIOS``
and ``NodesForkServer`` starts this file as the fork server. The data are pure
functions of (rank layout, step); the workers observe, the test judges.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import dist_worker as dw
from tiered_dist_worker import ROWS, bias, mat_full

HERE = Path(__file__).resolve()


def rows(rank: int, world: int) -> tuple[int, int]:
    """Uneven row shards of the matrix: 2 ranks 40/24, 4 ranks 10/20/14/20, 3 ranks 30/4/30."""
    cuts = {1: [0, 64], 2: [0, 40, 64], 3: [0, 30, 34, 64], 4: [0, 10, 30, 44, 64]}[world]
    return cuts[rank], cuts[rank + 1]


def rank_state(rank: int, world: int, step: int, *, empty: bool = False, salt: int = 0) -> dict:
    """``salt`` tells jobs apart: two jobs' checkpoints of one step hold other values."""
    import torch
    from safeckpt.protocol.shards import Shard
    r0, r1 = rows(rank, world)
    m, b = mat_full(step)[r0:r1] + salt, bias(step) + salt
    if empty:
        m, b = torch.full_like(m, -1), torch.full_like(b, -1)
    return {"m": Shard(m, ROWS, [r0, 0]), "b": b, "step": -1 if empty else step}


def problems(state: dict, rank: int, world: int, step: int, salt: int = 0) -> list[str]:
    r0, r1 = rows(rank, world)
    return (dw.compare(state["m"].local_tensor, mat_full(step)[r0:r1] + salt, "m")
            + dw.compare(state["b"], bias(step) + salt, "b") + dw.compare(state["step"], step, "step"))


ARMED: list[str] = []  # "local", "durable", "peer", "record": SIGKILL this rank there; "refuse-peer", "unreadable"


def _killer(url: "str | Path", where: str, mine: set[int] = frozenset(), options: dict | None = None):
    """``url`` (a folder, or an S3 test server's URL with its ``options``) as a storage
    that SIGKILLs this process once a data file is completely written and fsynced
    there, while ``where`` is in ``ARMED``; "peer" (on a local
    folder): once a data file of a rank not in ``mine`` (another node's) is stored
    there; "record" (on a local folder): just before the node records its own files of
    a decided save. "refuse-peer": storing another node's file fails (EACCES), nobody
    dies. "unreadable": listing the local folder (or one in it) fails (EIO). Children
    stay wrapped."""
    import errno
    import signal
    import time
    from safeckpt.protocol.commit import DATA_RE
    from safeckpt.storage import open as open_storage
    from safeckpt.storage.base import StorageWrapper

    class KillAfterData(StorageWrapper):
        def listdir(self):
            if where == "local" and "unreadable" in ARMED:
                raise OSError(errno.EIO, "Input/output error (test)", self.url)
            return self.inner.listdir()

        def write_file(self, name, parts):
            if where == "local" and "record" in ARMED and name.startswith("holds-") and "-own-" in name:
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            found = DATA_RE.fullmatch(name)
            if where == "local" and "refuse-peer" in ARMED and found and int(found.group(2)) not in mine:
                raise PermissionError(13, "refused (test)", name)
            size = self.inner.write_file(name, parts)
            peer = found and where == "local" and "peer" in ARMED and int(found.group(2)) not in mine
            if found and (where in ARMED or peer):
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            return size

    return KillAfterData(open_storage(str(url), **(options or {})))


def _manager(ctx: dw.Ctx):
    import safeckpt
    node = ctx.opts["nodes"][ctx.rank]
    os.environ["SAFECKPT_NODE_ID"] = node
    return safeckpt.CheckpointManager(
        _killer(ctx.opts.get("durable_url") or ctx.root / "durable", "durable",
                options=ctx.opts.get("storage_options")),
        local=_killer(ctx.root / f"local-{ctx.opts.get('local_of', {}).get(node, node)}", "local", {r for r, n in enumerate(ctx.opts["nodes"]) if n == node}),
        keep_last=ctx.opts.get("keep_last", 2), keep_local=ctx.opts.get("keep_local", 2), local_replicas=ctx.opts.get("replicas", 0),
        async_save=ctx.opts.get("async_save", False))


def sc_nodes_save(ctx: dw.Ctx) -> dict:
    """Save ``opts["steps"]``, waiting for each to be durable (after a restore with
    ``opts["restore"]``); ranks in ``opts["victims"]`` are SIGKILLed during the save of
    ``opts["kill_step"]`` once their data file is written to ``opts["kill"]`` ("local":
    their node's disk, before the commit decision; "durable": the upload after it;
    "peer": once they store another node's file, the peer replica after the decision;
    "record": when their node is to record the decided save, before it does;
    "refuse-peer": their node cannot store the peer replica, and lives)."""
    out: dict[str, Any] = {"saves": {}}
    mgr = _manager(ctx)
    if ctx.opts.get("restore"):
        out["restored"] = mgr.restore(rank_state(ctx.rank, ctx.world, 0, empty=True))
    for step in ctx.opts["steps"]:
        killing = step == ctx.opts.get("kill_step")
        if killing and ctx.rank in ctx.opts.get("victims", []):
            ARMED.append(ctx.opts["kill"])
        out["saves"][str(step)] = _save_and_wait(ctx, mgr, step)
        if killing:
            ctx.stop = True  # a node is gone: no more collectives in this launch
            return out
    out["steps"] = mgr.steps()
    mgr.close()
    return out


def _save_and_wait(ctx: dw.Ctx, mgr: Any, step: int) -> dict:
    return dw.caught(lambda: (mgr.save(step, rank_state(ctx.rank, ctx.world, step, salt=ctx.opts.get("salt", 0))),
                              mgr.wait()))


def _restore(ctx: dw.Ctx, mgr: Any, expect: int) -> dict:
    """``mgr.restore`` into an empty state: what it returned, raised and warned (with
    the warning's class), and how the state differs from step ``expect``."""
    target = rank_state(ctx.rank, ctx.world, 0, empty=True)
    got: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = dw.caught(lambda: got.update(step=mgr.restore(target)))
    return {"restore": res, "restored": got.get("step"), "warnings": [str(w.message) for w in seen],
            "categories": [w.category.__name__ for w in seen],
            "problems": problems(target, ctx.rank, ctx.world, expect, ctx.opts.get("expect_salt", 0))}


def sc_nodes_restore(ctx: dw.Ctx) -> dict:
    """A fresh job restores (node ``opts["unreadable"]``'s folder failing to list
    meanwhile); reports what it got and whether it matches ``opts["expect"]``
    (salted by ``opts["expect_salt"]``); then saves ``opts["next"]`` and each of
    ``opts["then"]`` (salted by ``opts["salt"]``), waiting for each to be durable."""
    mgr = _manager(ctx)
    if ctx.opts["nodes"][ctx.rank] == ctx.opts.get("unreadable"):
        ARMED.append("unreadable")  # its folder cannot be listed while the job restores
    out = _restore(ctx, mgr, ctx.opts["expect"])
    ARMED.clear()
    nxt = ctx.opts.get("next")
    if nxt is not None:
        out["next"] = _save_and_wait(ctx, mgr, nxt)
    out["then"] = {str(s): _save_and_wait(ctx, mgr, s) for s in ctx.opts.get("then", [])}
    mgr.close()
    return out


def sc_nodes_refused(ctx: dw.Ctx) -> dict:
    """What is not supported on several nodes is refused on every rank before any write."""
    import safeckpt
    import torch.distributed as dist
    os.environ["SAFECKPT_NODE_ID"] = ctx.opts["nodes"][ctx.rank]
    local, durable = str(ctx.root / f"local-{ctx.opts['nodes'][ctx.rank]}"), str(ctx.root / "durable")
    out = {}
    for name, kw in {"incremental": {"incremental": True}, "process_group": {"process_group": dist.group.WORLD},
                     "replicas": {"local_replicas": 2}}.items():
        def attempt(kw=kw):
            with safeckpt.CheckpointManager(durable, local=local, **kw) as mgr:
                mgr.save(1, rank_state(ctx.rank, ctx.world, 1))
        out[name] = dw.caught(attempt)
    return out


# -- crafted holding records -----------------------------------------------------------
# A case (plain JSON, drawn by the test): {"node": "a", "step": 3, "name": "same" | "new",
# "mutation": {...}}. The node's own record of step 3 is the base; the mutation changes
# it (see ``craft``); the result goes into that node's ``step-<step>`` folder, under the
# base record's own name ("same": the real record is replaced) or a new one.


def _own_record(folder: Path) -> Path:
    return next(p for p in sorted(folder.glob("holds-*-own-*.json")))


def _reframe(manifest: str, field_: str, value: Any) -> str:
    """The embedded manifest with one field of its body changed, framed and
    checksummed anew (so only its content, never its frame, is wrong)."""
    import json
    from safeckpt.format.manifest import frame
    raw = manifest.encode()[len(b'{"safeckpt":'):-len(b',"checksum":"xxh3_64:0123456789abcdef"}\n')]
    body = json.loads(raw)
    body[field_] = value
    return frame(json.dumps(body, separators=(",", ":")).encode()).decode()


def craft(record: bytes, mutation: dict, other: bytes) -> bytes:
    """The bytes of a record file made from a valid ``record`` by ``mutation`` (``other``:
    a valid record of another node). Every mutated payload gets a valid checksum line,
    except where the mutation is about the framing itself."""
    import json
    from safeckpt.format.checksum import checksum
    kind = mutation["kind"]
    if kind == "other-node":
        return other
    if kind == "copy":
        return record
    if kind == "raw":
        payload = record.split(b"\n")[0]
        return {"bad-checksum": payload + b"\n" + checksum(payload + b" ").encode() + b"\n",
                "no-checksum": payload + b"\n",
                "truncated": record[:len(record) // 2],
                "extra-line": record + b"more\n",
                "empty": b"",
                "not-json": b"{not json\n" + checksum(b"{not json").encode() + b"\n",
                "binary": bytes(range(256))}[mutation["how"]]
    body = json.loads(record.split(b"\n")[0])
    first = sorted(body["files"])[0]
    if kind == "key":
        body[mutation["key"]] = mutation["value"]
    elif kind == "drop":
        del body[mutation["key"]]
    elif kind == "size":
        body["files"][first] = mutation["value"]
    elif kind == "name":
        body["files"][mutation["value"]] = body["files"].pop(first)
    elif kind == "body":
        body = mutation["value"]
    elif kind == "manifest":
        body["manifest"] = _reframe(body["manifest"], mutation["field"], mutation["value"])
    else:
        raise ValueError(f"unknown mutation {mutation!r}")
    payload = json.dumps(body, sort_keys=True).encode()
    return payload + b"\n" + checksum(payload).encode() + b"\n"


def apply_case(root: Path, case: dict, index: int, nodes: list[str]) -> Any:
    """Write one case's crafted record (and, for "copy", the node's step-3 data beside
    it); returns what puts the node's folder back as it was (whatever the restore
    wrote there included)."""
    import shutil
    from safeckpt.format.names import step_folder
    local = root / f"local-{case['node']}"
    base = _own_record(local / step_folder(3))
    other_node = next(n for n in nodes if n != case["node"])
    other = _own_record(root / f"local-{other_node}" / step_folder(3)).read_bytes()
    before = {p: p.read_bytes() for p in local.rglob("*") if p.is_file()}
    folder = local / step_folder(case["step"])
    folder.mkdir(exist_ok=True)
    name = base.name if case["name"] == "same" else base.name.replace("-own-", f"-own{index}x-")
    (folder / name).write_bytes(craft(base.read_bytes(), case["mutation"], other))
    if case["mutation"]["kind"] == "copy" and case["step"] != 3:
        for f in (local / step_folder(3)).glob("data-*"):
            shutil.copyfile(f, folder / f.name)

    def undo() -> None:
        for p in sorted(local.rglob("*"), reverse=True):
            if p.is_file() and p not in before:
                p.unlink()
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        for p, data in before.items():
            if not p.exists() or p.read_bytes() != data:
                p.parent.mkdir(exist_ok=True)
                p.write_bytes(data)
    return undo


def sc_nodes_crafted(ctx: dw.Ctx) -> list:
    """For each of ``opts["cases"]``: the first rank of the case's node writes the
    crafted record, then every rank restores in a fresh manager (expecting step
    ``opts["expect"]``), then the node's folder is put back."""
    out = []
    for i, case in enumerate(ctx.opts["cases"]):
        mine = ctx.rank == ctx.opts["nodes"].index(case["node"])
        undo = apply_case(ctx.root, case, i, ctx.opts["nodes"]) if mine else None
        ctx.barrier()
        mgr = _manager(ctx)
        out.append(_restore(ctx, mgr, ctx.opts["expect"]))
        mgr.close()
        ctx.barrier()
        if undo is not None:
            undo()
        ctx.barrier()
    return out


dw.SCENARIOS.update({"nodes_save": sc_nodes_save, "nodes_restore": sc_nodes_restore,
                     "nodes_refused": sc_nodes_refused, "nodes_crafted": sc_nodes_crafted})


class NodesForkServer(dw.ForkServer):
    """``dist_worker.ForkServer`` started on this file (so the ranks know the scenarios above)."""

    def __init__(self, src: str, env: dict | None = None) -> None:
        super().__init__(src, script=HERE, env=env)


if __name__ == "__main__":
    dw.extension_main()
