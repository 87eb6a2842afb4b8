"""Random states through every single-process save and load path, compared bit for bit.

The fast paths (small pieces packed into regions on save, staged regions reused by async
saves, batched reads of adjacent small tensors on load) each once had a bug that a
hand-written state did not show: regions of the same size sharing one buffer committed
the wrong bytes. Here seeded random states -- mixed dtypes, sizes on both sides of the
batching limits, many pieces of exactly one size, 0-d and empty tensors, strided and
transposed views, ties, nested containers -- go through ``save`` and ``async_save``
with the regions and read runs cut small, and come back through ``load_state`` and
``load`` into fresh and strided targets, every byte checked.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import safeckpt
from safeckpt.protocol import datafile, reader, staging
from safeckpt.storage import Storage

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]
SEEDS = range(8)


def random_tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    kind = rng.random()
    if kind < 0.05:
        shape: tuple[int, ...] = ()
    elif kind < 0.1:
        shape = (0, rng.randint(1, 4))
    elif kind < 0.9:
        shape = (rng.randint(1, 40), rng.randint(1, 40))
    else:
        shape = (rng.randint(200, 700), rng.randint(60, 200))  # above the limits cut small below
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    t = raw.view(dtype)[:torch.Size(shape).numel()].reshape(shape).clone()
    if t.dim() == 2 and min(t.shape) > 1 and rng.random() < 0.25:
        t = t.t() if rng.random() < 0.5 else t[::2, 1:]  # a strided view of a bigger tensor
    return t


def random_state(seed: int, n: int = 300) -> dict[str, Any]:
    rng = random.Random(seed)
    tensors = [random_tensor(rng) for _ in range(n)]
    state: dict[str, Any] = {"model": {}, "optim": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}}
    for i, t in enumerate(tensors):
        where = rng.random()
        if where < 0.5:
            state["model"][f"layer{i}.weight"] = t
        elif where < 0.9:
            state["optim"]["state"].setdefault(i // 2, {})["exp_avg" if i % 2 else "exp_avg_sq"] = t
            state["optim"]["param_groups"][0]["params"].append(i)
        else:
            state.setdefault("extra", []).append((t, f"note {i}"))
    dtype = rng.choice(DTYPES)  # a run of pieces of one size: regions of exactly the same size
    state["buffers"] = {f"b{i}": torch.full((512 // dtype.itemsize,), i, dtype=dtype) for i in range(24)}
    for _ in range(10):  # ties: the same tensor under a second name
        name = rng.choice(sorted(state["model"]))
        state["model"][name + ".tied"] = state["model"][name]
    state["step"] = seed
    return state


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, child in value.items() for k, v in leaves(child, f"{prefix}{key}/").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, child in enumerate(value) for k, v in leaves(child, f"{prefix}{i}/").items()}
    return {prefix: value}


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (in a fresh tensor of standard strides: NaN payloads included)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def assert_same(got: Any, want: Any) -> None:
    g, w = leaves(got), leaves(want)
    assert g.keys() == w.keys()
    for k, v in w.items():
        if isinstance(v, torch.Tensor):
            assert g[k].dtype == v.dtype and g[k].shape == v.shape, k
            assert torch.equal(raw_bytes(g[k]), raw_bytes(v)), k
        else:
            assert g[k] == v, k


def template_of(state: Any, rng: random.Random) -> Any:
    """Zeroed tensors of the same shapes (some strided), the state's ties kept."""
    made: dict[int, torch.Tensor] = {}

    def make(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if id(v) not in made:
                if v.dim() == 2 and rng.random() < 0.2:
                    made[id(v)] = torch.zeros(v.shape[1], v.shape[0], dtype=v.dtype).t()  # a strided target
                else:
                    made[id(v)] = torch.zeros_like(v, memory_format=torch.contiguous_format)
            return made[id(v)]
        if isinstance(v, dict):
            return {k: make(c) for k, c in v.items()}
        if isinstance(v, list):
            return [make(c) for c in v]
        if isinstance(v, tuple):
            return tuple(make(c) for c in v)
        return v
    return make(state)


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regions, staged regions and read runs a few KiB long: every state crosses them."""
    monkeypatch.setattr(datafile, "COALESCE_BUFFER", 4096)
    monkeypatch.setattr(datafile, "COALESCE_BELOW", 64 << 10)
    monkeypatch.setattr(staging, "STAGED_REGION", 4096)
    monkeypatch.setattr(Storage, "merge_reads_below", 2048)
    monkeypatch.setattr(reader, "COALESCE_MAX", 4096)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_random_states_round_trip_bit_for_bit(tmp_path, small_limits, seed: int, how: str) -> None:
    state = random_state(seed)
    path = tmp_path / "c"
    if how == "save":
        safeckpt.save(state, path)
    else:
        safeckpt.async_save(state, path).result(timeout=120)
        safeckpt.async_save(random_state(seed + 100), tmp_path / "other").result(timeout=120)  # reuses the buffers
        assert_same(safeckpt.load_state(tmp_path / "other"), random_state(seed + 100))
    assert safeckpt.verify(path).ok
    fresh = safeckpt.load_state(path)
    assert_same(fresh, state)
    assert fresh["model"][next(k for k in fresh["model"] if k.endswith(".tied"))[:-5]] is \
        fresh["model"][next(k for k in fresh["model"] if k.endswith(".tied"))]
    target = template_of(state, random.Random(seed))
    safeckpt.load(target, path)
    assert_same(target, state)
