"""From a user's state to named items and back.

Saving: ``flatten`` walks the state, replaces objects that have ``state_dict()`` by
their state, gives every tensor its dotted name and encodes everything else with the
restricted codec. Loading: ``LoadPlanner`` matches the state to load into against the
saved tree *before reading anything*, so a mismatch leaves the state untouched; it
returns the reads to do and a ``build`` step that puts the results in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import codec
from .errors import StateMismatchError, UnsafeObjectError
from .manifest import TensorEntry
from .tensors import dtype_from_name


def is_stateful(obj: Any) -> bool:
    """Objects saved as their ``state_dict()`` and loaded with ``load_state_dict``."""
    return (not isinstance(obj, (torch.Tensor, dict, list, tuple, type))
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


@dataclass
class FlatState:
    """A state as the manifest's tree plus its tensors, each named once."""

    tree: Any
    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> first name


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
            tuple(t.shape), tuple(t.stride()), t.dtype)


def flatten(state: dict, allow_pickle: bool = False) -> FlatState:
    """Walk ``state``; tensors that are the same view of the same memory are stored once."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, not {type(state).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}

    def on_tensor(key: str, t: torch.Tensor) -> dict:
        if key in tensors or key in aliases:
            raise UnsafeObjectError(f"two tensors in the state are both named {key!r}; rename one of the keys")
        if t.is_quantized or t.layout != torch.strided or t.is_nested or t.device.type == "meta":
            raise UnsafeObjectError(
                f"cannot store tensor {key!r} ({t.layout}, {t.dtype}, on {t.device}): only dense "
                "tensors with data are supported; convert it first")
        skey = _storage_key(t) if t.numel() else None
        if skey is not None and skey in seen:
            aliases[key] = seen[skey]
        else:
            tensors[key] = t
            if skey is not None:
                seen[skey] = key
        return {"$tensor": key}

    def on_object(key: str, value: Any) -> Any:
        return value.state_dict() if is_stateful(value) else value

    tree = codec.encode(state, "", on_tensor, on_object, allow_pickle)
    return FlatState(tree, tensors, aliases)


@dataclass
class Read:
    """One tensor to read: into ``dest`` (in place) or into a new tensor."""

    name: str
    entry: TensorEntry
    dest: torch.Tensor | None
    result: torch.Tensor | None = None


Thunk = Callable[[], Any]


class LoadPlanner:
    """Matches a target state against a saved tree (see module docstring).

    Modes: ``"state"`` (the user's containers and ``nn.Module`` states: keys must
    match), ``"object"`` (the state of another stateful object such as an optimizer:
    the checkpoint's structure wins, the object's ``load_state_dict`` validates it)."""

    def __init__(self, tensors: dict[str, TensorEntry], strict: bool, allow_pickle: bool) -> None:
        self.tensors = tensors
        self.strict = strict
        self.allow_pickle = allow_pickle
        self.reads: list[Read] = []
        self.problems: list[str] = []

    def plan(self, target: Any, node: Any, key: str = "", mode: str = "state") -> Thunk:
        if is_stateful(target):
            return self._plan_object(target, node, key)
        tag = codec.tag_of(node)
        if isinstance(target, torch.Tensor):
            return self._plan_tensor_into(target, node, key, mode)
        if tag == "$tensor":
            if isinstance(target, (dict, list, tuple)):
                self.problems.append(f"{key or '<root>'}: the state has a {type(target).__name__}, the checkpoint a tensor")
                return lambda: target
            return self._fresh_tensor(node, key)
        if tag in ("$set", "$frozenset"):
            return lambda: codec.decode_set(node, key, self.allow_pickle)
        if tag is None:
            if isinstance(target, (dict, list, tuple)):
                self.problems.append(f"{key or '<root>'}: the state has a {type(target).__name__}, the checkpoint a plain value")
                return lambda: target
            return lambda: codec.decode_leaf(node, key, self.allow_pickle)
        if isinstance(target, (dict, list, tuple)) and mode == "state":
            return self._plan_container_into(target, node, key, tag)
        return self._plan_container_fresh(target, node, key, tag)

    def _entry(self, node: dict, key: str) -> TensorEntry | None:
        entry = self.tensors.get(node["$tensor"])
        if entry is None:
            self.problems.append(f"{key}: the checkpoint's tree names tensor {node['$tensor']!r} but has no data for it")
        return entry

    def _fresh_tensor(self, node: dict, key: str) -> Thunk:
        entry = self._entry(node, key)
        if entry is None:
            return lambda: None
        read = Read(node["$tensor"], entry, None)
        self.reads.append(read)
        return lambda: read.result

    def _plan_tensor_into(self, target: torch.Tensor, node: Any, key: str, mode: str) -> Thunk:
        if codec.tag_of(node) != "$tensor":
            self.problems.append(f"{key}: the state has a tensor, the checkpoint a {describe(node)}")
            return lambda: target
        entry = self._entry(node, key)
        if entry is None:
            return lambda: target
        dtype = dtype_from_name(entry.dtype, key)
        if list(target.shape) == entry.shape and target.dtype == dtype:
            self.reads.append(Read(node["$tensor"], entry, target))
            return lambda: target
        if mode == "object":  # the checkpoint's tensor replaces the object's current one
            return self._fresh_tensor(node, key)
        self.problems.append(f"{key}: the state has {tuple(target.shape)} {target.dtype}, "
                             f"the checkpoint {tuple(entry.shape)} {dtype}")
        return lambda: target

    def _plan_container_into(self, target: dict | list | tuple, node: Any, key: str, tag: str) -> Thunk:
        if (tag in ("object", "$dict", "$odict")) != isinstance(target, dict):
            self.problems.append(f"{key or '<root>'}: the state has a {type(target).__name__}, the checkpoint a {describe(node)}")
            return lambda: target
        saved = dict(codec.items_of(node, key, self.allow_pickle))
        current = dict(target.items()) if isinstance(target, dict) else dict(enumerate(target))
        children = {k: self.plan(current[k], saved[k], codec.child_key(key, k)) for k in current if k in saved}
        for k in (k for k in current if k not in saved):
            self.problems.append(f"{codec.child_key(key, k)}: missing from the checkpoint")
        for k in (k for k in saved if k not in current):
            self.problems.append(f"{codec.child_key(key, k)}: in the checkpoint but not in the state")

        def build() -> Any:
            values = {k: th() for k, th in children.items()}
            if isinstance(target, tuple):
                return tuple(values.get(i, v) for i, v in enumerate(target))
            for k, v in values.items():
                target[k] = v
            return target
        return build

    def _plan_container_fresh(self, target: Any, node: Any, key: str, tag: str) -> Thunk:
        current: dict = {}
        if isinstance(target, dict):
            current = dict(target)
        elif isinstance(target, (list, tuple)):
            current = dict(enumerate(target))
        children = [(k, self.plan(current.get(k), child, codec.child_key(key, k), "object"))
                    for k, child in codec.items_of(node, key, self.allow_pickle)]
        return lambda: codec.build_container(tag, [(k, th()) for k, th in children])

    def _plan_object(self, target: Any, node: Any, key: str) -> Thunk:
        is_module = isinstance(target, torch.nn.Module)
        inner = self.plan(target.state_dict(), node, key, "state" if is_module else "object")

        def build() -> Any:
            value = inner()
            try:
                if is_module:
                    target.load_state_dict(value, strict=self.strict)
                else:
                    target.load_state_dict(value)
            except Exception as exc:  # the object's own validation: report it as a mismatch
                raise StateMismatchError(
                    f"{key or '<root>'}: {type(target).__name__}.load_state_dict rejected the "
                    f"checkpoint's state: {exc}") from exc
            return target
        return build


def describe(node: Any) -> str:
    """A short description of an encoded node for mismatch messages."""
    tag = codec.tag_of(node)
    return {"object": "dict", "$dict": "dict", "$odict": "dict", "list": "list", "$tuple": "tuple",
            "$tensor": "tensor", None: "plain value"}.get(tag, tag or "value")
