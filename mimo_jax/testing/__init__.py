"""Helpers for tests and notebooks: tiny models, random Hugging Face checkpoints."""

from mimo_jax.testing.hf_models import save_random_hf_model

__all__ = ["save_random_hf_model"]
