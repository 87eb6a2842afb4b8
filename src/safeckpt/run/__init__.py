"""A training run's checkpoints: the manager, retention, garbage collection, the writer
lease, background saves, the local tier and node-local checkpoints on many nodes.

Internal: the public API is ``safeckpt.CheckpointManager``, ``async_save`` and
``list_checkpoints``."""

__all__: list[str] = []
