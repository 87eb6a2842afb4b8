"""The states a checkpoint folder can be in (judged by ``folder.folder_state``); a module
of its own so that commands can name them without importing torch."""

from __future__ import annotations

import enum


class CheckpointState(str, enum.Enum):
    """What a checkpoint folder is; the value is the name ``--json`` prints."""

    COMMITTED = "committed"        # a valid manifest: the checkpoint loads
    TORN = "torn"                  # files but no manifest: a save that was killed (or is still running)
    CORRUPT = "corrupt"            # manifests, none valid (or, for verify, data that fails its checksums)
    NEWER_FORMAT = "newer_format"  # written by a newer safeckpt: never skipped, never judged corrupt
    EMPTY = "empty"                # nothing in the folder (or no folder)
    RETIRED = "retired"            # deleted by retention; keeps data newer checkpoints share
    UNREADABLE = "unreadable"      # the folder or a manifest could not be read (permissions, I/O errors)

    @property
    def label(self) -> str:
        """How people are shown the state (tables, one-line reports)."""
        return _LABEL[self]


_LABEL = {CheckpointState.COMMITTED: "committed", CheckpointState.TORN: "torn save", CheckpointState.CORRUPT: "CORRUPT",
          CheckpointState.NEWER_FORMAT: "newer format (upgrade safeckpt)", CheckpointState.EMPTY: "empty",
          CheckpointState.RETIRED: "retired (data still shared)", CheckpointState.UNREADABLE: "UNREADABLE"}
