"""The restricted value codec: plain Python values to JSON and back, never running code.

Containers keep their exact type (tuple vs list, OrderedDict, non-string keys),
ints of any size, non-finite floats, bytes, NumPy arrays and scalars, torch dtypes
and devices. Tensors are not encoded here: the caller passes ``on_tensor`` to turn
each tensor into a reference, and ``on_ref`` to turn references back.
Anything else is refused with ``UnsafeObjectError`` unless the caller opts into
pickle, in which case loading it needs the same explicit opt-in.
"""

from __future__ import annotations

import base64
import collections
import itertools
import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Container, cast

import numpy as np
import torch

from ..errors import CheckpointError, CorruptCheckpointError, UnsafeObjectError

JSON = Any
_SAFE_INT = 2**53


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


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
        return value if -_SAFE_INT < value < _SAFE_INT else {"$int": hex(value)}
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


def _number(value: Any) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def decode_leaf(node: JSON, key: str, allow_pickle: bool) -> Any:
    """Inverse of ``encode_leaf`` for one tagged or plain JSON value."""
    if not isinstance(node, dict):
        return node
    ((tag, arg),) = node.items()
    try:
        if tag == "$int":
            return int(arg, 0)
        if tag == "$float":
            return float(arg)
        if tag == "$complex":
            real, imag = (float(part["$float"]) if isinstance(part, dict) else _number(part) for part in arg)
            return complex(real, imag)
        if tag == "$bytes":
            return _unb64(arg)
        if tag == "$bytearray":
            return bytearray(_unb64(arg))
        if tag == "$dtype":
            dtype = getattr(torch, arg)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(arg)
            return dtype
        if tag == "$device":
            return torch.device(arg)
        if tag == "$ndarray":
            dtype = np.dtype(arg["dtype"])
            if dtype.kind in "OV":
                raise ValueError(f"dtype {dtype}")
            return np.frombuffer(_unb64(arg["data"]), dtype=dtype).reshape(arg["shape"]).copy()
        if tag == "$npscalar":
            dtype = np.dtype(arg["dtype"])
            if dtype.kind in "OV":
                raise ValueError(f"dtype {dtype}")
            return np.frombuffer(_unb64(arg["data"]), dtype=dtype)[0]
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, OverflowError) as exc:
        raise CorruptCheckpointError(f"cannot decode value {tag} at {key!r}: {exc}") from exc
    if tag == "$pickle":
        if not allow_pickle:
            raise UnsafeObjectError(
                f"the value at {key!r} was stored with pickle; loading it runs code from the "
                "checkpoint. Pass allow_pickle=True only if you trust who wrote it"
            )
        return pickle.loads(_unb64(arg))
    raise CorruptCheckpointError(f"unknown value tag {tag!r} at {key!r}")


def child_key(prefix: str, key: Any) -> str:
    """The dotted name of a child, as in a ``state_dict``: ``model`` + ``w`` -> ``model.w``."""
    return f"{prefix}.{key}" if prefix else str(key)


@dataclass
class Encoded:
    """Returned by an ``on_object`` hook: JSON that ``encode`` emits as it is."""

    json: JSON


_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types that go straight to on_tensor
_UNHOOKED = {dict, list, tuple, str, int, float, bool, type(None), *_TENSORS}  # never given to on_object
_CONTAINERS = (dict, collections.OrderedDict, list, tuple, torch.Size, set, frozenset)
MAX_DEPTH = 100  #: containers nested deeper than this are refused on save and on load


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
            name = f"{key}.{k}" if key else str(k)
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


def decode_key(node: JSON, key: str, allow_pickle: bool) -> Any:
    """Inverse of ``encode_leaf_or_tuple``."""
    if isinstance(node, dict) and "$tuple" in node:
        return tuple(decode_key(v, key, allow_pickle) for v in node["$tuple"])
    return decode_leaf(node, key, allow_pickle)


CONTAINER_TAGS = ("$dict", "$odict", "$tuple", "$size", "$set", "$frozenset", "$tensor", "$local")
_UNHASHABLE = ("$ndarray", "$bytearray")
_INT64 = 2**63


def check_tree(node: JSON, where: str, tensors: "Container[str]", *, plain: bool = False,
               rank_tree: bool = False, error: type[CheckpointError] = CorruptCheckpointError) -> None:
    """Raise ``error`` naming ``where`` unless ``node`` is a tree this codec wrote: every
    tag with the argument its decoder expects, every leaf decodable (``$pickle`` leaves
    are decoded on load, with the loader's opt-in), dict keys and set members hashable,
    ``$tensor`` naming one of ``tensors``, ``$local`` not nested (``plain`` values, as
    metadata and metrics, have neither ``$local`` nor ``$pickle``), and
    at most ``MAX_DEPTH`` containers deep. Walked without recursion, so a crafted tree
    of any depth is refused cleanly; after it, the decoders and the load planner (which
    recurse) cannot fail on the tree's shape. ``rank_tree``: one rank's tree before the
    ranks' trees are merged, where ``$local`` holds this rank's value, not every rank's."""
    # node, its parent's key and its own name in it (the key is built only when needed:
    # most nodes are leaves), depth, inside $local
    stack: list[tuple[JSON, str | None, Any, int, bool]] = [(node, None, "", 0, False)]

    def bad(key: str, what: str) -> CheckpointError:
        return error(f"{where}: the value at {key or '<root>'!r} {what}")

    while stack:
        node, parent, name, depth, local = stack.pop()
        if not isinstance(node, (dict, list)):
            continue  # a plain JSON leaf
        key = "" if parent is None else child_key(parent, name)
        tag = tag_of(node)
        if tag is None:
            _check_leaf(node, key, not plain, bad)
            continue
        if depth >= MAX_DEPTH:
            raise bad(key, f"is nested more than {MAX_DEPTH} containers deep")
        arg: Any = cast(Any, node)[tag] if tag not in ("object", "list") else node
        if tag == "$tensor":
            if not isinstance(arg, str) or arg not in tensors:
                raise bad(key, f"names tensor {arg!r}, which the checkpoint does not hold")
            continue
        if tag == "$local" and rank_tree and not local:
            stack.append((arg, parent, name, depth + 1, True))
            continue
        if not isinstance(arg, (list, dict)) or (tag != "object" and not isinstance(arg, list)):
            raise bad(key, f"is a malformed {tag} (not a list)")
        if tag == "$local":
            if local or plain:
                raise bad(key, "is a rank-local value where none may be")
            local = True
        if tag in ("$set", "$frozenset"):
            for member in arg:
                _check_key(member, key, not plain, bad)
            continue
        if tag in ("$dict", "$odict"):
            for pair in arg:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise bad(key, f"is a malformed {tag} (an item is not a [key, value] pair)")
                _check_key(pair[0], key, not plain, bad)
            stack.extend((v, key, k, depth + 1, local) for k, v in arg)
        elif tag == "object":
            stack.extend((v, key, k, depth + 1, local) for k, v in cast(dict, arg).items())
        else:
            if tag == "$size" and not all(type(v) is int and 0 <= v < _INT64 for v in arg):
                raise bad(key, "is a malformed $size (not a list of dimensions)")
            stack.extend((v, key, i, depth + 1, local) for i, v in enumerate(arg))


def _check_leaf(node: JSON, key: str, pickled: bool, bad: Callable[[str, str], CheckpointError]) -> None:
    if isinstance(node, dict):
        ((tag, arg),) = node.items()
        if tag == "$pickle":
            if not pickled or not isinstance(arg, str):
                raise bad(key, "is a malformed $pickle")
            return
        try:
            decode_leaf(node, key, False)
        except CorruptCheckpointError as exc:
            raise bad(key, f"cannot be decoded ({exc})") from exc


def _check_key(node: JSON, key: str, pickled: bool, bad: Callable[[str, str], CheckpointError]) -> None:
    """A dict key or set member: a hashable leaf, or a ``$tuple`` of them."""
    stack = [(node, 0)]
    while stack:
        node, depth = stack.pop()
        tag = tag_of(node)
        if tag == "$tuple" and isinstance(node[tag], list) and depth < MAX_DEPTH:
            stack.extend((member, depth + 1) for member in node[tag])
        elif tag is not None or (isinstance(node, dict) and next(iter(node)) in _UNHASHABLE):
            raise bad(key, f"has a key or member that is not hashable: {str(node)[:80]}")
        else:
            _check_leaf(node, key, pickled, bad)


def tag_of(node: JSON) -> str | None:
    """The container or reference tag of an encoded node, ``"object"`` for a plain
    JSON object, ``"list"`` for an array, ``None`` for a leaf."""
    if isinstance(node, list):
        return "list"
    if isinstance(node, dict):
        if len(node) == 1:
            (tag,) = node
            if tag in CONTAINER_TAGS:
                return tag
            if tag.startswith("$"):
                return None
        return "object"
    return None


def items_of(node: JSON, key: str, allow_pickle: bool) -> list[tuple[Any, JSON]]:
    """The (key, child) pairs of an encoded mapping, list or tuple node."""
    tag = tag_of(node)
    if tag == "object":
        return list(node.items())
    if tag == "list":
        return list(enumerate(node))
    if tag in ("$tuple", "$size"):
        return list(enumerate(node[tag]))
    if tag in ("$dict", "$odict"):
        try:
            return [(decode_key(k, key, allow_pickle), v) for k, v in node[tag]]
        except CheckpointError:
            raise
        except (TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"malformed mapping at {key!r}: {exc}") from exc
    raise CorruptCheckpointError(f"expected a container at {key!r}")


def build_container(tag: str, items: list[tuple[Any, Any]]) -> Any:
    """Make the Python container for ``tag`` from decoded (key, value) pairs."""
    if tag in ("object", "$dict"):
        return dict(items)
    if tag == "$odict":
        return collections.OrderedDict(items)
    if tag == "list":
        return [v for _, v in items]
    if tag == "$tuple":
        return tuple(v for _, v in items)
    if tag == "$size":
        return torch.Size([v for _, v in items])
    raise ValueError(tag)


def decode_set(node: JSON, key: str, allow_pickle: bool) -> set | frozenset:
    """Decode a ``$set`` / ``$frozenset`` node."""
    tag = tag_of(node)
    members = [decode_key(v, key, allow_pickle) for v in node[tag]]
    return set(members) if tag == "$set" else frozenset(members)


def decode_value(node: JSON, key: str, allow_pickle: bool = False) -> Any:
    """Decode a tree that holds no tensor references (metadata, metrics, keys)."""
    tag = tag_of(node)
    if tag is None:
        return decode_leaf(node, key, allow_pickle)
    if tag in ("$set", "$frozenset"):
        return decode_set(node, key, allow_pickle)
    if tag == "$tensor":
        raise CorruptCheckpointError(f"unexpected tensor reference at {key!r}")
    return build_container(tag, [(k, decode_value(v, child_key(key, k), allow_pickle))
                                 for k, v in items_of(node, key, allow_pickle)])
