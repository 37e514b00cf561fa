"""Reports: self-contained HTML pages with matplotlib plots, for a run (``python -m mimo_jax.report
RUN_DIR``) and for a sweep (:mod:`mimo_jax.sweep.report`).  Needs matplotlib (the ``report`` extra)."""

from mimo_jax.report.run import write_run_report

__all__ = ["write_run_report"]
