"""Profiles by name and ``crash_points``: crash a piece of code at every storage operation.

``storage_for_profile("nfs")`` gives a fresh ``(storage, backend)`` pair; ``crash_points``
runs a function on it once to count its operations, then once per crash point k (and
per power-cut outcome) on a fresh copy of the state before it, crashing at operation k,
cutting the power, and yielding the recovered storage for the caller's assertions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..storage.base import Storage
from .disk import DISK_PROFILES, DiskProfile, SimulatedDisk
from .faults import SimulatedCrash
from .objectstore import ObjectBucket

__all__ = ["PROFILES", "storage_for_profile", "crash_points", "CrashPoint"]

#: every profile name ``storage_for_profile`` and ``crash_points`` accept
PROFILES = ("posix", "nfs", "windows", "fuse-object", "object-store")

DEFAULT_ROOT = "/ckpt"


def _backend(profile: "str | DiskProfile", root: str, seed: int | None) -> "SimulatedDisk | ObjectBucket":
    if isinstance(profile, DiskProfile):
        disk = SimulatedDisk(profile, seed=seed)
        disk.makedirs(root)
        return disk
    if profile == "object-store":
        return ObjectBucket(seed=seed)
    if profile not in DISK_PROFILES:
        raise ValueError(f"unknown storage profile {profile!r}; choose one of {', '.join(PROFILES)}")
    disk = SimulatedDisk(profile, seed=seed)
    disk.makedirs(root)
    return disk


def storage_for_profile(profile: "str | DiskProfile" = "posix", root: str = DEFAULT_ROOT, *,
                        seed: int | None = 0) -> tuple[Storage, "SimulatedDisk | ObjectBucket"]:
    """A fresh, empty ``Storage`` behaving like ``profile`` and its backend.

    Profiles: ``posix`` (folder fsync makes entries durable), ``nfs`` (metadata is
    synchronous, data durable only on fsync, files visible while incomplete, rename
    not atomic), ``windows`` (folder fsync refused, metadata journaled in order and
    committed by a file fsync, replace over an open file fails), ``fuse-object`` (an
    object-store FUSE mount, as rclone without its cache: a file is uploaded on close,
    not on fsync; a killed writer's file as far as it got; no rename, no append, no
    folder fsync) -- each a ``LocalStorage`` on a ``SimulatedDisk`` -- and
    ``object-store`` (a ``MemoryObjectStore``: no folders, no rename, atomic PUT,
    conditional create). A ``DiskProfile`` describes a filesystem of your own. The backend has ``crash_after``, ``inject(...)``,
    ``crash(rng, mode)``, ``clone()``, ``files()`` and ``storage(root)``."""
    backend = _backend(profile, root, seed)
    return backend.storage(root), backend


@dataclass
class CrashPoint:
    """One crashed-and-recovered run yielded by ``crash_points``."""

    profile: str
    k: int                 #: the operation that crashed (``total + 1``: none did)
    total: int             #: operations the uncrashed run made
    outcome: str           #: ``"kill"`` (nothing lost), ``"drop"`` or ``"power-cut#N"``
    crashed: bool          #: False when ``fn`` finished before operation ``k``
    op: str                #: ``"<kind> <path>"`` of the crashing operation, or ""
    storage: Storage       #: the recovered storage: assert on it
    backend: Any           #: its ``SimulatedDisk`` or ``ObjectBucket``
    result: Any = None     #: what ``fn`` returned when it was not crashed
    error: BaseException | None = None  #: an ordinary exception ``fn`` raised instead

    def __str__(self) -> str:
        where = f"crash at op {self.k}/{self.total} ({self.op})" if self.crashed else \
            f"no crash (fn finished after {self.total} ops)"
        return f"[{self.profile}] {where}, outcome {self.outcome}"


def crash_points(fn: Callable[[Storage], Any], profile: "str | DiskProfile" = "posix", *,
                 setup: Callable[[Storage], Any] | None = None, power_cuts: int = 2,
                 seed: int = 0, root: str = DEFAULT_ROOT,
                 only: "tuple[int, str] | None" = None) -> Iterator[CrashPoint]:
    """Crash ``fn(storage)`` at every storage operation, exhaustively, and yield each
    recovered storage.

    ``setup(storage)`` builds the state before (say, a committed checkpoint); it runs
    once and is never crashed. ``fn`` then runs once uncrashed to count its operations
    ``n``; then for every ``k`` in ``1..n+1`` (``n+1``: ``fn`` finishes and the power
    fails right after) and every outcome it runs again on a fresh copy of the state
    after ``setup``, crashing at operation ``k``: a ``"kill"`` (the process dies, the OS
    keeps what it was given), a ``"drop"`` (the power fails and everything not synced is
    lost) and ``power_cuts`` random power cuts (each unsynced write kept, dropped or torn
    into garbage; each unsynced folder change kept or undone). Object stores lose
    nothing on a crash, so they get only the ``"kill"`` outcome. ``only=(k, outcome)``
    replays one point. Everything is seeded by ``seed``: a failing point replays the
    same way."""
    _, base = storage_for_profile(profile, root, seed=seed)
    if setup is not None:
        setup(base.storage(root))
    probe = base.clone()
    fn(probe.storage(root))
    total = probe.ops
    outcomes = ["kill"]
    if not isinstance(base, ObjectBucket):
        outcomes += ["drop"] + [f"power-cut#{i}" for i in range(power_cuts)]
    for k in range(1, total + 2):
        for outcome in outcomes:
            if only is not None and (k, outcome) != tuple(only):
                continue
            backend = base.clone()
            backend.crash_after = k if k <= total else None
            result = error = None
            try:
                result = fn(backend.storage(root))
            except SimulatedCrash:
                pass
            except Exception as exc:  # noqa: BLE001 - handed to the caller to judge
                error = exc
            crash = backend.crashed
            crashed = crash is not None
            op = f"{crash.kind} {crash.path}" if crashed else ""
            rng = random.Random(f"{seed}:{profile}:{k}:{outcome}")
            mode = outcome if outcome in ("kill", "drop") else "random"
            backend.crash(rng, "keep" if mode == "kill" else mode)
            yield CrashPoint(profile.name if isinstance(profile, DiskProfile) else profile, k, total, outcome, crashed, op, backend.storage(root), backend,
                             result, error)
