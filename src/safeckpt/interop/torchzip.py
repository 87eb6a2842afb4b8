"""``torch.save`` archives (a file, or each item of a DCP ``.distcp`` file), read
without trusting them.

torch's own zip reader trusts every field of the archive and checks no CRC-32, so a
flipped bit in the data loads as a wrong value, and one in the zip's directory can
make it read the wrong bytes, nothing, or uninitialised memory. ``check_archive``
parses the archive itself first, for any seekable file: every field torch's reader
uses must agree with the rest (each central record with its local header, the end
records with the directory, no overlaps) and every record's bytes with their CRC-32,
or ``CorruptCheckpointError`` is raised; it is how a Lightning ``.ckpt`` file is checked
before ``torch.load`` reads it, and how ``load_archive`` reads an import. There,
tensor data is not copied: the archive's storages are stored uncompressed, so each
tensor is a view of the memory-mapped file, and an import streams from the page cache
tensor by tensor. The pickle is read with torch's weights-only unpickler, which also
admits NumPy arrays and scalars (safeckpt stores those natively; object arrays are
refused when saved).
"""

from __future__ import annotations

import contextlib
import io
import mmap
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import IO, Any, Iterator

import numpy as np
import torch

from ..errors import CorruptCheckpointError

# a legacy (pre-zip) torch.save file starts with a pickle of this number: LONG1 opcode, 10 bytes
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_ZIP_MAGIC = b"PK\x03\x04"  # every torch.save file since torch 1.6 is a zip archive
_CHECK_BLOCK = 1 << 20


def torch_format(head: bytes) -> str | None:
    """Which ``torch.save`` format a file whose first 32 bytes are ``head`` is in:
    ``"zip"`` (torch 1.6 and later), ``"legacy"``, or None for neither."""
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    return "legacy" if _LEGACY_MAGIC in head[:32] else None

try:  # NumPy 2
    from numpy._core.multiarray import _reconstruct, scalar
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core.multiarray import _reconstruct, scalar  # type: ignore[no-redef]

NUMPY_GLOBALS: list[Any] = [_reconstruct, scalar, np.ndarray, np.dtype,
                 *{type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDGSUMm"}]


@contextlib.contextmanager
def numpy_allowed() -> Iterator[None]:
    """``torch.load(weights_only=True)`` inside admits NumPy arrays, dtypes and scalars:
    building them runs no code from the file."""
    with torch.serialization.safe_globals(NUMPY_GLOBALS):
        yield


class _Window(io.RawIOBase):
    """A read-only, seekable file over ``buffer[start:start + length]``."""

    def __init__(self, buffer: "mmap.mmap | bytes", start: int, length: int) -> None:
        self._view = memoryview(buffer)[start:start + length]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, out: Any) -> int:
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._view.release()
        super().close()


# The zip records torch.save writes (APPNOTE 4.3), little-endian
_EOCD = struct.Struct("<4sHHHHIIH")              # end of central directory
_LOCATOR = struct.Struct("<4sIQI")               # zip64 end of central directory locator
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")          # zip64 end of central directory
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<4sHHHHHIIIHH")          # local file header
_U16, _U32 = 0xFFFF, 0xFFFFFFFF                  # "the value is in the zip64 record"
_ZIP64_FIELD = 0x0001
# general-purpose flags a reader may meet without changing how it reads a stored record:
# sizes in a data descriptor after the data (bit 3), UTF-8 names (bit 11)
_HARMLESS_FLAGS = 0x0008 | 0x0800
_DOS_FOLDER = 0x10  # in the external attributes: torch's reader reads such a record as empty


@dataclass(frozen=True)
class Record:
    """A record of a checked archive: its bytes are ``[offset, offset + size)`` of the
    archive (stored, never compressed) and have CRC-32 ``crc``."""

    name: str
    offset: int
    size: int
    crc: int


@dataclass(frozen=True)
class Archive:
    """A checked ``torch.save`` archive: its records by name, the folder they are all
    in (``"archive/"``), and whether their CRC-32s were checked (False: none recorded)."""

    records: dict[str, Record]
    prefix: str
    checked: bool


@dataclass(frozen=True)
class _Entry:
    name: bytes
    flags: int
    stamps: tuple[int, int, int]  # crc, compressed and uncompressed size as the 32-bit fields hold them
    crc: int
    size: int
    header: int  # where its local header starts


def _unsound(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: not a sound torch.save archive ({why}); it was torn or changed "
                                  "after it was written")


def _read(f: "IO[bytes] | io.RawIOBase", offset: int, n: int, where: str) -> bytes:
    """Exactly ``n`` bytes at ``offset``."""
    f.seek(offset)
    parts, left = [], n
    while left:
        part = f.read(left)
        if not part:
            raise _unsound(where, f"it ends before byte {offset + n}")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _directory(f: "IO[bytes] | io.RawIOBase", size: int, where: str) -> tuple[int, int, int]:
    """(offset, size, entries) of the central directory, which must end exactly where the
    end records begin, and they at the end of the file: one disk, no comment, and the
    zip64 records, when present, right before the last one and agreeing with it."""
    if size < _EOCD.size:
        raise _unsound(where, f"{size} bytes, too short for a zip archive")
    end = size - _EOCD.size
    sig, disk, cd_disk, on_disk, entries, cd_size, cd_offset, comment = _EOCD.unpack(_read(f, end, _EOCD.size, where))
    if sig != b"PK\x05\x06" or comment:
        raise _unsound(where, "no end-of-central-directory record at its end")
    if disk or cd_disk or on_disk != entries:
        raise _unsound(where, "its end record describes an archive over several disks")
    if end >= _LOCATOR.size + _EOCD64.size and _read(f, end - _LOCATOR.size, 4, where) == b"PK\x06\x07":
        _, z_disk, z_offset, disks = _LOCATOR.unpack(_read(f, end - _LOCATOR.size, _LOCATOR.size, where))
        end -= _LOCATOR.size + _EOCD64.size
        if z_disk or disks != 1 or z_offset != end:
            raise _unsound(where, "its zip64 locator does not point at the record before it")
        (sig, record_size, _, _, disk, cd_disk, on_disk, entries64, cd_size64,
         cd_offset64) = _EOCD64.unpack(_read(f, end, _EOCD64.size, where))
        if sig != b"PK\x06\x06" or record_size != _EOCD64.size - 12 or disk or cd_disk or on_disk != entries64:
            raise _unsound(where, "a malformed zip64 end record")
        for short, full, cap in ((entries, entries64, _U16), (cd_size, cd_size64, _U32), (cd_offset, cd_offset64, _U32)):
            if short not in (min(full, cap), cap):
                raise _unsound(where, "its end record and zip64 end record disagree")
        entries, cd_size, cd_offset = entries64, cd_size64, cd_offset64
    if cd_offset + cd_size != end or not entries:
        raise _unsound(where, "its central directory does not end where its end records begin")
    return cd_offset, cd_size, entries


def _zip64(extra: bytes, values: tuple[int, int, int], where: str) -> tuple[int, int, int]:
    """(uncompressed size, compressed size, local header offset) of a central record:
    each 32-bit field that holds 0xFFFFFFFF is read, in that order, from the zip64 field
    of its extra data (which must be a well-formed series of fields)."""
    zip64, pos = b"", 0
    while pos < len(extra):
        if pos + 4 > len(extra):
            raise _unsound(where, "a malformed extra field")
        kind, n = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + n > len(extra):
            raise _unsound(where, "a malformed extra field")
        if kind == _ZIP64_FIELD and not zip64:
            zip64 = extra[pos + 4:pos + 4 + n]
        pos += 4 + n
    wide = list(struct.unpack_from(f"<{len(zip64) // 8}Q", zip64))
    if sum(v == _U32 for v in values) > len(wide):
        raise _unsound(where, "a record whose zip64 field lacks its sizes")
    wide.reverse()
    return tuple(wide.pop() if v == _U32 else v for v in values)  # type: ignore[return-value]


def _entries(cd: bytes, count: int, where: str) -> list[_Entry]:
    """The central directory's records, each checked for what torch's reader would
    read differently from what was written: stored, no encryption or other flag that
    changes how it is read, not marked as a folder, one disk, no comment."""
    out, pos = [], 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(cd):
            raise _unsound(where, "its central directory is shorter than its end record says")
        (sig, _made_by, _needed, flags, method, _time, _date, crc, csize, usize, name_len, extra_len, comment_len,
         disk, _internal, external, header) = _CENTRAL.unpack_from(cd, pos)
        name_at = pos + _CENTRAL.size
        name, extra = cd[name_at:name_at + name_len], cd[name_at + name_len:name_at + name_len + extra_len]
        pos = name_at + name_len + extra_len + comment_len
        if sig != b"PK\x01\x02" or pos > len(cd):
            raise _unsound(where, "a malformed central directory")
        what = f"record {name.decode('utf-8', 'replace')!r}"
        if method or flags & ~_HARMLESS_FLAGS or disk or comment_len:
            raise _unsound(where, f"{what} is compressed, encrypted or otherwise not stored as torch.save stores it "
                                  f"(method {method}, flags {flags:#06x})")
        if external & _DOS_FOLDER or name.endswith(b"/"):
            raise _unsound(where, f"{what} is marked as a folder")
        stamps = (crc, csize, usize)
        usize, csize, header = _zip64(extra, (usize, csize, header), where)
        if usize != csize:
            raise _unsound(where, f"{what}: stored, but its sizes differ ({csize} and {usize} bytes)")
        out.append(_Entry(name, flags, stamps, crc, usize, header))
    if pos != len(cd):
        raise _unsound(where, "its central directory is longer than its records")
    return out


def _names(entries: list[_Entry], where: str) -> tuple[dict[bytes, str], str]:
    """Each record's name as text, and the folder they are all in: names unique even
    without case (torch's reader finds a record ignoring case), all in the folder of the
    first (the one torch's reader takes), with a ``data.pkl``."""
    names: dict[bytes, str] = {}
    try:
        texts = [e.name.decode("utf-8") for e in entries]
    except UnicodeDecodeError:
        raise _unsound(where, "a record name that is not UTF-8") from None
    prefix = texts[0].partition("/")[0] + "/"
    if len({e.name.lower() for e in entries}) != len(entries):
        raise _unsound(where, "two records of the same name")
    for entry, text in zip(entries, texts):
        if prefix == "/" or not text.startswith(prefix):
            raise _unsound(where, f"record {text!r} is outside the archive's folder {prefix!r}")
        names[entry.name] = text
    if prefix + "data.pkl" not in texts:
        raise _unsound(where, "a zip file without its data.pkl record")
    return names, prefix


def check_archive(f: "IO[bytes] | io.RawIOBase", where: str) -> Archive:
    """Check the ``torch.save`` archive in the seekable binary file ``f`` before torch's
    reader sees it, which trusts every field and checks no CRC-32: the end records and
    the central directory (see ``_directory``, ``_entries``, ``_names``), every local
    header against its central record (signature, flags, method, name; its CRC-32 and
    sizes equal, or zero where a data descriptor holds them), records that do not
    overlap each other or the directory, and the CRC-32 of the bytes each record's
    local header leads a reader to, which covers every byte of the pickle and of every
    tensor. A field torch ignores (times, versions, attributes but the folder bit,
    padding) may differ; anything else that differs is refused with
    ``CorruptCheckpointError`` naming ``where``, so what loads afterwards is what was
    saved. An archive that records no CRC-32 at all (written after
    ``torch.serialization.set_crc32_options(False)``) is checked for its structure only
    (``Archive.checked`` False)."""
    try:
        size = f.seek(0, io.SEEK_END)
        cd_offset, cd_size, count = _directory(f, size, where)
        entries = _entries(_read(f, cd_offset, cd_size, where), count, where)
        names, prefix = _names(entries, where)
        recorded = any(e.crc for e in entries if e.size)
        records: dict[str, Record] = {}
        free = 0  # where the next record may start
        for e in sorted(entries, key=lambda e: e.header):
            name = names[e.name]
            if e.header < free or e.header + _LOCAL.size > cd_offset:
                raise _unsound(where, f"record {name!r} overlaps another record or the central directory")
            sig, _needed, flags, method, _time, _date, *stamps, name_len, extra_len = _LOCAL.unpack(
                _read(f, e.header, _LOCAL.size, where))
            if sig != b"PK\x03\x04" or flags != e.flags or method:
                raise _unsound(where, f"record {name!r}: its local header does not match its central record")
            if tuple(stamps) != e.stamps and not (flags & 0x0008 and stamps == [0, 0, 0]):
                raise _unsound(where, f"record {name!r}: its local header records another CRC-32 or size")
            if _read(f, e.header + _LOCAL.size, name_len, where) != e.name:
                raise _unsound(where, f"record {name!r}: its local header names another record")
            offset = e.header + _LOCAL.size + name_len + extra_len
            free = offset + e.size
            if free > cd_offset:
                raise _unsound(where, f"record {name!r} overlaps the central directory")
            if recorded and _crc32(f, offset, e.size) != e.crc:
                raise _unsound(where, f"Bad CRC-32 for record {name!r}: its bytes changed")
            records[name] = Record(name, offset, e.size, e.crc)
        return Archive(records, prefix, recorded)
    except CorruptCheckpointError:
        raise
    except (ValueError, OSError, struct.error) as exc:
        raise _unsound(where, f"{type(exc).__name__}: {exc}") from exc


def _crc32(f: "IO[bytes] | io.RawIOBase", offset: int, size: int) -> int:
    f.seek(offset)
    crc, left = 0, size
    while left:
        block = f.read(min(left, _CHECK_BLOCK))
        if not block:
            return -1  # cut short: cannot match
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


def load_archive(buffer: mmap.mmap, start: int, length: int, where: str) -> Any:
    """The object ``torch.save`` wrote at ``buffer[start:start + length]``, its tensors
    views of ``buffer``. Raises ``CorruptCheckpointError`` naming ``where`` for a bad
    archive or a failed CRC-32 (``check_archive``; one without CRC-32s is refused too),
    and lets ``pickle.UnpicklingError`` (a value weights_only refuses) through for the
    caller to explain."""
    if start < 0 or length <= 0 or start + length > len(buffer):
        raise CorruptCheckpointError(f"{where}: byte range [{start}, {start + length}) is outside the file")
    window = _Window(buffer, start, length)
    try:
        archive = check_archive(window, where)
    finally:
        window.close()
    if not archive.checked:
        raise CorruptCheckpointError(f"{where}: the archive records no CRC-32 to check it by")

    def record(name: str) -> bytes:
        r = archive.records[archive.prefix + name]
        return buffer[start + r.offset:start + r.offset + r.size]

    try:
        if archive.prefix + "byteorder" in archive.records and record("byteorder") != b"little":
            raise ValueError("a big-endian archive")
        unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(record("data.pkl")), encoding="utf-8")
        unpickler.persistent_load = lambda saved_id: _storage(buffer, start, archive, saved_id)  # type: ignore[method-assign]  # pickle's documented hook
        with numpy_allowed():
            return unpickler.load()
    except pickle.UnpicklingError:
        raise
    except (KeyError, ValueError, TypeError, RuntimeError, EOFError, struct.error, AttributeError,
            IndexError) as exc:
        raise CorruptCheckpointError(f"{where}: not a sound torch.save archive "
                                     f"({type(exc).__name__}: {exc})") from exc


def _storage(buffer: mmap.mmap, start: int, archive: Archive, saved_id: Any) -> torch.storage.TypedStorage:
    """A storage of the archive as a view of ``buffer`` (torch.save stores them uncompressed)."""
    typename, storage_type, key, _location, numel = saved_id
    if typename != "storage":
        raise ValueError(f"unknown persistent id {typename!r}")
    dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
    record = archive.records[f"{archive.prefix}data/{key}"]
    nbytes = numel * torch._utils._element_size(dtype)
    if record.size != nbytes:
        raise ValueError(f"storage {key}: {record.size} bytes, expected {nbytes}")
    data = (torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start + record.offset) if nbytes
            else torch.empty(0, dtype=torch.uint8))
    return torch.storage.TypedStorage(wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True)
