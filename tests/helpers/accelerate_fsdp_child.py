"""One rank of an Accelerate FSDP run with ``SHARDED_STATE_DICT`` (launched by
``torch.distributed.run`` from test_integration_accelerate.py).

Accelerate runs FSDP only on accelerators and falls back to DDP on CPU, so the
Accelerator is told it is an FSDP run, as it is on GPUs; the model is sharded by FSDP2's
``fully_shard`` over the gloo group. ``save_state`` then writes what it writes under FSDP
(``pytorch_model_fsdp_0/`` and ``optimizer_0/``, torch.distributed.checkpoint folders
whose index is ``.metadata``) and seals it. A fresh model then resumes from it with
``load_state``; rank 0 writes what it saw to ``<root>.json``.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist


def fsdp_accelerator():
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT", fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerator.state.distributed_type = DistributedType.FSDP  # what it is on GPUs
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def sharded_model(accelerator, seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    accelerator._models.append(model)  # as accelerator.prepare registers them under FSDP
    accelerator._optimizers.append(opt)
    return model, opt


def local_state(model, opt) -> dict[str, torch.Tensor]:
    """This rank's shards of the parameters and of the optimizer's moments."""
    out = {f"p.{n}": p.to_local().detach().clone() for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            out[f"o.{i}.{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    return out


def main(root: str) -> None:
    import safeckpt
    from safeckpt.integrations.accelerate import load_state, save_state

    warnings.simplefilter("ignore")
    accelerator = fsdp_accelerator()
    model, opt = sharded_model(accelerator, seed=0)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    saved = local_state(model, opt)
    save_state(accelerator, root, 1)
    folder = f"{root}/step-000000001"
    report = safeckpt.verify(folder)

    accelerator._models.clear()
    accelerator._optimizers.clear()
    model, opt = sharded_model(accelerator, seed=1)
    model(torch.randn(4, 8)).sum().backward()  # an optimizer state to be replaced
    opt.step()
    restored = load_state(accelerator, root)
    got = local_state(model, opt)
    differ = sorted(k for k in saved if k not in got or not torch.equal(saved[k], got[k]))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"differ": differ, "shards": {k: v.numel() for k, v in saved.items()}})
    if dist.get_rank() == 0:
        with open(f"{root}.json", "w") as f:
            json.dump({"problems": report.problems, "restored": restored, "ranks": gathered}, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
