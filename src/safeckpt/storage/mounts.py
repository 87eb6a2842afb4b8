"""Which mount a local folder is on, and whether an fsync there makes a file durable.

A FUSE mount of an object store is a local path whose durability is its daemon's. rclone
with its VFS write cache (``--vfs-cache-mode writes`` or ``full``) answers fsync and
close at once and uploads the file later (``--vfs-write-back``, 5 s by default; with 0
the upload still starts only after close returns), while a deletion reaches the bucket
at once: right after an overwrite or a retention pass the bucket may hold no checkpoint
at all, and a machine lost in that window loses the last good one. Without the cache
(``off``, or ``minimal`` for files opened write-only) close returns once the object is
uploaded.

The mount table (``/proc/self/mountinfo``) names the filesystem (``fuse.rclone``) but
not rclone's options: the cache mode is read from the rclone process that serves the
mount (its command line, then ``RCLONE_VFS_CACHE_MODE`` in its environment). When that
process cannot be seen (another container), the mount counts as cached: the warning
says how to tell.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from ..errors import WeakStorageWarning, warn

MOUNTINFO = "/proc/self/mountinfo"
#: rclone cache modes whose close returns before the file is in the bucket
WRITE_BACK_MODES = ("writes", "full")

_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()  # (mount id, mount point) of the mounts warned about
_seen: set[str] = set()  # folders already looked at (a save writes several files into one)


@dataclass(frozen=True)
class Mount:
    """One line of the mount table."""

    id: str
    point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    """Mount table fields escape space, tab, newline and backslash as octal."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mount_of(path: str, table: str = MOUNTINFO) -> Mount | None:
    """The mount holding ``path`` (the longest mount point above it), or None when the
    mount table cannot be read (not Linux)."""
    try:
        with open(table) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    path = os.path.realpath(path)
    best: Mount | None = None
    for line in lines:
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        rest = fields[fields.index("-", 6) + 1:]
        point = _unescape(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(fields[0], point, rest[0], _unescape(rest[1]) if len(rest) > 1 else "")
    return best


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in a command line (the last one)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def rclone_cache_mode(point: str, proc: str = "/proc") -> str | None:
    """The ``--vfs-cache-mode`` of the rclone process serving the mount at ``point`` (its
    default, ``off``, when not given), or None when no such process can be seen."""
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            if not args or not os.path.basename(args[0]).startswith("rclone") or "mount" not in args[1:3]:
                continue
            cwd = os.readlink(f"{proc}/{pid}/cwd")
        except OSError:
            continue
        if not any(os.path.realpath(os.path.join(cwd, a)) == point for a in args[2:] if not a.startswith("-")):
            continue
        mode = _flag(args, "--vfs-cache-mode")
        if mode is None:
            try:
                with open(f"{proc}/{pid}/environ", "rb") as f:
                    env = dict(e.decode(errors="replace").partition("=")[::2] for e in f.read().split(b"\0") if e)
                mode = env.get("RCLONE_VFS_CACHE_MODE")
            except OSError:
                pass
        return (mode or "off").lower()
    return None


def fsync_weakness(mount: Mount, folder: str) -> str | None:
    """Why an fsync in ``folder`` on ``mount`` does not make a file durable, or None when
    it does (as far as the mount table and the mount's daemon tell)."""
    if mount.fstype != "fuse.rclone":
        return None
    mode = rclone_cache_mode(mount.point)
    if mode is not None and mode not in WRITE_BACK_MODES:
        return None
    how = f"--vfs-cache-mode {mode}" if mode else "a cache mode this process cannot see (its rclone runs elsewhere)"
    return (f"{folder} is on an rclone mount of {mount.source} at {mount.point} with {how}: rclone answers "
            "fsync and close before it uploads a file (seconds later) but deletes at once, so right after an "
            "overwrite or a retention pass the bucket may hold no checkpoint, and a crash of this machine then "
            "loses the last good one. Mount with --vfs-cache-mode off (or minimal): close then returns once "
            "the file is in the bucket (--vfs-write-back 0 only shortens the window)")


def warn_if_fsync_is_weak(folder: str) -> None:
    """Warn (``WeakStorageWarning``), once per mount, when files written in ``folder``
    are not durable when their fsync and close return. A folder is looked at once."""
    with _lock:
        if folder in _seen:
            return
        if len(_seen) > 4096:
            _seen.clear()
        _seen.add(folder)
    mount = mount_of(folder)
    if mount is None or not mount.fstype.startswith("fuse."):
        return
    with _lock:
        if (mount.id, mount.point) in _warned:
            return
        reason = fsync_weakness(mount, folder)
        if reason is not None:
            _warned.add((mount.id, mount.point))
    if reason is not None:
        warn(reason, WeakStorageWarning)
