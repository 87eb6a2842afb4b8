"""The commit protocol: flattening a state, writing data files, committing a manifest
last, and reading pieces back into a state (any number of ranks, any resharding).

Internal: the public API is ``safeckpt.save``, ``load``, ``load_state``, ``verify``."""

__all__: list[str] = []
