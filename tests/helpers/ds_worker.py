"""DeepSpeed (ZeRO 1, 2, 3 on the CPU accelerator) on real gloo ranks, for
tests/test_integration_deepspeed.py.

Scenarios here are added to ``dist_worker.SCENARIOS`` (this module reuses its worker
loop, ``Ctx`` and ``caught``), and ``DeepSpeedForkServer`` starts *this* file as the fork
server: it imports torch and deepspeed once (``DS_ACCELERATOR=cpu``), so a launch of 2
ranks costs a fork and ``deepspeed.initialize``, not two interpreters importing both.

Training is a pure function of the step: the batch of step k on rank r is seeded by
(k, r), so a run resumed from any committed tag ends bit-identical to an uninterrupted
one, and the model of each launch starts from its own random seed (a load that did not
happen cannot go unnoticed). Each rank appends ``begin K`` / ``done K`` around every
save to ``OUT/progress-r<rank>``; the test SIGKILLs the ranks at random moments.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import dist_worker as dw

HERE = Path(__file__).resolve()
TOTAL_STEPS = 40


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def build(stage: int, seed: int, **install: Any):
    """A DeepSpeed engine over a small MLP whose weights come from ``seed``, with
    safeckpt's checkpoint engine installed."""
    import deepspeed
    import torch
    from safeckpt.integrations import deepspeed as sds
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24),
                                torch.nn.ReLU(), torch.nn.Linear(24, 4))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    return sds.install(engine, **install)


def train_step(engine, rank: int) -> None:
    import torch
    step = int(engine.global_steps) + 1
    g = torch.Generator().manual_seed(1000 * step + rank)
    loss = engine(torch.randn(4, 8, generator=g)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def full_params(engine) -> dict:
    """Every parameter, whole (ZeRO-3 gathers them; collective)."""
    import deepspeed
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=engine.zero_optimization_stage() == 3):
        return {name: p.detach().clone() for name, p in params}


def digest(tensors: dict) -> str:
    """A hash of every name and every bit of the tensors."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def state_digest(engine) -> str:
    """This rank's part of the training state, the fp32 master weights the optimizer
    steps and their Adam moments: what a save must bring back exactly (no collective)."""
    import torch
    opt = engine.optimizer.optimizer
    h = hashlib.sha256()
    for group in opt.param_groups:
        for p in group["params"]:
            h.update(p.detach().contiguous().numpy().tobytes())
            for key, value in sorted(opt.state.get(p, {}).items()):
                h.update(key.encode())
                h.update(value.contiguous().numpy().tobytes() if isinstance(value, torch.Tensor)
                         else repr(value).encode())
    return h.hexdigest()


class States:
    """``saved STEP DIGEST`` before each save, ``loaded STEP DIGEST`` after a resume, per
    rank and stage, across launches: the test checks every load against the saves."""

    def __init__(self, ctx: dw.Ctx, stage: int) -> None:
        self.fd = os.open(ctx.root / f"zero{stage}-states-r{ctx.rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def mark(self, what: str, engine) -> None:
        os.write(self.fd, f"{what} {int(engine.global_steps)} {state_digest(engine)}\n".encode())


def read_states(path: Path) -> list[tuple[str, int, str]]:
    if not path.exists():
        return []
    return [(w, int(s), d) for w, s, d in (line.split(" ") for line in path.read_text().split("\n")[:-1])]


class Progress:
    """``begin K`` / ``done K`` lines around each save, unbuffered (the test reads them live)."""

    def __init__(self, ctx: dw.Ctx) -> None:
        self.fd = os.open(ctx.out / f"progress-r{ctx.rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def mark(self, what: str, step: int) -> None:
        os.write(self.fd, f"{what} {step} {time.time():.4f}\n".encode())


def read_progress(path: Path) -> dict[str, list]:
    """``{"resumed": [step], "begin": [steps...], "done": [steps...], "times": [(what,
    step, unix time)...]}`` from one rank's progress file (a line cut short by a kill is
    ignored)."""
    out: dict[str, list] = {"resumed": [], "begin": [], "done": [], "times": []}
    if path.exists():
        for line in path.read_text().split("\n")[:-1]:
            what, step, when = line.split(" ")
            out[what].append(int(step))
            out["times"].append((what, int(step), float(when)))
    return out


# -- scenarios -------------------------------------------------------------------------

def sc_ds_run(ctx: dw.Ctx) -> dict:
    """Resume from the newest committed tag, save that tag again (a re-save, as a loop
    that resumes at the step it restored does), then train and save every step to
    ``TOTAL_STEPS``; the test may SIGKILL the ranks at any moment."""
    stage, seed = ctx.opts["stage"], ctx.opts["seed"]
    folder = str(ctx.root / f"zero{stage}")
    engine = build(stage, seed, keep_last=ctx.opts.get("keep_last"))
    progress, states = Progress(ctx), States(ctx, stage)
    load_path, client = engine.load_checkpoint(folder)
    resumed = int(engine.global_steps)
    if resumed:
        states.mark("loaded", engine)
    progress.mark("resumed", resumed)

    def save() -> None:
        states.mark("saved", engine)
        progress.mark("begin", int(engine.global_steps))
        engine.save_checkpoint(folder, client_state={"launch": seed})
        progress.mark("done", int(engine.global_steps))

    if resumed:
        save()
    while engine.global_steps < ctx.opts.get("total", TOTAL_STEPS):
        train_step(engine, ctx.rank)
        save()
    final = full_params(engine)
    if ctx.rank == 0:
        import torch
        torch.save(final, ctx.root / f"zero{stage}-final.pt")
    return {"resumed": resumed, "loaded_launch": (client or {}).get("launch"), "digest": digest(final),
            "steps": int(engine.global_steps)}


def sc_ds_reference(ctx: dw.Ctx) -> dict:
    """The same training uninterrupted, never saved, from the first launch's model: the
    digest a resumed run must reach."""
    stage = ctx.opts["stage"]
    engine = build(stage, ctx.opts["first_seed"])
    while engine.global_steps < ctx.opts.get("total", TOTAL_STEPS):
        train_step(engine, ctx.rank)
    return {"digest": digest(full_params(engine))}


def failing_fs():
    """The real filesystem, except that every write fails with ENOSPC (a full disk)."""
    from safeckpt.storage.local import OSFileSystem

    class FullDisk(OSFileSystem):
        def write(self, fd: int, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
    return FullDisk()


def sc_ds_rank_raises(ctx: dw.Ctx) -> dict:
    """Rank 1's storage fails inside ``save`` (a full disk): every rank must raise, the
    previous tag and ``latest`` stay as they were, the attempt leaves nothing; then the
    next save works."""
    stage = ctx.opts["stage"]
    folder = ctx.root / f"raise{stage}"
    engine = build(stage, 1)
    train_step(engine, ctx.rank)
    engine.save_checkpoint(str(folder))
    before = dw.listing(folder)
    train_step(engine, ctx.rank)
    from safeckpt.integrations import deepspeed as sds
    if ctx.rank == 1:
        sds.install(engine, storage_options={"fs": failing_fs()})
    out: dict = {"failed": dw.caught(lambda: engine.save_checkpoint(str(folder)))}
    ctx.barrier()
    out["after"] = dw.listing(folder)
    out["before"] = before
    sds.install(engine)
    out["retry"] = dw.caught(lambda: engine.save_checkpoint(str(folder)))
    ctx.barrier()
    out["after_retry"] = dw.listing(folder)
    return out


def sc_ds_kill_before_latest(ctx: dw.Ctx) -> dict:
    """Rank 0 is SIGKILLed after the commit of global_step2, before ``latest`` moves."""
    stage = ctx.opts["stage"]
    folder = str(ctx.root / f"latest{stage}")
    engine = build(stage, 2)
    from safeckpt.integrations import deepspeed as sds
    for _ in range(2):
        train_step(engine, ctx.rank)
        if engine.global_steps == 2 and ctx.rank == 0:
            real = sds.replace_file

            def kill_at_latest(root, name, data):
                if name == sds.LATEST:
                    os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(60)
                return real(root, name, data)
            sds.replace_file = kill_at_latest
        engine.save_checkpoint(folder)
    return {}


def sc_ds_resume_once(ctx: dw.Ctx) -> dict:
    """Load the newest committed tag of ``opts["folder"]`` into a fresh engine."""
    engine = build(ctx.opts["stage"], 3)
    path, client = engine.load_checkpoint(str(ctx.root / ctx.opts["folder"]))
    return {"path": path, "steps": int(engine.global_steps), "digest": digest(full_params(engine))}


dw.SCENARIOS.update({name[3:]: fn for name, fn in dict(globals()).items() if name.startswith("sc_ds_")})


class DeepSpeedForkServer(dw.ForkServer):
    """``dist_worker.ForkServer`` started on this file, with deepspeed imported once."""

    def __init__(self, src: str, env: dict | None = None) -> None:
        super().__init__(src, script=HERE, env={"DS_ACCELERATOR": "cpu", **(env or {})})


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        import deepspeed  # noqa: F401  (the ranks fork with it imported)
        dw.serve(heavy=False)
        sys.exit(0)
    sys.exit(dw.main())
