"""The one judgement of what a checkpoint folder is: committed, torn, corrupt, of a newer
format, empty or retired. ``CheckpointManager`` (listing, restore, retention) and every
``safeckpt`` command name a folder's state through this module, so they always agree."""

from __future__ import annotations

from ..protocol.checkpoint import read_committed
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from ..run.garbage import RETIRED as RETIRED_MARKER
from .manifest import Manifest
from ..storage import Storage

COMMITTED = "committed"        # a valid manifest: the checkpoint loads
TORN = "torn"                  # files but no manifest: a save that was killed (or is still running)
CORRUPT = "corrupt"            # manifests, none valid (or, for verify, data that fails its checksums)
NEWER_FORMAT = "newer_format"  # written by a newer safeckpt: never skipped, never judged corrupt
EMPTY = "empty"                # nothing in the folder (or no folder)
RETIRED = "retired"            # deleted by retention; keeps data newer checkpoints share

STATES = (COMMITTED, TORN, CORRUPT, NEWER_FORMAT, EMPTY, RETIRED)

# how people are shown each state (tables, one-line reports); --json uses the names above
LABEL = {COMMITTED: "committed", TORN: "torn save", CORRUPT: "CORRUPT",
         NEWER_FORMAT: "newer format (upgrade safeckpt)", EMPTY: "empty", RETIRED: "retired (data still shared)"}

_RETIRED_WHY = "deleted by retention; holds data later checkpoints share"


def folder_state(folder: Storage, listing: dict[str, int | None] | None = None) -> tuple[str, Manifest | str]:
    """``(COMMITTED, manifest)``, or ``(state, why)`` for every other state."""
    if listing is None:
        listing = folder.listdir()
    try:
        return COMMITTED, read_committed(folder, listing)
    except UnsupportedFormatError as exc:
        return NEWER_FORMAT, str(exc)
    except CheckpointNotFoundError as exc:
        if RETIRED_MARKER in listing:
            return RETIRED, _RETIRED_WHY
        return (TORN if listing else EMPTY), str(exc)
    except CorruptCheckpointError as exc:
        return CORRUPT, str(exc)

