"""The package's layering: no import cycles among its subpackages (lazy, function-level imports included)."""

import ast
import collections
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mimo_jax")
# The layers that grew cycles before (eval <-> train, tasks <-> data, rewards -> train): checked pairwise
# here, and the whole graph for any cycle below.
WATCHED = ("train", "eval", "tasks", "data", "rewards")


def _package_graph() -> dict[str, dict[str, list[str]]]:
  """``{subpackage: {imported subpackage: [files that import it]}}`` from every ``import`` statement."""
  graph: dict[str, dict[str, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
  for directory, _, files in os.walk(ROOT):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(directory, name)
      rel = os.path.relpath(path, ROOT)
      src = rel.split(os.sep)[0].removesuffix(".py")
      if src == "__init__":
        continue
      for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
          modules = [node.module]
        elif isinstance(node, ast.Import):
          modules = [alias.name for alias in node.names]
        else:
          continue
        for module in modules:
          parts = module.split(".")
          if parts[0] == "mimo_jax" and len(parts) > 1 and parts[1] != src:
            graph[src][parts[1]].append(rel)
  return graph


def _cycles(graph) -> list[list[str]]:
  """Every elementary cycle's node list, found by DFS from each node (the graph is small)."""
  found = set()
  out = []

  def walk(start, node, path):
    for nxt in graph.get(node, {}):
      if nxt == start:
        key = frozenset(path)
        if key not in found:
          found.add(key)
          out.append(path + [start])
      elif nxt not in path:
        walk(start, nxt, path + [nxt])

  for start in list(graph):
    walk(start, start, [start])
  return out


def test_no_import_cycles_between_subpackages():
  graph = _package_graph()
  for a in WATCHED:
    for b in WATCHED:
      if a < b and b in graph.get(a, {}) and a in graph.get(b, {}):
        raise AssertionError(f"{a} <-> {b}: {graph[a][b][:2]} and {graph[b][a][:2]}")
  assert _cycles(graph) == []


def test_the_graph_reader_sees_real_edges():
  graph = _package_graph()
  # The trainer builds on rewards, rollout and the evaluator; the evaluator does not build on the trainer.
  assert {"rewards", "rollout", "eval"} <= set(graph["train"])
  assert "train" not in graph["eval"]
  assert _cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == [["a", "b", "c", "a"]]
