"""Accelerate: save_state / load_state through a CheckpointManager, a real kill and resume.

A small MLP with dropout trains 8 steps on CPU through ``accelerate`` (prepared model,
optimizer and scheduler, a registered custom object), drawing its data from Python's
``random``, NumPy and torch, so a resume is exact only when all three generators come
back. A process saving every 2 steps is SIGKILLed during the save of step 6 (its
data written, its manifest not); another process, which never trained, starts from a
different random model and resumes from step 4 and must end bit-identical to an uninterrupted run that
never saved (so saving must not disturb the generators either).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.integrations import accelerate as sa  # noqa: E402

STEPS = 8
SAVE_EVERY = 2
KILL_AT = 6
KEEP_LAST = 2


class Counter:
    """A custom object registered with ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.total = 0
        self.seen: list[int] = []

    def state_dict(self) -> dict:
        return {"total": self.total, "seen": list(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.seen = state["total"], list(state["seen"])


def _setup(model_seed: int):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(model_seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    return accelerator, model, opt, sched, counter


def _train(accelerator, model, opt, sched, counter, start: int, root: str | None, report=None) -> dict:
    losses = {}
    for step in range(start + 1, STEPS + 1):
        x = torch.randn(8, 16)
        scale = random.random()
        noise = torch.from_numpy(np.random.randn(8, 1)).float()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) * scale + noise)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.total += step
        counter.seen.append(step)
        losses[str(step)] = loss.item()
        if report:
            report(losses)
        if root is not None and step % SAVE_EVERY == 0:
            sa.save_state(accelerator, root, step, keep_last=KEEP_LAST)
    return losses


def _outcome(accelerator, model, counter, losses: dict, weights: str) -> dict:
    safeckpt.save({k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
                  weights)
    return {"losses": losses, "weights": weights, "counter": counter.state_dict(), "acc_step": accelerator.step}


# ----------------------------------------------------------------------------- children

def child_killed(plan: dict) -> None:
    from safeckpt.storage.local import LocalStorage

    real = LocalStorage.write_file

    def write_file(self, name, parts):
        if name.startswith("manifest-") and self.path.endswith(f"step-{KILL_AT:09d}"):
            os.kill(os.getpid(), signal.SIGKILL)  # the data file is written, the manifest never
            time.sleep(60)
        return real(self, name, parts)

    LocalStorage.write_file = write_file

    def report(losses):
        Path(plan["killed_losses"]).write_text(json.dumps(losses))
    _train(*_setup(model_seed=0), start=0, root=plan["root"], report=report)
    raise AssertionError("the run was not killed")


def child_resume(plan: dict) -> dict:
    parts = _setup(model_seed=99)  # a different model: loading nothing cannot pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = sa.load_state(parts[0], plan["root"])
    losses = _train(*parts, start=start, root=plan["root"])
    result = {"restored": start, "warnings": [str(w.message) for w in caught],
              "resumed": _outcome(parts[0], parts[1], parts[4], losses, plan["resumed_weights"])}
    ref = _setup(model_seed=0)
    result["ref"] = _outcome(ref[0], ref[1], ref[4], _train(*ref, start=0, root=None), plan["ref_weights"])
    return result


def child_main(plan: dict) -> None:
    """One launch: fork the run that gets killed, then resume in this process, which
    never trained (so it shares nothing with the killed run but the files)."""
    pid = os.fork()
    if pid == 0:
        try:
            child_killed(plan)
        except BaseException:
            import traceback
            Path(plan["out"] + ".err").write_text(traceback.format_exc())
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    killed = {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
              "steps": safeckpt.CheckpointManager(plan["root"]).steps(),
              "error": Path(plan["out"] + ".err").read_text() if os.path.exists(plan["out"] + ".err") else None}
    result = child_resume(plan) if killed["signal"] == signal.SIGKILL else {}
    Path(plan["out"]).write_text(json.dumps({**result, "killed": killed}))


def _run_child(plan_path: Path) -> tuple[int, str]:
    src = str(Path(safeckpt.__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, __file__, str(plan_path)], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    return proc.returncode, proc.stdout


# ----------------------------------------------------------------------------- tests

def test_kill_mid_save_then_resume_is_bit_identical(tmp_path):
    root = str(tmp_path / "run")
    plan = {"root": root, "out": str(tmp_path / "result.json"), "killed_losses": str(tmp_path / "killed.json"),
            "resumed_weights": str(tmp_path / "w-resumed"), "ref_weights": str(tmp_path / "w-ref")}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))

    code, out = _run_child(plan_path)
    assert code == 0, f"the child failed (exit {code}):\n{out[-5000:]}"
    result = json.loads(Path(plan["out"]).read_text())
    killed = result["killed"]
    assert killed["signal"] == signal.SIGKILL, f"the run was not killed:\n{killed['error']}"
    assert killed["steps"] == [2, 4]  # step 6 was torn: data written, no manifest
    mgr = safeckpt.CheckpointManager(root)
    assert result["restored"] == 4
    assert any(f"step {KILL_AT}" in w and "not committed" in w for w in result["warnings"]), result["warnings"]

    resumed, ref = result["resumed"], result["ref"]
    killed = json.loads(Path(plan["killed_losses"]).read_text())
    assert {k: v for k, v in ref["losses"].items() if int(k) <= KILL_AT} == killed
    assert {k: v for k, v in ref["losses"].items() if int(k) > 4} == resumed["losses"]
    assert resumed["counter"] == ref["counter"] and resumed["acc_step"] == ref["acc_step"]
    got, want = safeckpt.load_state(resumed["weights"]), safeckpt.load_state(ref["weights"])
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the uninterrupted run"

    # retention ran after each commit, in the run the resume continued
    assert mgr.steps() == [STEPS - SAVE_EVERY, STEPS]
    for step in mgr.steps():
        assert safeckpt.verify(mgr.path(step)).ok
    saved = safeckpt.load_state(mgr.path(STEPS))
    assert {"models", "optimizers", "schedulers", "custom_objects", "step", "rng"} <= saved.keys()
    assert saved["custom_objects"][0] == ref["counter"]
    assert set(saved["rng"][0]) >= {"python", "numpy", "torch"}


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_save_does_not_advance_generators_and_load_restores_them(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    saved_rng = sa.rng_states()
    try:
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        before = sa.rng_states()
        accelerator.step = 3
        sa.save_state(accelerator, tmp_path, 1)
        after_save = _draws()
        sa.set_rng_states(before)
        assert _draws() == after_save, "saving changed what a generator produces next"
        _draws()
        accelerator.step = 0
        with torch.no_grad():
            model.weight.zero_()
        assert sa.load_state(accelerator, tmp_path) == 1
        assert _draws() == after_save and accelerator.step == 3
        assert model.weight.abs().sum() > 0
        assert sa.load_state(accelerator, tmp_path / "empty") is None
    finally:
        sa.set_rng_states(saved_rng)


if __name__ == "__main__":
    torch.set_num_threads(1)  # before the fork: the killed run must not inherit an OpenMP pool
    child_main(json.loads(Path(sys.argv[1]).read_text()))
