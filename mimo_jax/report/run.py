"""The run report: ``RUN_DIR/report.html`` from the run directory's own files, for a live run too.

It reads only what the trainer writes (``config.json``, ``metrics.jsonl``, ``histograms.jsonl``,
``samples.jsonl``, ``alarms.jsonl``, ``summary.json``) and what ``python -m mimo_jax.eval --all``
adds (``eval_curve.jsonl``), takes no lock and changes nothing else, so it
can be redrawn while the run goes on (a line cut by the writer is skipped).  The page, in the order
one debugs a run: what state it is in; the reward and held-out curves; then the reports' diagnosis
order for a collapse (value loss, entropy, KL), the clip fractions, lengths and time split; the
reward distribution over time; the alarms; the sample replay; the resolved config.
"""

from __future__ import annotations

import datetime
import html
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mimo_jax.files import read_json, read_jsonl
from mimo_jax.report.page import Page, fmt
from mimo_jax.report.plots import lines, quantile_heatmap, series

__all__ = ["load_run", "run_report", "write_run_report"]

REPORT = "report.html"
# The sample replay shows the rows of this many most recent steps (the whole replay stays in samples.jsonl).
SAMPLE_STEPS = 3


def load_run(run_dir: str) -> dict[str, Any]:
  """Everything the report reads from a run directory.

  Raises:
    FileNotFoundError: the directory holds no run (no ``config.json`` and no ``metrics.jsonl``).
  """
  f = lambda name: os.path.join(run_dir, name)  # noqa: E731
  if not os.path.isdir(run_dir) or not (os.path.exists(f("config.json")) or os.path.exists(f("metrics.jsonl"))):
    raise FileNotFoundError(f"{run_dir}: not a run directory (no config.json or metrics.jsonl)")
  metrics = _stepped(read_jsonl(f("metrics.jsonl")))
  return {
    "run_dir": os.path.abspath(run_dir),
    "config": read_json(f("config.json")) or {},
    "summary": read_json(f("summary.json")),
    "metrics": metrics,
    "rl": [r for r in metrics if "reward_mean" in r],
    "evals": [r for r in metrics if any(k.startswith("eval/") for k in r)],
    "histograms": _stepped(read_jsonl(f("histograms.jsonl"))),
    "samples": _stepped(read_jsonl(f("samples.jsonl"))),
    "alarms": [_alarm(a) for a in _stepped(read_jsonl(f("alarms.jsonl")))],
    # `python -m mimo_jax.eval --run_dir=RUN --all`: every kept checkpoint, evaluated afterwards.
    "eval_curve": [r for r in read_jsonl(f("eval_curve.jsonl")) if r.get("phase") == "rl"],
    "updated": os.path.getmtime(f("metrics.jsonl")) if os.path.exists(f("metrics.jsonl")) else None,
  }


def _stepped(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """The rows with a finite numeric ``step`` (the trainer writes one on every row; a row edited by hand
  without one cannot be placed on a curve and is left out)."""
  return [
    r
    for r in rows
    if isinstance(r.get("step"), (int, float)) and not isinstance(r["step"], bool) and math.isfinite(r["step"])
  ]


def _alarm(a: Mapping[str, Any]) -> dict[str, Any]:
  """An ``alarms.jsonl`` row in the shape the page draws (fields edited by hand into other types are
  shown as text)."""
  evidence, diagnosis = a.get("evidence"), a.get("diagnosis")
  return {
    **a,
    "kind": str(a.get("kind")),
    "evidence": dict(evidence) if isinstance(evidence, Mapping) else {},
    "diagnosis": [str(d) for d in diagnosis] if isinstance(diagnosis, list) else [],
  }


def _quantile_rows(hists: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[list[float]]]:
  """The steps and quantiles of ``key`` over the histogram rows whose quantiles are finite numbers, as
  many as the trainer writes (the most common count)."""
  rows = [
    (h["step"], q)
    for h in hists
    if isinstance(q := h.get(key), list)
    and len(q) > 1
    and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in q)
  ]
  if not rows:
    return [], []
  width = max({len(q) for _, q in rows}, key=[len(q) for _, q in rows].count)
  kept = [(step, q) for step, q in rows if len(q) == width]
  return [step for step, _ in kept], [q for _, q in kept]


def _eval_keys(evals: Sequence[Mapping[str, Any]]) -> list[str]:
  keys = sorted({k for r in evals for k in r if re.fullmatch(r"eval/(greedy_accuracy|(pass|maj)@\d+)", k)})
  return sorted(keys, key=lambda k: (not k.endswith("greedy_accuracy"), k))


def run_report(run: Mapping[str, Any]) -> Page:
  """The report's page for a loaded run (:func:`load_run`)."""
  cfg = run["config"]
  rl, evals, summary = run["rl"], run["evals"], run["summary"]
  experiment = cfg.get("run", {}).get("experiment", "run")
  max_steps = cfg.get("run", {}).get("max_steps")
  page = Page(f"mimo-jax run report: {experiment}", run["run_dir"])
  marks = [(float(a["step"]), a["kind"]) for a in run["alarms"]]

  # --- state -------------------------------------------------------------------------------------------
  page.heading("State", anchor="state")
  last = rl[-1]["step"] if rl else 0
  if summary is not None and summary.get("rl_steps") == max_steps:
    status, cls = "complete", "ok"
  elif summary is not None:  # a finished run continued to a larger --max_steps: its summary is the earlier end's
    status = (
      f"in progress or stopped: RL step {last} of {max_steps} logged (continued after completing "
      f"{summary.get('rl_steps')} steps)"
    )
    cls = "warn"
  else:
    status, cls = f"in progress or stopped: RL step {last} of {max_steps} logged", "warn"
  updated = ""
  if run["updated"] is not None:
    when = datetime.datetime.fromtimestamp(run["updated"], datetime.UTC)
    updated = f"; metrics last written {when:%Y-%m-%d %H:%M:%S} UTC"
  status = html.escape(status)  # holds config.json's and metrics.jsonl's values
  page.raw(f'<p>Status: <span class="{cls}">{status}</span>{updated}; {len(run["alarms"])} alarm(s).</p>')
  keys = _eval_keys(evals)
  rows = []
  warm = next((r for r in evals if r["step"] == 0), None)
  for label, r in (("warm start", warm), ("latest", evals[-1] if evals else None)):
    if r is not None:
      rows.append([label, r["step"], *(r.get(k) for k in keys)])
  best = {k: max((r[k] for r in evals if isinstance(r.get(k), (int, float))), default=None) for k in keys}
  if evals:
    rows.append(["best", "", *(best[k] for k in keys)])
  if rows:
    page.table(rows, ["held-out", "step", *(k[5:] for k in keys)])
  facts = []
  if rl:
    r = rl[-1]
    for k in ("flops_total", "samples_total", "tokens_total", "rollbacks", "alarm_rollbacks", "skipped_total"):
      if k in r:
        facts.append([k, r[k]])
  if summary is not None:
    facts += [[k, summary.get(k)] for k in ("wall_time_s", "sft_time_s", "nonfinite_steps") if k in summary]
    code = summary.get("code")
    if isinstance(code, Mapping) and code:
      facts.append(
        ["code", f"{code.get('package', '')} {code.get('commit', '') or ''}{' (dirty)' if code.get('dirty') else ''}"]
      )
  if facts:
    page.table(facts, ["", "value"])

  # --- curves --------------------------------------------------------------------------------------------
  page.heading("Reward and held-out accuracy", anchor="curves")
  page.figure(
    lines(
      {
        "reward_mean (raw)": series(rl, "reward_mean"),
        "accuracy": series(rl, "accuracy"),
        "shaped_reward_mean": series(rl, "shaped_reward_mean"),
        "reward_normalized_mean": series(rl, "reward_normalized_mean"),
      },
      title="Batch reward",
      ylabel="reward",
      marks=marks,
      right={"reward_std": series(rl, "reward_std")},
      right_label="std",
    ),
    "the raw reward of the trained batch (shaped or normalised values on their own keys); alarms as dotted lines",
  )
  curve = {"greedy_accuracy (eval --all)": series(run.get("eval_curve", []), "greedy_accuracy")}
  page.figure(
    lines(
      {**{k[5:]: series(evals, k) for k in keys}, **curve},
      title="Held-out evaluation",
      ylabel="accuracy",
      marks=marks,
      styles={**{k[5:]: "o-" for k in keys}, **dict.fromkeys(curve, "s:")},
    ),
    f"greedy accuracy, pass@k and maj@k on the held-out prompts (step 0: the warm start; {fmt(max_steps)} + 1: final)"
    + (
      f"; squares: {len(run['eval_curve'])} kept checkpoints evaluated afterwards (eval_curve.jsonl)"
      if run.get("eval_curve")
      else ""
    ),
  )
  page.heading("Diagnosis order: value loss, entropy, KL", anchor="diagnosis")
  if any("value_loss" in r for r in rl):
    page.figure(
      lines(
        {"value_loss": series(rl, "value_loss")},
        title="Critic",
        ylabel="value loss",
        marks=marks,
        right={"explained_variance": series(rl, "explained_variance")},
        right_label="explained variance",
      ),
      "PPO's critic: a value-loss spike is the first thing to check when the reward collapses",
    )
  page.figure(
    lines(
      {"entropy": series(rl, "entropy")},
      title="Policy entropy",
      ylabel="nats / token",
      marks=marks,
      right={"entropy_coef": series(rl, "entropy_coef")},
      right_label="coefficient",
    ),
    "entropy over loss tokens and the entropy bonus in effect",
  )
  page.figure(
    lines(
      {
        "kl_k3 (batch mean)": series(rl, "kl_k3"),
        "kl_prompt_p95": series(rl, "kl_prompt_p95"),
        "kl_prompt_max": series(rl, "kl_prompt_max"),
      },
      title="KL to the reference (mean and tail)",
      ylabel="KL",
      marks=marks,
      right={"kl_coef": series(rl, "kl_coef")},
      right_label="coefficient",
    ),
    "the per-prompt tail next to the mean: a few prompts can carry the whole KL (their ids: kl_prompt_max_id)",
  )
  page.figure(
    lines(
      {k: series(rl, k) for k in ("clipfrac", "clipfrac_low", "clipfrac_high", "dual_clip_frac", "is_clipfrac")},
      title="Clip fractions",
      ylabel="fraction of tokens",
      marks=marks,
    ),
    "PPO ratio clipping (low / high / dual) and the sampler-learner importance clip",
  )
  page.figure(
    lines(
      {"grad_norm": series(rl, "grad_norm"), "update_norm": series(rl, "update_norm")},
      title="Optimisation",
      ylabel="norm",
      marks=marks,
      logy=True,
      right={"lr": series(rl, "lr")},
      right_label="learning rate",
    ),
    "gradient norm before clipping, the update's norm, and the learning rate in effect",
  )
  page.figure(
    lines(
      {"response_len": series(rl, "response_len")},
      title="Response length",
      ylabel="tokens",
      marks=marks,
      right={"truncated_frac": series(rl, "truncated_frac")},
      right_label="truncated fraction",
    ),
    "completion length (batch mean) and the share that hit --max_new_tokens",
  )
  parts = ("generate", "reward", "score", "update", "checkpoint", "step")
  page.figure(
    lines(
      {k: series(rl, f"time_{k}_s") for k in parts},
      title="Step time split",
      ylabel="seconds",
      marks=marks,
    ),
    "seconds per step: generation, reward, the learner program's score passes and update (one program, its time split by counted FLOPs), this step's own checkpoint, the whole step",
  )

  # --- distributions ---------------------------------------------------------------------------------------
  hists = run["histograms"]
  page.heading("Distributions over time", anchor="distributions")
  for key, label in (("reward_hist", "raw reward"), ("response_len_hist", "response length (tokens)")):
    steps_, quantiles = _quantile_rows(hists, key)
    page.figure(
      quantile_heatmap(steps_, quantiles, title=f"{label} per step", ylabel=label),
      f"the batch's {label} distribution at each RL step (from histograms.jsonl's quantiles)",
    )

  # --- alarms ------------------------------------------------------------------------------------------------
  page.heading("Alarms", anchor="alarms")
  if run["alarms"]:
    page.table(
      [
        {
          "step": a.get("step"),
          "kind": a.get("kind"),
          "onset": a.get("onset"),
          "evidence": ", ".join(f"{k} {fmt(v)}" for k, v in dict(a.get("evidence", {})).items()),
          "look at, in order": "; ".join(a.get("diagnosis", [])),
          "action": a.get("action"),
        }
        for a in run["alarms"]
      ],
      ["step", "kind", "onset", "evidence", "look at, in order", "action"],
    )
  else:
    page.paragraph("No alarm fired.", cls="ok")

  # --- samples -----------------------------------------------------------------------------------------------
  page.heading("Sample replay", anchor="samples")
  steps = sorted({s["step"] for s in run["samples"]})[-SAMPLE_STEPS:]
  shown = [s for s in run["samples"] if s["step"] in steps]
  if shown:
    page.paragraph(f"The rows of RL steps {', '.join(map(str, steps))} (every step's are in samples.jsonl).")
    page.table(
      [
        [
          s.get("step"),
          s.get("kind"),
          s.get("prompt_id"),
          s.get("policy_version"),
          f"T={fmt(s.get('temperature'))} k={fmt(s.get('top_k'))} p={fmt(s.get('top_p'))}",
          s.get("reward"),
          s.get("length"),
          s.get("finish_reason"),
          s.get("kl"),
          s.get("prompt"),
          s.get("completion"),
        ]
        for s in shown
      ],
      ["step", "kind", "prompt id", "policy", "sampling", "reward", "length", "finish", "kl", "prompt", "completion"],
      classes=[""] * 9 + ["text", "text"],  # newlines and indentation kept (code completions)
    )
  else:
    page.paragraph("No samples yet (or --log_samples=0).")

  # --- config ----------------------------------------------------------------------------------------------
  page.heading("Resolved config", anchor="config")

  def build_config(p: Page) -> None:
    for concern, values in cfg.items():
      if isinstance(values, Mapping) and concern not in ("provenance", "sandbox"):
        p.heading(concern, level=3)
        p.table([[k, v] for k, v in sorted(values.items())], ["flag", "value"])
    for extra in ("provenance", "sandbox"):
      if cfg.get(extra):
        p.heading(extra, level=3)
        p.pre(json.dumps(cfg[extra], indent=2))

  page.details("every setting of the run (config.json)", build_config)
  return page


def write_run_report(run_dir: str) -> str:
  """Writes ``RUN_DIR/report.html`` (atomically) and returns its path."""
  page = run_report(load_run(run_dir))
  return page.write(os.path.join(run_dir, REPORT))
