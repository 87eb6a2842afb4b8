"""Storage backends by URL scheme.

``open(url)`` asks, in order: backends registered in this process (``register``),
backends other packages declare in the ``safeckpt.storage`` entry-point group (the
entry point's name is the scheme, its object an opener ``(url, **storage_options) ->
Storage``), then fsspec for every other scheme. Plain paths and ``file://`` URLs are
local. So a GCS backend with generation-match preconditions, say, plugs in without
editing safeckpt, and ``safeckpt.testing.StorageTests`` checks it.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from typing import Any, Callable
from urllib.parse import unquote, urlparse

from ..errors import StorageError
from .base import Storage
from .local import LocalStorage
from .urls import install_hint, url_scheme

ENTRY_POINT_GROUP = "safeckpt.storage"
Opener = Callable[..., Storage]

_LOCAL_OPTIONS = ("fs", "follow_symlinks")
_openers: dict[str, Opener] = {}


def register(scheme: str, opener: Opener, *, replace: bool = False) -> None:
    """Open ``scheme://`` URLs with ``opener(url, **storage_options)``."""
    scheme = scheme.lower()
    if scheme in ("", "file") or (scheme in _openers and not replace):
        raise ValueError(f"a storage backend for {scheme!r}:// is already registered (pass replace=True)")
    _openers[scheme] = opener


def _declared(scheme: str) -> Opener | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name.lower() == scheme:
            try:
                opener = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plug-in is a storage error
                raise StorageError(f"the storage backend {ep.value!r} for {scheme}:// failed to load: {exc}") from exc
            _openers[scheme] = opener
            return opener
    return None


def _open_fsspec(url: str, **storage_options: Any) -> Storage:
    try:
        import fsspec  # noqa: F401

        from .fsspec import FsspecStorage
        from .s3 import S3Storage
    except ImportError:
        raise StorageError(f"no storage backend for {url_scheme(url)}:// URLs ({url}); object stores "
                           f"need the fsspec backend: {install_hint(url_scheme(url))}") from None
    return (S3Storage if url_scheme(url) in ("s3", "s3a") else FsspecStorage)(url, **storage_options)


def open_storage(url: "str | os.PathLike[str] | Storage", **storage_options: Any) -> Storage:
    """The storage for a path, ``file://`` URL or any other registered or fsspec URL.

    ``storage_options`` go to the backend: for fsspec URLs to the filesystem (s3fs:
    ``endpoint_url``, ``key``, ``secret``, ``client_kwargs``, ...). Local paths take only
    ``fs`` and ``follow_symlinks`` (see ``LocalStorage``) and ignore the rest, so code
    that passes its object-store options everywhere also works with a local path."""
    if isinstance(url, Storage):
        return url
    text = os.fspath(url)
    scheme = url_scheme(text)
    if scheme in (None, "file"):
        local = {k: v for k, v in storage_options.items() if k in _LOCAL_OPTIONS}
        return LocalStorage(unquote(urlparse(text).path) if scheme else text, **local)
    opener = _openers.get(scheme) or _declared(scheme) or _open_fsspec
    return opener(text, **storage_options)
