"""Decoded manifests remembered by their bytes.

After every save a ``CheckpointManager`` applies retention and collects garbage, which
reads every committed manifest of the run again. Decoding one is Python work per tensor
(for an async save: on the background thread, holding the GIL the training needs);
checking that the bytes read are the ones decoded before is one xxh3 pass with the GIL
released. So a manifest is decoded once per content: the key is its length and the
checksum of all its bytes, and anything else (a torn, altered or new manifest) is
decoded and checked as always. A decoded manifest is shared by every caller that reads
those bytes: callers never change one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .checksum import checksum
from .manifest import Manifest, decode_manifest

LIMIT_BYTES = 32 << 20  # of manifest bytes remembered in all (their decoded form is several times more)

_lock = threading.Lock()
_cache: "OrderedDict[tuple[int, str], Manifest]" = OrderedDict()
_held = [0]


def decode(data: bytes, where: str) -> Manifest:
    """``decode_manifest(data, where)``, decoded only the first time these bytes are seen."""
    if len(data) > LIMIT_BYTES // 2:
        return decode_manifest(data, where)
    key = (len(data), checksum(data))
    with _lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    manifest = decode_manifest(data, where)  # raises for anything that is not a valid manifest
    with _lock:
        if key not in _cache:
            _cache[key] = manifest
            _held[0] += key[0]
            while _held[0] > LIMIT_BYTES:
                old, _ = _cache.popitem(last=False)
                _held[0] -= old[0]
    return manifest


def clear() -> None:
    """Forget every decoded manifest (their memory)."""
    with _lock:
        _cache.clear()
        _held[0] = 0
