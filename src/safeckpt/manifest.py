"""The manifest: the commit record of a checkpoint, its schema, and its validation.

On storage a manifest is one line of JSON with a fixed frame,
``{"safeckpt":<body>,"checksum":"xxh3_64:<16 hex>"}`` + newline, where the checksum
covers exactly the bytes of ``<body>``. A torn or altered manifest fails the check
and is simply not a commit. See docs/format.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .checksum import ALGORITHM, checksum, is_checksum
from .errors import CorruptCheckpointError
from .tensors import dtype_from_name, nbytes_of

FORMAT_VERSION = 1
MANIFEST_RE = re.compile(r"^manifest-(\d{6,})\.json$")
MAX_MANIFEST_BYTES = 1 << 30
_PREFIX = b'{"safeckpt":'
_SUFFIX_LEN = len(',"checksum":"') + len(ALGORITHM) + 1 + 16 + len('"}\n')
_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=@,-]*$")


def manifest_name(seq: int) -> str:
    """``manifest-000001.json`` for sequence number 1."""
    return f"manifest-{seq:06d}.json"


def check_relpath(name: object, where: str) -> str:
    """A file name from a manifest must stay inside the checkpoint folder."""
    if not isinstance(name, str) or not name or "\\" in name or name.startswith("/"):
        raise CorruptCheckpointError(f"{where}: file name {name!r} is not a relative path inside the checkpoint")
    for part in name.split("/"):
        if part in ("", ".", "..") or not _SAFE_PART.match(part):
            raise CorruptCheckpointError(f"{where}: file name {name!r} leaves the checkpoint folder or is not allowed")
    return name


@dataclass
class FileEntry:
    """One immutable file of the checkpoint."""

    name: str
    size: int
    rank: int | None = None
    header_size: int | None = None      # data files: bytes covered by header_checksum
    header_checksum: str | None = None
    checksum: str | None = None         # sealed foreign files: checksum of the whole file


@dataclass
class Chunk:
    """A box of a logical tensor stored as one contiguous byte range of a file."""

    file: str
    start: int
    end: int
    checksum: str
    offsets: list[int]
    shape: list[int]


@dataclass
class TensorEntry:
    """A logical tensor: dtype, global shape and the chunks that cover it."""

    dtype: str
    shape: list[int]
    chunks: list[Chunk] = field(default_factory=list)


@dataclass
class Manifest:
    """The decoded body of a manifest."""

    save_id: str
    seq: int
    created: float
    world_size: int
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    tree: Any
    step: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def encode_manifest(m: Manifest) -> bytes:
    """Serialize to the framed, self-checksummed form."""
    body = {
        "format_version": m.version, "save_id": m.save_id, "seq": m.seq, "created": m.created,
        "world_size": m.world_size, "step": m.step, "metadata": m.metadata, "metrics": m.metrics,
        "files": [{k: v for k, v in vars(f).items() if v is not None} for f in m.files.values()],
        "tensors": {name: {"dtype": t.dtype, "shape": t.shape, "chunks": [vars(c) for c in t.chunks]}
                    for name, t in m.tensors.items()},
        "tree": m.tree,
    }
    raw = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    return _PREFIX + raw + f',"checksum":"{checksum(raw)}"}}\n'.encode()


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"{where}: {what}")


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def decode_manifest(data: bytes, where: str) -> Manifest:
    """Check the frame, checksum, version and schema; raise ``CorruptCheckpointError``
    naming ``where`` and the problem otherwise."""
    _need(data.startswith(_PREFIX) and len(data) > len(_PREFIX) + _SUFFIX_LEN, where,
          "not a safeckpt manifest, or truncated (an interrupted save leaves this)")
    raw, suffix = data[len(_PREFIX):-_SUFFIX_LEN], data[-_SUFFIX_LEN:]
    try:
        stored = json.loads(b"{" + suffix[1:-1])["checksum"]
    except (ValueError, KeyError, TypeError):
        stored = None
    _need(is_checksum(stored), where, "truncated or garbled (no checksum at the end)")
    _need(checksum(raw) == stored, where, "checksum mismatch: the manifest is torn or was altered")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from exc
    _need(isinstance(body, dict), where, "body is not a JSON object")
    version = body.get("format_version")
    _need(type(version) is int, where, "no format_version")
    _need(version <= FORMAT_VERSION, where,
          f"format version {version} is newer than this safeckpt understands "
          f"({FORMAT_VERSION}); upgrade safeckpt to read it")
    try:
        return _decode_body(body, where)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{where}: malformed manifest ({exc!r})") from exc


def _decode_body(body: dict, where: str) -> Manifest:
    files: dict[str, FileEntry] = {}
    for f in body["files"]:
        entry = FileEntry(**f)
        check_relpath(entry.name, where)
        _need(type(entry.size) is int and entry.size >= 0, where, f"bad size for {entry.name}")
        _need(entry.name not in files, where, f"file {entry.name} listed twice")
        files[entry.name] = entry
    tensors: dict[str, TensorEntry] = {}
    for name, t in body["tensors"].items():
        dtype = dtype_from_name(t["dtype"], f"{where}: tensor {name!r}")
        _need(_int_list(t["shape"]), where, f"tensor {name!r}: bad shape {t['shape']!r}")
        chunks = [Chunk(**c) for c in t["chunks"]]
        for c in chunks:
            _need(c.file in files, where, f"tensor {name!r} names unlisted file {c.file!r}")
            _need(_int_list(c.offsets) and _int_list(c.shape) and len(c.shape) == len(t["shape"])
                  and len(c.offsets) == len(c.shape)
                  and all(o + s <= g for o, s, g in zip(c.offsets, c.shape, t["shape"])),
                  where, f"tensor {name!r}: chunk box outside the tensor")
            _need(type(c.start) is int and type(c.end) is int and 0 <= c.start <= c.end <= files[c.file].size
                  and c.end - c.start == nbytes_of(c.shape, dtype), where,
                  f"tensor {name!r}: byte range [{c.start}, {c.end}) does not fit {c.file} or its shape")
            _need(is_checksum(c.checksum), where, f"tensor {name!r}: bad checksum {c.checksum!r}")
        tensors[name] = TensorEntry(t["dtype"], t["shape"], chunks)
    return Manifest(
        save_id=str(body["save_id"]), seq=int(body["seq"]), created=float(body["created"]),
        world_size=int(body["world_size"]), files=files, tensors=tensors, tree=body["tree"],
        step=body.get("step"), metadata=body.get("metadata") or {}, metrics=body.get("metrics") or {},
        version=body["format_version"])
