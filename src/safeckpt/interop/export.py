"""Out of safeckpt: consolidate a checkpoint into standard files (``imports`` brings
checkpoints of other tools in).

``export_checkpoint`` turns a (possibly sharded) checkpoint into a single
``.safetensors`` file, the Hugging Face sharded layout (``model-00001-of-0000N.safetensors``
plus ``model.safetensors.index.json``), or ``torch.save`` files of a flat
``name -> tensor`` dict. Full tensors are assembled from their chunks by the library's
reader, a batch at a time, written and dropped: safetensors output never holds more
than one batch (or one tensor, if larger) in memory, ``torch`` output one output file.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import struct
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, cast

import torch

from ..errors import CleanupWarning, warn
from ..format.tree import leaf_values
from . import hflayout
from ..format.folder import read_committed
from ..errors import CheckpointError, CheckpointExistsError, StorageError
from ..format.manifest import Manifest
from ..protocol.reader import TensorReader
from ..protocol.state import Read
from ..storage import Storage, is_remote
from ..storage import open as open_storage
from ..format.tensors import SAFETENSORS_DTYPES, byte_view, dtype_from_name, nbytes_of

log = logging.getLogger(__name__)

__all__ = ["ExportError", "ExportResult", "ExportedFile", "export_checkpoint", "parse_size",
           "plan_shards", "read_tensors"]

READ_BATCH = 64 << 20  # tensors read together (adjacent chunks coalesce into one request)
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def options_for(path: "str | os.PathLike[str] | Storage", options: dict | None) -> dict:
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


_ABSENT = object()


def _no_file_in_the_way(storage: Storage) -> None:
    """Refuse, before anything is written, an output folder that is a file or lies below
    one (the first write would fail, and so would removing what it wrote)."""
    here = storage
    while True:
        try:
            parent = here.parent()
        except StorageError:
            return
        if parent.url == here.url:
            return
        found = parent.listdir().get(here.url.rstrip("/").rpartition("/")[2], _ABSENT)
        if found is None:  # a folder, and so are those above it
            return
        if found is not _ABSENT:
            where = "it is" if here is storage else f"{here.url} is"
            raise ExportError(f"cannot export into {storage.url}: {where} a file, not a folder")
        here = parent


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
                      on_start: Callable[[int], None] | None = None,
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
    ``out``). ``on_start(bytes)`` is called with the bytes of tensor data to write once
    they are known, ``on_tensor(name, bytes)`` after each tensor is written."""
    if format not in ("safetensors", "torch"):
        raise ExportError(f"unknown export format {format!r} (use 'safetensors' or 'torch')")
    if strip_prefix and not select:
        raise ExportError("--strip-prefix needs --select PREFIX (the prefix to strip)")
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    source = open_storage(ckpt, **options_for(ckpt, storage_options))
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
    storage = open_storage(target.folder, **options_for(
        target.folder, out_storage_options if out_storage_options is not None else storage_options))
    if not is_remote(target.folder):
        _no_file_in_the_way(storage)
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
    if on_start is not None:
        on_start(total)
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
    skipped = sum(1 for k in leaf_values(manifest.tree) if not select or k.startswith(select))
    return ExportResult(storage.url, written, index, len(names), total, skipped,
                        {out_names[a]: out_names[k] for a, k in ties.items()}, config_name)
