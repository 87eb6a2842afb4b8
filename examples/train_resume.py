"""Kill a training job in the middle of a checkpoint save, resume it, get the same model.

    .venv/bin/python examples/train_resume.py  # or: ./run demo

The script plays four parts, each in its own process, as a real job would live them:

1. a reference run trains a small MLP for 60 steps, uninterrupted;
2. a second run, checkpointing every 10 steps with ``CheckpointManager(keep_last=2)``,
   is SIGKILLed while a checkpoint's data file is being written (no manifest yet);
3. a restart calls ``mgr.restore(state)``: the half-written step is not a checkpoint, so
   it resumes from the newest committed one and trains to the end;
4. the final weights and optimizer state of 1 and 3 are compared bit for bit.

The checkpointed state is the whole job: model, optimizer, LR scheduler, the torch,
NumPy and Python RNGs (dropout and augmentation draw from all three), the step and the
data position. Miss any of it and step 4 fails.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

import safeckpt

TOTAL_STEPS = 60
SAVE_EVERY = 10
KILL_FROM_STEP = 40          # arm the kill for this save (and later ones, if one is missed)
N_SAMPLES, DIM, HIDDEN, CLASSES, BATCH = 1024, 256, 1024, 10, 32
HERE = Path(__file__).resolve()


# --------------------------------------------------------------------------- the job


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic data set: inputs, and labels from a random 'teacher' network."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, DIM, generator=g)
    teacher = torch.randn(DIM, CLASSES, generator=g)
    return x, (torch.tanh(x) @ teacher).argmax(dim=1)


def batch_indices(epoch: int, batch: int) -> torch.Tensor:
    """Which samples make up batch ``batch`` of ``epoch``: a per-epoch shuffle, like
    DistributedSampler.set_epoch, so the data position alone says where we are."""
    perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(epoch))
    return perm[batch * BATCH:(batch + 1) * BATCH]


def make_model() -> nn.Module:
    # ~1.3M parameters: with AdamW's two moments a checkpoint is ~16 MB, big enough
    # that a save takes long enough to be caught in the middle.
    return nn.Sequential(
        nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, CLASSES),
    )


def rng_states() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_states(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


class SaveKiller(threading.Thread):
    """SIGKILLs this process once a checkpoint save is caught half-way: a new folder under
    ``root`` holds a data file of a few MB (of ~16) but no manifest yet. Only watches
    while armed, so the kill always lands inside a save."""

    def __init__(self, root: Path):
        super().__init__(daemon=True)
        self.root, self.armed, self.known = root, threading.Event(), set()

    def arm(self) -> None:
        self.known = {p.name for p in self.root.iterdir()} if self.root.exists() else set()
        sys.setswitchinterval(1e-4)   # let this thread in while the save holds the GIL
        self.armed.set()

    def disarm(self) -> None:
        self.armed.clear()

    def run(self) -> None:
        while True:
            self.armed.wait()
            try:
                for folder in self.root.iterdir():
                    if folder.name in self.known or not folder.is_dir():
                        continue
                    files = {f.name: f.stat().st_size for f in folder.iterdir()}
                    data = {n: s for n, s in files.items() if "data-" in n and s >= 4_000_000}
                    if data and not any(n.startswith("manifest-") for n in files):
                        # no size here: the save's threads keep writing until the kill lands,
                        # so the listing after death (describe) is the one true size
                        print(f"  !! SIGKILL now: {folder.name}/{next(iter(data))} is being written "
                              "and there is no manifest yet", flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)
            except OSError:
                pass                  # a folder or file vanished under us; look again
            time.sleep(2e-4)


def train(ckpt_root: Path, out: Path | None, kill: bool) -> None:
    """One life of the training job: restore if there is a checkpoint, train, save."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    x, y = make_data()
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=TOTAL_STEPS)
    epoch, batch, step = 0, 0, 0
    losses: dict[int, float] = {}

    def state() -> dict:
        return {"model": model, "optim": optim, "sched": sched, "rng": rng_states(),
                "step": step, "data_pos": {"epoch": epoch, "batch": batch}}

    killer = SaveKiller(ckpt_root)
    if kill:
        killer.start()
    with safeckpt.CheckpointManager(ckpt_root, keep_last=2) as mgr:
        st = state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = mgr.restore(st)   # newest committed step, skipping any that isn't
        for w in caught:
            print("  safeckpt warns: " + str(w.message).replace("\n", "\n    "))
        if restored is None:
            print("  no checkpoint yet: starting from scratch")
        else:
            # Tensors were copied in place and load_state_dict() was called on model,
            # optimizer and scheduler; plain values were replaced in the dict.
            step, pos = st["step"], st["data_pos"]
            epoch, batch = pos["epoch"], pos["batch"]
            set_rng_states(st["rng"])
            print(f"  mgr.restore() -> step {restored}: resuming at step {step + 1} "
                  f"(epoch {epoch}, batch {batch}, lr {sched.get_last_lr()[0]:.6f})")

        model.train()
        while step < TOTAL_STEPS:
            idx = batch_indices(epoch, batch)
            noise_scale = random.uniform(0.0, 0.1)                    # Python RNG
            noise = torch.from_numpy(np.random.standard_normal((len(idx), DIM)).astype(np.float32))
            logits = model(x[idx] + noise_scale * noise)              # dropout: torch RNG
            loss = nn.functional.cross_entropy(logits, y[idx])
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            losses[step] = loss.item()
            batch += 1
            if batch * BATCH >= N_SAMPLES:
                epoch, batch = epoch + 1, 0

            if step % SAVE_EVERY == 0:
                if kill and step >= KILL_FROM_STEP:
                    killer.arm()
                mgr.save(step, state(), metrics={"loss": losses[step]})
                killer.disarm()
                print(f"  step {step:2d}  loss {losses[step]:.4f}  saved checkpoint "
                      f"(kept: {mgr.steps()})", flush=True)

    if out is not None:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(),
                    "sched": sched.state_dict(), "losses": losses}, out)


# --------------------------------------------------------------------------- the story


def run_child(*args: str) -> int:
    """Run one life of the job in a fresh process, echoing its output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(HERE), "--child", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print("  |" + line.rstrip("\n"), flush=True)
    return proc.wait()


def describe(root: Path) -> None:
    """Show the checkpoint folders on disk and what safeckpt thinks of each."""
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        names = sorted(f.name for f in folder.iterdir())
        try:
            report = safeckpt.verify(folder)
            verdict = "committed, verify ok" if report.ok else f"INVALID: {report.problems}"
        except safeckpt.CheckpointError as exc:
            verdict = f"not a checkpoint ({type(exc).__name__})"
        print(f"    {folder.name}/  {verdict}")
        for n in names:
            size = (folder / n).stat().st_size
            print(f"        {n}  ({size / 1e6:.1f} MB)" if size >= 100_000 else
                  f"        {n}  ({size / 1e3:.1f} kB)")


def compare(ref: dict, got: dict) -> list[str]:
    """Every difference between two final states, tensor by tensor, bit for bit."""
    diffs = []
    for k, t in ref["model"].items():
        if not torch.equal(t, got["model"][k]):
            diffs.append(f"model.{k}")
    ro, go = ref["optim"], got["optim"]
    if ro["param_groups"] != go["param_groups"]:
        diffs.append("optim.param_groups")
    for pid, s in ro["state"].items():
        for k, t in s.items():
            if not torch.equal(t, go["state"][pid][k]):
                diffs.append(f"optim.state.{pid}.{k}")
    if ref["sched"] != got["sched"]:
        diffs.append("sched")
    for step, loss in got["losses"].items():
        if ref["losses"][step] != loss:
            diffs.append(f"loss at step {step}")
    return diffs


def main(work: Path, t0: float) -> int:
    run_dir, ref_dir = work / "run", work / "reference"
    ref_out, resumed_out = work / "reference.pt", work / "resumed.pt"

    print(f"\n[1/4] Reference run: {TOTAL_STEPS} steps, no interruption")
    if run_child("--ckpt", str(ref_dir), "--out", str(ref_out)) != 0:
        print("FAIL: the reference run failed")
        return 1

    print(f"\n[2/4] Same job, checkpointing every {SAVE_EVERY} steps into {run_dir.name}/; "
          f"it SIGKILLs itself in the middle of the step-{KILL_FROM_STEP} save")
    rc = run_child("--ckpt", str(run_dir), "--kill")
    if rc != -signal.SIGKILL:
        print(f"FAIL: expected the job to die of SIGKILL mid-save, it exited with {rc} "
              "(the saves finished too fast to be caught?)")
        return 1
    committed = safeckpt.CheckpointManager(run_dir).steps()
    print(f"  The job is dead (killed by signal {signal.SIGKILL.name}). On disk:")
    describe(run_dir)
    print(f"  Committed checkpoints: {committed}. The torn folder has data but no manifest, "
          "so it was never a checkpoint.")

    print("\n[3/4] Restart: the same script restores the newest committed checkpoint")
    if run_child("--ckpt", str(run_dir), "--out", str(resumed_out)) != 0:
        print("FAIL: the resumed run failed")
        return 1
    print("  On disk after the resumed run:")
    describe(run_dir)

    print("\n[4/4] Comparing the resumed run's final state with the reference")
    ref = torch.load(ref_out, weights_only=True)
    got = torch.load(resumed_out, weights_only=True)
    first_resumed = min(got["losses"])
    if first_resumed - 1 != max(committed):
        print(f"FAIL: resumed after step {first_resumed - 1}, "
              f"but the newest committed checkpoint was {max(committed)}")
        return 1
    diffs = compare(ref, got)
    n_tensors = len(ref["model"]) + sum(len(s) for s in ref["optim"]["state"].values())
    took = time.perf_counter() - t0
    if diffs:
        print(f"FAIL: {len(diffs)} differences, first: {', '.join(diffs[:5])}")
        return 1
    print(f"  {n_tensors} model and optimizer tensors, the scheduler state and the losses of "
          f"steps {first_resumed}-{TOTAL_STEPS} are identical, bit for bit (torch.equal).")
    try_next(work)
    print(f"\nPASS: killed mid-save, resumed from step {max(committed)}, "
          f"same model as the uninterrupted run ({took:.1f} s)")
    return 0


def workdir(ap: argparse.ArgumentParser, wanted: Path | None) -> Path:
    """The folder the demo works in: ``wanted`` if it is new or empty, else a new one
    in the temp dir. It is kept afterwards, so the checkpoints can be looked at."""
    if wanted is None:
        return Path(tempfile.mkdtemp(prefix="safeckpt-demo-"))
    if wanted.exists() and not wanted.is_dir():
        ap.error(f"--workdir {wanted} is a file; name a new or empty folder")
    if wanted.is_dir() and any(wanted.iterdir()):
        ap.error(f"--workdir {wanted} is not empty; name a new or empty folder "
                 "(the demo never writes over files it did not make)")
    try:
        wanted.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--workdir {wanted}: cannot create it ({exc.strerror or exc})")
    return wanted


def try_next(work: Path) -> None:
    """Where the checkpoints are, and the commands to look at them."""
    cli = Path(sys.executable).with_name("safeckpt")
    cli_text = str(cli) if cli.exists() else "safeckpt"
    run_dir = work / "run"
    latest = safeckpt.CheckpointManager(run_dir).latest_step()
    print(f"\nThe checkpoints are kept in {work}. Try:")
    print(f"  {cli_text} ls {run_dir}")
    print(f"  {cli_text} verify {run_dir}")
    if latest is not None:
        print(f"  {cli_text} show {run_dir}/step-{latest:09d}")
    print(f"Remove them with: rm -r {work}")


if __name__ == "__main__":
    start = time.perf_counter()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path,
                    help="where to keep the checkpoints: a new or empty folder (default: a new folder "
                         "in the temp dir, named at the end)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        train(a.ckpt, a.out, a.kill)
        sys.exit(0)
    sys.exit(main(workdir(ap, a.workdir), start))
