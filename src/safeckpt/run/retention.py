"""Which checkpoints a run keeps: the union of its rules, as a pure function."""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    """``keep_last`` newest, ``keep_best`` by ``best_metric`` (``best_mode`` "min" or
    "max"), and every step that is a multiple of ``keep_every``. A checkpoint is kept
    if any rule keeps it; with no rule at all, everything is kept."""

    keep_last: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best", "keep_every"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")
        if self.keep_best is not None and not self.best_metric:
            raise ValueError("keep_best needs best_metric, the name of a metric passed to save()")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {self.best_mode!r}")

    @property
    def keeps_all(self) -> bool:
        return self.keep_last is None and self.keep_best is None and self.keep_every is None

    def keep(self, metrics: dict[int, dict], protect: AbstractSet[int] = frozenset()) -> set[int]:
        """The steps to keep among committed ``metrics`` (step -> metrics dict). The
        newest step and ``protect`` are always kept."""
        steps = sorted(metrics)
        if self.keeps_all or not steps:
            return set(steps)
        kept = {steps[-1], *protect}
        if self.keep_last is not None:
            kept.update(steps[-self.keep_last:])
        if self.keep_every is not None:
            kept.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best is not None:
            kept.update(self.best(metrics)[:self.keep_best])
        return kept

    def best(self, metrics: dict[int, dict]) -> list[int]:
        """Steps that recorded a number as ``best_metric``, best first (ties: newer first).
        Infinities rank as the extremes they are (a loss of -inf is the lowest); NaN, a
        bool, a string or no value at all never ranks: such a step is kept only by the
        other rules."""
        sign = 1 if self.best_mode == "min" else -1
        scored = [(sign * value, -s, s) for s, m in metrics.items()
                  if isinstance(value := m.get(self.best_metric), (int, float)) and not isinstance(value, bool)
                  and not (isinstance(value, float) and math.isnan(value))]
        return [s for _, _, s in sorted(scored)]
