"""Storage backends behind one small interface; ``open(url)`` picks one."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from ..errors import StorageError
from .base import Storage, StorageWrapper, storage_error
from .local import LocalStorage

__all__ = ["Storage", "StorageWrapper", "LocalStorage", "open", "storage_error"]


def open(url: "str | os.PathLike[str] | Storage", **storage_options) -> Storage:  # noqa: A001
    """The storage for a path, ``file://`` URL or (with the ``s3`` extra) any fsspec URL.

    ``storage_options`` go to the backend: for fsspec URLs to the filesystem (s3fs:
    ``endpoint_url``, ``key``, ``secret``, ``client_kwargs``, ...). Local paths take
    only ``fs`` and ``follow_symlinks`` (see ``LocalStorage``) and ignore the rest, so code that passes its
    object-store options everywhere also works with a local path."""
    if isinstance(url, Storage):
        return url
    text = os.fspath(url)
    local = {k: v for k, v in storage_options.items() if k in ("fs", "follow_symlinks")}
    if text.startswith("file://"):
        return LocalStorage(unquote(urlparse(text).path), **local)
    if "://" in text:
        try:
            from .fsspec import FsspecStorage
            import fsspec  # noqa: F401
        except ImportError:
            scheme = text.split("://", 1)[0]
            raise StorageError(f"no storage backend for {scheme}:// URLs ({text}); "
                               "object stores need the fsspec backend: pip install 'safeckpt[s3]'") from None
        return FsspecStorage(text, **storage_options)
    return LocalStorage(text, **local)
