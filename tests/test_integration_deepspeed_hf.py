"""The Hugging Face Trainer and Accelerate with DeepSpeed ZeRO-2 (CPU accelerator):
``SafeTrainer`` and ``safeckpt.integrations.accelerate``, in their default layouts (the
tools' own files, sealed) and in the safeckpt layout, killed mid-save, resumed
bit-exactly in a fresh process.

Each run is a fresh process (tests/helpers/ds_trainer_child.py): a tiny GPT-2 from a
config trains 8 steps, saving every 2. The killed run dies during the save of step 6;
``last_checkpoint`` must skip the torn ``checkpoint-6`` with a warning, and a fresh
process that starts from a *different* random model and resumes from ``checkpoint-4``
must end with the same weights, bit for bit, and the same losses as a run that was
never interrupted. Accelerate (tests/helpers/ds_accelerate_child.py) likewise: killed
during the save of step 6, ``load_state`` in a fresh process from another random
model resumes from the newest committed step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import safeckpt  # noqa: E402
from safeckpt.protocol.checkpoint import read_committed  # noqa: E402
from safeckpt.integrations import transformers as hf  # noqa: E402
from safeckpt.storage import LocalStorage  # noqa: E402

pytestmark = pytest.mark.timeout(600)

HELPERS = Path(__file__).resolve().parent / "helpers"
SRC = str(Path(safeckpt.__file__).resolve().parent.parent)
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}


def child(*args: str, script: str = "ds_trainer_child.py") -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV,
           "PYTHONPATH": os.pathsep.join([SRC, str(HELPERS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(HELPERS / script), *args], env=env, timeout=300,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, deepspeed_ops) -> dict:
    folder = tmp_path_factory.mktemp("reference")
    done = child("reference", str(folder / "out"), str(folder / "result.json"))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((folder / "result.json").read_text())


def kill_then_resume(tmp_path: Path, point: str, reference: dict, kind: str = "safe") -> Path:
    out = tmp_path / "out"
    killed = child("killed", str(out), point, kind)
    assert killed.returncode == -9, f"not killed (exit {killed.returncode}):\n{killed.stderr[-4000:]}"
    with pytest.warns(UserWarning, match="checkpoint-6"):
        assert hf.last_checkpoint(out) == str(out / "checkpoint-4")
    resumed = child("resume", str(out), str(tmp_path / "result.json"), kind)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["step"] == 8
    assert got["losses"] == reference["losses"]
    assert got["weights"] == reference["weights"], "resumed weights differ from the uninterrupted run"
    return out


@pytest.mark.slow
def test_safetrainer_zero2_killed_before_seal_resumes_bit_exact(tmp_path, reference):
    """The default layout: the Trainer's files and DeepSpeed's own tag, one seal."""
    out = kill_then_resume(tmp_path, "seal", reference)
    newest = out / "checkpoint-8"
    m = read_committed(LocalStorage(newest))
    assert {"trainer_state.json", "latest", "rng_state.pth", "global_step8/mp_rank_00_model_states.pt",
            "global_step8/zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= set(m.files)
    assert not [n for n in m.files if "manifest" in n]  # DeepSpeed wrote its tag itself
    assert safeckpt.verify(str(newest)).ok
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6", "checkpoint-8"]  # save_total_limit=2


@pytest.mark.slow
def test_safetrainer_safeckpt_layout_zero2_killed_before_seal_resumes_bit_exact(tmp_path, reference):
    out = kill_then_resume(tmp_path, "seal", reference, kind="safeckpt")
    # the newest checkpoint: one commit over the model, global_step8/, latest, RNG and trainer state
    newest = out / "checkpoint-8"
    m = read_committed(LocalStorage(newest))
    assert {"trainer_state.json", "latest", "rng_state.pth", "global_step8/mp_rank_00_model_states.pt",
            "global_step8/zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= set(m.files)
    assert safeckpt.verify(str(newest)).ok
    assert (newest / "latest").read_text() == "global_step8"
    assert safeckpt.verify(str(newest / "global_step8")).ok  # DeepSpeed's tag is committed on its own too
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6", "checkpoint-8"]  # save_total_limit=2


@pytest.mark.slow
def test_safetrainer_zero2_killed_inside_deepspeed_save_resumes_bit_exact(tmp_path, reference):
    kill_then_resume(tmp_path, "tag", reference, kind="safeckpt")


@pytest.mark.slow
def test_callback_with_deepspeed_killed_before_seal_resumes_bit_exact(tmp_path, reference):
    """A plain Trainer with SafeCheckpointCallback: DeepSpeed writes global_stepN/ itself
    (the callback cannot reach the engine), the callback seals checkpoint-N."""
    out = kill_then_resume(tmp_path, "seal", reference, kind="callback")
    assert safeckpt.verify(str(out / "checkpoint-8")).ok


@pytest.fixture(scope="module")
def accelerate_reference(tmp_path_factory, deepspeed_ops) -> dict:
    folder = tmp_path_factory.mktemp("accelerate-reference")
    done = child("reference", str(folder / "run"), str(folder / "result.json"), script="ds_accelerate_child.py")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((folder / "result.json").read_text())


@pytest.mark.parametrize("layout,point,resumes_at", [
    ("accelerate", "seal", 4), pytest.param("safeckpt", "tag", 4, marks=pytest.mark.slow),
    pytest.param("safeckpt", "seal", 6, marks=pytest.mark.slow)])
def test_accelerate_zero2_killed_mid_save_resumes_bit_exact(tmp_path, accelerate_reference, layout, point,
                                                            resumes_at):
    root = tmp_path / "run"
    killed = child("killed", str(root), point, layout, script="ds_accelerate_child.py")
    assert killed.returncode == -9, f"not killed (exit {killed.returncode}):\n{killed.stderr[-4000:]}"
    resumed = child("resume", str(root), str(tmp_path / "result.json"), layout, script="ds_accelerate_child.py")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["start"] == resumes_at
    want = accelerate_reference
    assert {k: v for k, v in want["losses"].items() if int(k) > resumes_at} == got["losses"]
    assert got["weights"] == want["weights"] and got["lr"] == want["lr"]
    # keep_last=2, one commit per step over the engine's tag and the rest
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-000000006", "step-000000008"]
    newest = root / "step-000000008"
    m = read_committed(LocalStorage(newest))
    assert "pytorch_model/mp_rank_00_model_states.pt" in m.files
    # the safeckpt layout commits DeepSpeed's tag on its own too; the default leaves it stock
    assert ("pytorch_model/manifest-000001.json" in m.files) == (layout == "safeckpt")
    assert safeckpt.verify(str(newest)).ok
