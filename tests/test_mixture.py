"""Task mixtures and layered rewards from the command line: --task=a:w,b:w, --json_*, --judge_*, --mode=reward_model."""

import collections
import json
import os

import jax
import numpy as np
import pytest

from mimo_jax.config import ConfigError, DataConfig, parse_task_mix
from mimo_jax.main import main, parse_config
from mimo_jax.rewards.base import RewardSample
from mimo_jax.rewards.task_rewards import build_task_reward
from mimo_jax.tasks.arith import ArithTask
from mimo_jax.tasks.gsm8k import GSM8KTask
from mimo_jax.tasks.mixture import MixtureTask, apportion
from mimo_jax.tasks.registry import build_task
from mimo_jax.testing.hf_models import save_random_judge
from mimo_jax.train.metric_names import describe
from mimo_jax.train_rm import corrupt_answer, gold_completion, task_pairs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILE = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
# A mixture run small enough for the suite: arithmetic and GSM8K prompts (the longer bucket for GSM8K).
MIX = [
  "--model_preset=tiny",
  "--task=arith:0.25,gsm8k:0.75",
  "--prompt_buckets=16,96",
  "--max_new_tokens=8",
  "--sft_steps=4",
  "--sft_batch_size=8",
  "--prompts_per_step=8",
  "--num_samples=2",
  "--eval_prompts=8",
  "--eval_samples=2",
  "--eval_every=2",
  "--checkpoint_every=1",
  "--tensorboard=false",
  "--log_samples=1",
]


# ----------------------------------------------------------------------------
# --task parsing
# ----------------------------------------------------------------------------


def test_task_mix_parses_and_canonicalises():
  assert parse_task_mix("arith") == (("arith", 1.0),)
  assert parse_task_mix("arith:0.5, gsm8k:1.5") == (("arith", 0.5), ("gsm8k", 1.5))
  assert DataConfig(task="arith:1").task == "arith" and not DataConfig(task="arith:1").is_mixture
  assert DataConfig(task="gsm8k:1,arith:3").task == "gsm8k:1,arith:3"
  mixed = DataConfig(task="arith:1,gsm8k:1")
  assert mixed.is_mixture and mixed.reward_normalization == "task_running"  # auto
  assert DataConfig().reward_normalization == "none"  # auto, one task: unchanged
  assert DataConfig(task="arith:1,gsm8k:1", reward_normalize="none").reward_normalization == "none"


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--task=arith:0", "the weight of 'arith' must be a finite number > 0"),
    ("--task=arith:-1,gsm8k:1", "the weight of 'arith' must be a finite number > 0"),
    ("--task=arith:inf,gsm8k:1", "the weight of 'arith' must be a finite number > 0"),
    ("--task=arith:x", "the weight of 'arith' must be a finite number > 0"),
    ("--task=arith,arith", "'arith' appears twice"),
    ("--task=mnist:1,arith:1", "unknown task 'mnist'; allowed tasks: arith, gsm8k, humaneval, jsonl"),
    ("--task=gsm8k:1,humaneval:1 --data_path=x.jsonl", "--data_path='x.jsonl': is ambiguous in a mixture"),
  ],
)
def test_bad_task_flags_are_refused_before_compute(flag, message, capsys):
  assert main(["prog", f"--flagfile={FLAGFILE}", *flag.split()]) == 2
  err = capsys.readouterr().err
  assert message in err and err.startswith("error: --")


# ----------------------------------------------------------------------------
# The mixture task
# ----------------------------------------------------------------------------


def test_apportion_golden_values():
  assert apportion(10, [1, 1]) == [5, 5]
  assert apportion(10, [0.3, 0.7]) == [3, 7]
  assert apportion(7, [1, 1, 1]) == [3, 2, 2]  # ties by order
  assert apportion(5, [0.98, 0.01, 0.01], at_least_one=True) == [3, 1, 1]
  assert apportion(2, [1, 1, 1], at_least_one=True) == [1, 1, 0]  # too few to give each one
  with pytest.raises(ValueError):
    apportion(3, [1, 0])


def _mixture(heldout=20):
  arith = ArithTask(levels=(1, 2), seed=1234, heldout_size=heldout, reverse_answer=True)
  gsm = GSM8KTask(None, None)
  return MixtureTask([(arith, 1.0), (gsm, 3.0)], levels={"arith": (1, 2)}, heldout_size=heldout), arith, gsm


def test_mixture_heldout_strata_and_reward_dispatch():
  mix, arith, gsm = _mixture(heldout=20)
  held = mix.heldout()
  # The held-out budget split by weight (1:3), each task's block its own held-out prefix.
  assert [p.task for p in held] == ["arith"] * 5 + ["gsm8k"] * 15
  assert held[:5] == arith.heldout()[:5] and held[5:] == gsm.heldout()[:15]
  assert mix.strata() == {("arith", 1): 0.125, ("arith", 2): 0.125, ("gsm8k", 0): 0.75}
  assert mix.name == "arith+gsm8k" and not mix.runs_untrusted_code
  rng = np.random.default_rng(0)
  drawn = mix.sample(rng, 400)
  share = collections.Counter(p.task for p in drawn)
  assert 0.65 < share["gsm8k"] / 400 < 0.85 and not any(mix.is_heldout(p) for p in drawn)
  # Each problem is verified by its own task's verifier.
  for p in drawn[:40]:
    own = arith if p.task == "arith" else gsm
    for text in (p.answer, " #### " + p.answer, "nonsense"):
      assert mix.reward(p, text) == own.reward(p, text)
  # A checkpointed pool rebuilds each problem by its own class.
  for p in drawn[:10]:
    import dataclasses

    assert mix.problem_from_dict(dataclasses.asdict(p)) == p
  examples = mix.sft_examples(np.random.default_rng(1), 200)
  assert 100 < sum(prompt.startswith("Question:") for prompt, _ in examples) < 190


def test_per_task_normalisation_standardises_each_task_before_the_mix():
  mix, _, _ = _mixture()
  rewarder = build_task_reward(mix, normalize="task_running")
  rng = np.random.default_rng(3)
  problems = mix.sample(rng, 64)
  # Arithmetic right half the time; GSM8K right a quarter of the time (different reward scales per task).
  samples = []
  for i, p in enumerate(problems):
    right = i % 2 == 0 if p.task == "arith" else i % 4 == 0
    text = (p.answer if p.task == "arith" else f" #### {p.answer}") if right else "0 #### -1"
    samples.append(RewardSample(prompt=p.prompt, completion=text, row={"problem": p, "answer": p.answer}, task=p.task))
  batch = rewarder(samples)
  tasks = np.array([s.task for s in samples])
  for name in ("arith", "gsm8k"):
    z = batch.normalized["correct"][tasks == name]
    assert abs(z.mean()) < 1e-5 and abs(z.std() - 1) < 1e-3, name
  # The format component applies to GSM8K samples only (NaN elsewhere); the raw mix is logged unchanged.
  assert np.isnan(batch.components["format"][tasks == "arith"]).all()
  assert not np.isnan(batch.components["format"][tasks == "gsm8k"]).any()
  np.testing.assert_allclose(batch.raw_rewards, batch.components["correct"], atol=0)
  rewarder.close()


def test_the_digit_credit_is_a_dense_arith_component_beside_the_exact_match():
  """--digit_reward_weight: reward = correct + w * digits on arithmetic samples; other tasks' samples untouched."""
  mix, arith, _ = _mixture()
  problems = mix.sample(np.random.default_rng(5), 48)
  samples = []
  for i, p in enumerate(problems):
    if p.task == "arith":  # exact, one digit off (the units digit, first in a reversed answer), or empty
      text = [p.answer, str((int(p.answer[0]) + 1) % 10) + p.answer[1:], ""][i % 3]
    else:
      text = f" #### {p.answer}" if i % 2 else "nonsense"
    samples.append(RewardSample(prompt=p.prompt, completion=text, row={"problem": p, "answer": p.answer}, task=p.task))
  rewarder = build_task_reward(mix, digit_weight=0.5)
  batch = rewarder(samples)
  rewarder.close()
  tasks = np.array([s.task for s in samples])
  on = tasks == "arith"
  assert on.any() and (~on).any()
  expected = [arith.digit_credit(s.row["problem"], s.completion) for s, a in zip(samples, on, strict=True) if a]
  np.testing.assert_allclose(batch.components["digits"][on], expected)
  assert np.isnan(batch.components["digits"][~on]).all()
  np.testing.assert_allclose(batch.raw_rewards[on], batch.components["correct"][on] + 0.5 * np.asarray(expected))
  np.testing.assert_allclose(batch.raw_rewards[~on], batch.components["correct"][~on])
  # A wrong answer with digits in place now earns something: the signal is dense.
  assert {0.0, 1.5} < set(np.round(batch.raw_rewards[on], 6)) and any(0 < r < 1 for r in batch.raw_rewards[on])
  # Off by default: no such component.
  plain = build_task_reward(mix)
  assert "digits" not in plain(samples).components
  plain.close()


def test_the_rollout_worker_draws_each_task_and_level_in_proportion(tmp_path):
  from mimo_jax.train.rollout_worker import RolloutWorker

  cfg = parse_config(["prog", f"--flagfile={FLAGFILE}", *MIX, "--prompts_per_step=16", f"--run_dir={tmp_path}"])
  task, tokenizer = build_task(cfg.data, seed=0)
  worker = RolloutWorker(cfg, task, tokenizer, sampler=None, rewarder=None, key=jax.random.key(0))
  strata = collections.Counter()
  for _ in range(6):
    batch = worker.sample_problems()
    counts = collections.Counter(p.task for p in batch)
    assert counts == {"arith": 4, "gsm8k": 12}  # 1:3 of 16 in every batch, not only on average
    strata.update((p.task, p.level) for p in batch)
    assert len({p.uid for p in batch}) == 16
  assert strata[("arith", 1)] == strata[("arith", 2)] == 12  # levels balanced within the task
  # The pool's state round-trips through the checkpoint's JSON (problems of both classes).
  state = json.loads(json.dumps(worker.prompt_sampler.state_dict()))
  other = RolloutWorker(cfg, task, tokenizer, sampler=None, rewarder=None, key=jax.random.key(0))
  other.load_host_state(prompt_sampler=state)
  rng_state = worker.data_rng.bit_generator.state
  other.data_rng.bit_generator.state = rng_state
  assert [p.uid for p in other.sample_problems()] == [p.uid for p in worker.sample_problems()]


# ----------------------------------------------------------------------------
# Through the command line
# ----------------------------------------------------------------------------


def _rl_records(run_dir):
  lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  return lines, [r for r in lines if r["step"] >= 1 and "reward_mean" in r]


@pytest.mark.slow
def test_a_mixture_trains_and_reports_per_task_through_the_command_line(tmp_path):
  # (A resume's prompt pool, problems of both classes, is checked by the worker test above.)
  schema = '{"type": "integer"}'
  flags = ["prog", f"--flagfile={FLAGFILE}", *MIX, "--json_reward_weight=0.1", f"--json_schema={schema}"]
  assert main([*flags, "--max_steps=3", f"--run_dir={tmp_path}"]) == 0
  lines, rl = _rl_records(tmp_path)
  assert [r["step"] for r in rl] == [1, 2, 3]
  for r in rl:
    assert r["task/arith/share"] == 0.25 and r["task/gsm8k/share"] == 0.75
    assert "reward_normalized_mean" in r  # --reward_normalize=auto standardises per task in a mixture
    for name in ("correct", "format", "json"):
      assert f"reward/{name}_mean" in r
  evals = [r for r in lines if "eval/greedy_accuracy" in r]
  assert evals and all(r["eval/arith/num_problems"] == 2 and r["eval/gsm8k/num_problems"] == 6 for r in evals)
  assert sorted({k for r in lines for k in r if describe(k) is None}) == []
  # The json component: 1 exactly when the completion is a JSON integer (an independent check per logged sample).
  samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
  assert {s["task"] for s in samples} == {"arith", "gsm8k"}
  for s in samples:
    try:
      is_int = isinstance(json.loads(s["completion"]), int)
    except ValueError:
      is_int = False
    assert s["components"]["json"] == float(is_int), s["completion"]
    assert (s["components"]["format"] is None) == (s["task"] == "arith")


def test_bad_reward_flags_are_refused_before_compute(tmp_path, capsys):
  bad = [
    ("--json_schema={not json", "--json_schema='{not json': "),
    ('--json_schema={"type": "complex"}', "--json_schema="),
    (f"--json_schema={tmp_path / 'missing.json'}", "neither inline JSON nor an existing file"),
    (f"--judge_checkpoint={tmp_path}", "not a Hugging Face checkpoint directory (no config.json)"),
    ("--judge_mode=vote", "--judge_mode=vote: value should be one of <score|pairwise>"),
    ("--rm_pairs=/nonexistent.jsonl", "--rm_pairs='/nonexistent.jsonl': no such file"),
  ]
  for flag, message in bad:
    argv = ["prog", f"--flagfile={FLAGFILE}", flag, f"--run_dir={tmp_path / 'run'}"]
    assert main(argv) == 2, flag
    if flag.startswith("--rm_pairs"):
      from mimo_jax.train_rm import main as train_rm_main

      assert message in capsys.readouterr().err, flag
      assert train_rm_main(argv) == 2
    assert message in capsys.readouterr().err, flag
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.slow
def test_a_judge_from_the_command_line_scores_every_completion(tmp_path, capsys):
  judge = save_random_judge(str(tmp_path / "judge"))
  flags = [
    "prog",
    f"--flagfile={FLAGFILE}",
    "--model_preset=tiny",
    "--sft_steps=2",
    "--max_steps=2",
    "--prompts_per_step=8",
    "--num_samples=2",
    "--eval_prompts=8",
    "--eval_samples=2",
    "--max_new_tokens=6",
    "--tensorboard=false",
    f"--judge_checkpoint={judge}",
    "--judge_samples=2",
    "--judge_max_new_tokens=6",
    "--judge_weight=0.5",
    f"--run_dir={tmp_path / 'run'}",
  ]
  assert main(flags) == 0
  _, rl = _rl_records(tmp_path / "run")
  # A random judge never writes a valid 'Score:' line: every sample is a failure of the judge (counted as
  # 0; no judged sample, so no mean), logged every step and reported with the judge's reason; the run goes on.
  # (metrics.jsonl writes a non-finite value as its text)
  assert all(r["reward/judge_mean"] == "nan" and r["reward/judge_fail_frac"] == 1.0 for r in rl)
  out = capsys.readouterr().out
  assert "RL step 0: reward sources failed, each failure counted as 0: judge on 16 of 16 samples" in out
  assert "JudgeInvalid: none of the judge's 2 outputs ends with one valid 'Score: <number>' line" in out


def test_a_judges_sampling_stream_resumes_where_it_stopped(tmp_path):
  from mimo_jax.rewards.judge import load_judge

  judge_dir = save_random_judge(str(tmp_path / "judge"))

  def make():
    return load_judge(
      str(judge_dir), mode="score", num_samples=2, max_new_tokens=5, temperature=1.0, key=jax.random.key(7)
    )

  prompts = ["Question: 1+1= Answer: 2", "Question: 2+2= Answer: 5"]
  a = make()
  a.generate_fn(prompts, 2)
  state = json.loads(json.dumps(a.state_dict()))
  b = make()
  b.load_state_dict(state)
  assert b.generate_fn(prompts, 2) == a.generate_fn(prompts, 2)
  assert b.num_outputs == a.num_outputs and a.generate_fn.num_calls == 2


# ----------------------------------------------------------------------------
# --mode=reward_model
# ----------------------------------------------------------------------------


def test_preference_pairs_from_the_task_are_checked_by_its_verifier():
  arith = ArithTask(levels=(1, 2), seed=1234, heldout_size=16, reverse_answer=True)
  rng = np.random.default_rng(0)
  problems = arith.sample(rng, 50)
  pairs, skipped = task_pairs(arith, problems, rng)
  assert skipped == 0 and len(pairs) == 50
  for p, (prompt, chosen, rejected) in zip(problems, pairs, strict=True):
    assert prompt == p.prompt and arith.reward(p, chosen) == 1.0 and arith.reward(p, rejected) == 0.0
    assert len(rejected) == len(chosen) and sum(a != b for a, b in zip(chosen, rejected, strict=True)) == 1
  assert corrupt_answer("no digits", rng) is None
  text = corrupt_answer("so 12 + 30 = 42 #### 42", np.random.default_rng(1))
  assert text[:-2] == "so 12 + 30 = 42 #### " and text[-2:] != "42"
  gsm = GSM8KTask(None, None)
  problem = gsm.heldout()[0]
  assert gold_completion(problem) == " " + problem.solution and gsm.reward(problem, gold_completion(problem)) == 1.0


@pytest.mark.slow
def test_reward_model_mode_trains_and_a_policy_run_uses_it(tmp_path, capsys):
  rm_dir, pairs = tmp_path / "rm", tmp_path / "pairs.jsonl"
  base = ["prog", f"--flagfile={FLAGFILE}", "--model_preset=tiny", "--max_new_tokens=6", "--eval_prompts=16"]
  # A file of pairs, with two malformed rows that are counted and reported.
  arith = ArithTask(levels=(1, 2), seed=1234, heldout_size=16, reverse_answer=True)
  rows, _ = task_pairs(arith, arith.sample(np.random.default_rng(0), 64), np.random.default_rng(1))
  lines = [json.dumps(dict(zip(("prompt", "chosen", "rejected"), r, strict=True))) for r in rows]
  pairs.write_text("\n".join([*lines, '{"prompt": "1+1="}', "not json"]) + "\n")
  from mimo_jax.train_rm import main as train_rm_main

  assert train_rm_main([*base, f"--rm_pairs={pairs}", "--rm_steps=40", f"--run_dir={rm_dir}"]) == 0
  report = json.loads((rm_dir / "reward_model.json").read_text())
  assert report["malformed_rows"] == 2 and report["train_pairs"] + report["heldout_pairs"] == 64
  assert report["history"][-1]["rm_loss"] < report["history"][0]["rm_loss"]
  assert 0.0 <= report["heldout_pair_accuracy"] <= 1.0
  assert "use it with --reward_model=" in capsys.readouterr().out
  # The policy run with the same task and tokenizer flags scores every completion with it.
  run = tmp_path / "run"
  flags = [*base, "--sft_steps=2", "--max_steps=2", "--prompts_per_step=8", "--num_samples=2", "--eval_samples=2"]
  assert main([*flags, "--tensorboard=false", f"--reward_model={rm_dir}", f"--run_dir={run}"]) == 0
  _, rl = _rl_records(run)
  assert all("reward/reward_model_mean" in r and r["reward/reward_model_fail_frac"] == 0.0 for r in rl)


def test_a_reward_model_of_another_vocabulary_is_refused(tmp_path, capsys):
  rm_dir = tmp_path / "rm"
  base = ["prog", f"--flagfile={FLAGFILE}", "--model_preset=tiny", "--max_new_tokens=6", "--eval_prompts=8"]
  assert main([*base, "--mode=reward_model", "--rm_steps=1", "--rm_num_pairs=8", f"--run_dir={rm_dir}"]) == 0
  # The same flags but GSM8K's tokenizer (2000 pieces against arithmetic's 16).
  gsm = [*base, "--task=gsm8k", "--prompt_buckets=96", "--max_steps=1", "--sft_steps=0", f"--reward_model={rm_dir}"]
  assert main([*gsm, f"--run_dir={tmp_path / 'run'}"]) == 2
  assert "its vocabulary (16) is smaller than this run's tokenizer" in capsys.readouterr().err
  with pytest.raises(ConfigError):
    parse_config(["prog", "--mode=reward_model", "--rm_steps=0"])


def test_a_task_with_too_few_held_out_problems_passes_its_shortfall_to_the_others():
  """300 held-out prompts at weights 0.5/0.5: the shipped GSM8K sample holds 100, so arith takes the
  other 200 (the held-out set was 250, silently).  Only when every task is spent is it short."""
  task, _ = build_task(DataConfig(task="arith:0.5,gsm8k:0.5", eval_prompts=300), seed=0)
  counts = collections.Counter(p.task for p in task.heldout())
  assert counts == {"arith": 200, "gsm8k": 100}
  from mimo_jax.tasks.mixture import _fill

  assert _fill(10, [0.5, 0.25, 0.25], [2, 100, 100]) == [2, 5, 3]  # (ties of the remainders by order)
  assert _fill(10, [0.5, 0.5], [3, 4]) == [3, 4]  # all spent: short
  assert _fill(9, [1.0, 1.0, 1.0], [100, 0, 100]) == [5, 0, 4]
