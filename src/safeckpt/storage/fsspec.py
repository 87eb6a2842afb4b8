"""Object stores and other fsspec filesystems (``gs://``, ``az://``, ``memory://``, ...).

Nothing here renames: every file is one object written once under its final name. A
file that fits in one part is created by one request that carries the create-only
condition (fsspec's ``pipe_file(..., mode="create")``: ``ifGenerationMatch=0`` on GCS,
``If-None-Match: *`` on Azure); a larger one is streamed with fsspec's ``"xb"`` mode,
where the condition rides on the upload's completion (GCS's resumable uploads: enforced
by GCS, not by every emulator; Azure's block list commit). Exclusive create is claimed
for the filesystems that send such a condition (``CONDITIONAL_CREATE_PROTOCOLS``, each
tested against an emulator that enforces it), not for the rest (``memory://`` checks,
then creates). ``open_replace`` streams the
final object with ``"wb"`` on an object store (it appears whole when its upload
completes), and on other fsspec filesystems (``memory://``, ...) writes a temporary
name in the same folder and moves it over the name. S3 has a class of its own
(``s3.S3Storage``) that calls the S3 API directly, so that each guarantee is explicit
rather than left to s3fs's file layer:

- every create is conditional (``If-None-Match: *``), zero-byte files included (s3fs's
  ``"xb"`` mode skips the condition for them and silently overwrites);
- a lost race answers 412, which s3fs turns into ``FileExistsError`` on AWS and moto but
  into ``OSError(EINVAL)`` on SeaweedFS (no ``Condition`` field): both become
  ``FileExistsError``;
- files larger than one part are uploaded as a multipart upload whose parts are cut
  from the stream as it comes and sent in parallel (bounded memory), completed with the
  same condition, and aborted on any error;
- a PUT whose outcome is unknown (5xx, timeout, or a 412 on a retry of our own request)
  is settled by looking at the object: every PUT carries a random write token in its
  user metadata, and if the object carries ours, it succeeded (identical bytes from
  another writer do not count);
- listings bypass s3fs's listing cache, so another writer's files are never invisible.

The error translation (``object_store_error``) is shared by both.
"""

from __future__ import annotations

import errno
import itertools
from typing import Any, Iterable, Iterator

from ..errors import StorageError
from .base import Buffer, Replacement, Storage
from ..format.names import is_replace_temp, replace_temp_name
from .urls import install_hint, url_scheme

try:
    import fsspec
except ImportError:  # pragma: no cover - exercised only without the extra
    fsspec = None

#: fsspec protocols whose folders are implicit (prefixes): ``remove_folder`` is a no-op
OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}
#: fsspec protocols whose filesystem makes a create conditional, so that the store refuses
#: it when the name exists (gcsfs and adlfs); a race of creates has exactly one winner
CONDITIONAL_CREATE_PROTOCOLS = {"gs", "gcs", "az", "abfs", "abfss"}
PART_SIZE = 64 << 20  # multipart part size; S3 needs at least 5 MiB for all but the last
MAX_PARTS = 10_000
PARALLEL_PARTS = 4  # parts in flight at once (memory: about (PARALLEL_PARTS + 1) * PART_SIZE)
READ_PIECE = 16 << 20  # large range reads are split into pieces fetched concurrently
READ_BATCH = 8
WRITE_TOKEN = "safeckpt-write"  # user metadata naming the request that created an object

_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                     "InvalidClientTokenId", "AuthorizationHeaderMalformed", "UnrecognizedClientException"}


def bytes_view(part: Buffer) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def client_error(exc: BaseException) -> tuple[str | None, int | None]:
    """(S3 error code, HTTP status) of a botocore error, possibly wrapped by s3fs."""
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return code, status
    return None, None


def is_backend_error(exc: BaseException) -> bool:
    """An error of the storage (s3fs/botocore/aiohttp/timeouts), not of the caller."""
    module = type(exc).__module__ or ""
    return isinstance(exc, (OSError, TimeoutError)) or module.split(".")[0] in (
        "botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec")


def is_precondition_failed(exc: BaseException) -> bool:
    code, status = client_error(exc)
    return status == 412 or code == "PreconditionFailed" or isinstance(exc, FileExistsError)


def is_definite(exc: BaseException) -> bool:
    """True when the server certainly refused the request (a 4xx other than 408/409/412/429)."""
    code, status = client_error(exc)
    if status is None:
        return isinstance(exc, (PermissionError, FileNotFoundError))
    return 400 <= status < 500 and status not in (408, 409, 412, 429)


def object_store_error(exc: BaseException, action: str, where: str, endpoint: str | None = None) -> StorageError:
    """Translate an s3fs/botocore/fsspec failure into a ``StorageError`` that says why."""
    code, status = client_error(exc)
    name = type(exc).__name__
    detail = str(exc)
    err_no = getattr(exc, "errno", None)
    if code in _CREDENTIAL_CODES or (status == 403 and code not in ("AccessDenied",)) \
            or "NoCredentialsError" in name or "PartialCredentialsError" in name:
        reason = ("the object store rejected the credentials (wrong or missing key/secret: pass "
                  "storage_options={'key': ..., 'secret': ...} or set AWS credentials)")
        err_no = errno.EACCES
    elif code == "AccessDenied" or isinstance(exc, PermissionError):
        reason = ("access denied: the credentials were rejected or lack permission for this "
                  "bucket/prefix")
        err_no = errno.EACCES
    elif code == "NoSuchBucket":
        bucket = where.split("://", 1)[-1].split("/", 1)[0]
        reason = f"the bucket {bucket!r} does not exist (create it, or fix the URL)"
        err_no = errno.ENOENT
    elif code in ("QuotaExceeded", "EntityTooLarge") or err_no == errno.ENOSPC:
        reason = f"the store refused the size ({code or 'no space'})"
        err_no = errno.ENOSPC
    elif "EndpointConnectionError" in name or "ConnectTimeout" in name or "ConnectionError" in name \
            or isinstance(exc, ConnectionError):
        reason = f"cannot reach the object store{f' at {endpoint}' if endpoint else ''} (is it running?)"
        err_no = errno.ECONNREFUSED
    elif status is not None and status >= 500:
        reason = f"the object store failed with HTTP {status} ({code}); the operation may be retried"
        err_no = errno.EIO
    else:
        reason = f"{code or name}"
    err = StorageError(f"cannot {action} {where}: {reason} [{name}: {detail}]")
    err.errno = err_no
    return err


class FsspecStorage(Storage):
    """A folder (key prefix) on any fsspec filesystem (``S3Storage`` for ``s3://``)."""

    atomic_write = True  # an object appears whole, on the completion of its PUT
    merge_reads_below = 32 << 20  # a ranged GET costs a round trip: fetch neighbours together
    # claimed per filesystem (``CONDITIONAL_CREATE_PROTOCOLS``): elsewhere a create is
    # refused when the name exists, but two racing writers are not kept apart
    exclusive_create = False
    can_replace = True

    def __init__(self, url: str | None = None, *, fs: Any = None, path: str | None = None,
                 part_size: int = PART_SIZE, parallel_parts: int = PARALLEL_PARTS,
                 **storage_options: Any) -> None:
        if fsspec is None:
            raise StorageError(f"cannot open {url}: the fsspec backend needs fsspec "
                               f"({install_hint(url_scheme(url or ''))})")
        if fs is None:
            try:
                fs, path = fsspec.core.url_to_fs(url, **storage_options)
            except ImportError as exc:
                raise StorageError(f"cannot open {url}: {exc} ({install_hint(url_scheme(url or ''))})") from exc
            except (ValueError, TypeError) as exc:
                raise StorageError(f"cannot open {url}: {exc}") from exc
        self.fs = fs
        self.path = (path or "").rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        scheme = url_scheme(url or "")
        self.protocol = scheme if scheme in protocols else protocols[0]  # az://, not abfs://
        self.object_store = bool(OBJECT_STORE_PROTOCOLS.intersection(protocols))
        self.exclusive_create = type(self).exclusive_create or bool(CONDITIONAL_CREATE_PROTOCOLS.intersection(protocols))
        self.part_size = int(part_size)
        self.parallel_parts = max(1, int(parallel_parts))
        self.url = self._url(self.path)
        self.endpoint = getattr(fs, "endpoint_url", None)
        if not self.object_store:
            # memory:// (and local-like filesystems) show a file from the moment it is
            # opened; object stores show an object only once its upload completes.
            self.atomic_write = False

    # -- naming ------------------------------------------------------------------------
    def child(self, name: str) -> "FsspecStorage":
        return self._at(f"{self.path}/{name.strip('/')}" if self.path else name.strip("/"))

    def parent(self) -> "FsspecStorage":
        return self._at(self.path.rpartition("/")[0])

    def _at(self, path: str) -> "FsspecStorage":
        sub = object.__new__(type(self))
        sub.__dict__.update(self.__dict__)
        sub.path = path
        sub.url = self._url(path)
        return sub

    def _url(self, path: str) -> str:
        """The URL of ``path``, in the scheme the storage was opened with."""
        if not path:
            return f"{self.protocol}://"
        url = self.fs.unstrip_protocol(path)
        return f"{self.protocol}://{url.split('://', 1)[1]}" if "://" in url else url

    def _full(self, name: str) -> str:
        return f"{self.path}/{name}" if self.path else name

    def _where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _err(self, exc: BaseException, action: str, name: str | None) -> StorageError:
        return object_store_error(exc, action, self._where(name) if name else self.url, self.endpoint)

    # -- writing -------------------------------------------------------------------------
    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        """One conditional request when the data fits in one part, else a stream."""
        path = self._full(name)
        parts = iter(parts)
        head = bytearray()
        rest: "Iterator[Buffer] | None" = None
        for part in parts:  # the caller's errors come out unchanged
            view = bytes_view(part)
            if len(head) + len(view) > self.part_size:
                rest = itertools.chain([view], parts)
                break
            head += view
        try:
            if rest is None:
                self.fs.pipe_file(path, bytes(head), mode="create")
                return len(head)
            return self._stream(path, name, itertools.chain([head], rest))
        except FileExistsError:
            raise
        except OSError as exc:
            if is_precondition_failed(exc):
                raise FileExistsError(errno.EEXIST, "file exists", self._where(name)) from exc
            raise self._err(exc, "write", name) from exc
        finally:
            self.fs.invalidate_cache(self.path)

    def _stream(self, path: str, name: str, parts: "Iterator[Buffer]") -> int:
        """Write a file larger than one part through fsspec's create-only mode."""
        written = 0
        try:
            f = self.fs.open(path, "xb", block_size=self.part_size)
        except (ValueError, NotImplementedError):  # the backend has no create-only mode
            if self.fs.exists(path):
                raise FileExistsError(errno.EEXIST, "file exists", self._where(name)) from None
            f = self.fs.open(path, "wb", block_size=self.part_size)
        try:
            for part in parts:
                view = bytes_view(part)
                f.write(view)
                written += len(view)
        except BaseException:
            self._discard(f, path)
            raise
        f.close()  # the upload completes (the object appears) here
        return written

    def open_replace(self, name: str) -> Replacement:
        return _FsspecReplacement(self, name)

    def _discard(self, f: Any, path: str) -> None:
        """Abandon a file being written: nothing may appear under its name. fsspec's
        buffered files would complete the upload on ``close()`` (even from ``__exit__``
        or ``__del__``), so they are discarded and marked closed instead; backends that
        show a file from its creation (``memory://``) get it removed."""
        try:
            f.discard()
        except Exception:  # noqa: BLE001
            pass
        try:
            f.closed = True
        except Exception:  # noqa: BLE001
            pass
        if not self.atomic_write:
            try:
                self.fs.rm_file(path)
            except Exception:  # noqa: BLE001
                pass

    # -- reading ----------------------------------------------------------------------
    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        path = self._full(name)
        view = out.cast("B") if out.format != "B" else out
        n = len(view)
        if n == 0:
            return
        pieces = [(s, min(s + READ_PIECE, offset + n)) for s in range(offset, offset + n, READ_PIECE)]
        try:
            for i in range(0, len(pieces), READ_BATCH):
                batch = pieces[i:i + READ_BATCH]
                if len(batch) == 1:
                    datas = [self.fs.cat_file(path, start=batch[0][0], end=batch[0][1])]
                else:
                    datas = self.fs.cat_ranges([path] * len(batch), [s for s, _ in batch],
                                               [e for _, e in batch], on_error="return")
                for (start, end), data in zip(batch, datas):
                    if isinstance(data, BaseException):
                        raise data
                    view[start - offset:start - offset + len(data)] = data
                    if len(data) < end - start:
                        raise EOFError(f"{self._where(name)} ends before byte {offset + n}")
        except (FileNotFoundError, EOFError):
            raise
        except OSError as exc:
            code, _ = client_error(exc)
            if code in ("NoSuchKey", "InvalidRange"):
                if code == "NoSuchKey":
                    raise FileNotFoundError(errno.ENOENT, "no such object", self._where(name)) from exc
                raise EOFError(f"{self._where(name)} ends before byte {offset + n}") from exc
            raise self._err(exc, "read", name) from exc

    def size(self, name: str) -> int:
        try:
            size = self._lookup_size(name)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such file", self._where(name)) from None
        except OSError as exc:
            code, status = client_error(exc)
            if status == 404 and code != "NoSuchBucket":
                raise FileNotFoundError(errno.ENOENT, "no such file", self._where(name)) from exc
            raise self._err(exc, "stat", name) from exc
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such file (a folder)", self._where(name))
        return size

    def _lookup_size(self, name: str) -> int | None:
        """The size of ``name`` as the backend reports it (None: it is a folder)."""
        info = self.fs.info(self._full(name))
        return None if info.get("type") == "directory" else int(info["size"])

    # -- listing and deleting ----------------------------------------------------------------
    def listdir(self) -> dict[str, int | None]:
        self.fs.invalidate_cache(self.path)  # never answer from a stale listing cache
        try:
            entries = self.fs.ls(self.path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            raise self._err(exc, "list", None) from exc
        out: dict[str, int | None] = {}
        for e in entries:
            base = e["name"].rstrip("/").rsplit("/", 1)[-1]
            if e["name"].rstrip("/") == self.path:
                continue
            out[base] = None if e.get("type") == "directory" else int(e.get("size") or 0)
        return out

    def delete(self, names: Iterable[str]) -> None:
        names = list(names)
        if not names:
            return
        for name in names:
            try:
                self.fs.rm_file(self._full(name))
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise self._err(exc, "delete", name) from exc
        self.fs.invalidate_cache(self.path)

    def remove_folder(self) -> None:
        if self.object_store or "/" not in self.path.strip("/"):
            return  # folders are prefixes; and never touch a bucket or filesystem root
        try:
            if self.fs.ls(self.path, detail=False):
                return
            self.fs.rmdir(self.path)
        except OSError:
            return  # missing or not empty: nothing to do


class _FsspecReplacement(Replacement):
    """A replacement through an fsspec file (see the module docstring)."""

    def __init__(self, storage: FsspecStorage, name: str) -> None:
        self.storage, self.name = storage, name
        self.staged = not storage.object_store
        self.target = replace_temp_name(name) if self.staged else name
        try:
            if self.staged:
                self._remove_leftovers()
            self.file: Any = storage.fs.open(storage._full(self.target), "wb", block_size=storage.part_size)
        except OSError as exc:
            raise storage._err(exc, "create", self.target) from exc

    def _remove_leftovers(self) -> None:
        head, _, base = self.name.rpartition("/")
        folder = self.storage.child(head) if head else self.storage
        folder.delete([n for n, size in folder.listdir().items() if size is not None and is_replace_temp(n, base)])

    def write(self, data: Buffer) -> int:
        view = bytes_view(data)
        try:
            self.file.write(view)
        except OSError as exc:
            self.abort()
            raise self.storage._err(exc, "write", self.name) from exc
        self.written += len(view)
        return len(view)

    def commit(self) -> int:
        storage = self.storage
        try:
            self.file.close()  # an object store completes the upload here: the object appears
            if self.staged:
                storage.fs.mv(storage._full(self.target), storage._full(self.name))
        except OSError as exc:
            self.abort()
            raise storage._err(exc, "replace", self.name) from exc
        finally:
            storage.fs.invalidate_cache(storage.path)
        return self.written

    def abort(self) -> None:
        storage = self.storage
        if not getattr(self.file, "closed", True):
            storage._discard(self.file, storage._full(self.target))
        if self.staged:
            try:
                storage.fs.rm_file(storage._full(self.target))
            except Exception:  # noqa: BLE001 - cleanup; the next replacement removes leftovers
                pass
