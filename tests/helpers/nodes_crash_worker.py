"""Crash points of the local tier on several nodes, for tests/test_crash_matrix.py.

Two simulated nodes (``SAFECKPT_NODE_ID``), one gloo rank each. A node's local folder
is a ``SimulatedDisk`` of the cell's profile inside that rank's process, kept between
launches as a pickle (``ROOT/disk-<node>.pickle``); the durable root is a real folder
both ranks share (``ROOT/durable``). The victim numbers its operations on its disk and
on the durable root in one sequence (``FaultyStorage(counter=disk.counter)``); at
operation k its power fails: the disk is cut with the cell's outcome
(``SimulatedDisk.crash``), kept, and the process SIGKILLed at once, its other threads
with it. The other node carries on until its collectives fail and keeps its disk as it
is (it did not lose power). The data are nodes_dist_worker's; the test judges.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import dist_worker as dw
from nodes_dist_worker import problems, rank_state

from safeckpt.testing.disk import SimulatedDisk
from safeckpt.testing.faults import OpCounter

HERE = Path(__file__).resolve()
NODES = ("a", "b")
MOUNT = "/node"  # the local folder on each node's simulated disk
MODES = {"kill": "keep", "drop": "drop"}  # a crash point's outcome -> SimulatedDisk.crash mode ("random" else)


def disk_file(root: Path, node: str) -> Path:
    return root / f"disk-{node}.pickle"


def load_disk(root: Path, node: str, profile: str) -> SimulatedDisk:
    """The node's disk as the last launch left it (a fresh one the first time, or wiped)."""
    path = disk_file(root, node)
    if path.exists():
        return pickle.loads(path.read_bytes())
    disk = SimulatedDisk(profile)
    disk.makedirs(MOUNT)
    return disk


def dump_disk(disk: SimulatedDisk, path: Path) -> None:
    disk.counter = OpCounter()  # an armed counter stays with this process
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(disk))
    os.replace(tmp, path)


def cut_power(disk: SimulatedDisk, outcome: str, seed: str) -> None:
    disk.crash(random.Random(seed), MODES.get(outcome, "random"))


class PowerCut(OpCounter):
    """The victim's counter: at the crash point its node loses power, at once."""

    def __init__(self, disk: SimulatedDisk, path: Path, outcome: str, seed: str) -> None:
        super().__init__()
        self.disk, self.path, self.outcome, self.seed = disk, path, outcome, seed

    def die(self, kind: str, path: str):
        super().die(kind, path)
        self.path.with_suffix(".crash").write_text(f"{self.ops} {kind} {path}")
        cut_power(self.disk, self.outcome, self.seed)
        dump_disk(self.disk, self.path)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)


def _manager(ctx: dw.Ctx, disk: SimulatedDisk, durable: Path, *, counted: bool = False):
    import safeckpt
    from safeckpt.storage import LocalStorage
    from safeckpt.testing import FaultyStorage
    root: Any = LocalStorage(str(durable))
    if counted:
        root = FaultyStorage(root, counter=disk.counter)
    return safeckpt.CheckpointManager(root, local=disk.storage(MOUNT), keep_last=1, keep_local=1,
                                      local_replicas=1)


def _node(ctx: dw.Ctx) -> str:
    node = NODES[ctx.rank]
    os.environ["SAFECKPT_NODE_ID"] = node
    return node


def sc_crash_setup(ctx: dw.Ctx) -> dict:
    """Fresh disks of ``opts["profile"]``: save step 1 (durable and replicated), keep the disks."""
    node = _node(ctx)
    disk = load_disk(ctx.root, node, ctx.opts["profile"])
    mgr = _manager(ctx, disk, ctx.root / "durable")
    mgr.save(1, rank_state(ctx.rank, ctx.world, 1))
    mgr.close()
    dump_disk(disk, disk_file(ctx.root, node))
    return {}


def sc_crash_save(ctx: dw.Ctx) -> dict:
    """A resumed job restores step 1, then saves step 2 (replica, upload, retention on
    both tiers) and closes. The victim ``opts["victim"]`` loses power at its operation
    ``opts["k"]`` of that save (none: the probe run, which reports every operation), or
    right after it returned."""
    node = _node(ctx)
    path = disk_file(ctx.root, node)
    disk = load_disk(ctx.root, node, ctx.opts["profile"])
    victim = node == ctx.opts["victim"]
    seed = f"{ctx.opts['profile']}:{ctx.opts['victim']}:{ctx.opts.get('k')}:{ctx.opts['outcome']}"
    if victim:
        disk.counter = PowerCut(disk, path, ctx.opts["outcome"], seed)
    mgr = _manager(ctx, disk, ctx.root / "durable", counted=victim)
    out: dict[str, Any] = {"restored": mgr.restore(rank_state(ctx.rank, ctx.world, 0, empty=True))}
    disk.counter.ops, disk.counter.log = 0, []
    if victim:
        disk.counter.crash_after = ctx.opts.get("k")
    out["save"] = dw.caught(lambda: (mgr.save(2, rank_state(ctx.rank, ctx.world, 2)), mgr.wait()))
    out["close"] = dw.caught(mgr.close)
    out["ops"], out["log"] = disk.counter.ops, disk.counter.log
    if victim:
        cut_power(disk, ctx.opts["outcome"], seed)
    dump_disk(disk, path)
    ctx.stop = out["save"]["raised"] is not None  # the other node is gone
    return out


def sc_crash_recover(ctx: dw.Ctx) -> dict:
    """After a crash: a job with ``opts["wipe"]``'s disk replaced by an empty one restores
    (on copies of the disks; the durable root as the crash left it), so does one that
    lost the durable root as well (the other node's disk alone), then a job on the
    disks as they are restores and saves step 3 (its disks kept). Each job runs on the
    durable root's own path (node-local records belong to the durable root of that
    URL): rank 0 keeps the crash's durable root aside and puts back a copy, or nothing,
    before each. Each reports the step it restored and how the state differs from
    that step's."""
    node = _node(ctx)
    disk = load_disk(ctx.root, node, ctx.opts["profile"])
    durable, kept = ctx.root / "durable", ctx.root / "durable-after-crash"
    out: dict[str, Any] = {}

    def wiped() -> SimulatedDisk:
        return load_disk(ctx.root / "none", node, ctx.opts["profile"]) if node == ctx.opts["wipe"] else disk.clone()

    for name, run_disk, with_durable in (("wiped", wiped(), True), ("alone", wiped(), False), ("same", disk, True)):
        if ctx.rank == 0:
            if not kept.exists():
                shutil.move(durable, kept)
            shutil.rmtree(durable, ignore_errors=True)
            if with_durable:
                shutil.copytree(kept, durable)
        ctx.barrier()
        target = rank_state(ctx.rank, ctx.world, 0, empty=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr = _manager(ctx, run_disk, durable)
            res = dw.caught(lambda: mgr.restore(target))
            step = int(res["value"]) if res["raised"] is None and res["value"] != "None" else None
            out[name] = {"restore": res, "restored": step,
                         "problems": problems(target, ctx.rank, ctx.world, step) if step else []}
            if name == "same":
                out[name]["next"] = dw.caught(lambda: (mgr.save(3, rank_state(ctx.rank, ctx.world, 3)), mgr.wait()))
            out[name]["close"] = dw.caught(mgr.close)
        ctx.barrier()  # every rank's background upload is done before rank 0 moves the root
    dump_disk(disk, disk_file(ctx.root, node))
    return out


dw.SCENARIOS.update({"crash_setup": sc_crash_setup, "crash_save": sc_crash_save, "crash_recover": sc_crash_recover})


class NodesCrashForkServer(dw.ForkServer):
    """``dist_worker.ForkServer`` started on this file (so the ranks know the scenarios above)."""

    def __init__(self, src: str, env: dict | None = None) -> None:
        super().__init__(src, script=HERE, env=env)


if __name__ == "__main__":
    dw.extension_main()
