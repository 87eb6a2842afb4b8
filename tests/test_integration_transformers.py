"""Hugging Face Trainer: sealing, safe rotation, SafeTrainer, and a real kill and resume.

A tiny GPT-2 built from a config (no download) trains 8 steps on generated tokens,
saving every 2 steps (an evaluation before each save picks a best checkpoint). Real
child processes are SIGKILLed during the save of step 6, after the Trainer wrote its
files and before the seal, one per integration: a ``Trainer`` with
``SafeCheckpointCallback``, ``SafeTrainer`` (the Trainer's own files, its default)
and ``SafeTrainer(checkpoint_layout="safeckpt")``. ``last_checkpoint`` must skip the
torn ``checkpoint-6`` with a warning, ``from_pretrained`` must load ``checkpoint-4``
with the weights the run had at step 4, and a fresh process that starts from a
*different* random model and resumes from ``checkpoint-4`` must end with weights
``torch.equal`` to an uninterrupted run and the same losses, step for step.

The children are this file run as a script (``python test_integration_transformers.py
MODE ARGS``); the three runs that follow the kills share one process to keep the
number of ``import transformers`` small.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.protocol.group import SingleGroup  # noqa: E402
from safeckpt.integrations import transformers as hf  # noqa: E402
from safeckpt.interop.sealing import seal  # noqa: E402

STEPS = 8
SAVE_EVERY = 2
KILL_AT = 6
SAVE_TOTAL_LIMIT = 2
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
             "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             "WANDB_DISABLED": "true", "CUDA_VISIBLE_DEVICES": ""}


# ----------------------------------------------------------------------------- training

def _model(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    """48 sequences of 16 random tokens: 12 batches of 4 per epoch, so a resume at
    step 4 is mid-epoch (batches skipped, RNG restored after the skip)."""

    def __init__(self, n: int = 48, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def _args(out: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        learning_rate=5e-3, logging_steps=1, save_strategy="steps", save_steps=SAVE_EVERY,
        eval_strategy="steps", eval_steps=SAVE_EVERY, metric_for_best_model="eval_loss",
        greater_is_better=True,  # the worst loss is "best": an old checkpoint, which rotation must keep
        save_total_limit=SAVE_TOTAL_LIMIT, report_to=[], seed=42, use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0)


#: how each kind of run checkpoints: a Trainer with the callback, SafeTrainer (its default
#: layout) and SafeTrainer with the safeckpt layout
KINDS = ("callback", "safe", "safeckpt")


def _trainer(kind: str, out: str, model_seed: int, callbacks=()):
    from transformers import Trainer

    data = {"model": _model(model_seed), "args": _args(out), "train_dataset": _Tokens(),
            "eval_dataset": _Tokens(16, seed=1)}
    if kind == "callback":
        return Trainer(**data, callbacks=[*callbacks, hf.SafeCheckpointCallback()])
    layout = "safeckpt" if kind == "safeckpt" else "trainer"
    return hf.SafeTrainer(**data, callbacks=list(callbacks), checkpoint_layout=layout)


def _losses(trainer) -> dict[str, float]:
    return {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e}


def _result(trainer, out: str) -> dict:
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    safeckpt.save(weights, out, process_group=SingleGroup())  # by this process alone, also under DDP
    return {"losses": _losses(trainer), "weights": out,
            "best": trainer.state.best_model_checkpoint}


# ----------------------------------------------------------------------------- child modes

def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


class _RecordStep4:
    """The weights a run holds when it saves step 4, kept aside for from_pretrained."""

    def __init__(self, out: str) -> None:
        from transformers import TrainerCallback

        class Record(TrainerCallback):
            def on_save(self, args, state, control, model=None, **kwargs):
                if state.global_step == 4:
                    safeckpt.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                                  out + "-step4", process_group=SingleGroup())
        self.callback = Record()


def child_killed(arg: str) -> None:
    """Train and die during the save of step KILL_AT. ``arg``: ``KIND:DIR[:POINT]``.
    Points: ``seal`` (default; the Trainer's files written, before the seal), ``files``
    (in the middle of the Trainer's optimizer.pt), ``external`` (callback: the parent
    kills from outside as soon as checkpoint-6 appears, a pause before the seal makes
    sure it can), and for the safeckpt layout ``commit`` (its data written, no manifest
    at all) and ``data`` (part of its data file written)."""
    from kill_points import die_writing

    from safeckpt.storage.local import LocalStorage

    kind, out, point = (arg.split(":") + ["seal"])[:3]
    torn = f"checkpoint-{KILL_AT}"
    real_seal, real_write = hf.seal, LocalStorage.write_file

    def seal(path, **kwargs):
        if point in ("seal", "external") and str(path).endswith(torn):
            if point == "external":
                time.sleep(30)
            _die()
        return real_seal(path, **kwargs)

    def write_file(self, name, parts):
        if self.path.endswith(torn) and kind == "safeckpt":
            if point == "commit" and name == "manifest-000001.json":
                _die()
            if point == "data" and name.startswith("data-"):
                def some_then_die():
                    for i, part in enumerate(parts):
                        yield part
                        if i >= 1:
                            _die()
                return real_write(self, name, some_then_die())
        return real_write(self, name, parts)

    hf.seal, LocalStorage.write_file = seal, write_file
    if point == "files":
        die_writing(f"{torn}/optimizer.pt", _die)
    _trainer(kind, out, model_seed=0, callbacks=[_RecordStep4(out).callback]).train()
    raise AssertionError("the run was not killed")


def child_resume(plan: str) -> None:
    """Resume each killed run listed in the plan from a different random model; then,
    unless the plan has no ``ref_dir``, run the uninterrupted reference."""
    p = json.loads(Path(plan).read_text())
    results = {}
    for kind, folder, ckpt, weights in p["resume"]:
        t = _trainer(kind, folder, model_seed=1234)
        t.train(resume_from_checkpoint=ckpt if kind == "callback" else True)  # SafeTrainer: last_checkpoint
        results[kind] = _result(t, weights)
    if p.get("ref_dir"):
        t = _trainer("callback", p["ref_dir"], model_seed=0)
        t.train()
        results["ref"] = _result(t, p["ref_weights"])
    Path(p["out"]).write_text(json.dumps(results))


def child_ddp(plan: str) -> None:
    """Run by torchrun on every rank: train (or resume) a SafeTrainer and a Trainer with
    the callback; rank 0 writes what they ended with."""
    p = json.loads(Path(plan).read_text())
    results = {}
    for kind in KINDS:
        t = _trainer(kind, p[f"{kind}_dir"], model_seed=77 if p["resume"] else 0)
        t.train(resume_from_checkpoint=p.get(f"{kind}_ckpt"))
        results[kind] = _result(t, p[f"{kind}_weights"]) if t.args.process_index == 0 else None
    if int(os.environ.get("RANK", "0")) == 0:
        Path(p["out"]).write_text(json.dumps(results))


CHILDREN = {"killed": child_killed, "resume": child_resume, "ddp": child_ddp}


class ForkServer:
    """This file run as ``serve``: it imports torch and transformers once and forks a
    child per run, so a kill costs a fork, not an ``import transformers``. Each child
    writes its output to ``<log>``; ``wait`` returns its exit code (negative: signal)."""

    def __init__(self) -> None:
        src = str(Path(safeckpt.__file__).resolve().parent.parent)
        env = {**os.environ, **CHILD_ENV, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, __file__, "serve"], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._ask(None).get("ready")

    def _ask(self, request: dict | None) -> dict:
        if request is not None:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died (exit {self.proc.wait()})")
        return json.loads(line)

    def fork(self, mode: str, arg: str, log: str) -> int:
        return self._ask({"cmd": "fork", "mode": mode, "arg": arg, "log": log})["pid"]

    def wait(self, pid: int, log: str) -> tuple[int, str]:
        code = self._ask({"cmd": "wait", "pid": pid})["code"]
        return code, Path(log).read_text() if os.path.exists(log) else ""

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _run_child(mode: str, arg: str, log: str) -> None:
    code = 1
    try:
        try:
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
        except Exception:
            pass
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)  # stdout was the protocol pipe
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(300)  # nothing may run forever
        CHILDREN[mode](arg)
        code = 0
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)


def serve() -> None:
    torch.set_num_threads(1)  # forked children must not inherit an OpenMP pool
    import transformers.trainer  # noqa: F401  (the lazy modules a run needs, imported once)
    from transformers import GPT2LMHeadModel, TrainingArguments  # noqa: F401
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "fork":
            pid = os.fork()
            if pid == 0:
                _run_child(req["mode"], req["arg"], req["log"])
            reply = {"pid": pid}
        else:
            _, status = os.waitpid(req["pid"], 0)
            reply = {"code": os.waitstatus_to_exitcode(status)}
        print(json.dumps(reply), flush=True)
    os._exit(0)  # skip the interpreter's slow teardown of torch and transformers


# ----------------------------------------------------------------------------- the runs

def _last(output_dir) -> tuple[str | None, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = hf.last_checkpoint(output_dir)
    return found, [str(w.message) for w in caught]


def _steps(output_dir: str, sealed: bool | None = None) -> list[int]:
    out = []
    for step, path in hf._checkpoints(output_dir):
        is_sealed = not isinstance(hf._committed(path), str)
        if sealed is None or is_sealed == sealed:
            out.append(step)
    return out


@pytest.fixture(scope="module")
def server():
    srv = ForkServer()
    yield srv
    srv.close()


def _kill_run(server, kind: str, folder: str, point: str, log: str) -> None:
    """Fork a run that must end SIGKILLed during the save of step KILL_AT; with point
    ``external``, the parent kills it as soon as that folder exists."""
    pid = server.fork("killed", f"{kind}:{folder}:{point}", log)
    if point == "external":
        torn = os.path.join(folder, f"checkpoint-{KILL_AT}")
        deadline = time.monotonic() + 120
        while not os.path.isdir(torn) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(pid, signal.SIGKILL)
    code, out = server.wait(pid, log)
    assert code == -signal.SIGKILL, f"the {kind} run was not killed (exit {code}):\n{out[-3000:]}"


def _after_kill(folder: str) -> dict:
    return {"sealed": _steps(folder, True), "unsealed": _steps(folder, False), "last": _last(folder),
            "pretrained": _pretrained_matches_step4(folder)}


def _pretrained_matches_step4(folder: str) -> bool:
    """The stock tool reads the previous checkpoint: from_pretrained gives the weights
    the killed run held when it saved step 4."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(os.path.join(folder, "checkpoint-4"))
    want = safeckpt.load_state(folder + "-step4")
    got = model.state_dict()
    return want.keys() <= got.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _resume(server, base: Path, name: str, resume: list, ref: bool) -> dict:
    plan = {"out": str(base / f"{name}.json"), "resume": resume}
    if ref:
        plan.update(ref_dir=str(base / "ref"), ref_weights=str(base / "w-ref"))
    (base / f"{name}-plan.json").write_text(json.dumps(plan))
    log = str(base / f"{name}.log")
    code, out = server.wait(server.fork("resume", str(base / f"{name}-plan.json"), log), log)
    assert code == 0, f"the resuming process failed (exit {code}):\n{out[-5000:]}"
    return json.loads(Path(plan["out"]).read_text())


@pytest.fixture(scope="module")
def runs(server, tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    dirs = {k: str(base / k) for k in (*KINDS, "ref")}
    # the killed runs at once, then one process resumes them all and runs the reference
    pids = {kind: server.fork("killed", f"{kind}:{dirs[kind]}", str(base / f"{kind}.log")) for kind in KINDS}
    after_kill = {}
    for kind, pid in pids.items():
        code, out = server.wait(pid, str(base / f"{kind}.log"))
        assert code == -signal.SIGKILL, f"the {kind} run was not killed (exit {code}):\n{out[-3000:]}"
        after_kill[kind] = _after_kill(dirs[kind])
    resume = [(kind, dirs[kind], after_kill[kind]["last"][0], str(base / f"w-{kind}")) for kind in KINDS]
    results = _resume(server, base, "resume", resume, ref=True)
    return {"dirs": dirs, "after_kill": after_kill, "results": results, "base": base}


def _check_resumed(after_kill: dict, folder: str, res: dict, ref: dict) -> None:
    assert after_kill["sealed"] == [2, 4] and after_kill["unsealed"] == [KILL_AT], after_kill
    last, messages = after_kill["last"]
    assert last == os.path.join(folder, "checkpoint-4"), (last, messages)
    assert after_kill["pretrained"], "from_pretrained(checkpoint-4) did not give the step-4 weights"
    torn = os.path.join(folder, f"checkpoint-{KILL_AT}")
    assert any(torn in m and "not sealed" in m for m in messages), messages
    assert res["losses"] == ref["losses"], "the resumed run's losses differ from the uninterrupted run's"
    assert sorted(map(int, ref["losses"])) == list(range(1, STEPS + 1))
    got, want = safeckpt.load_state(res["weights"]), safeckpt.load_state(ref["weights"])
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the uninterrupted run"


@pytest.mark.parametrize("kind", KINDS)
def test_kill_before_seal_skips_torn_checkpoint_and_resume_is_exact(runs, kind):
    _check_resumed(runs["after_kill"][kind], runs["dirs"][kind], runs["results"][kind], runs["results"]["ref"])


def _expected_kept(best: str) -> list[int]:
    """save_total_limit=2 as the Trainer counts it: the best one among the two kept."""
    best_step = int(best.rsplit("-", 1)[1])
    assert best_step < STEPS - SAVE_EVERY, "the best checkpoint must be an old one for this test to mean anything"
    return [best_step, STEPS]


@pytest.mark.parametrize("kind", [*KINDS, "ref"])
def test_rotation_keeps_what_the_trainer_keeps_and_the_best(runs, kind):
    """save_total_limit=2 with an old best checkpoint: the best and the newest survive,
    in each resumed run and in the uninterrupted one, all sealed and intact."""
    folder = runs["dirs"][kind]
    best = runs["results"][kind]["best"]
    assert os.path.dirname(best) == folder
    assert _steps(folder) == _expected_kept(best)
    assert _steps(folder, sealed=False) == []
    for step in _steps(folder):
        assert safeckpt.verify(os.path.join(folder, f"checkpoint-{step}")).ok


def test_flipped_byte_in_sealed_checkpoint_is_skipped(runs, tmp_path):
    folder = tmp_path / "out"
    shutil.copytree(runs["dirs"]["ref"], folder)
    victim = folder / "checkpoint-8" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))  # same size: only a full checksum finds it
    last, messages = _last(folder)
    assert last == runs["results"]["ref"]["best"].replace(runs["dirs"]["ref"], str(folder))
    assert any(str(folder / "checkpoint-8") in m and "corrupt" in m for m in messages), messages


TRAINER_FILES = {"model.safetensors", "config.json", "generation_config.json", "optimizer.pt", "scheduler.pt",
                 "rng_state.pth", "training_args.bin", "trainer_state.json"}


@pytest.mark.parametrize("kind", ["callback", "safe"])
def test_default_checkpoints_hold_the_trainers_own_files(runs, kind):
    for step in _steps(runs["dirs"][kind]):
        path = os.path.join(runs["dirs"][kind], f"checkpoint-{step}")
        sealed = hf._committed(path)
        assert not isinstance(sealed, str), sealed
        assert set(sealed.files) == TRAINER_FILES  # each one sealed, nothing renamed or added


def test_safeckpt_layout_holds_model_files_and_no_pickle(runs):
    folder = runs["dirs"]["safeckpt"]
    for step in _steps(folder):
        path = os.path.join(folder, f"checkpoint-{step}")
        names = os.listdir(path)
        assert {"model.safetensors", "config.json", "trainer_state.json"} <= set(names)
        assert not [n for n in names if n.endswith((".pt", ".pth", ".bin", ".pkl"))], names
        state = safeckpt.load_state(path)
        assert {"optimizer", "scheduler", "rng", "trainer_state"} <= state.keys() and "model" not in state
        assert state["trainer_state"]["global_step"] == step
        assert set(state["rng"]) >= {"python", "numpy", "cpu"}


@pytest.mark.slow
@pytest.mark.parametrize("kind,point", [("callback", "external"), ("callback", "files"), ("safe", "files"),
                                        ("safeckpt", "commit"), ("safeckpt", "data")])
def test_kill_at_other_moments_then_resume_is_exact(server, runs, tmp_path, kind, point):
    """More kill moments: from outside as soon as the Trainer creates checkpoint-6 (the
    callback pauses before its seal); half way through the Trainer's optimizer.pt; the
    safeckpt layout before its tensors commit, and in the middle of its data file."""
    folder = str(tmp_path / kind)
    _kill_run(server, kind, folder, point, str(tmp_path / "killed.log"))
    ak = _after_kill(folder)
    res = _resume(server, tmp_path, "resume", [(kind, folder, ak["last"][0], str(tmp_path / "w"))], ref=False)
    _check_resumed(ak, folder, res[kind], runs["results"]["ref"])
    assert _steps(folder) == _expected_kept(res[kind]["best"]) and _steps(folder, sealed=False) == []


@pytest.mark.slow
def test_ddp_two_cpu_ranks_seal_and_resume_exactly(tmp_path):
    """torchrun, two gloo ranks: every rank's files are sealed (the seal waits for the
    per-rank RNG files), the safeckpt layout writes one checkpoint from both ranks with
    per-rank RNG states, and all resume mid-epoch to the uninterrupted result."""
    src = str(Path(safeckpt.__file__).resolve().parent.parent)
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    dirs = {k: str(tmp_path / k) for k in KINDS}

    def torchrun(name: str, resume: bool) -> dict:
        plan = {"out": str(tmp_path / f"{name}.json"), "resume": resume}
        for kind in dirs:
            plan[f"{kind}_dir"] = dirs[kind]
            plan[f"{kind}_weights"] = str(tmp_path / f"w-{name}-{kind}")
            if resume:  # the oldest kept checkpoint that is mid-epoch (6 steps per epoch on 2 ranks)
                step = next(s for s in _steps(dirs[kind]) if s % 6 and s < STEPS)
                plan[f"{kind}_ckpt"] = os.path.join(dirs[kind], f"checkpoint-{step}")
        (tmp_path / f"{name}-plan.json").write_text(json.dumps(plan))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "2", __file__, "ddp", str(tmp_path / f"{name}-plan.json")],
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=300, check=False)
        assert proc.returncode == 0, proc.stdout[-5000:]
        return json.loads(Path(plan["out"]).read_text())

    first = torchrun("first", resume=False)
    for kind in dirs:
        for step in _steps(dirs[kind]):
            path = os.path.join(dirs[kind], f"checkpoint-{step}")
            assert safeckpt.verify(path).ok and hf.checkpoint_problem(path) is None
    for kind in ("callback", "safe"):
        sealed = hf._committed(os.path.join(dirs[kind], "checkpoint-8")).files
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(sealed)  # rank 1's file too
    safe8 = safeckpt.load_state(os.path.join(dirs["safeckpt"], "checkpoint-8"))
    assert len(safe8["rng"]) == 2  # one RNG state per rank
    second = torchrun("second", resume=True)
    for kind in dirs:
        assert second[kind]["losses"] == first[kind]["losses"], kind
        got, want = safeckpt.load_state(second[kind]["weights"]), safeckpt.load_state(first[kind]["weights"])
        for name in want:
            assert torch.equal(got[name], want[name]), f"{kind}: {name}"


def test_last_checkpoint_of_missing_or_empty_folder_is_none(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hf.last_checkpoint(tmp_path / "missing") is None
        assert hf.last_checkpoint(tmp_path) is None


def test_unsupported_transformers_version_is_refused(monkeypatch):
    hf.check_transformers_version("5.24.0")
    for version in ("4.57.1", "6.0.0", "6.0.0.dev0"):
        with pytest.raises(RuntimeError, match="SafeCheckpointCallback"):
            hf.check_transformers_version(version)
    monkeypatch.setattr(hf.transformers, "__version__", "4.40.0")
    with pytest.raises(RuntimeError, match="4.40.0"):
        hf.SafeTrainer(model=None)  # refused before the Trainer does anything


def _fake_checkpoint(root, step: int, sealed: bool = True) -> str:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(100))
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if sealed:
        seal(path, step=step)
    return str(path)


def test_rotate_counts_like_the_trainer_and_never_touches_unsealed(tmp_path):
    """The Trainer's rule (keep max(limit, protected), the newest and the best
    protected) over sealed folders only."""
    paths = {s: _fake_checkpoint(tmp_path, s, sealed=(s != 3)) for s in range(1, 6)}
    assert hf.rotate(str(tmp_path), None, best=None, just_saved=None) == []
    deleted = hf.rotate(str(tmp_path), 2, best=paths[2], just_saved=paths[5])
    assert sorted(deleted) == [paths[1], paths[4]]  # 5 newest, 2 best; 3 not sealed: not counted
    assert [s for s, _ in hf._checkpoints(tmp_path)] == [2, 3, 5]
    assert hf.rotate(str(tmp_path), 1, best=paths[2], just_saved=paths[5]) == []  # both protected
    assert hf.rotate(str(tmp_path), 1, best=None, just_saved=paths[5]) == [paths[2]]
    assert [s for s, _ in hf._checkpoints(tmp_path)] == [3, 5]


def test_rotate_keeps_the_one_just_saved_below_a_newer_sealed_one(tmp_path):
    """A resumed run re-saving step 4 while an older run's sealed 6 is still there:
    neither the newest sealed one nor the one just saved is deleted."""
    paths = {s: _fake_checkpoint(tmp_path, s) for s in (2, 4, 6)}
    assert hf.rotate(str(tmp_path), 1, best=None, just_saved=paths[4]) == [paths[2]]


def test_callback_removes_a_stale_folder_and_pauses_the_trainers_rotation_only_while_saving(tmp_path):
    from types import SimpleNamespace

    path = _fake_checkpoint(tmp_path, 6)
    cb = hf.SafeCheckpointCallback()
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True, save_total_limit=2, save_strategy="steps")
    cb.on_step_end(args, SimpleNamespace(global_step=6), SimpleNamespace(should_save=False, should_evaluate=False))
    assert hf.checkpoint_problem(path) is None and args.save_total_limit == 2  # not saving this step
    cb.on_step_end(args, SimpleNamespace(global_step=6), SimpleNamespace(should_save=True, should_evaluate=False))
    assert not os.path.exists(path)  # an older run's folder of this step: gone, manifest first
    assert args.save_total_limit is None  # the Trainer does not rotate before the seal
    cb.on_step_begin(args, SimpleNamespace(global_step=7), None)  # the window ended without a save
    assert args.save_total_limit == 2


# ----------------------------------------------------------------------------- seal

def test_seal_checksums_every_file_and_verify_finds_a_flip(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "sub" / "weights.bin").write_bytes(os.urandom(50_000))
    info = seal(tmp_path, step=7, metadata={"by": "test"})
    assert sorted(info.files) == ["config.json", "sub/weights.bin"] and info.step == 7 and info.seq == 1
    assert safeckpt.verify(tmp_path).ok
    data = bytearray((tmp_path / "sub" / "weights.bin").read_bytes())
    data[123] ^= 0xFF
    (tmp_path / "sub" / "weights.bin").write_bytes(bytes(data))
    report = safeckpt.verify(tmp_path)
    assert not report.ok and "sub/weights.bin" in report.problems[0]


def test_reseal_after_change_writes_a_higher_sequence(tmp_path):
    (tmp_path / "a.json").write_text("one")
    assert seal(tmp_path, step=1, metadata={"x": 1}).seq == 1
    (tmp_path / "a.json").write_text("two")  # same size, new bytes
    assert not safeckpt.verify(tmp_path).ok
    info = seal(tmp_path)
    assert info.seq == 2 and info.step == 1 and info.metadata == {"x": 1}
    assert sorted(os.listdir(tmp_path)) == ["a.json", "manifest-000002.json"]
    assert safeckpt.verify(tmp_path).ok


def test_seal_over_a_safeckpt_save_keeps_its_tensors(tmp_path):
    safeckpt.save({"w": torch.arange(6.0), "n": 3}, tmp_path, metadata={"kind": "k"})
    (tmp_path / "extra.json").write_text("{}")
    info = seal(tmp_path)
    assert info.seq == 2 and "extra.json" in info.files and info.metadata == {"kind": "k"}
    state = safeckpt.load_state(tmp_path)
    assert torch.equal(state["w"], torch.arange(6.0)) and state["n"] == 3
    assert safeckpt.verify(tmp_path).ok


def test_seal_refuses_empty_folders_and_unnameable_files(tmp_path):
    with pytest.raises(safeckpt.CheckpointNotFoundError):
        seal(tmp_path / "nothing")
    (tmp_path / "ok.json").write_text("x")
    bad = ["a b.bin", "-x.bin", "..x", "sub/caf\u00e9.bin"]
    for name in bad:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    with pytest.raises(safeckpt.InvalidFileNameError) as exc:
        safeckpt.seal(tmp_path)
    assert isinstance(exc.value, safeckpt.CheckpointError) and isinstance(exc.value, ValueError)
    assert sorted(exc.value.problems) == sorted(bad)
    assert all(repr(name) in str(exc.value) for name in bad) and "§2.5" in str(exc.value)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("manifest-")]  # nothing written


def test_seal_covers_the_hidden_index_of_a_dcp_folder(tmp_path):
    """FSDP's SHARDED_STATE_DICT under Accelerate or the Trainer is a
    torch.distributed.checkpoint folder, which cannot be loaded without its ``.metadata``
    index: it is sealed with it, so a damaged index is found. The temporary file an
    interrupted replacement of safeckpt left is garbage, not part of the seal."""
    import torch.distributed.checkpoint as dcp
    from damage import assert_a_flipped_byte_is_found  # tests/helpers: not on the path of this file's children

    (tmp_path / "trainer_state.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as one process
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path / "pytorch_model_fsdp_0"))
    temp = tmp_path / ".trainer_state.json.safeckpt-0123456789ab.tmp"
    temp.write_text("{")
    info = safeckpt.seal(tmp_path)
    assert "pytorch_model_fsdp_0/.metadata" in info.files and temp.name not in info.files
    assert safeckpt.verify(tmp_path).ok
    back = {"w": torch.zeros(6)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=str(tmp_path / "pytorch_model_fsdp_0"))
    assert torch.equal(back["w"], torch.arange(6.0))
    assert_a_flipped_byte_is_found(tmp_path, "pytorch_model_fsdp_0/.metadata")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
    if sys.argv[1:] == ["serve"]:
        serve()
    else:  # run one child mode directly (debugging)
        torch.set_num_threads(1)
        CHILDREN[sys.argv[1]](sys.argv[2])
