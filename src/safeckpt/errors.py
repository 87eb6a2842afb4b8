"""The error tree: every failure safeckpt reports is a ``CheckpointError``.

Each class also subclasses the closest builtin so that existing ``except``
clauses (``FileNotFoundError``, ``OSError``, ``ValueError``) keep working.
Messages say what went wrong, where (path, key, rank) and what to do.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every error raised by safeckpt."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the path."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists and ``overwrite`` was not given."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint's manifest or data does not match what was committed."""


class UnsupportedFormatError(CorruptCheckpointError):
    """The checkpoint was written in a newer format version than this safeckpt reads."""


class StateMismatchError(CheckpointError, KeyError):
    """The state to load into does not match the checkpoint (keys, shapes, dtypes).

    ``problems`` has one line per problem (``"key: what"``) and ``keys`` the key of each;
    ``missing`` lists keys of the state the checkpoint lacks, ``unexpected`` keys of the
    checkpoint the state lacks, ``shapes`` and ``dtypes`` map a key to (the state's,
    the checkpoint's). A handler can thus decide from the keys, never from the text."""

    def __init__(self, message: str = "", *, problems: list[str] | None = None, keys: list[str] | None = None,
                 missing: list[str] | None = None, unexpected: list[str] | None = None,
                 shapes: dict | None = None, dtypes: dict | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])
        self.keys = list(keys or [])
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])
        self.shapes = dict(shapes or {})
        self.dtypes = dict(dtypes or {})

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StorageError(CheckpointError, OSError):
    """The storage refused or failed an operation (full disk, read-only, permission)."""


class UnsafeObjectError(CheckpointError, TypeError):
    """A value cannot be stored or loaded without executing code (pickle)."""


class UnsupportedFeatureError(CheckpointError, NotImplementedError):
    """A feature of another library that safeckpt cannot honour exactly (for example a
    torch.distributed.checkpoint planner that transforms non-tensor data), refused
    before anything is written rather than saved differently."""


class InvalidFileNameError(CheckpointError, ValueError):
    """A file that a manifest would have to name breaks the file name rules
    (docs/format.md §2.5), so the folder cannot be sealed; nothing was written.

    ``problems`` maps each such file (relative to the folder) to why."""

    def __init__(self, message: str, problems: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.problems = dict(problems or {})


class SaveAbortedError(CheckpointError, RuntimeError):
    """A save failed on one or more ranks and was aborted everywhere; nothing was committed.

    ``errors`` maps each failing rank to its error message."""

    def __init__(self, message: str, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})


class WriterDiedError(SaveAbortedError):
    """The writer process of async saves ended while it held a save: nothing of that save
    is committed (``started`` False: the writer never started, so no writer can)."""

    def __init__(self, message: str, started: bool = True) -> None:
        super().__init__(message)
        self.started = started


class ManagerClosedError(CheckpointError, RuntimeError):
    """A ``CheckpointManager`` was used after ``close()`` (or its ``with`` block): it
    saves, restores, retains, deletes and collects nothing more."""


# --------------------------------------------------------------------------- warnings


class SafeckptWarning(UserWarning):
    """Base of every warning safeckpt issues (filter them all with this class)."""


class SkippedCheckpointWarning(SafeckptWarning):
    """A checkpoint, or a newer manifest of one, was passed over (torn, corrupt,
    incomplete); the message names each and the one used instead."""


class CleanupWarning(SafeckptWarning):
    """A save or export ended as it should, but removing what it replaced or left
    failed: garbage that ``gc`` removes later, never a lost checkpoint."""


class ForeignRunWarning(SafeckptWarning):
    """The run root holds checkpoints of another run, which this one leaves alone."""


class PartialLoadWarning(SafeckptWarning):
    """A ``strict=False`` load left parts of the state as they were."""


class ReplicationWarning(SafeckptWarning):
    """Copying a checkpoint to the durable tier failed; the local copy is intact."""


class WeakStorageWarning(SafeckptWarning):
    """The storage lacks a capability a guarantee rests on (exclusive create for the
    writer lease); the message says what does not hold."""


class LeaseWarning(SafeckptWarning):
    """The run root's newest writer lease could not be read (a folder under its name, a
    field of the wrong type, a pid no process has); the manager took the root over, as
    docs/format.md §2.7 says for an unreadable lease."""


def warn(message: str, category: type[SafeckptWarning]) -> None:
    """Issue a warning that points at the first frame outside safeckpt, whatever the
    depth of the call and on any thread (hand-counted stack levels were wrong on the
    background threads of async saves and replication)."""
    import os
    import sys
    import types
    import warnings

    package = os.path.dirname(os.path.abspath(__file__))
    frame: types.FrameType | None
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
