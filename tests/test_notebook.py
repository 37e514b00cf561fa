"""The Colab quickstart, executed end to end at reduced size in a real Jupyter kernel (nbclient), and its
flags kept equal to the embedded default's flagfile."""

from __future__ import annotations

import ast
import os

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def _flags_in(source: str) -> list[str]:
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "FLAGS":
      return ast.literal_eval(node.value)
  return []


def test_the_notebook_trains_with_the_embedded_defaults_flags():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  flags = next(f for f in (_flags_in(c.source) for c in nb.cells if c.cell_type == "code") if f)
  lines = open(os.path.join(ROOT, "experiments", "grpo_tiny.flags")).read().splitlines()
  assert flags == [line for line in lines if line.startswith("--")]


def test_the_quickstart_runs_end_to_end(tmp_path, monkeypatch):
  from nbclient import NotebookClient

  # The kernel inherits the environment: the test session's 8 CPU devices and compilation cache.
  monkeypatch.setenv("QUICKSTART_SFT_STEPS", "6")
  monkeypatch.setenv("QUICKSTART_RL_STEPS", "4")
  monkeypatch.setenv("QUICKSTART_EVAL_PROMPTS", "16")
  monkeypatch.setenv("QUICKSTART_RUN_DIR", str(tmp_path / "run"))
  nb = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
  code = [c for c in nb.cells if c.cell_type == "code"]
  text = ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream") for c in code]
  assert "jax " in text[0] and "cpu" in text[0]
  assert "held-out greedy accuracy: warm-start" in text[1] and "report: " in text[1]
  images = [o for o in code[2].outputs if o.output_type == "display_data" and "image/png" in o.data]
  assert len(images) >= 10
  assert "of 12 held-out problems right" in text[3]
  assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "hf" / "config.json").exists()
