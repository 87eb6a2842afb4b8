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


def rank_state(rank: int, world: int, step: int, *, empty: bool = False) -> dict:
    import torch
    from safeckpt.protocol.shards import Shard
    r0, r1 = rows(rank, world)
    m, b = mat_full(step)[r0:r1].clone(), bias(step)
    if empty:
        m, b = torch.full_like(m, -1), torch.full_like(b, -1)
    return {"m": Shard(m, ROWS, [r0, 0]), "b": b, "step": -1 if empty else step}


def problems(state: dict, rank: int, world: int, step: int) -> list[str]:
    r0, r1 = rows(rank, world)
    return (dw.compare(state["m"].local_tensor, mat_full(step)[r0:r1], "m")
            + dw.compare(state["b"], bias(step), "b") + dw.compare(state["step"], step, "step"))


ARMED: list[str] = []  # "local", "durable", "peer", "record": SIGKILL this rank there; "refuse-peer"


def _killer(url: "str | Path", where: str, mine: set[int] = frozenset(), options: dict | None = None):
    """``url`` (a folder, or an S3 test server's URL with its ``options``) as a storage
    that SIGKILLs this process once a data file is completely written and fsynced
    there, while ``where`` is in ``ARMED``; "peer" (on a local
    folder): once a data file of a rank not in ``mine`` (another node's) is stored
    there; "record" (on a local folder): just before the node records its own files of
    a decided save. "refuse-peer": storing another node's file fails (EACCES), nobody
    dies. Children stay wrapped."""
    import signal
    import time
    from safeckpt.protocol.commit import DATA_RE
    from safeckpt.storage import open as open_storage
    from safeckpt.storage.base import StorageWrapper

    class KillAfterData(StorageWrapper):
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
        out["saves"][str(step)] = dw.caught(lambda s=step: (mgr.save(s, rank_state(ctx.rank, ctx.world, s)),
                                                             mgr.wait()))
        if killing:
            ctx.stop = True  # a node is gone: no more collectives in this launch
            return out
    out["steps"] = mgr.steps()
    mgr.close()
    return out


def sc_nodes_restore(ctx: dw.Ctx) -> dict:
    """A fresh job restores; reports what it got and whether it matches ``opts["expect"]``."""
    mgr = _manager(ctx)
    target = rank_state(ctx.rank, ctx.world, 0, empty=True)
    got: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = dw.caught(lambda: got.update(step=mgr.restore(target)))
    out: dict[str, Any] = {"restore": res, "restored": got.get("step"), "warnings": [str(w.message) for w in seen]}
    out["problems"] = problems(target, ctx.rank, ctx.world, ctx.opts["expect"])
    nxt = ctx.opts.get("next")
    if nxt is not None:
        out["next"] = dw.caught(lambda: (mgr.save(nxt, rank_state(ctx.rank, ctx.world, nxt)), mgr.wait()))
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


dw.SCENARIOS.update({"nodes_save": sc_nodes_save, "nodes_restore": sc_nodes_restore,
                     "nodes_refused": sc_nodes_refused})


class NodesForkServer(dw.ForkServer):
    """``dist_worker.ForkServer`` started on this file (so the ranks know the scenarios above)."""

    def __init__(self, src: str, env: dict | None = None) -> None:
        super().__init__(src, script=HERE, env=env)


if __name__ == "__main__":
    dw.extension_main()
