"""The manifest: the commit record of a checkpoint, its schema, and its validation.

On storage a manifest is one line of JSON with a fixed frame,
``{"safeckpt":<body>,"checksum":"xxh3_64:<16 hex>"}`` + newline, where the checksum
covers exactly the bytes of ``<body>``. A torn or altered manifest fails the check
and is simply not a commit. See docs/format.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from .text import key_text
from .tree import check_tree, child_key, decode_value, items_of, tag_of
from .checksum import ALGORITHM, BLOCK_SIZE, checksum, checksum_of, is_checksum
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from .names import (MANIFEST_RE, is_shared, manifest_name, manifest_seq, name_problem, root_path,  # noqa: F401
                    shared_location, step_of)
from .records import Chunk, FileEntry, TensorEntry  # noqa: F401 - the manifest's parts
from .compact import TableEntry, TensorTable, decode_table, from_entries, tie_error
from . import transformed as stored_as
from .plan import PlanError, check_coverage
from .dtypes import is_shape, itemsize_of

FORMAT_VERSION = 4  # 2: incremental manifests (files of sibling checkpoints, xxh3_128 chunks); 3: tensor tables;
# 4: tensors stored through stream transforms (``transformed``)
WRITE_VERSION = 3  # what a save writes: compact tensor tables (compact.py)
_PREFIX = b'{"safeckpt":'
_SUFFIX_START = b',"checksum":"' + ALGORITHM.encode() + b":"
_SUFFIX_LEN = len(_SUFFIX_START) + 16 + len(b'"}\n')


def check_relpath(name: object, where: str, siblings: bool = False) -> str:
    """A file name from a manifest must stay inside the checkpoint folder (§2.5); with
    ``siblings`` it may also be ``../step-NNNNNNNNN/<file>``, a file of a sibling
    checkpoint in the same run root, and nothing further away."""
    why = name_problem(name, siblings)
    if why is not None or not isinstance(name, str):
        raise CorruptCheckpointError(f"{where}: file name {name!r} is not allowed: {why}")
    return name


@dataclass
class DcpRecord:
    """How a torch.distributed.checkpoint save named its items: every flat key (DCP's
    fully qualified name) and its path in ``tree``; ``planner_data`` says whether the
    planner flattened a nested state (the paths are then DCP's ``planner_data``);
    ``bytesio`` lists the values that were ``io.BytesIO`` (stored as ``$bytes``)."""

    items: dict[str, list[str | int]]
    planner_data: bool = True
    bytesio: list[str] = field(default_factory=list)


@dataclass
class Manifest:
    """The decoded body of a manifest."""

    save_id: str
    seq: int
    created: float
    world_size: int
    files: dict[str, FileEntry]
    tensors: "Mapping[str, TensorEntry | TableEntry]"  # format 3 decodes into a TensorTable
    tree: Any
    step: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    block_size: int = BLOCK_SIZE
    run_id: str | None = None  # the CheckpointManager run that wrote it (retention scope)
    durable_root: str | None = None  # a local tier's save: the durable root it belongs to (its URL)
    version: int = 1  # saves write WRITE_VERSION; seal keeps the version it found
    dcp: DcpRecord | None = None  # written by safeckpt.dcp.Writer

    @property
    def total_bytes(self) -> int:
        """Bytes of the files in the checkpoint's own folder: what its save wrote."""
        return sum(f.size for f in self.files.values() if not is_shared(f.name))

    @property
    def shared_files_bytes(self) -> int:
        """Bytes of the earlier checkpoints' files it reads data from."""
        return sum(f.size for f in self.files.values() if is_shared(f.name))

    def shared_bytes(self) -> int:
        """Bytes of tensor data it shares with earlier checkpoints (each chunk once)."""
        if isinstance(self.tensors, TensorTable):
            return self.tensors.distinct_bytes([is_shared(n) for n in self.tensors.file_names])
        return sum(end - start for _, start, end in
                   {(c.file, c.start, c.end) for t in self.tensors.values() for c in t.chunks if is_shared(c.file)})

    def tie_of(self, name: str, entry: "TensorEntry | TableEntry") -> tuple:
        """Which saved tensor ``name`` is: tensors of one tie (saved as one tensor) have
        the same. Format 1 ties tensors by their shared chunks; format 2, whose distinct
        tensors may share chunks by content, names the tie."""
        if self.version < 2:
            return entry.dtype, tuple(entry.shape), tuple((c.file, c.start) for c in entry.chunks)
        return (entry.tied_to or name,)

    def chunks_in(self, file: str) -> list[tuple[str, Chunk]]:
        """(tensor name, chunk) of every chunk stored in ``file``."""
        if isinstance(self.tensors, TensorTable):
            return self.tensors.chunks_in(file)
        return [(name, c) for name, t in self.tensors.items() for c in t.chunks if c.file == file]


def editable(tensors: "Mapping[str, TensorEntry | TableEntry]") -> dict[str, TensorEntry]:
    """The tensors of a decoded manifest as entries that can be changed in place."""
    if isinstance(tensors, stored_as.WithTransformed):
        return {**editable(tensors.table), **tensors.transformed}
    return tensors.entries() if isinstance(tensors, TensorTable) else dict(tensors)  # type: ignore[arg-type]


def _no_tensors(key: str, t: Any) -> Any:
    raise TypeError(f"{key}: tensors are not allowed in metadata or metrics")


def encode_values(values: dict[str, Any], what: str) -> Any:
    """Metadata and metrics go through the restricted codec (nan, tuples, int keys)."""
    from .codec import encode  # imports torch, which decoding a manifest never needs

    return encode(values, what, _no_tensors, lambda k, v: v, allow_pickle=False)


def encode_manifest(m: Manifest) -> bytes:
    """Serialize to the framed, self-checksummed form."""
    tensors, transformed = stored_as.split(m.tensors)
    if transformed and m.version < stored_as.TRANSFORMED_VERSION:
        raise ValueError(f"a manifest with transformed tensors is format {stored_as.TRANSFORMED_VERSION}, "
                         f"not {m.version}")
    table = from_entries(tensors, list(m.files), m.block_size).encode_parts() if m.version >= 3 else None
    stand_in = f"table-{secrets.token_hex(16)}"  # the table's text goes where this string is
    body = {
        "format_version": m.version, "save_id": m.save_id, "seq": m.seq, "created": m.created,
        "world_size": m.world_size, "step": m.step, "block_size": m.block_size, "run_id": m.run_id,
        "metadata": encode_values(m.metadata, "metadata"), "metrics": encode_values(m.metrics, "metrics"),
        "files": [{k: v for k, v in vars(f).items() if v is not None} for f in m.files.values()],
        "tensors": stand_in if table is not None else
                   {name: {"dtype": t.dtype, "shape": t.shape, "chunks": [vars(c) for c in t.chunks],
                           **({"tied_to": t.tied_to} if t.tied_to else {})}
                    for name, t in tensors.items()},
        "tree": m.tree,
    }
    if transformed:
        body["transformed"] = transformed
    if m.durable_root is not None:
        body["durable_root"] = m.durable_root
    if m.dcp is not None:
        body["dcp"] = {"items": m.dcp.items, "planner_data": m.dcp.planner_data, "bytesio": m.dcp.bytesio}
    text = json.dumps(body, separators=(",", ":"), allow_nan=False)
    if table is None:
        return frame(text.encode())
    before, after = text.split(f'"{stand_in}"', 1)
    return frame([before.encode(), *table, after.encode()])


def frame(raw: "bytes | list[bytes]") -> bytes:
    """A manifest's bytes on storage: the JSON body ``raw`` (or the parts it is made of,
    joined once, here) in its self-checksummed frame."""
    parts = [raw] if isinstance(raw, (bytes, bytearray)) else raw
    return b"".join([_PREFIX, *parts, f',"checksum":"{checksum_of(parts)}"}}\n'.encode()])


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"{where}: {what}")


def _is_int(value: Any, minimum: int = 0) -> bool:
    return type(value) is int and value >= minimum


def _known(cls: type, entry: Any, where: str) -> dict:
    """The fields of ``cls`` in a JSON object; unknown (newer, additive) fields are ignored."""
    _need(isinstance(entry, dict), where, f"{cls.__name__} entry is not an object")
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in entry.items() if k in names}


def decode_manifest(data: bytes, where: str) -> Manifest:
    """Check the frame, checksum, version and schema; raise ``CorruptCheckpointError``
    naming ``where`` and the problem otherwise (``UnsupportedFormatError`` for a
    manifest written by a newer safeckpt)."""
    _need(data.startswith(_PREFIX) and len(data) > len(_PREFIX) + _SUFFIX_LEN, where,
          "not a safeckpt manifest, or truncated (an interrupted save leaves this)")
    raw, suffix = data[len(_PREFIX):-_SUFFIX_LEN], data[-_SUFFIX_LEN:]
    stored = suffix[len(b',"checksum":"'):-len(b'"}\n')].decode("ascii", "replace")
    _need(suffix.startswith(_SUFFIX_START) and suffix.endswith(b'"}\n') and is_checksum(stored),
          where, "truncated or garbled (no checksum at the end)")
    _need(checksum(raw) == stored, where, "checksum mismatch: the manifest is torn or was altered")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from exc
    except RecursionError as exc:
        raise CorruptCheckpointError(f"{where}: its JSON is nested too deeply to be a manifest") from exc
    _need(isinstance(body, dict), where, "body is not a JSON object")
    version = body.get("format_version")
    _need(_is_int(version, 1), where, f"bad format_version {version!r}")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{where}: format version {version} is newer than this safeckpt understands "
            f"({FORMAT_VERSION}); upgrade safeckpt to read it")
    try:
        return _decode_body(body, where, len(raw))
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError, OverflowError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed manifest ({exc!r})") from exc


def _decode_files(entries: Any, where: str, version: int) -> dict[str, FileEntry]:
    files: dict[str, FileEntry] = {}
    for raw in entries:
        f = FileEntry(**_known(FileEntry, raw, where))
        check_relpath(f.name, where, siblings=version >= 2)
        _need(_is_int(f.size), where, f"bad size for {f.name}")
        _need(f.rank is None or _is_int(f.rank), where, f"bad rank for {f.name}")
        _need(f.header_size is None or (_is_int(f.header_size, 8) and f.header_size <= f.size
                                        and is_checksum(f.header_checksum)),
              where, f"bad header record for {f.name}")
        _need(f.checksum is None or is_checksum(f.checksum), where, f"bad checksum for {f.name}")
        _need(f.name not in files, where, f"file {f.name} listed twice")
        files[f.name] = f
    return files


def _nat_list(value: Any) -> bool:
    """A list of ints >= 0 (not bools): checked with set and min, which cost far less than
    a generator per item; this runs twice per chunk."""
    return isinstance(value, list) and (not value or ({type(v) for v in value} == _INT_TYPE and min(value) >= 0))


_INT_TYPE = {int}


def _decode_chunk(raw: Any, name: str, shape: list[int], itemsize: int, files: dict[str, FileEntry],
                  block: int, where: str) -> Chunk:
    # built field by field (unknown, newer fields are ignored): this runs once per chunk
    c = Chunk(raw["file"], raw["start"], raw["end"], raw["checksums"], raw["offsets"], raw["shape"])
    f = files.get(c.file)
    if f is None:  # the messages are built only on failure
        raise CorruptCheckpointError(f"{where}: tensor {name!r} names unlisted file {c.file!r}")
    offsets, cshape = c.offsets, c.shape
    if not (_nat_list(offsets) and _nat_list(cshape) and len(cshape) == len(shape) == len(offsets)
            and (cshape == shape and not any(offsets)  # the common case: one chunk, the whole tensor
                 or all(o + s <= g for o, s, g in zip(offsets, cshape, shape)))):
        raise CorruptCheckpointError(f"{where}: tensor {name!r}: chunk box outside the tensor")
    start, end, sums = c.start, c.end, c.checksums
    if not (type(start) is int and type(end) is int and 0 <= start <= end <= f.size
            and end - start == math.prod(cshape) * itemsize):
        raise CorruptCheckpointError(
            f"{where}: tensor {name!r}: byte range [{start}, {end}) does not fit {c.file} or its shape")
    if not (type(sums) is list and len(sums) == max(1, -(-(end - start) // block)) and all(map(is_checksum, sums))):
        raise CorruptCheckpointError(f"{where}: tensor {name!r}: bad checksums")
    return c


def _decode_tensors(saved: Any, files: dict[str, FileEntry], block: int, where: str) -> dict[str, TensorEntry]:
    """Formats 1 and 2: one JSON entry per tensor and chunk."""
    tensors: dict[str, TensorEntry] = {}
    itemsizes: dict[str, int] = {}  # per dtype name; messages below are built only on failure
    for name, t in saved.items():
        dtype, shape = t["dtype"], t["shape"]
        itemsize = itemsizes.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            itemsize = itemsizes[dtype] = itemsize_of(dtype, f"{where}: tensor {name!r}")
        if not is_shape(shape, itemsize):
            raise CorruptCheckpointError(f"{where}: tensor {name!r}: bad shape {str(shape)[:100]}")
        chunks = [_decode_chunk(c, name, shape, itemsize, files, block, where) for c in t["chunks"]]
        if len(chunks) == 1:
            if chunks[0].shape != shape:
                raise CorruptCheckpointError(f"{where}: tensor {name!r}: its chunk does not cover it")
        else:
            try:
                check_coverage(name, tuple(shape), [(tuple(c.offsets), tuple(c.shape)) for c in chunks])
            except PlanError as exc:
                raise CorruptCheckpointError(f"{where}: {exc}") from exc
        tied = t.get("tied_to")
        if not (tied is None or (isinstance(tied, str) and tied in saved and tied != name)):
            raise CorruptCheckpointError(f"{where}: tensor {name!r}: tied to unknown tensor {tied!r}")
        tensors[name] = TensorEntry(dtype, shape, chunks, tied)
    for name, t in tensors.items():  # a tie repeats its tensor (compact.TensorTable.check_ties)
        if t.tied_to is not None:
            first = tensors[t.tied_to]
            if (first.dtype, first.shape, first.chunks) != (t.dtype, t.shape, t.chunks):
                raise tie_error(where, name, t.tied_to)
    return tensors


def _decode_body(body: dict, where: str, length: int) -> Manifest:
    files = _decode_files(body["files"], where, body["format_version"])
    block = body.get("block_size", BLOCK_SIZE)
    _need(_is_int(block, 1), where, f"bad block_size {block!r}")
    tensors: Mapping[str, TensorEntry | TableEntry] = decode_table(body["tensors"], files, block, where, length) \
        if body["format_version"] >= 3 else _decode_tensors(body["tensors"], files, block, where)
    if body["format_version"] >= stored_as.TRANSFORMED_VERSION and body.get("transformed") is not None:
        tensors = stored_as.decode(tensors, body["transformed"], where)
    step, world, run_id = body.get("step"), body["world_size"], body.get("run_id")
    _need(run_id is None or isinstance(run_id, str), where, f"bad run_id {run_id!r}")
    durable_root = body.get("durable_root")
    _need(durable_root is None or isinstance(durable_root, str), where, f"bad durable_root {durable_root!r}")
    _need(step is None or _is_int(step), where, f"bad step {step!r}")
    _need(_is_int(world, 1), where, f"bad world_size {world!r}")
    _need(isinstance(body["save_id"], str) and _is_int(body["seq"], 1)
          and type(body["created"]) in (int, float), where, "bad save_id, seq or created")
    tree = body["tree"]
    check_tree(tree, where, tensors)
    dcp = _decode_dcp(body["dcp"], where) if body.get("dcp") is not None else None
    if dcp is not None:
        dcp_nodes(dcp, tree, where)
    return Manifest(
        save_id=body["save_id"], seq=body["seq"], created=float(body["created"]), world_size=world,
        files=files, tensors=tensors, tree=tree, step=step, block_size=block, run_id=run_id,
        durable_root=durable_root, metadata=decode_values(body.get("metadata") or {}, "metadata", where),
        metrics=decode_values(body.get("metrics") or {}, "metrics", where), version=body["format_version"],
        dcp=dcp)


def _decode_dcp(raw: Any, where: str) -> DcpRecord:
    record = DcpRecord(**_known(DcpRecord, raw, where))
    _need(isinstance(record.items, dict) and type(record.planner_data) is bool and isinstance(record.bytesio, list)
          and all(n in record.items for n in record.bytesio), where, "malformed dcp record")
    for fqn, path in record.items.items():
        _need(isinstance(path, list) and bool(path) and all(type(p) is str or _is_int(p) for p in path), where,
              f"dcp item {fqn!r}: bad path {path!r}")
    return record


MAPPING_TAGS = ("object", "$dict", "$odict")


def children(node: Any, where: str) -> dict:
    """The children of a container node of a tree by key as DCP names path parts: a
    mapping's keys as strings, a list's or tuple's items by index."""
    tag = tag_of(node)
    if tag in MAPPING_TAGS:
        return {key_text(k): v for k, v in items_of(node, where, False)}
    if tag in ("list", "$tuple"):
        return dict(items_of(node, where, False))
    raise CorruptCheckpointError(f"{where}: expected a container")


def dcp_nodes(record: DcpRecord, tree: Any, where: str) -> dict[str, Any]:
    """Each DCP item's node in the tree, checked: its path leads to it, it is no rank-local
    value, and an item listed in ``bytesio`` holds bytes. Each container's children are
    gathered once (a state has many items under few containers)."""
    found: dict[int, dict] = {}
    nodes = {}
    for fqn, path in record.items.items():
        node = tree
        for part in path:
            kids = found.get(id(node))
            if kids is None:
                kids = found[id(node)] = children(node, f"{where}: dcp item {fqn!r}")
            if part not in kids:
                raise CorruptCheckpointError(f"{where}: dcp item {fqn!r}: its path {list(path)} is not in the tree")
            node = kids[part]
        if tag_of(node) == "$local" or (fqn in record.bytesio and not (
                isinstance(node, dict) and list(node) == ["$bytes"])):
            raise CorruptCheckpointError(f"{where}: dcp item {fqn!r} is listed as "
                                         f"{'an io.BytesIO' if fqn in record.bytesio else 'an item'}, but the tree "
                                         "holds something else there")
        nodes[fqn] = node
    return nodes


def decode_values(node: Any, what: str, where: str) -> dict[str, Any]:
    """Inverse of ``encode_values``; ``where`` names the manifest in errors."""
    _need(tag_of(node) in ("object", "$dict", "$odict"), where, f"{what} is not a mapping")
    check_tree(node, f"{where}: {what}", (), plain=True)
    items = items_of(node, what, allow_pickle=False)
    return {k: decode_value(v, child_key(what, k)) for k, v in items}
