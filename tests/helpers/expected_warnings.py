"""Warnings a test expects only in some runs (a crash may or may not tear a newer
manifest): record them, check each is the expected one, so the suite prints none and a
new warning still fails the test."""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Iterator

# read_committed falling back past a newer manifest a crash tore
FALLBACK = re.compile(r"using manifest-\d+\.json; skipped newer manifests: ")


@contextlib.contextmanager
def only(pattern: re.Pattern = FALLBACK) -> Iterator[list[warnings.WarningMessage]]:
    """Record every warning in the block; fail on any that does not match ``pattern``.
    The caller may assert on the list (e.g. that one was given when expected)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    unexpected = [str(w.message) for w in caught if not pattern.search(str(w.message))]
    assert not unexpected, f"unexpected warning(s): {unexpected}"
