"""Tensor <-> bytes without copies, and the dtype names used on storage."""

from __future__ import annotations

import ctypes

import torch

from ..errors import UnsafeObjectError
from .dtypes import QUANTIZED, torch_dtypes, unknown_dtype

# safetensors' names for the dtypes it knows; other dtypes are stored as raw "U8".
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
                     ("float8_e8m0fnu", "F8_E8M0")):
    if hasattr(torch, _name):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


QUANTIZED_DTYPES = {getattr(torch, name) for name in QUANTIZED}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES = {_dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}  #: ``dtype_name`` of the dtypes torch has now


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the manifest's dtype name (looked up: it is
    asked once per tensor)."""
    name = DTYPE_NAMES.get(dtype)
    return name if name is not None else _dtype_name(dtype)
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128}


_LOADABLE = torch_dtypes()


def dtype_from_name(name: str, where: str) -> torch.dtype:
    """Inverse of ``dtype_name``; unknown names (and quantized dtypes, which are never
    stored) mean a corrupt or newer checkpoint."""
    dtype = _LOADABLE.get(name) if type(name) is str else None
    if dtype is None:
        raise unknown_dtype(name, where)
    return dtype


def nbytes_of(shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize




def holds_values(t: torch.Tensor) -> bool:
    """A CPU tensor whose memory is its values in order, so its bytes may be copied in or
    out directly: contiguous, and no lazy conjugate or negative bit (the memory of
    ``z.conj()`` holds ``z``, and reads are conjugated on the way out)."""
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def is_storable(t: torch.Tensor) -> bool:
    """Dense tensors with data; quantized (even a plain view as a quantized dtype: a
    quantized tensor always has one of those dtypes), sparse, nested and meta tensors are
    not."""
    return not (t.dtype in QUANTIZED_DTYPES or t.layout != torch.strided or t.is_nested or t.is_meta)


def to_storable(t: torch.Tensor, key: str) -> torch.Tensor:
    """A dense, contiguous CPU tensor with the same values, or a clear error (the common
    case is decided with the cheapest attribute checks: it runs once per tensor)."""
    if t.layout == torch.strided and not t.is_nested and t.dtype not in QUANTIZED_DTYPES and holds_values(t):
        return t.detach() if t.requires_grad else t
    if not is_storable(t):
        raise UnsafeObjectError(
            f"cannot store tensor {key!r} ({t.layout}, {t.dtype}, on {t.device}): only dense "
            "tensors with data are supported (not quantized, sparse, nested or meta); convert it first")
    t = t.detach().resolve_conj().resolve_neg()  # a lazy conj/neg view's bytes are not its values
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (writable)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    if t.requires_grad:
        t = t.detach()
    try:
        if t.dtype in _NUMPY_DTYPES:
            return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        # dtypes numpy cannot view (e.g. some float8 / bits types): go through the address
        return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")
