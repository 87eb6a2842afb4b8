"""Fast, non-cryptographic checksums of byte ranges (xxh3, ~10 GB/s, GIL released).

``xxh3_64`` guards against corruption. Incremental saves identify chunks by content,
which needs a hash whose collisions are negligible across billions of chunks, so their
chunks carry ``xxh3_128`` (the same speed); a reader checks whichever a checksum names.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import xxhash

ALGORITHM = "xxh3_64"


STRONG = "xxh3_128"
_HEXDIGEST = {ALGORITHM: xxhash.xxh3_64_hexdigest, STRONG: xxhash.xxh3_128_hexdigest}
_DIGEST = {ALGORITHM: xxhash.xxh3_64_digest, STRONG: xxhash.xxh3_128_digest}
_HASHER = {ALGORITHM: xxhash.xxh3_64, STRONG: xxhash.xxh3_128}
RELEASE_GIL_FROM = 64 << 10  # xxhash 3.x's one-shot functions hold the GIL; hash objects release it


def checksum(data, algorithm: str = ALGORITHM) -> str:
    """Return ``"<algorithm>:<hex digits>"`` for a bytes-like object. Data of
    ``RELEASE_GIL_FROM`` bytes or more is hashed with the GIL released (a background
    save's hashing must not stall the training thread); smaller data takes the cheaper
    one-shot call (which xxhash >= 4 also runs without the GIL above 64 KiB). Both give
    the same digest."""
    n = data.nbytes if isinstance(data, memoryview) else len(data)
    if n >= RELEASE_GIL_FROM:
        return f"{algorithm}:{_HASHER[algorithm](data).hexdigest()}"
    return f"{algorithm}:{_HEXDIGEST[algorithm](data)}"


def checksum_of(parts: "list[Any]", algorithm: str = ALGORITHM) -> str:
    """``checksum`` of the bytes of ``parts`` one after another, without joining them."""
    hasher = _HASHER[algorithm]()
    for part in parts:
        hasher.update(part)
    return f"{algorithm}:{hasher.hexdigest()}"


def raw_digest(algorithm: str) -> Callable[[Any], bytes]:
    """The one-shot function giving the raw bytes of ``checksum``'s hex digits (as format
    3's tables store them). It holds the GIL: for many small pieces hashed in a loop on
    several threads, where releasing and retaking it for each would cost more."""
    return _DIGEST[algorithm]


def matches(data, expected: str) -> bool:
    """True when ``data`` has the checksum ``expected`` (of either algorithm)."""
    return checksum(data, expected.partition(":")[0]) == expected


BLOCK_SIZE = 16 << 20  # chunks are checksummed per block so partial reads can be verified


def block_checksums(data, block_size: int = BLOCK_SIZE) -> list[str]:
    """Checksums of consecutive ``block_size`` blocks of ``data`` (one for empty data)."""
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
    if len(view) <= block_size:
        return [checksum(view)]
    return [checksum(view[i:i + block_size]) for i in range(0, len(view), block_size)]


def slice_checksums(data, spans: "list[tuple[int, int]]") -> list[list[str]]:
    """``block_checksums`` of many slices of one buffer, each at most one block long (the
    small pieces of a staged region): one checksum each, in one tight loop."""
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
    one, prefix = _HEXDIGEST[ALGORITHM], ALGORITHM + ":"
    assert all(b - a <= BLOCK_SIZE for a, b in spans), "a slice longer than a block"
    return [[prefix + one(view[a:b])] for a, b in spans]


_CHECKSUM_RE = re.compile(rf"{ALGORITHM}:[0-9a-f]{{16}}|{STRONG}:[0-9a-f]{{32}}", re.ASCII)


def is_checksum(value: object) -> bool:
    """True when ``value`` is a checksum string this version can check."""
    return isinstance(value, str) and _CHECKSUM_RE.fullmatch(value) is not None


class RunningChecksum:
    """The ``xxh3_64`` checksum of bytes seen in pieces (a whole file, as sealed)."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_64()

    def update(self, data) -> None:
        self._hash.update(data)

    @property
    def value(self) -> str:
        return f"{ALGORITHM}:{self._hash.hexdigest()}"


def file_checksum(storage, name: str, size: int, block_size: int = BLOCK_SIZE) -> str:
    """The checksum of a whole file (what a sealed file's manifest entry records), read
    block by block so a file of any size needs one block of memory."""
    running = RunningChecksum()
    buf = memoryview(bytearray(min(block_size, size) or 1))
    offset = 0
    while offset < size:
        n = min(len(buf), size - offset)
        storage.read_into(name, offset, buf[:n])
        running.update(buf[:n])
        offset += n
    return running.value
