"""One writer per run root: numbered lease files, the highest epoch holds the root.

A manager takes the root by creating the next lease file (exclusive create, so two
takers cannot both win). Another live process on the same host holding it makes the
new one fail fast; otherwise (a dead process, or another host that cannot be asked)
the new one takes over and the old one is *fenced*: it checks the lease before every
commit and deletion and stops with a clear error once it is no longer the holder.
No clocks or mtimes are involved.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass

from ..errors import WeakStorageWarning, warn
from ..errors import CheckpointExistsError
from ..format.names import LEASE_RE, lease_name
from ..protocol.leftovers import THIS_HOST, process_alive
from ..storage import Storage



@dataclass
class Holder:
    """Who holds a lease."""

    run_id: str
    host: str  #: ``leftovers.THIS_HOST`` of the holder (leases of older releases: its host name)
    pid: int
    token: str
    created: float
    hostname: str = ""  #: for messages

    @property
    def where(self) -> str:
        return f"pid {self.pid} on {self.hostname or self.host}"

    def alive_here(self) -> bool:
        """True when the holder is another process on this host that is still running."""
        return self.pid != os.getpid() and process_alive(self.host, self.pid) is True


class WriterLease:
    """The lease of one manager on one root."""

    def __init__(self, storage: Storage, run_id: str) -> None:
        self.storage = storage
        self.me = Holder(run_id, THIS_HOST, os.getpid(), uuid.uuid4().hex, time.time(), socket.gethostname())
        self.epoch: int | None = None

    def current(self) -> tuple[int, Holder | None]:
        """The highest lease epoch in the root and its holder (None if unreadable)."""
        epochs = [int(m.group(1)) for n in self.storage.listdir() if (m := LEASE_RE.fullmatch(n))]
        if not epochs:
            return 0, None
        epoch = max(epochs)
        try:
            return epoch, Holder(**json.loads(self.storage.read(lease_name(epoch))))
        except (ValueError, TypeError, OSError):
            return epoch, None

    def acquire(self) -> None:
        """Take the root (see module docstring); raises if a live local process has it.

        The lease is only as strong as the backend's exclusive create: where that is
        not enforced (``Storage.exclusive_create`` false), two jobs starting at the same
        moment could both take it, which is said once in a warning."""
        if not self.storage.exclusive_create:
            warn(f"{self.storage.url}: this storage cannot create files exclusively, so the writer "
                 "lease cannot keep two jobs that start at the same moment apart; run one job per "
                 "checkpoint root", WeakStorageWarning)
        epoch, holder = self.current()
        if holder is not None and holder.token != self.me.token and holder.alive_here():
            raise CheckpointExistsError(
                f"{self.storage.url} is in use by another job ({holder.where}, "
                f"run {holder.run_id}); two jobs must not write one checkpoint root. Stop the "
                "other job or use another root")
        try:
            self.storage.write_file(lease_name(epoch + 1), [json.dumps(asdict(self.me)).encode()])
        except FileExistsError as exc:
            raise CheckpointExistsError(
                f"another job took {self.storage.url} at the same moment; two jobs must not write "
                "one checkpoint root") from exc
        self.epoch = epoch + 1
        older = [lease_name(e) for e in range(max(1, epoch - 2), epoch + 1)]
        self.storage.delete(older)

    def check(self) -> None:
        """Raise if another manager has taken the root since we acquired it."""
        if self.epoch is None:
            self.acquire()
            return
        epoch, holder = self.current()
        if epoch != self.epoch:
            who = holder.where if holder else "another job"
            raise CheckpointExistsError(
                f"this manager no longer owns {self.storage.url}: {who} took it over; to protect "
                "that job's checkpoints this one will not commit or delete anything more")
