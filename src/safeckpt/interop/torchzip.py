"""``torch.save`` archives embedded in other files (each item of a DCP ``.distcp``
file is one), read without trusting them.

Every member's CRC-32 is checked before anything is used (torch's own reader never
checks them, so a flipped byte would import silently): ``check_archive`` does it for
any seekable file, and is how a Lightning ``.ckpt`` file is checked before it loads. Tensor data is not copied: the
archive's storages are stored uncompressed, so each tensor is a view of the
memory-mapped file, and an import streams from the page cache tensor by tensor. The
pickle is read with torch's weights-only unpickler, which also admits NumPy arrays and
scalars (safeckpt stores those natively; object arrays are refused when saved).
"""

from __future__ import annotations

import contextlib
import io
import mmap
import pickle
import struct
import zipfile
from typing import IO, Any, Iterator

import numpy as np
import torch

from ..errors import CorruptCheckpointError

# a legacy (pre-zip) torch.save file starts with a pickle of this number: LONG1 opcode, 10 bytes
LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
ZIP_MAGIC = b"PK\x03\x04"  # every torch.save file since torch 1.6 is a zip archive
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_CHECK_BLOCK = 1 << 20

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


def check_archive(f: "IO[bytes] | io.RawIOBase", where: str) -> bool:
    """Check the ``torch.save`` archive in the seekable binary file ``f``: its zip
    structure (central directory, local headers), a ``data.pkl`` record, and the CRC-32
    of every record, which covers every byte of the pickle and of every tensor. Raises
    ``CorruptCheckpointError`` naming ``where``; returns False, having checked only the
    structure, for an archive that records no CRC-32 at all (written after
    ``torch.serialization.set_crc32_options(False)``)."""
    try:
        with zipfile.ZipFile(f) as archive:  # type: ignore[arg-type]  # any seekable binary file
            members = archive.infolist()
            if not any(n.filename.endswith("/data.pkl") and n.filename.count("/") == 1 for n in members):
                raise CorruptCheckpointError(f"{where}: not a sound torch.save archive (a zip file without "
                                             "its data.pkl record)")
            recorded = any(info.CRC for info in members if info.file_size)
            for info in members:
                if not recorded:
                    info.CRC = 0  # nothing to compare: read the record only for its header
                with archive.open(info) as member:  # zipfile checks the CRC-32 at the end of each
                    while member.read(_CHECK_BLOCK):
                        pass
        return recorded
    except CorruptCheckpointError:
        raise
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, struct.error, NotImplementedError,
            RuntimeError) as exc:
        raise CorruptCheckpointError(f"{where}: not a sound torch.save archive "
                                     f"({type(exc).__name__}: {exc}); it was torn or changed after it "
                                     "was written") from exc


def load_archive(buffer: mmap.mmap, start: int, length: int, where: str) -> Any:
    """The object ``torch.save`` wrote at ``buffer[start:start + length]``, its tensors
    views of ``buffer``. Raises ``CorruptCheckpointError`` naming ``where`` for a bad
    archive or a failed CRC-32, and lets ``pickle.UnpicklingError`` (a value
    weights_only refuses) through for the caller to explain."""
    if start < 0 or length <= 0 or start + length > len(buffer):
        raise CorruptCheckpointError(f"{where}: byte range [{start}, {start + length}) is outside the file")
    window = _Window(buffer, start, length)
    try:
        if not check_archive(window, where):
            raise CorruptCheckpointError(f"{where}: the archive records no CRC-32 to check it by")
        with zipfile.ZipFile(window) as archive:
            members = {info.filename: info for info in archive.infolist()}
            pkl = next(n for n in members if n.endswith("/data.pkl") and n.count("/") == 1)
            prefix = pkl[:-len("data.pkl")]
            if f"{prefix}byteorder" in members and archive.read(f"{prefix}byteorder") != b"little":
                raise ValueError("a big-endian archive")
            unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(archive.read(pkl)), encoding="utf-8")
        unpickler.persistent_load = lambda saved_id: _storage(buffer, start, window, members, prefix, saved_id)  # type: ignore[method-assign]  # pickle's documented hook
        with numpy_allowed():
            return unpickler.load()
    except pickle.UnpicklingError:
        raise
    except CorruptCheckpointError:
        raise
    except (zipfile.BadZipFile, StopIteration, KeyError, ValueError, TypeError, RuntimeError, EOFError,
            OSError, struct.error, AttributeError, IndexError) as exc:
        raise CorruptCheckpointError(f"{where}: not a sound torch.save archive "
                                     f"({type(exc).__name__}: {exc})") from exc
    finally:
        window.close()


def _storage(buffer: mmap.mmap, start: int, window: _Window, members: dict[str, zipfile.ZipInfo],
             prefix: str, saved_id: Any) -> torch.storage.TypedStorage:
    """A storage of the archive as a view of ``buffer`` (torch.save stores them uncompressed)."""
    typename, storage_type, key, _location, numel = saved_id
    if typename != "storage":
        raise ValueError(f"unknown persistent id {typename!r}")
    dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
    info = members[f"{prefix}data/{key}"]
    nbytes = numel * torch._utils._element_size(dtype)
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
        raise ValueError(f"storage {key}: {info.file_size} bytes, compressed={info.compress_type}, "
                         f"expected {nbytes} stored")
    window.seek(info.header_offset)
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(window.read(_LOCAL_HEADER.size))
    if signature != b"PK\x03\x04":
        raise ValueError(f"storage {key}: no local header")
    offset = start + info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    data = (torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes
            else torch.empty(0, dtype=torch.uint8))
    return torch.storage.TypedStorage(wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True)
