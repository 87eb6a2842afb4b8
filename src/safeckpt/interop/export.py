"""Out of and into safeckpt: consolidate a checkpoint into standard files, and bring
checkpoints of other tools in.

``export_checkpoint`` turns a (possibly sharded) checkpoint into a single
``.safetensors`` file, the Hugging Face sharded layout (``model-00001-of-0000N.safetensors``
plus ``model.safetensors.index.json``), or ``torch.save`` files of a flat
``name -> tensor`` dict. Full tensors are assembled from their chunks by the library's
reader, a batch at a time, written and dropped: safetensors output never holds more
than one batch (or one tensor, if larger) in memory, ``torch`` output one output file.

``import_checkpoint`` saves a ``torch.save`` file, a ``.safetensors`` file, a Hugging
Face folder or a ``torch.distributed.checkpoint`` folder as a safeckpt checkpoint.
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

import io
import json
import logging
import mmap
import os
import pickle
import re
import struct
import secrets
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, cast

import torch

from ..errors import CleanupWarning, warn
from ..format import codec as _codec
from . import hflayout, torchzip
from ..protocol.checkpoint import CheckpointInfo, read_committed
from ..protocol.checkpoint import save as safeckpt_save
from ..errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,
                     CorruptCheckpointError, UnsafeObjectError)
from ..format.manifest import Manifest
from ..format.plan import PlanError, check_coverage
from ..protocol.reader import TensorReader
from ..protocol.state import Read
from ..storage import Storage, is_remote
from ..storage import open as open_storage
from ..format.tensors import SAFETENSORS_DTYPES, byte_view, dtype_from_name, is_shape, nbytes_of

log = logging.getLogger("safeckpt")

__all__ = ["ExportError", "ExportResult", "ExportedFile", "export_checkpoint", "import_checkpoint",
           "detect_format", "read_foreign", "plain_values", "read_safetensors", "parse_size", "plan_shards",
           "read_tensors"]

READ_BATCH = 64 << 20  # tensors read together (adjacent chunks coalesce into one request)
_SAFETENSORS_TO_TORCH = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def _options_for(path: "str | os.PathLike[str] | Storage", options: dict | None) -> dict:
    """Storage options apply to URLs; a local path (or a Storage object) takes none, so
    one set of options serves e.g. an export from s3:// to a local folder."""
    if isinstance(path, Storage):
        return {}
    text = os.fspath(path)
    return dict(options or {}) if is_remote(text) else {}


class ExportError(CheckpointError, ValueError):
    """An export or import that cannot be done as asked (bad options, unsupported input)."""


# --------------------------------------------------------------------------- sizes


_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgtp]?i?b?)\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units, as Hugging Face uses), ``"500MiB"`` ->
    binary units, a plain number is bytes."""
    if isinstance(text, int):
        size = text
    else:
        m = _SIZE_RE.fullmatch(text)
        unit = m.group(2).lower().removesuffix("b") if m else None
        if m is None or unit not in _UNITS:
            raise ExportError(f"cannot read the size {text!r}: use a number of bytes or e.g. 500MB, 5GB, 2GiB")
        size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ExportError(f"the size must be positive, not {text!r}")
    return size


def plan_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split tensors (in order) into files of at most ``max_shard_size`` bytes, the way
    Hugging Face's ``save_pretrained`` does: a tensor larger than the limit gets a file
    of its own."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes:
        if current and used + size > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current or not shards:
        shards.append(current)
    return shards


# --------------------------------------------------------------------------- reading


class _Reader(TensorReader):
    """The library's reader, checking each data file's header once per export rather
    than once per batch of tensors."""

    def __init__(self, storage: Storage, manifest: Manifest, verify: bool) -> None:
        super().__init__(storage, manifest, verify)
        self._headers_checked: set[str] = set()

    def check_headers(self, files: set[str]) -> None:
        todo = set(files) - self._headers_checked
        super().check_headers(todo)
        self._headers_checked |= todo


def read_tensors(storage: Storage, manifest: Manifest, names: Iterable[str], *, verify: bool = True,
                 batch_bytes: int = READ_BATCH) -> Iterator[tuple[str, torch.Tensor]]:
    """Full CPU tensors of a checkpoint, in the order of ``names``, read ``batch_bytes``
    at a time (a larger tensor alone): only the current batch is held in memory."""
    reader = _Reader(storage, manifest, verify)
    batch: list[Read] = []
    used = 0

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        reader.run(batch)
        for read in batch:
            yield read.name, cast(torch.Tensor, read.result)  # run() filled it
            read.result = None

    for name in names:
        entry = manifest.tensors[name]
        size = nbytes_of(entry.shape, dtype_from_name(entry.dtype, name))
        if batch and used + size > batch_bytes:
            yield from flush()
            batch, used = [], 0
        batch.append(Read(name, entry, None))
        used += size
    if batch:
        yield from flush()


# --------------------------------------------------------------------------- export


@dataclass
class ExportedFile:
    """One file an export wrote."""

    name: str
    bytes: int
    tensors: int


@dataclass
class ExportResult:
    """What ``export_checkpoint`` wrote: files (in ``folder``), and the index if sharded."""

    folder: str
    files: list[ExportedFile]
    index: str | None
    tensors: int
    bytes: int
    skipped_values: int = 0
    tied: dict[str, str] = field(default_factory=dict)  # exported name left out -> the tied name kept
    config: str | None = None  # config.json, when the checkpoint carries the model's config

    @property
    def paths(self) -> list[str]:
        return ([f"{self.folder}/{f.name}" for f in self.files] + ([f"{self.folder}/{self.config}"] if self.config
                else []) + ([f"{self.folder}/{self.index}"] if self.index else []))


@dataclass
class _Target:
    folder: str
    single_name: str | None       # file name when OUT names one file
    shard_stem: str               # "model" or "pytorch_model"
    shard_suffix: str             # ".safetensors" or ".bin"


def _target(out: str, fmt: str, sharded: bool) -> _Target:
    """Where the output goes: ``OUT`` ending in a file suffix names one file, else a folder."""
    stem, suffix = ("model", ".safetensors") if fmt == "safetensors" else ("pytorch_model", ".bin")
    stripped = out.rstrip("/") or "/"
    head, sep, base = stripped.rpartition("/")
    kind = "safetensors" if base.endswith(".safetensors") else "torch" if base.endswith(_TORCH_SUFFIXES) else None
    if kind is None:
        return _Target(stripped, None, stem, suffix)
    if kind != fmt:
        raise ExportError(f"{out}: a {kind} file name for --format {fmt} output; name the file "
                          f"*{suffix} or give a folder")
    if sharded:
        raise ExportError(f"{out}: with --max-shard-size the output is a folder ({stem}-00001-of-0000N"
                          f"{suffix} + {stem}{suffix}.index.json); give a folder, not a file name")
    return _Target((head or "/") if sep else ".", base, stem, suffix)


def _safetensors_parts(names: list[str], out_names: dict[str, str], manifest: Manifest,
                       tensors: Iterator[tuple[str, torch.Tensor]]) -> tuple[int, Iterator[bytes | memoryview]]:
    """(file size, stream of bytes) of a safetensors file holding ``names``; the header
    is computed from the manifest, the data is streamed from ``tensors``."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        entry = manifest.tensors[name]
        dtype = dtype_from_name(entry.dtype, name)
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise ExportError(f"tensor {name!r} is {entry.dtype}, which safetensors cannot store; "
                              "export it with --format torch, or leave it out with --select")
        n = nbytes_of(entry.shape, dtype)
        header[out_names[name]] = {"dtype": code, "shape": list(entry.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text

    def stream() -> Iterator[bytes | memoryview]:
        yield prefix
        for _, t in tensors:
            if t.numel():
                yield byte_view(t)

    return len(prefix) + offset, stream()


def _torch_bytes(tensors: Iterator[tuple[str, torch.Tensor]], out_names: dict[str, str]) -> bytes | memoryview:
    flat = {out_names[name]: t for name, t in tensors}
    buf = io.BytesIO()
    torch.save(flat, buf)
    return buf.getbuffer()


def _clear(storage: Storage, names: list[str], target: _Target, overwrite: bool, now: bool) -> list[str]:
    """Refuse to replace existing output unless ``overwrite``; return the old output to
    remove (with ``now``, remove it here), including shards of an earlier export into
    more files. Shards without an index are what an interrupted export left: replaced
    without ``overwrite``."""
    shard_re = re.compile(re.escape(target.shard_stem) + r"-[0-9]{5}-of-[0-9]{5}" + re.escape(target.shard_suffix))
    index = f"{target.shard_stem}{target.shard_suffix}.index.json"
    existing = {n: size for n, size in storage.listdir().items() if size is not None}
    leftovers = {n for n in existing if shard_re.fullmatch(n)} if index in names and index not in existing else set()
    clash = sorted(n for n in names if n in existing and n not in leftovers)
    if clash and not overwrite:
        raise CheckpointExistsError(f"{storage.url}/{clash[0]} exists; pass --overwrite (overwrite=True) "
                                    "to replace the output")
    stale = set(clash) | leftovers
    if overwrite and target.single_name is None:  # a folder: earlier shards and index too
        stale |= {n for n in existing if shard_re.fullmatch(n) or n == index}
    if now:
        storage.delete(sorted(stale))
    return sorted(stale)


class _Output:
    """The files of one export, complete or absent. Where a reader could see a file
    before it is complete, each is written under a temporary name in the destination
    folder and renamed into place once every file is written, the index last (object
    stores, where one PUT is atomic, write the final names). On any failure, every file
    it wrote is removed, so a rerun finds nothing in its way."""

    def __init__(self, storage: Storage, staged: bool, stale: list[str]) -> None:
        self.storage = storage
        self.staged = staged
        self.stale = stale  # old output to remove once the new files are in place
        self.token = secrets.token_hex(4)
        self.pending: list[tuple[str, str]] = []  # (name written, final name)
        self.placed: list[str] = []  # final names put in place (an old output there is gone)

    def write(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
        written = f".{name}.{self.token}.partial" if self.staged else name
        self.pending.append((written, name))
        return _write(self.storage, written, parts)

    def publish(self, index: str | None) -> None:
        """Put the files in place: old index first out, new index last in."""
        if not self.staged:
            return
        if index in self.stale:
            self.storage.delete([index])
        files = [pair for pair in self.pending if pair[1] != index]
        for written, name in files:
            self._place(written, name)
        self.storage.delete([n for n in self.stale if n not in {f for _, f in self.pending}])
        for written, name in self.pending:
            if name == index:
                self._place(written, name)
        self.pending = []

    def _place(self, written: str, name: str) -> None:
        self.storage.rename(written, name)
        self.placed.append(name)

    def __enter__(self) -> "_Output":
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is not None and (self.pending or self.placed):
            try:  # until publish, an old output under the final names stays as it was
                self.storage.delete(sorted({written for written, _ in self.pending} | set(self.placed)))
            except CheckpointError as cleanup:  # the export's own error matters more
                warn(f"export to {self.storage.url} failed and removing its files failed too: {cleanup}",
                     CleanupWarning)


def _write(storage: Storage, name: str, parts: Iterable[bytes | memoryview]) -> int:
    try:
        return storage.write_file(name, parts)
    except FileExistsError:
        raise CheckpointExistsError(f"{storage.url}/{name} appeared while exporting (another export "
                                    "into the same place?)") from None


def export_checkpoint(ckpt: "str | os.PathLike[str] | Storage", out: "str | os.PathLike[str]", *,
                      format: str = "safetensors", max_shard_size: "int | str | None" = None,
                      select: str | None = None, strip_prefix: bool = False,
                      storage_options: dict | None = None, out_storage_options: dict | None = None,
                      overwrite: bool = False, verify: bool = True,
                      on_tensor: Callable[[str, int], None] | None = None) -> ExportResult:
    """Consolidate the checkpoint at ``ckpt`` into standard files at ``out``.

    ``format``: ``"safetensors"`` (one file, or with ``max_shard_size`` the Hugging Face
    sharded layout) or ``"torch"`` (``torch.save`` of a flat dict; sharded as
    ``pytorch_model-0000i-of-0000N.bin`` + ``pytorch_model.bin.index.json``). ``out``
    is a file name (``.safetensors`` / ``.pt`` ...) or a folder, on any storage URL.
    ``select`` keeps tensors whose name starts with it (``"model."``), ``strip_prefix``
    removes it from the exported names. Non-tensor values are not exported (these
    formats hold only tensors); their count is in the result. ``storage_options`` go to
    whichever of ``ckpt`` and ``out`` is a URL (``out_storage_options``, if given, to
    ``out``). ``on_tensor(name, bytes)`` is called after each tensor is written."""
    if format not in ("safetensors", "torch"):
        raise ExportError(f"unknown export format {format!r} (use 'safetensors' or 'torch')")
    if strip_prefix and not select:
        raise ExportError("--strip-prefix needs --select PREFIX (the prefix to strip)")
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    source = open_storage(ckpt, **_options_for(ckpt, storage_options))
    manifest = read_committed(source)
    selected = [n for n in manifest.tensors if not select or n.startswith(select)]
    ties = hflayout.tied(manifest, selected)  # written once, as save_pretrained does
    names = [n for n in selected if n not in ties]
    if not names:
        what = f"starts with {select!r}" if select else "exists"
        sample = ", ".join(list(manifest.tensors)[:5]) or "none"
        raise ExportError(f"no tensor in {source.url} {what} (tensors: {sample}"
                          f"{', ...' if len(manifest.tensors) > 5 else ''})")
    out_names = {n: n[len(select):] if strip_prefix and select else n for n in selected}
    for n, o in out_names.items():
        if not o:
            raise ExportError(f"--strip-prefix would leave tensor {n!r} without a name")
        if format == "safetensors" and o == "__metadata__":
            raise ExportError(f"tensor {n!r}: the name __metadata__ is reserved by safetensors")
    sizes = [(n, nbytes_of(manifest.tensors[n].shape, dtype_from_name(manifest.tensors[n].dtype, n)))
             for n in names]
    target = _target(os.fspath(out), format, limit is not None)
    storage = open_storage(target.folder, **_options_for(
        target.folder, out_storage_options if out_storage_options is not None else storage_options))
    groups = plan_shards(sizes, limit) if limit is not None else [names]
    if len(groups) == 1:
        file_names = [target.single_name or f"{target.shard_stem}{target.shard_suffix}"]
    else:
        file_names = [f"{target.shard_stem}-{i:05d}-of-{len(groups):05d}{target.shard_suffix}"
                      for i in range(1, len(groups) + 1)]
    index = f"{target.shard_stem}{target.shard_suffix}.index.json" if len(groups) > 1 else None
    config = hflayout.config_json(manifest) if target.single_name is None else None  # a folder: HF's layout
    config_name = hflayout.CONFIG_FILE if config is not None else None
    staged = storage.can_rename and not storage.atomic_write
    stale = _clear(storage, file_names + [n for n in (config_name, index) if n], target, overwrite,
                   now=not staged)
    size_of = dict(sizes)

    def tensors_of(group: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in read_tensors(source, manifest, group, verify=verify):
            yield name, t
            if on_tensor is not None:
                on_tensor(name, size_of[name])

    written: list[ExportedFile] = []
    total = sum(size_of.values())
    with _Output(storage, staged, stale) as output:
        for group, file_name in zip(groups, file_names):
            if format == "safetensors":
                _, parts = _safetensors_parts(group, out_names, manifest, tensors_of(group))
                size = output.write(file_name, parts)
            else:
                size = output.write(file_name, [_torch_bytes(tensors_of(group), out_names)])
            written.append(ExportedFile(file_name, size, len(group)))
        if config is not None:
            output.write(hflayout.CONFIG_FILE, [config])
        if index is not None:  # written last: a complete index means complete shards
            weight_map = {out_names[n]: f.name for group, f in zip(groups, written) for n in group}
            body = {"metadata": {"total_size": total}, "weight_map": weight_map}
            output.write(index, [json.dumps(body, indent=2).encode() + b"\n"])
        output.publish(index)
    for f in written:  # once in place: a failed export never claims a file
        log.info("exported %s/%s: %d tensor(s), %d bytes", storage.url, f.name, f.tensors, f.bytes)
    skipped = sum(1 for k in plain_values(manifest.tree) if not select or k.startswith(select))
    return ExportResult(storage.url, written, index, len(names), total, skipped,
                        {out_names[a]: out_names[k] for a, k in ties.items()}, config_name)


def plain_values(tree: Any) -> dict[str, Any]:
    """Every non-tensor value of a saved tree by its dotted name, still encoded (so two
    checkpoints compare by their JSON). A list or tuple of plain values is one value, and
    so is an empty container; rank-local values are named ``key@rank`` like rank-local
    tensors."""
    out: dict[str, Any] = {}

    def walk(node: Any, key: str) -> None:
        tag = _codec.tag_of(node)
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
            items = _codec.items_of(node, key, False)
        except UnsafeObjectError:
            out[key or "<root>"] = node  # a mapping with pickled keys
            return
        if not items and key:
            out[key] = node
        for k, child in items:
            walk(child, _codec.child_key(key, k))

    walk(tree, "")
    return out


def _has_tensor(node: Any) -> bool:
    """True when an encoded sequence holds a tensor or a mapping (shown item by item)."""
    tag = _codec.tag_of(node)
    if tag in ("$tensor", "$local", "object", "$dict", "$odict"):
        return True
    if tag in ("list", "$tuple", "$size"):
        return any(_has_tensor(n) for n in (node if tag == "list" else node[tag]))
    return False


# --------------------------------------------------------------------------- import: reading


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, memory-mapped (copy-on-write), so a
    large file is not read into memory up front. Parsed here: no extra dependency."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise CheckpointNotFoundError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with f:
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
    ``torch.save`` since torch 1.6) by ``torchzip``, its CRC-32s checked and tensors
    memory-mapped; the legacy format, which carries no checksum, by ``torch.load``."""
    try:
        if zipfile.is_zipfile(path):
            mm = _map(path)
            try:
                return torchzip.load_archive(mm, 0, len(mm), path)
            except pickle.UnpicklingError as exc:
                raise _weights_only_error(path, exc) from exc
        with torchzip.numpy_allowed():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _weights_only_error(path, exc) from exc
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"no file at {path}") from exc
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
        with open(meta_path, "rb") as f:
            metadata = _DcpMetadataUnpickler(f).load()
        entries = dict(metadata.state_dict_metadata)
        planner_data = dict(metadata.planner_data or {})
        storage = dict(metadata.storage_data)
    except pickle.UnpicklingError as exc:
        raise UnsafeObjectError(f"{meta_path}: refused: {exc}; safeckpt only reads DCP metadata "
                                "records from it") from exc
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{path} is not a torch.distributed.checkpoint folder (no .metadata)") from exc
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
    try:
        with open(path, "rb") as f:
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
    with open(path, "rb") as f:
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
            with open(os.path.join(path, pick)) as f:
                index = json.load(f)
            weight_map = index["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, AssertionError) as exc:
            raise CorruptCheckpointError(f"{path}/{pick}: not a valid index (needs a weight_map)") from exc
        files, expected = sorted(set(weight_map.values())), weight_map
    out: dict[str, torch.Tensor] = {}
    meta: dict = {}
    for name in files:
        if "/" in name or "\\" in name or name.startswith("."):
            raise CorruptCheckpointError(f"{path}/{pick}: file name {name!r} leaves the folder")
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise CorruptCheckpointError(f"{path}: {name} is missing (listed in {pick})")
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
        raise ExportError(f"importing from {url} needs fsspec: pip install 'safeckpt[s3]'") from exc
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
    opts = _options_for(src_text, src_storage_options if src_storage_options is not None else storage_options)
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
                             storage_options=_options_for(dest, storage_options))
    return info, fmt
