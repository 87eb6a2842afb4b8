"""Decoded manifests remembered by their bytes.

After every save a ``CheckpointManager`` applies retention and collects garbage, which
reads every committed manifest of the run again. Decoding one is Python work per tensor
(for an async save: on the background thread, holding the GIL the training needs);
checking that the bytes read are the ones decoded before is one xxh3 pass with the GIL
released. So a manifest is decoded once per content: the key is its length and the
checksum of all its bytes, and anything else (a torn, altered or new manifest) is
decoded and checked as always. The cache never hands out the manifest it holds: each
caller gets its own (``_own``), whose metadata and metrics (the user's values, which
listings return) are copies; its records of files and tensors are shared, read-only,
and no public function returns them as they are.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections import OrderedDict
from typing import Any

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
            return _own(found)
    manifest = decode_manifest(data, where)  # raises for anything that is not a valid manifest
    with _lock:
        if key not in _cache:
            _cache[key] = manifest
            _held[0] += key[0]
            while _held[0] > LIMIT_BYTES:
                old, _ = _cache.popitem(last=False)
                _held[0] -= old[0]
    return _own(manifest)


_IMMUTABLE = frozenset({str, int, float, bool, type(None), bytes, complex})


def _copied(value: Any) -> Any:
    """A copy of decoded metadata or metrics that shares nothing mutable with ``value``:
    the plain containers JSON decodes to are copied here (several times faster than
    ``deepcopy``, which the codec's rarer types get)."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is dict:
        return {k: v if type(v) in _IMMUTABLE else _copied(v) for k, v in value.items()}
    if kind is list:
        return [v if type(v) in _IMMUTABLE else _copied(v) for v in value]
    return copy.deepcopy(value)


def _own(m: Manifest) -> Manifest:
    """A caller's own manifest: a new record with its own metadata and metrics."""
    return dataclasses.replace(m, metadata=_copied(m.metadata), metrics=_copied(m.metrics))


def clear() -> None:
    """Forget every decoded manifest (their memory)."""
    with _lock:
        _cache.clear()
        _held[0] = 0
