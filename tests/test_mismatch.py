"""Loading into a state that does not match the checkpoint.

``StateMismatchError`` (a ``CheckpointError`` and a ``KeyError``) lists every offending
key at once: missing, unexpected, wrong shape, wrong dtype, container where the
checkpoint has a tensor and the reverse. When it is raised nothing in the state has
changed. With ``strict=False`` what matches is loaded, the rest is left as it was and
a warning lists the rest.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import safeckpt


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


def snapshot(state: Any) -> Any:
    """A deep copy to compare against: tensors cloned, modules and optimizers by state."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, (nn.Module, torch.optim.Optimizer)):
        return snapshot(copy.deepcopy(state.state_dict()))
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return copy.deepcopy(state)


def assert_unchanged(state: Any, before: Any, where: str = "<root>") -> None:
    if isinstance(state, (nn.Module, torch.optim.Optimizer)):
        state = state.state_dict()
    if isinstance(before, torch.Tensor):
        assert isinstance(state, torch.Tensor), where
        assert state.dtype == before.dtype and state.shape == before.shape, where
        assert torch.equal(state, before), f"{where}: modified by a load that failed"
    elif isinstance(before, dict):
        assert list(state) == list(before), f"{where}: keys changed to {list(state)}"
        for k in before:
            assert_unchanged(state[k], before[k], f"{where}.{k}")
    elif isinstance(before, (list, tuple)):
        assert type(state) is type(before) and len(state) == len(before), f"{where}: {state!r}"
        for i, (s, b) in enumerate(zip(state, before)):
            assert_unchanged(s, b, f"{where}[{i}]")
    else:
        assert state == before, f"{where}: {state!r} != {before!r}"


def problem_keys(message: str) -> set[str]:
    """The keys a mismatch message lists, one problem per indented line ``  key: ...``."""
    return {m.group(1) for m in re.finditer(r"^\s+([^\s:]+): ", message, re.MULTILINE)}


SAVED = {
    "same": torch.arange(3.0),
    "shape": torch.ones(2, 2),
    "dtype": torch.ones(4),
    "tensor_vs_dict": {"x": torch.ones(1)},
    "dict_vs_tensor": torch.ones(2),
    "list_vs_tensor": torch.ones(2),
    "value_vs_tensor": 7,
    "plain_replaced_by_tensor": torch.ones(1),
    "gone": torch.ones(1),
    "count": 5,
    "lst": [torch.ones(1), torch.ones(1)],
    "nested": {"deep": {"w": torch.ones(3)}},
}


def mismatching_target() -> dict:
    return {
        "same": torch.zeros(3),
        "shape": torch.zeros(2, 3),
        "dtype": torch.zeros(4, dtype=torch.float64),
        "tensor_vs_dict": torch.zeros(1),
        "dict_vs_tensor": {"y": torch.zeros(2)},
        "list_vs_tensor": [torch.zeros(2)],
        "value_vs_tensor": torch.zeros(1),
        "plain_replaced_by_tensor": 0,  # plain values are replaced, not matched
        "new": torch.zeros(1),
        "count": 0,
        "lst": [torch.zeros(1)],
        "nested": {"deep": {"w": torch.zeros(3), "b": torch.zeros(1)}},
    }


OFFENDERS = {"shape", "dtype", "tensor_vs_dict", "dict_vs_tensor", "list_vs_tensor", "value_vs_tensor", "new", "gone", "lst.1", "nested.deep.b"}


def test_error_is_a_key_error_and_lists_every_offending_key(ckpt):
    safeckpt.save(SAVED, ckpt)
    target = mismatching_target()
    before = snapshot(target)
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load(target, ckpt)
    exc = err.value
    assert isinstance(exc, KeyError) and isinstance(exc, safeckpt.CheckpointError)
    message = str(exc)
    assert not message.startswith(("'", '"')), "KeyError's repr quoting leaked into the message"
    assert str(ckpt) in message
    assert problem_keys(message) == OFFENDERS
    assert "strict=False" in message  # says what to do
    assert_unchanged(target, before)
    # the same, as attributes: no handler needs to parse the message
    assert set(exc.keys) == OFFENDERS and len(exc.problems) == len(exc.keys)
    assert set(exc.missing) == {"new", "nested.deep.b"}
    assert set(exc.unexpected) == {"gone", "lst.1"}
    assert exc.shapes == {"shape": ((2, 3), tuple(SAVED["shape"].shape))}
    assert exc.dtypes == {"dtype": (torch.float64, SAVED["dtype"].dtype)}


@pytest.mark.parametrize("case, target, key, words", [
    ("missing", {"a": torch.zeros(2), "b": torch.zeros(2), "extra": torch.zeros(1)}, "extra", "missing"),
    ("unexpected", {"a": torch.zeros(2)}, "b", "not in the state"),
    ("shape", {"a": torch.zeros(3), "b": torch.zeros(2)}, "a", "(3,)"),
    ("dtype", {"a": torch.zeros(2, dtype=torch.int32), "b": torch.zeros(2)}, "a", "torch.int32"),
    ("bfloat16_vs_float16", {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2)}, "a", "bfloat16"),
    ("container_vs_tensor", {"a": {"a0": torch.zeros(2)}, "b": torch.zeros(2)}, "a", "dict"),
    ("list_vs_tensor", {"a": [torch.zeros(2)], "b": torch.zeros(2)}, "a", "list"),
    ("tuple_vs_tensor", {"a": (torch.zeros(2),), "b": torch.zeros(2)}, "a", "tuple"),
    ("tensor_vs_container", {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(1)}, "c", "tensor"),
    ("tensor_vs_value", {"a": torch.zeros(2), "b": torch.zeros(2), "d": torch.zeros(1)}, "d", "tensor"),
])
def test_each_kind_of_mismatch(case, target, key, words, ckpt):
    saved = {"a": torch.ones(2), "b": torch.ones(2)}
    if case == "tensor_vs_container":
        saved["c"] = {"inner": torch.ones(1)}
    if case == "tensor_vs_value":
        saved["d"] = 3.5
    safeckpt.save(saved, ckpt)
    before = snapshot(target)
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load(target, ckpt)
    message = str(err.value)
    assert key in problem_keys(message), message
    line = next(line for line in message.splitlines() if line.strip().startswith(f"{key}:"))
    assert words in line, line
    assert_unchanged(target, before)


def test_strict_false_loads_what_matches_and_warns_about_the_rest(ckpt):
    safeckpt.save(SAVED, ckpt)
    target = mismatching_target()
    before = snapshot(target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safeckpt.load(target, ckpt, strict=False)
    messages = [str(w.message) for w in caught if str(ckpt) in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert problem_keys(messages[0]) == OFFENDERS

    # What matches is loaded ...
    assert torch.equal(target["same"], SAVED["same"])
    assert target["count"] == 5
    assert torch.equal(target["lst"][0], torch.ones(1)) and len(target["lst"]) == 1
    assert torch.equal(target["nested"]["deep"]["w"], torch.ones(3))
    assert torch.equal(target["plain_replaced_by_tensor"], torch.ones(1))
    # ... the rest is left exactly as it was.
    for k in ("shape", "dtype", "tensor_vs_dict", "dict_vs_tensor", "list_vs_tensor", "value_vs_tensor", "new"):
        assert_unchanged(target[k], before[k], k)
    assert_unchanged(target["nested"]["deep"]["b"], before["nested"]["deep"]["b"], "nested.deep.b")
    assert "gone" not in target


def test_strict_false_without_problems_does_not_warn(ckpt):
    safeckpt.save({"a": torch.ones(2)}, ckpt)
    target = {"a": torch.zeros(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        safeckpt.load(target, ckpt, strict=False)
    assert torch.equal(target["a"], torch.ones(2))


# --------------------------------------------------------------------------- modules


class Block(nn.Module):
    def __init__(self, extra: bool = False, width: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(width, 2)
        self.norm = nn.LayerNorm(2)
        if extra:
            self.extra = nn.Parameter(torch.full((4,), 9.0))


class Model(nn.Module):
    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.block = Block(**kw)
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block.norm(self.block.lin(x)))


def _saved_model(ckpt: Path, **kw: Any) -> Model:
    torch.manual_seed(0)
    model = Model(**kw)
    safeckpt.save({"model": model, "epoch": 4}, ckpt)
    return model


def test_module_with_extra_parameter(ckpt):
    _saved_model(ckpt)
    torch.manual_seed(1)
    target = Model(extra=True)
    before = snapshot(target)
    state = {"model": target, "epoch": 0}
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load(state, ckpt)
    assert problem_keys(str(err.value)) == {"model.block.extra"}
    assert_unchanged(target, before)
    assert state["epoch"] == 0


def test_module_missing_a_parameter(ckpt):
    _saved_model(ckpt, extra=True)
    torch.manual_seed(1)
    target = Model()
    before = snapshot(target)
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load({"model": target}, ckpt)
    assert problem_keys(str(err.value)) == {"model.block.extra", "epoch"}
    assert_unchanged(target, before)


def test_module_with_wrong_shapes(ckpt):
    _saved_model(ckpt)
    target = Model(width=5)
    before = snapshot(target)
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load({"model": target, "epoch": 0}, ckpt)
    assert problem_keys(str(err.value)) == {"model.block.lin.weight"}
    assert "(2, 5)" in str(err.value) and "(2, 3)" in str(err.value)
    assert_unchanged(target, before)


def test_module_with_wrong_dtype(ckpt):
    _saved_model(ckpt)
    target = Model().double()
    before = snapshot(target)
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load({"model": target, "epoch": 0}, ckpt)
    assert problem_keys(str(err.value)) == {
        "model.block.lin.weight", "model.block.lin.bias", "model.block.norm.weight",
        "model.block.norm.bias", "model.head.weight", "model.head.bias"}
    assert_unchanged(target, before)


def test_module_strict_false_loads_the_rest(ckpt):
    saved = _saved_model(ckpt)
    torch.manual_seed(1)
    target = Model(extra=True)
    with pytest.warns(UserWarning) as caught:
        safeckpt.load({"model": target, "epoch": 0}, ckpt, strict=False)
    assert any("model.block.extra" in str(w.message) for w in caught)
    for k, v in saved.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k
    assert torch.equal(target.block.extra, torch.full((4,), 9.0))


class SeenLog(nn.Module):
    """Logs what it has seen in a buffer that grows, and resizes it when loading (what
    the Trainer's resume tests do): its own ``load_state_dict`` must get the saved
    state, whose shapes differ from the fresh module's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("seen", torch.empty(0, dtype=torch.long))
        self.calls: list[bool] = []

    def load_state_dict(self, state_dict, strict=True, assign=False):
        self.calls.append(strict)
        if state_dict["seen"].shape != self.seen.shape:
            self.seen = state_dict["seen"].clone()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def test_module_with_its_own_load_state_dict_gets_the_saved_state_through_it(ckpt):
    torch.manual_seed(0)
    saved = SeenLog()
    saved.seen = torch.arange(12)
    safeckpt.save({"model": saved, "epoch": 3}, ckpt)
    target = SeenLog()
    state = {"model": target, "epoch": 0}
    safeckpt.load(state, ckpt)
    assert target.calls == [True] and state["epoch"] == 3
    assert torch.equal(target.seen, torch.arange(12)) and torch.equal(target.fc.weight, saved.fc.weight)
    assert target.state_dict().keys() == saved.state_dict().keys()


def test_module_with_its_own_load_state_dict_still_refuses_what_it_refuses(ckpt):
    safeckpt.save({"model": nn.Linear(3, 3)}, ckpt)
    target = SeenLog()
    with pytest.raises(safeckpt.StateMismatchError, match="SeenLog.load_state_dict rejected"):
        safeckpt.load({"model": target}, ckpt)  # its own strict load: the keys differ


# --------------------------------------------------------------------------- optimizers


def _trained(ckpt: Path) -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
    safeckpt.save({"model": model, "optim": opt}, ckpt)
    return model, opt


def _two_groups(model: Model) -> torch.optim.Optimizer:
    return torch.optim.Adam([{"params": model.block.parameters()},
                             {"params": model.head.parameters(), "lr": 0.5}], lr=1e-3)


def test_optimizer_with_a_different_number_of_param_groups(ckpt):
    _trained(ckpt)
    model = Model()
    opt = _two_groups(model)
    before = snapshot(opt)
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load({"optim": opt}, ckpt)
    assert isinstance(err.value, KeyError)
    assert "optim" in str(err.value)
    assert_unchanged(opt, before)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.5]


def test_optimizer_with_a_different_number_of_params_in_a_group(ckpt):
    _trained(ckpt)
    model = Model()
    opt = torch.optim.Adam(model.block.parameters(), lr=1e-3)
    before = snapshot(opt)
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load({"optim": opt}, ckpt)
    assert "optim" in str(err.value)
    assert_unchanged(opt, before)


def test_optimizer_mismatch_leaves_the_rest_of_the_state_untouched(ckpt):
    """The optimizer's mismatch must be found before anything is read: the model that
    sits next to it in the state must not have been loaded when the error is raised."""
    _trained(ckpt)
    torch.manual_seed(7)
    model = Model()
    opt = _two_groups(model)
    state = {"model": model, "optim": opt}
    before = snapshot(state)
    with pytest.raises(safeckpt.StateMismatchError):
        safeckpt.load(state, ckpt)
    assert_unchanged(state, before)


def test_optimizer_mismatch_is_listed_with_the_other_problems(ckpt):
    _trained(ckpt)
    model = Model(extra=True)
    opt = _two_groups(model)
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load({"model": model, "optim": opt}, ckpt)
    message = str(err.value)
    assert "model.block.extra" in message
    assert re.search(r"^\s+optim\b", message, re.MULTILINE), message


def test_optimizer_mismatch_with_strict_false_loads_the_model_and_warns(ckpt):
    saved_model, _ = _trained(ckpt)
    torch.manual_seed(7)
    model = Model()
    opt = _two_groups(model)
    before = snapshot(opt)
    with pytest.warns(UserWarning) as caught:
        safeckpt.load({"model": model, "optim": opt}, ckpt, strict=False)
    assert any("optim" in str(w.message) for w in caught)
    for k, v in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert_unchanged(opt, before)


def _model_and_sched(lr_step: int):
    torch.manual_seed(lr_step)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    for _ in range(lr_step):
        opt.step()
        sched.step()
    return model, opt, sched


def test_an_object_rejecting_its_state_leaves_the_whole_state_untouched(tmp_path):
    """Saved with a disabled GradScaler, loaded into an enabled one: the scaler refuses
    its state, and neither the model's weights nor the scheduler loaded before it have
    changed (the README's promise: a StateMismatchError leaves the state untouched)."""
    model, opt, sched = _model_and_sched(3)
    safeckpt.save({"model": model, "sched": sched, "scaler": torch.amp.GradScaler("cpu", enabled=False)},
                  tmp_path / "ck")
    model2, opt2, sched2 = _model_and_sched(0)
    weights, epoch = model2.weight.detach().clone(), sched2.last_epoch
    with pytest.raises(safeckpt.StateMismatchError, match="scaler.*GradScaler.load_state_dict rejected"):
        safeckpt.load({"model": model2, "sched": sched2, "scaler": torch.amp.GradScaler("cpu", enabled=True)},
                      tmp_path / "ck")
    assert torch.equal(model2.weight, weights), "the weights were overwritten before the scaler refused"
    assert sched2.last_epoch == epoch, "the scheduler kept a state from a load that failed"


def test_objects_loaded_early_are_put_back_when_the_tensors_turn_out_corrupt(tmp_path):
    model, opt, sched = _model_and_sched(3)
    safeckpt.save({"model": model, "sched": sched}, tmp_path / "ck")
    (data,) = (tmp_path / "ck").glob("data-*")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    model2, opt2, sched2 = _model_and_sched(0)
    with pytest.raises(safeckpt.CorruptCheckpointError):
        safeckpt.load({"model": model2, "sched": sched2}, tmp_path / "ck")
    assert sched2.last_epoch == 0 and sched2.get_last_lr() == [0.1]


def test_keys_given_as_one_str_is_that_key_not_its_characters(ckpt):
    """``keys="model"`` (finding d) loads the key ``model``; before, its characters were
    taken as five keys the checkpoint lacks."""
    safeckpt.save({"model": {"w": torch.arange(3.0)}, "mo": 1, "step": 7}, ckpt)
    got = safeckpt.load_state(ckpt, keys="model")
    assert list(got) == ["model"] and torch.equal(got["model"]["w"], torch.arange(3.0))
    target = {"model": {"w": torch.zeros(3)}}
    safeckpt.load(target, ckpt, keys="model")
    assert torch.equal(target["model"]["w"], torch.arange(3.0))
    assert list(safeckpt.load_state(ckpt, keys=("mo", "step"))) == ["mo", "step"]  # any iterable of keys
    with pytest.raises(safeckpt.StateMismatchError, match=r"holds no \['nope'\]"):
        safeckpt.load_state(ckpt, keys="nope")


# --------------------------------------------------------------------------- targets sharing memory (finding 6)

SHARED_ELEMENTS = {
    "overlapping as_strided": lambda: torch.zeros(20).as_strided((4, 3), (1, 1)),
    "expand": lambda: torch.zeros(3)[None].expand(4, 3),
    "expand inside a Shard": lambda: safeckpt.Shard(torch.zeros(3)[None].expand(4, 3), (4, 3), (0, 0)),
}


@pytest.mark.parametrize("case", list(SHARED_ELEMENTS))
def test_a_target_whose_elements_share_memory_is_refused_before_anything_is_read(ckpt, case):
    """Its elements cannot each take a saved value: torch's copy_ refuses an expanded
    target, and the last write wins in an overlapping one (the load used to return with
    wrong values, or raise a RuntimeError after other tensors were overwritten)."""
    safeckpt.save({"a": torch.arange(3.0) + 1, "w": torch.arange(12.0).reshape(4, 3)}, ckpt)
    target = {"a": torch.zeros(3), "w": SHARED_ELEMENTS[case]()}
    before = snapshot(target["a"])
    with pytest.raises(safeckpt.StateMismatchError, match="share memory") as err:
        safeckpt.load(target, ckpt)
    assert err.value.keys == ["w"] and problem_keys(str(err.value)) == {"w"}
    assert_unchanged(target["a"], before, "a")
    with pytest.warns(safeckpt.PartialLoadWarning, match="w: the state's tensor has elements that share memory"):
        safeckpt.load(target, ckpt, strict=False)
    assert torch.equal(target["a"], torch.arange(3.0) + 1)


def test_targets_sharing_memory_are_refused_unless_they_are_one_tensor_saved_as_a_tie(ckpt):
    """Two tensors of the state over one memory: each would get part of the other's
    saved values. Refused up front (both named, nothing read) unless they are one view
    and the checkpoint holds them as one tensor tied; views that only interleave (columns
    of one matrix) and a view with gaps share nothing and load."""
    buf = torch.arange(20.0)
    safeckpt.save({"a": buf[0:10], "b": buf[5:15], "c": buf[15:20].clone(), "d": torch.ones(2)}, ckpt)
    into = torch.zeros(20)
    target = {"a": into[0:10], "b": into[5:15], "c": into[15:20], "d": torch.zeros(2)}
    with pytest.raises(safeckpt.StateMismatchError, match="'b', but the checkpoint holds them as different") as err:
        safeckpt.load(target, ckpt)
    assert sorted(err.value.keys) == ["a", "b"] and not into.any() and not target["d"].any()
    same = torch.zeros(5)  # one tensor for two that were saved apart
    with pytest.raises(safeckpt.StateMismatchError) as err:
        safeckpt.load({"a": torch.zeros(10), "b": torch.zeros(10), "c": same, "d": same[:2]}, ckpt)
    assert sorted(err.value.keys) == ["c", "d"]

    tied = nn.Linear(4, 4)
    safeckpt.save({"x": tied.weight, "y": tied.weight, "cols": torch.arange(24.0).reshape(4, 6)[:, 0:3],
                   "rest": torch.arange(24.0).reshape(4, 6)[:, 3:6], "gaps": torch.arange(8.0)[::2]}, ckpt,
                  overwrite=True)
    fresh, matrix, gapped = nn.Linear(4, 4), torch.zeros(4, 6), torch.zeros(8)
    safeckpt.load({"x": fresh.weight.data, "y": fresh.weight.data, "cols": matrix[:, 0:3], "rest": matrix[:, 3:6],
                   "gaps": gapped[::2]}, ckpt)
    assert torch.equal(fresh.weight, tied.weight)
    assert torch.equal(matrix, torch.arange(24.0).reshape(4, 6))
    assert torch.equal(gapped, torch.tensor([0.0, 0, 2, 0, 4, 0, 6, 0]))
    # meta tensors have no memory (each has address 0): loading into them does nothing, as before
    safeckpt.load({k: torch.empty_like(v, device="meta") for k, v in safeckpt.load_state(ckpt).items()}, ckpt)
