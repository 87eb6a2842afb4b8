"""Async saves: snapshot the state into reusable host buffers, then commit in the background.

The caller is blocked only for the copy into host memory (pinned when tensors live on
a GPU). Afterwards the training may change its tensors freely. At most one save is in
flight per saver: the next save first waits for the previous commit, so host memory
for staging is bounded by one copy of the state's tensors, reused from save to save.
An error is never lost: ``result()`` raises it, and if nobody asked, the next save,
``wait()`` or ``close()`` does.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import torch

from ..protocol.checkpoint import CheckpointInfo, SaveRequest, gc_paused, log_save, save_request
from ..protocol.group import resolve
from ..protocol.state import FlatState, Piece

log = logging.getLogger(__name__)


class SaveFuture(Future):
    """A ``concurrent.futures.Future`` of a ``CheckpointInfo``, set once committed.

    ``blocked_seconds`` is how long the caller was blocked by the snapshot."""

    def __init__(self, blocked_seconds: float = 0.0) -> None:
        super().__init__()
        self.blocked_seconds = blocked_seconds
        self.observed = False

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.observed = True
        return super().exception(timeout)


class StagingPool:
    """Host buffers keyed by piece name, reused while shape and dtype stay the same."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def snapshot(self, flat: FlatState) -> FlatState:
        """Copy every piece into a buffer; returns a FlatState that owns the copies. A
        contiguous CPU piece is copied with one ``memmove`` (no torch op per piece, the
        GIL released), which is what keeps the snapshot of many small tensors near a
        plain memory copy; other pieces go through ``copy_``."""
        pieces: dict[str, Piece] = {}
        buffers = self.buffers
        cuda = False
        for name, piece in flat.pieces.items():
            src = piece.tensor
            buf = buffers.get(name)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = buffers[name] = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            if src.is_cpu and src.is_contiguous() and not src.is_conj() and not src.is_neg():
                if buf.nbytes:
                    ctypes.memmove(buf.data_ptr(), src.data_ptr(), buf.nbytes)
            else:
                cuda = cuda or src.is_cuda
                buf.copy_(src.detach(), non_blocking=src.is_cuda)
            pieces[name] = Piece(buf, piece.info)
        if cuda:
            torch.cuda.synchronize()  # the non-blocking copies must land before we return
        for name in list(buffers):
            if name not in pieces:
                del buffers[name]
        return FlatState(flat.tree, pieces, flat.aliases, flat.has_local)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class AsyncSaver:
    """Runs saves one at a time on a background thread (see module docstring)."""

    def __init__(self) -> None:
        self.pool = StagingPool()
        self.pending: SaveFuture | None = None
        self._lock = threading.Lock()
        _live.add(self)

    @gc_paused
    def submit(self, state: dict, request: SaveRequest,
               on_done: Callable[[CheckpointInfo, float], None] | None = None) -> SaveFuture:
        """Snapshot ``state`` and start committing it; returns once the snapshot is taken."""
        started = time.perf_counter()
        self.wait()
        flattener = request.flattener(state)
        try:
            flat = flattener()
            snap = self.pool.snapshot(flat)
            snapshot: Callable[[], FlatState] = lambda: snap  # noqa: E731
        except Exception as exc:
            if request.group.size == 1:
                raise
            snapshot = _raiser(exc)  # the other ranks must learn of it, or they would wait
        future = SaveFuture(time.perf_counter() - started)
        thread = threading.Thread(target=self._run, args=(future, request, snapshot, started, on_done),
                                  name="safeckpt-async-save")  # not a daemon: exit waits for it
        with self._lock:
            self.pending = future
        thread.start()
        return future

    def _run(self, future: SaveFuture, request: SaveRequest, snapshot: Callable[[], FlatState],
             started: float, on_done: Callable[[CheckpointInfo, float], None] | None) -> None:
        try:
            info = request.run(snapshot, started)
            if on_done is not None:
                on_done(info, future.blocked_seconds)
            else:
                log_save(info, future.blocked_seconds)
        except BaseException as exc:  # delivered through the future, never dropped
            future.set_exception(exc)
            return
        future.set_result(info)

    def wait(self) -> CheckpointInfo | None:
        """Wait for the save in flight; raise its error unless someone already saw it."""
        with self._lock:
            future = self.pending
        if future is None:
            return None
        seen = future.observed
        exc = Future.exception(future)  # waits without marking the error as seen
        future.observed = True
        if exc is None:
            return Future.result(future)
        if not seen:
            raise exc
        return None

    def close(self) -> None:
        """Wait for the save in flight (raising its unseen error) and free the buffers."""
        try:
            self.wait()
        finally:
            self.pool.buffers.clear()
            _live.discard(self)


def _raiser(exc: BaseException) -> Callable[[], FlatState]:
    def fail() -> FlatState:
        raise exc
    return fail


_live: "weakref.WeakSet[AsyncSaver]" = weakref.WeakSet()
_default: AsyncSaver | None = None


def async_save(state: dict, path: Any, *, overwrite: bool = False, metadata: dict | None = None,
               process_group: Any = None, storage_options: dict | None = None,
               allow_pickle: bool = False) -> SaveFuture:
    """Like ``save``, but returns a ``SaveFuture`` as soon as the state is snapshotted.

    Saves through this function share one background saver: a second call waits for
    the first commit. In a torch.distributed job the commit runs on its own gloo group,
    so it never interleaves with the training's collectives."""
    global _default
    if _default is None:
        _default = AsyncSaver()
    request = save_request(path, overwrite=overwrite, metadata=metadata,
                           process_group=background_group(process_group),
                           storage_options=storage_options, allow_pickle=allow_pickle)
    return _default.submit(state, request)


def background_group(process_group: Any) -> Any:
    """The group background commits use: separate from the one foreground calls use."""
    return resolve(process_group, purpose="background")


@atexit.register
def _finish_at_exit() -> None:
    """Commit in-flight saves before the interpreter exits, and never drop an error."""
    for saver in list(_live):
        try:
            saver.wait()
        except BaseException as exc:  # noqa: BLE001 - reported, the process is ending
            print(f"safeckpt: an async save failed and nobody saw its error: {exc}", file=sys.stderr)
            log.error("an async save failed and nobody saw its error: %s", exc)
