"""Other formats in and out: exports (torch.save, safetensors, Hugging Face folders),
imports of DCP and torch.save checkpoints, and sealing folders written by other tools.

Internal: the public API is ``safeckpt.export_checkpoint``, ``import_checkpoint`` and
``seal``."""

__all__: list[str] = []
