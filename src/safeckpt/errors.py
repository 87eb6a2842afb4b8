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


class SaveAbortedError(CheckpointError, RuntimeError):
    """A save failed on one or more ranks and was aborted everywhere; nothing was committed.

    ``errors`` maps each failing rank to its error message."""

    def __init__(self, message: str, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})
