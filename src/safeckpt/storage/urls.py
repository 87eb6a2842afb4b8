"""What a location string names: a URL of some scheme, or a plain local path."""

from __future__ import annotations

import re

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(text: str) -> str | None:
    """The scheme of a URL (``"s3"`` for ``s3://bucket/key``), None for a plain path."""
    m = _SCHEME.match(text)
    return m.group(1).lower() if m else None


_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs", "adl": "adlfs"}


def install_hint(scheme: str | None) -> str:
    """What to install to open ``scheme://`` URLs: the ``s3`` extra for S3 (s3fs), else
    fsspec and the package that gives it the scheme (gcsfs, adlfs, ...)."""
    if scheme in ("s3", "s3a"):
        return "pip install 'safeckpt[s3]'"
    package = _PACKAGES.get(scheme or "")
    return f"pip install fsspec {package}" if package else f"install fsspec and its package for {scheme}:// URLs"


def is_remote(text: str) -> bool:
    """A URL of a backend other than the local filesystem."""
    return url_scheme(text) not in (None, "file")
