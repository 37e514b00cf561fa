"""Helpers for tests and notebooks: random Hugging Face checkpoints, compile counting, a fake rollout."""

from mimo_jax.testing.compiles import count_compilations
from mimo_jax.testing.fake_rollout import FakeRollout
from mimo_jax.testing.hf_models import save_random_hf_model

__all__ = ["FakeRollout", "count_compilations", "save_random_hf_model"]
