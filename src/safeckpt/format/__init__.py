"""What a checkpoint is on storage: file and folder names, the manifest, the value codec,
dtypes, checksums, box geometry, and the one judgement of a checkpoint folder's state.
Nothing here writes: the protocol (``safeckpt.protocol``) does.

Internal: these modules may change between releases; the public API is ``safeckpt``'s
``__all__`` (and ``safeckpt.storage``, ``safeckpt.testing``, ``safeckpt.dcp``,
``safeckpt.integrations``)."""

__all__: list[str] = []
