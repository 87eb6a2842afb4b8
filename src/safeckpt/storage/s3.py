"""S3 through the S3 API (s3fs's client): conditional creates, multipart uploads cut
from the stream, PUTs of unknown outcome settled by a write token, uncached listings
(the module docstring of ``fsspec``, which this class extends, says each), and
replacements of one key by one conditional PUT (``open_replace``)."""

from __future__ import annotations

import errno
import secrets
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Iterable

from ..errors import StorageError
from .base import Buffer, Replacement
from .fsspec import (MAX_PARTS, PARALLEL_PARTS, PART_SIZE, WRITE_TOKEN, FsspecStorage, bytes_view, client_error,
                     is_backend_error, is_definite, is_precondition_failed)

MIN_PART_SIZE = 5 << 20  # S3 refuses smaller parts (but the last)


class S3Storage(FsspecStorage):
    """A key prefix in an S3 bucket (AWS, MinIO, SeaweedFS, moto, ...)."""

    exclusive_create = True  # If-None-Match: *, zero-byte objects included

    def __init__(self, url: str | None = None, *, fs: Any = None, path: str | None = None,
                 part_size: int = PART_SIZE, parallel_parts: int = PARALLEL_PARTS,
                 **storage_options: Any) -> None:
        super().__init__(url, fs=fs, path=path, part_size=max(int(part_size), MIN_PART_SIZE),
                         parallel_parts=parallel_parts, **storage_options)
        self.bucket, _, self.prefix = self.path.partition("/")
        if not self.bucket:
            raise StorageError(f"cannot open {url}: an s3:// URL needs a bucket (s3://bucket/prefix)")

    def _at(self, path: str) -> "S3Storage":
        sub = super()._at(path)
        assert isinstance(sub, S3Storage)
        sub.bucket, _, sub.prefix = path.partition("/")
        return sub

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, method: str, **kwargs: Any) -> Any:
        """One S3 API call through s3fs (its retries and error translation apply)."""
        return self.fs.call_s3(method, **kwargs)

    # -- writing -------------------------------------------------------------------------
    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        """One conditional PUT when the data fits in one part, else a multipart upload."""
        upload = _Upload(self, name, {"IfNoneMatch": "*"})
        try:
            for part in parts:
                upload.write(part)
        except BaseException:
            upload.abort()  # the caller's error from ``parts``, unchanged
            raise
        return upload.commit()

    def open_replace(self, name: str) -> Replacement:
        """One PUT (or multipart upload) of the final key, conditional on the version
        this replacement started from (``If-Match`` its ETag, or ``If-None-Match: *``
        if there was none) where the store honours it: a replacement never overwrites
        a version another writer put there meanwhile."""
        try:
            etag = self._call("head_object", Bucket=self.bucket, Key=self._key(name)).get("ETag")
        except Exception as exc:  # noqa: BLE001 - classified below
            code, status = client_error(exc)
            if status != 404 and code not in ("404", "NoSuchKey", "NotFound") \
                    and not isinstance(exc, FileNotFoundError):
                raise self._err(exc, "look up", name) from exc
            etag = None
        return _Upload(self, name, {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}, replacing=True)

    def _put(self, name: str, body: bytes, token: str, condition: dict[str, str], replacing: bool) -> None:
        key = self._key(name)
        try:
            self._conditional("put_object", condition, Bucket=self.bucket, Key=key, Body=body,
                              Metadata={WRITE_TOKEN: token})
        except Exception as exc:  # noqa: BLE001 - classified below
            self._settle(exc, name, key, token, replacing)
        finally:
            self.fs.invalidate_cache(self._full(name))

    def _conditional(self, method: str, condition: dict[str, str], **kwargs: Any) -> Any:
        """A call with a precondition; where the store does not implement it (HTTP 501),
        the call again without (what it would do for any other client)."""
        try:
            return self._call(method, **kwargs, **condition)
        except Exception as exc:  # noqa: BLE001 - classified below
            code, status = client_error(exc)
            if not condition or not (status == 501 or code == "NotImplemented"):
                raise
        return self._call(method, **kwargs)

    def _settle(self, exc: BaseException, name: str, key: str, token: str, replacing: bool = False) -> None:
        """Decide a failed upload: return if it in fact succeeded, else raise.

        A 412 is a lost race -- or a retry (by botocore or s3fs) of our own request that
        had succeeded; a 5xx, timeout or lost connection leaves the outcome unknown.
        Either way the object is looked at: if it carries our write token, it is ours."""
        if not is_definite(exc) and self._ours(key, token):
            return
        if is_precondition_failed(exc):
            if replacing:
                raise StorageError(f"cannot replace {self._where(name)}: another writer changed it while "
                                   "this replacement was written (nothing was overwritten; one writer per "
                                   "file name)") from exc
            raise FileExistsError(errno.EEXIST, f"{self._where(name)} exists (another writer "
                                  "created it first)", self._where(name)) from exc
        raise self._err(exc, "write", name) from exc

    def _ours(self, key: str, token: str) -> bool:
        """Does the object exist and carry our write token? (False if it cannot be read.)"""
        try:
            head = self._call("head_object", Bucket=self.bucket, Key=key)
        except Exception:  # noqa: BLE001 - any failure means "not proven"
            return False
        meta = {k.lower(): v for k, v in (head.get("Metadata") or {}).items()}
        return meta.get(WRITE_TOKEN) == token

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._call("abort_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - garbage collection aborts what is left
            pass

    def abort_stale_uploads(self, older_than: float = 3600.0) -> int:
        """Abort incomplete multipart uploads under this prefix started more than
        ``older_than`` seconds ago (left by crashed saves; they cost storage until
        aborted). Returns how many were aborted."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        cutoff = time.time() - older_than
        aborted = 0
        try:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            while True:
                page = self._call("list_multipart_uploads", **kwargs)
                for up in page.get("Uploads", []):
                    started = up.get("Initiated")
                    if started is not None and started.timestamp() > cutoff:
                        continue
                    self._call("abort_multipart_upload", Bucket=self.bucket, Key=up["Key"],
                               UploadId=up["UploadId"])
                    aborted += 1
                if not page.get("IsTruncated"):
                    return aborted
                kwargs["KeyMarker"] = page.get("NextKeyMarker")
                kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker")
        except Exception as exc:  # noqa: BLE001
            raise self._err(exc, "abort stale uploads in", None) from exc

    # -- reading, listing, deleting -----------------------------------------------------------
    def _lookup_size(self, name: str) -> int | None:
        return int(self._call("head_object", Bucket=self.bucket, Key=self._key(name))["ContentLength"])

    def listdir(self) -> dict[str, int | None]:
        self.fs.invalidate_cache(self.path)  # never answer from a stale listing cache
        prefix = f"{self.prefix}/" if self.prefix else ""
        out: dict[str, int | None] = {}
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "Delimiter": "/"}
        try:
            while True:
                page = self._call("list_objects_v2", **kwargs)
                for obj in page.get("Contents", []):
                    base = obj["Key"][len(prefix):]
                    if base:  # skip a "folder marker" object equal to the prefix
                        out[base] = int(obj["Size"])
                for cp in page.get("CommonPrefixes", []):
                    out[cp["Prefix"][len(prefix):].rstrip("/")] = None
                if not page.get("IsTruncated"):
                    return out
                kwargs["ContinuationToken"] = page["NextContinuationToken"]
        except Exception as exc:  # noqa: BLE001
            raise self._err(exc, "list", None) from exc

    def delete(self, names: Iterable[str]) -> None:
        names = list(names)
        if names:
            self._delete_keys(names)

    def _delete_keys(self, names: list[str]) -> None:
        try:
            for i in range(0, len(names), 1000):
                batch = names[i:i + 1000]
                out = self._call("delete_objects", Bucket=self.bucket,
                                 Delete={"Objects": [{"Key": self._key(n)} for n in batch], "Quiet": True})
                errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if errors:
                    first = errors[0]
                    raise StorageError(f"cannot delete {len(errors)} object(s) in {self.url}, e.g. "
                                       f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}")
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._err(exc, "delete objects in", None) from exc
        finally:
            self.fs.invalidate_cache(self.path)


class _Upload(Replacement):
    """One object uploaded from a stream: the bytes are cut into parts of ``part_size``
    as they come (at most one part is buffered), sent as one conditional PUT if they fit
    in one part, else as a multipart upload whose parts go out in parallel and which is
    completed with the same condition and aborted on any error. Parts grow past 2,000
    so that an object never needs more than ``MAX_PARTS``; the last may be smaller."""

    def __init__(self, store: S3Storage, name: str, condition: dict[str, str], replacing: bool = False) -> None:
        self.store, self.name, self.condition, self.replacing = store, name, condition, replacing
        self.key = store._key(name)
        self.token = secrets.token_hex(12)  # tells our own object from another writer's
        self.buf = bytearray()
        self.count = 0                      # parts cut so far
        self.first: bytes | None = None     # held until a second part shows a multipart upload is needed
        self.upload_id: str | None = None
        self.etags: dict[int, str] = {}
        self.futures: set[Future] = set()
        self.slots = threading.Semaphore(store.parallel_parts)
        self.pool: ThreadPoolExecutor | None = None
        self.done = False

    def _part_size(self) -> int:
        return self.store.part_size << min(self.count // 2000, 4)

    def write(self, data: Buffer) -> int:
        view = bytes_view(data)
        n = len(view)
        try:
            while view:
                size = self._part_size()
                if not self.buf and len(view) >= size:
                    piece, view = bytes(view[:size]), view[size:]
                else:
                    want = size - len(self.buf)
                    self.buf += view[:want]
                    view = view[want:]
                    if len(self.buf) < size:
                        break
                    piece, self.buf = bytes(self.buf), bytearray()
                self._cut(piece)
        except BaseException as exc:
            raise self._failed(exc) from None
        self.written += n
        return n

    def _cut(self, piece: bytes) -> None:
        self.count += 1
        if self.count > MAX_PARTS:
            raise StorageError(f"cannot write {self.store._where(self.name)}: more than {MAX_PARTS} parts")
        if self.count == 1:
            self.first = piece
            return
        if self.upload_id is None:
            self._start()
            assert self.first is not None
            self._submit(1, self.first)
            self.first = None
        self._submit(self.count, piece)

    def _start(self) -> None:
        store = self.store
        try:
            self.upload_id = store._call("create_multipart_upload", Bucket=store.bucket, Key=self.key,
                                         Metadata={WRITE_TOKEN: self.token})["UploadId"]
        except Exception as exc:  # noqa: BLE001
            raise store._err(exc, "start a multipart upload of", self.name) from exc
        self.pool = ThreadPoolExecutor(store.parallel_parts, thread_name_prefix="safeckpt-upload")

    def _submit(self, number: int, body: bytes) -> None:
        store, upload_id = self.store, self.upload_id

        def upload() -> None:
            try:
                out = store._call("upload_part", Bucket=store.bucket, Key=self.key, PartNumber=number,
                                  UploadId=upload_id, Body=body)
                self.etags[number] = out["ETag"]
            finally:
                self.slots.release()

        self.slots.acquire()
        for done in [f for f in self.futures if f.done()]:
            self.futures.discard(done)
            done.result()  # surface a failed part early
        assert self.pool is not None
        self.futures.add(self.pool.submit(upload))

    def commit(self) -> int:
        store = self.store
        try:
            if self.buf or self.count == 0:
                piece, self.buf = bytes(self.buf), bytearray()
                self._cut(piece)
            if self.upload_id is None:
                assert self.first is not None
                self.done = True
                store._put(self.name, self.first, self.token, self.condition, self.replacing)
                return self.written
            done, _ = wait(self.futures, return_when=FIRST_EXCEPTION)
            for f in done:
                f.result()
            if len(self.etags) != self.count:
                raise StorageError(f"cannot write {store._where(self.name)}: {self.count - len(self.etags)} parts missing")
            parts = [{"PartNumber": n, "ETag": self.etags[n]} for n in range(1, self.count + 1)]
            try:
                store._conditional("complete_multipart_upload", self.condition, Bucket=store.bucket, Key=self.key,
                                   UploadId=self.upload_id, MultipartUpload={"Parts": parts})
            except Exception as exc:  # noqa: BLE001
                store._settle(exc, self.name, self.key, self.token, self.replacing)
            self.done = True
            return self.written
        except BaseException as exc:
            raise self._failed(exc) from None
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
            store.fs.invalidate_cache(store._full(self.name))

    def _failed(self, exc: BaseException) -> BaseException:
        """Abort, and the error to raise: our own verdicts and the caller's errors
        unchanged, a backend's failure as a ``StorageError``."""
        self.abort()
        if isinstance(exc, (FileExistsError, StorageError)) or not is_backend_error(exc):
            return exc
        err = self.store._err(exc, "write", self.name)
        err.__cause__ = exc
        return err

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        for f in self.futures:
            f.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.upload_id is not None:
            self.store._abort(self.key, self.upload_id)
