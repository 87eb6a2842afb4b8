"""FSDP-wrapped models and their optimizers as safeckpt state, for the trainer drop-ins.

A model sharded with FSDP (``fully_shard``, FSDP2, or ``FullyShardedDataParallel``,
FSDP1) is saved as its *sharded* state dict, taken and put back with
torch.distributed.checkpoint's state-dict helpers (``get_model_state_dict`` ...): every
rank saves only its shards (DTensors, or FSDP1's ShardedTensors) through
``safeckpt.save`` and the checkpoint reshards onto another world size on load. Both
objects have ``state_dict`` / ``load_state_dict``, so they slot into any safeckpt state
in place of the model or optimizer.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch


def is_fsdp(model: Any) -> TypeGuard[torch.nn.Module]:
    """Whether ``model`` (or a submodule) is sharded by FSDP1 or FSDP2."""
    if not isinstance(model, torch.nn.Module):
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def _inner(optimizer: Any) -> Any:
    """The torch optimizer behind a wrapper (Accelerate's ``AcceleratedOptimizer``)."""
    return getattr(optimizer, "optimizer", optimizer)


def owner(models: list, optimizer: Any) -> Any | None:
    """The model among ``models`` whose parameters ``optimizer`` updates."""
    params = {id(p) for group in _inner(optimizer).param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    return None


class ShardedModel:
    """An FSDP model, saved and loaded as its sharded state dict."""

    def __init__(self, model: torch.nn.Module, strict: bool = True) -> None:
        self.model = model
        self.strict = strict

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, state, options=StateDictOptions(strict=self.strict))


class ShardedOptimizer:
    """The optimizer of an FSDP model, saved and loaded as its sharded state dict (keyed
    by parameter names, so a fresh optimizer with no state yet loads it too)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model = model
        self.optimizer = _inner(optimizer)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)
