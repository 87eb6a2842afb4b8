"""Plan once: a save whose layout equals the job's previous save reuses its plan.

Phase 1 of a save gathers every rank's pieces on rank 0, which checks them (shapes,
shards tiling their tensors), assigns writers balanced by bytes, and after the writes
builds the manifest's tensor table from the plan. A training job saves the same layout
again and again, so each rank keeps what it planned under a key of its own *layout*
(its pieces' names, kinds, dtypes, shapes and boxes, its ties, its rank, the world
size, the format version and the folder the saves go into), with the plan's id. The
next save sends rank 0 only that id -- or nothing, when its layout changed -- with a
digest of its tree of values; when every rank names the same plan, rank 0 skips the
gather of every rank's pieces and the planning, and fills the previous save's table
with this save's byte ranges and checksums. Any difference on any rank makes every rank
plan in full, as without the cache.

What depends on the save and is never kept: the save id and sequence (so the data
file names), the step, the tree's values (rank-local ones travel in the probe), and
every byte range and checksum. The cache lives on the process group the saves run on
(``TorchGroup.plans``): one job's saves (a manager, its background saver, plain
``save`` calls on one group) and never another job's; a new world makes new groups.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ..format.checksum import checksum
from ..format.compact import Checksums, TensorTable
from ..format.manifest import WRITE_VERSION
from ..format.pieces import PieceColumns
from ..format.plan import WritePlan

KEPT_PLANS = 4  # layouts kept per group: a job that saves several kinds of state alternates


def layout_key(where: str, pieces: PieceColumns, aliases: dict[str, str], rank: int, world: int) -> str:
    """What a rank's part of a plan depends on, as one digest: its pieces (not their
    values), its ties, its place in the world, the format written, and the folder the
    saves go into (without the save's own folder: a manager's step folders share it)."""
    parts = [json.dumps([where.rsplit("/", 1)[0], rank, world, WRITE_VERSION, pieces.dtypes,
                         sorted(aliases.items())]).encode(), "\0".join(pieces.names).encode()]
    parts += [np.ascontiguousarray(a).tobytes() for a in (pieces.kind, pieces.dtype, pieces.ndim, pieces.global_shape,
                                                           pieces.offsets, pieces.shape, pieces.nbytes)]
    return checksum(b"\1".join(parts), "xxh3_128")


def split_locals(tree: Any) -> tuple[Any, list[Any]]:
    """``tree`` with every rank-local value (``{"$local": x}``) blanked, and those
    values in the order of a walk: equal blanked trees on every rank mean equal shared
    values, and the blanks are filled from every rank's values (``fill_locals``)."""
    values: list[Any] = []

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if node.keys() == {"$local"}:
                values.append(node["$local"])
                return {"$local": None}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return walk(tree), values


def fill_locals(blank: Any, per_rank: list[list[Any]]) -> Any:
    """The merged tree of ``split_locals``'s blank and every rank's values: each blank
    holds the list of the ranks' values, as ``commit.merge_trees`` makes it."""
    at = iter(range(len(per_rank[0]) if per_rank else 0))

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if node.keys() == {"$local"}:
                k = next(at)
                return {"$local": [values[k] for values in per_rank]}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return walk(blank)


def tree_digest(blank: Any) -> str:
    return checksum(json.dumps(blank, separators=(",", ":")).encode(), "xxh3_128")


@dataclass
class Probe:
    """Phase 1 of a save when the group keeps plans: every rank to rank 0."""

    url: str
    step: int | None
    plan: str | None  # the id of the plan this rank's unchanged layout was part of
    tree: str  # digest of the tree with rank-local values blanked
    values: list[Any] | None  # the rank-local values, when the tree holds any
    error: str | None = None


@dataclass
class Planned:
    """What a rank keeps of a plan: its id and the pieces this rank writes; rank 0 also
    the plan, every rank's ties (as ``Intent``s without pieces) and, once a save of it
    built one, the tensor table with, per chunk row, the reported piece it holds."""

    plan_id: str
    write: list[str]
    plan: WritePlan | None = None
    intents: list[Any] = field(default_factory=list)
    table: TensorTable | None = None
    source: np.ndarray | None = None
    counts: list[int] | None = None  # pieces each rank writes
    start: np.ndarray | None = None  # the reported byte ranges the table holds, rank after rank
    end: np.ndarray | None = None

    def keep(self, table: TensorTable, source: np.ndarray, counts: list[int], start: np.ndarray,
             end: np.ndarray) -> None:
        """Keep the table a save of this plan built: row ``j`` holds the reported piece
        ``source[j]`` (rank after rank, each rank's in its file's order). The plan's
        pieces are no longer needed."""
        self.table, self.source, self.counts, self.start, self.end, self.plan = table, source, counts, start, end, None

    def refill(self, file_names: list[str], start: np.ndarray, end: np.ndarray, sums: Checksums) -> TensorTable:
        """The kept table with a new save's files, byte ranges and checksums (reported
        rank after rank): the byte ranges of an unchanged layout are, as a rule, the
        same, and then the kept columns are kept too."""
        table, rows = cast(TensorTable, self.table), cast(np.ndarray, self.source)
        if self.start is not None and np.array_equal(start, self.start) and np.array_equal(end, cast(np.ndarray, self.end)):
            return table.refill(file_names, table.c_start, table.c_length, sums.take(rows))
        return table.refill(file_names, start[rows], end[rows] - start[rows], sums.take(rows))


class PlanCache:
    """A group's plans by layout key, the most recent ``KEPT_PLANS``."""

    def __init__(self) -> None:
        self._plans: OrderedDict[str, Planned] = OrderedDict()
        self._lock = threading.Lock()
        self.reused = 0  # saves that reused a kept plan, and that planned in full (or tried to)
        self.planned = 0

    def get(self, key: str) -> Planned | None:
        with self._lock:
            found = self._plans.get(key)
            if found is not None:
                self._plans.move_to_end(key)
            return found

    def put(self, key: str, planned: Planned) -> None:
        with self._lock:
            self._plans[key] = planned
            self._plans.move_to_end(key)
            while len(self._plans) > KEPT_PLANS:
                self._plans.popitem(last=False)


def plans_of(group: Any) -> PlanCache:
    """The plan cache of a group of several ranks, made on first use."""
    with _made:
        if getattr(group, "plans", None) is None:
            group.plans = PlanCache()
        return group.plans


_made = threading.Lock()
