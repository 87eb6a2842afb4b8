"""Faults for async saves, the same in the saving process (saves on a thread) and in the
async writer process (``safeckpt.run.writer``), chosen by the path of the file written:
under a folder whose name ends in

- ``@full``: every write to a data file fails with ENOSPC at the OS call, as on a full
  disk, unless a file ``<that folder>.ok`` exists (``heal``, ``fail``);
- ``@eio``: the write of a manifest fails with EIO, unless ``<that folder>.ok`` exists;
- ``@held``: a data file is created only once a file ``<that folder>.go`` exists (the
  save is held in flight until the test lets it go: ``release``);
- ``@midway``: a data file's writes after its first wait for that ``.go`` file (a save
  held in the middle of writing its data file);
- ``@die``: the process is SIGKILLed right after it wrote, fsynced and closed a manifest
  (a writer process that dies after its commit, before it could say so);
- ``@keep``: deleting a file fails with EACCES.

``install(setattr)`` patches ``OSFileSystem`` in this process (pass
``monkeypatch.setattr``); ``python writer_faults.py FD PID`` is a writer process with
the patches in place (``writer_command()``: what ``safeckpt.run.writer.COMMAND``
becomes for a test).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

HOLD_S = 60.0


def _under(path: str, marker: str) -> str | None:
    """The folder above ``path`` whose name ends in ``marker``, if any."""
    parts = Path(path).parts[:-1]
    for i in range(len(parts), 0, -1):
        if parts[i - 1].endswith(marker):
            return str(Path(*parts[:i]))
    return None


def _hold(folder: str) -> None:
    """Wait until the test lets saves under ``folder`` go on (``release``), or HOLD_S."""
    deadline = time.monotonic() + HOLD_S
    while not os.path.exists(folder + ".go") and time.monotonic() < deadline:
        time.sleep(0.01)


def install(patch: Callable[[Any, str, Any], None] = setattr) -> None:
    from safeckpt.storage.local import OSFileSystem

    failing: dict[int, int] = {}  # fd -> the errno its writes fail with
    dying: set[int] = set()  # fds of manifests whose close kills the process
    midway: dict[int, list] = {}  # fd of a data file -> [its folder, written to yet]
    real_open, real_write, real_close = OSFileSystem.open, OSFileSystem.write, OSFileSystem.close
    real_unlink = OSFileSystem.unlink

    def open_(self, path, flags, mode=0o777):
        name = os.path.basename(path)
        held = _under(path, "@held")
        if held is not None and name.startswith("data-"):
            _hold(held)
        fd = real_open(self, path, flags, mode)
        failing.pop(fd, None)
        full, eio = _under(path, "@full"), _under(path, "@eio")
        if name.startswith("data-") and full is not None and not os.path.exists(full + ".ok"):
            failing[fd] = errno.ENOSPC
        elif name.startswith("manifest-") and eio is not None and not os.path.exists(eio + ".ok"):
            failing[fd] = errno.EIO
        dying.discard(fd)
        midway.pop(fd, None)
        gate = _under(path, "@midway")
        if gate is not None and name.startswith("data-"):
            midway[fd] = [gate, False]
        if name.startswith("manifest-") and _under(path, "@die") is not None:
            dying.add(fd)
        return fd

    def close(self, fd):
        real_close(self, fd)
        if fd in dying:
            os.kill(os.getpid(), signal.SIGKILL)

    def write(self, fd, data):
        if fd in failing:  # as the OS reports it
            raise OSError(failing[fd], os.strerror(failing[fd]))
        if fd in midway:
            if midway[fd][1]:
                _hold(midway[fd][0])
            midway[fd][1] = True
        return real_write(self, fd, data)

    def unlink(self, path):
        if _under(path, "@keep") is not None:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_unlink(self, path)

    patch(OSFileSystem, "unlink", unlink)
    patch(OSFileSystem, "open", open_)
    patch(OSFileSystem, "write", write)
    patch(OSFileSystem, "close", close)


def heal(folder: "str | os.PathLike[str]") -> None:
    """Writes under ``folder`` (``@full``, ``@eio``) work from now on."""
    Path(str(folder) + ".ok").touch()


def fail(folder: "str | os.PathLike[str]") -> None:
    """Writes under ``folder`` (``@full``, ``@eio``) fail again."""
    Path(str(folder) + ".ok").unlink(missing_ok=True)


def release(folder: "str | os.PathLike[str]") -> None:
    """Let the saves held under ``folder`` (a name ending in ``@held`` or ``@midway``) go on."""
    Path(str(folder) + ".go").touch()


def writer_command() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve())]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # this checkout's safeckpt
    install()
    from safeckpt.run.writer import main

    main(sys.argv[1:])
