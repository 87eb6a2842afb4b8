"""safeckpt: crash-safe, storage-agnostic, distributed and fast checkpoints for PyTorch."""

import logging

from ._version import __version__
from .asyncsave import SaveFuture, async_save
from .checkpoint import CheckpointInfo, VerifyReport, load, load_state, save, verify
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CleanupWarning,
                     CorruptCheckpointError, ForeignRunWarning, PartialLoadWarning, ReplicationWarning,
                     SafeckptWarning, SaveAbortedError, SkippedCheckpointWarning, StateMismatchError,
                     StorageError, UnsafeObjectError, UnsupportedFeatureError, UnsupportedFormatError,
                     WeakStorageWarning)
from .manager import CheckpointManager
from .seal import seal
from .shards import RankLocal, Shard

# loggers are named by module under "safeckpt"; nothing is printed unless the application says so
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "__version__", "save", "async_save", "load", "load_state", "verify", "CheckpointInfo",
    "VerifyReport", "SaveFuture", "Shard", "RankLocal", "UnsupportedFormatError", "seal",
    "CheckpointManager", "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError",
    "CorruptCheckpointError", "SaveAbortedError", "StateMismatchError", "StorageError",
    "UnsafeObjectError", "UnsupportedFeatureError",
    "SafeckptWarning", "SkippedCheckpointWarning", "CleanupWarning", "ForeignRunWarning",
    "PartialLoadWarning", "ReplicationWarning", "WeakStorageWarning",
]
