"""The tree of a manifest: the saved state as JSON (docs/format.md §7), with tensors as
references. Walking it, checking it and decoding its values, without importing torch:
``safeckpt ls`` and ``show`` read manifests only (torch is imported for a value that is
one of its types: a dtype, a device, a ``torch.Size``). ``codec`` encodes states into
trees.
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
import re
from dataclasses import dataclass
from typing import Any, Callable, Container, cast

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError, UnsafeObjectError
from .dtypes import ITEMSIZES, QUANTIZED
from .text import key_text

JSON = Any
MAX_DEPTH = 100  #: containers nested deeper than this are refused on save and on load


def unb64(text: str) -> bytes:
    """Standard base64 with padding, in its one canonical form (unused bits zero)."""
    data = base64.b64decode(text.encode("ascii"), validate=True)
    if base64.b64encode(data) != text.encode("ascii"):
        raise ValueError(f"{text[:20]!r} is not canonical base64")
    return data


SAFE_INT = 2**53  #: ints of at least this size are ``$int``, smaller ones JSON integers
_INT_FORMS = re.compile(r"-?(0x[1-9a-f][0-9a-f]*|[1-9][0-9]*)")  # hex(v), or decimal (older writers)
_NON_FINITE = ("inf", "-inf", "nan")  # $float's arguments; each decodes to a new float (two NaN keys stay two)


def _decode_int(arg: Any) -> int:
    if type(arg) is not str or not _INT_FORMS.fullmatch(arg):
        raise ValueError(f"{arg!r} is not hex(v) or a decimal integer")
    value = int(arg, 16 if "x" in arg else 10)
    if -SAFE_INT < value < SAFE_INT:
        raise ValueError(f"{value} is written as a JSON integer, not as $int")
    return value


def _decode_float(part: Any) -> float:
    """A float as ``$complex`` holds each part: a finite JSON float or a ``$float``."""
    if type(part) is float and math.isfinite(part):
        return part
    if type(part) is dict and list(part) == ["$float"] and part["$float"] in _NON_FINITE:
        return float(part["$float"])
    raise ValueError(f"{part!r} is not a finite JSON float or a $float")


def _decode_dtype(arg: Any) -> Any:
    import torch  # only for a value that is one of its types

    dtype = getattr(torch, arg, None) if type(arg) is str else None
    if not isinstance(dtype, torch.dtype) or str(dtype) != f"torch.{arg}":
        raise ValueError(f"{arg!r} is not the name of a torch dtype (aliases such as 'int' or 'half' are not)")
    return dtype


def _decode_device(arg: Any) -> Any:
    import torch

    device = torch.device(arg) if type(arg) is str else None
    if device is None or str(device) != arg:
        raise ValueError(f"{arg!r} is not str() of a torch device")
    return device


def _numpy(arg: Any, fields: tuple[str, ...]) -> tuple[np.dtype, bytes]:
    """The dtype and data of an ``$ndarray`` or ``$npscalar`` argument: exactly
    ``fields``, the dtype as NumPy's ``dtype.str`` writes it, and not an object or void one."""
    if type(arg) is not dict or sorted(arg) != sorted(fields):
        raise ValueError(f"the argument is not an object of {', '.join(fields)}")
    name = arg["dtype"]
    dtype = np.dtype(name) if type(name) is str else None
    if dtype is None or dtype.str != name or dtype.kind in "OV":
        raise ValueError(f"dtype {name!r} is not a plain NumPy dtype.str")
    return dtype, unb64(arg["data"])


def _decode_ndarray(arg: Any) -> np.ndarray:
    dtype, data = _numpy(arg, ("dtype", "shape", "data"))
    shape = arg["shape"]
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"shape {shape!r} is not a list of sizes")
    count = math.prod(shape)
    if len(data) != count * dtype.itemsize:
        raise ValueError(f"{len(data)} bytes of data for shape {shape} of {dtype.str}")
    return np.frombuffer(data, dtype=dtype, count=count).reshape(shape).copy()


def _decode_npscalar(arg: Any) -> Any:
    """A NumPy scalar, whose ``dtype.str`` and ``tobytes()`` are its argument (an empty
    ``np.str_``/``np.bytes_`` has an item size of 0 and a few NUL bytes of data)."""
    dtype, data = _numpy(arg, ("dtype", "data"))
    value = dtype.type() if dtype.itemsize == 0 else \
        np.frombuffer(data, dtype=dtype)[0] if len(data) == dtype.itemsize else None
    if value is None or value.dtype.str != dtype.str or value.tobytes() != data:
        raise ValueError(f"{len(data)} bytes of data are not one {dtype.str}")
    return value


def decode_leaf(node: JSON, key: str, allow_pickle: bool) -> Any:
    """Inverse of ``codec.encode_leaf`` for one tagged or plain JSON value; a tagged
    value is accepted only in the one form docs/format.md §7 gives it."""
    if not isinstance(node, dict):
        return node
    ((tag, arg),) = node.items()
    try:
        if tag == "$int":
            return _decode_int(arg)
        if tag == "$float":
            if type(arg) is not str or arg not in _NON_FINITE:
                raise ValueError(f"{arg!r} is not 'inf', '-inf' or 'nan'")
            return float(arg)
        if tag == "$complex":
            if type(arg) is not list or len(arg) != 2:
                raise ValueError("the argument is not [real, imag]")
            return complex(_decode_float(arg[0]), _decode_float(arg[1]))
        if tag == "$bytes":
            return unb64(arg)
        if tag == "$bytearray":
            return bytearray(unb64(arg))
        if tag == "$dtype":
            return _decode_dtype(arg)
        if tag == "$device":
            return _decode_device(arg)
        if tag == "$ndarray":
            return _decode_ndarray(arg)
        if tag == "$npscalar":
            return _decode_npscalar(arg)
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
        if not isinstance(node, (dict, list)):  # a plain JSON leaf
            problem = _number_problem(node)
            if problem:
                raise bad(child_key(parent or "", name), problem)
            continue
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
            _distinct(cast(list, arg), tag, key, not plain, bad)
            continue
        if tag in ("$dict", "$odict"):
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in arg):
                raise bad(key, f"is a malformed {tag} (an item is not a [key, value] pair)")
            _distinct([k for k, _ in arg], tag, key, not plain, bad)
            stack.extend((v, key, k, depth + 1, local) for k, v in arg)
        elif tag == "object":
            stack.extend((v, key, k, depth + 1, local) for k, v in cast(dict, arg).items())
        else:
            if tag == "$size" and not all(type(v) is int and 0 <= v < _INT64 for v in arg):
                raise bad(key, "is a malformed $size (not a list of dimensions)")
            stack.extend((v, key, i, depth + 1, local) for i, v in enumerate(arg))


def _check_leaf(node: JSON, key: str, pickled: bool, bad: Callable[[str, str], CheckpointError]) -> None:
    problem = _number_problem(node)
    if problem:
        raise bad(key, problem)
    if isinstance(node, dict):
        ((tag, arg),) = node.items()
        if tag == "$pickle":
            if not pickled or not _is_base64(arg):
                raise bad(key, "is a malformed $pickle")
            return
        if _plainly_valid(tag, arg):
            return
        try:
            decode_leaf(node, key, False)
        except CorruptCheckpointError as exc:
            raise bad(key, f"cannot be decoded ({exc})") from exc


def _is_base64(arg: Any) -> bool:
    try:
        unb64(arg)
    except (ValueError, TypeError, AttributeError):
        return False
    return True


_DEVICE = re.compile(r"(cpu|cuda|meta|mps|xpu)(:(0|[1-9][0-9]?))?")


def _plainly_valid(tag: str, arg: Any) -> bool:
    """A dtype or device value of the usual kinds, known valid without importing torch
    (any other is decoded to be checked, which asks torch)."""
    if tag == "$dtype":
        return type(arg) is str and (arg in ITEMSIZES or arg in QUANTIZED)
    return tag == "$device" and type(arg) is str and _DEVICE.fullmatch(arg) is not None


def _distinct(nodes: list, tag: str, key: str, pickled: bool, bad: Callable[[str, str], CheckpointError]) -> None:
    """The keys of a ``$dict``/``$odict`` or the members of a ``$set``/``$frozenset``: each
    valid (``_check_key``), and no two the same Python value (``1``, ``1.0`` and ``true``
    are one key: a dict holding them keeps one, silently)."""
    seen: set = set()
    for node in nodes:
        value = _check_key(node, key, pickled, bad)
        if value in seen:
            raise bad(key, f"is a {tag} holding the key or member {repr(node)[:80]} twice")
        seen.add(value)


@dataclass(frozen=True)
class _Opaque:
    """A dtype or device key, compared by its encoding (one per value; decoding it needs
    torch); equal to no decoded value."""

    tag: str
    arg: str


def _check_key(node: JSON, key: str, pickled: bool, bad: Callable[[str, str], CheckpointError],
               depth: int = 0) -> Any:
    """A dict key or set member: a hashable leaf, or a ``$tuple`` of them; returns the
    value it decodes to, as far as it can be known without torch or unpickling
    (``_Opaque``; a new ``object()`` for a ``$pickle``, whose equality only the objects
    it unpickles to know: two equal pickles of objects compared by identity are two keys)."""
    tag = tag_of(node)
    if tag == "$tuple" and isinstance(node[tag], list) and depth < MAX_DEPTH:
        return tuple(_check_key(member, key, pickled, bad, depth + 1) for member in node[tag])
    if tag is not None or (isinstance(node, dict) and next(iter(node)) in _UNHASHABLE):
        raise bad(key, f"has a key or member that is not hashable: {str(node)[:80]}")
    _check_leaf(node, key, pickled, bad)
    if not isinstance(node, dict):
        return node
    ((name, arg),) = node.items()
    if name == "$pickle":
        return object()
    return _Opaque(name, arg) if name in ("$dtype", "$device") else decode_leaf(node, key, False)


def _number_problem(node: JSON) -> str | None:
    """Why a plain JSON leaf is not a value as §7 writes it, or None: a float must be
    finite (``1e999`` and ``NaN`` parse as non-finite ones) and an int below 2**53."""
    kind = type(node)
    if (kind is float and not math.isfinite(node)) or (kind is int and not -SAFE_INT < node < SAFE_INT):
        return f"is the JSON number {node!r}; a non-finite float is a $float, an int of 2**53 or more an $int"
    return None


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
