"""The ranks taking part in a save or load, behind a few collectives.

``SingleGroup`` stands in when torch.distributed is not initialized. ``TorchGroup``
runs object collectives on a dedicated gloo group created with a timeout, so a rank
that dies or hangs turns into a clear error instead of a hang, and checkpoint traffic
never interleaves with the training's own collectives. Its ``send_bytes`` and
``recv_bytes`` move files between two ranks (the node tier's peer copies) under the
same timeout; loads that share what they read (``exchange``) send bytes point to
point over it, or over a dedicated NCCL group (``device_group``).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import threading
from typing import Any

from ..errors import SaveAbortedError

DEFAULT_TIMEOUT_S = float(os.environ.get("SAFECKPT_TIMEOUT", "300"))
SEND_BLOCK = 64 << 20  # bytes per point-to-point message
NODE_ENV = "SAFECKPT_NODE_ID"
Peers = list[tuple[Any, int, int]]  # (a tensor of bytes, the other rank, a tag told apart within one exchange)


def node_id() -> str:
    """This process's node: ``$SAFECKPT_NODE_ID``, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


class CollectiveError(SaveAbortedError):
    """Another rank stopped answering (died, hung, or lost its connection)."""


class SingleGroup:
    """One process: every collective is the identity."""

    rank = 0
    size = 1

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def scatter(self, objs: list[Any] | None) -> Any:
        assert objs is not None  # the only rank is the source
        return objs[0]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]


class TorchGroup:
    """Object collectives over a torch.distributed process group."""

    def __init__(self, pg: Any, timeout_s: float) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.pg = pg
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.root = dist.get_global_rank(pg, 0) if pg is not None else 0
        self.plans: Any = None  # the saves' kept plans (``plancache``), made on first use

    def _run(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except RuntimeError as exc:  # gloo: timeouts, closed connections
            raise CollectiveError(
                f"rank {self.rank}: lost contact with the other ranks during {what} "
                f"(timeout {self.timeout_s:.0f}s): a rank died, hung or disagrees on the call "
                f"sequence; nothing was committed [{exc}]") from exc

    def gather(self, obj: Any) -> list[Any] | None:
        out = [None] * self.size if self.rank == 0 else None
        self._run("gather", lambda: self.dist.gather_object(obj, out, dst=self.root, group=self.pg))
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        out = [None]
        self._run("scatter", lambda: self.dist.scatter_object_list(out, objs, src=self.root, group=self.pg))
        return out[0]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank."""
        box = [obj]
        self._run("broadcast", lambda: self.dist.broadcast_object_list(box, src=self.global_rank(src),
                                                                         group=self.pg))
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out = [None] * self.size
        self._run("all_gather", lambda: self.dist.all_gather_object(out, obj, group=self.pg))
        return out

    def send_bytes(self, data: "bytes | bytearray", dst: int) -> None:
        """Send ``data`` to rank ``dst`` of this group (which calls ``recv_bytes``): its
        length, then the bytes in blocks, viewed in place (torch only reads a buffer it
        sends)."""
        import torch
        peer = self.dist.get_global_rank(self.pg, dst)
        self._run("send", lambda: self.dist.send(torch.tensor([len(data)], dtype=torch.int64), peer, group=self.pg))
        if not data:
            return
        whole = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
        for lo in range(0, len(data), SEND_BLOCK):
            self._run("send", lambda b=whole[lo:lo + SEND_BLOCK]: self.dist.send(b, peer, group=self.pg))

    def recv_bytes(self, src: int) -> memoryview:
        """The bytes rank ``src`` sent with ``send_bytes``, received in place into one buffer."""
        import torch
        peer = self.dist.get_global_rank(self.pg, src)
        size = torch.zeros(1, dtype=torch.int64)
        self._run("recv", lambda: self.dist.recv(size, peer, group=self.pg))
        out = torch.empty(int(size), dtype=torch.uint8)
        for lo in range(0, int(size), SEND_BLOCK):
            self._run("recv", lambda b=out[lo:lo + SEND_BLOCK]: self.dist.recv(b, peer, group=self.pg))
        return out.numpy().data

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank: one all-reduce of one number."""
        import torch

        box = torch.tensor([int(flag)], dtype=torch.int32)
        self._run("all_reduce", lambda: self.dist.all_reduce(box, op=self.dist.ReduceOp.MAX, group=self.pg))
        return bool(box.item())

    def exchange(self, sends: Peers, recvs: Peers, pg: Any = None) -> None:
        """Send and receive byte tensors point to point, all posted at once, and wait for
        all of them (over ``pg``, this group's ranks on another backend, if given)."""
        pg = self.pg if pg is None else pg
        dist = self.dist

        def run() -> None:
            ops = [dist.P2POp(dist.isend, t, self.global_rank(r), pg, tag) for t, r, tag in sends] + \
                  [dist.P2POp(dist.irecv, t, self.global_rank(r), pg, tag) for t, r, tag in recvs]
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        self._run("exchange", run)

    def connect(self, pg: Any, device: Any) -> None:
        """Set up ``pg`` (this group's ranks on another backend) with one all-reduce on
        ``device``: NCCL wants every rank in its first call, and a rank may have nothing
        to send or receive in a window."""
        import torch

        self._run("all_reduce", lambda: self.dist.all_reduce(torch.zeros(1, device=device), group=pg))

    def global_rank(self, rank: int) -> int:
        return self.dist.get_global_rank(self.pg, rank) if self.pg is not None else rank


_dedicated: dict[Any, tuple[Any, Any]] = {}  # key -> (the world it spans, the group)
_lock = threading.Lock()


def _dedicated_group(key: Any, make: Any) -> Any:
    """The group made by ``make()`` for ``key`` over the current world, made once (every
    rank must ask for it at the same point: making a group is collective)."""
    import torch.distributed as dist

    with _lock:
        world = dist.group.WORLD
        for stale in [k for k, (w, _) in _dedicated.items() if w is not world]:
            del _dedicated[stale]  # made for a world destroyed since (a job that re-initialized)
        if key not in _dedicated:
            _dedicated[key] = (world, make())
        return _dedicated[key][1]


def resolve(process_group: Any = None, timeout_s: float | None = None,
            purpose: str = "foreground") -> SingleGroup | TorchGroup:
    """The group for a call: the given one, else a dedicated gloo group over the default
    world (one per ``purpose``, created collectively on first use), else a single process.
    Background commits use their own purpose so they never interleave with calls made
    from the training thread."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    if isinstance(process_group, (SingleGroup, TorchGroup)):
        return process_group
    try:
        import torch.distributed as dist
        initialized = dist.is_available() and dist.is_initialized()
    except ImportError:
        initialized = False
    if process_group is not None:
        return TorchGroup(process_group, timeout_s)
    if not initialized or dist.get_world_size() == 1:
        return SingleGroup()
    return _dedicated_group((timeout_s, purpose), lambda: TorchGroup(
        dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)), timeout_s))


def can_use_nccl(group: TorchGroup) -> bool:
    """Whether this rank can move bytes over a dedicated NCCL group spanning ``group``:
    CUDA, a world whose backend is NCCL, and ``group`` the whole world (making a group
    is collective over the world)."""
    import torch
    import torch.distributed as dist

    return torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower() \
        and group.size == dist.get_world_size()


def device_group(group: TorchGroup) -> Any:
    """The dedicated NCCL group over ``group``'s ranks (see ``can_use_nccl``), made once:
    every rank calls it at the same point."""
    import torch.distributed as dist

    return _dedicated_group((group.timeout_s, "exchange", "nccl"), lambda: dist.new_group(
        backend="nccl", timeout=datetime.timedelta(seconds=group.timeout_s)))


@atexit.register
def _release_at_exit() -> None:
    """Let go of the dedicated groups while the interpreter is still whole, also where a
    manager kept in a global still holds one. A gloo group still referenced when the
    interpreter tears down is destroyed in the middle of it, and its worker threads can
    abort the process ("terminate called without an active exception") after a script
    that did everything right, destroy_process_group included. Async saves are finished
    before this runs (their exit handler was registered later, so it runs first)."""
    with _lock:
        groups = [g for _, g in _dedicated.values() if isinstance(g, TorchGroup)]
        _dedicated.clear()
    for group in groups:
        group.pg = None
