"""Into safeckpt: ``import_checkpoint`` saves a ``torch.save`` file, a ``.safetensors``
file, a Hugging Face folder or a ``torch.distributed.checkpoint`` folder as a safeckpt
checkpoint.

Nothing from the source can run code: ``torch.save`` files are read with
``weights_only=True``, safetensors files are parsed here and memory-mapped, and a DCP
folder's pickled ``.metadata`` goes through an unpickler that only builds DCP's own
metadata records (torch's ``dcp_to_torch_save`` would unpickle it and its non-tensor
values without restriction); its items are read by ``torchzip`` (CRC-32s checked,
tensors memory-mapped). NumPy arrays and scalars are admitted (safeckpt stores them).
Sources are memory-mapped, so an import streams tensor by tensor from the page cache
into the new checkpoint instead of holding the state in memory.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import mmap
import os
import pickle
import re
import struct
import tempfile
from typing import Any, Callable

import torch

from . import torchzip
from ..protocol.checkpoint import CheckpointInfo
from ..protocol.checkpoint import save as safeckpt_save
from ..errors import (CheckpointError, CheckpointNotFoundError,
                     CorruptCheckpointError, UnsafeObjectError)
from ..format.plan import PlanError, check_coverage
from ..storage import Storage, is_remote
from ..storage.local import OS_FILESYSTEM, not_regular
from ..storage.urls import install_hint, url_scheme
from ..format.dtypes import is_shape
from ..format.tensors import SAFETENSORS_DTYPES, nbytes_of

from .export import ExportError, options_for

log = logging.getLogger(__name__)
_SAFETENSORS_TO_TORCH = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}

__all__ = ["import_checkpoint", "detect_format", "read_foreign", "read_safetensors", "FORMATS"]


def _open(path: str) -> io.BufferedReader:
    """A file of the source, opened only if it is a regular file (links followed: a
    Hugging Face cache is made of them). Anything else is refused at once, by the rule
    local storage reads by (``open_reader``): a FIFO would block the import forever and
    a device (``/dev/zero``) never end."""
    try:
        return io.BufferedReader(OS_FILESYSTEM.open_reader(path, follow_symlinks=True))  # type: ignore[arg-type]  # a FileIO
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"no file at {path}") from exc
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise CheckpointNotFoundError(
                f"{path} is {not_regular(path) or 'not a regular file'}, not a checkpoint file: safeckpt "
                "imports regular files only") from exc
        raise CheckpointNotFoundError(f"cannot read {path}: {exc.strerror or exc}") from exc


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, memory-mapped (copy-on-write), so a
    large file is not read into memory up front. Parsed here: no extra dependency."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, 100 << 20):
            raise CorruptCheckpointError(f"{path}: not a safetensors file (header length {n} does not fit)")
        try:
            header = json.loads(f.read(n))
            assert isinstance(header, dict)
        except (ValueError, AssertionError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{path}: not a safetensors file (bad JSON header)") from exc
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 0 else None
    base = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(f"{path}: not a safetensors file (__metadata__ is not a string map)")
    out: dict[str, torch.Tensor] = {}
    for name, e in header.items():
        try:
            dtype = _SAFETENSORS_TO_TORCH[e["dtype"]]
            shape = e["shape"]
            begin, end = e["data_offsets"]
            if not is_shape(shape, dtype.itemsize) or type(begin) is not int or type(end) is not int:
                raise ValueError("bad shape or offsets")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{path}: tensor {name!r}: unsupported or malformed entry "
                                         f"({exc})") from exc
        nbytes = nbytes_of(shape, dtype)
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise CorruptCheckpointError(f"{path}: tensor {name!r}: byte range [{begin}, {end}) does not "
                                         f"fit its shape {shape} or the file")
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=base + begin)
        if (base + begin) % dtype.itemsize:
            raw = raw.clone()  # misaligned: copy
        out[name] = raw.view(dtype).reshape(shape)
    return out, metadata


def _weights_only_error(path: str, exc: BaseException) -> UnsafeObjectError:
    """One line out of torch's long weights_only refusal: the sentence that says what
    the file holds."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line.removeprefix("WeightsUnpickler error:").strip() for line in lines
              if not line.startswith(("Weights only load failed", "Check the documentation"))]
    why = (useful or lines or [type(exc).__name__])[0]
    why = why.split(" Please use ")[0].rstrip(". ")
    return UnsafeObjectError(
        f"{path}: refused: torch.load(weights_only=True) does not allow what this file holds ({why}). "
        "safeckpt never unpickles arbitrary objects from a file; if you trust it, load it yourself "
        "and call safeckpt.save")


def read_torch(path: str) -> Any:
    """A ``torch.save`` file, read with ``weights_only=True``: a zip archive (every
    ``torch.save`` since torch 1.6) by ``torchzip``, every field of its structure and
    its CRC-32s checked and tensors memory-mapped; the legacy format, which carries no
    checksum, by ``torch.load``. A file that is neither (it does not start as a pickle
    does) is refused as not a checkpoint before torch's unpickler can call its bytes a
    dangerous pickle."""
    with _open(path) as f:
        kind = torchzip.torch_format(f.read(32))
    if kind is None:
        raise CorruptCheckpointError(
            f"{path}: not a checkpoint (neither a torch.save file, which is a zip archive or a "
            "pickle that starts with torch's magic number, nor a safetensors file); give the path of the "
            "checkpoint file itself")
    try:
        if kind == "zip":
            mm = _map(path)
            return torchzip.load_archive(mm, 0, len(mm), path)
        with _open(path) as f, torchzip.numpy_allowed():
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _weights_only_error(path, exc) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CorruptCheckpointError(f"{path}: cannot read it as a torch.save file ({first})") from exc


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata records; anything else in ``.metadata`` is refused."""

    def find_class(self, module: str, name: str) -> Any:
        import dataclasses
        import enum
        import pathlib

        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                      "torch.distributed.checkpoint.planner"):
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif (module, name) == ("torch.serialization", "_get_layout"):
            from torch.serialization import _get_layout
            return _get_layout
        elif module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
            return getattr(pathlib, name)
        elif (module, name) == ("collections", "OrderedDict"):
            import collections
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")


def read_dcp(path: str) -> dict:
    """The full state of a ``torch.distributed.checkpoint`` folder, in one process and
    without a process group, never running code from it (see module docstring).

    Read here rather than by DCP's loader: every item's CRC-32s are checked, tensors are
    views of the memory-mapped ``.distcp`` files (a tensor saved in several chunks is
    assembled in memory), and a failure is one ``CheckpointError`` naming the file."""
    try:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
        from torch.distributed.checkpoint._traverse import set_element
    except ImportError as exc:
        raise ExportError(f"cannot read the DCP checkpoint {path}: this torch has no "
                          f"torch.distributed.checkpoint ({exc})") from exc

    meta_path = os.path.join(path, ".metadata")
    try:
        with _open(meta_path) as f:
            metadata = _DcpMetadataUnpickler(f).load()
        entries = dict(metadata.state_dict_metadata)
        planner_data = dict(metadata.planner_data or {})
        storage = dict(metadata.storage_data)
    except pickle.UnpicklingError as exc:
        raise UnsafeObjectError(f"{meta_path}: refused: {exc}; safeckpt only reads DCP metadata "
                                "records from it") from exc
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(f"{path} is not a torch.distributed.checkpoint folder ({exc})") from exc
    except Exception as exc:  # noqa: BLE001 - truncated or garbled
        raise CorruptCheckpointError(
            f"{meta_path}: cannot read the DCP metadata ({type(exc).__name__}: {exc})") from exc

    files: dict[str, mmap.mmap] = {}

    def item(fqn: str, index: Any) -> Any:
        info: Any = storage.get(index)
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
            raise CorruptCheckpointError(f"{meta_path}: {fqn!r} is stored in {name!r}, not a file of the folder")
        if getattr(info, "transform_descriptors", None):
            raise ExportError(f"{path}/{name}: {fqn!r} was saved with transforms "
                              f"{info.transform_descriptors}, which safeckpt does not read")
        if name not in files:
            files[name] = _map(os.path.join(path, name))
        where = f"{path}/{name} ({fqn}, bytes {info.offset}+{info.length})"
        try:
            return torchzip.load_archive(files[name], info.offset, info.length, where)
        except pickle.UnpicklingError as exc:
            raise _weights_only_error(where, exc) from exc

    state: dict = {}
    for fqn, entry in entries.items():
        if isinstance(entry, BytesStorageMetadata):
            value = item(fqn, MetadataIndex(fqn))
        elif isinstance(entry, TensorStorageMetadata):
            value = _assemble(fqn, entry, lambda chunk: item(fqn, MetadataIndex(fqn, chunk.offsets)), meta_path)
        else:
            raise CorruptCheckpointError(f"{meta_path}: {fqn!r} has an unknown kind of entry")
        set_element(state, planner_data[fqn], value) if fqn in planner_data else state.__setitem__(fqn, value)
    return state


def _map(path: str) -> mmap.mmap:
    """A data file, memory-mapped copy-on-write (tensors are views of it)."""
    with _open(path) as f:
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise CorruptCheckpointError(f"cannot read {path}: {exc}") from exc


def _assemble(fqn: str, entry: Any, read: Callable[[Any], Any], where: str) -> torch.Tensor:
    """A DCP tensor from its chunks: the chunk itself when one covers it (no copy)."""
    shape, dtype = list(entry.size), entry.properties.dtype
    chunks = list(entry.chunks)
    parts = []
    for chunk in chunks:
        t = read(chunk)
        if not isinstance(t, torch.Tensor) or list(t.shape) != list(chunk.sizes) or t.dtype != dtype:
            raise CorruptCheckpointError(f"{where}: {fqn!r}: a saved chunk is not the tensor the metadata describes")
        parts.append((list(chunk.offsets), t))
    if len(parts) == 1 and parts[0][0] == [0] * len(shape) and list(parts[0][1].shape) == shape:
        return parts[0][1]
    try:
        check_coverage(fqn, tuple(shape), [(tuple(o), tuple(t.shape)) for o, t in parts])
    except PlanError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from exc
    out = torch.empty(shape, dtype=dtype)
    for offsets, t in parts:
        out[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
    return out


FORMATS = ("torch", "safetensors", "hf", "dcp")


def detect_format(path: str) -> str:
    """What a local file or folder holds: ``torch``, ``safetensors``, ``hf`` (a Hugging
    Face folder, sharded or not), ``dcp`` or ``safeckpt``."""
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if ".metadata" in names:
            return "dcp"
        if any(re.fullmatch(r"manifest-[0-9]{6,}\.json", n) for n in names):
            return "safeckpt"
        if any(n.endswith(".index.json") for n in names) or names & {"model.safetensors", "pytorch_model.bin"}:
            return "hf"
        raise CheckpointNotFoundError(
            f"{path} is a folder without a known checkpoint: expected a Hugging Face folder "
            "(model.safetensors[.index.json] / pytorch_model.bin[.index.json]) or a "
            "torch.distributed.checkpoint folder (.metadata)")
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no file or folder at {path}")
    with _open(path) as f:
        head = f.read(9)
    if path.endswith(".safetensors") or (len(head) == 9 and head[8:9] == b"{"):
        return "safetensors"
    return "torch"


def _read_hf(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    names = set(os.listdir(path))
    indexes = sorted(n for n in names if n.endswith(".index.json"))
    pick = next((n for n in indexes if n.endswith(".safetensors.index.json")), indexes[0] if indexes else None)
    if pick is None:
        single = "model.safetensors" if "model.safetensors" in names else "pytorch_model.bin"
        files, expected = [single], None
    else:
        try:
            with _open(os.path.join(path, pick)) as f:
                index = json.load(f)
            weight_map = index["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, AssertionError, TypeError) as exc:
            raise CorruptCheckpointError(f"{path}/{pick}: not a valid index (needs a weight_map)") from exc
        files, expected = sorted(set(weight_map.values())), weight_map
    out: dict[str, torch.Tensor] = {}
    meta: dict = {}
    for name in files:
        if "/" in name or "\\" in name or name.startswith("."):
            raise CorruptCheckpointError(f"{path}/{pick}: file name {name!r} leaves the folder")
        full = os.path.join(path, name)
        if not os.path.exists(full):  # a link to nothing: a Hugging Face cache whose file is gone
            what = "a link to nothing" if os.path.islink(full) else "missing"
            listed = f"listed in {pick}" if pick else "the folder's weights file; it has no *.index.json"
            raise CorruptCheckpointError(f"{path}: {name} is {what} ({listed})")
        if name.endswith(".safetensors"):
            tensors, meta = read_safetensors(full)
        else:
            tensors = read_torch(full)
            if not isinstance(tensors, dict):
                raise CorruptCheckpointError(f"{full}: holds a {type(tensors).__name__}, not a dict of tensors")
        out.update(tensors)
    if expected is not None:
        missing = sorted(set(expected) - set(out))
        if missing:
            raise CorruptCheckpointError(f"{path}: {len(missing)} tensor(s) of {pick} are in none of its files "
                                         f"(first: {missing[0]})")
    return out, meta


def read_foreign(path: str, format: str | None = None) -> tuple[dict, str, dict]:
    """(state, format, metadata) of a local checkpoint of another tool; ``format`` is
    detected when None."""
    fmt = format or detect_format(path)
    if fmt == "safeckpt":
        raise ExportError(f"{path} is already a safeckpt checkpoint (copy it, or load and save it)")
    meta: dict = {}
    if fmt == "safetensors":
        state, meta = read_safetensors(path)
    elif fmt == "hf":
        state, meta = _read_hf(path) if os.path.isdir(path) else read_safetensors(path)
    elif fmt == "dcp":
        state = read_dcp(path)
    elif fmt == "torch":
        state = read_torch(path)
    else:
        raise ExportError(f"unknown import format {fmt!r} (use one of {', '.join(FORMATS)})")
    if not isinstance(state, dict):
        raise ExportError(f"{path} holds a {type(state).__name__}, not a dict; safeckpt saves a dict "
                          "(load it and save {'key': value} yourself)")
    return state, fmt, meta


def _fetch(url: str, tmp: str, storage_options: dict) -> str:
    """Copy a remote file or folder (any fsspec URL) to ``tmp``; return the local path."""
    try:
        import fsspec
    except ImportError as exc:
        raise ExportError(f"importing from {url} needs fsspec: {install_hint(url_scheme(url))}") from exc
    from ..storage.fsspec import object_store_error
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        path = path.rstrip("/")
        local = os.path.join(tmp, os.path.basename(path) or "src")
        if fs.isdir(path):
            fs.get(path + "/", local + "/", recursive=True)
            if not os.path.isdir(local) or not os.listdir(local):
                raise CheckpointNotFoundError(f"nothing at {url}")
        elif fs.isfile(path):
            fs.get(path, local)
        else:
            raise CheckpointNotFoundError(f"nothing at {url}")
        return local
    except CheckpointError:
        raise
    except (ValueError, ImportError) as exc:
        raise ExportError(f"cannot open {url}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - translated into one clear error
        raise object_store_error(exc, "read", url) from exc


def import_checkpoint(src: "str | os.PathLike[str]", dest: "str | os.PathLike[str] | Storage", *,
                      format: str | None = None, under: str | None = None, overwrite: bool = False,
                      metadata: dict | None = None, storage_options: dict | None = None,
                      src_storage_options: dict | None = None) -> tuple[CheckpointInfo, str]:
    """Save the checkpoint of another tool at ``src`` as a safeckpt checkpoint at
    ``dest``; returns (what ``safeckpt.save`` returned, the detected format).

    ``src``: a ``torch.save`` file, a ``.safetensors`` file, a Hugging Face folder
    (``*.index.json`` with its shards, or one ``model.safetensors``/``pytorch_model.bin``)
    or a ``torch.distributed.checkpoint`` folder; local or a URL (fetched to a temporary
    folder first). ``under`` nests the state under one key (``"model"`` makes
    ``model.<name>`` of every tensor, ready for ``safeckpt.load({"model": model}, ...)``).
    The source's format and path are recorded in the metadata."""
    src_text = os.fspath(src)
    opts = options_for(src_text, src_storage_options if src_storage_options is not None else storage_options)
    with tempfile.TemporaryDirectory(prefix="safeckpt-import-") as tmp:
        local = _fetch(src_text, tmp, opts) if is_remote(src_text) else src_text.removeprefix("file://")
        state, fmt, source_meta = read_foreign(local, format)
        if under:
            state = {under: state}
        meta: dict[str, Any] = {"imported_from": src_text, "source_format": fmt}
        if source_meta:
            meta["source_metadata"] = source_meta
        meta.update(metadata or {})
        info = safeckpt_save(state, dest, overwrite=overwrite, metadata=meta,
                             storage_options=options_for(dest, storage_options))
    return info, fmt
