"""Which tensors of a state can take saved values in place: memory shared between the
elements of one tensor, or between two tensors.

A load copies each saved tensor into the state's tensor. Where two elements of one
target share memory (an ``expand()``ed view, an overlapping ``as_strided`` one) the
copy cannot give each its own value: torch's ``copy_`` refuses it, or the last write
wins. Where two targets share memory, each copy overwrites part of the other, which is
right only when both are one tensor saved as a tie. The load planner asks here before
anything is read, so such a state is refused untouched.

Shared memory is decided exactly: first by the byte spans of the tensors (sorted once
for the whole state: the common case, nothing shared, costs a few numpy operations),
then, for the rare views whose spans meet without sharing a byte (columns of one
matrix), by their runs of contiguous bytes.
"""

from __future__ import annotations

import heapq
import math
from typing import Hashable, Sequence

import numpy as np
import torch

#: runs of contiguous bytes enumerated for one tensor at most; a tensor with more (a
#: large view with no two elements adjacent) is taken as sharing memory (refused, with a
#: remedy: ``.clone()``)
ENUMERABLE = 1 << 22


def _dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """(stride, size) of each dimension that has more than one element, by stride."""
    return sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1)


def _nested(t: torch.Tensor) -> bool:
    """Whether each stride of ``t`` passes every element the smaller strides reach, so no
    two of its elements share memory (a view with gaps passes; ``expand()`` does not)."""
    reach = 0
    for stride, size in _dims(t):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def _runs(t: torch.Tensor) -> tuple[np.ndarray, int] | None:
    """The start addresses of ``t``'s runs of contiguous bytes, and their length in bytes
    (its innermost contiguous dimensions make one run); None for more than ``ENUMERABLE``."""
    dims = _dims(t)
    run, inner = 1, 0  # elements per run, dimensions in it
    while inner < len(dims) and dims[inner][0] == run:
        run *= dims[inner][1]
        inner += 1
    outer = dims[inner:]
    if math.prod(size for _, size in outer) > ENUMERABLE:
        return None
    starts = np.zeros(1, dtype=np.int64)
    for stride, size in outer:
        starts = (starts[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
    item = t.element_size()
    return starts * item + t.data_ptr(), run * item


def _meet(starts: np.ndarray, ends: np.ndarray) -> bool:
    """Whether any two of the byte ranges [starts, ends) meet."""
    order = np.argsort(starts, kind="stable")
    return bool(np.any(starts[order][1:] < np.maximum.accumulate(ends[order])[:-1]))


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (or may: see ``ENUMERABLE``)."""
    if t.is_contiguous() or t.numel() < 2 or t.is_meta or _nested(t):
        return False
    runs = _runs(t)
    if runs is None:
        return True
    starts, length = runs
    return _meet(starts, starts + length)


def _shares(a: torch.Tensor, b: torch.Tensor, span_a: int, span_b: int) -> bool:
    """Whether ``a`` and ``b`` (neither overlapping itself), whose spans meet, share
    memory: at once when each fills its span, else by their runs."""
    if a.device != b.device:
        return False
    if span_a == a.nbytes and span_b == b.nbytes:
        return True
    runs_a, runs_b = _runs(a), _runs(b)
    if runs_a is None or runs_b is None:
        return True
    starts = np.concatenate((runs_a[0], runs_b[0]))
    return _meet(starts, starts + np.repeat([runs_a[1], runs_b[1]], [runs_a[0].size, runs_b[0].size]))


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (0 when empty, or a meta
    tensor, which has no memory: loading into it does nothing)."""
    if t.numel() == 0 or t.is_meta:
        return 0
    if t.is_contiguous():
        return t.nbytes
    return t.element_size() * (1 + sum(stride * (size - 1) for size, stride in zip(t.shape, t.stride())))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device) == (b.data_ptr(), b.shape, b.stride(), b.dtype,
                                                                      b.device)


def sharing(tensors: Sequence[torch.Tensor], ties: Sequence[Hashable]) -> list[tuple[int, int]]:
    """The pairs (by index) of ``tensors`` (none overlapping itself) that share memory,
    except a pair that is the same view of one memory with equal ``ties`` values (one
    saved tensor, tied).

    The tensors' byte spans, sorted by start, fall into runs that meet (a tensor starting
    before an earlier one ended); only runs of two or more are swept pair by pair."""
    n = len(tensors)
    if n < 2:
        return []
    starts = np.fromiter((t.data_ptr() for t in tensors), np.int64, n)
    spans = np.fromiter((_extent(t) for t in tensors), np.int64, n)
    order = np.argsort(starts, kind="stable")
    order = order[spans[order] > 0]
    if order.size < 2:
        return []
    begin = starts[order]
    reach = np.maximum.accumulate(begin + spans[order])  # the furthest end of any tensor so far
    group = np.cumsum(np.concatenate(([True], begin[1:] >= reach[:-1])))
    found = []
    active: list[tuple[int, int]] = []  # (end, index) of the tensors the sweep is inside
    for i in order[np.bincount(group)[group] > 1].tolist():
        while active and active[0][0] <= starts[i]:
            heapq.heappop(active)
        for _, j in active:
            a, b = tensors[j], tensors[i]
            if _shares(a, b, int(spans[j]), int(spans[i])) and not (_same_view(a, b) and ties[j] == ties[i]):
                found.append((min(i, j), max(i, j)))
        heapq.heappush(active, (int(starts[i] + spans[i]), i))
    return found
