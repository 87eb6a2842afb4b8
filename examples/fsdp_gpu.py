"""The real sharded GPU paths, for a machine with GPUs (the tests run them on CPU):

    .venv/bin/torchrun --nproc-per-node 2 examples/fsdp_gpu.py --dir /tmp/fsdp-gpu

1. ``dcp.save`` / ``dcp.load`` of an FSDP2 model and its optimizer on CUDA through
   ``safeckpt.dcp.Writer`` / ``Reader`` (NCCL for the training, a separate gloo group for
   ``dcp.async_save``), checked bit for bit against the state before the save;
2. the Hugging Face ``SafeTrainer`` with Accelerate's FSDP plugin (FSDP2) on a tiny GPT-2
   built from a config, in each checkpoint layout (the Trainer's own FSDP files, sealed;
   safeckpt's sharded data file): trains 4 steps saving every 2, then a second trainer
   from another random model resumes from ``checkpoint-2`` and must end with the same
   weights.

Prints one line per check and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def _full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": dict(msd), "optim": osd["state"]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def check_dcp(folder: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import safeckpt.dcp

    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).cuda()
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = build(0)
    model(torch.randn(8, 64, device="cuda")).square().mean().backward()
    opt.step()
    expected = _full(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=safeckpt.dcp.Writer(f"{folder}/dcp"))
    future = dcp.async_save({"model": msd, "optim": osd}, storage_writer=safeckpt.dcp.Writer(f"{folder}/dcp-async"),
                            process_group=dist.new_group(backend="gloo"))
    future.result()
    ok = True
    for name in ("dcp", "dcp-async"):
        fresh, fresh_opt = build(1)
        msd, osd = get_state_dict(fresh, fresh_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=safeckpt.dcp.Reader(f"{folder}/{name}"))
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        ok &= _same(_full(fresh, fresh_opt), expected)
    return ok


def check_trainer(folder: str, layout: str) -> bool:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from safeckpt.integrations.transformers import SafeTrainer

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            ids = torch.arange(i, i + 16) % 100
            return {"input_ids": ids, "labels": ids}

    def trainer(seed: int, steps: int) -> SafeTrainer:
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=16))
        args = TrainingArguments(output_dir=f"{folder}/trainer-{layout}", max_steps=steps, save_steps=2,
                                 per_device_train_batch_size=4, report_to=[], seed=seed, data_seed=0,
                                 fsdp="full_shard", fsdp_config={"fsdp_version": 2})
        return SafeTrainer(model=model, args=args, train_dataset=Tokens(), checkpoint_layout=layout)

    first = trainer(0, 4)
    first.train()
    reference = {k: v.full_tensor().cpu() if hasattr(v, "full_tensor") else v.cpu()
                 for k, v in first.model.state_dict().items()}
    second = trainer(1, 4)
    second.train(resume_from_checkpoint=f"{folder}/trainer-{layout}/checkpoint-2")
    got = {k: v.full_tensor().cpu() if hasattr(v, "full_tensor") else v.cpu()
           for k, v in second.model.state_dict().items()}
    return _same(got, reference)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: this script checks the CUDA paths; the CPU paths are in tests/test_dcp.py")
        return 0
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("cpu:gloo,cuda:nccl")
    failed = 0
    from functools import partial
    for name, check in (("dcp save/async_save/load, FSDP2 on CUDA", check_dcp),
                        ("SafeTrainer with FSDP2 (the Trainer's files, sealed), resume",
                         partial(check_trainer, layout="trainer")),
                        ("SafeTrainer with FSDP2 (checkpoint_layout='safeckpt'), resume",
                         partial(check_trainer, layout="safeckpt"))):
        ok = check(args.dir)
        failed += not ok
        if dist.get_rank() == 0:
            print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
