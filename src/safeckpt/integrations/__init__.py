"""Drop-ins for the trainers people use; each module imports its own trainer library.

- ``safeckpt.integrations.transformers``: ``SafeCheckpointCallback``, ``last_checkpoint``,
  ``SafeTrainer`` / ``SafeTrainerMixin`` for the Hugging Face ``Trainer``: the Trainer's
  own files, sealed (``pip install 'safeckpt[hf]'``).
- ``safeckpt.integrations.accelerate``: ``save_state`` / ``load_state`` for an
  ``accelerate.Accelerator`` through a ``CheckpointManager``: the files
  ``accelerator.save_state`` writes, sealed.
- ``safeckpt.integrations.lightning``: ``SafeCheckpointIO`` for PyTorch Lightning, and
  ``SafeModelParallelStrategy`` / ``SafeFSDPStrategy`` for its sharded strategies
  (``pip install 'safeckpt[lightning]'``).

``_sealed`` holds what the two share (a folder of another tool's files is a checkpoint
exactly when its seal is valid). In their safeckpt layouts, FSDP models are saved
sharded by the Accelerate helpers and ``SafeTrainer`` (``_fsdp``); ``safeckpt.dcp`` is
the layer under torch.distributed.checkpoint itself.

Nothing is imported here, so ``import safeckpt.integrations`` never pulls in a trainer.
See docs/integrations.md.
"""
