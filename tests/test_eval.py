"""Held-out evaluation: evaluate_policy against scripted completions, and the
``python -m mimo_jax.eval`` command line on a real (tiny) run directory."""

import collections
import dataclasses
import hashlib
import itertools
import json
import os
import shutil

import jax
import numpy as np
import pytest

from mimo_jax.config import ADDED_SETTINGS, Config
from mimo_jax.config_base import ConfigError
from mimo_jax.eval import (
  config_from_dict,
  default_answer_fn,
  default_ks,
  evaluate_policy,
  samples_per_call,
)
from mimo_jax.eval.__main__ import main as eval_main
from mimo_jax.main import main as train_main
from mimo_jax.rollout import SamplingParams
from mimo_jax.tasks.arith import ArithTask, build_tokenizer
from mimo_jax.testing import FakeRollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------
# evaluate_policy with scripted completions
# ----------------------------------------------------------------------------


class ScriptedSampler:
  """Greedy calls (temperature 0) and sampled calls answer from separate scripts.

  ``greedy[prompt]`` is the greedy completion text; ``samples[prompt][i]`` is the text of
  the prompt's i-th sample (counted across calls, so splitting the samples over several
  calls does not change which text each sample gets).  Every call is recorded.
  """

  def __init__(self, tokenizer, greedy, samples, *, batch_shards=1):
    self.tokenizer = tokenizer
    self.greedy_script, self.sample_script = greedy, samples
    self.seen = collections.Counter()
    self.calls = []
    self.params = None
    self.batch_shards = batch_shards
    self._greedy = FakeRollout(lambda ids, g: self._ids(self.greedy_script.get(self._prompt(ids))))
    self._sampled = FakeRollout(self._sample)

  def _prompt(self, ids):
    return self.tokenizer.decode(list(ids))

  def _ids(self, text):
    return self.tokenizer.encode(text, add_eos=True) if text is not None else [self.tokenizer.eos_id]

  def _sample(self, ids, g):
    prompt = self._prompt(ids)
    if prompt not in self.sample_script:  # a filler row
      return [self.tokenizer.eos_id]
    i = self.seen[prompt]
    self.seen[prompt] += 1
    return self._ids(self.sample_script[prompt][i])

  def update_params(self, params):
    self.params = params

  def generate(self, tokens, mask, *, num_samples, temperature, key, **kwargs):
    self.calls.append(
      {
        "rows": tokens.shape[0],
        "num_samples": num_samples,
        "temperature": float(temperature),
        "key": tuple(np.asarray(jax.random.key_data(key)).tolist()),
      }
    )
    rollout = self._greedy if temperature == 0 else self._sampled
    return rollout.generate(tokens, mask, num_samples=num_samples, temperature=temperature, key=key, **kwargs)


@pytest.fixture(scope="module")
def arith():
  task = ArithTask(levels=(1,), seed=1234, heldout_size=5)
  return task, build_tokenizer(task), task.heldout()


def _script(problems):
  """Per problem: the greedy text and six sample texts (A = gold, W1/W2 = wrong, "" = no answer)."""
  greedy, samples, correct = {}, {}, []
  layouts = [
    ("A", ["A", "A", "A", "A", "A", "A"]),  # c=6
    ("W1", ["W1", "A", "W1", "A", "A", "W2"]),  # c=3
    ("A", ["W1", "W1", "W1", "W1", "W1", "W1"]),  # c=0
    ("", ["", "A", "", "W1", "W1", "A"]),  # c=2
    ("A", ["A", "W1", "W2", "W2", "W2", "W1"]),  # c=1
  ]
  for p, (g, row) in zip(problems, layouts, strict=True):
    texts = {"A": p.answer, "W1": str(int(p.answer) + 1), "W2": str(int(p.answer) + 2), "": ""}
    greedy[p.prompt] = texts[g]
    samples[p.prompt] = [texts[s] for s in row]
    correct.append([s == "A" for s in row])
  return greedy, samples, correct


def _evaluate(sampler, task, tokenizer, problems, **overrides):
  kwargs = dict(
    buckets=(16,),
    rows=4,
    max_new_tokens=6,
    sampling=SamplingParams(stop_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id),
    num_samples=6,
    ks=(1, 2, 4, 6),
    temperature=0.7,
    key=jax.random.key(0),
  )
  kwargs.update(overrides)
  return evaluate_policy(sampler, "PARAMS", task, tokenizer, problems, **kwargs)


def _brute_pass_at_k(correct, k):
  """The fraction of k-subsets of the samples holding at least one correct sample."""
  subsets = list(itertools.combinations(range(len(correct)), k))
  return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("max_batch_rows", [None, 8])
def test_evaluate_policy_matches_hand_counted_metrics(arith, max_batch_rows):
  task, tokenizer, problems = arith
  greedy, samples, correct = _script(problems)
  sampler = ScriptedSampler(tokenizer, greedy, samples)
  out = _evaluate(sampler, task, tokenizer, problems, max_batch_rows=max_batch_rows)

  assert sampler.params == "PARAMS"
  assert out["num_problems"] == 5
  assert out["greedy_accuracy"] == pytest.approx(3 / 5)  # problems 0, 2, 4
  assert out["pass@1"] == pytest.approx((6 + 3 + 0 + 2 + 1) / 30)
  assert out["pass@6"] == pytest.approx(4 / 5)
  for k in (1, 2, 4, 6):
    expected = np.mean([_brute_pass_at_k(c, k) for c in correct])
    assert out[f"pass@{k}"] == pytest.approx(expected), k
  # Majority votes, counted by hand (ties go to the answer seen first; "" is no answer).
  assert out["maj@1"] == pytest.approx(2 / 5)
  assert out["maj@2"] == pytest.approx(3 / 5)
  assert out["maj@4"] == pytest.approx(2 / 5)
  assert out["maj@6"] == pytest.approx(3 / 5)
  assert not [k for k in out if "/" in k]  # one task: no per-task keys

  # Static shapes: every call has 4 prompt rows (the second chunk is padded); with
  # max_batch_rows=8 the six samples come two at a time; every call has its own key.
  greedy_calls = [c for c in sampler.calls if c["temperature"] == 0]
  sample_calls = [c for c in sampler.calls if c["temperature"] != 0]
  per_call = 6 if max_batch_rows is None else 2
  assert [(c["rows"], c["num_samples"]) for c in greedy_calls] == [(4, 1)] * 2
  assert [(c["rows"], c["num_samples"]) for c in sample_calls] == [(4, per_call)] * (2 * 6 // per_call)
  assert all(c["temperature"] == pytest.approx(0.7) for c in sample_calls)
  assert len({c["key"] for c in sampler.calls}) == len(sampler.calls)


def test_evaluate_policy_reports_each_level_of_a_task_with_several(arith):
  task, tokenizer, problems = arith
  greedy, samples, _ = _script(problems)
  # Problems 0, 1 and 3 at level 1, problems 2 and 4 at level 2 (the levels of the held-out split of a
  # mixed-difficulty task): the same metrics per level, counted by hand from _script's layouts.
  leveled = [dataclasses.replace(p, level=2 if i in (2, 4) else 1) for i, p in enumerate(problems)]
  out = _evaluate(ScriptedSampler(tokenizer, greedy, samples), task, tokenizer, leveled)
  assert out["greedy_accuracy"] == pytest.approx(3 / 5)
  assert out["level1/num_problems"] == 3 and out["level2/num_problems"] == 2
  assert out["level1/greedy_accuracy"] == pytest.approx(1 / 3)  # problem 0
  assert out["level2/greedy_accuracy"] == pytest.approx(2 / 2)  # problems 2 and 4
  assert out["level1/pass@1"] == pytest.approx((6 + 3 + 2) / 18)
  assert out["level2/pass@1"] == pytest.approx((0 + 1) / 12)
  assert out["level1/pass@6"] == 1.0 and out["level2/pass@6"] == pytest.approx(1 / 2)
  assert out["level1/maj@6"] == 1.0 and out["level2/maj@6"] == 0.0

  # Two tasks: each task's levels under its own name; a task with one level has no level keys.
  mixed = leveled[:3] + [dataclasses.replace(p, task="codegen") for p in leveled[3:]]
  out = _evaluate(ScriptedSampler(tokenizer, greedy, samples), task, tokenizer, mixed)
  assert out["arith/level1/greedy_accuracy"] == pytest.approx(1 / 2) and out["arith/level2/num_problems"] == 1
  assert out["codegen/level1/num_problems"] == 1 and out["codegen/level2/greedy_accuracy"] == 1.0
  assert not [k for k in out if k.startswith("level")]
  out = _evaluate(ScriptedSampler(tokenizer, greedy, samples), task, tokenizer, leveled[:2] + leveled[3:4])
  assert not [k for k in out if "level" in k]


def test_evaluate_policy_reports_each_task_and_maj_only_with_an_extractor(arith):
  task, tokenizer, problems = arith
  greedy, samples, _ = _script(problems)
  # Problems 3 and 4 belong to a task without a notion of a final answer.
  mixed = problems[:3] + [dataclasses.replace(p, task="codegen") for p in problems[3:]]
  out = _evaluate(ScriptedSampler(tokenizer, greedy, samples), task, tokenizer, mixed)
  assert out["greedy_accuracy"] == pytest.approx(3 / 5)
  assert out["arith/greedy_accuracy"] == pytest.approx(2 / 3)
  assert out["codegen/greedy_accuracy"] == pytest.approx(1 / 2)
  assert out["arith/pass@6"] == pytest.approx(2 / 3) and out["codegen/pass@6"] == 1.0
  assert out["arith/pass@1"] == pytest.approx((6 + 3 + 0) / 18)
  assert out["arith/maj@6"] == pytest.approx(2 / 3) and out["arith/maj@1"] == pytest.approx(1 / 3)
  assert out["arith/num_problems"] == 3 and out["codegen/num_problems"] == 2
  assert not [k for k in out if k.startswith("maj@") or k.startswith("codegen/maj@")]

  # An explicit extractor applies to every task: one constant answer makes every vote
  # follow the first sample (correct for problems 0 and 4).
  out = _evaluate(ScriptedSampler(tokenizer, greedy, samples), task, tokenizer, mixed, answer_fn=lambda p, t: "x")
  assert [out[f"maj@{k}"] for k in (1, 2, 4, 6)] == pytest.approx([2 / 5] * 4)
  assert out["codegen/maj@6"] == pytest.approx(1 / 2)


def test_evaluate_policy_checks_its_arguments(arith):
  task, tokenizer, problems = arith
  greedy, samples, _ = _script(problems)
  with pytest.raises(ValueError, match="outside 1..num_samples=6"):
    _evaluate(ScriptedSampler(tokenizer, greedy, samples), task, tokenizer, problems, ks=(1, 8))
  with pytest.raises(ValueError, match="multiple of the sampler's batch shards"):
    _evaluate(ScriptedSampler(tokenizer, greedy, samples, batch_shards=3), task, tokenizer, problems)


def test_eval_rows_are_a_multiple_of_the_batch_shards_at_most_64():
  """The rows of every evaluation call, for any sampler mesh: a multiple of its batch shards (which
  :func:`evaluate_policy` requires), all held-out prompts when they fit, at most 64 (or one per shard)."""
  from mimo_jax.eval.evaluator import eval_rows

  for shards in range(1, 131):
    for prompts in range(0, 301):
      rows = eval_rows(prompts, shards)
      assert rows % shards == 0 and shards <= rows <= max(64, shards)
      assert rows >= min(prompts, 64 // shards * shards)
  assert eval_rows(64, 8) == 64 and eval_rows(64, 3) == 63 and eval_rows(10, 3) == 12 and eval_rows(64, 24) == 48


def test_samples_per_call_and_default_ks():
  assert samples_per_call(64, 16, None) == 64
  assert samples_per_call(64, 16, 256) == 16
  assert samples_per_call(6, 4, 8) == 2
  assert samples_per_call(7, 4, 8) == 1  # 7 is prime: one sample per call
  assert samples_per_call(6, 4, 3) == 1  # even one sample per prompt is over the limit
  assert default_ks(64) == (1, 8, 64)
  assert default_ks(8) == (1, 8)
  assert default_ks(1) == (1,)


def test_default_answer_extractors():
  arith = default_answer_fn("arith")
  assert arith(None, " 42 ") == "42" and arith(None, "  ") is None
  gsm8k = default_answer_fn("gsm8k")
  # Differently written numbers vote together; a completion without an answer has none.
  assert gsm8k(None, "so 1000 + 200\n#### 1,200") == gsm8k(None, "The answer is 1200.") is not None
  assert gsm8k(None, "#### 7") != gsm8k(None, "#### 8")
  assert gsm8k(None, "no idea") is None
  assert default_answer_fn("humaneval") is None


def test_config_from_dict_round_trips_and_names_bad_fields():
  cfg = Config()
  assert config_from_dict(json.loads(cfg.to_json())) == cfg
  d = cfg.to_dict()
  d["run"]["bogus"] = 1
  del d["data"]["task"]
  del d["logging"]
  with pytest.raises(ConfigError) as e:
    config_from_dict(d)
  assert "unknown fields: run.bogus" in str(e.value)
  assert "missing fields: logging" in str(e.value) and "data.task" in str(e.value)
  # A run directory written before the newer settings existed reads as their defaults.
  d = cfg.to_dict()
  for concern, names in ADDED_SETTINGS.items():
    for name in names:
      del d[concern][name]
  assert config_from_dict(d) == cfg
  # A real older run's config.json (every setting the release before ADDED_SETTINGS had) still reads: a
  # setting added since and missing from ADDED_SETTINGS fails here.  The warm start's clip was --grad_clip.
  old = json.load(open(os.path.join(ROOT, "tests", "data", "config_before_added_settings.json")))
  old["optim"]["grad_clip"] = 0.5
  read = config_from_dict(old)
  assert read.optim.sft_grad_clip == 0.5 and read.data.data_order == "sample" and read.data.train_prompts == 0
  assert read.run.debug_lr_spike_steps == () and read.data.digit_reward_weight == 0.0
  d = cfg.to_dict()
  d["run"]["max_steps"] = "ten"
  with pytest.raises(ConfigError, match=r"run\.max_steps='ten' \(expected int\)"):
    config_from_dict(d)


# ----------------------------------------------------------------------------
# The command line on a tiny trained run
# ----------------------------------------------------------------------------

TRAIN = [
  f"--flagfile={os.path.join(ROOT, 'experiments', 'grpo_tiny.flags')}",
  # tests/test_train.py's FAST set, two RL steps
  "--model_preset=tiny",
  "--sft_steps=6",
  "--sft_batch_size=16",
  "--max_steps=2",
  "--prompts_per_step=8",
  "--num_samples=4",
  "--eval_prompts=16",
  "--eval_samples=2",
  "--eval_every=2",
  "--checkpoint_every=2",
  "--max_new_tokens=6",
  "--tensorboard=false",
]


def _hashed_reward(self, problem, completion_text):
  """A verifier a random policy passes about half the time, depending on every completion.

  A tiny model trained for seconds gets exact arithmetic right 0% of the time, which
  would make "same greedy accuracy" hold for any parameters; with this reward the
  accuracy is informative and any changed completion flips its verdict half the time.
  """
  del self
  digest = hashlib.sha1(f"{problem.prompt}|{completion_text.strip()}".encode()).digest()
  return float(digest[0] % 2)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("eval") / "run"
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ArithTask, "reward", _hashed_reward)
    assert train_main(["prog", *TRAIN, f"--run_dir={run_dir}"]) == 0
  metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  evals = {r["step"]: r for r in metrics if "eval/greedy_accuracy" in r}
  return run_dir, evals


def _cli(capsys, *argv):
  rc = eval_main(["prog", *argv])
  captured = capsys.readouterr()
  lines = [line for line in captured.out.splitlines() if line.startswith("{")]
  return rc, (json.loads(lines[-1]) if rc == 0 else None), captured.err


def test_cli_reproduces_the_runs_greedy_accuracy(trained_run, tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(ArithTask, "reward", _hashed_reward)
  run_dir, evals = trained_run
  steps = sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit())
  assert steps == [6, 7, 9]  # SFT 6; RL step 0 at 7 and the final RL step 2 at 9

  # The run directory: its latest checkpoint, with the run's own evaluation settings.
  out_path = tmp_path / "out" / "eval.json"
  rc, res, err = _cli(capsys, f"--checkpoint={run_dir}", "--eval_prompts=16", f"--output={out_path}")
  assert rc == 0, err
  assert (res["checkpoint_step"], res["phase"], res["step"]) == (9, "rl", 2)
  assert res["num_problems"] == 16 and res["eval_samples"] == 2 and res["ks"] == [1, 2]
  assert json.loads(out_path.read_text()) == res
  final = evals[3]["eval/greedy_accuracy"]  # logged at step max_steps + 1
  assert 0 < final < 1  # informative (see _hashed_reward)
  assert res["greedy_accuracy"] == final
  for key in ("greedy_accuracy", "pass@1", "pass@2", "maj@1", "maj@2"):
    assert 0 <= res[key] <= 1, key
  assert res["pass@2"] >= res["pass@1"]

  # A specific checkpoint: the end of SFT, which the run evaluated as its warm start.
  rc, res, err = _cli(
    capsys,
    f"--checkpoint={run_dir / 'checkpoints' / '6'}",
    "--eval_samples=4",
    "--ks=1,2,4",
    "--max_batch_rows=32",
    "--eval_temperature=1.5",
  )
  assert rc == 0, err
  assert (res["checkpoint_step"], res["phase"], res["step"]) == (6, "sft", 6)
  assert res["greedy_accuracy"] == evals[0]["eval/greedy_accuracy"]
  assert res["eval_temperature"] == 1.5 and res["num_problems"] == 16
  for k in (1, 2, 4):
    assert 0 <= res[f"maj@{k}"] <= 1 and 0 <= res[f"pass@{k}"] <= 1
  assert res["pass@1"] <= res["pass@2"] <= res["pass@4"]
  # The held-out split spreads over the run's two levels (grpo_tiny's 1,2): each is reported on its own
  # (how a mixed-difficulty run moves each level), and the levels' problems make up the whole.
  assert {k.split("/")[0] for k in res if "/" in k} == {"level1", "level2"}
  n1, n2 = res["level1/num_problems"], res["level2/num_problems"]
  assert n1 > 0 and n2 > 0 and n1 + n2 == 16
  for key in ("greedy_accuracy", "pass@4"):
    assert res[key] == pytest.approx((n1 * res[f"level1/{key}"] + n2 * res[f"level2/{key}"]) / 16), key
  assert "eval_prompts_not_held_out" not in res

  # A larger arithmetic split than the run held out: its extra prompts are ones the run could train on.
  rc, res, err = _cli(capsys, f"--checkpoint={run_dir}", "--eval_prompts=24")
  assert rc == 0, err
  from mimo_jax.tasks.registry import HELDOUT_SEED

  own = {p.prompt for p in ArithTask(levels=(1, 2), seed=HELDOUT_SEED, heldout_size=16).heldout()}
  larger = [p.prompt for p in ArithTask(levels=(1, 2), seed=HELDOUT_SEED, heldout_size=24).heldout()]
  outside = sum(p not in own for p in larger)
  assert res["num_problems"] == 24 and 0 < outside and res["eval_prompts_not_held_out"] == outside

  # A run written on a mesh this machine's devices cannot hold (here: 2 x 8 of 8) evaluates on all of
  # them over fsdp (checkpoints restore onto any layout): here that is the run's own split of 8.
  moved = tmp_path / "moved"
  shutil.copytree(run_dir, moved)
  config = json.loads((moved / "config.json").read_text())
  config["mesh"].update(mesh_data=2, mesh_fsdp=8)
  (moved / "config.json").write_text(json.dumps(config))
  rc, res, err = _cli(capsys, f"--checkpoint={moved}", "--eval_prompts=16")
  assert rc == 0, err
  assert res["greedy_accuracy"] == final and res["checkpoint_step"] == 9


def test_cli_refuses_missing_checkpoints_and_bad_flags(trained_run, tmp_path, capsys):
  run_dir, _ = trained_run
  rc, _, err = _cli(capsys, f"--checkpoint={tmp_path / 'nowhere'}")
  assert rc == 2 and "no such directory" in err
  rc, _, err = _cli(capsys, f"--checkpoint={run_dir / 'checkpoints' / '8'}")
  assert rc == 2 and "no such checkpoint directory" in err and "[6, 7, 9]" in err
  rc, _, err = _cli(capsys, f"--checkpoint={run_dir}", "--eval_samples=4", "--ks=1,8")
  assert rc == 2 and "--ks=1,8" in err and "1..eval_samples=4" in err
  rc, _, err = _cli(capsys, f"--checkpoint={run_dir}", "--eval_samples=many")
  assert rc == 2 and "eval_samples" in err
  rc, _, err = _cli(capsys)
  assert rc == 2 and "--checkpoint is required" in err
  for value in ("nan", "inf"):  # a non-finite temperature was accepted, and printed as JSON's invalid NaN
    rc, _, err = _cli(capsys, f"--checkpoint={run_dir}", f"--eval_temperature={value}")
    assert rc == 2 and f"--eval_temperature={value}: must be > 0" in err
  rc, _, err = _cli(capsys, f"--checkpoint={run_dir}", f"--eval_seed={10**23}")
  assert rc == 2 and "must fit in 64 bits" in err  # was an OverflowError traceback
  rc, _, err = _cli(capsys, f"--checkpoint={run_dir}", f"--output={tmp_path}")
  assert rc == 2 and "is a directory" in err  # was an IsADirectoryError traceback, after the evaluation

  # A checkpoint whose model_config this version does not know (a newer trainer's): a named refusal.
  newer = tmp_path / "newer"
  shutil.copytree(run_dir, newer)
  for meta in (newer / "checkpoints").glob("*/meta/metadata"):
    data = json.loads(meta.read_text())
    data["model_config"]["sliding_window"] = 8
    meta.write_text(json.dumps(data))
  rc, _, err = _cli(capsys, f"--checkpoint={newer / 'checkpoints' / '9'}")
  assert rc == 2 and "model_config has fields this version does not know: sliding_window" in err, err

  # A run directory whose config.json this version cannot read.
  odd = tmp_path / "odd"
  (odd / "checkpoints" / "1").mkdir(parents=True)
  config = json.loads((run_dir / "config.json").read_text())
  config["run"]["not_a_field"] = 3
  (odd / "config.json").write_text(json.dumps(config))
  rc, _, err = _cli(capsys, f"--checkpoint={odd}")
  assert rc == 2 and "unknown fields: run.not_a_field" in err


def test_cli_refuses_a_corrupted_checkpoint(trained_run, tmp_path, capsys):
  run_dir, _ = trained_run
  copy = tmp_path / "run"
  shutil.copytree(run_dir, copy)
  state = copy / "checkpoints" / "9" / "state"
  # The evaluator reads (and verifies) only the policy's parameters: damage every data file so they are hit.
  for victim in (p for p in state.rglob("*") if p.is_file() and p.stat().st_size > 1024):
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  rc, _, err = _cli(capsys, f"--checkpoint={copy / 'checkpoints' / '9'}")
  assert rc == 2 and "corrupted" in err and "checkpoint 9" in err


def test_cli_all_evaluates_every_checkpoint_into_the_eval_curve_and_resumes(trained_run, tmp_path, capsys, monkeypatch):
  """--run_dir --all: one row per kept checkpoint, each equal to the run's own evaluation of that policy
  (SFT end and RL step 0 are the warm start, the last is the final); a rerun reuses the finished rows."""
  import shutil

  monkeypatch.setattr(ArithTask, "reward", _hashed_reward)
  src, evals = trained_run
  run_dir = tmp_path / "run"
  shutil.copytree(src, run_dir)
  rc, res, err = _cli(capsys, f"--run_dir={run_dir}", "--all", "--eval_prompts=16")
  assert rc == 0, err
  rows = [json.loads(line) for line in open(run_dir / "eval_curve.jsonl")]
  assert [(r["checkpoint_step"], r["phase"], r["step"]) for r in rows] == [(6, "sft", 6), (7, "rl", 0), (9, "rl", 2)]
  warm, final = evals[0]["eval/greedy_accuracy"], evals[3]["eval/greedy_accuracy"]
  assert [r["greedy_accuracy"] for r in rows] == [warm, warm, final]
  assert res["eval_curve"] == [{k: r[k] for k in ("checkpoint_step", "phase", "step", "greedy_accuracy")} for r in rows]
  # Rerun with the same settings: every row is reused as it is (the settings are worked out before the
  # first checkpoint, which was evaluated again); rows edited into another shape are not results.
  before = (run_dir / "eval_curve.jsonl").read_text()
  for r in rows:
    r["marker"] = True
  lines = [json.dumps(r) + "\n" for r in rows] + ["null\n", '{"phase": "rl"}\n', '{"checkpoint_step": "9"}\n']
  (run_dir / "eval_curve.jsonl").write_text("".join(lines))
  assert eval_main(["prog", f"--run_dir={run_dir}", "--all", "--eval_prompts=16"]) == 0
  printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
  assert len(printed) == 1  # the result; no progress row: nothing evaluated, the file left as it was
  assert json.loads(printed[0])["eval_curve"] == res["eval_curve"]
  assert (run_dir / "eval_curve.jsonl").read_text() == "".join(lines)
  assert before.count("\n") == 3
  # Other settings: every checkpoint is evaluated again and its row replaced.
  rc, _, err = _cli(capsys, f"--run_dir={run_dir}", "--all", "--eval_prompts=16", "--eval_samples=4")
  assert rc == 0, err
  again = [json.loads(line) for line in open(run_dir / "eval_curve.jsonl")]
  assert [r.get("marker") for r in again] == [None] * 3 and [r["eval_samples"] for r in again] == [4] * 3
  # Bad combinations are refused before anything runs.
  for argv, message in (
    (["--all"], "--all needs --run_dir"),
    ([f"--run_dir={run_dir}"], "--run_dir is the run of --all"),
    ([f"--run_dir={run_dir}", "--all", f"--checkpoint={run_dir}"], "leave out --checkpoint"),
  ):
    rc, _, err = _cli(capsys, *argv)
    assert rc == 2 and message in err, (argv, err)


def test_keep_best_keeps_the_best_evaluated_policy_beside_the_last_ones(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(ArithTask, "reward", _hashed_reward)
  run_dir = tmp_path / "run"
  flags = [*TRAIN, "--max_steps=4", "--eval_every=1", "--keep_best=greedy_accuracy", "--learning_rate=3e-3"]
  assert train_main(["prog", *flags, f"--run_dir={run_dir}"]) == 0
  metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  # RL evaluations: steps 1-3 (every step but the last) and the final one, logged at max_steps + 1.
  evals = [(m["step"], m["eval/greedy_accuracy"]) for m in metrics if "eval/greedy_accuracy" in m and m["step"] > 0]
  assert [s for s, _ in evals] == [1, 2, 3, 5]
  best_step, best = max(evals, key=lambda e: (e[1], -e[0]))  # the first of the best
  best_rl_step = min(best_step, 4)
  kept = sorted(int(n) for n in os.listdir(run_dir / "best") if n.isdigit())
  assert kept == [6 + 1 + best_rl_step]  # one checkpoint axis: SFT steps 1..6, RL step k at 7 + k
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["best"] == {"metric": "greedy_accuracy", "value": best}
  # The newest checkpoints are kept as always (--keep_last=3), the best one beside them.
  assert sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit())[-1] == 11
  rc, res, err = _cli(capsys, f"--checkpoint={run_dir / 'best' / str(kept[0])}")
  assert rc == 0, err
  assert (res["phase"], res["step"], res["greedy_accuracy"]) == ("rl", best_rl_step, best)
  # Exported: the best policy's very weights.
  from mimo_jax.ckpt import Checkpointer
  from mimo_jax.export import main as export_main
  from mimo_jax.models.hf import load_hf

  assert export_main(["--run_dir", str(tmp_path), "--out", str(tmp_path / "hf"), "--best"]) == 2
  err = capsys.readouterr().err
  assert "no best checkpoint" in err and "--keep_best" in err
  assert export_main(["--run_dir", str(run_dir), "--out", str(tmp_path / "hf"), "--best"]) == 0
  assert f"exported checkpoint {kept[0]}" in capsys.readouterr().out
  ckpt = Checkpointer(str(run_dir / "best"), read_only=True)
  stored, _ = ckpt.restore_untyped_part(kept[0], ["params"])
  ckpt.close()
  from flax import nnx

  def arrays(tree):  # each array's shape and exact bits, in a canonical order
    return sorted((np.shape(x), np.asarray(x, np.float32).tobytes()) for x in jax.tree.leaves(tree))

  assert arrays(nnx.state(load_hf(str(tmp_path / "hf")))) == arrays(stored["params"])
  # --all takes best/'s checkpoint too once --keep_last has dropped it from checkpoints/.
  shutil.rmtree(run_dir / "checkpoints" / str(kept[0]), ignore_errors=True)
  left = sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit())
  rc, res, err = _cli(capsys, f"--run_dir={run_dir}", "--all")
  assert rc == 0, err
  rows = [json.loads(line) for line in open(run_dir / "eval_curve.jsonl")]
  assert [r["checkpoint_step"] for r in rows] == sorted([*left, kept[0]])
  assert next(r["greedy_accuracy"] for r in rows if r["checkpoint_step"] == kept[0]) == best


def test_keep_best_names_a_held_out_metric():
  from mimo_jax.config import ConfigError, validate
  from mimo_jax.main import parse_config

  with pytest.raises(ConfigError, match="--keep_best='reward_mean': allowed values: greedy_accuracy, pass@K"):
    parse_config(["prog", "--keep_best=reward_mean"])
  with pytest.raises(ConfigError, match=r"--keep_best='pass@3'.*k in \[1, 8\]"):
    validate(parse_config(["prog", "--keep_best=pass@3", "--eval_samples=8"]), 8)
  validate(parse_config(["prog", "--keep_best=pass@8", "--eval_samples=8"]), 8)
