"""S3 through the S3 API (s3fs's client): conditional creates, multipart uploads cut
from the stream, PUTs of unknown outcome settled by a write token, uncached listings
(the module docstring of ``fsspec``, which this class extends, says each)."""

from __future__ import annotations

import errno
import itertools
import secrets
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Iterable, Iterator

from ..errors import StorageError
from .base import Buffer
from .fsspec import (MAX_PARTS, PARALLEL_PARTS, PART_SIZE, WRITE_TOKEN, FsspecStorage, is_backend_error, is_definite, is_precondition_failed)

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
        pieces = self._pieces(parts)
        first = next(pieces, b"")
        second = next(pieces, None)
        if second is None:
            self._put(name, first)
            return len(first)
        return self._multipart(name, itertools.chain([first, second], pieces))

    def _put(self, name: str, body: bytes) -> None:
        key = self._key(name)
        token = secrets.token_hex(12)  # tells our own object from another writer's
        try:
            self._call("put_object", Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*",
                       Metadata={WRITE_TOKEN: token})
        except Exception as exc:  # noqa: BLE001 - classified below
            self._settle(exc, name, key, token)
        finally:
            self.fs.invalidate_cache(self._full(name))

    def _settle(self, exc: BaseException, name: str, key: str, token: str) -> None:
        """Decide a failed create: return if it in fact succeeded, else raise.

        A 412 is a lost race -- or a retry (by botocore or s3fs) of our own request that
        had succeeded; a 5xx, timeout or lost connection leaves the outcome unknown.
        Either way the object is looked at: if it carries our write token, it is ours."""
        if not is_definite(exc) and self._ours(key, token):
            return
        if is_precondition_failed(exc):
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

    def _multipart(self, name: str, pieces: Iterator[bytes]) -> int:
        key = self._key(name)
        token = secrets.token_hex(12)
        try:
            upload_id = self._call("create_multipart_upload", Bucket=self.bucket, Key=key,
                                   Metadata={WRITE_TOKEN: token})["UploadId"]
        except Exception as exc:  # noqa: BLE001
            raise self._err(exc, "start a multipart upload of", name) from exc
        etags: dict[int, str] = {}
        futures: set[Future] = set()
        slots = threading.Semaphore(self.parallel_parts)
        pool = ThreadPoolExecutor(self.parallel_parts, thread_name_prefix="safeckpt-upload")

        def upload(number: int, body: bytes) -> None:
            try:
                out = self._call("upload_part", Bucket=self.bucket, Key=key, PartNumber=number,
                                 UploadId=upload_id, Body=body)
                etags[number] = out["ETag"]
            finally:
                slots.release()

        def submit(number: int, body: bytes) -> None:
            slots.acquire()
            for done in [f for f in futures if f.done()]:
                futures.discard(done)
                done.result()  # surface a failed part early
            futures.add(pool.submit(upload, number, body))

        total = 0
        number = 0
        try:
            for part in pieces:
                number += 1
                if number > MAX_PARTS:
                    raise StorageError(f"cannot write {self._where(name)}: more than {MAX_PARTS} parts")
                total += len(part)
                submit(number, part)
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in done:
                f.result()
            if len(etags) != number:
                raise StorageError(f"cannot write {self._where(name)}: {number - len(etags)} parts missing")
            parts_info = [{"PartNumber": n, "ETag": etags[n]} for n in range(1, number + 1)]
            self._complete(name, key, upload_id, parts_info, token)
            return total
        except BaseException as exc:
            for f in futures:
                f.cancel()
            pool.shutdown(wait=True)
            self._abort(key, upload_id)
            if isinstance(exc, (FileExistsError, StorageError)) or not is_backend_error(exc):
                raise  # our own verdicts, and the caller's errors from ``parts``, unchanged
            raise self._err(exc, "write", name) from exc
        finally:
            pool.shutdown(wait=True)
            self.fs.invalidate_cache(self._full(name))

    def _complete(self, name: str, key: str, upload_id: str, parts: list[dict], token: str) -> None:
        try:
            self._call("complete_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload_id,
                       MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except Exception as exc:  # noqa: BLE001
            self._settle(exc, name, key, token)

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
