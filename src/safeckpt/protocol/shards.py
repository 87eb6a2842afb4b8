"""Pieces of larger tensors, and values that belong to one rank.

``Shard`` is an explicit piece of a global tensor (tensor parallel, SMP partial,
Megatron); a ``DTensor`` (or FSDP1's ``ShardedTensor``) is turned into the same
description. ``RankLocal`` marks a
value that each rank saves and restores for itself (its RNG state, its data position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class Shard:
    """``local_tensor`` holds the box ``offsets`` .. ``offsets + local_tensor.shape`` of a
    tensor of ``global_shape``. Pieces may be uneven; together the ranks' pieces must
    cover the whole tensor. Loading copies the matching part into ``local_tensor``."""

    local_tensor: torch.Tensor
    global_shape: Sequence[int]
    offsets: Sequence[int]

    def __post_init__(self) -> None:
        self.global_shape = [int(d) for d in self.global_shape]
        self.offsets = [int(o) for o in self.offsets]
        shape = list(self.local_tensor.shape)
        if not (len(self.global_shape) == len(self.offsets) == len(shape)) or any(
                o < 0 or o + s > g for o, s, g in zip(self.offsets, shape, self.global_shape)):
            raise ValueError(f"Shard of shape {shape} at offsets {self.offsets} does not fit in "
                             f"global shape {self.global_shape}")


class RankLocal:
    """A value saved separately by every rank and restored to the same rank.

    Loading on a different world size raises ``StateMismatchError`` (``strict=False``
    keeps the current value instead)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"RankLocal({self.value!r})"


def is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "placements") and hasattr(t, "device_mesh")


def dtensor_box(t: Any) -> tuple[torch.Tensor, list[int], list[int]]:
    """(local tensor, global shape, offsets) of a DTensor with Shard/Replicate placements."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if not isinstance(p, (DShard, Replicate)):
            raise ValueError(f"DTensor placement {p} is not supported (only Shard and Replicate); "
                             "call .redistribute() or .full_tensor() first")
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if list(local.shape) != list(shape):  # padded uneven shards
        local = local[tuple(slice(0, s) for s in shape)]
    return local, list(t.shape), list(offsets)


def is_sharded_tensor(t: Any) -> bool:
    return type(t).__name__ == "ShardedTensor" and hasattr(t, "local_shards")


def sharded_tensor_box(t: Any) -> tuple[torch.Tensor, list[int], list[int]] | None:
    """(local tensor, global shape, offsets) of a ShardedTensor's one local shard (FSDP1's
    sharded state dicts hold one per rank), or None for a rank that holds none."""
    shards = t.local_shards()
    if not shards:
        return None
    if len(shards) > 1:
        raise ValueError(f"a ShardedTensor with {len(shards)} local shards on one rank is not supported "
                         "(one per rank, as FSDP makes them); wrap each piece in safeckpt.Shard")
    return shards[0].tensor, list(t.size()), list(shards[0].metadata.shard_offsets)
