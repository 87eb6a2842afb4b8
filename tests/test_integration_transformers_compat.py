"""The Trainer integrations behave as the stock Trainer where users and their tools
look: what the upstream Trainer checkpoint tests showed (docs/testing.md runs those
tests with safeckpt swapped in), checked here with our own tiny runs.

Each run is a tiny GPT-2 built from a config (no download) for a few steps on generated
tokens, in this process.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.integrations import transformers as hf  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seed: int = 0) -> None:
        self.data = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def trainer(kind: str, out: Path, model=None, callbacks=(), compute_metrics=None, **args):
    from transformers import Trainer, TrainingArguments

    settings = {"output_dir": str(out), "max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
                "save_strategy": "steps", "save_steps": 2, "report_to": [], "seed": 3, "use_cpu": True,
                "disable_tqdm": True, "dataloader_num_workers": 0, **args}
    data = {"model": gpt2() if model is None else model, "args": TrainingArguments(**settings),
            "train_dataset": Tokens(), "eval_dataset": Tokens(8, seed=1), "compute_metrics": compute_metrics}
    if kind == "callback":
        return Trainer(**data, callbacks=[*callbacks, hf.SafeCheckpointCallback()])
    return hf.SafeTrainer(**data, callbacks=list(callbacks),
                          checkpoint_layout="safeckpt" if kind == "safeckpt" else "trainer")


def first_is_best() -> dict:
    """Evaluation settings under which the first evaluation stays the best one."""
    calls = []

    def score(_) -> dict:
        calls.append(1)
        return {"score": -len(calls)}
    return {"eval_strategy": "steps", "eval_steps": 2, "compute_metrics": score, "metric_for_best_model": "score",
            "greater_is_better": True}


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def holds(model, path: Path) -> bool:
    """The model's weights are those of ``path``'s model.safetensors (which drops the
    tied lm_head, as save_pretrained does)."""
    saved, have = load_file(str(path / "model.safetensors")), weights(model)
    return bool(saved) and all(torch.equal(have[k], v) for k, v in saved.items())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One SafeTrainer run of 4 steps saving at 2 and 4, and its final weights."""
    out = tmp_path_factory.mktemp("compat") / "out"
    t = trainer("safe", out)
    t.train()
    return {"out": out, "weights": weights(t.model)}


def copy_of(run: dict, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run["out"], tmp_path / "out")
    return tmp_path / "out"


# -- resuming ------------------------------------------------------------------------------

def test_resume_true_without_a_checkpoint_raises_the_trainers_error(tmp_path):
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer("safe", tmp_path / "fresh").train(resume_from_checkpoint=True)


def test_resume_from_a_missing_folder_raises_the_trainers_error(tmp_path):
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        trainer("safe", tmp_path / "out").train(resume_from_checkpoint=str(tmp_path / "checkpoint-9-bogus"))


def reshard_by_hand(ckpt: Path) -> None:
    """Split model.safetensors into two shards and an index, as the stock Trainer loads."""
    state = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(ckpt / shard), metadata={"format": "pt"})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))


def test_named_checkpoint_resharded_by_hand_resumes_exactly_with_a_warning(run, tmp_path):
    """model.safetensors split into shards after the seal: the files the seal names
    that remain are checked, the change is reported, and the run ends where the
    uninterrupted one did."""
    out = copy_of(run, tmp_path)
    reshard_by_hand(out / "checkpoint-2")
    t = trainer("safe", out, model=gpt2(seed=9))
    with pytest.warns(UserWarning, match="model.safetensors removed"):
        t.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert same(weights(t.model), run["weights"])


def test_safeckpt_layout_resharded_by_hand_is_refused(tmp_path):
    """Its data file is read through the seal, which no longer matches the folder."""
    trainer("safeckpt", tmp_path / "out", max_steps=2).train()
    reshard_by_hand(tmp_path / "out" / "checkpoint-2")
    with pytest.raises(safeckpt.CorruptCheckpointError, match="model.safetensors removed since it was sealed"):
        trainer("safeckpt", tmp_path / "out").train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))


def test_named_checkpoint_with_a_flipped_byte_is_refused(run, tmp_path):
    out = copy_of(run, tmp_path)
    victim = out / "checkpoint-2" / "optimizer.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(safeckpt.CorruptCheckpointError, match="optimizer.pt"):
        trainer("safe", out).train(resume_from_checkpoint=str(out / "checkpoint-2"))


def test_named_folder_without_a_seal_is_refused_with_the_way_to_seal_it(run, tmp_path):
    out = copy_of(run, tmp_path)
    ckpt = out / "checkpoint-2"
    for name in os.listdir(ckpt):
        if name.startswith("manifest-"):
            os.remove(ckpt / name)
    with pytest.raises(safeckpt.CorruptCheckpointError, match=r"not sealed.*safeckpt.seal"):
        trainer("safe", out).train(resume_from_checkpoint=str(ckpt))
    safeckpt.seal(ckpt, step=2)  # complete, written without safeckpt: sealing it makes it one
    t = trainer("safe", out, model=gpt2(seed=9))
    t.train(resume_from_checkpoint=str(ckpt))
    assert same(weights(t.model), run["weights"])


@pytest.mark.parametrize("kind", ["safe", "safeckpt"])
def test_model_with_its_own_load_state_dict_resumes(tmp_path, kind):
    """A model whose buffer grows as it trains, resized by its own load_state_dict
    (issue 24 item 12): the resumed run ends with the uninterrupted run's buffer."""
    class Logged(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 64)
            self.register_buffer("seen", torch.empty(0, dtype=torch.long))

        def load_state_dict(self, state_dict, strict=True, assign=False):
            if state_dict["seen"].shape != self.seen.shape:
                self.seen = state_dict["seen"].clone()
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

        def forward(self, input_ids, labels=None):
            self.seen = torch.cat([self.seen, input_ids[:, 0]])
            logits = self.fc(input_ids.float())
            return {"loss": torch.nn.functional.cross_entropy(logits, labels[:, 0]), "logits": logits}

    torch.manual_seed(0)
    first = trainer(kind, tmp_path / "a", model=Logged())
    first.train()
    torch.manual_seed(1)
    resumed = trainer(kind, tmp_path / "b", model=Logged())
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert torch.equal(resumed.model.seen, first.model.seen) and len(first.model.seen) == 16
    assert same(weights(resumed.model), weights(first.model))


# -- rotation and the best checkpoint ---------------------------------------------------------

def test_callback_leaves_save_total_limit_as_the_user_set_it(tmp_path):
    t = trainer("callback", tmp_path / "out", save_total_limit=1)
    assert t.args.save_total_limit == 1
    t.train()
    assert t.args.save_total_limit == 1
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-4"]


@pytest.mark.parametrize("kind", ["callback", "safe"])
def test_limit_of_one_keeps_the_old_best_beside_the_newest_and_only_the_best_at_the_end(tmp_path, kind):
    """The Trainer's save_total_limit=1 with a best checkpoint: while training the
    newest sealed one stays beside the best; once training ends only the best is left,
    and load_best_model_at_end loads it."""
    kept = []

    from transformers import TrainerCallback

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            kept.append(sorted(os.listdir(args.output_dir)) if os.path.isdir(args.output_dir) else [])

    t = trainer(kind, tmp_path / "out", callbacks=[Watch()], max_steps=6, save_total_limit=1,
                load_best_model_at_end=True, **first_is_best())
    t.train()
    assert t.state.best_model_checkpoint == str(tmp_path / "out" / "checkpoint-2")
    assert kept[-1] == ["checkpoint-2", "checkpoint-4"]  # before step 6: the best and the newest
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-2"]
    assert holds(t.model, tmp_path / "out" / "checkpoint-2")


def test_a_damaged_best_checkpoint_is_not_loaded_at_the_end(tmp_path):
    from transformers import TrainerCallback

    class Damage(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 4:  # the last save: damage the best one, saved at step 2
                victim = Path(args.output_dir) / "checkpoint-2" / "model.safetensors"
                data = bytearray(victim.read_bytes())
                data[-10] ^= 0x01
                victim.write_bytes(bytes(data))

    t = trainer("safe", tmp_path / "out", callbacks=[Damage()], load_best_model_at_end=True, **first_is_best())
    with pytest.warns(UserWarning, match=r"not loading .*checkpoint-2: corrupt"):
        t.train()
    assert holds(t.model, tmp_path / "out" / "checkpoint-4")


# -- a resumed run over an older run's checkpoints ------------------------------------------------

def scores(*values: float) -> dict:
    """Evaluations every 2 steps whose ``score`` (greater is better) takes ``values`` in turn."""
    left = list(values)
    return {"eval_strategy": "steps", "eval_steps": 2, "compute_metrics": lambda _: {"score": left.pop(0)},
            "metric_for_best_model": "score", "greater_is_better": True, "max_steps": 8}


def seals(out: Path) -> dict[str, str | None]:
    """Each checkpoint's seal (its save id), None for a folder without one."""
    from safeckpt.integrations._sealed import seal_of
    return {p.name: (m.save_id if (m := seal_of(str(p))) else None) for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def older_run(tmp_path_factory) -> dict:
    """A run saving (sealed) at 2, 4, 6 and 8, evaluating before each save; the best
    score at step 4 is 2."""
    out = tmp_path_factory.mktemp("older") / "out"
    trainer("callback", out, **scores(1, 2, 3, 4)).train()
    return {"out": out, "seals": seals(out)}


@pytest.mark.parametrize("kind", ["callback", "safe"])
def test_a_resumed_best_strategy_run_replaces_only_the_checkpoints_it_saves(older_run, tmp_path, kind):
    """Resumed from checkpoint-4 with save_strategy="best": step 6 is a new best and is
    saved (the older run's folder replaced, then sealed), step 8 is not, so the older
    run's sealed checkpoint-8 must stay as it was, as the stock Trainer keeps it."""
    out = copy_of(older_run, tmp_path)
    t = trainer(kind, out, save_strategy="best", **scores(5, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", safeckpt.SafeckptWarning)
        t.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    now, before = seals(out), older_run["seals"]
    assert list(now) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"], now
    assert {k: now[k] for k in ("checkpoint-2", "checkpoint-4", "checkpoint-8")} == \
        {k: before[k] for k in ("checkpoint-2", "checkpoint-4", "checkpoint-8")}  # untouched
    assert now["checkpoint-6"] not in (None, before["checkpoint-6"])  # saved again, sealed anew
    history = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    assert [e["eval_score"] for e in history if "eval_score" in e] == [1, 2, 5]  # the resumed run's files
    for name in now:
        assert hf.checkpoint_problem(str(out / name)) is None, name
    assert hf.last_checkpoint(out) == str(out / "checkpoint-8")


def test_a_resumed_best_strategy_run_with_two_evaluation_datasets(older_run, tmp_path):
    """With a dict of evaluation datasets the callback hears ``on_evaluate`` once per
    dataset, and only the second carries ``metric_for_best_model``: the new best at step
    6 is still seen in time to replace the older run's checkpoint-6 (sealed, no
    warning), and checkpoint-8 is kept."""
    out = copy_of(older_run, tmp_path)
    left = [9, 5, 9, 0]  # (a, b) at step 6, then at step 8; the best so far is 2
    t = trainer("callback", out, save_strategy="best", eval_strategy="steps", eval_steps=2, max_steps=8,
                compute_metrics=lambda _: {"score": left.pop(0)}, metric_for_best_model="b_score",
                greater_is_better=True)
    t.eval_dataset = {"a": Tokens(8, seed=1), "b": Tokens(8, seed=2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", safeckpt.SafeckptWarning)
        t.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    now, before = seals(out), older_run["seals"]
    assert not left and now["checkpoint-8"] == before["checkpoint-8"]
    assert now["checkpoint-6"] not in (None, before["checkpoint-6"])
    assert hf.checkpoint_problem(str(out / "checkpoint-6")) is None


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_callback_forcing_a_save_over_an_older_checkpoint(older_run, tmp_path, order):
    """A resumed run that saves nothing by itself; a callback forces a save at step 6 in
    ``on_evaluate``, which the Trainer writes into the older run's sealed checkpoint-6.
    Listed before SafeCheckpointCallback, the old folder is deleted first and the new
    save sealed. Listed after it, the callback decided before the save was forced, so the
    folder may mix both saves: it loses its seal and is not sealed again (a warning says
    why). Nothing else is touched either way."""
    from transformers import TrainerCallback

    class SaveAt6(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            if state.global_step == 6:
                control.should_save = True

    out = copy_of(older_run, tmp_path)
    t = trainer("callback", out, callbacks=[SaveAt6()] if order == "before" else [], save_strategy="no",
                **scores(0, 0))
    if order == "after":
        t.add_callback(SaveAt6())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    said = [str(w.message) for w in caught if issubclass(w.category, safeckpt.SafeckptWarning)]
    now, before = seals(out), older_run["seals"]
    assert {k: v for k, v in now.items() if k != "checkpoint-6"} == {k: v for k, v in before.items() if k != "checkpoint-6"}
    if order == "before":
        assert now["checkpoint-6"] not in (None, before["checkpoint-6"]) and not said, said
        assert hf.checkpoint_problem(str(out / "checkpoint-6")) is None
    else:
        assert now["checkpoint-6"] is None
        assert len(said) == 1 and "checkpoint-6 into the sealed checkpoint an older run left" in said[0], said
    assert hf.last_checkpoint(out) == str(out / "checkpoint-8")


# -- just-in-time checkpoints ------------------------------------------------------------------

def test_jit_checkpoint_of_safetrainer_is_sealed(tmp_path):
    """enable_jit_checkpoint: the Trainer saves on SIGTERM from its own callback, into a
    folder holding its in-progress marker. SafeTrainer seals that save like any other."""
    from transformers import TrainerCallback
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    class RequestAtStep3(TrainerCallback):
        def __init__(self) -> None:
            self.trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:
                jit = next(c for c in self.trainer.callback_handler.callbacks if isinstance(c, JITCheckpointCallback))
                jit.jit_manager.is_checkpoint_requested = True  # what its SIGTERM handler sets

    request = RequestAtStep3()
    t = trainer("safe", tmp_path / "out", callbacks=[request], max_steps=8, save_steps=100,
                enable_jit_checkpoint=True)
    request.trainer = t
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.train()
    folders = sorted(os.listdir(tmp_path / "out"))
    assert len(folders) == 1, folders
    path = str(tmp_path / "out" / folders[0])
    assert hf.checkpoint_problem(path) is None and hf.last_checkpoint(tmp_path / "out") == path
    assert "checkpoint-is-incomplete.txt" not in os.listdir(path)
