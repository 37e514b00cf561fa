"""Models: the Llama/Qwen-family decoder, its value-head variant, presets and HF I/O."""

from mimo_jax.models.config import PRESETS, PUBLIC_PARAM_COUNTS, ModelConfig, RopeScaling, get_preset
from mimo_jax.models.create import abstract_state, create_sharded
from mimo_jax.models.hf import config_from_hf, config_to_hf, load_hf, save_hf
from mimo_jax.models.transformer import (
  KVCache,
  Transformer,
  ValueModel,
  positions_from_mask,
)

__all__ = [
  "PRESETS",
  "PUBLIC_PARAM_COUNTS",
  "KVCache",
  "ModelConfig",
  "RopeScaling",
  "Transformer",
  "ValueModel",
  "abstract_state",
  "config_from_hf",
  "config_to_hf",
  "create_sharded",
  "get_preset",
  "load_hf",
  "positions_from_mask",
  "save_hf",
]
