"""The run report: drawn from a real run (alarms provoked on purpose), opened in a real headless Chromium
(every image loads, no console error, a screenshot kept as a test artifact), on a live run, and its
histograms' quantiles against numpy."""

from __future__ import annotations

import html
import json
import os
import shutil

import numpy as np
import pytest

from mimo_jax.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.environ.get("MIMO_TEST_ARTIFACTS", os.path.join(ROOT, "test-artifacts"))
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = [
  f"--flagfile={os.path.join(ROOT, 'experiments', 'grpo_tiny.flags')}",
  "--model_preset=tiny",
  "--sft_steps=6",
  "--sft_batch_size=16",
  "--max_steps=6",
  "--prompts_per_step=8",
  "--num_samples=4",
  "--eval_prompts=16",
  "--eval_samples=2",
  "--eval_every=3",
  "--checkpoint_every=3",
  "--max_new_tokens=6",
  # A KL alarm on purpose: any KL above 1e-9, smoothed over 2 steps, from the fourth step on (an entropy
  # bonus moves the policy off the reference even when every reward of these few steps is 0).
  "--entropy_coef=0.01",
  "--alarm_window=2",
  "--alarm_kl_max=1e-9",
  # The same records to Weights & Biases, offline (no network).
  "--wandb_project=mimo-jax-test",
  "--wandb_mode=offline",
]
SECTIONS = [
  "State",
  "Reward and held-out accuracy",
  "Diagnosis order: value loss, entropy, KL",
  "Distributions over time",
  "Alarms",
  "Sample replay",
  "Resolved config",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("report") / "run"
  import contextlib
  import io

  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert main(["prog", *FLAGS, f"--run_dir={path}"]) == 0
  # The end of a run prints the report's path (the end of `make run` shows it).
  assert f"report: {path / 'report.html'}" in out.getvalue()
  return path


def test_the_histogram_quantiles_are_numpys():
  from mimo_jax.train.logger import QUANTILES, histogram_quantiles

  x = np.arange(21.0)
  assert histogram_quantiles(x) == list(x)  # 21 values: the quantiles are the values themselves
  assert histogram_quantiles([1.0, np.nan, 3.0]) == [float(f"{q:.6g}") for q in np.quantile([1.0, 3.0], QUANTILES)]
  assert histogram_quantiles([np.inf]) is None


def test_the_report_shows_the_run(run_dir):
  text = open(run_dir / "report.html", encoding="utf-8").read()
  for section in SECTIONS:
    assert f">{html.escape(section)}</h2>" in text
  assert 'class="ok">complete</span>' in text
  alarms = [json.loads(line) for line in open(run_dir / "alarms.jsonl")]
  assert [a["kind"] for a in alarms] == ["kl_blowup"] and alarms[0]["step"] == 4
  assert "<td>kl_blowup</td>" in text and "1 alarm(s)" in text
  # Every RL step's histograms are kept as quantiles; the batch-mean length lies inside each step's.
  rl = [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "reward_mean" in r]
  hists = [json.loads(line) for line in open(run_dir / "histograms.jsonl")]
  assert [h["step"] for h in hists] == [r["step"] for r in rl] == list(range(1, 7))
  for h, r in zip(hists, rl, strict=True):
    assert len(h["reward_hist"]) == 21 and h["response_len_hist"][0] <= r["response_len"] <= h["response_len_hist"][-1]
  # The sample replay: the last steps' completions, escaped; the config's every setting.
  samples = [json.loads(line) for line in open(run_dir / "samples.jsonl")]
  last = [s for s in samples if s["step"] == 6]
  assert last and all(f'<td class="text">{html.escape(s["prompt"])}</td>' in text for s in last)
  assert "<td>learning_rate</td>" in text and "<td>alarm_kl_max</td>" in text
  assert "http://" not in text and "https://" not in text and "<script" not in text  # self-contained


def test_the_report_in_a_real_browser(run_dir, tmp_path):
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service

  assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), (
    "Debian's chromium and chromium-driver are needed (.ci/run installs them): apt-get install chromium chromium-driver"
  )
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for arg in (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    f"--user-data-dir={tmp_path / 'profile'}",
    "--window-size=1280,6000",
  ):
    options.add_argument(arg)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
  try:
    driver.get(f"file://{run_dir / 'report.html'}")
    assert driver.execute_script("return document.readyState") == "complete"
    images = driver.execute_script(
      "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight, i.alt])"
    )
    expected = open(run_dir / "report.html", encoding="utf-8").read().count("<img ")
    assert len(images) == expected >= 10
    broken = [alt for complete, w, h, alt in images if not (complete and w > 100 and h > 100)]
    assert broken == []
    headings = [e.text for e in driver.find_elements("tag name", "h2")]
    assert headings == SECTIONS
    # Prompts and completions keep their newlines and indentation (code completions stay readable).
    spaces = driver.execute_script(
      "return Array.from(document.querySelectorAll('td.text')).map(e => getComputedStyle(e).whiteSpace)"
    )
    assert spaces and set(spaces) == {"pre-wrap"}
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []
    os.makedirs(ARTIFACTS, exist_ok=True)
    assert driver.save_screenshot(os.path.join(ARTIFACTS, "run_report.png"))
  finally:
    driver.quit()


def test_the_report_of_a_live_run(run_dir, tmp_path, capsys):
  from mimo_jax.report.__main__ import main as report

  live = tmp_path / "live"
  shutil.copytree(run_dir, live)
  os.remove(live / "summary.json")
  lines = open(live / "metrics.jsonl").readlines()
  rl = [i for i, line in enumerate(lines) if '"reward_mean"' in line]
  with open(live / "metrics.jsonl", "w") as f:  # steps 1..3 and a line the writer is halfway through
    f.writelines(lines[: rl[3]])
    f.write(lines[rl[3]][:40])
  assert report([str(live)]) == 0
  text = open(live / "report.html", encoding="utf-8").read()
  assert "in progress or stopped: RL step 3 of 6 logged" in text
  # A finished run continued to a larger --max_steps keeps its earlier summary until it ends again: not
  # "complete".  Values from config.json and metrics.jsonl are text, never markup.
  shutil.copy(run_dir / "summary.json", live / "summary.json")
  cfg = json.loads(open(live / "config.json").read())
  cfg["run"]["max_steps"] = 400
  open(live / "config.json", "w").write(json.dumps(cfg))
  assert report([str(live)]) == 0
  text = open(live / "report.html", encoding="utf-8").read()
  assert "RL step 3 of 400 logged (continued after completing 6 steps)" in text and ">complete<" not in text
  cfg["run"]["max_steps"] = "<script>alert(1)</script>"
  open(live / "config.json", "w").write(json.dumps(cfg))
  assert report([str(live)]) == 0
  text = open(live / "report.html", encoding="utf-8").read()
  assert "<script" not in text and "of &lt;script&gt;alert(1)&lt;/script&gt; logged" in text
  assert report([str(tmp_path / "nothing")]) == 2
  assert "not a run directory" in capsys.readouterr().err


def test_the_report_of_hand_edited_logs(run_dir, tmp_path):
  """Rows edited by hand into shapes the trainer never writes are left out or shown as text; the page is
  still drawn (each of these raised out of the report before)."""
  from mimo_jax.report.__main__ import main as report

  edited = tmp_path / "edited"
  shutil.copytree(run_dir, edited)
  alarms = [json.loads(line) for line in open(edited / "alarms.jsonl")]
  assert alarms
  with open(edited / "metrics.jsonl", "a") as f:
    f.write("null\n[1, 2]\n7\n")
    f.write(json.dumps({"reward_mean": 0.5}) + "\n")  # no step
  with open(edited / "alarms.jsonl", "a") as f:
    f.write(json.dumps({"kind": "no step", "evidence": {}}) + "\n")
    f.write(json.dumps({**alarms[0], "kind": r"cost $\frac$ per", "evidence": [1, 2], "diagnosis": "x"}) + "\n")
  with open(edited / "histograms.jsonl", "a") as f:
    row = json.loads(open(run_dir / "histograms.jsonl").readline())
    q = row["reward_hist"]
    f.write(json.dumps({**row, "step": 90, "reward_hist": [float("nan")] * len(q)}) + "\n")  # NaN
    f.write(json.dumps({**row, "step": 91, "reward_hist": q[:3]}) + "\n")  # too few quantiles
    f.write(json.dumps({**row, "step": 92, "reward_hist": ["a"] * len(q)}) + "\n")
  summary = json.loads(open(edited / "summary.json").read())
  open(edited / "summary.json", "w").write(json.dumps({**summary, "code": "edited"}))
  assert report([str(edited)]) == 0
  text = open(edited / "report.html", encoding="utf-8").read()
  assert f"{len(alarms) + 1} alarm(s)" in text  # the one without a step is left out
  assert r"cost $\frac$ per" in text and "RL step 6 of 6" not in text and ">complete<" in text
  open(edited / "summary.json", "w").write("[1, 2]")  # not an object: as if absent
  open(edited / "config.json", "w").write("null")
  assert report([str(edited)]) == 0
  assert "in progress or stopped: RL step 6 of None logged" in open(edited / "report.html", encoding="utf-8").read()


def test_the_report_draws_the_evaluation_of_every_kept_checkpoint(run_dir, tmp_path):
  """`python -m mimo_jax.eval --run_dir=RUN --all` writes eval_curve.jsonl; the redrawn report adds its
  RL checkpoints to the held-out figure, so a curve that falls while the reward rises is visible."""
  from mimo_jax.eval.__main__ import main as evaluate
  from mimo_jax.report.__main__ import main as report

  copy = tmp_path / "run"
  shutil.copytree(run_dir, copy)
  images = open(copy / "report.html", encoding="utf-8").read().count("<img ")
  assert "eval_curve.jsonl" not in open(copy / "report.html", encoding="utf-8").read()
  assert evaluate(["prog", f"--run_dir={copy}", "--all"]) == 0
  rows = [json.loads(line) for line in open(copy / "eval_curve.jsonl")]
  rl = [r for r in rows if r["phase"] == "rl"]
  assert len(rl) >= 2
  assert report([str(copy)]) == 0
  text = open(copy / "report.html", encoding="utf-8").read()
  assert f"squares: {len(rl)} kept checkpoints evaluated afterwards (eval_curve.jsonl)" in text
  assert text.count("<img ") == images  # drawn into the held-out figure, not a figure of its own


def _wandb_records(path: str) -> list[bytes]:
  """The records of a W&B ``.wandb`` file, read independently of W&B's own (Go) reader: a 7-byte file
  header, then LevelDB-log records (crc32c, length, type: full / first / middle / last) in 32 KiB
  blocks, each record a ``wandb_internal_pb2.Record``."""
  import struct

  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  pos, block, out, parts = 7, 32768, [], b""
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:  # a block's tail too short for a header is padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
    if kind == 1:
      out.append(chunk)
    elif kind == 2:
      parts = chunk
    elif kind == 3:
      parts += chunk
    elif kind == 4:
      out.append(parts + chunk)
  return out


def test_weights_and_biases_offline_gets_the_same_records(run_dir):
  import glob

  from wandb.proto import wandb_internal_pb2

  runs = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
  run_id = open(run_dir / "wandb_id").read().strip()
  assert len(runs) == 1 and runs[0].endswith(run_id)
  history, config = {}, {}
  for raw in _wandb_records(os.path.join(runs[0], f"run-{run_id}.wandb")):
    record = wandb_internal_pb2.Record()
    record.ParseFromString(raw)
    kind = record.WhichOneof("record_type")
    if kind == "history":
      row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
      history[row["rl_step"]] = row
    elif kind == "run":
      config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.run.config.update})
  metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  rl_and_eval = [r for r in metrics if r["step"] >= 0]
  assert sorted(s for s in history if s >= 0) == [r["step"] for r in rl_and_eval] == list(range(8))
  for r in rl_and_eval:  # every scalar of every record, as metrics.jsonl has it
    scalars = {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert {k: history[r["step"]][k] for k in scalars} == scalars
  assert history[3]["reward_hist/_type"] == "histogram" and history[3]["samples/_type"] == "table-file"
  # The KL alarm of step 4 rides on step 4's row as a table (one history row per step), and no other.
  assert [s for s in sorted(history) if "alarms/_type" in history[s]] == [4]
  media = os.path.join(runs[0], "files", "media", "table")
  (alarms,) = [json.load(open(p)) for p in glob.glob(os.path.join(media, "alarms_*.table.json"))]
  assert alarms["columns"][:3] == ["step", "kind", "onset"] and [row[:2] for row in alarms["data"]] == [
    [4, "kl_blowup"]
  ]
  # The samples table has every field of samples.jsonl's rows.
  samples = [json.loads(line) for line in open(run_dir / "samples.jsonl")]
  tables = [json.load(open(p)) for p in glob.glob(os.path.join(media, "samples_*.table.json"))]
  assert tables and all(set(samples[0]) - {"row"} <= set(t["columns"]) for t in tables)
  assert config["optim"]["learning_rate"] == 2e-4 and config["logging"]["wandb_mode"] == "offline"


def test_weights_and_biases_needs_its_package_named_before_any_compute(monkeypatch):
  import importlib.util

  from mimo_jax.config import ConfigError
  from mimo_jax.main import parse_config

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(ConfigError, match="--wandb_project='x'.*pip install 'mimo-jax\\[wandb\\]'"):
    parse_config(["prog", "--wandb_project=x"])
  with pytest.raises(ConfigError, match="wandb_mode"):
    parse_config(["prog", "--wandb_mode=cloud"])
