"""Drop-ins for the trainers people use; each module imports its own trainer library.

- ``safeckpt.integrations.transformers``: ``SafeCheckpointCallback``, ``last_checkpoint``,
  ``SafeTrainer`` / ``SafeTrainerMixin`` for the Hugging Face ``Trainer``
  (``pip install 'safeckpt[hf]'``).
- ``safeckpt.integrations.accelerate``: ``save_state`` / ``load_state`` for an
  ``accelerate.Accelerator`` through a ``CheckpointManager``.
- ``safeckpt.integrations.lightning``: ``SafeCheckpointIO`` for PyTorch Lightning, and
  ``SafeModelParallelStrategy`` / ``SafeFSDPStrategy`` for its sharded strategies
  (``pip install 'safeckpt[lightning]'``).

FSDP models are saved sharded by the Accelerate helpers and ``SafeTrainer`` (``_fsdp``);
``safeckpt.dcp`` is the layer under torch.distributed.checkpoint itself.

Nothing is imported here, so ``import safeckpt.integrations`` never pulls in a trainer.
See docs/integrations.md.
"""
