"""Pallas kernels and their pure-jnp references (installed as ``mimo_jax.kernels``)."""
