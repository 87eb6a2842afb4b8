"""``MemoryObjectStore``: a ``Storage`` that behaves like S3/GCS/Azure, in memory.

No folders (a "folder" is a key prefix), no rename, no append; a PUT is atomic and
whole (a crash mid-upload leaves nothing), a conditional create (``If-None-Match``)
makes ``write_file`` exclusive, ``open_replace`` is one unconditional PUT of the final
key, and whatever a call acknowledged is durable, so a power cut loses nothing. Operations are numbered like ``SimulatedDisk``'s (kinds ``put``,
``get``, ``list``, ``delete``) for crash points and ``Fault`` rules -- e.g.
``Fault("put", errno.EIO, effect="after")`` is a 5xx whose PUT in fact happened.
"""

from __future__ import annotations

import errno
import random
from typing import Iterable

from ..storage.base import Buffer, Replacement, Storage, storage_error
from .faults import CountedBackend, Fault, OpCounter

__all__ = ["MemoryObjectStore", "ObjectBucket"]


class ObjectBucket(CountedBackend):
    """The objects (key -> bytes) and the operation counter of one simulated bucket."""

    def __init__(self, *, crash_after: int | None = None, faults: Iterable[Fault] = (),
                 latency: "float | dict[str, float]" = 0.0, seed: int | None = 0,
                 stale_listings: int = 0) -> None:
        self.objects: dict[str, bytes] = {}
        self.counter = OpCounter(crash_after, faults, latency, seed)
        self.stale_listings = stale_listings
        self._stale: dict[str, list] = {}

    name = "object-store"

    def crash(self, rng: "random.Random | int | None" = None, mode: str = "random") -> None:
        """A crash of the client: every acknowledged PUT/DELETE is durable, so nothing
        is lost; the bucket works again afterwards."""
        self.counter.revive()
        self._stale.clear()

    def files(self, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix``: key relative to it -> bytes."""
        prefix = prefix.strip("/")
        start = prefix + "/" if prefix else ""
        return {k[len(start):]: v for k, v in sorted(self.objects.items()) if k.startswith(start)}

    def storage(self, path: str = "ckpt") -> "MemoryObjectStore":
        """A ``MemoryObjectStore`` on this bucket under the key prefix ``path``."""
        return MemoryObjectStore(self, path)


class MemoryObjectStore(Storage):
    """An in-memory object store (see module docstring)."""

    atomic_write = True
    exclusive_create = True
    can_replace = True

    def __init__(self, bucket: ObjectBucket | None = None, prefix: str = "") -> None:
        self.bucket = bucket if bucket is not None else ObjectBucket()
        self.prefix = prefix.strip("/")
        self.url = f"memobj://{self.prefix}"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> "MemoryObjectStore":
        return MemoryObjectStore(self.bucket, self._key(name.strip("/")))

    def parent(self) -> "MemoryObjectStore":
        return MemoryObjectStore(self.bucket, self.prefix.rpartition("/")[0])

    def _op(self, kind: str, key: str, action: str) -> None:
        counter = self.bucket.counter
        if counter.tick(kind, key):
            raise counter.die(kind, key)
        try:
            counter.check(kind, key)
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as exc:
            raise storage_error(exc, action, f"{self.url}/{key}") from exc

    def _after(self, kind: str, key: str, action: str) -> None:
        try:
            self.bucket.counter.check(kind, key, effect="after")
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as exc:
            raise storage_error(exc, action, f"{self.url}/{key}") from exc

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        body = b"".join(bytes(memoryview(p).cast("B")) for p in parts)  # upload buffer
        self._store(name, body, exclusive=True)
        return len(body)

    def open_replace(self, name: str) -> Replacement:
        return _Put(self, name)

    def _store(self, name: str, body: bytes, exclusive: bool) -> None:
        """One PUT of ``body`` under ``name`` (conditional on absence if ``exclusive``)."""
        key = self._key(name)
        self._op("put", key, "upload")
        if exclusive and key in self.bucket.objects:  # If-None-Match: * -> 412 Precondition Failed
            raise FileExistsError(errno.EEXIST, "object exists (412 Precondition Failed)", key)
        self._snapshot(key)
        self.bucket.objects[key] = body
        self._after("put", key, "upload")

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        key = self._key(name)
        self._op("get", key, "read")
        data = self.bucket.objects.get(key)
        if data is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{name}")
        view = out.cast("B") if out.format != "B" else out
        piece = data[offset:offset + len(view)]
        if len(piece) < len(view):
            raise EOFError(f"{self.url}/{name} ends before byte {offset + len(view)}")
        view[:] = piece

    def listdir(self) -> dict[str, int | None]:
        start = self.prefix + "/" if self.prefix else ""
        self._op("list", start, "list")
        stale = self.bucket._stale.get(start)
        if stale is not None:
            stale[1] -= 1
            if stale[1] <= 0:
                del self.bucket._stale[start]
            return dict(stale[0])
        return self._list(start)

    def _list(self, start: str) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for key, data in self.bucket.objects.items():
            if key.startswith(start):
                head, sep, _ = key[len(start):].partition("/")
                out[head] = None if sep else len(data)
        return out

    def _snapshot(self, key: str) -> None:
        """Stale listings: remember the folder's listing from before this change."""
        if self.bucket.stale_listings:
            start = key.rpartition("/")[0]
            start = start + "/" if start else ""
            self.bucket._stale.setdefault(start, [self._list(start), self.bucket.stale_listings])

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            key = self._key(name)
            self._op("delete", key, "delete")
            if key in self.bucket.objects:
                self._snapshot(key)
            self.bucket.objects.pop(key, None)
            self._after("delete", key, "delete")

    def remove_folder(self) -> None:
        """Folders are implicit: nothing to do, and no request is made."""


class _Put(Replacement):
    """A replacement on the simulated store: the body is buffered (as an upload
    client's parts would be) and PUT whole under the final key at ``commit``."""

    def __init__(self, store: MemoryObjectStore, name: str) -> None:
        self.store, self.name = store, name
        self.body: bytearray | None = bytearray()

    def write(self, data: Buffer) -> int:
        if self.body is None:
            raise ValueError(f"write to a finished replacement of {self.name}")
        view = memoryview(data).cast("B")
        self.body += view
        self.written += len(view)
        return len(view)

    def commit(self) -> int:
        body, self.body = self.body, None
        assert body is not None
        self.store._store(self.name, bytes(body), exclusive=False)
        return self.written

    def abort(self) -> None:
        self.body = None
