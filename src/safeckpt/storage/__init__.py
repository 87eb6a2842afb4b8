"""Storage backends behind one small interface; ``open(url)`` picks one (see ``registry``)."""

from __future__ import annotations

from .base import Storage, StorageWrapper, storage_error
from .local import LocalStorage
from .registry import ENTRY_POINT_GROUP, register
from .urls import is_remote, url_scheme
from .registry import open_storage as open  # noqa: A001 - the package's verb

__all__ = ["Storage", "StorageWrapper", "LocalStorage", "open", "register", "url_scheme", "is_remote",
           "storage_error", "ENTRY_POINT_GROUP"]
