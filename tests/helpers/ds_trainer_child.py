"""One Hugging Face ``SafeTrainer`` run with DeepSpeed ZeRO-2 on the CPU accelerator
(``use_cpu=True``, one process), for tests/test_integration_deepspeed_hf.py.

    python ds_trainer_child.py killed OUT POINT [KIND]   # SIGKILLs itself during the save of step KILL_AT
    python ds_trainer_child.py resume OUT RESULT [KIND]  # resumes from last_checkpoint(OUT), model seed 1234
    python ds_trainer_child.py reference OUT RESULT

KIND is ``safe`` (``SafeTrainer``, its default layout: the Trainer's and DeepSpeed's own
files), ``safeckpt`` (``SafeTrainer(checkpoint_layout="safeckpt")``: DeepSpeed writes
through safeckpt's checkpoint engine) or ``callback`` (a plain ``Trainer`` with
``SafeCheckpointCallback``).

A tiny GPT-2 built from a config (no download) trains STEPS steps on generated tokens,
saving every SAVE_EVERY steps. Kill points: ``tag`` (``safeckpt``: inside DeepSpeed's
save_checkpoint, after rank 0 wrote its model file), ``seal`` (DeepSpeed's tag and the
RNG files and trainer state written, before checkpoint-N is sealed).
RESULT gets the losses and a hash of the final weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import time

STEPS, SAVE_EVERY, KILL_AT = 8, 2, 6
DS_CONFIG = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
             "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}


def _single_process_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"})


def _trainer(out: str, seed: int, kind: str = "safe"):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from safeckpt.integrations.transformers import SafeCheckpointCallback, SafeTrainer

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.data = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.data[i], "labels": self.data[i]}

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=5e-3,
                             logging_steps=1, save_strategy="steps", save_steps=SAVE_EVERY, save_total_limit=2,
                             report_to=[], seed=42, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                             deepspeed=DS_CONFIG)
    if kind == "callback":
        return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[SafeCheckpointCallback()])
    return SafeTrainer(model=model, args=args, train_dataset=Tokens(),
                       checkpoint_layout="safeckpt" if kind == "safeckpt" else "trainer")


def _result(trainer, path: str) -> None:
    h = hashlib.sha256()
    for name, t in sorted(trainer.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    losses = {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e}
    with open(path, "w") as f:
        json.dump({"weights": h.hexdigest(), "losses": losses, "step": trainer.state.global_step}, f)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def killed(out: str, point: str, kind: str) -> None:
    from safeckpt.integrations import deepspeed as sds
    from safeckpt.integrations import transformers as hf

    if point == "tag":
        real_save = sds.SafeCheckpointEngine.save

        def save(self, state_dict, path):
            real_save(self, state_dict, path)
            if f"checkpoint-{KILL_AT}" in path:
                _die()
        sds.SafeCheckpointEngine.save = save
    else:
        real_seal = hf.seal

        def seal(path, **kwargs):
            if path.endswith(f"checkpoint-{KILL_AT}"):
                _die()
            return real_seal(path, **kwargs)
        hf.seal = seal
    _trainer(out, seed=0, kind=kind).train()
    raise AssertionError("the run was not killed")


def main(argv: list[str]) -> None:
    _single_process_env()
    mode, out, arg = argv[:3]
    kind = argv[3] if len(argv) > 3 else "safe"
    if mode == "killed":
        killed(out, arg, kind)
    elif mode == "resume":
        from safeckpt.integrations.transformers import last_checkpoint
        t = _trainer(out, seed=1234, kind=kind)
        t.train(resume_from_checkpoint=last_checkpoint(out) if kind == "callback" else True)
        _result(t, arg)
    else:
        t = _trainer(out, seed=0)
        t.train()
        _result(t, arg)


if __name__ == "__main__":
    main(sys.argv[1:])
