"""Scaling studies: compute-to-performance fits (and, as they land, the sweep runner and its report)."""
