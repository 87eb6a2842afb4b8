"""What interrupted saves left in a checkpoint folder, and whether their writer may
still be running: the one rule that garbage collection, the writer lease and a save
clearing its folder (``clear_aborted``) all apply.

A save may be running until its save id (which starts with the unix time the save
began) is ``min_age_s`` old -- garbage collection's rule -- unless its writer is known
to be dead -- the writer lease's rule: a data file names its writer (``safeckpt_writer``,
``<pid>@<host>``, in its safetensors metadata), and a writer on this host (same host name
and process namespace) whose process is gone is dead. A writer on another host, or a
file too short to name one (a save killed at once, or written by an older safeckpt),
cannot be asked. Ages come from save ids, never from file times, which FUSE mounts get
wrong.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time

import xxhash

from ..errors import CorruptCheckpointError
from ..format import manifestcache
from ..format.folder import manifest_seqs, shared_by_siblings
from ..format.manifest import Manifest
from ..format.names import DATA_RE
from ..storage import Storage
from .filecheck import read_header_length


def _host() -> str:
    """This host as its writers name it: a digest of the host name and the process
    namespace (two containers may share a host name, never process ids), of fixed
    length so that a data file's size does not depend on the machine."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return xxhash.xxh3_64_hexdigest(f"{socket.gethostname()} {namespace}".encode())


THIS_HOST = _host()
#: a later save into a folder clears an earlier save's files whose writer is on another
#: host (or unknown) once the save is this old; ``safeckpt gc`` spares as long by default
ABANDONED_AFTER_S = 3600.0
WRITER_KEY = "safeckpt_writer"
_WRITER = re.compile(r'"safeckpt_writer":("(?:[^"\\]|\\.)*")')
_HEAD = 4096  # the writer is in the metadata, which comes first in the header


def writer_tag() -> str:
    """This process as a data file names its writer: ``<pid, 10 digits>@<host digest>``."""
    return f"{os.getpid():010d}@{THIS_HOST}"


def process_alive(host: str, pid: int) -> bool | None:
    """Whether the process ``pid`` of ``host`` runs (this process does); None when it
    is on another host and cannot be asked."""
    if host != THIS_HOST:
        return None
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save_id_age(save_id: str, now: float) -> float:
    """Seconds since the save with this id started (its id begins with unix seconds)."""
    try:
        return now - int(save_id[:8], 16)
    except ValueError:
        return float("inf")


def read_writer(folder: Storage, name: str) -> tuple[str, int] | None:
    """(host, pid) of the process that wrote the data file ``name``, or None when its
    header does not say (too short, not ours, or written before writers were named)."""
    try:
        size = folder.size(name)
        if size < 8:
            return None
        end = min(size, 8 + read_header_length(folder.read(name, 0, 8)), _HEAD)
        m = _WRITER.search(folder.read(name, 8, end - 8).decode("utf-8", "replace"))
        pid, _, host = json.loads(m.group(1)).partition("@") if m else ("", "", "")
        return (host, int(pid)) if pid.isdigit() else None
    except (OSError, EOFError, ValueError):
        return None


def save_may_run(folder: Storage, name: str, save_id: str, min_age_s: float | None, now: float) -> bool:
    """Whether the save that wrote the data file ``name`` may still be running (see the
    module docstring); with ``min_age_s`` None no save is (the caller knows)."""
    if min_age_s is None or save_id_age(save_id, now) >= min_age_s:
        return False
    writer = read_writer(folder, name)
    return writer is None or process_alive(*writer) is not False


def clear_aborted(folder: Storage, committed: Manifest | None, min_age_s: float | None = ABANDONED_AFTER_S,
                  now: float | None = None) -> list[str]:
    """Before a save writes into ``folder`` (whose committed manifest is ``committed``):
    delete the data files of earlier saves there that never committed (killed, or their
    clean-up failed) and cannot be running any more (``save_may_run``), so that their
    space is free for this one. A file any manifest of the folder names, or a sibling
    checkpoint shares, is left alone; so are manifests (the commit replaces or retires
    them, garbage collection removes torn ones). Returns the names deleted."""
    now = time.time() if now is None else now
    listing = folder.listdir()
    orphans = [(n, m.group(1)) for n in listing
               if (m := DATA_RE.fullmatch(n)) and (committed is None or n not in committed.files)]
    if not orphans:
        return []
    named = shared_by_siblings(folder)
    for seq, name in manifest_seqs(listing):
        if committed is None or seq != committed.seq:
            try:
                named |= set(manifestcache.decode(folder.read(name), f"{folder.url}/{name}").files)
            except (CorruptCheckpointError, OSError):
                continue
    doomed = sorted(n for n, save_id in orphans if n not in named
                    and not save_may_run(folder, n, save_id, min_age_s, now))
    folder.delete(doomed)
    return doomed
