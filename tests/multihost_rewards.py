"""The rollout side's reward path on a global mesh, for ``test_multihost.py``.

Run as ``python tests/multihost_rewards.py OUT.json [main flags]`` in one process, or in several
(with ``--coordinator_address/--num_processes/--process_id``): builds a rollout batch over the mesh
whose completions are known texts (a row-dependent pattern of right and wrong answers), rewards two
such batches with the real worker (``RolloutWorker.reward``: decode, score, mix with the running
normaliser) and writes (process 0) the rewards, components and metrics; every process also writes
the rows it decoded itself, with their texts, to ``OUT.json.p<i>``, and what a judge
(``--judge_checkpoint``) wrote for each batch to ``OUT.json.p<i>.judge``. The composite reward is the run's own
(``build_run_reward``), so ``--reward_model`` and the judge score on the global mesh. ``--probe``
(first after OUT.json) adds a per-sample source that fails on the rows whose completion is a multiple of 3,
and the batches' failure messages are written too.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mimo_jax import multihost, sharding
from mimo_jax.main import parse_config
from mimo_jax.rewards.base import CompositeReward, RewardSource
from mimo_jax.rollout import FINISH_STOP, RolloutOutput
from mimo_jax.rollout.encoding import encode_prompts, encode_targets
from mimo_jax.tasks.registry import build_task
from mimo_jax.testing import reward_fns
from mimo_jax.train.loop import build_run_reward
from mimo_jax.train.rollout_worker import RolloutWorker


def batch(worker, mesh, rng, step: int):
  cfg = worker.cfg
  G = cfg.rollout.num_samples
  problems = worker.sample_problems()
  texts = []
  for i in range(len(problems) * G):
    p = problems[i // G]
    right = (i * 7 + step) % 3 == 0
    texts.append(p.answer if right else str(int(p.answer) + 1 + int(rng.integers(0, 5))))
  B = len(texts)
  tokens, mask, _ = encode_prompts(worker.tokenizer, [p.prompt for p in problems], worker.buckets)
  ctok, cmask, _ = encode_targets(worker.tokenizer, texts, cfg.rollout.max_new_tokens)
  rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

  def put(x):
    return jax.device_put(np.asarray(x), rows)

  M = ctok.shape[1]
  rollout = RolloutOutput(
    prompt_tokens=put(np.repeat(tokens, G, axis=0)),
    prompt_mask=put(np.repeat(mask, G, axis=0)),
    completion_tokens=put(ctok),
    completion_mask=put(cmask),
    lengths=put(cmask.sum(axis=1).astype(np.int32)),
    finish_reason=put(np.full((B,), FINISH_STOP, np.int32)),
    logprobs=put(np.zeros((B, M), np.float32)),
    sampler_logprobs=put(np.zeros((B, M), np.float32)),
    temperature=put(np.ones((B,), np.float32)),
    prompt_index=put(np.repeat(np.arange(len(problems), dtype=np.int32), G)),
  )
  return problems, rollout, texts


class Recording:
  """A judge's generate_fn that keeps what the judge wrote (everything else is the wrapped one's)."""

  def __init__(self, inner):
    self.inner, self.calls = inner, []

  def __call__(self, prompts, num_samples):
    out = self.inner(prompts, num_samples)
    self.calls.append(out)
    return out

  def __getattr__(self, name):
    return getattr(self.inner, name)


def main(argv):
  out = argv[1]
  probe = argv[2:3] == ["--probe"]
  cfg = parse_config(["prog", *argv[2 + probe :]])
  sharding.initialize_distributed(cfg.mesh)
  mesh = sharding.build_mesh(cfg.mesh)
  task, tokenizer = build_task(cfg.data, seed=cfg.run.seed)
  rewarder = build_run_reward(cfg, task, tokenizer, mesh)
  if probe:
    fails = RewardSource("probe", functools.partial(reward_fns.fails_on_multiples, k=3), weight=0.0)
    rewarder = CompositeReward(
      [*rewarder.sources, fails], normalize=rewarder.normalize, ema=rewarder.ema, eps=rewarder.eps, clip=rewarder.clip
    )
  judge = next((s.fn for s in rewarder.sources if s.name == "judge"), None)
  if judge is not None:
    judge.generate_fn = Recording(judge.generate_fn)
  worker = RolloutWorker(cfg, task, tokenizer, None, rewarder, jax.random.key(0))
  rng = np.random.default_rng(0)
  results, own, judged = [], [], []
  for step in range(2):
    problems, rollout, texts = batch(worker, mesh, rng, step)
    rewards = worker.reward(problems, rollout)
    if judge is not None:
      judged.append(judge.generate_fn.calls.pop())
    results.append(
      {
        "values": rewards.values.tolist(),
        "correct": rewards.correct.tolist(),
        "components": {k: v.tolist() for k, v in rewards.components.items()},
        "normalized": {k: v.tolist() for k, v in rewards.batch.normalized.items()},
        "metrics": rewards.metrics,
        "errors": rewards.batch.errors,
        "expected_correct": [t == problems[i // cfg.rollout.num_samples].answer for i, t in enumerate(texts)],
      }
    )
    own.append({str(i): t for i, t in enumerate(rewards.texts) if t is not None})
  results.append({"reward_state": rewarder.state_dict()})
  if multihost.is_primary():
    with open(out, "w") as f:
      json.dump(results, f)
  with open(f"{out}.p{jax.process_index()}", "w") as f:
    json.dump(own, f)
  if judge is not None:
    with open(f"{out}.p{jax.process_index()}.judge", "w") as f:
      json.dump(judged, f)


if __name__ == "__main__":
  main(sys.argv)
