"""Crashes and injected errors: ``SimulatedCrash``, ``Fault`` and ``FaultyStorage``.

Every simulated backend here (and ``FaultyStorage``, which wraps any ``Storage``)
numbers its operations 1, 2, 3, ... With ``crash_after=k`` the k-th operation and
every later one raise ``SimulatedCrash``: the process is dead, so no cleanup code may
reach storage any more. ``SimulatedCrash`` derives from ``BaseException`` so that
``except Exception`` (or ``except OSError``) in library code cannot swallow it.
"""

from __future__ import annotations

import copy

import errno as _errno
import os
import random
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..errors import StorageError
from ..storage.base import Buffer, Replacement, Storage, storage_error

__all__ = ["SimulatedCrash", "Fault", "OpCounter", "FaultyStorage", "make_error"]


class SimulatedCrash(BaseException):
    """The simulated process died at storage operation number ``op``.

    A ``BaseException`` (like ``KeyboardInterrupt``), so ``except Exception`` cannot
    swallow it; once raised, every later operation on the same backend raises it too."""

    def __init__(self, op: int, kind: str, path: str) -> None:
        super().__init__(f"simulated crash at operation {op} ({kind} {path})")
        self.op, self.kind, self.path = op, kind, path

    def __reduce__(self):
        return (SimulatedCrash, (self.op, self.kind, self.path))


def make_error(error: "int | BaseException | type[BaseException]", path: str = "") -> BaseException:
    """An exception from an errno (``errno.ENOSPC`` -> ``OSError`` with the matching
    subclass, e.g. ``PermissionError`` for ``EACCES``), an exception class or instance."""
    if isinstance(error, int):
        return OSError(error, os.strerror(error), path)
    if isinstance(error, type):
        return error(path) if not issubclass(error, OSError) else error(_errno.EIO, "injected", path)
    return error


@dataclass
class Fault:
    """An injected error: operations of kind ``op`` (``"*"``: any) whose path contains
    ``path`` raise ``error``.

    ``after`` matching operations succeed first, then ``times`` fail (``None``: every
    later one; ``times=2`` makes a transient error that goes away). With
    ``effect="after"`` the operation takes effect and *then* reports the error (an
    ambiguous outcome, like a timed-out PUT that in fact succeeded)."""

    op: str
    error: "int | BaseException | type[BaseException]"
    path: str | None = None
    after: int = 0
    times: int | None = None
    effect: str = "before"
    seen: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def matches(self, op: str, path: str) -> bool:
        return (self.op in ("*", op)) and (self.path is None or self.path in path)

    def trigger(self, op: str, path: str) -> BaseException | None:
        """Count a matching operation; the error to raise, if this one fails."""
        if not self.matches(op, path):
            return None
        self.seen += 1
        if self.seen <= self.after or (self.times is not None and self.fired >= self.times):
            return None
        self.fired += 1
        return make_error(self.error, path)


class OpCounter:
    """Operation numbering, the crash point, injected faults and latency, shared by
    every handle of one simulated backend (a disk, a store, a ``FaultyStorage`` tree)."""

    def __init__(self, crash_after: int | None = None, faults: Iterable[Fault] = (),
                 latency: "float | dict[str, float]" = 0.0, seed: int | None = 0) -> None:
        self.ops = 0
        self.crash_after = crash_after
        self.faults: list[Fault] = list(faults)
        self.latency = latency
        self.rng = random.Random(seed)
        self.crashed: SimulatedCrash | None = None
        self.log: list[tuple[int, str, str]] = []

    def tick(self, kind: str, path: str, *, count: bool = True) -> bool:
        """Start an operation: raise ``SimulatedCrash`` if the process is (now) dead;
        return True if this operation is the one that crashes *while running* (a write
        that may be torn) -- the caller then applies part of it and calls ``die``."""
        if self.crashed is not None:
            raise SimulatedCrash(self.ops, kind, path)
        if not count:
            return False
        self.ops += 1
        self.log.append((self.ops, kind, path))
        if self.crash_after is not None and self.ops >= self.crash_after:
            return True
        self._delay(kind)
        return False

    def die(self, kind: str, path: str) -> "SimulatedCrash":
        self.crashed = SimulatedCrash(self.ops, kind, path)
        return self.crashed

    def check(self, kind: str, path: str, effect: str = "before") -> None:
        """Raise the first injected fault that fires for this operation."""
        for fault in self.faults:
            if fault.effect == effect:
                exc = fault.trigger(kind, path)
                if exc is not None:
                    raise exc

    def _delay(self, kind: str) -> None:
        delay = self.latency.get(kind, 0.0) if isinstance(self.latency, dict) else self.latency
        if delay:
            time.sleep(delay)

    def revive(self) -> None:
        """After a crash: the process restarted; operations work again, no crash armed."""
        self.crashed = None
        self.crash_after = None


class FaultyStorage(Storage):
    """Wraps any ``Storage``: numbers its operations, crashes at one, injects errors.

    Operation kinds: ``write_file``, ``read``, ``listdir``, ``delete`` (one per name),
    ``remove_folder``, ``fsync`` (checked after ``write_file`` handed over all its
    bytes: an EIO there means the data may not be durable; the save must fail) and
    ``replace`` (the commit of an ``open_replace``; a crash there leaves the old file).
    Options:

    - ``crash_after=k``: the k-th operation and every later one raise ``SimulatedCrash``;
      a crash inside ``write_file`` may be *torn* (``torn=True``): a random prefix of the
      bytes reaches the inner storage first, as when a process dies mid-write.
    - ``faults``: ``Fault`` rules, e.g. ``Fault("read", errno.EIO)``,
      ``Fault("write_file", errno.EACCES)``, ``Fault("*", errno.EROFS)``;
      ``Fault("delete", PermissionError, times=2)`` is transient.
    - ``enospc_after_bytes=N``: writes fail with ENOSPC once N bytes were written in all.
    - ``read_only=True``: every mutation fails with EROFS.
    - ``stale_listings=n``: after a change to a folder, its next ``n`` listings return
      the snapshot taken before the change (like s3fs's listing cache).
    - ``latency``: seconds to sleep per operation (a float, or a dict per kind).
    - ``counter``: another backend's ``OpCounter`` (``disk.counter``) to number the
      operations in, instead of a new one: a process's operations on several storages
      (a node's disk and the durable root it uploads to) crash at one point of one
      sequence. ``crash_after``, ``faults``, ``latency`` and ``seed`` are then the counter's.

    Children (``child(name)``) share the counter, faults and byte budget."""

    def __init__(self, inner: Storage, *, crash_after: int | None = None, faults: Iterable[Fault] = (),
                 enospc_after_bytes: int | None = None, read_only: bool = False,
                 stale_listings: int = 0, latency: "float | dict[str, float]" = 0.0,
                 torn: bool = True, seed: int | None = 0, counter: "OpCounter | None" = None,
                 _shared: "_Shared | None" = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.atomic_write = inner.atomic_write
        self.exclusive_create = inner.exclusive_create
        self.can_replace = inner.can_replace
        if _shared is None:
            _shared = _Shared(counter or OpCounter(crash_after, faults, latency, seed), enospc_after_bytes,
                              read_only, stale_listings, torn)
        self._s = _shared

    # -- state shared by the whole tree -----------------------------------------------
    @property
    def counter(self) -> OpCounter:
        return self._s.counter

    @property
    def ops(self) -> int:
        """Operations performed so far (the crash point of the last one)."""
        return self._s.counter.ops

    @property
    def crash_after(self) -> int | None:
        return self._s.counter.crash_after

    @crash_after.setter
    def crash_after(self, k: int | None) -> None:
        self._s.counter.crash_after = k

    @property
    def crashed(self) -> SimulatedCrash | None:
        """The crash, once it happened."""
        return self._s.counter.crashed

    @property
    def faults(self) -> list[Fault]:
        return self._s.counter.faults

    @property
    def log(self) -> list[tuple[int, str, str]]:
        """(number, kind, path) of every operation so far."""
        return self._s.counter.log

    @property
    def bytes_written(self) -> int:
        return self._s.written

    def inject(self, op: str, error: "int | BaseException | type[BaseException]", **kw) -> Fault:
        """Add a ``Fault`` rule (see ``Fault``) and return it."""
        fault = Fault(op, error, **kw)
        self._s.counter.faults.append(fault)
        return fault

    def revive(self) -> None:
        """The process restarted after a crash: operations work again."""
        self._s.counter.revive()

    # -- Storage ----------------------------------------------------------------------
    def child(self, name: str) -> "FaultyStorage":
        return FaultyStorage(self.inner.child(name), _shared=self._s)

    def parent(self) -> "FaultyStorage":
        return FaultyStorage(self.inner.parent(), _shared=self._s)

    def _start(self, kind: str, where: str) -> bool:
        counter = self._s.counter
        if counter.tick(kind, where):
            raise counter.die(kind, where)
        return False

    def _fail(self, kind: str, where: str, action: str, effect: str = "before") -> None:
        try:
            if self._s.read_only and kind in _MUTATIONS:
                raise make_error(_errno.EROFS, where)
            self._s.counter.check(kind, where, effect)
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise storage_error(exc, action, where) from exc

    def _folder_of(self, name: str) -> tuple[Storage, str]:
        head, _, tail = name.rpartition("/")
        return (self.inner.child(head) if head else self.inner), tail

    def _before_change(self, name: str) -> None:
        if self._s.stale_listings:
            folder, _ = self._folder_of(name)
            if folder.url not in self._s.stale:
                self._s.stale[folder.url] = [folder.listdir(), self._s.stale_listings]

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        where = f"{self.url}/{name}"
        counter = self._s.counter
        crashing = counter.tick("write_file", where)
        if not crashing:
            self._fail("write_file", where, "create")
        self._before_change(name)
        budget = self._s.budget()
        torn_at = None
        if crashing:
            if not self._s.torn:
                raise counter.die("write_file", where)
            torn_at = counter.rng.randrange(0, 1 << 62)  # fraction picked below

        def feed() -> Iterator[Buffer]:
            total = 0
            parts_list = [memoryview(p).cast("B") for p in parts]
            size = sum(len(p) for p in parts_list)
            stop = None if torn_at is None else (torn_at % (size + 1))
            for view in parts_list:
                if stop is not None and total + len(view) >= stop:
                    if stop > total:
                        yield view[:stop - total]
                    raise counter.die("write_file", where)
                if budget is not None and self._s.written + len(view) > budget:
                    room = max(0, budget - self._s.written)
                    if room:
                        self._s.written += room
                        yield view[:room]
                    raise make_error(_errno.ENOSPC, where)
                self._s.written += len(view)
                total += len(view)
                yield view
            if stop is not None:
                raise counter.die("write_file", where)

        try:
            n = self.inner.write_file(name, feed())
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise storage_error(exc, "write", where) from exc
        self._fail("fsync", where, "sync")
        self._fail("write_file", where, "write", effect="after")
        return n

    def open_replace(self, name: str) -> Replacement:
        where = f"{self.url}/{name}"
        if self._s.read_only:
            raise storage_error(OSError(_errno.EROFS, os.strerror(_errno.EROFS), where), "replace", where)
        return _FaultyReplacement(self, self.inner.open_replace(name), where)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        where = f"{self.url}/{name}"
        self._start("read", where)
        self._fail("read", where, "read")
        self.inner.read_into(name, offset, out)

    def listdir(self) -> dict[str, int | None]:
        self._start("listdir", self.url)
        self._fail("listdir", self.url, "list")
        stale = self._s.stale.get(self.url)
        if stale is not None:
            stale[1] -= 1
            if stale[1] <= 0:
                del self._s.stale[self.url]
            return dict(stale[0])
        return self.inner.listdir()

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            where = f"{self.url}/{name}"
            self._start("delete", where)
            self._fail("delete", where, "delete")
            self._before_change(name)
            self.inner.delete([name])
            self._fail("delete", where, "delete", effect="after")

    def remove_folder(self) -> None:
        self._start("remove_folder", self.url)
        self._fail("remove_folder", self.url, "remove folder")
        self.inner.remove_folder()


_MUTATIONS = {"write_file", "delete", "remove_folder", "fsync", "replace"}


class _FaultyReplacement(Replacement):
    """A replacement through ``FaultyStorage``: its bytes count against the ENOSPC
    budget, and its commit is one operation (``replace``) that can crash or fail."""

    def __init__(self, owner: FaultyStorage, inner: Replacement, where: str) -> None:
        self.owner, self.inner, self.where = owner, inner, where

    def write(self, data: Buffer) -> int:
        shared = self.owner._s
        n = len(memoryview(data).cast("B"))
        budget = shared.budget()
        if budget is not None and shared.written + n > budget:
            raise storage_error(OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC), self.where), "write", self.where)
        shared.written += n
        self.written += n
        return self.inner.write(data)

    def commit(self) -> int:
        try:
            self.owner._start("replace", self.where)
            self.owner._fail("replace", self.where, "replace")
        except Exception:
            self.inner.abort()
            raise
        n = self.inner.commit()
        self.owner._fail("replace", self.where, "replace", effect="after")
        return n

    def abort(self) -> None:
        self.inner.abort()


class _Shared:
    def __init__(self, counter: OpCounter, enospc_after_bytes: int | None, read_only: bool,
                 stale_listings: int, torn: bool) -> None:
        self.counter = counter
        self.enospc_after_bytes = enospc_after_bytes
        self.read_only = read_only
        self.stale_listings = stale_listings
        self.torn = torn
        self.written = 0
        self.stale: dict[str, list] = {}

    def budget(self) -> int | None:
        return self.enospc_after_bytes


class CountedBackend:
    """Shared face of the simulated backends: their operation counter, crash point,
    fault rules and cloning, all kept in ``self.counter`` (an ``OpCounter``)."""

    counter: OpCounter

    @property
    def ops(self) -> int:
        return self.counter.ops

    @property
    def crash_after(self) -> int | None:
        return self.counter.crash_after

    @crash_after.setter
    def crash_after(self, k: int | None) -> None:
        self.counter.crash_after = k

    @property
    def crashed(self):
        """The ``SimulatedCrash``, once the process died."""
        return self.counter.crashed

    @property
    def log(self) -> list[tuple[int, str, str]]:
        return self.counter.log

    def inject(self, op: str, error, **kw) -> Fault:
        """Add a ``Fault`` rule (see ``Fault``) and return it."""
        fault = Fault(op, error, **kw)
        self.counter.faults.append(fault)
        return fault

    def clone(self):
        """An independent copy (contents, pending writes, faults); the op count restarts."""
        twin = copy.deepcopy(self)
        twin.counter.ops = 0
        twin.counter.log = []
        return twin
