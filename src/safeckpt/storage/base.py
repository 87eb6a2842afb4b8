"""The ``Storage`` interface: the handful of operations the commit protocol needs.

A ``Storage`` is a folder on some backend; names are ``/``-separated paths relative
to it. Files are written once under their final name and never modified; nothing
here needs rename. Capability flags tell the protocol what the backend can do.

One operation is the exception, for the files other tools insist on writing under a
fixed name (Lightning's ``last.ckpt``, DeepSpeed's ``latest``): ``open_replace``
streams a file that replaces ``name`` atomically. Each backend does it the way its
storage allows (a temporary name in the same folder, fsync, rename, folder fsync on
POSIX and NFS; one PUT of the final object on an object store; the final name,
visible only when it is closed, on object-store FUSE mounts that refuse rename), and
the conformance suite checks the rule: whatever the moment of a crash, ``name`` holds
the old complete file or the new complete one.
"""

from __future__ import annotations

import copy
import errno
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Iterable

from ..errors import StorageError
from ..format.names import is_shared, shared_location

Buffer = bytes | bytearray | memoryview


class Storage(ABC):
    """A folder of immutable files on one backend."""

    #: a reader can never observe a partly written file under its final name
    atomic_write: bool = False
    #: ``write_file(..., exclusive=True)`` is enforced by the backend, not just checked first
    exclusive_create: bool = True
    #: adjacent reads smaller than this are merged into one request (object stores pay a
    #: round trip per request, local disks only a system call)
    merge_reads_below: int = 1 << 20
    #: ``rename`` replaces a file atomically (never needed by the commit protocol; exports
    #: use it to put finished files in place)
    can_rename: bool = False
    #: ``open_replace`` replaces a file atomically (see the module docstring)
    can_replace: bool = False

    url: str

    @abstractmethod
    def child(self, name: str) -> "Storage":
        """The storage of a sub-folder."""

    @abstractmethod
    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        """Create ``name`` (which must not exist) from ``parts``; durable on return.

        Returns the number of bytes written. Raises ``FileExistsError`` if the name
        exists, ``StorageError`` for anything the backend refuses."""

    @abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``name`` from ``offset``; short files raise."""

    def sync(self, names: Iterable[str]) -> None:
        """Make files that already exist (another tool wrote them) durable, with their
        folders, before a manifest vouches for them. Object stores need nothing: an
        object is durable when its PUT returns."""

    @abstractmethod
    def listdir(self) -> dict[str, int | None]:
        """Entries directly in this folder: file name -> size, sub-folder -> None.

        A missing folder lists as empty."""

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Delete files (missing ones are fine); the deletion is durable on return."""

    @abstractmethod
    def remove_folder(self) -> None:
        """Remove this folder if it is empty (a no-op where folders are implicit)."""

    def rename(self, src: str, dst: str) -> None:
        """Atomically replace ``dst`` by ``src`` (durable on return), where ``can_rename``."""
        raise StorageError(f"{self.url}: this storage cannot rename files")

    def open_replace(self, name: str) -> "Replacement":
        """Start writing a file that will replace ``name`` (or create it) atomically,
        where ``can_replace``: until ``commit()`` returns, readers see the old file (or
        none), and a crash at any moment leaves the old complete file or the new complete
        one, never a mix, a prefix or an empty file. Nothing is buffered beyond what the
        backend needs (object stores: one upload part), so a large file streams."""
        raise StorageError(f"{self.url}: this storage cannot replace a file atomically")

    def replace_file(self, name: str, parts: Iterable[Buffer]) -> int:
        """Atomically replace ``name`` with ``parts`` (see ``open_replace``); durable
        on return. Returns the number of bytes written."""
        with self.open_replace(name) as out:
            for part in parts:
                out.write(part)
        return out.written

    def parent(self) -> "Storage":
        """The folder holding this one (incremental checkpoints read their siblings' data)."""
        raise StorageError(f"{self.url}: this storage cannot reach its parent folder, which an "
                           "incremental checkpoint needs to read data it shares with older ones")

    def locate(self, name: str) -> tuple["Storage", str]:
        """The folder and name of a file a manifest names: ``../<folder>/<file>`` is a file
        of a sibling checkpoint (written by an earlier save of an incremental run)."""
        if is_shared(name):
            folder, file = shared_location(name)
            return self.parent().child(folder), file
        return self, name

    def read(self, name: str, offset: int = 0, size: int | None = None) -> bytes:
        """Read ``size`` bytes (default: to the end) of ``name`` from ``offset``."""
        if size is None:
            size = self.size(name) - offset
        out = bytearray(size)
        self.read_into(name, offset, memoryview(out))
        return bytes(out)

    def size(self, name: str) -> int:
        """The size of a file; ``FileNotFoundError`` if it does not exist."""
        here, name = self.locate(name)
        head, _, tail = name.rpartition("/")
        folder = here.child(head) if head else here
        size = folder.listdir().get(tail)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", f"{self.url}/{name}")
        return size


class Replacement(ABC):
    """A file being written to replace another (``Storage.open_replace``): a writable
    binary stream (``write``, ``flush``), then ``commit`` or ``abort``. As a context
    manager it commits on a normal exit and aborts on an exception."""

    written: int = 0

    @abstractmethod
    def write(self, data: Buffer) -> int:
        """Append ``data`` (copied or written before returning: the caller may reuse
        its buffer) and return its length."""

    def flush(self) -> None:
        """Nothing to do: ``commit`` makes the file durable (``torch.save`` calls it)."""

    @abstractmethod
    def commit(self) -> int:
        """Make the new file durable, then visible under its name; returns its size."""

    @abstractmethod
    def abort(self) -> None:
        """Give up: the old file (or none) stays, nothing of the new one is left
        behind where the backend allows. Never raises for a cleanup failure."""

    def __enter__(self) -> "Replacement":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


class StorageWrapper(Storage):
    """A storage that forwards everything to ``inner``: a base for wrappers that change
    one thing (count the bytes read, hook writes). ``wrap(inner)`` makes the wrapper of
    a child or parent folder; the default copies this wrapper around the new inner."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.atomic_write = inner.atomic_write
        self.exclusive_create = inner.exclusive_create
        self.merge_reads_below = inner.merge_reads_below
        self.can_rename = inner.can_rename
        self.can_replace = inner.can_replace

    def wrap(self, inner: Storage) -> "StorageWrapper":
        clone = copy.copy(self)
        StorageWrapper.__init__(clone, inner)
        return clone

    def child(self, name: str) -> Storage:
        return self.wrap(self.inner.child(name))

    def parent(self) -> Storage:
        return self.wrap(self.inner.parent())

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        return self.inner.write_file(name, parts)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(name, offset, out)

    def listdir(self) -> dict[str, int | None]:
        return self.inner.listdir()

    def delete(self, names: Iterable[str]) -> None:
        self.inner.delete(names)

    def remove_folder(self) -> None:
        self.inner.remove_folder()

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(src, dst)

    def open_replace(self, name: str) -> Replacement:
        return self.inner.open_replace(name)

    def __getattr__(self, attr: str):  # backend extras, such as abort_stale_uploads
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)


_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "an I/O error (the device may be failing)",
}


def storage_error(exc: OSError, action: str, where: str) -> StorageError:
    """Translate an ``OSError`` into a ``StorageError`` that says what, where and why."""
    reason = _REASONS.get(exc.errno or 0, exc.strerror or str(exc))
    err = StorageError(f"cannot {action} {where}: {reason} [{type(exc).__name__}: {exc}]")
    err.errno = exc.errno
    return err
