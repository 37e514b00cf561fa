"""Benchmarks (``python -m mimo_jax.bench.<name>``); results are recorded in BUILD_NOTES.md."""
