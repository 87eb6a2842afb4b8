"""safeckpt: crash-safe, storage-agnostic, distributed and fast checkpoints for PyTorch."""

from ._version import __version__
from .asyncsave import SaveFuture, async_save
from .checkpoint import CheckpointInfo, VerifyReport, load, load_state, save, verify
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,
                     CorruptCheckpointError, SaveAbortedError, StateMismatchError, StorageError,
                     UnsafeObjectError, UnsupportedFeatureError, UnsupportedFormatError)
from .manager import CheckpointManager
from .seal import seal
from .shards import RankLocal, Shard

__all__ = [
    "__version__", "save", "async_save", "load", "load_state", "verify", "CheckpointInfo",
    "VerifyReport", "SaveFuture", "Shard", "RankLocal", "UnsupportedFormatError", "seal",
    "CheckpointManager", "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError",
    "CorruptCheckpointError", "SaveAbortedError", "StateMismatchError", "StorageError",
    "UnsafeObjectError", "UnsupportedFeatureError",
]
