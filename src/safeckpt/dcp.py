"""safeckpt underneath ``torch.distributed.checkpoint`` (DCP).

``Writer`` and ``Reader`` are DCP storage layers: DCP's planner decides what each rank
writes and reads, safeckpt's commit protocol makes it a checkpoint. DCP's call order
maps onto the protocol one to one:

- ``prepare_global_plan`` (coordinator): read the folder's committed manifest, refuse
  an existing checkpoint without ``overwrite``, draw the save id and hand it to every
  rank in its plan's ``storage_data``;
- ``write_data`` (every rank): one safetensors data file named by the save id and the
  rank, written and fsynced; non-tensor values are encoded by the restricted codec
  from the original objects (never DCP's ``torch.save`` bytes) and travel to the
  coordinator in the write results;
- ``finish`` (coordinator, only when every rank wrote): the manifest, last; then the
  replaced version's files. When a rank fails, DCP never calls ``finish``: nothing is
  committed, the previous checkpoint stays, and the failed save's files (named by its
  save id) are garbage for ``safeckpt gc``.

The checkpoint is an ordinary safeckpt checkpoint (``safeckpt.load_state``, ``verify``,
``ls``, ``show``, ``export`` work on it) with a ``dcp`` record that keeps DCP's names.
``Reader`` rebuilds DCP's ``Metadata`` from the manifest (no pickle), checks every
block it reads, and hands the load planner only bytes it made itself from decoded
values; it also reads checkpoints written by ``safeckpt.save``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import secrets
import time
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.checkpoint._traverse import set_element
from torch.futures import Future

from .format import codec
from .protocol.checkpoint import PathLike, new_save_id, plain_values, read_committed
from .format.checksum import checksum
from .protocol.commit import (check_visible, data_file_name, describe_error, file_metadata, read_existing, refuse_existing,
                     remove_quietly, retire_replaced, write_manifest)
from .protocol.datafile import WrittenPiece, plan_layout, write_data_file
from .errors import (CheckpointError, CorruptCheckpointError, SaveAbortedError,
                     UnsupportedFeatureError)
from .format.manifest import (MAPPING_TAGS, WRITE_VERSION, Chunk, DcpRecord, FileEntry, Manifest, TensorEntry,
                               children, dcp_nodes, encode_values)
from .format.plan import PlanError, check_coverage
from .protocol.reader import TensorReader
from .protocol.state import LoadPlanner as ValuePlanner, Read, flatten
from .storage import Storage
from .storage import open as open_storage
from .format.tensors import byte_view, dtype_from_name, dtype_name
from .format.transformed import TRANSFORMED_VERSION, StoredChunk
from .protocol import transforms

__all__ = ["Writer", "Reader", "dcp_to_torch_save", "UnsupportedFeatureError"]

Path = tuple[str | int, ...]
_EXTRA = "$extra"  # the index of the write result that carries ``extra``'s tree


@dataclass(frozen=True)
class _Assigned:
    """The coordinator's answer in each rank's plan: this save's id and the rank's index."""

    save_id: str
    rank: int


@dataclass
class _Written:
    """Where one tensor chunk landed (a ``WriteResult``'s storage data)."""

    file: FileEntry
    start: int
    end: int
    checksums: list[str]
    shape: list[int]
    dtype: str
    transforms: list[str]  # the stream transforms its stored bytes went through (none: the tensor's bytes)


@dataclass
class _Extra:
    """The coordinator's ``extra`` state: its tree (tensor references by name) and aliases."""

    tree: Any
    aliases: dict[str, str]
    names: list[str]


@dataclass
class _Value:
    """A non-tensor value, encoded by the restricted codec on the rank that holds it
    (an ``io.BytesIO`` as its bytes)."""

    node: Any
    bytesio: bool = False


def _fqn_error(fqn: str, what: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"safeckpt.dcp: {fqn!r}: {what}")


class Writer(StorageWriter, BlockingAsyncStager):
    """``dcp.save(state, storage_writer=safeckpt.dcp.Writer(path))``: a crash-safe DCP save.

    ``path`` is any safeckpt storage URL (local path, ``file://``, ``s3://`` ... with
    ``storage_options``) or a ``Storage``. ``overwrite`` (default, as DCP's
    ``FileSystemWriter``) replaces a committed checkpoint atomically; without it an
    existing one raises ``CheckpointExistsError``. ``step`` and ``metadata`` go into
    the manifest. ``extra`` is a state saved by rank 0 as ``safeckpt.save`` would (its
    own tensors, values and empty containers kept as they are) in the same commit, next
    to DCP's items, under its own top-level keys: a trainer's metadata (Lightning's
    ``meta.pt``); read it back with ``safeckpt.load_state(path, keys=[...])``.
    For ``dcp.async_save`` it stages the state in host memory as DCP's
    ``FileSystemWriter`` does (``cache_staged_state_dict`` keeps the staging copy, pinned,
    for the next save). ``_extensions`` are DCP's stream transforms (``ZStandard()``
    compresses), applied to every tensor chunk DCP writes: the manifest records them and
    the checksums of the stored bytes; values stay in the manifest as they are."""

    def __init__(self, path: PathLike, *, storage_options: dict | None = None, overwrite: bool = True,
                 step: int | None = None, metadata: dict | None = None, extra: dict | None = None,
                 cache_staged_state_dict: bool = False, _extensions: Sequence[Any] | None = None) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.extensions = list(_extensions or [])
        for ex in self.extensions:
            if not all(callable(getattr(ex, m, None)) for m in ("transform_to", "get_descriptor")):
                raise TypeError(f"_extensions must be torch.distributed.checkpoint stream transforms "
                                f"(StreamTransformExtension), not {type(ex).__name__}")
        self.storage_options = dict(storage_options or {})
        self.overwrite = overwrite
        self.step = step
        self.metadata = plain_values(metadata, "metadata")
        encode_values(self.metadata, "metadata")  # refused now, before any save
        if extra is not None and not (isinstance(extra, dict) and all(
                type(k) is str and not k.startswith("$") for k in extra)):
            raise TypeError("extra must be a dict with string keys that do not start with '$'")
        self.extra = extra
        self.storage: Storage = open_storage(path, **self.storage_options)
        self.reset()

    # -- DCP's protocol ----------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.storage = open_storage(checkpoint_id, **self.storage_options)
        self.is_coordinator = True
        self.old: Manifest | None = None
        self.seq = 0
        self.save_id: str | None = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.storage.url)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise UnsupportedFeatureError(
                "safeckpt.dcp.Writer needs use_collectives=True: a commit needs the ranks to agree "
                "(without collectives each rank would write a checkpoint of its own)")
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=self.storage.url)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if any(not p.usable for p in plans):
            raise UnsupportedFeatureError(
                "safeckpt.dcp.Writer does not support save-plan caching (enable_plan_caching): "
                "every save needs a plan carrying its own save id")
        urls = [p.storage_data for p in plans]
        if any(u != self.storage.url for u in urls):
            raise SaveAbortedError(f"the ranks disagree on where to save: {dict(enumerate(urls))}; every rank "
                                   "must pass the same path to safeckpt.dcp.Writer")
        self.old, max_seq = read_existing(self.storage)
        refuse_existing(self.storage, self.old, max_seq, self.overwrite)
        self.save_id, self.seq = new_save_id(), max_seq + 1
        return [dataclasses.replace(p, storage_data=_Assigned(self.save_id, rank)) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assigned = plan.storage_data
        if not isinstance(assigned, _Assigned):
            raise UnsupportedFeatureError(
                "safeckpt.dcp.Writer: the plan carries no save id (a planner replaced the plan's "
                "storage_data in finish_plan?)")
        name = data_file_name(assigned.save_id, assigned.rank)
        try:
            resolved, results = self._resolve(plan, planner)
            tensors = [self._stored(item, t) for item, t in resolved]
            if self.extra and assigned.rank == 0:
                tensors += [(item, t, []) for item, t in self._extra(results)]
            if tensors:
                results += self._write_tensors(name, assigned, tensors)
        except BaseException as exc:
            if not isinstance(exc, FileExistsError):
                remove_quietly(self.storage, [name])
            if not isinstance(exc, Exception):  # interrupted: cleaned up, re-raised as it is
                raise
            raise _on_rank(exc, assigned.rank, f"writing its part of {self.storage.url}") from exc
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files = {r.storage_data.file.name: r.storage_data.file for rank in results for r in rank
                 if isinstance(r.storage_data, _Written)}
        try:
            manifest = self._manifest(metadata, results, files)
            check_visible(self.storage, [(cast(int, f.rank), f) for f in files.values()])
            write_manifest(self.storage, manifest)
        except BaseException as exc:
            remove_quietly(self.storage, sorted(files))
            if not isinstance(exc, Exception):
                raise
            raise _on_rank(exc, 0, f"committing {self.storage.url}") from exc
        retire_replaced(self.storage, self.old, manifest)

    # -- helpers -------------------------------------------------------------------------
    def _resolve(self, plan: SavePlan, planner: SavePlanner) -> tuple[list, list[WriteResult]]:
        """This rank's tensors (resolved by the planner, as DCP writes them) and its values
        (the original objects, encoded without pickle)."""
        tensors: list[tuple[WriteItem, torch.Tensor]] = []
        values: list[WriteResult] = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                value = _original(planner, item)
                bytesio = isinstance(value, io.BytesIO)
                node = codec.encode(value.getvalue() if bytesio else value, fqn, _no_tensor, lambda k, v: v,
                                    allow_pickle=False)
                values.append(WriteResult(item.index, 0, _Value(node, bytesio)))
                continue
            t = planner.resolve_data(item)
            want = cast(TensorWriteData, item.tensor_data)  # set on every tensor item
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(want.chunk.sizes) \
                    or t.dtype != want.properties.dtype:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise _fqn_error(fqn, f"the planner's resolve_data returned {got}, but the plan records "
                                      f"{want.properties.dtype} {tuple(want.chunk.sizes)}; a planner must "
                                      "describe in its plan what it writes")
            tensors.append((item, t))
        return tensors, values

    def _extra(self, results: list[WriteResult]) -> list[tuple[WriteItem, torch.Tensor]]:
        """Flatten ``extra`` as ``safeckpt.save`` does; its tensors become whole-tensor items."""
        assert self.extra is not None  # called only when there is extra
        flat = flatten(self.extra)
        if flat.has_local:
            raise UnsupportedFeatureError("safeckpt.dcp.Writer: extra cannot hold RankLocal values")
        results.append(WriteResult(MetadataIndex(_EXTRA), 0, _Extra(flat.tree, flat.aliases, list(flat.pieces))))
        return [(WriteItem(MetadataIndex(name), WriteItemType.TENSOR,
                           tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0] * p.tensor.dim()),
                                                                            p.tensor.shape),
                                                       TensorProperties(dtype=p.tensor.dtype), p.tensor.shape)),
                 p.tensor) for name, p in flat.pieces.items()]

    def _stored(self, item: WriteItem, t: torch.Tensor) -> tuple[WriteItem, torch.Tensor, list[str]]:
        """What a DCP tensor item stores: its bytes through the stream transforms, if any."""
        if not self.extensions:
            return item, t, []
        data, descriptors = transforms.encode(self.extensions, byte_view(t.detach().cpu().contiguous()))
        stored = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return item, stored, descriptors

    def _write_tensors(self, name: str, assigned: _Assigned, tensors: list) -> list[WriteResult]:
        keys = [item.index.fqn for item, _, _ in tensors]
        if len(set(keys)) < len(keys):  # several chunks of one tensor on this rank
            keys = [f"{k}@{','.join(map(str, item.tensor_data.chunk.offsets))}"
                    for k, (item, _, _) in zip(keys, tensors)]
        layout = plan_layout([(k, t) for k, (_, t, _) in zip(keys, tensors)],
                             file_metadata(assigned.save_id))
        written: list[WrittenPiece] = []
        size = write_data_file(self.storage, name, layout, written)
        entry = FileEntry(name, size, rank=assigned.rank, header_size=len(layout.header),
                          header_checksum=checksum(layout.header))
        return [WriteResult(item.index, w.end - w.start,
                            _Written(entry, w.start, w.end, w.checksums, list(item.tensor_data.chunk.sizes),
                                     dtype_name(item.tensor_data.properties.dtype), descriptors))
                for (item, _, descriptors), w in zip(tensors, written)]

    def _manifest(self, metadata: Metadata, results: list[list[WriteResult]],
                  files: dict[str, FileEntry]) -> Manifest:
        chunks: dict[str, list[Chunk]] = {}
        values: dict[str, Any] = {}
        bytesio: list[str] = []
        extra: _Extra | None = None
        dtypes: dict[str, str] = {}
        for rank in results:
            for r in rank:
                fqn, data = r.index.fqn, r.storage_data
                if isinstance(data, _Extra):
                    extra = data
                elif isinstance(data, _Value):
                    values[fqn] = data.node
                    if data.bytesio:
                        bytesio.append(fqn)
                else:
                    dtypes[fqn] = data.dtype
                    offsets = list(r.index.offset) if r.index.offset is not None else [0] * len(data.shape)
                    where = (data.file.name, data.start, data.end, data.checksums, offsets, data.shape)
                    chunks.setdefault(fqn, []).append(
                        StoredChunk(*where, transforms=data.transforms) if data.transforms else Chunk(*where))
        tensors: dict[str, TensorEntry] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                if fqn not in values:
                    raise SaveAbortedError(f"{self.storage.url}: no rank wrote the value {fqn!r}")
                continue
            found = chunks.get(fqn, [])
            if len(found) != len(md.chunks):
                raise SaveAbortedError(f"{self.storage.url}: tensor {fqn!r} has {len(md.chunks)} chunks in "
                                       f"DCP's metadata, the ranks wrote {len(found)}")
            shape = tuple(md.size)
            try:
                check_coverage(fqn, shape, [(tuple(c.offsets), tuple(c.shape)) for c in found])
            except PlanError as exc:
                raise SaveAbortedError(f"{self.storage.url}: {exc}") from exc
            tensors[fqn] = TensorEntry(dtype_name(md.properties.dtype), list(shape), found)
        paths, flattened = _paths(metadata)
        root: dict = {}
        for fqn, path in paths.items():
            leaf = {"$tensor": fqn} if fqn in tensors else values[fqn]
            set_element(root, path, codec.Encoded(leaf))
        tree = codec.encode(root, "", _no_tensor, lambda k, v: v, allow_pickle=False)
        if extra is not None:
            tree = _merge_extra(tree, extra, chunks, dtypes, tensors)
        return Manifest(save_id=self.save_id or "", seq=self.seq, created=time.time(), world_size=len(results),
                        files=files, tensors=tensors, tree=tree, step=self.step, metadata=self.metadata,
                        version=TRANSFORMED_VERSION if self.extensions else WRITE_VERSION, dcp=DcpRecord({fqn: list(p) for fqn, p in paths.items()}, flattened, sorted(bytesio)))


def _merge_extra(tree: dict, extra: _Extra, chunks: dict[str, list[Chunk]], dtypes: dict[str, str],
                 tensors: dict[str, TensorEntry]) -> dict:
    """The ``extra`` state's keys next to DCP's at the root, its tensors in the table."""
    clash = sorted(set(tree) & set(extra.tree) | set(tensors) & set(extra.names))
    if clash:
        raise UnsupportedFeatureError(f"safeckpt.dcp.Writer: extra and the DCP state both hold {clash}")
    for name in extra.names:  # one whole chunk each
        tensors[name] = TensorEntry(dtypes[name], list(chunks[name][0].shape), chunks[name])
    for alias, first in extra.aliases.items():
        tensors[alias] = dataclasses.replace(tensors[first], tied_to=first)
    return {**tree, **extra.tree}


def _on_rank(exc: Exception, rank: int, doing: str) -> CheckpointError:
    """The error this rank hands DCP (which raises ``CheckpointException`` on every rank
    with each failed rank's error): it names the rank, and keeps safeckpt's error type."""
    message = (f"rank {rank}: {doing} failed, so the save was aborted on every rank; nothing was "
               f"committed and the previous checkpoint is untouched: {describe_error(exc)}")
    if isinstance(exc, SaveAbortedError) or not isinstance(exc, CheckpointError):
        return SaveAbortedError(message, {rank: describe_error(exc)})
    return type(exc)(message)


def _original(planner: SavePlanner, item: WriteItem) -> Any:
    """The object behind a non-tensor item. DCP would write ``torch.save`` bytes of what
    ``resolve_data`` returns; safeckpt stores the object itself, which is only the same
    thing when the planner's ``resolve_data`` is DCP's own."""
    kind: type[Any] = type(planner)
    if not (isinstance(planner, DefaultSavePlanner) and kind.resolve_data is DefaultSavePlanner.resolve_data
            and kind.transform_object is DefaultSavePlanner.transform_object):
        raise _fqn_error(item.index.fqn, f"{kind.__name__} changes how non-tensor values are resolved "
                                         "(resolve_data / transform_object); safeckpt stores values without "
                                         "pickle and cannot store a custom transform's bytes. Use DCP's "
                                         "DefaultSavePlanner for values, or transform them before saving")
    return planner.lookup_object(item.index)


def _no_tensor(key: str, t: torch.Tensor) -> Any:
    raise _fqn_error(key, "a tensor inside a non-tensor value (DCP would pickle it); put tensors directly "
                          "in the state dict, or in dicts and lists, where DCP saves them as tensors")


def _paths(metadata: Metadata) -> tuple[dict[str, Path], bool]:
    """Every item's path in the saved tree: DCP's flattening mappings when the planner
    made them, else the flat key."""
    mappings = metadata.planner_data
    keys = list(metadata.state_dict_metadata)
    if mappings is None:
        return {k: (k,) for k in keys}, False
    if not (isinstance(mappings, dict) and all(
            isinstance(mappings.get(k), tuple) and mappings[k]
            and all(type(p) in (str, int) for p in mappings[k]) for k in keys)):
        raise UnsupportedFeatureError(
            "safeckpt.dcp.Writer: the planner's planner_data is not DCP's flattening mappings "
            "(fqn -> path); custom planner_data cannot be stored without pickle")
    return {k: mappings[k] for k in keys}, True


# --------------------------------------------------------------------------- reading


def _traversed(node: Any) -> bool:
    """Whether DCP's flattening goes into a node: every mapping, and a list that holds a
    tensor or such a container; anything else (a tuple too, whatever it holds) is one item."""
    tag = codec.tag_of(node)
    return tag in MAPPING_TAGS or (tag == "list" and any(codec.tag_of(c) == "$tensor" or _traversed(c) for c in node))


def _flat_items(node: Any, path: Path, out: dict[str, Path], nodes: dict[str, Any]) -> None:
    """DCP's flattening of a tree saved by ``safeckpt.save`` (rank-local values skipped):
    each item's path and node."""
    tag = codec.tag_of(node)
    if tag == "$local":
        return
    if _traversed(node):
        for key, child in children(node, ".".join(map(str, path))).items():
            _flat_items(child, path + (key,), out, nodes)
    elif path:
        out[".".join(map(str, path))] = path
        nodes[".".join(map(str, path))] = node


class Reader(StorageReader):
    """``dcp.load(state, storage_reader=safeckpt.dcp.Reader(path))``: loads a committed
    safeckpt checkpoint (written by ``Writer`` or by ``safeckpt.save``) through DCP,
    resharding as DCP's planner decides, every block checked."""

    def __init__(self, path: PathLike, *, storage_options: dict | None = None,
                 _extension_registry: Any = None) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.extension_registry = _extension_registry  # DCP's default registry when None (knows ZStandard)
        self.storage: Storage = open_storage(path, **self.storage_options)
        self.reset()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.storage = open_storage(checkpoint_id, **self.storage_options)
        self.manifest: Manifest | None = None
        self.items: dict[str, Any] = {}  # fqn -> tree node
        self.bytesio: set[str] = set()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self) -> Metadata:
        manifest = self.manifest = read_committed(self.storage)
        where = self.storage.url
        if manifest.dcp is not None:
            paths = {fqn: tuple(p) for fqn, p in manifest.dcp.items.items()}
            planner_data = manifest.dcp.planner_data
            self.bytesio = set(manifest.dcp.bytesio)
            self.items = dcp_nodes(manifest.dcp, manifest.tree, where)
        else:
            paths, planner_data = {}, True
            self.items = {}
            _flat_items(manifest.tree, (), paths, self.items)
        md: dict[str, Any] = {}
        for fqn, node in self.items.items():
            if codec.tag_of(node) != "$tensor":
                md[fqn] = BytesStorageMetadata()
                continue
            entry = manifest.tensors.get(node["$tensor"])
            if entry is None:
                raise CorruptCheckpointError(
                    f"{where}: the tree names tensor {node['$tensor']!r} but has no data for it")
            md[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=dtype_from_name(entry.dtype, f"{where}: {fqn}")), torch.Size(entry.shape),
                [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.shape)) for c in entry.chunks])
        return Metadata(md, planner_data=dict(paths) if planner_data else None,
                        storage_meta=StorageMeta(checkpoint_id=where, save_id=manifest.save_id,
                                                 load_id=secrets.token_hex(8)),
                        version=CURRENT_DCP_VERSION)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.manifest is None:
            raise CheckpointError("safeckpt.dcp.Reader: read_metadata was not called first")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        assert self.manifest is not None  # set_up_storage_reader refused a missing one
        return dataclasses.replace(plan, storage_data=self.manifest.save_id)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen = {p.storage_data for p in plans}
        if len(seen) > 1:
            raise CheckpointError(
                f"the ranks read different commits of {self.storage.url} (save ids {sorted(seen)}): a save "
                "committed while they started loading; load again")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.manifest is not None  # set_up_storage_reader refused a missing one
        values = ValuePlanner(self.manifest.tensors, True, allow_pickle=False)  # the tensors inside values
        reads: list[Read] = values.reads
        targets = []
        pending = []
        for req in plan.items:
            fqn = req.storage_index.fqn
            node = self.items[fqn]
            if req.type == LoadItemType.BYTE_IO:
                pending.append((req, values.plan(None, node, fqn, "object")))
                continue
            entry = self.manifest.tensors[node["$tensor"]]
            target = planner.resolve_tensor(req).detach()
            offsets = tuple(int(a) + int(b) for a, b in zip(cast(torch.Size, req.storage_index.offset), req.storage_offsets))
            if tuple(target.shape) != tuple(req.lengths):
                raise CheckpointError(f"{fqn}: the planner resolved a tensor of shape {tuple(target.shape)} for "
                                      f"a read of {tuple(req.lengths)}")
            reads.append(Read(node["$tensor"], entry, target, (offsets, tuple(req.lengths))))
            targets.append((req, target))
        if values.problems:
            raise CorruptCheckpointError(f"{self.storage.url}: " + "; ".join(values.problems))
        TensorReader(self.storage, self.manifest, verify=True, transforms=self.extension_registry).run(reads)
        for req, target in targets:
            planner.commit_tensor(req, target)
        for req, value in pending:
            fqn = req.storage_index.fqn
            planner.load_bytes(req, _bytes_of(io.BytesIO(value()) if fqn in self.bytesio else value()))
        future: Future[None] = Future()
        future.set_result(None)
        return future


def _bytes_of(value: Any) -> io.BytesIO:
    """What DCP's load planner expects for a value: ``torch.save`` bytes. These are made
    here, from a value the restricted codec decoded, never read from storage."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def dcp_to_torch_save(path: PathLike, torch_save_path: str | os.PathLike, *,
                      storage_options: dict | None = None) -> None:
    """``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` for a safeckpt
    checkpoint (DCP's own reads only ``FileSystemWriter`` folders): the whole state, one
    process, as a ``torch.save`` file."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=Reader(path, storage_options=storage_options),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    torch.save(state, torch_save_path)
