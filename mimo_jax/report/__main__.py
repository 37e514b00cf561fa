"""``python -m mimo_jax.report RUN_DIR``: writes ``RUN_DIR/report.html`` (a live run's too) and prints its path."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if len(argv) != 1 or argv[0].startswith("-"):
    print("usage: python -m mimo_jax.report RUN_DIR", file=sys.stderr)
    return 0 if argv and argv[0] in ("-h", "--help") else 2
  try:
    from mimo_jax.report import write_run_report
  except ImportError as e:
    print(f"error: the report needs matplotlib ({e}); pip install 'mimo-jax[report]'", file=sys.stderr)
    return 2
  try:
    path = write_run_report(argv[0])
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"report: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
