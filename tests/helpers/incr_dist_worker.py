"""Incremental saves on real gloo ranks, for tests/test_incremental.py.

Scenarios here are added to ``dist_worker.SCENARIOS`` (this module imports
dist_worker and reuses its worker loop, ``Ctx``, ``compare`` and ``caught``), and
``IncrForkServer`` starts *this* file as the fork server, so the ranks can run them.
Its server imports only torch and torch.distributed (no DTensor, no dynamo): a launch
of 2 ranks then costs a fork, about a second.

The data are pure functions of (rank, step), shared with the test process, which
judges: what each save wrote, and that every kept checkpoint loads exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import dist_worker as dw

HERE = Path(__file__).resolve()

CHUNK = 4096                      # bytes: small chunks for small tensors
EMB_SHAPE = (256, 64)             # float32: 64 KiB, 1 row = 256 bytes, a chunk = 16 rows
FROZEN_SHAPE = (128, 128)         # float32: 64 KiB replicated, never changes
ROWS2 = [(0, 128), (128, 256)]    # the embedding's row shards on 2 ranks
# rows of the embedding changed at each step (step 1 is the first save)
CHANGED = {1: [], 2: [200], 3: [5, 6, 250]}
STEPS = (1, 2, 3)
KEEP_LAST = 2


def emb_full(step: int):
    """The embedding table at ``step``: rows listed in CHANGED up to ``step`` moved."""
    import torch
    t = torch.arange(EMB_SHAPE[0] * EMB_SHAPE[1], dtype=torch.float32).reshape(EMB_SHAPE) / 7
    for s in range(2, step + 1):
        for row in CHANGED[s]:
            t[row] += 1000 * s
    return t


def frozen_full():
    import torch
    return torch.randn(FROZEN_SHAPE, generator=torch.Generator().manual_seed(11))


def touched_chunks(step: int) -> int:
    """Embedding chunks (16 rows each) that differ from the previous step."""
    return len({row // (CHUNK // (EMB_SHAPE[1] * 4)) for row in CHANGED[step]})


def rank_state(rank: int, world: int, step: int, *, empty: bool = False) -> dict:
    import torch

    from safeckpt.protocol.shards import Shard
    rows = ROWS2 if world == 2 else [(0, EMB_SHAPE[0])]
    r0, r1 = rows[rank]
    emb = emb_full(step)[r0:r1].clone()
    frozen = frozen_full()
    if empty:
        emb, frozen = torch.full_like(emb, -1), torch.full_like(frozen, -1)
    return {"emb": Shard(emb, EMB_SHAPE, [r0, 0]), "frozen": frozen, "step": -1 if empty else step}


def rank_problems(state: dict, rank: int, world: int, step: int) -> list[str]:
    rows = ROWS2 if world == 2 else [(0, EMB_SHAPE[0])]
    r0, r1 = rows[rank]
    return (dw.compare(state["emb"].local_tensor, emb_full(step)[r0:r1], "emb")
            + dw.compare(state["frozen"], frozen_full(), "frozen")
            + dw.compare(state["step"], step, "step"))


def sc_incr_save2(ctx: dw.Ctx) -> dict:
    """Three incremental saves on every rank (keep_last=2), then every kept step loaded
    back on all ranks by path, and a restore by a new manager."""
    import safeckpt
    root = ctx.root / "incr2"
    mgr = safeckpt.CheckpointManager(str(root), keep_last=KEEP_LAST, incremental=True, chunk_size=CHUNK)
    out: dict[str, Any] = {"saves": {}}
    for step in STEPS:
        info = mgr.save(step, rank_state(ctx.rank, ctx.world, step))
        out["saves"][str(step)] = {"bytes": info.bytes, "shared_bytes": info.shared_bytes,
                                   "files": sorted(info.files), "steps": mgr.steps()}
    ctx.barrier()
    out["listing"] = dw.listing(root)
    out["loads"] = {}
    for step in mgr.steps():
        target = rank_state(ctx.rank, ctx.world, 0, empty=True)
        res = dw.caught(lambda t=target, s=step: safeckpt.load(t, mgr.path(s)))
        out["loads"][str(step)] = res if res["raised"] else rank_problems(target, ctx.rank, ctx.world, step)
    mgr.close()
    fresh = safeckpt.CheckpointManager(str(root), keep_last=KEEP_LAST, incremental=True, chunk_size=CHUNK)
    target = rank_state(ctx.rank, ctx.world, 0, empty=True)
    out["restored"] = fresh.restore(target)
    out["restored_problems"] = rank_problems(target, ctx.rank, ctx.world, STEPS[-1])
    fresh.close()
    return out


def sc_incr_load2(ctx: dw.Ctx) -> dict:
    """Load every committed step of the module's root on this launch's ranks."""
    import safeckpt
    root = ctx.root / "incr2"
    mgr = safeckpt.CheckpointManager(str(root))
    out = {}
    for step in mgr.steps():
        target = rank_state(ctx.rank, ctx.world, 0, empty=True)
        res = dw.caught(lambda t=target, s=step: safeckpt.load(t, mgr.path(s)))
        out[str(step)] = res if res["raised"] else rank_problems(target, ctx.rank, ctx.world, step)
    return out


dw.SCENARIOS.update({"incr_save2": sc_incr_save2, "incr_load2": sc_incr_load2})


class IncrForkServer(dw.ForkServer):
    """``dist_worker.ForkServer`` started on this file (so the ranks know the scenarios above)."""

    def __init__(self, src: str) -> None:
        super().__init__(src, script=HERE)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        dw.serve(heavy=False)
        sys.exit(0)
    sys.exit(dw.main())
