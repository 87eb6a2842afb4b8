"""``SimulatedDisk``: an in-memory filesystem that loses what was not synced at a crash.

It offers the handful of OS calls ``LocalStorage`` makes (``LocalStorage(path,
fs=disk)``), numbers them for crash points, and tracks for every file its durable
content and the writes still pending, and for every folder its durable entries and
the creations and deletions still pending. ``disk.crash(rng)`` is a power cut, as in
SQLite's crash-test layer: every unsynced write is independently kept, dropped or
torn into garbage, and every unsynced folder change independently kept or undone (a
file whose entry is lost disappears with it). A ``DiskProfile`` says how a kind of
filesystem makes things durable and which calls it refuses.
"""

from __future__ import annotations

import errno
import os
import posixpath
import random
from dataclasses import dataclass
from typing import Iterable, Iterator, cast

from ..storage.base import Buffer
from .faults import CountedBackend, Fault, OpCounter, make_error

__all__ = ["DiskProfile", "DISK_PROFILES", "SimulatedDisk"]


@dataclass(frozen=True)
class DiskProfile:
    """How a kind of filesystem behaves, for ``SimulatedDisk``.

    ``entries``: when folder changes (create, delete, mkdir, rename) become durable --
    ``"explicit"`` on fsync of the folder (strict POSIX), ``"sync"`` at once (NFS: the
    server commits metadata before replying), ``"journal"`` when any file is fsynced
    (an ordered metadata journal, as NTFS), ``"object"`` a file's entry together with
    its whole content when it is closed (an object-store FUSE mount uploads then: rclone
    uploads nothing on fsync, s3fs does; deletes are immediate). A process killed while
    writing has its files closed by the kernel, so the mount uploads what it wrote: a
    short file (``crash(mode="keep")``); a power cut loses a file not yet closed. On an
    ``"object"`` disk, opening an existing file with ``O_TRUNC`` starts a new object that
    replaces the old one when it is uploaded (readers see the old one until then).
    ``torn``: unsynced writes may be torn into garbage (else a file is all or nothing).
    ``dir_open_errno`` / ``dir_fsync_errno``: opening / fsyncing a folder fails so.
    ``rename``: ``"atomic"``, ``"nonatomic"`` (a crash in between leaves both names)
    or ``"unsupported"`` (ENOTSUP). ``replace_open_fails``: replacing a file that is
    open fails with PermissionError (Windows). ``append``: O_APPEND and writing to an
    existing file are allowed."""

    name: str
    entries: str = "explicit"
    torn: bool = True
    dir_open_errno: int | None = None
    dir_fsync_errno: int | None = None
    rename: str = "atomic"
    replace_open_fails: bool = False
    append: bool = True
    os_name: str = "posix"


DISK_PROFILES: dict[str, DiskProfile] = {
    "posix": DiskProfile("posix"),
    "nfs": DiskProfile("nfs", entries="sync", rename="nonatomic"),
    "windows": DiskProfile("windows", entries="journal", dir_open_errno=errno.EACCES,
                           replace_open_fails=True),
    "fuse-object": DiskProfile("fuse-object", entries="object", torn=False,
                               dir_fsync_errno=errno.ENOTSUP, rename="unsupported", append=False),
}


class _File:
    __slots__ = ("data", "durable", "pending", "uploaded", "open_count", "replaces")

    def __init__(self) -> None:
        self.data = bytearray()        # what a reader sees now (the page cache)
        self.durable = b""             # what survives a power cut for sure
        self.pending: list[tuple[int, bytes]] = []  # writes since the last fsync
        self.uploaded = False          # fuse-object: the object was PUT (immutable now)
        self.open_count = 0
        self.replaces: "tuple[_Dir, str] | None" = None  # fuse-object: the entry its upload replaces


class _Dir:
    __slots__ = ("entries", "durable")

    def __init__(self) -> None:
        self.entries: dict[str, "_File | _Dir"] = {}   # what a listing shows now
        self.durable: dict[str, "_File | _Dir"] = {}   # what survives a power cut


class _Handle:
    __slots__ = ("node", "path", "flags", "pos")

    def __init__(self, node: "_File | _Dir", path: str, flags: int) -> None:
        self.node, self.path, self.flags, self.pos = node, path, flags, 0


class _Stat:
    def __init__(self, size: int, is_dir: bool) -> None:
        self.st_size = size
        self.st_mode = 0o040755 if is_dir else 0o100644


class _Entry:
    """What ``scandir`` yields: ``name``, ``path``, ``is_dir()``, ``is_file()``, ``stat()``."""

    def __init__(self, name: str, path: str, node: "_File | _Dir") -> None:
        self.name, self.path = name, path
        self._is_dir = isinstance(node, _Dir)
        self._stat = _Stat(0 if isinstance(node, _Dir) else len(node.data), self._is_dir)

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:  # a simulated disk has no links
        return self._is_dir

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return not self.is_dir()

    def stat(self, *, follow_symlinks: bool = True) -> _Stat:
        return self._stat


class _Scan:
    def __init__(self, entries: list[_Entry]) -> None:
        self._entries = entries

    def __enter__(self) -> Iterator[_Entry]:
        return iter(self._entries)

    def __exit__(self, *exc: object) -> None:
        return None

    def __iter__(self) -> Iterator[_Entry]:
        return iter(self._entries)


class _Reader:
    """An unbuffered binary reader over a simulated file (each ``readinto`` is one op)."""

    def __init__(self, disk: "SimulatedDisk", node: _File, path: str) -> None:
        self.disk, self.node, self.path, self.pos = disk, node, path, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else (self.pos + offset if whence == 1 else len(self.node.data) + offset)
        return self.pos

    def readinto(self, out: memoryview) -> int:
        self.disk._op("read", self.path)
        data = self.node.data[self.pos:self.pos + len(out)]
        memoryview(out).cast("B")[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def read(self, n: int = -1) -> bytes:
        buf = bytearray(len(self.node.data) - self.pos if n < 0 else n)
        got = self.readinto(memoryview(buf))
        return bytes(buf[:got])

    def close(self) -> None:
        self.node.open_count -= 1 if self.node.open_count else 0

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _norm(path: str) -> str:
    path = os.fspath(path).replace("\\", "/")
    if len(path) > 1 and path[1] == ":":  # a Windows drive letter from os.path.abspath
        path = path[2:]
    return posixpath.normpath("/" + path.lstrip("/"))


class SimulatedDisk(CountedBackend):
    """An in-memory filesystem with power cuts; pass it as ``LocalStorage(path, fs=disk)``.

    Operation kinds (for ``crash_after`` and ``Fault``): ``open``, ``write``, ``fsync``
    (a file), ``fsync_dir`` (a folder), ``close``, ``mkdir``, ``rmdir``, ``unlink``,
    ``rename``, ``listdir``, ``stat``, ``read``. Options: ``crash_after=k`` (the k-th
    operation crashes; a crashing write may be torn), ``faults`` (``Fault`` rules,
    e.g. ``Fault("fsync", errno.EIO)``), ``capacity`` (bytes: ENOSPC beyond),
    ``read_only`` (EROFS for every change), ``latency`` (seconds per operation)."""

    def __init__(self, profile: "str | DiskProfile" = "posix", *, crash_after: int | None = None,
                 faults: Iterable[Fault] = (), capacity: int | None = None, read_only: bool = False,
                 latency: "float | dict[str, float]" = 0.0, seed: int | None = 0) -> None:
        self.profile = DISK_PROFILES[profile] if isinstance(profile, str) else profile
        self.counter = OpCounter(crash_after, faults, latency, seed)
        self.capacity = capacity
        self.read_only = read_only
        self.root = _Dir()
        self._fds: dict[int, _Handle] = {}
        self._next_fd = 3
        self._journal: list[tuple[_Dir, str, "_File | _Dir | None"]] = []
        self._replacing: list[_File] = []  # fuse-object: new objects not uploaded yet

    # -- bookkeeping ------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Like ``os.name``."""
        return self.profile.os_name

    def _op(self, kind: str, path: str) -> bool:
        """Count an operation; True if it is the crashing one (caller tears, then dies)."""
        if self.counter.tick(kind, path):
            if kind != "write":
                raise self.counter.die(kind, path)
            return True
        if self.read_only and kind in ("write", "mkdir", "rmdir", "unlink", "rename") :
            raise make_error(errno.EROFS, path)
        self.counter.check(kind, path)
        return False

    def _after(self, kind: str, path: str) -> None:
        self.counter.check(kind, path, effect="after")

    def _lookup(self, path: str) -> "_File | _Dir":
        node: _File | _Dir = self.root
        for part in _norm(path).split("/")[1:]:
            if not part:
                continue
            if not isinstance(node, _Dir):
                raise make_error(errno.ENOTDIR, path)
            if part not in node.entries:
                raise make_error(errno.ENOENT, path)
            node = node.entries[part]
        return node

    def _parent(self, path: str) -> tuple[_Dir, str]:
        head, tail = posixpath.split(_norm(path))
        parent = self._lookup(head)
        if not isinstance(parent, _Dir):
            raise make_error(errno.ENOTDIR, path)
        return parent, tail

    def _set_entry(self, folder: _Dir, name: str, node: "_File | _Dir | None", *, durable_now: bool = False) -> None:
        if node is None:
            folder.entries.pop(name, None)
        else:
            folder.entries[name] = node
        mode = self.profile.entries
        if durable_now or mode == "sync" or (mode == "object" and not isinstance(node, _File)):
            self._make_durable(folder, name)
        elif mode == "journal":
            self._journal.append((folder, name, node))

    @staticmethod
    def _make_durable(folder: _Dir, name: str) -> None:
        if name in folder.entries:
            folder.durable[name] = folder.entries[name]
        else:
            folder.durable.pop(name, None)

    def _commit_journal(self) -> None:
        for folder, name, _ in self._journal:
            self._make_durable(folder, name)
        self._journal.clear()

    def _used(self) -> int:
        total, stack = 0, [self.root]
        while stack:
            d = stack.pop()
            for node in d.entries.values():
                if isinstance(node, _Dir):
                    stack.append(node)
                else:
                    total += len(node.data)
        return total

    # -- setup helpers (not operations; never crash) -----------------------------------
    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents, durably, without counting operations."""
        node = self.root
        for part in _norm(path).split("/")[1:]:
            if not part:
                continue
            if part not in node.entries:
                child = _Dir()
                node.entries[part] = node.durable[part] = child
            node = cast(_Dir, node.entries[part])  # makedirs is only called on folder paths

    def files(self, path: str = "/") -> dict[str, bytes]:
        """Every file under ``path`` (what a reader sees now): relative path -> bytes."""
        out: dict[str, bytes] = {}

        def walk(d: _Dir, prefix: str) -> None:
            for name, node in sorted(d.entries.items()):
                if isinstance(node, _Dir):
                    walk(node, prefix + name + "/")
                else:
                    out[prefix + name] = bytes(node.data)
        start = self._lookup(path)
        if isinstance(start, _Dir):
            walk(start, "")
        return out

    def storage(self, path: str = "/ckpt"):
        """A ``LocalStorage`` on this disk at ``path``."""
        from ..storage.local import LocalStorage
        return LocalStorage(path, fs=self)

    # -- the OS calls LocalStorage makes -----------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o777) -> int:
        crashing = self._op("open", path)
        assert not crashing
        prof = self.profile
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        writing = flags & (os.O_WRONLY | os.O_RDWR)
        if node is not None and flags & os.O_CREAT and flags & os.O_EXCL:
            raise make_error(errno.EEXIST, path)
        if node is None:
            if not flags & os.O_CREAT:
                raise make_error(errno.ENOENT, path)
            if self.read_only:
                raise make_error(errno.EROFS, path)
            node = _File()
            self._set_entry(parent, name, node)
        elif isinstance(node, _Dir):
            if writing:
                raise make_error(errno.EISDIR, path)
            if prof.dir_open_errno:
                raise make_error(prof.dir_open_errno, path)
        elif writing and flags & os.O_TRUNC and prof.entries == "object":
            if self.read_only:
                raise make_error(errno.EROFS, path)
            node = _File()  # a new object; the old one stays visible until it is uploaded
            node.replaces = (parent, name)
            self._replacing.append(node)
        else:
            if writing and self.read_only:
                raise make_error(errno.EROFS, path)
            if writing and (not prof.append or node.uploaded) and (len(node.data) or node.uploaded):
                raise make_error(errno.EPERM, path)
            if flags & os.O_APPEND and not prof.append:
                raise make_error(errno.EINVAL, path)
            if flags & os.O_TRUNC and writing:
                node.pending.append((0, b""))
                del node.data[:]
        fd = self._next_fd
        self._next_fd += 1
        self._fds[fd] = _Handle(node, _norm(path), flags)
        if isinstance(node, _File):
            node.open_count += 1
        self._after("open", path)
        return fd

    def _handle(self, fd: int, path_for_error: str = "") -> _Handle:
        try:
            return self._fds[fd]
        except KeyError:
            raise make_error(errno.EBADF, path_for_error) from None

    def write(self, fd: int, data: Buffer) -> int:
        h = self._fds.get(fd)
        path = h.path if h else f"<fd {fd}>"
        crashing = self._op("write", path)
        h = self._handle(fd, path)
        node = h.node
        if not isinstance(node, _File) or not h.flags & (os.O_WRONLY | os.O_RDWR):
            raise make_error(errno.EBADF, path)
        if node.uploaded:
            raise make_error(errno.EPERM, path)
        view = bytes(memoryview(data).cast("B"))
        if crashing:  # the process dies during this write: part of it may have landed
            view = view[:self.counter.rng.randint(0, len(view))]
        elif self.capacity is not None:
            room = self.capacity - self._used()
            if room <= 0:
                raise make_error(errno.ENOSPC, path)
            view = view[:room]
        pos = len(node.data) if h.flags & os.O_APPEND else h.pos
        if view:
            if pos > len(node.data):
                node.data.extend(bytes(pos - len(node.data)))
            node.data[pos:pos + len(view)] = view
            node.pending.append((pos, view))
        h.pos = pos + len(view)
        if crashing:
            raise self.counter.die("write", path)
        self._after("write", path)
        return len(view)

    def fsync(self, fd: int) -> None:
        h = self._fds.get(fd)
        path = h.path if h else f"<fd {fd}>"
        kind = "fsync_dir" if h is not None and isinstance(h.node, _Dir) else "fsync"
        self._op(kind, path)
        h = self._handle(fd, path)
        node = h.node
        if isinstance(node, _Dir):
            if self.profile.dir_fsync_errno:
                raise make_error(self.profile.dir_fsync_errno, path)
            if self.profile.entries == "explicit":
                for name in set(node.entries) | set(node.durable):
                    self._make_durable(node, name)
            self._after(kind, path)
            return
        if self.profile.entries != "object":  # a FUSE object mount uploads on close only
            self._sync_file(node, h.path)
        self._after(kind, path)

    def _sync_file(self, node: _File, path: str) -> None:
        node.durable = bytes(node.data)
        node.pending.clear()
        mode = self.profile.entries
        if mode == "journal":
            self._commit_journal()
        elif mode == "object" and not node.uploaded:  # at close
            node.uploaded = True
            if node.replaces is not None:
                self._upload_replacement(node)
                return
            parent, name = self._parent(path)
            if parent.entries.get(name) is node:
                self._make_durable(parent, name)

    def _upload_replacement(self, node: _File) -> None:
        """fuse-object: a new object written over an existing name takes its place."""
        assert node.replaces is not None
        parent, name = node.replaces
        node.replaces = None
        self._replacing.remove(node)
        parent.entries[name] = node
        self._make_durable(parent, name)

    def close(self, fd: int) -> None:
        h = self._fds.get(fd)
        path = h.path if h else f"<fd {fd}>"
        self._op("close", path)
        h = self._fds.pop(fd, None)
        if h is None:
            raise make_error(errno.EBADF, path)
        if isinstance(h.node, _File):
            h.node.open_count -= 1
            if self.profile.entries == "object" and h.flags & (os.O_WRONLY | os.O_RDWR):
                self._sync_file(h.node, h.path)  # the mount uploads the object on close
        self._after("close", path)

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        self._op("mkdir", path)
        parent, name = self._parent(path)
        if name in parent.entries:
            raise make_error(errno.EEXIST, path)
        self._set_entry(parent, name, _Dir())
        self._after("mkdir", path)

    def rmdir(self, path: str) -> None:
        self._op("rmdir", path)
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            raise make_error(errno.ENOENT, path)
        if not isinstance(node, _Dir):
            raise make_error(errno.ENOTDIR, path)
        if node.entries:
            raise make_error(errno.ENOTEMPTY, path)
        self._set_entry(parent, name, None)
        self._after("rmdir", path)

    def unlink(self, path: str) -> None:
        self._op("unlink", path)
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            raise make_error(errno.ENOENT, path)
        if isinstance(node, _Dir):
            raise make_error(errno.EISDIR, path)
        # fuse-object: a DELETE is immediate and durable
        self._set_entry(parent, name, None, durable_now=self.profile.entries == "object")
        self._after("unlink", path)

    def rename(self, src: str, dst: str) -> None:
        """POSIX rename (replaces ``dst``); see ``DiskProfile.rename``."""
        self._op("rename", src)
        prof = self.profile
        if prof.rename == "unsupported":
            raise make_error(errno.ENOTSUP, src)
        sparent, sname = self._parent(src)
        dparent, dname = self._parent(dst)
        node = sparent.entries.get(sname)
        if node is None:
            raise make_error(errno.ENOENT, src)
        target = dparent.entries.get(dname)
        if prof.replace_open_fails and isinstance(target, _File) and target.open_count:
            raise make_error(errno.EACCES, dst)
        self._set_entry(dparent, dname, node)
        if prof.rename == "nonatomic":  # the link and the unlink are two steps
            self._op("rename", src)
        self._set_entry(sparent, sname, None)
        self._after("rename", src)

    replace = rename

    def isdir(self, path: str) -> bool:
        self._op("stat", path)
        try:
            return isinstance(self._lookup(path), _Dir)
        except OSError:
            return False

    def exists(self, path: str) -> bool:
        self._op("stat", path)
        try:
            self._lookup(path)
            return True
        except OSError:
            return False

    def stat(self, path: str) -> _Stat:
        self._op("stat", path)
        node = self._lookup(path)
        return _Stat(len(node.data) if isinstance(node, _File) else 0, isinstance(node, _Dir))

    lstat = stat  # no symlinks on a simulated disk

    def scandir(self, path: str) -> _Scan:
        self._op("listdir", path)
        node = self._lookup(path)
        if not isinstance(node, _Dir):
            raise make_error(errno.ENOTDIR, path)
        base = _norm(path)
        return _Scan([_Entry(n, posixpath.join(base, n), c) for n, c in sorted(node.entries.items())])

    def listdir(self, path: str) -> list[str]:
        with self.scandir(path) as it:
            return [e.name for e in it]

    def open_reader(self, path: str, follow_symlinks: bool = False) -> _Reader:
        self._op("open", path)
        node = self._lookup(path)
        if isinstance(node, _Dir):
            raise make_error(errno.EISDIR, path)
        node.open_count += 1
        return _Reader(self, node, _norm(path))

    # -- the power cut -----------------------------------------------------------------
    def crash(self, rng: "random.Random | int | None" = None, mode: str = "random") -> None:
        """A power cut, then a restart: what was not durable is kept, lost or torn.

        ``mode``: ``"random"`` (each unsynced write independently kept, dropped or torn
        into garbage; each unsynced folder change independently kept or undone),
        ``"keep"`` (only the process died: the OS still wrote everything back) or
        ``"drop"`` (every unsynced change is lost). Afterwards the disk works again:
        no crash armed, no open files."""
        if not isinstance(rng, random.Random):
            rng = random.Random(rng)
        prof = self.profile
        for node in list(self._replacing):  # fuse-object: the mount uploads them if it lives on
            if mode == "keep":
                node.durable, node.pending, node.uploaded = bytes(node.data), [], True
                self._upload_replacement(node)
        self._replacing.clear()
        # 1. folder entries: durable ones stay; pending changes are kept or undone
        if prof.entries == "journal":
            cut = {"keep": len(self._journal), "drop": 0}.get(mode)
            if cut is None:
                cut = rng.randint(0, len(self._journal))
            for folder, name, _ in self._journal[:cut]:
                self._make_durable(folder, name)
            self._journal.clear()
        dirs, files = self._all_nodes()
        for d in dirs:
            final: dict[str, _File | _Dir] = {}
            for name in sorted(set(d.entries) | set(d.durable)):
                now, before = d.entries.get(name), d.durable.get(name)
                if now is before:
                    pick = now
                elif prof.entries == "journal":
                    pick = before
                elif mode == "keep":
                    pick = now
                elif mode == "drop":
                    pick = before
                else:
                    pick = now if rng.random() < 0.5 else before
                if pick is not None:
                    final[name] = pick
            d.entries = dict(final)
            d.durable = dict(final)
        # 2. file contents: durable bytes, then each pending write kept, dropped or torn
        for f in files:
            if prof.entries == "object" and not f.uploaded:
                # never uploaded: the object does not exist (its entry was pending too)
                data = bytearray(f.data) if mode == "keep" else bytearray()
                f.uploaded = mode == "keep"
            else:
                data = bytearray(f.durable)
                for off, chunk in f.pending:
                    if not chunk and off == 0:  # a truncate
                        choice = {"keep": "keep", "drop": "drop"}.get(mode) or rng.choice(("keep", "drop"))
                        if choice == "keep":
                            del data[:]
                        continue
                    choice = mode if mode in ("keep", "drop") else rng.choice(("keep", "drop", "torn"))
                    if choice == "drop" or (choice == "torn" and not prof.torn):
                        continue
                    if choice == "torn":
                        cut = rng.randint(0, len(chunk))
                        chunk = chunk[:cut] + rng.randbytes(rng.randint(0, len(chunk) - cut))
                    if off > len(data):
                        data.extend(bytes(off - len(data)))
                    data[off:off + len(chunk)] = chunk
            f.data = data
            f.durable = bytes(data)
            f.pending = []
            f.open_count = 0
        # fuse-object: objects that were never uploaded vanish with their entries
        if prof.entries == "object" and mode != "keep":
            for d in dirs:
                for name in [n for n, c in d.entries.items() if isinstance(c, _File) and not c.uploaded]:
                    del d.entries[name]
                    d.durable.pop(name, None)
        self._fds.clear()
        self.counter.revive()

    def _all_nodes(self) -> tuple[list[_Dir], list[_File]]:
        """Every folder and file reachable now or after a crash."""
        dirs: list[_Dir] = []
        files: list[_File] = []
        seen: set[int] = set()
        stack: list[_File | _Dir] = [self.root]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, _Dir):
                dirs.append(node)
                stack.extend(node.entries.values())
                stack.extend(node.durable.values())
            else:
                files.append(node)
        return dirs, files
