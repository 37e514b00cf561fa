"""JSON schemas of checkpoint metadata (installed as ``mimo_jax.checkpoints_schema``)."""
