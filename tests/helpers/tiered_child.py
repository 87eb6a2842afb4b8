"""Tools for tests/test_tiered.py: a storage wrapper that lets a test stop a copy at a
chosen byte, and a fork server whose children save through a tiered manager and are
SIGKILLed while rank 0 copies a checkpoint to the durable root.

``HookedStorage(inner, on_write)`` delegates every operation to ``inner`` and passes
each ``write_file`` through ``on_write(rel, parts) -> parts``, where ``rel`` is the
file's path relative to the wrapped root (``step-000000002/data-...``,
``safeckpt-writer-000000001.json``). A hook can block (a test gate), stall half way
through the bytes, or change nothing.

``TieredForkServer`` starts this file as save_child's fork server with one more mode,
``tiered_kill``: save steps with ``CheckpointManager(durable, local=...)``, then stall
the durable copy of the last step at ``point`` and report ``stall N`` to the progress
file; the test SIGKILLs the child there. The points:

- ``mid_data``: half of the durable copy of a data file written (a torn data file);
- ``before_manifest``: every data file copied, the manifest not yet written;
- ``torn_manifest``: half of the manifest's bytes written (on a local folder: a torn
  manifest file; on an object store nothing appears until the PUT completes).
"""

from __future__ import annotations

import posixpath
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import save_child
from save_child import ForkServer, _Progress, make_state

from safeckpt.storage import Storage, StorageWrapper

HERE = Path(__file__).resolve()

Hook = Callable[[str, Iterable], Iterable]


class HookedStorage(StorageWrapper):
    """``inner`` with every ``write_file`` passed through ``on_write(rel, parts)``."""

    def __init__(self, inner: Storage, on_write: Hook, rel: str = ".") -> None:
        super().__init__(inner)
        self.on_write = on_write
        self.rel = rel

    def _rel(self, name: str) -> str:
        return posixpath.normpath(posixpath.join(self.rel, name))

    def child(self, name: str) -> "HookedStorage":
        return HookedStorage(self.inner.child(name), self.on_write, self._rel(name))

    def parent(self) -> "HookedStorage":
        return HookedStorage(self.inner.parent(), self.on_write, self._rel(".."))

    def write_file(self, name: str, parts: Iterable) -> int:
        return self.inner.write_file(name, self.on_write(self._rel(name), parts))


def half_then(parts: Iterable, then: Callable[[], None]) -> Iterator[bytes]:
    """The first half of the bytes, then ``then()`` (which may never return), then the rest."""
    data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    yield data[: len(data) // 2]
    then()  # runs only after the first half was handed to the storage
    yield data[len(data) // 2:]


# --------------------------------------------------------------------------- child mode


def mode_tiered_kill(local: str, durable: str, progress: str, point: str, steps: list,
                     options: dict | None = None, keep_last: int = 3, limit_s: float = 60.0) -> None:
    """Save ``steps`` through a tiered manager (waiting for the durable copy of every
    step but the last), then stall the durable copy of the last one at ``point``."""
    import safeckpt
    from safeckpt.format.names import step_folder
    from safeckpt.storage import open as open_storage

    report = _Progress(progress)
    last = steps[-1]
    target = step_folder(last) + "/"

    def stall() -> None:
        report("stall", last)
        time.sleep(limit_s)  # the test kills this process here
        raise AssertionError(f"nobody killed the child stalled at {point}")

    def on_write(rel: str, parts: Iterable) -> Iterable:
        if not rel.startswith(target):
            return parts
        name = rel[len(target):]
        if point == "mid_data" and name.startswith("data-"):
            return half_then(parts, stall)
        if point == "before_manifest" and name.startswith("manifest-"):
            stall()
        if point == "torn_manifest" and name.startswith("manifest-"):
            return half_then(parts, stall)
        return parts

    root = HookedStorage(open_storage(durable, **(options or {})), on_write)
    mgr = safeckpt.CheckpointManager(root, local=local, keep_last=keep_last, keep_local=2,
                                     storage_options=options)
    for step in steps:
        report("begin", step)
        mgr.save(step, make_state(step))
        report("done", step)
        if step != last:
            mgr.wait()
            report("copied", step)
    mgr.wait()  # stalls in the copy of the last step until killed
    raise AssertionError(f"the copy of step {last} was never stalled at {point}")


def read_events(path: str) -> list[tuple[str, int]]:
    """(event, step) lines of a progress file, in order."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        what, _, n = line.partition(" ")
        if n.isdigit():
            out.append((what, int(n)))
    return out


def serve() -> None:
    save_child.MODES["tiered_kill"] = mode_tiered_kill
    save_child.serve()


class TieredForkServer(ForkServer):
    """save_child's ``ForkServer``, started on this file (so children know ``tiered_kill``)."""

    def __init__(self, src: str) -> None:
        super().__init__(src, script=str(HERE))


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit("usage: tiered_child.py serve")
