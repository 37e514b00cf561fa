"""Orbax checkpoints of the train state plus JSON metadata."""

from mimo_jax.ckpt.manager import Checkpointer

__all__ = ["Checkpointer"]
