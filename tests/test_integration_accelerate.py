"""Accelerate: save_state / load_state in both layouts, a real kill and resume.

A small MLP with dropout trains 8 steps on CPU through ``accelerate`` (prepared model,
optimizer and scheduler, a registered custom object), drawing its data from Python's
``random``, NumPy and torch, so a resume is exact only when all three generators come
back. For each layout a process saving every 2 steps is SIGKILLed during the save of
step 6: the default one (Accelerate's own files) after ``accelerator.save_state``
wrote them and before the seal, the safeckpt one with its data written and its
manifest not. Stock ``accelerator.load_state`` then reads step 4 back as the killed
run held it, and a process that never trained starts from a different random model,
resumes from step 4 and must end bit-identical to an uninterrupted run that never
saved (so saving must not disturb the generators either).
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


def _train(accelerator, model, opt, sched, counter, start: int, root: str | None, layout: str = "accelerate",
           report=None) -> dict:
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
            sa.save_state(accelerator, root, step, keep_last=KEEP_LAST, layout=layout)
    return losses


def _outcome(accelerator, model, counter, losses: dict, weights: str) -> dict:
    safeckpt.save({k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
                  weights)
    return {"losses": losses, "weights": weights, "counter": counter.state_dict(), "acc_step": accelerator.step}


# ----------------------------------------------------------------------------- children

def child_killed(plan: dict, layout: str) -> None:
    """Train, saving in ``layout``, and die during the save of step KILL_AT: before the
    seal (``point`` "seal"), half way through Accelerate's optimizer.bin ("files"), or
    for the safeckpt layout between its data and its manifest."""
    from kill_points import die_writing

    from safeckpt.storage.local import LocalStorage

    run, point = plan[layout], plan.get("point", "seal")
    torn = f"step-{KILL_AT:09d}"

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    real_write, real_seal = LocalStorage.write_file, sa.seal

    def write_file(self, name, parts):
        if name.startswith("manifest-") and self.path.endswith(torn) and layout == "safeckpt":
            die()  # the data file is written, the manifest never
        return real_write(self, name, parts)

    def seal(path, **kwargs):
        if point == "seal" and str(path).endswith(torn):
            die()
        return real_seal(path, **kwargs)

    LocalStorage.write_file, sa.seal = write_file, seal
    if point == "files":
        die_writing(f"{torn}/optimizer.bin", die)
    parts = _setup(model_seed=0)

    def report(losses):
        Path(run["killed_losses"]).write_text(json.dumps(losses))
        if len(losses) == 4:  # the weights step 4 saves
            _outcome(parts[0], parts[1], parts[4], losses, run["step4"])
    _train(*parts, start=0, root=run["root"], layout=layout, report=report)
    raise AssertionError("the run was not killed")


def child_resume(run: dict, layout: str) -> dict:
    parts = _setup(model_seed=99)  # a different model: loading nothing cannot pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = sa.load_state(parts[0], run["root"])
    losses = _train(*parts, start=start, root=run["root"], layout=layout)
    return {"restored": start, "warnings": [str(w.message) for w in caught],
            "resumed": _outcome(parts[0], parts[1], parts[4], losses, run["resumed_weights"])}


def child_main(plan: dict) -> None:
    """One launch: for each layout fork the run that gets killed, then resume it in this
    process, which never trained (so it shares nothing with the killed run but the
    files); then the uninterrupted reference."""
    result: dict = {}
    for layout in plan["layouts"]:
        err = plan[layout]["root"] + ".err"
        pid = os.fork()
        if pid == 0:
            try:
                child_killed(plan, layout)
            except BaseException:
                import traceback
                Path(err).write_text(traceback.format_exc())
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        killed = {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                  "steps": safeckpt.CheckpointManager(plan[layout]["root"]).steps(),
                  "error": Path(err).read_text() if os.path.exists(err) else None}
        if layout == "accelerate" and killed["signal"] == signal.SIGKILL:  # the stock tool reads step 4
            accelerator, model, _, _, counter = _setup(model_seed=7)
            accelerator.load_state(os.path.join(plan[layout]["root"], "step-000000004"))
            killed["stock"] = _outcome(accelerator, model, counter, {}, plan[layout]["stock4"])
        resumed = child_resume(plan[layout], layout) if killed["signal"] == signal.SIGKILL else {}
        result[layout] = {**resumed, "killed": killed}
    ref = _setup(model_seed=0)
    result["ref"] = _outcome(ref[0], ref[1], ref[4], _train(*ref, start=0, root=None), plan["ref_weights"])
    Path(plan["out"]).write_text(json.dumps(result))


def _run_child(plan_path: Path) -> tuple[int, str]:
    src = str(Path(safeckpt.__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, __file__, str(plan_path)], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    return proc.returncode, proc.stdout


def _kill_and_resume(tmp_path: Path, layouts, point: str = "seal") -> dict:
    plan: dict = {"layouts": list(layouts), "point": point, "out": str(tmp_path / "result.json"),
                  "ref_weights": str(tmp_path / "w-ref")}
    for layout in layouts:
        plan[layout] = {"root": str(tmp_path / layout), "killed_losses": str(tmp_path / f"killed-{layout}.json"),
                        "resumed_weights": str(tmp_path / f"w-{layout}"), "step4": str(tmp_path / f"step4-{layout}"),
                        "stock4": str(tmp_path / f"stock4-{layout}")}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    code, out = _run_child(plan_path)
    assert code == 0, f"the child failed (exit {code}):\n{out[-5000:]}"
    return {"plan": plan, "result": json.loads(Path(plan["out"]).read_text())}


# ----------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory) -> dict:
    return _kill_and_resume(tmp_path_factory.mktemp("accelerate"), sa.LAYOUTS)


def _same_weights(got_path: str, want_path: str) -> None:
    got, want = safeckpt.load_state(got_path), safeckpt.load_state(want_path)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs"


def _check_kill_and_resume(runs: dict, layout: str) -> None:
    plan, result = runs["plan"], runs["result"]
    run, res, ref = plan[layout], result[layout], result["ref"]
    killed = res["killed"]
    assert killed["signal"] == signal.SIGKILL, f"the run was not killed:\n{killed['error']}"
    assert killed["steps"] == [2, 4]  # step 6 was torn
    assert res["restored"] == 4
    why = "not sealed" if layout == "accelerate" else "not committed"
    assert any(f"{KILL_AT:09d}" in w and why in w for w in res["warnings"]), res["warnings"]

    resumed = res["resumed"]
    killed_losses = json.loads(Path(run["killed_losses"]).read_text())
    assert {k: v for k, v in ref["losses"].items() if int(k) <= KILL_AT} == killed_losses
    assert {k: v for k, v in ref["losses"].items() if int(k) > 4} == resumed["losses"]
    assert resumed["counter"] == ref["counter"] and resumed["acc_step"] == ref["acc_step"]
    _same_weights(resumed["weights"], ref["weights"])

    # retention ran after each commit, in the run the resume continued
    mgr = safeckpt.CheckpointManager(run["root"])
    assert mgr.steps() == [STEPS - SAVE_EVERY, STEPS]
    for step in mgr.steps():
        assert safeckpt.verify(mgr.path(step)).ok


@pytest.mark.parametrize("layout", sa.LAYOUTS)
def test_kill_mid_save_then_resume_is_bit_identical(killed_runs, layout):
    _check_kill_and_resume(killed_runs, layout)


def test_default_layout_is_accelerates_own_files_and_stock_load_state_reads_them(killed_runs):
    run = killed_runs["plan"]["accelerate"]
    newest = Path(run["root"]) / f"step-{STEPS:09d}"
    names = {p.name for p in newest.iterdir()}
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl", "manifest-000001.json"} == names
    # the stock accelerator.load_state, in the process that resumed, before it resumed:
    # step 4 as the killed run held it
    stock = killed_runs["result"]["accelerate"]["killed"]["stock"]
    assert stock["counter"]["seen"] == [1, 2, 3, 4]
    _same_weights(stock["weights"], run["step4"])


def test_safeckpt_layout_is_one_checkpoint_without_pickles(killed_runs):
    run = killed_runs["plan"]["safeckpt"]
    saved = safeckpt.load_state(Path(run["root"]) / f"step-{STEPS:09d}")
    assert {"models", "optimizers", "schedulers", "custom_objects", "step", "rng"} <= saved.keys()
    assert saved["custom_objects"][0] == killed_runs["result"]["ref"]["counter"]
    assert set(saved["rng"][0]) >= {"python", "numpy", "torch"}


@pytest.mark.slow
def test_kill_half_way_through_accelerates_files_then_resume_is_bit_identical(tmp_path):
    _check_kill_and_resume(_kill_and_resume(tmp_path, ["accelerate"], point="files"), "accelerate")


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.mark.parametrize("layout", sa.LAYOUTS)
def test_save_does_not_advance_generators_and_load_restores_them(tmp_path, layout):
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
        sa.save_state(accelerator, tmp_path, 1, layout=layout)
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


def test_sealed_folders_keep_their_metrics_for_retention(tmp_path):
    """keep_best over the accelerate layout: the metrics go into each seal, and
    retention (after each seal) keeps the best and the newest."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(4, 2))
    for step, loss in ((1, 0.5), (2, 0.1), (3, 0.4), (4, 0.3)):
        info = sa.save_state(accelerator, tmp_path, step, metrics={"loss": loss},
                             keep_last=1, keep_best=1, best_metric="loss")
        assert info.step == step
    assert safeckpt.CheckpointManager(tmp_path).steps() == [2, 4]
    assert [s.metrics for s in safeckpt.list_checkpoints(tmp_path)] == [{"loss": 0.1}, {"loss": 0.3}]


def test_a_root_accelerate_cannot_write_gets_the_safeckpt_layout(tmp_path):
    """accelerator.save_state writes with open(): an object-store URL (here fsspec's
    memory://) is saved in the safeckpt layout unless the accelerate one is asked for."""
    from accelerate import Accelerator

    pytest.importorskip("fsspec")
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    root = f"memory://{tmp_path.name}/run"
    with pytest.raises(ValueError, match="layout='safeckpt'"):
        sa.save_state(accelerator, root, 1, layout="accelerate")
    info = sa.save_state(accelerator, root, 2)
    assert info.metadata["layout"] == "safeckpt"
    want = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    assert sa.load_state(accelerator, root) == 2 and torch.equal(model.weight, want)


def test_two_threads_asking_at_once_share_one_manager(tmp_path, monkeypatch):
    """Two threads (a training loop and a callback thread) asking for the manager of one
    root at the same moment get the same one: two would be two writers of one root."""
    import threading

    from accelerate import Accelerator

    made = []

    class SlowManager(safeckpt.CheckpointManager):  # widens the window between looking and making
        def __init__(self, *args, **kwargs):
            time.sleep(0.3)
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(sa, "CheckpointManager", SlowManager)
    accelerator = Accelerator(cpu=True)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(sa.checkpoint_manager(accelerator, tmp_path / "run")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and got[0] is got[1] is made[0]
    made[0].close()


@pytest.mark.slow  # two processes importing accelerate: about 20 s on 2 cores
def test_an_fsdp_sharded_save_state_is_sealed_with_its_dcp_index_and_resumes(tmp_path):
    """FSDP with SHARDED_STATE_DICT on 2 gloo ranks: save_state writes
    torch.distributed.checkpoint folders, each with its ``.metadata`` index. The step is
    sealed with both indexes, a fresh model resumes every rank's shards exactly, and a
    damaged index is found by verify."""
    if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
        pytest.skip("needs FSDP2's fully_shard (torch >= 2.6)")
    from damage import assert_a_flipped_byte_is_found  # tests/helpers: not on the path of this file's children

    src = str(Path(safeckpt.__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    root = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).parent / "helpers" / "accelerate_fsdp_child.py"), str(root)],
                          env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:]
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["problems"] == [] and result["restored"] == 1, result
    assert [r["differ"] for r in result["ranks"]] == [[], []]
    assert result["ranks"][0]["shards"]["p.0.weight"] == 32  # half of the 8x8 weight: really sharded

    folder = root / "step-000000001"
    (manifest,) = folder.glob("manifest-*.json")
    named = {f["name"] for f in json.loads(manifest.read_text())["safeckpt"]["files"]}
    assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"} <= named, sorted(named)
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert on_disk - named == {manifest.name}  # every file the tools wrote is sealed
    assert_a_flipped_byte_is_found(folder, "pytorch_model_fsdp_0/.metadata")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
    torch.set_num_threads(1)  # before the fork: the killed run must not inherit an OpenMP pool
    child_main(json.loads(Path(sys.argv[1]).read_text()))
