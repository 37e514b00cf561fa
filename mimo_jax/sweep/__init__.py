"""Scaling studies: the sweep runner (``python -m mimo_jax.sweep``), its short-run gate and coupling rules,
the compute-to-performance fits, and the scaling report."""
