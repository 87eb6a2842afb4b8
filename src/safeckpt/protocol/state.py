"""From a user's state to named pieces and back.

Saving: ``flatten`` walks the state, replaces objects that have ``state_dict()`` by
their state, turns every tensor into a named piece (a whole replicated tensor, a
``Shard``/DTensor box, or a rank-local tensor) and encodes everything else with the
restricted codec. Loading: ``LoadPlanner`` matches the state to load into against the
saved tree *before reading anything*, so a mismatch leaves the state untouched; it
returns the reads to do and a ``build`` step that puts the results in place.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from ..format import codec
from ..errors import StateMismatchError, UnsafeObjectError
from ..format.compact import TableEntry
from ..format.manifest import TensorEntry
from ..format.plan import Box, PieceInfo
from .shards import RankLocal, Shard, dtensor_box, is_dtensor, is_sharded_tensor, sharded_tensor_box
from .targets import overlaps_itself, sharing
from ..format.tensors import DTYPE_NAMES, dtype_from_name, dtype_name, is_storable, to_storable


_PLAIN_TENSORS = {torch.Tensor, torch.nn.Parameter}  # tensors that are not DTensors or shards


def is_stateful(obj: Any) -> bool:
    """Objects saved as their ``state_dict()`` and loaded with ``load_state_dict``."""
    return (not isinstance(obj, (torch.Tensor, dict, list, tuple, type, Shard, RankLocal))
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


@dataclass
class Piece:
    """A tensor (or part of one) this rank holds, with its description."""

    tensor: torch.Tensor
    info: PieceInfo


@dataclass
class FlatState:
    """A state as the manifest's tree plus its pieces, each name once per rank."""

    tree: Any
    pieces: dict[str, Piece]
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> first name
    has_local: bool = False  # holds RankLocal values


def local_name(key: str, rank: int) -> str:
    """The manifest name of a rank-local tensor."""
    return f"{key}@{rank}"


def view_key(t: torch.Tensor, kind: str, offsets: Sequence[int]) -> tuple:
    """What makes two tensors the same stored piece: the same view of the same memory."""
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.is_conj(), t.is_neg(), kind,
            tuple(offsets))


@dataclass
class Walk:
    """A state walked once: the manifest's tree and every tensor in it, in order, with
    its name (the first half of ``flatten``). An async save by one process does no more
    per tensor while its caller waits (``protocol.arena``)."""

    tree: Any  # its tensors are ``{"$tensor": name}``, or all one ``UNNAMED`` (``named_tree``)
    names: list[str]
    tensors: list[torch.Tensor]
    boxes: dict[int, tuple[str, Any]]  # tensor index -> (kind, (global shape, offsets) or None): not replicated
    has_local: bool = False
    named: bool = True

    def named_tree(self) -> Any:
        """The tree with every tensor's name in its reference."""
        return self.tree if self.named else name_tensors(self.tree, self.names)


UNNAMED = {"$tensor": None}  # the one reference every tensor of an unnamed walk leaves in its tree


def name_tensors(tree: Any, names: list[str]) -> Any:
    """A tree whose ``UNNAMED`` references (any dict equal to it) are replaced by
    ``{"$tensor": name}``, the names in the order ``walk`` met the tensors: the order of
    the tree's dict values and list items, depth first."""
    order = iter(names)

    def fill(node: Any) -> Any:
        if type(node) is dict:
            if len(node) == 1 and node.get("$tensor", "") is None:
                return {"$tensor": next(order)}
            return {k: fill(v) for k, v in node.items()}
        if type(node) is list:
            return [fill(v) for v in node]
        return node

    return fill(tree) if names else tree


def walk(state: dict, allow_pickle: bool = False, rank: int = 0, named: bool = True) -> Walk:
    """Walk ``state``: objects with ``state_dict()`` are replaced by their state, every
    tensor is recorded (a ``Shard``/DTensor box, a rank-local tensor or a whole one) and
    everything else is encoded with the restricted codec, which refuses what it cannot
    encode. Not ``named``: every tensor leaves the same ``UNNAMED`` reference in the tree
    (no object per tensor, and a small pickle: an async save hands the tree over)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, not {type(state).__name__}")
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    boxes: dict[int, tuple[str, Any]] = {}
    name_of, tensor_of = names.append, tensors.append
    has_local = False

    def add(name: str, t: torch.Tensor) -> dict:
        """The codec's ``on_tensor``: a whole tensor, or the tensor of a box just recorded."""
        name_of(name)
        tensor_of(t)
        return {"$tensor": name} if named else UNNAMED

    def add_box(name: str, t: torch.Tensor, kind: str, box: Any = None) -> dict:
        boxes[len(names)] = (kind, box)
        return add(name, t)

    def on_local_tensor(key: str, t: torch.Tensor) -> dict:
        return add_box(local_name(key, rank), t, "local")

    def on_object(key: str, value: Any, local: bool = False) -> Any:
        if isinstance(value, RankLocal):
            if local:
                raise UnsafeObjectError(f"{key}: RankLocal values cannot be nested")
            nonlocal has_local
            has_local = True
            inner = codec.encode(value.value, key, on_local_tensor,
                                 lambda k, v: on_object(k, v, True), allow_pickle)
            return codec.Encoded({"$local": inner})
        if isinstance(value, Shard) or is_dtensor(value) or is_sharded_tensor(value):
            if local:
                raise UnsafeObjectError(f"{key}: a Shard or DTensor cannot be inside RankLocal")
            if isinstance(value, Shard):
                t, shape, offsets = value.local_tensor, list(value.global_shape), list(value.offsets)
            elif is_dtensor(value):
                t, shape, offsets = dtensor_box(value)
            else:
                box = sharded_tensor_box(value)
                if box is None:  # this rank holds no part of it
                    return codec.Encoded({"$tensor": key})
                t, shape, offsets = box
            return codec.Encoded(add_box(key, t, "shard", (tuple(shape), tuple(offsets))))
        return value.state_dict() if is_stateful(value) else value

    tree = codec.encode(state, "", add, on_object, allow_pickle)
    return Walk(tree, names, tensors, boxes, has_local, named)


def flatten(state: dict, allow_pickle: bool = False, rank: int = 0) -> FlatState:
    """``walk`` the state, then make each tensor a named piece (``pieces_of``)."""
    return pieces_of(walk(state, allow_pickle, rank))


def pieces_of(walked: Walk) -> FlatState:
    """The pieces of a walked state; tensors that are the same view of the same memory
    are stored once. Ties are found by address first (one ``data_ptr`` and one dict
    lookup per tensor): only tensors whose memory starts where another's does are
    compared by their whole view (``view_key``)."""
    pieces: dict[str, Piece] = {}
    aliases: dict[str, str] = {}
    first_at: dict[int, str] = {}  # address -> the first piece with bytes that starts there
    views: dict[tuple, str] = {}   # view key -> piece, for addresses several tensors start at
    shared: set[int] = set()       # those addresses
    dtype_names, new_info = DTYPE_NAMES, tuple.__new__  # PieceInfo._make without its checks: 20% of a piece
    boxes, whole = walked.boxes, ("replicated", None)
    for i, (name, t) in enumerate(zip(walked.names, walked.tensors)):
        if name in pieces or name in aliases:
            raise UnsafeObjectError(f"two tensors in the state are both named {name!r}; rename one of the keys")
        if not is_storable(t):
            to_storable(t, name)  # raises the clear error
        kind, box = boxes.get(i, whole) if boxes else whole
        shape = t.shape  # a torch.Size: a tuple, made once
        global_shape, offsets = (shape, (0,) * len(shape)) if box is None else box
        nbytes = t.nbytes
        if nbytes:
            address = t.data_ptr()
            first = first_at.setdefault(address, name)
            if first != name:  # memory another tensor starts at: compare whole views
                if address not in shared:
                    shared.add(address)
                    info = pieces[first].info
                    views[view_key(pieces[first].tensor, info.kind, info.offsets)] = first
                tied = views.setdefault(view_key(t, kind, offsets), name)
                if tied != name:
                    aliases[name] = tied
                    continue
        dtype = t.dtype
        pieces[name] = Piece(t, new_info(PieceInfo, (name, kind, dtype_names.get(dtype) or dtype_name(dtype),
                                                     global_shape, offsets, shape, nbytes)))
    if walked.has_local:  # a rank-local subtree was encoded from depth 0 by the hook: check the whole tree
        codec.check_tree(walked.named_tree(), "cannot save the state", pieces.keys() | aliases.keys(),
                         rank_tree=True, error=UnsafeObjectError)
    return FlatState(walked.tree, pieces, aliases, walked.has_local)


@dataclass
class Read:
    """Fill ``dest`` (in place; it holds ``box`` of the tensor) or a new full tensor."""

    name: str
    entry: TensorEntry | TableEntry
    dest: torch.Tensor | None
    box: Box | None = None
    result: torch.Tensor | None = None


Thunk = Callable[[], Any]


def _target_box(target: Any) -> tuple[torch.Tensor, list[int], Box] | None:
    """(local tensor, global shape, box) of a tensor-like load target."""
    if isinstance(target, Shard):
        t = target.local_tensor
        return t, list(target.global_shape), (tuple(target.offsets), tuple(t.shape))
    if is_dtensor(target):
        t, shape, offsets = dtensor_box(target)
        return t, shape, (tuple(offsets), tuple(t.shape))
    if is_sharded_tensor(target):
        box = sharded_tensor_box(target)
        if box is None:  # nothing of it on this rank: an empty box
            return None
        t, shape, offsets = box
        return t, shape, (tuple(offsets), tuple(t.shape))
    if isinstance(target, torch.Tensor):
        return target, list(target.shape), _whole(target)
    return None


def _whole(t: torch.Tensor) -> Box:
    return (0,) * t.dim(), tuple(t.shape)


def _fits(local: torch.Tensor, global_shape: Sequence[int], entry: TensorEntry | TableEntry, where: str) -> bool:
    """A target holding ``local`` of a tensor of ``global_shape`` loads ``entry`` in place:
    the same shape and dtype."""
    return list(global_shape) == entry.shape and local.dtype == dtype_from_name(entry.dtype, where)


class LoadPlanner:
    """Matches a target state against a saved tree (see module docstring).

    Modes: ``"state"`` (the user's containers and ``nn.Module`` states: keys must
    match), ``"object"`` (the state of another stateful object such as an optimizer:
    the checkpoint's structure wins, the object's ``load_state_dict`` validates it)."""

    def __init__(self, tensors: Mapping[str, TensorEntry | TableEntry], strict: bool, allow_pickle: bool,
                 rank: int = 0, world_size: int = 1) -> None:
        self.tensors = tensors
        self.strict = strict
        self.allow_pickle = allow_pickle
        self.rank = rank
        self.world_size = world_size
        self.reads: list[Read] = []
        self.problems: list[str] = []  # one line per problem, "key: what"
        self.keys: list[str] = []      # the key of each problem, in the same order
        self.missing: list[str] = []   # keys in the state the checkpoint lacks
        self.unexpected: list[str] = []  # keys in the checkpoint the state lacks
        self.shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # key -> (state, checkpoint)
        self.dtypes: dict[str, tuple[torch.dtype, torch.dtype]] = {}          # key -> (state, checkpoint)
        self.early: list[tuple[Any, Thunk, str]] = []  # objects loaded before any tensor is read
        self._loaded: list[tuple[Any, Any]] = []  # (object, its state before) for undo()

    def plan(self, target: Any, node: Any, key: str = "", mode: str = "state") -> Thunk:
        if type(node) is dict and (target is None or (type(target) is dict and mode == "state")):
            tag = codec.tag_of(node)  # the common cases, decided fast: a plain dict or a fresh value
            if tag in ("object", "$dict", "$odict"):
                if target is None:
                    return self._plan_container_fresh(target, node, key, tag)
                return self._plan_container_into(target, node, key, tag)
            if tag == "$tensor" and target is None:
                return self._fresh_tensor(node, key)
        if type(target) in _PLAIN_TENSORS and codec.tag_of(node) != "$local":
            shape = target.shape
            boxed = (target, list(shape), ((0,) * len(shape), tuple(shape)))
            return self._plan_tensor_into(target, boxed, node, key, mode)
        tag = codec.tag_of(node)
        if tag == "$local" or isinstance(target, RankLocal):
            return self._plan_local(target, node, key, mode)
        if is_stateful(target):
            return self._plan_object(target, node, key)
        found = _target_box(target)
        if found is not None:
            return self._plan_tensor_into(target, found, node, key, mode)
        if is_sharded_tensor(target) and tag == "$tensor":
            return lambda: target  # a ShardedTensor with no shard on this rank: nothing to read
        if tag == "$tensor":
            if isinstance(target, (dict, list, tuple)):
                self._report(key, f"the state has a {type(target).__name__}, the checkpoint a tensor")
                return lambda: target
            return self._fresh_tensor(node, key)
        if tag in ("$set", "$frozenset"):
            value = codec.decode_set(node, key, self.allow_pickle)  # decoded now: errors before reads
            return lambda: value
        if tag is None:
            if isinstance(target, (dict, list, tuple)):
                self._report(key, f"the state has a {type(target).__name__}, the checkpoint a plain value")
                return lambda: target
            value = codec.decode_leaf(node, key, self.allow_pickle)
            return lambda: value
        if isinstance(target, (dict, list, tuple)) and mode == "state":
            return self._plan_container_into(target, node, key, tag)
        return self._plan_container_fresh(target, node, key, tag)

    def _report(self, key: str, what: str) -> None:
        self.keys.append(key or "<root>")
        self.problems.append(f"{key or '<root>'}: {what}")

    def error(self, message: str) -> "StateMismatchError":
        """The mismatch as a ``StateMismatchError`` carrying every offending key."""
        return StateMismatchError(message, problems=self.problems, keys=self.keys, missing=self.missing,
                                  unexpected=self.unexpected, shapes=self.shapes, dtypes=self.dtypes)

    def _plan_local(self, target: Any, node: Any, key: str, mode: str) -> Thunk:
        inner_target = target.value if isinstance(target, RankLocal) else target
        if codec.tag_of(node) != "$local":
            self._report(key, "rank-local in the state, but saved as a shared value")
            return lambda: target
        per_rank = node["$local"]
        if target is None and self.world_size == 1:  # load_state: every rank's value, by rank
            thunks = [self.plan(None, n, key, "object") for n in per_rank]
            return lambda: [th() for th in thunks]
        if len(per_rank) != self.world_size:
            self._report(key, f"rank-local value saved by {len(per_rank)} ranks cannot be restored on "
                              f"{self.world_size}; pass strict=False to keep the current value")
            return lambda: target
        inner = self.plan(inner_target, per_rank[self.rank], key, mode)
        if not isinstance(target, RankLocal):
            return inner

        def build() -> Any:
            target.value = inner()
            return target
        return build

    def _entry(self, node: dict, key: str) -> TensorEntry | TableEntry | None:
        entry = self.tensors.get(node["$tensor"])
        if entry is None:
            self._report(key, f"the checkpoint's tree names tensor {node['$tensor']!r} but has no data for it")
        return entry

    def _fresh_tensor(self, node: dict, key: str) -> Thunk:
        entry = self._entry(node, key)
        if entry is None:
            return lambda: None
        read = Read(node["$tensor"], entry, None)
        self.reads.append(read)
        return lambda: read.result

    def _plan_tensor_into(self, target: Any, boxed: tuple, node: Any, key: str, mode: str) -> Thunk:
        local, global_shape, box = boxed
        if codec.tag_of(node) != "$tensor":
            self._report(key, f"the state has a tensor, the checkpoint a {describe(node)}")
            return lambda: target
        entry = self._entry(node, key)
        if entry is None:
            return lambda: target
        fits = _fits(local, global_shape, entry, key)
        overlapping = fits and overlaps_itself(local)
        if fits and not overlapping:
            self.reads.append(Read(node["$tensor"], entry, local, box))
            return lambda: target
        if mode == "object" and isinstance(target, torch.Tensor):
            return self._fresh_tensor(node, key)  # the checkpoint's tensor replaces the object's
        if overlapping:
            self._report(key, "the state's tensor has elements that share memory (an expand()ed or overlapping "
                              "as_strided view), which cannot each take a saved value; load into a tensor with "
                              "memory of its own (.clone())")
            return lambda: target
        dtype = dtype_from_name(entry.dtype, key)
        if tuple(global_shape) != tuple(entry.shape):
            self.shapes[key] = (tuple(global_shape), tuple(entry.shape))
        if local.dtype != dtype:
            self.dtypes[key] = (local.dtype, dtype)
        self._report(key, f"the state has {tuple(global_shape)} {local.dtype}, the checkpoint {tuple(entry.shape)} {dtype}")
        return lambda: target

    def _plan_container_into(self, target: dict | list | tuple, node: Any, key: str, tag: str) -> Thunk:
        if (tag in ("object", "$dict", "$odict")) != isinstance(target, dict):
            self._report(key, f"the state has a {type(target).__name__}, the checkpoint a {describe(node)}")
            return lambda: target
        saved = node if tag == "object" else dict(codec.items_of(node, key, self.allow_pickle))
        current = target if isinstance(target, dict) else dict(enumerate(target))
        children = {k: self.plan(v, saved[k], codec.child_key(key, k)) for k, v in current.items()
                    if k in saved and not (type(v) in _PLAIN_TENSORS and self._read_in_place(v, saved[k]))}
        if current.keys() != saved.keys():
            for k in (k for k in current if k not in saved):
                self.missing.append(codec.child_key(key, k))
                self._report(codec.child_key(key, k), "missing from the checkpoint")
            for k in (k for k in saved if k not in current):
                self.unexpected.append(codec.child_key(key, k))
                self._report(codec.child_key(key, k), "in the checkpoint but not in the state")
        if not children:  # every value read in place (or none): nothing to put back
            return lambda: target

        def build() -> Any:
            values = {k: th() for k, th in children.items()}
            if isinstance(target, tuple):
                merged = [(i, values.get(i, v)) for i, v in enumerate(target)]
                return codec.build_container("$size" if isinstance(target, torch.Size) else "$tuple", merged)
            for k, v in values.items():
                target[k] = v
            return target
        return build

    def _read_in_place(self, target: torch.Tensor, node: Any) -> bool:
        """Plan the common case, a plain tensor saved with its shape and dtype, without a
        key or a thunk (it is read in place: nothing to build); anything else is left to
        ``plan``, which reports it."""
        name = node.get("$tensor") if type(node) is dict and len(node) == 1 else None
        if not isinstance(name, str):
            return False
        entry = self.tensors.get(name)
        if entry is None or not _fits(target, target.shape, entry, name) or overlaps_itself(target):
            return False
        self.reads.append(Read(name, entry, target))
        return True

    def refuse_shared_memory(self, tie_of: Callable[[str, TensorEntry | TableEntry], tuple]) -> None:
        """Report (and drop the reads of) tensors of the state that share memory, unless
        they are one view of one memory and the checkpoint holds them as one tensor saved
        as a tie (``tie_of``: ``Manifest.tie_of``): each would get part of the other's
        values. Called once the state is planned, before anything is read."""
        reads, dests = [], []
        for r in self.reads:
            if r.dest is not None:
                reads.append(r)
                dests.append(r.dest)
        ties = [(tie_of(r.name, r.entry), r.box or _whole(d)) for r, d in zip(reads, dests)]
        partners: dict[int, list[str]] = {}
        for i, j in sharing(dests, ties):
            partners.setdefault(i, []).append(reads[j].name)
            partners.setdefault(j, []).append(reads[i].name)
        for i, names in sorted(partners.items()):
            self._report(reads[i].name, f"shares memory with the state's {', '.join(map(repr, names))}, but the "
                                        "checkpoint holds them as different tensors (not one tensor saved as a tie), "
                                        "so each would get part of the other's values; load into tensors with "
                                        "memory of their own (.clone())")
        if partners:
            dropped = {id(reads[i]) for i in partners}
            self.reads = [r for r in self.reads if id(r) not in dropped]

    def _plan_container_fresh(self, target: Any, node: Any, key: str, tag: str) -> Thunk:
        current: dict = {}
        if isinstance(target, dict):
            current = dict(target)
        elif isinstance(target, (list, tuple)):
            current = dict(enumerate(target))
        children = [(k, self.plan(current.get(k), child, codec.child_key(key, k), "object"))
                    for k, child in codec.items_of(node, key, self.allow_pickle)]
        return lambda: codec.build_container(tag, [(k, th()) for k, th in children])

    def _plan_object(self, target: Any, node: Any, key: str) -> Thunk:
        is_module = isinstance(target, torch.nn.Module)
        current = target.state_dict()
        if is_module and type(target).load_state_dict is not torch.nn.Module.load_state_dict:
            # its own load_state_dict decides (a buffer it resizes, keys it renames): it gets
            # the checkpoint's state as saved, tensors of the same shape and dtype read in place
            inner = self.plan(current, node, key, "object")

            def build_own() -> Any:
                self._load_object(target, _with_metadata(inner(), current), key, is_module)
                return target
            return build_own
        if isinstance(target, torch.optim.Optimizer):
            problem = _param_groups_problem(current, node, key, self.allow_pickle)
            if problem:
                self._report(key, problem.removeprefix(f"{key}: "))
                return lambda: target
            self._shape_like_params(target, current, node, key)
        reads = len(self.reads)
        inner = self.plan(current, node, key, "state" if is_module else "object")
        if not is_module and not isinstance(target, torch.optim.Optimizer) and len(self.reads) == reads:
            self.early.append((target, inner, key))  # nothing to read: its own check runs first
            return lambda: target

        def build() -> Any:
            self._load_object(target, inner(), key, is_module)
            return target
        return build

    def _load_object(self, target: Any, value: Any, key: str, is_module: bool = False) -> None:
        try:
            if is_module:
                target.load_state_dict(value, strict=self.strict)
            else:
                target.load_state_dict(value)
        except Exception as exc:  # the object's own validation: report it as a mismatch
            raise StateMismatchError(
                f"{key or '<root>'}: {type(target).__name__}.load_state_dict rejected the "
                f"checkpoint's state: {exc}") from exc

    def load_early(self) -> None:
        """Load the objects whose saved state holds no tensor (schedulers, grad scalers,
        counters) before anything is read: the checks in their own ``load_state_dict``
        then run while the state is untouched, and what they refuse is undone."""
        try:
            for target, inner, key in self.early:
                before = copy.deepcopy(target.state_dict())
                self._load_object(target, inner(), key)
                self._loaded.append((target, before))
        except BaseException:
            self.undo()
            raise

    def undo(self) -> None:
        """Put back the state of the objects ``load_early`` loaded (a later failure)."""
        while self._loaded:
            target, before = self._loaded.pop()
            try:
                target.load_state_dict(before)
            except Exception:  # noqa: BLE001 - it took this state before; best effort
                pass


    def _shape_like_params(self, optimizer: Any, current: dict, node: Any, key: str) -> None:
        """State the optimizer does not have yet (a fresh optimizer) is read into tensors
        laid out like its parameters when those are DTensors, so sharded (FSDP2)
        optimizer state comes back sharded instead of as full tensors."""
        groups = zip(current["param_groups"], optimizer.param_groups)
        params = {i: p for saved, live in groups for i, p in zip(saved["params"], live["params"])}
        saved_state = dict(codec.items_of(node, key, self.allow_pickle)).get("state")
        if saved_state is None or codec.tag_of(saved_state) not in ("object", "$dict"):
            return
        for index, per_param in codec.items_of(saved_state, key, self.allow_pickle):
            param = params.get(index)
            if param is None or not is_dtensor(param) or index in current["state"] or codec.tag_of(per_param) not in ("object", "$dict"):
                continue
            hints = {}
            for name, ref in codec.items_of(per_param, key, self.allow_pickle):
                entry = self.tensors.get(ref["$tensor"]) if codec.tag_of(ref) == "$tensor" else None
                if entry is not None and entry.shape == list(param.shape):
                    hints[name] = torch.zeros_like(param, dtype=dtype_from_name(entry.dtype, key))
            current["state"][index] = hints


def _with_metadata(value: Any, current: Any) -> Any:
    """``value`` as an ordered dict carrying the module's ``_metadata`` (the per-module
    versions ``Module.load_state_dict`` reads), as ``state_dict()`` gives it."""
    metadata = getattr(current, "_metadata", None)
    if metadata is None or not isinstance(value, dict):
        return value
    out = value if isinstance(value, OrderedDict) else OrderedDict(value)
    out._metadata = metadata  # type: ignore[attr-defined]
    return out


def _group_sizes(groups: Any) -> list[int]:
    return [len(g["params"]) for g in groups]


def _param_groups_problem(current: dict, node: Any, key: str, allow_pickle: bool) -> str | None:
    """An optimizer's parameter groups must match before anything is read (its own
    ``load_state_dict`` would only complain after the rest of the state was loaded)."""
    saved = dict(codec.items_of(node, key, allow_pickle)) if codec.tag_of(node) in ("object", "$dict") else {}
    groups = saved.get("param_groups")
    if groups is None or codec.tag_of(groups) != "list":
        return f"{key}: the checkpoint holds no optimizer state (no param_groups)"
    try:
        saved_sizes = [len(codec.decode_value(dict(codec.items_of(g, key, allow_pickle))["params"], key))
                       for g in groups]
    except (KeyError, TypeError):
        return f"{key}: the checkpoint's param_groups are malformed"
    if saved_sizes != _group_sizes(current["param_groups"]):
        return (f"{key}: the checkpoint's optimizer has parameter groups of sizes {saved_sizes}, "
                f"this optimizer {_group_sizes(current['param_groups'])}")
    return None


def describe(node: Any) -> str:
    """A short description of an encoded node for mismatch messages."""
    tag = codec.tag_of(node)
    return {"object": "dict", "$dict": "dict", "$odict": "dict", "list": "list", "$tuple": "tuple",
            "$tensor": "tensor", "$local": "rank-local value", None: "plain value"}.get(tag, tag or "value")
