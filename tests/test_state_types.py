"""What a state may hold, and that each kind of value comes back exactly.

Every test saves with ``safeckpt.save`` and loads back both ways: as a new state with
``safeckpt.load_state`` and in place with ``safeckpt.load``. Tensors are compared
bitwise (through a ``uint8`` view, so NaN payloads and -0.0 count), plain values with
their exact types. Objects the restricted codec cannot represent are refused unless the
user opts into pickle, and a checkpoint never runs code on load without that opt-in.
"""

from __future__ import annotations

import collections
import enum
import math
import pickle
import random
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

import safeckpt
from safeckpt.format.manifest import decode_manifest, encode_manifest, manifest_name
from safeckpt.format.text import value_repr

pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    pytest.mark.filterwarnings("ignore:.*quantize_per_tensor.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*quantized.*:UserWarning"),
]


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A checkpoint folder that does not exist yet."""
    return tmp_path / "ckpt"


@pytest.fixture
def keep_global_rng():
    """Tests that reseed the global generators put them back afterwards."""
    py, npy, pt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(pt)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor in row-major order, for bitwise comparison."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.detach().reshape(-1).view(torch.uint8)


def assert_tensor_same(got: Any, want: torch.Tensor, where: str = "") -> None:
    assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.device.type == "cpu", where
    assert torch.equal(raw_bytes(got), raw_bytes(want)), f"{where}: bytes differ"


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def assert_same(got: Any, want: Any, where: str = "<root>") -> None:
    """Deep equality that also demands identical types at every level (tuple is not
    list, OrderedDict is not dict, 1 is not True, -0.0 is not 0.0, NaN equals NaN)."""
    assert type(got) is type(want), f"{where}: got {type(got).__name__}, want {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert_tensor_same(got, want, where)
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{got.shape}"
        assert got.tobytes() == want.tobytes(), f"{where}: array bytes differ"
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, float):
        assert _same_float(got, want), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, complex):
        assert _same_float(got.real, want.real) and _same_float(got.imag, want.imag), f"{where}: {got!r}"
    elif isinstance(want, dict):  # dict, OrderedDict: same keys (with types) in the same order
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], f"{where}: keys {list(got)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{value_repr(k)}]")  # an int key of any size
    elif isinstance(want, (list, tuple)):  # list, tuple, torch.Size
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, (set, frozenset)):
        assert {(type(x), x) for x in got} == {(type(x), x) for x in want}, f"{where}: {got!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def placeholder(value: Any) -> Any:
    """The same container structure as ``value`` with every leaf blanked: what a fresh
    program holds before it loads a checkpoint into it."""
    kind = type(value)
    if kind in (dict, collections.OrderedDict):
        return kind((k, placeholder(v)) for k, v in value.items())
    if kind is list:
        return [placeholder(v) for v in value]
    if kind is tuple:
        return tuple(placeholder(v) for v in value)
    if kind is torch.Size:
        return torch.Size([0] * len(value))
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return None


def roundtrip_both_ways(value: Any, path: Path, **save_kw: Any) -> tuple[Any, Any, Any]:
    """Save ``{"v": value}``; return it loaded by ``load_state``, in place into a
    blanked structure, and in place into ``None``."""
    safeckpt.save({"v": value}, path, **save_kw)
    fresh = safeckpt.load_state(path)["v"]
    into_structure = {"v": placeholder(value)}
    safeckpt.load(into_structure, path)
    into_none = {"v": None}
    safeckpt.load(into_none, path)
    return fresh, into_structure["v"], into_none["v"]


# --------------------------------------------------------------------------- dtypes

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _is_quantized_dtype(dtype: torch.dtype) -> bool:
    with warnings.catch_warnings():  # complex32 and quantized dtypes warn on creation
        warnings.simplefilter("ignore")
        return torch.empty(1, dtype=dtype).is_quantized


# Quantized dtypes carry a scale and zero point outside their bytes; safeckpt refuses
# them (test_quantized_tensors_are_refused), so they are not in the bitwise round trip.
QUANTIZED_DTYPES = [d for d in ALL_DTYPES if _is_quantized_dtype(d)]
STORABLE_DTYPES = [d for d in ALL_DTYPES if d not in QUANTIZED_DTYPES]


def _converts(dtype: torch.dtype) -> bool:
    try:
        torch.arange(4, dtype=torch.float64).to(dtype)
        return True
    except (RuntimeError, TypeError):
        return False


ARITHMETIC_DTYPES = [d for d in STORABLE_DTYPES if _converts(d)]


def bit_pattern(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor of ``dtype`` made from random bytes (so every bit pattern a type allows
    shows up, including NaN payloads), and those bytes. The first element is all ones
    (a NaN with a full payload in every IEEE type), the second is -0.0's pattern."""
    n = int(np.prod(shape))
    size = dtype.itemsize
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:  # a bool byte other than 0 or 1 is not a valid value
        data = torch.randint(0, 2, (n * size,), generator=g, dtype=torch.uint8)
    else:
        data = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
        data[:size] = 0xFF
        data[size:2 * size] = 0
        data[2 * size - 1] = 0x80
    return data.view(dtype).reshape(shape), data


def test_dtype_enumeration_covers_the_families():
    names = {str(d) for d in STORABLE_DTYPES}
    for must in ("float32", "float16", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                 "int8", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
                 "complex32", "complex64", "complex128"):
        assert f"torch.{must}" in names
    assert len(STORABLE_DTYPES) >= 20
    assert torch.qint8 in QUANTIZED_DTYPES


@pytest.mark.parametrize("dtype", STORABLE_DTYPES, ids=str)
def test_every_dtype_round_trips_bitwise(dtype, ckpt):
    t, data = bit_pattern(dtype)
    zero_dim = t[1, 2]  # a 0-dim view of the same memory
    safeckpt.save({"t": t, "nested": {"scalar": zero_dim}}, ckpt)

    loaded = safeckpt.load_state(ckpt)
    assert_tensor_same(loaded["t"], t, "load_state t")
    assert torch.equal(raw_bytes(loaded["t"]), data)
    assert_tensor_same(loaded["nested"]["scalar"], zero_dim, "load_state scalar")

    target = torch.zeros(data.shape, dtype=torch.uint8).view(dtype).reshape(t.shape)
    scalar_target = torch.zeros(dtype.itemsize, dtype=torch.uint8).view(dtype).reshape(())
    state = {"t": target, "nested": {"scalar": scalar_target}}
    safeckpt.load(state, ckpt)
    assert state["t"] is target and state["nested"]["scalar"] is scalar_target
    assert_tensor_same(target, t, "load in place")
    assert_tensor_same(scalar_target, zero_dim, "load in place scalar")


@pytest.mark.parametrize("dtype", ARITHMETIC_DTYPES, ids=str)
def test_every_dtype_with_real_values(dtype, ckpt):
    """Values made by conversion (what training produces), with the special values the
    type has: signed zeros, infinities and NaN for floats, extremes for integers."""
    if dtype is torch.bool:
        t = torch.tensor([[True, False, True], [False, False, True]])
    elif dtype.is_complex:
        t = torch.complex(torch.tensor([0.0, -0.0, 1.5, float("inf"), float("nan"), -2.25]),
                          torch.tensor([1.0, -0.0, float("-inf"), 3.0, 0.5, float("nan")])).to(dtype)
    elif dtype.is_floating_point:
        t = torch.tensor([0.0, -0.0, 1.0, -1.5, 0.125, float("inf"), float("-inf"), float("nan"), 3.0, -448.0]).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.tensor([info.min, info.max, 0, 1, info.max // 3], dtype=dtype)
    t = t.reshape(-1, 1) if t.numel() % 2 else t.reshape(2, -1)
    safeckpt.save({"t": t}, ckpt)
    assert_tensor_same(safeckpt.load_state(ckpt)["t"], t)
    target = torch.ones_like(t)
    safeckpt.load({"t": target}, ckpt)
    assert_tensor_same(target, t)


def _quantized_by_quantize(dtype: torch.dtype) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.1, 0, dtype)


def _quantized_by_empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(8, dtype=dtype)


def _quantized_dtype_by_view(dtype: torch.dtype) -> torch.Tensor:
    # A uint8 buffer reinterpreted as a quantized dtype: no scale or zero point at all.
    return torch.arange(8 * dtype.itemsize, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("make", [_quantized_by_quantize, _quantized_by_empty, _quantized_dtype_by_view],
                         ids=["quantize_per_tensor", "empty", "uint8_view"])
@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES, ids=str)
def test_quantized_tensors_are_refused(dtype, make, ckpt):
    """A quantized dtype's values depend on a scale and zero point that are not in its
    bytes; saving one must be refused up front (not written and then unreadable)."""
    t = make(dtype)
    with pytest.raises(safeckpt.UnsafeObjectError) as err:
        safeckpt.save({"layer": {"q": t}}, ckpt)
    assert "layer.q" in str(err.value)
    assert not ckpt.exists()


# --------------------------------------------------------------------------- shapes, views, sharing


def test_zero_dim_and_empty_tensors(ckpt):
    state = {
        "scalar_f": torch.tensor(3.5),
        "scalar_i": torch.tensor(-7, dtype=torch.int64),
        "scalar_b": torch.tensor(True),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(3, 0),
        "empty_3d": torch.empty(0, 4, 2, dtype=torch.int8),
    }
    safeckpt.save(state, ckpt)
    loaded = safeckpt.load_state(ckpt)
    for k, v in state.items():
        assert_tensor_same(loaded[k], v, k)
    target = {k: torch.ones_like(v) for k, v in state.items()}
    originals = dict(target)
    safeckpt.load(target, ckpt)
    for k, v in state.items():
        assert target[k] is originals[k]
        assert_tensor_same(target[k], v, k)


def test_distinct_tensors_come_back_as_distinct_objects(ckpt):
    """Only tensors that were one tensor may come back as one object: two separate
    empty tensors (which take no bytes in the data file) must stay two objects."""
    state = {"a": torch.empty(0), "b": torch.empty(0), "c": torch.zeros(2, 0), "d": torch.zeros(2, 0),
             "e": torch.ones(2), "f": torch.ones(2)}
    safeckpt.save(state, ckpt)
    loaded = safeckpt.load_state(ckpt)
    ids = {k: id(v) for k, v in loaded.items()}
    assert len(set(ids.values())) == len(ids), f"names sharing one tensor object: {ids}"


def _views_of(base: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "transpose": base.t(),
        "step_slice": base[::2, 1::3],
        "column": base[:, 2],
        "permute": base.reshape(2, 3, 4).permute(2, 0, 1),
        "diagonal": torch.diagonal(base),
        "expanded": base[0, :3].expand(4, 3),
        "overlapping": base.reshape(-1).as_strided((5, 4), (2, 1)),
    }


def test_non_contiguous_and_strided_views(ckpt):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    views = _views_of(base)
    assert not any(v.is_contiguous() for k, v in views.items() if k != "overlapping")
    safeckpt.save(views, ckpt)

    loaded = safeckpt.load_state(ckpt)
    for k, v in views.items():
        assert_tensor_same(loaded[k], v, k)

    # In place into views of another buffer: exactly the viewed elements change.
    for name in ("transpose", "step_slice", "column", "permute", "diagonal"):
        buffer = torch.full((4, 6), -1.0)
        target = _views_of(buffer)[name]
        safeckpt.load({**{k: torch.empty_like(v) for k, v in views.items()}, name: target}, ckpt)
        assert torch.equal(target, views[name]), name
        untouched = torch.ones(4, 6, dtype=torch.bool)
        _views_of(untouched)[name].fill_(False)
        assert torch.all(buffer[untouched] == -1.0), f"{name}: wrote outside the view"


def _lazy_views(n: int) -> dict[str, torch.Tensor]:
    """Load targets whose memory is not their values: conjugate views (``conj()`` of
    complex64, complex128 and a strided slice) and negative views (``conj().imag``,
    ``_neg_view``)."""
    return {"conj64": torch.zeros(n, dtype=torch.complex64).conj(),
            "conj128": torch.zeros(n, dtype=torch.complex128).conj(),
            "conj_strided": torch.zeros(2, n, dtype=torch.complex64).conj()[:, ::2],
            "neg_imag": torch.zeros(n, dtype=torch.complex64).conj().imag,
            "neg_view": torch._neg_view(torch.zeros(n, dtype=torch.float64))}


def _saved_values(targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Values of each target's dtype and shape, with an imaginary part where there is one."""
    out = {}
    for k, t in targets.items():
        ramp = torch.arange(1, t.numel() + 1, dtype=torch.float64).reshape(t.shape)
        out[k] = (ramp + 2j * ramp if t.is_complex() else ramp).to(t.dtype)
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in one process
@pytest.mark.parametrize("n", [8, 1 << 18], ids=["small", "large"])  # batched reads; whole chunks read directly
def test_load_into_conjugate_and_negative_views_gives_the_saved_values(ckpt, n):
    """A view whose memory holds the conjugate (or negation) of its values gets the saved
    values: reading it back after the load gives what was saved, on every read path."""
    views = _lazy_views(n)
    assert all(v.is_conj() or v.is_neg() for v in views.values())
    saved = _saved_values(views)
    safeckpt.save(saved, ckpt)
    mgr = safeckpt.CheckpointManager(ckpt.parent / "run")
    mgr.save(1, saved)

    def check(how: str, load: Callable[[dict], Any]) -> None:
        targets = _lazy_views(n)
        load(targets)
        for k, t in targets.items():
            assert t.is_conj() or t.is_neg(), f"{how}: {k} was replaced, not loaded in place"
            assert torch.equal(t.resolve_conj().resolve_neg(), saved[k]), f"{how}: {k} holds other values"

    check("load", lambda targets: safeckpt.load(targets, ckpt))
    check("restore", lambda targets: mgr.restore(targets))
    check("load without verify", lambda targets: safeckpt.load(targets, ckpt, verify=False))

    def as_shards(targets: dict) -> None:  # a Shard of the whole tensor, then two of its halves
        safeckpt.load({k: safeckpt.Shard(t, tuple(t.shape), (0,) * t.dim()) for k, t in targets.items()}, ckpt)
        for k, t in targets.items():
            t.zero_()
        for half in range(2):
            shards = {}
            for k, t in targets.items():
                cut = t.shape[-1] // 2
                part = t[..., :cut] if half == 0 else t[..., cut:]
                shards[k] = safeckpt.Shard(part, tuple(t.shape), (0,) * (t.dim() - 1) + (half * cut,))
            safeckpt.load(shards, ckpt)
    check("load into Shards", as_shards)

    dcp = pytest.importorskip("torch.distributed.checkpoint")
    check("dcp.load with safeckpt.dcp.Reader",
          lambda targets: dcp.load(targets, storage_reader=safeckpt.dcp.Reader(str(ckpt)), no_dist=True))
    mgr.close()


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.hidden = nn.Linear(4, 4)
        self.out = nn.Linear(4, 11, bias=False)
        self.out.weight = self.embed.weight  # weight tying

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(ids))))


def test_tied_module_weights(ckpt):
    torch.manual_seed(1)
    model = TiedLM()
    safeckpt.save({"model": model}, ckpt)

    loaded = safeckpt.load_state(ckpt)["model"]
    assert set(loaded) == set(model.state_dict())
    assert loaded["embed.weight"] is loaded["out.weight"]
    assert torch.equal(loaded["embed.weight"], model.embed.weight.detach())

    torch.manual_seed(2)
    fresh = TiedLM()
    assert not torch.equal(fresh.embed.weight, model.embed.weight)
    safeckpt.load({"model": fresh}, ckpt)
    assert fresh.out.weight is fresh.embed.weight
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    ids = torch.tensor([[1, 5, 10]])
    assert torch.equal(fresh(ids), model(ids))


def test_one_tensor_under_several_names(ckpt):
    t = torch.randn(3, 2)
    safeckpt.save({"a": t, "b": [t, {"c": t}]}, ckpt)
    loaded = safeckpt.load_state(ckpt)
    assert loaded["a"] is loaded["b"][0] is loaded["b"][1]["c"]
    assert torch.equal(loaded["a"], t)
    x, y = torch.zeros(3, 2), torch.zeros(3, 2)
    state = {"a": x, "b": [y, {"c": x}]}
    safeckpt.load(state, ckpt)
    assert state["a"] is x and state["b"][0] is y
    assert torch.equal(x, t) and torch.equal(y, t)


def test_different_views_of_one_storage(ckpt):
    base = torch.arange(20, dtype=torch.float64)
    state = {
        "base": base,
        "head": base[2:8],
        "overlap": base[5:12],
        "every_third": base[::3],
        "matrix": base.view(4, 5),
        "matrix_t": base.view(4, 5).t(),
        "same_bytes_as_int": base.view(torch.int64),
        "row": base.view(4, 5)[1],
    }
    safeckpt.save(state, ckpt)
    loaded = safeckpt.load_state(ckpt)
    for k, v in state.items():
        assert_tensor_same(loaded[k], v, k)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    safeckpt.load(target, ckpt)
    for k, v in state.items():
        assert_tensor_same(target[k], v, k)


def test_parameter_in_plain_dict_is_loaded_in_place(ckpt):
    p = nn.Parameter(torch.randn(3))
    safeckpt.save({"p": p}, ckpt)
    assert torch.equal(safeckpt.load_state(ckpt)["p"], p.detach())
    q = nn.Parameter(torch.zeros(3))
    state = {"p": q}
    safeckpt.load(state, ckpt)
    assert state["p"] is q and q.requires_grad
    assert torch.equal(q.detach(), p.detach())


# --------------------------------------------------------------------------- modules, optimizers, schedulers


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.l2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.bn(self.l1(x))))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def test_module_with_buffers(ckpt):
    torch.manual_seed(0)
    model = Net()
    model(_batch(0)[0])  # moves BatchNorm's running stats and num_batches_tracked
    safeckpt.save({"model": model}, ckpt)

    loaded = safeckpt.load_state(ckpt)["model"]
    assert list(loaded) == list(model.state_dict())
    for k, v in model.state_dict().items():
        assert_tensor_same(loaded[k], v, k)

    torch.manual_seed(1)
    fresh = Net()
    safeckpt.load({"model": fresh}, ckpt)
    for k, v in model.state_dict().items():
        assert_tensor_same(fresh.state_dict()[k], v, k)
    assert fresh.bn.num_batches_tracked.item() == 1


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.95)),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
}


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, sched: Any = None) -> list[float]:
    lrs = []
    for i in steps:
        x, y = _batch(i)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(1.0)  # a metric that never improves
            else:
                sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()
    return {f"{p}.{k}": v for p, s in sd["state"].items() for k, v in s.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_training_resumes_bit_identically(opt_name, ckpt):
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[opt_name](model.parameters())
    _train(model, opt, range(3))
    safeckpt.save({"model": model, "optim": opt}, ckpt)
    _train(model, opt, range(3, 7))  # the run that never stopped

    torch.manual_seed(123)  # different initial weights: everything must come from the checkpoint
    model2 = Net()
    opt2 = OPTIMIZERS[opt_name](model2.parameters())
    assert opt2.state_dict()["state"] == {}  # fresh: never stepped
    safeckpt.load({"model": model2, "optim": opt2}, ckpt)
    _train(model2, opt2, range(3, 7))

    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), name
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k
    ref, got = _optimizer_tensors(opt), _optimizer_tensors(opt2)
    assert ref.keys() == got.keys() and ref
    for k in ref:
        assert ref[k].dtype == got[k].dtype and torch.equal(ref[k], got[k]), k
    assert opt.state_dict()["param_groups"] == opt2.state_dict()["param_groups"]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_optimizer_state_dict_comes_back_exactly(opt_name, ckpt):
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[opt_name](model.parameters())
    _train(model, opt, range(2))
    safeckpt.save({"optim": opt}, ckpt)
    assert_same(safeckpt.load_state(ckpt)["optim"], opt.state_dict())

    # Into an optimizer that already has (different) state of its own.
    torch.manual_seed(5)
    model2 = Net()
    opt2 = OPTIMIZERS[opt_name](model2.parameters())
    _train(model2, opt2, range(10, 15))
    safeckpt.load({"optim": opt2}, ckpt)
    assert_same(opt2.state_dict(), opt.state_dict())


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=20),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    # Its lambda is not part of state_dict() (torch stores None for plain functions), so
    # it saves without pickle; the new run supplies the lambda again.
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda epoch: 0.9 ** epoch),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1, factor=0.5),
}


@pytest.mark.parametrize("sched_name", list(SCHEDULERS))
def test_lr_scheduler_resumes(sched_name, ckpt):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = SCHEDULERS[sched_name](opt)
    _train(model, opt, range(3), sched)
    safeckpt.save({"model": model, "optim": opt, "sched": sched}, ckpt)
    assert_same(safeckpt.load_state(ckpt)["sched"], sched.state_dict())
    ref_lrs = _train(model, opt, range(3, 8), sched)

    torch.manual_seed(9)
    model2 = Net()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    sched2 = SCHEDULERS[sched_name](opt2)
    safeckpt.load({"model": model2, "optim": opt2, "sched": sched2}, ckpt)
    lrs = _train(model2, opt2, range(3, 8), sched2)

    assert lrs == ref_lrs
    assert sched2.state_dict() == sched.state_dict()
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)


def _cpu_grad_scaler(**kw: Any) -> Any:
    try:
        return torch.amp.GradScaler("cpu", **kw)
    except (AttributeError, TypeError, RuntimeError) as exc:
        pytest.skip(f"torch.amp.GradScaler('cpu') is not supported by this torch: {exc}")


def _scaled_steps(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, steps: range) -> list[float]:
    scales = []
    for i in steps:
        x, y = _batch(i)
        if i % 4 == 1:
            x = x.clone()
            x[0, 0] = float("inf")  # an overflow: the step is skipped and the scale backs off
        opt.zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_grad_scaler_resumes(ckpt):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = _cpu_grad_scaler(init_scale=2.0 ** 10, growth_interval=2)
    _scaled_steps(model, opt, scaler, range(4))
    safeckpt.save({"model": model, "optim": opt, "scaler": scaler}, ckpt)
    assert_same(safeckpt.load_state(ckpt)["scaler"], scaler.state_dict())
    ref = _scaled_steps(model, opt, scaler, range(4, 10))

    model2 = nn.Linear(4, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.01)
    scaler2 = _cpu_grad_scaler()
    safeckpt.load({"model": model2, "optim": opt2, "scaler": scaler2}, ckpt)
    assert scaler2.state_dict() == safeckpt.load_state(ckpt)["scaler"]
    assert _scaled_steps(model2, opt2, scaler2, range(4, 10)) == ref
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)


class Progress:
    """A user object that is not a Module: saved as its state_dict()."""

    def __init__(self) -> None:
        self.step = 0
        self.seen = torch.zeros(0, dtype=torch.int64)
        self.history: list[tuple[int, float]] = []
        self.loaded_with: dict | None = None

    def state_dict(self) -> dict:
        return {"step": self.step, "seen": self.seen, "history": list(self.history), "tag": ("v", 2)}

    def load_state_dict(self, sd: dict) -> None:
        self.loaded_with = sd
        self.step, self.seen, self.history = sd["step"], sd["seen"], list(sd["history"])


def test_custom_stateful_object(ckpt):
    p = Progress()
    p.step = 2 ** 60 + 3
    p.seen = torch.tensor([4, 8, 15, 16, 23, 42])  # a different shape than a fresh one has
    p.history = [(1, 0.5), (2, float("nan"))]
    safeckpt.save({"trainer": {"progress": p}}, ckpt)

    assert_same(safeckpt.load_state(ckpt)["trainer"]["progress"], p.state_dict())

    fresh = Progress()
    state = {"trainer": {"progress": fresh}}
    safeckpt.load(state, ckpt)
    assert state["trainer"]["progress"] is fresh
    assert fresh.loaded_with is not None
    assert_same(fresh.loaded_with, p.state_dict())
    assert fresh.step == p.step
    assert torch.equal(fresh.seen, p.seen)


# --------------------------------------------------------------------------- plain values

PLAIN_VALUES: list[tuple[str, Any]] = [
    ("none", None),
    ("true", True),
    ("false", False),
    ("zero", 0),
    ("negative_int", -17),
    ("int_2_53_minus_1", 2 ** 53 - 1),
    ("int_2_53", 2 ** 53),
    ("int_minus_2_53", -(2 ** 53)),
    ("int_2_64_plus_1", 2 ** 64 + 1),
    ("negative_huge_int", -(10 ** 40) - 7),
    ("int_over_4300_digits", 7 ** 6000),
    ("int_keys_over_4300_digits", {7 ** 6000: "a", (1, -(7 ** 6000)): "b", 3: {7 ** 6000}}),
    ("float", 1.5),
    ("float_tiny", 5e-324),
    ("float_max", 1.7976931348623157e308),
    ("float_third", 1 / 3),
    ("nan", float("nan")),
    ("inf", float("inf")),
    ("minus_inf", float("-inf")),
    ("minus_zero", -0.0),
    ("complex", complex(1.5, -0.0)),
    ("complex_nonfinite", complex(float("nan"), float("-inf"))),
    ("empty_str", ""),
    ("unicode", "héllo ✓ 𝄞 日本\x00\n\"'\\"),
    ("str_like_a_tag", "$pickle"),
    ("bytes", bytes(range(256))),
    ("empty_bytes", b""),
    ("bytearray", bytearray(b"\x00\xffab")),
    ("empty_tuple", ()),
    ("tuple", (1, "a", None)),
    ("tuple_vs_list", (1, [2, (3, [4])])),
    ("list_vs_tuple", [1, (2, [3, (4,)])]),
    ("empty_list", []),
    ("nested_empty", [[], {}, ()]),
    ("empty_dict", {}),
    ("nested_dict", {"a": {"b": {"c": [1, {"d": (2, 3.0)}]}}}),
    ("int_keys", {1: "a", -2: "b", 2 ** 70: "c"}),
    ("tuple_keys", {(1, "x"): 1, (2, ("y", None)): 2}),
    ("mixed_keys", {1: "int", "1": "str", 2.5: "float", None: "none", b"k": "bytes", False: "bool"}),
    ("keys_like_tags", {"$tensor": "x", "$pickle": "y", "$dict": [1]}),
    ("keys_with_dots", {"": 1, "a.b": 2, "a": {"b": 3}}),
    ("ordered_dict", collections.OrderedDict([("b", 1), ("a", 2), ("c", [3])])),
    ("ordered_dict_int_keys", collections.OrderedDict([(2, "x"), (1, "y")])),
    ("set", {1, 2, "x", (3, 4), None}),
    ("empty_set", set()),
    ("frozenset", frozenset({1.5, b"x", (1, (2,))})),
    ("np_int16_2d", np.arange(6, dtype=np.int16).reshape(2, 3)),
    ("np_float64_0d", np.array(3.5)),
    ("np_bool", np.array([True, False])),
    ("np_complex64", np.array([1 + 2j, -0.0j], dtype=np.complex64)),
    ("np_empty_3d", np.zeros((2, 0, 3), dtype=np.float32)),
    ("np_big_endian_nan", np.array([1.0, np.nan, -0.0], dtype=">f8")),
    ("np_uint64_max", np.array([np.iinfo(np.uint64).max], dtype=np.uint64)),
    ("np_float16_4d", np.linspace(-1, 1, 24, dtype=np.float16).reshape(1, 2, 3, 4)),
    ("np_unicode", np.array(["ab", "c"])),
    ("np_datetime", np.array(["2020-01-01", "NaT"], dtype="datetime64[D]")),
    ("np_fortran_order", np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3))),
    ("np_scalar_float32", np.float32(1.5)),
    ("np_scalar_int64", np.int64(-3)),
    ("np_scalar_uint8", np.uint8(255)),
    ("np_scalar_float16", np.float16(2)),
    ("np_scalar_bool", np.bool_(True)),
    ("np_scalar_complex", np.complex128(1j)),
    ("np_scalar_nan", np.float64("nan")),
    ("np_scalar_datetime", np.datetime64("2020-01-01T12:00")),
    ("np_scalar_str", np.str_("ab")),
    ("python_random_state", random.Random(7).getstate()),
    ("numpy_global_random_state", np.random.RandomState(7).get_state()),
    ("numpy_generator_state", np.random.default_rng(7).bit_generator.state),
    ("torch_rng_state", torch.Generator().manual_seed(7).get_state()),
    ("torch_dtypes", list(ALL_DTYPES)),
    ("torch_devices", [torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda"), torch.device("meta")]),
    ("torch_size", torch.Size([2, 3])),
    ("torch_size_empty", torch.Size([])),
    ("values_with_tensor", {"lr": 0.1, "t": torch.arange(3), "sizes": [torch.Size([1])]}),
]


@pytest.mark.parametrize("value", [v for _, v in PLAIN_VALUES], ids=[k for k, _ in PLAIN_VALUES])
def test_plain_value_round_trips_with_exact_type(value, ckpt):
    fresh, into_structure, into_none = roundtrip_both_ways(value, ckpt)
    assert_same(fresh, value, "load_state")
    assert_same(into_structure, value, "load into the same structure")
    assert_same(into_none, value, "load into None")


def test_all_plain_values_in_one_state(ckpt):
    state = dict(PLAIN_VALUES)
    safeckpt.save(state, ckpt)
    assert_same(safeckpt.load_state(ckpt), state)


def test_rng_states_restore_the_same_next_numbers(ckpt, keep_global_rng):
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    gen = np.random.default_rng(14)
    [random.random() for _ in range(5)], np.random.rand(5), torch.rand(5), gen.random(5)
    state = {"rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                     "torch": torch.get_rng_state(), "numpy_gen": gen.bit_generator.state}}
    safeckpt.save(state, ckpt)
    want = ([random.random() for _ in range(5)], np.random.rand(5).tolist(), torch.rand(5),
            np.random.standard_normal(3).tolist(), gen.random(5).tolist())

    def restore_and_draw(rng: dict) -> tuple:
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        g = np.random.default_rng()
        g.bit_generator.state = rng["numpy_gen"]
        return ([random.random() for _ in range(5)], np.random.rand(5).tolist(), torch.rand(5),
                np.random.standard_normal(3).tolist(), g.random(5).tolist())

    for loaded in (safeckpt.load_state(ckpt), _loaded_in_place(ckpt)):
        random.seed(0), np.random.seed(0), torch.manual_seed(0)  # move away first
        got = restore_and_draw(loaded["rng"])
        assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3] and got[4] == want[4]
        assert torch.equal(got[2], want[2])


def _loaded_in_place(path: Path) -> dict:
    state = {"rng": {"python": None, "numpy": None, "torch": torch.get_rng_state().zero_(), "numpy_gen": None}}
    safeckpt.load(state, path)
    return state


# --------------------------------------------------------------------------- objects that need pickle

NT = collections.namedtuple("NT", "a b")


class Color(enum.Enum):
    RED = 1


class Custom:
    def __init__(self, x: int = 1) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return type(other) is Custom and other.x == self.x


UNSAFE_OBJECTS: list[tuple[str, Callable[[], Any]]] = [
    ("custom_instance", lambda: Custom(5)),
    ("lambda", lambda: (lambda x: x)),
    ("namedtuple", lambda: NT(1, [2])),
    ("defaultdict", lambda: collections.defaultdict(list, a=[1])),
    ("enum", lambda: Color.RED),
    ("class_object", lambda: Custom),
    ("path", lambda: Path("/x/y")),
    ("numpy_object_array", lambda: np.array([1, None], dtype=object)),
    ("numpy_structured_array", lambda: np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])),
]


@pytest.mark.parametrize("make", [m for _, m in UNSAFE_OBJECTS], ids=[k for k, _ in UNSAFE_OBJECTS])
def test_other_objects_are_refused_without_writing(make, ckpt):
    state = {"model": {"w": torch.ones(2)}, "extra": {"items": [0, make()]}}
    with pytest.raises(safeckpt.UnsafeObjectError) as err:
        safeckpt.save(state, ckpt)
    assert isinstance(err.value, safeckpt.CheckpointError)
    assert "extra.items.1" in str(err.value)
    assert not ckpt.exists() or list(ckpt.iterdir()) == []


def test_refused_save_leaves_existing_checkpoint_untouched(ckpt):
    safeckpt.save({"w": torch.ones(2), "epoch": 1}, ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(safeckpt.UnsafeObjectError):
        safeckpt.save({"w": torch.zeros(2), "epoch": Custom()}, ckpt, overwrite=True)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    loaded = safeckpt.load_state(ckpt)
    assert loaded["epoch"] == 1 and torch.equal(loaded["w"], torch.ones(2))


def _assert_same_object(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape and got.tolist() == want.tolist()
    elif isinstance(want, collections.defaultdict):
        assert got.default_factory is want.default_factory and got == want
    else:
        assert got == want


PICKLABLE = [(k, m) for k, m in UNSAFE_OBJECTS if k != "lambda"]


@pytest.mark.parametrize("make", [m for _, m in PICKLABLE], ids=[k for k, _ in PICKLABLE])
def test_pickle_needs_opt_in_on_save_and_on_load(make, ckpt):
    value = make()
    safeckpt.save({"w": torch.ones(2), "extra": {"obj": value}}, ckpt, allow_pickle=True)

    with pytest.raises(safeckpt.UnsafeObjectError) as err:
        safeckpt.load_state(ckpt)
    assert "extra.obj" in str(err.value)
    with pytest.raises(safeckpt.UnsafeObjectError):
        safeckpt.load({"w": torch.zeros(2), "extra": {"obj": None}}, ckpt)

    _assert_same_object(safeckpt.load_state(ckpt, allow_pickle=True)["extra"]["obj"], value)
    state = {"w": torch.zeros(2), "extra": {"obj": None}}
    safeckpt.load(state, ckpt, allow_pickle=True)
    _assert_same_object(state["extra"]["obj"], value)
    assert torch.equal(state["w"], torch.ones(2))


def test_unpicklable_object_with_allow_pickle_is_a_clear_error(ckpt):
    """A lambda cannot be pickled even with the opt-in: the error must still be a
    safeckpt error that names the key, and nothing may be written."""
    with pytest.raises(safeckpt.UnsafeObjectError) as err:
        safeckpt.save({"hooks": {"on_step": lambda s: s}}, ckpt, allow_pickle=True)
    assert "hooks.on_step" in str(err.value)
    assert not ckpt.exists() or list(ckpt.iterdir()) == []


class CreatesFile:
    """Unpickling this creates a file: the stand-in for arbitrary code in a checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _craft(ckpt: Path, alter: Callable[[Any, dict], None], payload: dict) -> None:
    """Rewrite the checkpoint's tree with the library's own manifest codec, committed
    as a newer, valid manifest."""
    (name,) = [p.name for p in ckpt.iterdir() if p.name.startswith("manifest-")]
    m = decode_manifest((ckpt / name).read_bytes(), name)
    alter(m.tree, payload)
    m.seq += 1
    (ckpt / manifest_name(m.seq)).write_bytes(encode_manifest(m))


def _as_value(tree: Any, payload: dict) -> None:
    tree["meta"]["epoch"] = payload


def _as_dict_key(tree: Any, payload: dict) -> None:
    tree["meta"]["ids"]["$dict"][0][0] = payload


def _as_set_member(tree: Any, payload: dict) -> None:
    tree["meta"]["tags"]["$set"][0] = payload


def _in_tuple(tree: Any, payload: dict) -> None:
    tree["meta"]["pair"]["$tuple"][1] = payload


def _in_object_state(tree: Any, payload: dict) -> None:
    tree["progress"]["step"] = payload


@pytest.mark.parametrize("alter", [_as_value, _as_dict_key, _as_set_member, _in_tuple, _in_object_state],
                         ids=["value", "dict_key", "set_member", "in_tuple", "in_object_state"])
def test_crafted_pickle_never_runs_without_opt_in(alter, ckpt, tmp_path):
    marker = tmp_path / "pwned"
    payload = {"$pickle": __import__("base64").b64encode(pickle.dumps(CreatesFile(str(marker)))).decode()}
    safeckpt.save({"model": {"w": torch.ones(3)}, "progress": Progress(),
                   "meta": {"epoch": 3, "ids": {1: "x"}, "tags": {"a"}, "pair": (1, 2)}}, ckpt)
    _craft(ckpt, alter, payload)
    assert safeckpt.verify(ckpt).ok  # a valid commit: the defence is the decoder

    with pytest.raises(safeckpt.UnsafeObjectError):
        safeckpt.load_state(ckpt)
    assert not marker.exists()
    with pytest.raises(safeckpt.UnsafeObjectError):
        safeckpt.load({"model": {"w": torch.zeros(3)}, "progress": Progress(),
                       "meta": {"epoch": 0, "ids": {1: None}, "tags": None, "pair": (0, 0)}}, ckpt)
    assert not marker.exists()

    # Control: the payload is live, so its absence above means it was never unpickled.
    loaded = safeckpt.load_state(ckpt, allow_pickle=True)
    assert marker.exists()
    for f in _file_objects(loaded):
        f.close()


def _file_objects(node: Any) -> list:
    if hasattr(node, "close") and hasattr(node, "write"):
        return [node]
    if isinstance(node, dict):
        return [f for k, v in node.items() for f in _file_objects(k) + _file_objects(v)]
    if isinstance(node, (list, tuple, set, frozenset)):
        return [f for v in node for f in _file_objects(v)]
    return []


def test_refused_pickle_in_checkpoint_leaves_state_untouched(ckpt, tmp_path):
    """``load`` must find an unloadable value before it writes into the state: a load
    that raises leaves every tensor as it was."""
    marker = tmp_path / "pwned"
    payload = {"$pickle": __import__("base64").b64encode(pickle.dumps(CreatesFile(str(marker)))).decode()}
    safeckpt.save({"model": {"w": torch.ones(3)}, "meta": {"epoch": 3, "ids": {1: "x"}, "tags": {"a"},
                                                           "pair": (1, 2)}}, ckpt)
    _craft(ckpt, _as_value, payload)
    w = torch.zeros(3)
    state = {"model": {"w": w}, "meta": {"epoch": 0, "ids": {1: None}, "tags": None, "pair": (0, 0)}}
    with pytest.raises(safeckpt.UnsafeObjectError):
        safeckpt.load(state, ckpt)
    assert not marker.exists()
    assert torch.equal(w, torch.zeros(3)), "the tensor was overwritten by a load that failed"
    assert state["meta"]["epoch"] == 0
