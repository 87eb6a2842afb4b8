"""Tiered saves on real gloo ranks, for tests/test_tiered.py.

Scenarios here are added to ``dist_worker.SCENARIOS`` (this module imports dist_worker
and reuses its worker loop, ``Ctx``, ``compare`` and ``caught``), and
``TieredForkServer`` starts *this* file as the fork server, so the ranks can run them.
Its server imports only torch and torch.distributed: a launch of 2 ranks costs a fork.

Both ranks of a launch share one local folder (one node) and one durable root. The
data are pure functions of (rank, step), shared with the test process, which judges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dist_worker as dw

HERE = Path(__file__).resolve()

ROWS = (64, 32)                   # float32 row-sharded matrix
ROWS2 = [(0, 40), (40, 64)]       # uneven row shards on 2 ranks
KEEP_LAST = 2


def mat_full(step: int):
    import torch
    return torch.arange(ROWS[0] * ROWS[1], dtype=torch.float32).reshape(ROWS) * 0.25 + 100 * step


def bias(step: int):
    import torch
    return torch.linspace(-1, 1, 17, dtype=torch.float64) * step


def rank_state(rank: int, world: int, step: int, *, empty: bool = False) -> dict:
    import torch
    from safeckpt.protocol.shards import Shard
    r0, r1 = ROWS2[rank] if world == 2 else (0, ROWS[0])
    m, b = mat_full(step)[r0:r1].clone(), bias(step)
    if empty:
        m, b = torch.full_like(m, -1), torch.full_like(b, -1)
    return {"m": Shard(m, ROWS, [r0, 0]), "b": b, "step": -1 if empty else step}


def rank_problems(state: dict, rank: int, world: int, step: int) -> list[str]:
    r0, r1 = ROWS2[rank] if world == 2 else (0, ROWS[0])
    return (dw.compare(state["m"].local_tensor, mat_full(step)[r0:r1], "m")
            + dw.compare(state["b"], bias(step), "b") + dw.compare(state["step"], step, "step"))


def _manager(ctx: dw.Ctx):
    import safeckpt
    return safeckpt.CheckpointManager(str(ctx.root / "durable"), local=str(ctx.root / "local"),
                                      keep_last=KEEP_LAST, keep_local=2)


def sc_tiered_save2(ctx: dw.Ctx) -> dict:
    """Save ``opts["steps"]`` on every rank through one tiered manager, waiting for the
    durable copy after each; then every step the manager lists loaded back by path, and
    a restore by a new manager (from the local tier)."""
    import safeckpt
    steps = ctx.opts.get("steps", [1])
    mgr = _manager(ctx)
    out: dict[str, Any] = {"saves": {}}
    for step in steps:
        res = dw.caught(lambda: mgr.save(step, rank_state(ctx.rank, ctx.world, step)))
        if res["raised"]:
            out["saves"][str(step)] = res
            ctx.stop = True  # the group is out of step: no more collectives
            return out
        mgr.wait()
        out["saves"][str(step)] = {"steps": mgr.steps()}
    ctx.barrier()
    out["loads"] = {}
    for step in mgr.steps():
        target = rank_state(ctx.rank, ctx.world, 0, empty=True)
        res = dw.caught(lambda: safeckpt.load(target, mgr.path(step)))
        out["loads"][str(step)] = res if res["raised"] else rank_problems(target, ctx.rank, ctx.world, step)
    mgr.close()
    fresh = _manager(ctx)
    target = rank_state(ctx.rank, ctx.world, 0, empty=True)
    out["restored"] = fresh.restore(target)
    out["restored_problems"] = rank_problems(target, ctx.rank, ctx.world, steps[-1])
    fresh.close()
    return out


def sc_tiered_resume2(ctx: dw.Ctx) -> dict:
    """On a node whose local folder is gone: restore (from the durable root), save
    ``opts["next"]``, wait for its durable copy."""
    mgr = _manager(ctx)
    target = rank_state(ctx.rank, ctx.world, 0, empty=True)
    out: dict[str, Any] = {"restored": mgr.restore(target)}
    out["restored_problems"] = rank_problems(target, ctx.rank, ctx.world, ctx.opts["expect"])
    nxt = ctx.opts["next"]
    mgr.save(nxt, rank_state(ctx.rank, ctx.world, nxt))
    mgr.wait()
    ctx.barrier()
    out["steps"] = mgr.steps()
    out["path"] = mgr.path(nxt)
    mgr.close()
    return out


dw.SCENARIOS.update({"tiered_save2": sc_tiered_save2, "tiered_resume2": sc_tiered_resume2})


class TieredForkServer(dw.ForkServer):
    """``dist_worker.ForkServer`` started on this file (so the ranks know the scenarios above)."""

    def __init__(self, src: str, env: dict | None = None) -> None:
        super().__init__(src, script=HERE, env=env)


if __name__ == "__main__":
    dw.extension_main()
