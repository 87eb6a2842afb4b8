"""safeckpt: crash-safe, storage-agnostic, distributed and fast checkpoints for PyTorch.

The names below are imported on first use (PEP 562), so ``import safeckpt`` and the
``safeckpt`` command start without importing torch where they do not need it."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CleanupWarning,
                     CorruptCheckpointError, ForeignRunWarning, InvalidFileNameError, LeaseWarning,
                     ManagerClosedError, PartialLoadWarning, ReplicationWarning, SafeckptWarning,
                     SaveAbortedError, SkippedCheckpointWarning, StateMismatchError, StorageError,
                     UnsafeObjectError, UnsupportedFeatureError, UnsupportedFormatError, WeakStorageWarning,
                     WriterDiedError)

if TYPE_CHECKING:
    from .run.asyncsave import SaveFuture, async_save
    from .protocol.checkpoint import CheckpointInfo, VerifyReport, load, load_state, save, verify
    from .format.states import CheckpointState
    from .interop.export import export_checkpoint
    from .interop.imports import import_checkpoint
    from .run.listing import CheckpointStatus, list_checkpoints
    from .run.manager import CheckpointManager
    from .interop.sealing import seal
    from .protocol.shards import RankLocal, Shard

# loggers are named by module under "safeckpt"; nothing is printed unless the application says so
logging.getLogger(__name__).addHandler(logging.NullHandler())

_LAZY = {
    "save": "protocol.checkpoint", "load": "protocol.checkpoint", "load_state": "protocol.checkpoint", "verify": "protocol.checkpoint",
    "CheckpointInfo": "protocol.checkpoint", "VerifyReport": "protocol.checkpoint", "async_save": "run.asyncsave",
    "SaveFuture": "run.asyncsave", "CheckpointManager": "run.manager", "seal": "interop.sealing", "Shard": "protocol.shards",
    "RankLocal": "protocol.shards", "list_checkpoints": "run.listing", "CheckpointStatus": "run.listing",
    "CheckpointState": "format.states", "export_checkpoint": "interop.export", "import_checkpoint": "interop.imports",
}

__all__ = [
    "__version__", "save", "async_save", "load", "load_state", "verify", "CheckpointInfo",
    "VerifyReport", "SaveFuture", "Shard", "RankLocal", "UnsupportedFormatError", "seal",
    "CheckpointManager", "list_checkpoints", "CheckpointStatus", "CheckpointState", "export_checkpoint",
    "import_checkpoint", "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError",
    "CorruptCheckpointError", "SaveAbortedError", "StateMismatchError", "StorageError",
    "UnsafeObjectError", "UnsupportedFeatureError", "InvalidFileNameError", "ManagerClosedError", "WriterDiedError",
    "SafeckptWarning", "SkippedCheckpointWarning", "CleanupWarning", "ForeignRunWarning",
    "PartialLoadWarning", "ReplicationWarning", "WeakStorageWarning", "LeaseWarning",
]


def __getattr__(name: str) -> Any:
    """The public API (and submodules such as ``safeckpt.storage``), imported when first used."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
