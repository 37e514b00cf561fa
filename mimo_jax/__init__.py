"""mimo-jax: a JAX-native RL trainer (GRPO, PPO) for large language models."""

from mimo_jax import xla_defaults as _xla_defaults

_xla_defaults.apply()
