"""The tree of a manifest: the saved state as JSON (docs/format.md §7), with tensors as
references. Walking it, checking it and decoding its values, without importing torch:
``safeckpt ls`` and ``show`` read manifests only (torch is imported for a value that is
one of its types: a dtype, a device, a ``torch.Size``). ``codec`` encodes states into
trees.
"""

from __future__ import annotations

import base64
import collections
import pickle
import re
from typing import Any, Callable, Container, cast

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError, UnsafeObjectError
from .dtypes import ITEMSIZES, QUANTIZED
from .text import key_text

JSON = Any
MAX_DEPTH = 100  #: containers nested deeper than this are refused on save and on load


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _number(value: Any) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def decode_leaf(node: JSON, key: str, allow_pickle: bool) -> Any:
    """Inverse of ``codec.encode_leaf`` for one tagged or plain JSON value."""
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
            return unb64(arg)
        if tag == "$bytearray":
            return bytearray(unb64(arg))
        if tag == "$dtype":  # torch only for a value that is one of its types
            import torch

            dtype = getattr(torch, arg)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(arg)
            return dtype
        if tag == "$device":
            import torch

            return torch.device(arg)
        if tag == "$ndarray":
            dtype = np.dtype(arg["dtype"])
            if dtype.kind in "OV":
                raise ValueError(f"dtype {dtype}")
            return np.frombuffer(unb64(arg["data"]), dtype=dtype).reshape(arg["shape"]).copy()
        if tag == "$npscalar":
            dtype = np.dtype(arg["dtype"])
            if dtype.kind in "OV":
                raise ValueError(f"dtype {dtype}")
            return np.frombuffer(unb64(arg["data"]), dtype=dtype)[0]
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, OverflowError) as exc:
        raise CorruptCheckpointError(f"cannot decode value {tag} at {key!r}: {exc}") from exc
    if tag == "$pickle":
        if not allow_pickle:
            raise UnsafeObjectError(
                f"the value at {key!r} was stored with pickle; loading it runs code from the "
                "checkpoint. Pass allow_pickle=True only if you trust who wrote it"
            )
        return pickle.loads(unb64(arg))
    raise CorruptCheckpointError(f"unknown value tag {tag!r} at {key!r}")


def child_key(prefix: str, key: Any) -> str:
    """The dotted name of a child, as in a ``state_dict``: ``model`` + ``w`` -> ``model.w``
    (an int key too long for decimal text in hex: ``text.key_text``)."""
    return f"{prefix}.{key_text(key)}" if prefix else key_text(key)


def decode_key(node: JSON, key: str, allow_pickle: bool) -> Any:
    """Inverse of ``codec.encode_leaf_or_tuple``."""
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
        if _plainly_valid(tag, arg):
            return
        try:
            decode_leaf(node, key, False)
        except CorruptCheckpointError as exc:
            raise bad(key, f"cannot be decoded ({exc})") from exc


_DEVICE = re.compile(r"(cpu|cuda|meta|mps|xpu)(:[0-9]{1,2})?")


def _plainly_valid(tag: str, arg: Any) -> bool:
    """A dtype or device value of the usual kinds, known valid without importing torch
    (any other is decoded to be checked, which asks torch)."""
    if tag == "$dtype":
        return type(arg) is str and (arg in ITEMSIZES or arg in QUANTIZED)
    return tag == "$device" and type(arg) is str and _DEVICE.fullmatch(arg) is not None


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
        import torch

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


def leaf_values(tree: Any) -> dict[str, Any]:
    """Every non-tensor value of a saved tree by its dotted name, still encoded (so two
    checkpoints compare by their JSON). A list or tuple of plain values is one value, and
    so is an empty container; rank-local values are named ``key@rank`` like rank-local
    tensors."""
    out: dict[str, Any] = {}
    if tree is None:  # a seal of other tools' files holds no state
        return out

    def walk(node: Any, key: str) -> None:
        tag = tag_of(node)
        if tag == "$tensor":
            return
        if tag == "$local":
            for rank, child in enumerate(node["$local"]):
                walk(child, f"{key}@{rank}")
            return
        if tag is None or tag in ("$set", "$frozenset") or (tag in ("list", "$tuple", "$size")
                                                             and not _has_tensor(node)):
            out[key or "<root>"] = node  # a leaf, or a sequence of plain values: one value
            return
        try:
            items = items_of(node, key, False)
        except UnsafeObjectError:
            out[key or "<root>"] = node  # a mapping with pickled keys
            return
        if not items and key:
            out[key] = node
        for k, child in items:
            walk(child, child_key(key, k))

    walk(tree, "")
    return out


def _has_tensor(node: Any) -> bool:
    """True when an encoded sequence holds a tensor or a mapping (shown item by item)."""
    tag = tag_of(node)
    if tag in ("$tensor", "$local", "object", "$dict", "$odict"):
        return True
    if tag in ("list", "$tuple", "$size"):
        return any(_has_tensor(n) for n in (node if tag == "list" else node[tag]))
    return False
