"""Data-parallel training under torchrun that checkpoints with safeckpt and resumes on
another number of processes (CPU, gloo).

    .venv/bin/torchrun --nproc-per-node 2 examples/torchrun_ddp.py --steps 20 --dir /tmp/ddp-run
    .venv/bin/torchrun --nproc-per-node 3 examples/torchrun_ddp.py --steps 40 --dir /tmp/ddp-run

The first command trains 20 steps on 2 processes, saving every 5 steps with a
``CheckpointManager``. The second finds step 20, resumes from it on 3 processes and
trains on to step 40. Kill either at any moment and rerun it: it resumes from the
newest committed checkpoint (a save cut short is never loaded).

What the checkpoint holds, and how each part follows a change of world size:

- ``model``, ``optim``: DDP keeps them identical on every rank (replicated), so
  safeckpt writes each tensor once in total, the writes spread over the ranks, and any
  number of ranks loads them.
- ``progress``: the step and the number of samples the whole job has consumed. Plain
  values, equal on every rank.
- ``per_rank``: ``RankLocal`` values, saved by each rank and given back to the same
  rank: the number of samples this rank consumed and its RNG state.

The data order is defined globally: batch ``b`` of an epoch is a fixed slice of a
per-epoch shuffle, of ``GLOBAL_BATCH`` samples whatever the world size, and rank ``r``
of ``W`` takes every ``W``-th sample of it. With DDP's gradient averaging the update is
then the same on 2 or 3 ranks, which is what lets a job move to another world size
mid-run (up to float summation order; this model draws no random numbers while
training, so the runs are even comparable number for number).

Resuming on another world size: the per-rank values have no owner (which of 3 ranks
should get rank 1-of-2's position?). A strict restore refuses with
``StateMismatchError``, having changed nothing. We choose to then restore with
``strict=False``, which loads everything that matches (model, optimizer, progress)
and leaves the per-rank values as they are, and re-derive them from the global
sample counter (the RNG is reseeded from the step and the rank). We do that only when
the strict attempt's sole complaint is ``per_rank``, so a real mismatch (a changed
model) still stops the job. Restoring with ``strict=False`` always would be simpler
but would turn a changed model into a warning; saving no per-rank values at all works
here too (they can all be derived), but real loaders and augmentation pipelines carry
per-rank state that cannot.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import safeckpt

N_SAMPLES, DIM, CLASSES = 480, 16, 4
GLOBAL_BATCH = 24            # divisible by 1, 2, 3, 4, 6, 8: any of those world sizes works
SEED = 1234


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(N_SAMPLES, DIM, generator=g)
    y = (x @ torch.randn(DIM, CLASSES, generator=g)).argmax(dim=1)
    return x, y


def global_batch(samples_seen: int) -> torch.Tensor:
    """The samples of the next global batch: a slice of a per-epoch shuffle."""
    epoch, offset = divmod(samples_seen, N_SAMPLES)
    perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
    return perm[offset:offset + GLOBAL_BATCH]


def fresh_per_rank(samples_seen: int, step: int, rank: int, world: int) -> dict:
    """This rank's part of the position, derived from the global counter."""
    torch.manual_seed(SEED + 1000 * step + rank)
    return {"local_samples": samples_seen // world, "rng": torch.get_rng_state()}


def restore(mgr: safeckpt.CheckpointManager, state: dict) -> tuple[int | None, bool]:
    """(restored step or None, whether the per-rank values must be re-derived)."""
    try:
        return mgr.restore(state), False
    except safeckpt.StateMismatchError as exc:
        if not exc.keys or set(exc.keys) != {"per_rank"}:
            raise  # the model or optimizer does not match: never paper over that
    with warnings.catch_warnings():  # we know what strict=False leaves out: per_rank
        warnings.simplefilter("ignore")
        return mgr.restore(state, strict=False), True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/safeckpt-ddp-run", help="the run's checkpoint root")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        raise SystemExit(f"the global batch of {GLOBAL_BATCH} does not split over {world} ranks")

    torch.manual_seed(SEED)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, CLASSES))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = make_data()

    progress = {"step": 0, "samples": 0}
    per_rank = safeckpt.RankLocal(fresh_per_rank(0, 0, rank, world))
    state = {"model": model, "optim": opt, "progress": progress, "per_rank": per_rank}

    mgr = safeckpt.CheckpointManager(args.dir, keep_last=3)
    step, rederive = restore(mgr, state)
    if step is not None:
        if rederive:
            per_rank.value = fresh_per_rank(progress["samples"], progress["step"], rank, world)
        else:
            assert per_rank.value["local_samples"] == progress["samples"] // world
            torch.set_rng_state(per_rank.value["rng"])
        if rank == 0:
            how = ("saved by another number of ranks: per-rank positions re-derived" if rederive
                   else "per-rank positions restored")
            print(f"resumed from step {step} on {world} ranks ({how})", flush=True)

    loss = torch.zeros(())
    while progress["step"] < args.steps:
        idx = global_batch(progress["samples"])[rank::world]
        loss = F.cross_entropy(ddp(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()  # DDP averages the gradients over the ranks
        opt.step()
        progress["step"] += 1
        progress["samples"] += GLOBAL_BATCH
        per_rank.value["local_samples"] += GLOBAL_BATCH // world
        if progress["step"] % args.save_every == 0 or progress["step"] == args.steps:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # metrics must be the same on every rank
            per_rank.value["rng"] = torch.get_rng_state()
            mgr.save(progress["step"], state, metrics={"loss": mean_loss.item() / world})

    steps = mgr.steps()  # like every manager call in a distributed job: on every rank
    if rank == 0:
        print(f"trained to step {progress['step']} on {world} ranks; checkpoints at steps "
              f"{steps} in {os.path.abspath(args.dir)}", flush=True)
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
