"""Which rank reads which saved bytes for whom, when several ranks need the same ones.

A load on several ranks describes what each rank needs as *spans*: byte ranges of the
checkpoint's files, each a whole checksum block of a chunk (what is read and verified
as one). A span several ranks need -- a replicated tensor under DDP, the replicas of
HSDP, the rows two resharded ranks both overlap -- is read from storage once (per job,
or per node) by one of the ranks that need it, which checks it and sends it to the
others. Pure numpy over the ranks' spans; every rank computes the same plan from the
same input, so the ranks agree on it without another message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checksum import checksum


@dataclass
class Spans:
    """Byte ranges ``start[i]:start[i] + length[i]`` of files ``file[i]`` (positions in
    the manifest's list of files)."""

    file: np.ndarray
    start: np.ndarray
    length: np.ndarray

    @classmethod
    def of(cls, file: list[int], start: list[int], length: list[int]) -> "Spans":
        return cls(np.asarray(file, dtype=np.int64), np.asarray(start, dtype=np.int64),
                   np.asarray(length, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.file)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def digest(self) -> str:
        """Equal for equal lists of spans: ranks compare it before sending whole lists."""
        return checksum(b"".join(a.astype("<i8").tobytes() for a in (self.file, self.start, self.length)),
                        "xxh3_128")


@dataclass
class Needers:
    """Ranks that need the same spans (``spans``): one class per distinct list, or per
    distinct list and node when each node reads for itself (``node``)."""

    spans: Spans
    ranks: list[int]
    node: int = 0


@dataclass
class SharePlan:
    """Who reads what. *Units* are the distinct spans needed (per node, when each node
    reads for itself); each is read by ``reader[u]`` and needed by the ranks of group
    ``group[u]`` (``needers(g)``). *Messages* are runs of adjacent units one reader
    reads with one request and, when others need them, sends in one piece: message
    ``k`` holds units ``units[first[k]:first[k] + count[k]]``, the bytes
    ``start[k]:end[k]`` of ``file[k]``. ``shared`` lists the messages sent to other
    ranks in the order every rank walks them (the readers' bytes interleaved), cut into
    ``windows`` (ranges of ``shared``) of about ``window_bytes`` each."""

    u_file: np.ndarray
    u_start: np.ndarray
    u_length: np.ndarray
    reader: np.ndarray
    group: np.ndarray
    needer_at: np.ndarray  # group g's ranks are needer_ranks[needer_at[g]:needer_at[g + 1]]
    needer_ranks: np.ndarray
    units: np.ndarray
    first: np.ndarray
    count: np.ndarray
    m_reader: np.ndarray
    m_group: np.ndarray
    file: np.ndarray
    start: np.ndarray
    end: np.ndarray
    shared: np.ndarray
    windows: list[tuple[int, int]]

    def needers(self, group: int) -> list[int]:
        return self.needer_ranks[self.needer_at[group]:self.needer_at[group + 1]].tolist()

    def receivers(self, message: int) -> list[int]:
        """The ranks message ``message`` is sent to: those who need it but its reader."""
        reader = int(self.m_reader[message])
        return [r for r in self.needers(int(self.m_group[message])) if r != reader]

    def message_units(self, message: int) -> np.ndarray:
        return self.units[self.first[message]:self.first[message] + self.count[message]]

    @property
    def shared_bytes(self) -> int:
        """Bytes read once and sent to other ranks (each counted once)."""
        return int((self.end[self.shared] - self.start[self.shared]).sum())

    def saved_bytes(self) -> int:
        """Bytes the ranks do not read from storage thanks to the plan."""
        sizes = np.diff(self.needer_at)[self.group]
        return int(((sizes - 1) * self.u_length).sum())

    def private(self, rank: int) -> np.ndarray:
        """The messages ``rank`` reads for itself alone, in file order."""
        alone = np.diff(self.needer_at)[self.m_group] == 1
        return np.flatnonzero(alone & (self.m_reader == rank))


_WEIGHT_SEED = 0x5AFEC6  # the same weights on every rank: a rank set's key is the same everywhere


def plan_sharing(classes: list[Needers], world: int, message_bytes: int, window_bytes: int) -> SharePlan:
    """The plan for ranks whose needs are ``classes`` (every rank in at most one class
    per node): each distinct span a reader among the ranks that need it, the bytes of
    each set of needers split between its members in contiguous runs of about equal
    size (so adjacent small spans stay one request), messages of at most about
    ``message_bytes``."""
    sizes = np.asarray([len(c.spans) for c in classes], dtype=np.int64)
    cls = np.repeat(np.arange(len(classes), dtype=np.int64), sizes)
    cat = lambda name: np.concatenate([getattr(c.spans, name) for c in classes] or [np.zeros(0, np.int64)])  # noqa: E731
    file, start, length = cat("file"), cat("start"), cat("length")
    node = np.asarray([c.node for c in classes] or [0], dtype=np.int64)[cls]
    order = np.lexsort((cls, length, start, file, node))
    file, start, length, node, cls = file[order], start[order], length[order], node[order], cls[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (node[1:] != node[:-1]) | (file[1:] != file[:-1]) | (start[1:] != start[:-1]) | \
              (length[1:] != length[:-1])
    heads = np.flatnonzero(new)
    # a unit's needers: the union of its classes' ranks, keyed by a sum of per-rank
    # random weights (mod 2^64) and their number
    weights = np.random.default_rng(_WEIGHT_SEED).integers(0, 2**63, world, dtype=np.int64).astype(np.uint64)
    class_key = np.asarray([int(weights[c.ranks].sum(dtype=np.uint64)) for c in classes] or [0], dtype=np.uint64)
    class_size = np.asarray([len(c.ranks) for c in classes] or [0], dtype=np.uint64)
    key = np.add.reduceat(class_key[cls], heads) if len(heads) else np.zeros(0, np.uint64)
    size = np.add.reduceat(class_size[cls], heads) if len(heads) else np.zeros(0, np.uint64)
    _, first_unit, group = np.unique(np.stack((key, size), axis=1), axis=0, return_index=True, return_inverse=True)
    group = group.reshape(-1)
    ends = np.append(heads[1:], len(order))
    needer_lists = [sorted(r for c in cls[heads[u]:ends[u]].tolist() for r in classes[c].ranks)
                    for u in first_unit.tolist()]
    needer_at = np.concatenate(([0], np.cumsum([len(n) for n in needer_lists]))).astype(np.int64)
    needer_ranks = np.asarray([r for n in needer_lists for r in n], dtype=np.int64)
    u_file, u_start, u_length = file[heads], start[heads], length[heads]
    reader = _readers(group, u_length, needer_at, needer_ranks)
    return _messages(u_file, u_start, u_length, reader, group, needer_at, needer_ranks, message_bytes,
                     window_bytes)


def _readers(group: np.ndarray, length: np.ndarray, needer_at: np.ndarray, needer_ranks: np.ndarray) -> np.ndarray:
    """Each unit's reader: a group's units (in file order) cut into as many runs of about
    equal bytes as it has needers (a unit goes to the run its middle falls in), run
    ``i`` read by needer ``(i + g) % k`` (the rotation spreads the groups' first runs
    over different ranks)."""
    by_group = np.argsort(group, kind="stable")
    g, nbytes = group[by_group], length[by_group]
    total = np.bincount(g, weights=nbytes.astype(np.float64), minlength=len(needer_at) - 1)
    before = np.cumsum(nbytes) - nbytes
    first_at = np.searchsorted(g, np.arange(len(needer_at) - 1))
    before = before - before[first_at[g]] if len(g) else before
    k = np.diff(needer_at)[g]
    part = np.minimum(k - 1, ((before + nbytes / 2) * k / np.maximum(total[g], 1)).astype(np.int64))
    reader = np.empty(len(group), dtype=np.int64)
    reader[by_group] = needer_ranks[needer_at[g] + (part + g) % k]
    return reader


def _messages(u_file: np.ndarray, u_start: np.ndarray, u_length: np.ndarray, reader: np.ndarray, group: np.ndarray,
              needer_at: np.ndarray, needer_ranks: np.ndarray, message_bytes: int, window_bytes: int) -> SharePlan:
    """Units cut into messages (adjacent bytes, one reader, one set of needers), and
    the order and windows of the shared ones."""
    units = np.lexsort((u_start, u_file, group, reader))
    r, g, f, s, n = reader[units], group[units], u_file[units], u_start[units], u_length[units]
    gap = np.ones(len(units), dtype=bool)
    gap[1:] = (r[1:] != r[:-1]) | (g[1:] != g[:-1]) | (f[1:] != f[:-1]) | (s[1:] != s[:-1] + n[:-1])
    heads = np.flatnonzero(gap)
    part = (s - s[heads][np.cumsum(gap) - 1]) // max(message_bytes, 1)
    new = gap.copy()
    new[1:] |= part[1:] != part[:-1]
    first = np.flatnonzero(new).astype(np.int64)
    count = np.diff(np.append(first, len(units))).astype(np.int64)
    last = first + count - 1
    m_reader, m_group, m_file, m_start, m_end = r[first], g[first], f[first], s[first], s[last] + n[last]
    sent = np.flatnonzero(np.diff(needer_at)[m_group] > 1)
    # every reader's bytes in turn: messages ordered by the bytes their reader sent before
    by_reader = np.argsort(m_reader[sent], kind="stable")
    readers, nbytes = m_reader[sent][by_reader], (m_end - m_start)[sent][by_reader]
    cum = np.cumsum(nbytes) - nbytes
    before = np.empty(len(sent), dtype=np.int64)
    before[by_reader] = cum - cum[np.searchsorted(readers, readers)]
    shared = sent[np.lexsort((m_reader[sent], before))]
    cum = np.cumsum((m_end - m_start)[shared]) - (m_end - m_start)[shared]
    window = cum // max(window_bytes, 1)
    cut = np.flatnonzero(np.concatenate(([True], window[1:] != window[:-1]))) if len(shared) else np.zeros(0, np.int64)
    bounds = np.append(cut, len(shared)).tolist()
    return SharePlan(u_file, u_start, u_length, reader, group, needer_at, needer_ranks, units, first, count,
                     m_reader, m_group, m_file, m_start, m_end, shared, list(zip(bounds, bounds[1:])))
