"""Helpers for tests and notebooks: tiny models, random Hugging Face checkpoints, compile counting."""

from mimo_jax.testing.compiles import count_compilations
from mimo_jax.testing.hf_models import save_random_hf_model

__all__ = ["count_compilations", "save_random_hf_model"]
