"""The restricted value codec: plain Python values to JSON and back, never running code.

Containers keep their exact type (tuple vs list, OrderedDict, non-string keys),
ints of any size, non-finite floats, bytes, NumPy arrays and scalars, torch dtypes
and devices. Tensors are not encoded here: the caller passes ``on_tensor`` to turn
each tensor into a reference, and ``on_ref`` to turn references back.
Anything else is refused with ``UnsafeObjectError`` unless the caller opts into
pickle, in which case loading it needs the same explicit opt-in.

This module encodes; decoding and checking a tree need no torch and live in ``tree``
(its names are also here, for the modules that do both).
"""

from __future__ import annotations

import base64
import collections
import itertools
import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..errors import UnsafeObjectError
from .tree import JSON, MAX_DEPTH, SAFE_INT, tag_of
from .tree import (CONTAINER_TAGS, build_container, check_tree, child_key, decode_key,  # noqa: F401
                   decode_leaf, decode_set, decode_value, items_of)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _encode_float(x: float) -> JSON:
    return x if math.isfinite(x) else {"$float": repr(x)}


def _encode_ndarray(a: np.ndarray, key: str, allow_pickle: bool) -> JSON:
    if a.dtype.kind in "OV":
        if allow_pickle:
            return _pickled(a, key)
        raise UnsafeObjectError(
            f"cannot store NumPy array of dtype {a.dtype} at {key!r}: object and structured "
            "arrays need pickle; convert it to a tensor or plain values, or pass allow_pickle=True"
        )
    return {"$ndarray": {"dtype": a.dtype.str, "shape": list(a.shape),
                         "data": _b64(np.ascontiguousarray(a).tobytes())}}


def _pickled(value: Any, key: str) -> JSON:
    try:
        return {"$pickle": _b64(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))}
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise UnsafeObjectError(f"cannot store the value at {key!r} even with pickle: {exc}") from exc


def encode_leaf(value: Any, key: str, allow_pickle: bool) -> JSON:
    """Encode a value that is not a container or tensor; ``key`` names it in errors."""
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if kind is int:
        return value if -SAFE_INT < value < SAFE_INT else {"$int": hex(value)}
    if kind is float:
        return _encode_float(value)
    if kind is complex:
        return {"$complex": [_encode_float(value.real), _encode_float(value.imag)]}
    if kind is bytes:
        return {"$bytes": _b64(value)}
    if kind is bytearray:
        return {"$bytearray": _b64(bytes(value))}
    if kind is torch.dtype:
        return {"$dtype": str(value).removeprefix("torch.")}
    if kind is torch.device:
        return {"$device": str(value)}
    if isinstance(value, np.ndarray) and kind is np.ndarray:
        return _encode_ndarray(value, key, allow_pickle)
    if isinstance(value, np.generic) and value.dtype.kind not in "OV":
        return {"$npscalar": {"dtype": value.dtype.str, "data": _b64(value.tobytes())}}
    if allow_pickle:
        return _pickled(value, key)
    raise UnsafeObjectError(
        f"cannot store {kind.__module__}.{kind.__qualname__} at {key!r} without pickle, "
        "which would run code when loaded; give it state_dict()/load_state_dict(), convert "
        "it to plain values, or pass allow_pickle=True to save and load"
    )


@dataclass
class Encoded:
    """Returned by an ``on_object`` hook: JSON that ``encode`` emits as it is."""

    json: JSON


_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types that go straight to on_tensor
_UNHOOKED = {dict, list, tuple, str, int, float, bool, type(None), *_TENSORS}  # never given to on_object
_CONTAINERS = (dict, collections.OrderedDict, list, tuple, torch.Size, set, frozenset)


def encode(value: Any, key: str, on_tensor: Callable[[str, torch.Tensor], JSON],
           on_object: Callable[[str, Any], Any], allow_pickle: bool, depth: int = 0) -> JSON:
    """Encode a tree; ``on_object`` may replace a value (e.g. by its ``state_dict()``)
    or encode it itself by returning ``Encoded``. Values of the plain types (dict, list,
    tuple, str, int, float, bool, None, and exact ``torch.Tensor`` and ``Parameter``) are
    never given to it: that is the hot path of a state of many tensors, and no hook
    replaces them. Containers and tensor references ``MAX_DEPTH`` deep or more are
    refused with ``UnsafeObjectError``, as ``check_tree`` refuses them on load."""
    kind = type(value)
    if kind not in _UNHOOKED:
        value = on_object(key, value)
        kind = type(value)
        if kind is Encoded:
            if depth >= MAX_DEPTH and tag_of(value.json) is not None:
                raise _too_deep(key)
            return value.json
    if depth >= MAX_DEPTH and (kind in _CONTAINERS or isinstance(value, torch.Tensor)):
        raise _too_deep(key)
    inner = depth + 1
    fast = inner < MAX_DEPTH  # tensor children may go to on_tensor directly
    values: list = []
    if kind is dict:  # the common case first: string keys, encoded as a plain JSON object
        out: dict = {}
        for k, v in value.items():
            if type(k) is not str or k[:1] == "$":
                values = list(out.values())  # a tagged object after all: the values so far, then the rest
                break
            name = f"{key}.{k}" if key else k  # child_key, inlined: once per tensor
            out[k] = (on_tensor(name, v) if fast and type(v) in _TENSORS else
                      encode(v, name, on_tensor, on_object, allow_pickle, inner))
        else:
            return out
    if kind is dict or kind is collections.OrderedDict:
        for k, v in itertools.islice(value.items(), len(values), None):
            name = (f"{key}.{k}" if key else k) if type(k) is str else child_key(key, k)
            values.append(on_tensor(name, v) if fast and type(v) in _TENSORS else
                          encode(v, name, on_tensor, on_object, allow_pickle, inner))
        tag = "$dict" if kind is dict else "$odict"
        return {tag: [[k if type(k) is str else encode_leaf_or_tuple(k, key, allow_pickle), v]  # a str is itself
                      for k, v in zip(value, values)]}
    if kind is list or kind is tuple or kind is torch.Size:
        items = [on_tensor(f"{key}.{i}" if key else str(i), v) if fast and type(v) in _TENSORS else
                 encode(v, f"{key}.{i}" if key else str(i), on_tensor, on_object, allow_pickle, inner)
                 for i, v in enumerate(value)]
        return items if kind is list else {"$size" if kind is torch.Size else "$tuple": items}
    if isinstance(value, torch.Tensor):
        return on_tensor(key, value)
    if kind is set or kind is frozenset:
        items = sorted((encode_leaf_or_tuple(v, key, allow_pickle) for v in value), key=repr)
        return {"$" + kind.__name__: items}
    return encode_leaf(value, key, allow_pickle)


def _too_deep(key: str) -> UnsafeObjectError:
    return UnsafeObjectError(f"the value at {key or '<root>'!r} is nested more than {MAX_DEPTH} containers deep; "
                             "flatten the structure")


def encode_leaf_or_tuple(value: Any, key: str, allow_pickle: bool) -> JSON:
    """Encode a dict key or set member: a leaf or a tuple of them (no tensors)."""
    if type(value) is tuple:
        return {"$tuple": [encode_leaf_or_tuple(v, key, allow_pickle) for v in value]}
    return encode_leaf(value, key, allow_pickle)


