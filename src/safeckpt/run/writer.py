"""The writer process: where the async saves of one process are written and committed,
off its interpreter.

A background thread shares the GIL with the training: every Python step it takes per
tensor stalls the training's Python as long. So an async save by one process to a
local or network filesystem is handed to a writer process: the caller walks the state
and copies its tensors into a shared buffer (``protocol.arena``), and the writer does
everything else (pieces, layout, checksums, the data file, the manifest, the commit)
with the protocol a synchronous save runs (``staged.StagedRun``). The saving process
keeps a thread per save that only waits for the answer, and runs the save's
``before_commit`` (the manager's lease check) when the writer asks, just before the
commit.

One writer per process, started by the first such save and kept: a fresh interpreter
(``python -c``, never a ``fork`` of a process that may hold CUDA state and threads, nor
``multiprocessing``'s spawn, which imports the user's ``__main__`` again). It runs the
saves of several savers at once, a thread each, and exits when this process closes the
connection (at exit, after the saves in flight).

Failures:
- The writer dies (killed, out of memory): the socket closes, every save in flight fails
  with ``WriterDiedError`` (a ``SaveAbortedError``) naming how it died, its data file is
  removed and nothing is committed (had the manifest been written already, the save
  succeeded, and says so). The next save starts a new writer.
- The saving process dies (SIGKILL): the kernel kills the writer at once
  (``PR_SET_PDEATHSIG``, about the thread that started it: a thread of this module that
  lives as long as the process), so nothing is committed after the saver died, as with
  a thread; a save is handed over only once its snapshot is complete anyway.
- The writer cannot start at all: the save is finished in this process from the buffer,
  a warning says why, and later saves run on a thread.
- ``fork``: a child never uses its parent's writer or buffer; it starts its own.

``SAFECKPT_ASYNC_WRITER=thread`` keeps every async save in the saving process.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, cast

from ..errors import SafeckptWarning, SaveAbortedError, WriterDiedError, warn
from ..format.folder import read_committed
from ..format.manifest import Manifest
from ..format.names import data_file_name
from ..protocol.arena import SUPPORTED, BufferStager, Handover, MappedBuffer, SharedBuffer, WriterPlans
from ..protocol.checkpoint import SaveRequest, new_save_id
from ..protocol.commit import remove_quietly
from ..protocol.group import SingleGroup
from ..protocol.staged import StagedRun
from ..protocol.state import FlatState
from ..storage.local import OS_FILESYSTEM, LocalStorage

ENV = "SAFECKPT_ASYNC_WRITER"  #: "thread": async saves run in the saving process
_BOOT = ("import importlib.util, os, sys; i = sys.argv[1]; s = importlib.util.spec_from_file_location("
         "'safeckpt', i, submodule_search_locations=[os.path.dirname(i)]); m = importlib.util.module_from_spec(s); "
         "sys.modules['safeckpt'] = m; s.loader.exec_module(m); from safeckpt.run.writer import main; "
         "main(sys.argv[2:])")
#: how the writer is started (the socket's descriptor and this process's pid follow): the
#: same safeckpt as this process's, from its files, whatever the child's ``sys.path`` says
COMMAND = [sys.executable, "-c", _BOOT, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    "__init__.py")]
STOP_S = 30.0  # how long ``stop`` waits for the writer to exit before killing it
READY_S = float(os.environ.get("SAFECKPT_WRITER_START_TIMEOUT", "60"))  # for a new writer to say it is ready


# -- the wire: length-prefixed pickles over a Unix socket, descriptors with a message --

def _send(sock: socket.socket, message: Any, fds: "list[int] | None" = None) -> None:
    blob = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    head = struct.pack("<Q", len(blob))
    if fds:
        socket.send_fds(sock, [head], fds)
    elif len(blob) < 1 << 16:
        sock.sendall(head + blob)
        return
    else:
        sock.sendall(head)
    sock.sendall(blob)


def _receive(sock: socket.socket) -> "tuple[Any, list[int]] | None":
    """The next message and the descriptors that came with it; None once the peer is gone."""
    head, fds, _, _ = socket.recv_fds(sock, 8, 4, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    while head and len(head) < 8:
        more = sock.recv(8 - len(head))
        if not more:
            return None
        head += more
    if not head:
        return None
    body = bytearray(struct.unpack("<Q", head)[0])
    view, got = memoryview(body), 0
    while got < len(body):
        n = sock.recv_into(view[got:])
        if not n:
            return None
        got += n
    return pickle.loads(body), fds


def encode_error(exc: BaseException) -> bytes:
    """An exception as bytes for the other process: itself when it survives pickling
    (with an ``OSError``'s errno, which pickling loses when set after construction),
    else a ``SaveAbortedError`` with its type and message."""
    try:
        blob = pickle.dumps(exc, pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - any exception type may come from a storage
        blob = pickle.dumps(SaveAbortedError(f"{type(exc).__name__}: {exc}"), pickle.HIGHEST_PROTOCOL)
    return pickle.dumps((blob, exc.errno if isinstance(exc, OSError) else None))


def decode_error(data: bytes) -> BaseException:
    blob, errno = pickle.loads(data)
    exc = pickle.loads(blob)
    if errno is not None and isinstance(exc, OSError):
        exc.errno = errno
    return cast(BaseException, exc)


# -- what a save hands over ----------------------------------------------------------

@dataclass
class Job:
    """A ``SaveRequest`` as the writer runs it: what can leave this process."""

    storage: tuple[str, bool, str]  # a ``LocalStorage``: path, follow_symlinks, anchor
    overwrite: Any                  # a bool or a picklable rule (``SaveRun``)
    step: int | None
    metadata: dict
    metrics: dict
    run_id: str | None
    durable_root: str | None        # a save on a local tier: the durable root it belongs to
    save_id: str                    # drawn here: after a writer died, its commit can be told apart
    asks: bool                      # the request has a ``before_commit``, which runs here

    def request(self, before_commit: "Callable[[], None] | None" = None, storage: Any = None) -> SaveRequest:
        path, follow, anchor = self.storage
        return SaveRequest(storage or LocalStorage(path, follow_symlinks=follow, anchor=anchor), SingleGroup(),
                           self.overwrite, self.step, self.metadata, self.metrics, before_commit=before_commit,
                           run_id=self.run_id, durable_root=self.durable_root, save_id=self.save_id)


def job_for(request: SaveRequest) -> Job | None:
    """The job for ``request`` when a writer process can run it: a full save by one
    process (``stageable``) to a local or network filesystem, with a picklable
    ``overwrite``; None otherwise (the save then runs on a thread of this process)."""
    storage = request.storage
    if not (SUPPORTED and _broken is None and request.stageable and os.environ.get(ENV, "process") != "thread"
            and type(storage) is LocalStorage and storage.fs is OS_FILESYSTEM):
        return None
    running = _current
    if running is not None and running.owner == os.getpid() and running.dead is None \
            and running.identity != identity():
        return None  # the process now writes as someone else, or with another umask
    if not isinstance(request.overwrite, bool):
        try:
            pickle.dumps(request.overwrite)
        except (pickle.PicklingError, AttributeError, TypeError):
            return None
    return Job((storage.path, storage.follow_symlinks, storage.anchor), request.overwrite, request.step,
               request.metadata, request.metrics, request.run_id, request.durable_root, new_save_id(),
               request.before_commit is not None)


def commit(job: Job, handover: Handover, buffer: SharedBuffer, request: SaveRequest) -> Manifest:
    """Have the writer commit a save staged in ``buffer``; the committed manifest (its
    summary). Runs on the saver's background thread, which only waits meanwhile."""
    caught: list[tuple[type[Warning], str]] = []
    try:
        return _writer().save(job, handover, buffer, request.before_commit, caught)
    except WriterDiedError as died:
        committed = _committed(request, job.save_id)
        if committed is not None:
            return committed
        remove_quietly(request.storage, [data_file_name(job.save_id, 0)])
        if died.started:
            raise
        _give_up(str(died))
    finally:
        _reissue(caught)
    flat, starts = WriterPlans().flat_state(None, handover)  # the handover of a save holds its pieces
    return _finish(job.request(request.before_commit, request.storage), flat,
                   BufferStager(buffer.view(handover.size), starts))


def _committed(request: SaveRequest, save_id: str) -> Manifest | None:
    """The manifest of save ``save_id`` if it was committed before its writer died."""
    try:
        manifest = read_committed(request.storage)
    except Exception:  # noqa: BLE001 - not committed, or unreadable: either way not this save's
        return None
    return manifest if manifest.save_id == save_id else None


def _finish(request: SaveRequest, flat: FlatState, stager: BufferStager) -> Manifest:
    """Commit a handed-over save: the protocol of a synchronous save, its data file's
    parts sliced from the buffer (``stager``)."""
    run = cast(StagedRun, request.start(StagedRun))
    run.stage(lambda: flat, stager)
    return run.finish_staged()


def _reissue(caught: list[tuple[type[Warning], str]]) -> None:
    """Warnings the writer caught during a save, issued here where the caller sees them."""
    for category, text in caught:
        if issubclass(category, SafeckptWarning):
            warn(text, category)
        else:
            warnings.warn(text, category, stacklevel=2)


_broken: str | None = None  # why no writer process can start here


def _give_up(reason: str) -> None:
    global _broken
    _broken = reason
    warn(f"safeckpt: the async writer process could not start ({reason}); async saves run on a thread of this "
         "process from now on", SafeckptWarning)


# -- the saving process's side -------------------------------------------------------

class Writer:
    """The writer process as the saving process sees it: one socket, a thread reading
    the answers, a queue of them per save."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = _launch(theirs.fileno())
        finally:
            theirs.close()
        self.sock = ours
        self.owner = os.getpid()
        self.started = False  # it said it was ready
        self.ready = threading.Event()  # set once it said so, or ended
        self.identity = identity()  # what it writes as: it inherited them when it started
        self.dead: str | None = None  # how it ended
        self.known: dict[str, int] = {}  # buffer id -> the layout (plan) the writer holds for it
        self._sending = threading.Lock()
        self._forgotten: list[str] = []  # buffers to unmap, sent with the next message (``forget``)
        self._lock = threading.Lock()  # guards ``_saves`` and ``dead``
        self._saves: dict[int, queue.SimpleQueue] = {}
        self._numbers = itertools.count(1)
        threading.Thread(target=self._read, name="safeckpt-writer-answers", daemon=True).start()

    def save(self, job: Job, handover: Handover, buffer: SharedBuffer,
             before_commit: "Callable[[], None] | None", caught: list[tuple[type[Warning], str]]) -> Manifest:
        """Send the save and wait for its answer; ``caught`` gets the warnings the writer caught."""
        number, answers = next(self._numbers), queue.SimpleQueue()  # type: ignore[var-annotated]
        with self._lock:
            if self.dead is not None:
                raise self._died(job)
            self._saves[number] = answers
        try:
            try:
                with self._sending:
                    self._send_forgotten()
                    if buffer.id not in self.known:
                        _send(self.sock, ("map", buffer.id), [buffer.fd])
                        self.known[buffer.id] = 0
                    sent = handover if self.known[buffer.id] != handover.plan else handover.without_pieces()
                    _send(self.sock, ("save", number, sent, job))
                    self.known[buffer.id] = handover.plan
            except OSError:
                pass  # it is gone: the reading thread says how
            while True:
                kind, payload = answers.get()
                if kind == "commit?":
                    self._answer(number, before_commit)
                elif kind == "done":
                    manifest, caught[:] = payload
                    return cast(Manifest, manifest)
                elif kind == "failed":
                    error, caught[:] = payload
                    raise decode_error(error)
                else:
                    raise self._died(job)
        finally:
            with self._lock:
                self._saves.pop(number, None)

    def _answer(self, number: int, before_commit: "Callable[[], None] | None") -> None:
        """The writer is about to commit: run ``before_commit`` here, send the outcome."""
        error = None
        try:
            if before_commit is not None:
                before_commit()
        except BaseException as exc:  # noqa: BLE001 - the writer raises it, the save fails with it
            error = encode_error(exc)
        try:
            with self._sending:
                _send(self.sock, ("go", number, error))
        except OSError:
            pass  # it is gone: the reading thread says how

    def _died(self, job: Job) -> WriterDiedError:
        path = job.storage[0]
        if not self.started:
            return WriterDiedError(f"the async writer process could not start: it {self.dead}", started=False)
        return WriterDiedError(
            f"the async writer process (pid {self.proc.pid}) {self.dead} while it was saving {path}: nothing was "
            "committed and the checkpoint there before is untouched. Save again (a new writer process starts); "
            "if the machine is short of memory, the OOM killer may have ended it")

    def _read(self) -> None:
        while True:
            try:
                got = _receive(self.sock)
            except OSError:
                got = None
            if got is None:
                break
            (kind, number, payload), _ = got
            if kind == "ready":
                self.started = True
                self.ready.set()
                continue
            with self._lock:
                answers = self._saves.get(number)
            if answers is not None:
                answers.put((kind, payload))
        code = self.proc.wait()
        if code < 0:
            how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
        elif code == 0 and signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
            how = "ended (killed or exited: this process ignores SIGCHLD, so the system does not say how)"
        else:
            how = f"exited with status {code} (its traceback, if any, is on this process's stderr)"
        with self._lock:
            self.dead = how
            waiting = list(self._saves.values())
        self.ready.set()
        for answers in waiting:
            answers.put(("died", None))

    def wait_ready(self) -> None:
        """Wait for the new writer to say it is ready; one that does not within
        ``READY_S`` (an interpreter that is not Python, a program that hangs) is killed,
        and no writer can start here (``WriterDiedError`` with ``started`` False)."""
        if self.ready.wait(READY_S) and self.started:
            return
        if not self.started:
            self.proc.kill()
            self.ready.wait(STOP_S)
            raise WriterDiedError(f"the async writer process could not start: {sys.executable} -c did not answer "
                                  f"within {READY_S:.0f} s (SAFECKPT_WRITER_START_TIMEOUT)", started=False)

    def forget(self, buffer: str) -> None:
        """A saver dropped its buffer: the writer unmaps it. Never waits (a saver that
        was not closed is forgotten by the garbage collector, on any thread, maybe one
        sending right now): while another message is being sent, it goes with the next."""
        if self.known.pop(buffer, None) is None:
            return
        self._forgotten.append(buffer)
        if self._sending.acquire(blocking=False):
            try:
                self._send_forgotten()
            except OSError:
                pass
            finally:
                self._sending.release()

    def _send_forgotten(self) -> None:
        while self._forgotten:
            _send(self.sock, ("forget", self._forgotten.pop()))

    def stop(self) -> None:
        """Close the connection (the writer exits after the saves it runs) and wait for it."""
        try:
            with self._sending:
                _send(self.sock, ("exit",))
        except OSError:
            pass
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()


_current: Writer | None = None
_lock = threading.Lock()


def _writer() -> Writer:
    """This process's writer, started (again) when there is none alive."""
    global _current
    with _lock:
        if _current is None or _current.owner != os.getpid() or _current.dead is not None:
            try:
                _current = Writer()
            except OSError as exc:  # no interpreter to start
                raise WriterDiedError(f"the async writer process could not start: {exc}", started=False) from exc
            _current.wait_ready()
        return _current


def identity() -> tuple:
    """What files a process writes are made as: its umask, effective user and groups. A
    writer started earlier writes as the saving process was then; a save made after the
    process changed them (``os.umask``, ``os.seteuid``) runs on a thread here instead."""
    umask = None
    try:
        with open("/proc/self/status") as f:
            umask = next((line.split()[1] for line in f if line.startswith("Umask:")), None)
    except OSError:
        pass
    return umask, os.geteuid(), os.getegid(), tuple(sorted(os.getgroups()))


def current_pid() -> int | None:
    """The pid of this process's writer while it runs (for tests and diagnostics)."""
    writer = _current
    return writer.proc.pid if writer is not None and writer.dead is None and writer.owner == os.getpid() else None


def forget(buffer: SharedBuffer) -> None:
    """``buffer`` is closed: the writer lets go of its mapping too."""
    writer = _current
    if writer is not None and writer.dead is None and writer.owner == os.getpid():
        writer.forget(buffer.id)


@atexit.register
def stop() -> None:
    """Stop this process's writer (at exit, after ``asyncsave`` waited for the saves)."""
    global _current
    with _lock:
        writer, _current = _current, None
    if writer is not None and writer.owner == os.getpid():
        writer.stop()


def _after_fork_in_child() -> None:
    """A forked child starts its own writer: its parent's is the parent's."""
    global _current, _lock, _launcher
    inherited, _current, _lock, _launcher = _current, None, threading.Lock(), None
    if inherited is not None:
        inherited.sock.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Launcher:
    """A thread that starts writer processes and lives as long as this process: a
    child's parent-death signal fires when the thread that started it ends."""

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="safeckpt-writer-launcher", daemon=True).start()

    def _run(self) -> None:
        while True:
            start, done = self.requests.get()
            try:
                done.put((start(), None))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.put((None, exc))

    def run(self, start: Callable[[], Any]) -> Any:
        done: queue.SimpleQueue = queue.SimpleQueue()
        self.requests.put((start, done))
        result, error = done.get()
        if error is not None:
            raise error
        return result


_launcher: _Launcher | None = None


def _launch(fd: int) -> subprocess.Popen:
    """Start a writer process holding the socket ``fd`` (from the launcher thread)."""
    global _launcher
    if _launcher is None:
        _launcher = _Launcher()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # it copies bytes: no thread pools
    command = [*COMMAND, str(fd), str(os.getpid())]
    return cast(subprocess.Popen, _launcher.run(
        lambda: subprocess.Popen(command, pass_fds=[fd], env=env, stdin=subprocess.DEVNULL, close_fds=True)))


# -- the writer process ---------------------------------------------------------------

class _Server:
    """The writer's loop: map buffers, run each save on a thread, answer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._sending = threading.Lock()
        self.buffers: dict[str, MappedBuffer] = {}
        self.plans = WriterPlans()
        self.go: dict[int, queue.SimpleQueue] = {}
        self.threads: list[threading.Thread] = []
        self.local = threading.local()  # the save a thread runs: its number and the warnings it caught

    def send(self, message: Any) -> None:
        with self._sending:
            _send(self.sock, message)

    def serve(self) -> None:
        warnings.showwarning = self._caught
        warnings.simplefilter("always")  # each goes to the saving process, whose filters decide
        self.send(("ready", 0, os.getpid()))
        while True:
            got = _receive(self.sock)
            if got is None or got[0][0] == "exit":
                break
            message, fds = got
            kind = message[0]
            if kind == "map":
                self._forget(message[1])
                self.buffers[message[1]] = MappedBuffer(fds[0])
            elif kind == "save":
                _, number, handover, job = message
                self.go[number] = queue.SimpleQueue()
                thread = threading.Thread(target=self._save, args=(number, handover, job), name=f"save-{number}")
                self.threads = [t for t in self.threads if t.is_alive()] + [thread]
                thread.start()
            elif kind == "go":
                self.go[message[1]].put(message[2])
            elif kind == "forget":
                self._forget(message[1])
        for answers in self.go.values():
            answers.put(encode_error(SaveAbortedError("the saving process closed its connection")))
        for thread in self.threads:
            thread.join()

    def _forget(self, buffer: str) -> None:
        mapped = self.buffers.pop(buffer, None)
        if mapped is not None:
            mapped.close()
        self.plans.forget(buffer)

    def _save(self, number: int, handover: Handover, job: Job) -> None:
        caught: list[tuple[type[Warning], str]] = []
        self.local.caught = caught
        try:
            flat, starts = self.plans.flat_state(handover.buffer, handover)
            stager = BufferStager(self.buffers[handover.buffer].view(handover.size), starts)
            ask = (lambda: self._ask(number)) if job.asks else None
            answer: tuple = ("done", number, (_finish(job.request(ask), flat, stager), caught))
        except BaseException as exc:  # noqa: BLE001 - every error goes back to the saver
            answer = ("failed", number, (encode_error(exc), caught))
        finally:
            self.go.pop(number, None)
            self.local.caught = None
        try:
            self.send(answer)
        except OSError:  # the saving process is gone
            pass

    def _ask(self, number: int) -> None:
        self.send(("commit?", number, None))
        error = self.go[number].get()
        if error is not None:
            raise decode_error(error)

    def _caught(self, message: Any, category: type, filename: str, lineno: int, file: Any = None,
                line: Any = None) -> None:
        caught = getattr(self.local, "caught", None)
        if caught is None:
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            caught.append((category, str(message)))


def _die_with(parent: int) -> None:
    """Get SIGKILL when the thread that started this process ends (Linux), and leave now
    if the parent is gone already."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def main(argv: "list[str] | None" = None) -> None:
    """The writer process: ``COMMAND FD PARENT_PID``."""
    fd, parent = (int(a) for a in (argv if argv is not None else sys.argv[1:]))
    _die_with(parent)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C or a scheduler's SIGTERM is for the saving
        signal.signal(sig, signal.SIG_IGN)       # process, which may save once more: this one ends with it
    _Server(socket.socket(fileno=fd)).serve()
