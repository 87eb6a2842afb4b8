"""safeckpt: crash-safe, storage-agnostic, distributed and fast checkpoints for PyTorch."""

from ._version import __version__
from .checkpoint import CheckpointInfo, VerifyReport, load, load_state, save, verify
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,
                     CorruptCheckpointError, SaveAbortedError, StateMismatchError, StorageError,
                     UnsafeObjectError)
from .manager import CheckpointManager

__all__ = [
    "__version__", "save", "load", "load_state", "verify", "CheckpointInfo", "VerifyReport",
    "CheckpointManager", "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError",
    "CorruptCheckpointError", "SaveAbortedError", "StateMismatchError", "StorageError",
    "UnsafeObjectError",
]
