"""``StorageTests``: the conformance suite every ``Storage`` backend passes.

The commit protocol relies on exactly what these tests check: a create never replaces
an existing file (and, where ``exclusive_create`` is claimed, two racing creates never
both succeed), a file is read back byte for byte in any range, listings show files with
their sizes and sub-folders as ``None``, a failed write raises and never leaves a whole
file behind, deletes of missing names are fine; and where ``can_replace`` is claimed,
``open_replace`` creates or replaces a file from a stream, and a replacement that
fails keeps the old file and leaves nothing else (crashes and power cuts at every step
of a replacement are ``crash_points``' job: see tests/test_atomic_replace.py). A backend's own test module
subclasses it (pytest collects ``Test*`` classes) and says how to make a fresh, empty
storage::

    from safeckpt.testing import StorageTests

    class TestMyStore(StorageTests):
        def make_storage(self):
            return MyStore(f"mystore://bucket/{uuid.uuid4().hex}")

No pytest import is needed: the tests are plain methods that raise ``AssertionError``.
"""

from __future__ import annotations

import threading
from typing import Iterator

from ..storage.base import Buffer, Storage

__all__ = ["StorageTests"]

LARGE = 12 << 20  # more than two S3 parts of the minimum size


def _raises(exc_type: type[BaseException] | tuple[type[BaseException], ...], fn, *args) -> BaseException:
    try:
        fn(*args)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)}{args} did not raise {exc_type}")


class _Boom(Exception):
    """What a failing stream of parts raises (it must come out unchanged)."""


class StorageTests:
    """Subclass and implement ``make_storage``; every ``test_*`` method is one rule."""

    def make_storage(self) -> Storage:
        """A fresh, empty folder of the backend under test."""
        raise NotImplementedError

    # -- write, read -----------------------------------------------------------------
    def test_write_then_read_back(self) -> None:
        st = self.make_storage()
        parts: list[Buffer] = [b"head", bytearray(b"-mid-"), memoryview(b"tail!")]
        assert st.write_file("a.bin", parts) == 14
        assert st.read("a.bin") == b"head-mid-tail!"
        assert st.read("a.bin", 4, 5) == b"-mid-"
        out = bytearray(4)
        st.read_into("a.bin", 10, memoryview(out))
        assert bytes(out) == b"ail!"
        assert st.size("a.bin") == 14

    def test_large_file_in_many_parts(self) -> None:
        st = self.make_storage()
        data = bytes(range(256)) * (LARGE // 256)
        chunk = 3 << 20

        def parts() -> Iterator[memoryview]:
            view = memoryview(data)
            for i in range(0, len(data), chunk):
                yield view[i:i + chunk]
        assert st.write_file("big.bin", parts()) == len(data)
        assert st.size("big.bin") == len(data)
        assert st.read("big.bin", LARGE // 2 - 7, 1 << 20) == data[LARGE // 2 - 7:LARGE // 2 - 7 + (1 << 20)]
        assert st.read("big.bin") == data

    def test_empty_file(self) -> None:
        st = self.make_storage()
        assert st.write_file("empty", []) == 0
        assert st.listdir() == {"empty": 0}
        assert st.read("empty") == b""
        _raises(FileExistsError, st.write_file, "empty", [b"x"])  # the zero-byte trap of s3fs "xb"
        assert st.read("empty") == b""

    def test_create_never_replaces(self) -> None:
        st = self.make_storage()
        st.write_file("m.json", [b"first"])
        _raises(FileExistsError, st.write_file, "m.json", [b"second"])
        assert st.read("m.json") == b"first"

    def test_racing_creates_one_wins(self) -> None:
        st = self.make_storage()
        if not st.exclusive_create:
            return  # claimed nowhere: the protocol warns instead of relying on it
        results: list[str] = []
        start = threading.Barrier(4)

        def create(i: int) -> None:
            start.wait()
            try:
                st.write_file("race", [str(i).encode() * 1000])
                results.append(str(i))
            except FileExistsError:
                results.append("exists")
        threads = [threading.Thread(target=create, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [r for r in results if r != "exists"]
        assert len(winners) == 1, results
        assert st.read("race") == winners[0].encode() * 1000

    def test_reading_what_is_not_there(self) -> None:
        st = self.make_storage()
        _raises(FileNotFoundError, st.read, "missing", 0, 1)
        st.write_file("short", [b"abc"])
        _raises((EOFError, OSError), st.read, "short", 1, 10)

    def test_a_failed_write_raises_the_callers_error_and_leaves_no_whole_file(self) -> None:
        st = self.make_storage()

        def parts() -> Iterator[bytes]:
            yield b"x" * 1000
            raise _Boom("the caller's stream failed")
        _raises(_Boom, st.write_file, "torn", parts())
        size = st.listdir().get("torn")
        assert size is None or (not st.atomic_write and size < 1000 + 1), size
        if st.atomic_write:
            assert "torn" not in st.listdir(), "an atomic backend showed an aborted write"

    # -- atomic replacement ---------------------------------------------------------------
    def test_replace_creates_then_replaces(self) -> None:
        st = self.make_storage()
        if not st.can_replace:
            return
        assert st.replace_file("last.ckpt", [b"first"]) == 5
        assert st.read("last.ckpt") == b"first"
        assert st.replace_file("last.ckpt", [b"second", memoryview(b"!")]) == 7
        assert st.read("last.ckpt") == b"second!"
        assert st.replace_file("sub/x", []) == 0  # creates the folder; an empty file
        assert st.read("sub/x") == b""
        assert st.listdir() == {"last.ckpt": 7, "sub": None}, "a replacement left a file behind"

    def test_replace_streams_a_large_file(self) -> None:
        st = self.make_storage()
        if not st.can_replace:
            return
        st.replace_file("big", [b"old"])
        data = bytes(range(256)) * (LARGE // 256)
        with st.open_replace("big") as out:
            out.write(b"head")
            view = memoryview(data)
            for i in range(0, len(data), 3 << 20):
                out.write(view[i:i + (3 << 20)])
            out.flush()
            assert st.read("big") == b"old", "the new file was visible before its commit"
        assert out.written == len(data) + 4
        assert st.size("big") == len(data) + 4
        assert st.read("big", 0, 4) == b"head" and st.read("big", 4 + LARGE // 2, 100) == data[LARGE // 2:LARGE // 2 + 100]

    def test_a_failed_replace_keeps_the_old_file(self) -> None:
        st = self.make_storage()
        if not st.can_replace:
            return
        st.replace_file("last.ckpt", [b"old"])

        def parts() -> Iterator[bytes]:
            yield b"x" * 1000
            raise _Boom("the caller's stream failed")
        _raises(_Boom, st.replace_file, "last.ckpt", parts())
        assert st.read("last.ckpt") == b"old"
        out = st.open_replace("last.ckpt")
        out.write(b"y" * 5000)
        out.abort()
        assert st.read("last.ckpt") == b"old"
        assert st.listdir() == {"last.ckpt": 3}, "a failed replacement left a file behind"

    # -- list, delete, folders -------------------------------------------------------------
    def test_listing_shows_files_and_folders(self) -> None:
        st = self.make_storage()
        assert st.listdir() == {}
        st.write_file("f", [b"12345"])
        st.write_file("sub/g", [b"1"])
        assert st.listdir() == {"f": 5, "sub": None}
        assert st.child("sub").listdir() == {"g": 1}
        assert st.child("nowhere").listdir() == {}

    def test_delete(self) -> None:
        st = self.make_storage()
        for name in ("a", "b", "c"):
            st.write_file(name, [name.encode()])
        st.delete(["a", "missing", "c"])
        assert st.listdir() == {"b": 1}
        st.delete([])

    def test_child_and_parent(self) -> None:
        st = self.make_storage()
        child = st.child("step-000000001")
        child.write_file("x", [b"42"])
        assert st.listdir() == {"step-000000001": None}
        assert child.parent().url.rstrip("/") == st.url.rstrip("/")
        assert child.parent().child("step-000000001").read("x") == b"42"
        here, name = child.locate("../step-000000001/x")
        assert here.read(name) == b"42"

    def test_remove_folder(self) -> None:
        st = self.make_storage()
        child = st.child("d")
        child.write_file("x", [b"1"])
        child.remove_folder()  # not empty: a no-op
        assert child.listdir() == {"x": 1}
        child.delete(["x"])
        child.remove_folder()
        assert child.listdir() == {}  # some object stores (SeaweedFS's filer) keep the empty prefix
        child.remove_folder()  # missing: fine
