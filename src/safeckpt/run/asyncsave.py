"""Async saves: snapshot the state into reusable host buffers, then commit in the background.

A full save by one process to a local or network filesystem goes to the writer process
(``writer``): the caller walks the state and copies its tensors into a shared buffer
(``arena``), and the writer, with an interpreter of its own, does every other step;
this process keeps a thread that waits for its answer. Other saves by one process are
staged on the caller, every per-tensor step done before the call returns, so that the
background thread, which shares the GIL with the training, runs almost no Python
(``staged``); saves by several ranks copy each tensor into a buffer of its own and agree
on the layout in the background. Afterwards the training may change its tensors freely. At most one save is in
flight per saver: the next save first waits for the previous commit, so host memory
for staging is bounded by one copy of the state's tensors, reused from save to save.
Any thread may submit: a saver takes one submission at a time, whole (wait for the
previous commit, snapshot, start), so no two saves ever share a staging buffer, and
what a save commits is what its own call snapshotted.
An error is never lost: ``result()`` raises it, and if nobody asked, the next save,
``wait()`` or ``close()`` does.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, cast

from ..protocol.arena import ArenaStaging, SharedBuffer
from ..protocol.checkpoint import CheckpointInfo, SaveRequest, gc_paused, log_save, save_request
from ..protocol.group import resolve
from ..protocol.staged import StagedRun
from ..protocol.staging import StagingPool
from ..protocol.state import FlatState, walk
from . import writer

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


class AsyncSaver:
    """Runs saves one at a time on a background thread (see module docstring)."""

    def __init__(self) -> None:
        self.pool = StagingPool()
        self.arena = ArenaStaging()  # the shared buffer of saves the writer process commits
        self.pending: SaveFuture | None = None
        self._work: Callable[[], CheckpointInfo] | None = None  # the save in flight, freed by ``wait``
        self._lock = threading.Lock()  # guards ``pending`` and ``_work``
        self._submitting = threading.Lock()  # one submission at a time: wait, snapshot, start
        self._queue: queue.SimpleQueue | None = None  # the background thread's saves (``_background``)
        weakref.finalize(self, _release, self.arena)  # a saver never closed: its buffer goes, in the writer too
        _live.add(self)

    @gc_paused
    def submit(self, state: dict, request: SaveRequest,
               on_done: Callable[[CheckpointInfo, float], None] | None = None) -> SaveFuture:
        """Snapshot ``state`` and start committing it; returns once the snapshot is taken
        (see the module docstring for the three ways)."""
        started = time.perf_counter()
        with self._submitting:  # held until the save has started: its buffers are its own
            return self._submit(state, request, on_done, started)

    def _submit(self, state: dict, request: SaveRequest,
                on_done: Callable[[CheckpointInfo, float], None] | None, started: float) -> SaveFuture:
        self.wait()
        job = writer.job_for(request)
        if job is not None:
            walked = walk(state, request.allow_pickle, named=False)  # a bad state raises here
            self.pool.buffers.clear()  # one staging copy: the shared buffer
            handover = self.arena.stage(walked)
            buffer = cast(SharedBuffer, self.arena.buffer)
            return self._start(lambda: request.info(writer.commit(job, handover, buffer, request), started),
                               started, on_done)
        self._release_arena()
        flattener = request.flattener(state)  # one process: flattened now, a bad state raises here
        work: Callable[[], CheckpointInfo]
        if request.stageable:
            try:
                run = cast(StagedRun, request.start(StagedRun))
                run.stage(flattener, self.pool)
                work = lambda: request.info(run.finish_staged(), started)  # noqa: E731
            except Exception as exc:  # a refused save (exists, bad metadata) fails its future
                work = _raiser(exc)
        else:
            try:
                flat = flattener()
                snap = self.pool.snapshot(flat)
                snapshot: Callable[[], FlatState] = lambda: snap  # noqa: E731
            except Exception as exc:
                if request.group.size == 1:
                    raise
                snapshot = _raiser(exc)  # the other ranks must learn of it, or they would wait
            work = lambda: request.run(snapshot, started)  # noqa: E731
        return self._start(work, started, on_done)

    def submit_prepared(self, prepare: Callable[[StagingPool], Callable[[], Any]],
                        on_done: Callable[[Any, float], None] | None = None) -> SaveFuture:
        """Like ``submit`` for a save that snapshots its state itself: ``prepare(pool)``
        copies what it needs into the saver's buffers and returns the work to run in the
        background. It runs inside the same one-at-a-time section as ``submit`` (after the
        previous save finished), so no two saves ever share the buffers; what it raises
        reaches the caller and nothing starts."""
        started = time.perf_counter()
        with self._submitting:
            self.wait()
            self._release_arena()
            return self._start(prepare(self.pool), started, on_done)

    def _start(self, work: Callable[[], Any], started: float,
               on_done: Callable[[Any, float], None] | None) -> SaveFuture:
        """Run ``work`` (a save already snapshotted) on the background thread; its error
        is delivered through the future."""
        future = SaveFuture(time.perf_counter() - started)
        with self._lock:
            self.pending, self._work = future, work
        self._background().put((future, work, on_done))
        return future

    def _background(self) -> queue.SimpleQueue:
        """The queue of this saver's background thread, started on first use and kept:
        handing a save to a running thread costs the caller nothing, while starting a
        thread waits until the new thread runs (tens of milliseconds on a busy machine).
        A daemon: at exit, ``_finish_at_exit`` waits for the saves in flight first."""
        if self._queue is None:
            saves: queue.SimpleQueue = queue.SimpleQueue()
            self._queue = saves
            threading.Thread(target=_serve, args=(saves,), name="safeckpt-async-save", daemon=True).start()
            weakref.finalize(self, saves.put, None)  # the thread ends with its saver
        return self._queue

    def wait(self) -> CheckpointInfo | None:
        """Wait for the save in flight; raise its error unless someone already saw it.
        The finished save's objects (a staged save holds a few per tensor) are freed
        here, on the caller's thread: freeing them is Python work too, which the
        background thread would do holding the GIL."""
        with self._lock:
            future = self.pending
        if future is None:
            return None
        seen = future.observed
        exc = Future.exception(future)  # waits without marking the error as seen
        future.observed = True
        with self._lock:
            if self.pending is future:
                self._work = None
        if exc is None:
            return Future.result(future)
        if not seen:
            raise exc
        return None

    def close(self) -> None:
        """Wait for the save in flight (raising its unseen error) and free the buffers
        (after a submission another thread is making)."""
        with self._submitting:
            try:
                self.wait()
            finally:
                self.pool.buffers.clear()
                self._release_arena()
                _live.discard(self)

    def _release_arena(self) -> None:
        """Free the shared buffer (a save staged elsewhere: one staging copy at a time)."""
        _release(self.arena)

    def _after_fork_in_child(self) -> None:
        """In a forked child: the parent's save in flight is the parent's (its thread
        did not come along), and so are its locks."""
        self.pending, self._work, self._queue = None, None, None
        self._lock, self._submitting = threading.Lock(), threading.Lock()


def _release(arena: ArenaStaging) -> None:
    """Free a saver's shared buffer, here and in the writer process."""
    if arena.buffer is not None:
        writer.forget(arena.buffer)
        arena.close()


def _serve(saves: queue.SimpleQueue) -> None:
    """A saver's background thread: run each save handed to it (``None`` ends it). It
    lets go of a save before its future is set, so the save's objects are freed by
    the caller (``wait``)."""
    while (item := saves.get()) is not None:
        future, work, on_done = item
        del item
        error: BaseException | None = None
        try:
            info = work()
            if on_done is not None:
                on_done(info, future.blocked_seconds)
            else:
                log_save(info, future.blocked_seconds)
        except BaseException as exc:  # delivered through the future, never dropped
            error = exc
        del work
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(info)


def _raiser(exc: BaseException) -> Callable[[], Any]:
    def fail() -> Any:
        raise exc
    return fail


_live: "weakref.WeakSet[AsyncSaver]" = weakref.WeakSet()
_default: AsyncSaver | None = None  # the saver ``async_save`` calls share, made once (``_shared``)
_default_lock = threading.Lock()


def _shared() -> AsyncSaver:
    """The saver every ``async_save`` call uses, whichever thread calls first."""
    global _default
    with _default_lock:
        if _default is None:
            _default = AsyncSaver()
        return _default


def async_save(state: dict, path: Any, *, overwrite: bool = False, metadata: dict | None = None,
               process_group: Any = None, storage_options: dict | None = None,
               allow_pickle: bool = False) -> SaveFuture:
    """Like ``save``, but returns a ``SaveFuture`` as soon as the state is snapshotted.

    Saves through this function share one background saver: a second call, from any
    thread, waits for the first commit. In a torch.distributed job the commit runs on
    its own gloo group, so it never interleaves with the training's collectives."""
    request = save_request(path, overwrite=overwrite, metadata=metadata,
                           process_group=background_group(process_group),
                           storage_options=storage_options, allow_pickle=allow_pickle)
    return _shared().submit(state, request)


def background_group(process_group: Any) -> Any:
    """The group background commits use: separate from the one foreground calls use."""
    return resolve(process_group, purpose="background")


def _after_fork_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    for saver in list(_live):
        saver._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _finish_at_exit() -> None:
    """Commit in-flight saves before the interpreter exits, and never drop an error."""
    for saver in list(_live):
        try:
            saver.wait()
        except BaseException as exc:  # noqa: BLE001 - reported, the process is ending
            print(f"safeckpt: an async save failed and nobody saw its error: {exc}", file=sys.stderr)
            log.error("an async save failed and nobody saw its error: %s", exc)


def _register_exit_hook() -> None:
    """Run ``_finish_at_exit`` before ``concurrent.futures`` refuses new work at exit. The
    interpreter first calls threading's exit hooks, newest first (concurrent.futures's
    one sets its "shutdown" flag there), then joins the threads, then runs ``atexit``: a
    save still writing when the script ends needs thread pools, so it must be finished
    among threading's hooks, after concurrent.futures's was registered (imported here)."""
    import concurrent.futures.thread  # noqa: F401 - registers its exit hook now, before ours

    register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9
    (register or atexit.register)(_finish_at_exit)


_register_exit_hook()
