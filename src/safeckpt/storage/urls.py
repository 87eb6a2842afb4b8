"""What a location string names: a URL of some scheme, or a plain local path."""

from __future__ import annotations

import re

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(text: str) -> str | None:
    """The scheme of a URL (``"s3"`` for ``s3://bucket/key``), None for a plain path."""
    m = _SCHEME.match(text)
    return m.group(1).lower() if m else None


def is_remote(text: str) -> bool:
    """A URL of a backend other than the local filesystem."""
    return url_scheme(text) not in (None, "file")
