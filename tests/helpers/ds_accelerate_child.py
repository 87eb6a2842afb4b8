"""One Accelerate run with a DeepSpeed ZeRO-2 plugin on the CPU accelerator (one
process), saving through ``safeckpt.integrations.accelerate``, for
tests/test_integration_deepspeed_hf.py.

    python ds_accelerate_child.py killed ROOT POINT [LAYOUT]   # SIGKILLs itself during the save of step KILL_AT
    python ds_accelerate_child.py resume ROOT RESULT [LAYOUT]
    python ds_accelerate_child.py reference ROOT RESULT

A small MLP trains STEPS steps (the batch of step k is seeded by k), saving every
SAVE_EVERY steps with keep_last=2 in LAYOUT (``accelerate``, the default: Accelerate's
own files, DeepSpeed's stock engine writing its tag; or ``safeckpt``); the resumed run
starts from another random model. Kill points: ``seal`` (``accelerate``: every file
written, before the seal, so step 6 is torn; ``safeckpt``: after the engine's tag and
the manager's commit, before the seal: step 6 is committed, its tag by its own
manifest) and ``tag`` (``safeckpt``: inside DeepSpeed's save_checkpoint: step 6 never
commits).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from ds_trainer_child import _die, _single_process_env

STEPS, SAVE_EVERY, KILL_AT = 8, 2, 6


def run(root: str, seed: int, resume: bool, layout: str = "accelerate") -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from safeckpt.integrations.accelerate import load_state, save_state

    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
                                           "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
                                           "steps_per_print": 10 ** 9})
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # (with cpu=True Accelerate would skip DeepSpeed)
    acc = Accelerator(deepspeed_plugin=plugin)
    assert acc.distributed_type == "DEEPSPEED", acc.distributed_type
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    start = (load_state(acc, root) or 0) if resume else 0
    losses = {}
    for step in range(start + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses[step] = loss.item()
        if step % SAVE_EVERY == 0:
            save_state(acc, root, step, keep_last=2, layout=layout)
    h = hashlib.sha256()
    for name, t in sorted(model.module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return {"weights": h.hexdigest(), "losses": losses, "start": start, "lr": sched.get_last_lr()}


def main(argv: list[str]) -> None:
    _single_process_env()
    mode, root = argv[:2]
    layout = argv[3] if len(argv) > 3 else "accelerate"
    if mode == "killed":
        from safeckpt.integrations import accelerate as sacc
        from safeckpt.integrations import deepspeed as sds
        if layout == "accelerate":  # every file written, before the seal
            real_seal = sacc.seal

            def seal(path, **kwargs):
                if str(path).endswith(f"step-{KILL_AT:09d}"):
                    _die()
                return real_seal(path, **kwargs)
            sacc.seal = seal
        elif argv[2] == "tag":  # inside DeepSpeed's save_checkpoint, after the model file
            real_write = sds.SafeCheckpointEngine.save

            def write(self, state_dict, path):
                real_write(self, state_dict, path)
                if f"step-{KILL_AT:09d}" in path:
                    _die()
            sds.SafeCheckpointEngine.save = write
        else:  # after the tag and the manager's commit, before the seal
            real_save = sacc.CheckpointManager.save

            def save(self, step, state, **kwargs):
                info = real_save(self, step, state, **kwargs)
                if step == KILL_AT:
                    _die()
                return info
            sacc.CheckpointManager.save = save
        run(root, 0, resume=False, layout=layout)
        raise AssertionError("the run was not killed")
    result = run(root, 1234 if mode == "resume" else 0, resume=mode == "resume", layout=layout)
    with open(argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
