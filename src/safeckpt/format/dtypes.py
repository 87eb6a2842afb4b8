"""The dtype names a manifest may use, and their sizes, known without importing torch.

Decoding and checking a manifest needs each tensor's item size, not torch: ``safeckpt
ls`` and ``show`` read manifests only, and importing torch costs seconds. The sizes of
torch's dtypes are written out here; a name torch added since (not in the table) is
looked up in torch itself, so every dtype of the installed torch stays valid.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpointError

if TYPE_CHECKING:
    import torch

MAX_DIMS = 64  # NumPy's limit, through which tensor bytes are viewed

QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})  # never stored

#: item size of every storable dtype of torch 2.13 by its manifest name (``str(dtype)``
#: without ``torch.``); tests/test_structure.py checks it against the installed torch
ITEMSIZES = {
    "bfloat16": 2, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bool": 1,
    "complex128": 16, "complex32": 4, "complex64": 8, "float16": 2, "float32": 4, "float4_e2m1fn_x2": 1,
    "float64": 8, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "int1": 1, "int16": 2, "int2": 1, "int3": 1, "int32": 4, "int4": 1, "int5": 1,
    "int6": 1, "int64": 8, "int7": 1, "int8": 1, "uint1": 1, "uint16": 2, "uint2": 1, "uint3": 1,
    "uint32": 4, "uint4": 1, "uint5": 1, "uint6": 1, "uint64": 8, "uint7": 1, "uint8": 1,
}


@functools.cache
def torch_dtypes() -> "dict[str, torch.dtype]":
    """Every dtype of the installed torch that a checkpoint may hold, by its manifest
    name (canonical names only: no aliases such as ``float`` or ``half``)."""
    import torch

    found = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    return {name: d for name, d in found.items() if name not in QUANTIZED}


def unknown_dtype(name: Any, where: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: unknown dtype {name!r} (a newer torch or safeckpt wrote it, or it is corrupt)")


def itemsize_of(name: Any, where: str) -> int:
    """The item size of the dtype a manifest names; torch is asked only for a name the
    table does not hold."""
    size = ITEMSIZES.get(name) if type(name) is str else None
    if size is not None:
        return size
    dtype = torch_dtypes().get(name) if type(name) is str else None
    if dtype is None:
        raise unknown_dtype(name, where)
    return dtype.itemsize


def is_shape(shape: Any, itemsize: int = 1) -> bool:
    """A list of at most ``MAX_DIMS`` dimensions (ints >= 0) that torch can allocate: the
    product of the dimensions (empty ones counted as 1) times ``itemsize`` fits in int64."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        return False
    n = itemsize
    for d in shape:
        if type(d) is not int or d < 0:
            return False
        n *= max(d, 1)
    return n < 2**63
