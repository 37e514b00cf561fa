"""The rollout side of the seam: from the current policy to one :class:`~mimo_jax.train.learner.Experience`.

:class:`RolloutWorker` samples prompts (from the curriculum's pool when on), generates
``num_samples`` completions per prompt with the sampler's jitted program, decodes them, scores
them with the task's composite reward on the host, refills all-equal groups with further rounds
when dynamic sampling is on, and packs the batch as an ``Experience`` with its provenance (policy
version, batch id, prompt ids, sampling parameters).  Everything it keeps between steps is host
state (the generation key as key data, the data RNG, the curriculum, the reward normaliser, the
batch records), saved in each checkpoint through :meth:`RolloutWorker.host_state` and restored
by :meth:`RolloutWorker.load_host_state`, so a resumed run generates exactly what an
uninterrupted one would.  It never sees the learner's state: :meth:`RolloutWorker.update_params`
is the only way weights reach it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from mimo_jax import multihost
from mimo_jax.config import Config
from mimo_jax.config_base import ConfigError
from mimo_jax.data.curriculum import PassRateCurriculum, PromptSampler
from mimo_jax.data.prompt_stream import PromptStream
from mimo_jax.rewards.base import RewardBatch
from mimo_jax.rewards.task_rewards import reward_samples
from mimo_jax.rollout import FINISH_LENGTH, RolloutOutput
from mimo_jax.rollout.encoding import decode_completions, encode_prompts, sampling_params
from mimo_jax.train.learner import Experience

__all__ = ["RolloutBatch", "RolloutWorker", "Rewards", "digest", "train_pool"]

# Batch records kept for the checkpoint's buffer (provenance of the recent batches).
_BATCH_RECORDS = 16
# Seed-sequence tag of a generated task's --train_prompts draw (apart from the per-step data stream).
_POOL_TAG = 0x504F4F4C  # "POOL"
# Failure messages each host contributes to the batch's gathered ones (RewardBatch keeps the first 10).
_GATHERED_ERRORS = 10


def _batch_order(names: Sequence[str]) -> Callable[[str], tuple[int, int]]:
  """The sort key of a ``"<source>[<row>]: ..."`` failure message: source order, then batch row (what one
  process's ``CompositeReward.score`` gives)."""

  def key(message: str) -> tuple[int, int]:
    name, _, rest = message.partition("[")
    row = rest.partition("]")[0]
    return (names.index(name) if name in names else len(names), int(row) if row.isdigit() else -1)

  return key


def train_pool(task: Any, data: Any, seed: int) -> list[Any] | None:
  """The prompts RL draws from when ``--train_prompts`` or an epoch order (``--data_order``) asks for a
  finite set: the training file's (its first N), or N distinct problems drawn once from a generated
  task's training stream (seeded by the run's seed, apart from the per-step draws).  None: the task's own
  sampler draws every step.

  Raises:
    ConfigError: naming ``--train_prompts`` when the task has fewer training prompts.
  """
  if data.data_order == "sample" and not data.train_prompts:
    return None
  if hasattr(task, "train_problems"):
    pool = task.train_problems()
    if data.train_prompts > len(pool):
      raise ConfigError(f"--train_prompts={data.train_prompts}: the task has {len(pool)} training prompts")
    return pool[: data.train_prompts or None]
  try:
    return task.sample_distinct(np.random.default_rng([_POOL_TAG, seed]), data.train_prompts)
  except ValueError as e:
    raise ConfigError(f"--train_prompts={data.train_prompts}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Rewards:
  """Host-side rewards of one rollout batch.

  Attributes:
    values: float32 ``[B]`` raw rewards (what is logged): the mixed reward of the sources.
    correct: bool ``[B]``, the verifier's verdict.
    truncated: bool ``[B]``, the completion hit the length limit (read from the sampler once, for the
      reward and the experience alike).
    texts: the decoded completions.
    metrics: per-component means and failure counts (``reward/...``).
    histograms: per-component raw values (``reward/<name>``), logged as histograms.
    components: per source name, float32 ``[B]`` raw values (NaN where a source does not apply).
    batch: the composite reward's own batch the metrics came from (None for a stand-in reward).
    raw: float32 ``[B]`` the raw mix (the sources' raw values, weighted, before any normalisation):
      the logged reward.  None: ``values`` is raw already.
  """

  values: np.ndarray
  correct: np.ndarray
  truncated: np.ndarray
  texts: list[str]
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  histograms: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  components: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  batch: RewardBatch | None = None
  raw: np.ndarray | None = None

  @property
  def logged(self) -> np.ndarray:
    """The reward as logged: always the raw mix (``values`` is what trains, normalised if asked)."""
    return self.values if self.raw is None else self.raw


def _select_groups(
  rounds: Sequence[tuple[list[Any], RolloutOutput, Rewards]], picks: Sequence[tuple[int, int]], group_size: int
) -> tuple[list[Any], RolloutOutput, Rewards]:
  """Assembles one batch from groups ``(round, group)`` of several generation rounds.

  The result has the shapes and shardings of one round (prompt columns left-padded to the
  widest round's bucket), so the jitted stages downstream never recompile.  The selection
  runs on the host: the arrays are small and eager device ops would compile per shape.
  """
  P = max(r[1].prompt_tokens.shape[1] for r in rounds)
  first = rounds[0][1]

  def host(rollout: RolloutOutput) -> dict[str, np.ndarray]:
    arrays = multihost.to_host(
      {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout) if f.metadata.get("pytree_node", True)}
    )
    extra = P - arrays["prompt_tokens"].shape[1]
    for name in ("prompt_tokens", "prompt_mask"):
      arrays[name] = np.pad(arrays[name], ((0, 0), (extra, 0)))
    return arrays

  hosts = [host(r[1]) for r in rounds]
  rows = [(r, np.arange(g * group_size, (g + 1) * group_size)) for r, g in picks]
  fields = {name: np.concatenate([hosts[r][name][idx] for r, idx in rows]) for name in hosts[0]}
  fields["prompt_index"] = np.repeat(np.arange(len(picks), dtype=np.int32), group_size)
  widest = next(r[1] for r in rounds if r[1].prompt_tokens.shape[1] == P)

  def place(name: str, x: np.ndarray) -> jax.Array:
    # Back onto the mesh layout the sampler produced (uncommitted if it produced no mesh layout).
    sharding = getattr(widest if name in ("prompt_tokens", "prompt_mask") else first, name).sharding
    return jax.device_put(x, sharding) if isinstance(sharding, NamedSharding) else jnp.asarray(x)

  placed = {name: place(name, x) for name, x in fields.items()}
  rollout = first.replace(**placed)
  problems = [rounds[r][0][g] for r, g in picks]

  def gather(field: str) -> np.ndarray:
    return np.concatenate([getattr(rounds[r][2], field)[g * group_size : (g + 1) * group_size] for r, g in picks])

  texts = [rounds[r][2].texts[g * group_size + i] for r, g in picks for i in range(group_size)]
  components = {
    name: np.concatenate([rounds[r][2].components[name][g * group_size : (g + 1) * group_size] for r, g in picks])
    for name in rounds[0][2].components
  }
  # Component metrics and histograms describe the batch trained on: the selected groups of every round.
  metrics, histograms, batch = rounds[0][2].metrics, rounds[0][2].histograms, None
  if all(isinstance(r[2].batch, RewardBatch) for r in rounds):
    batch = RewardBatch.concatenate(
      [rounds[r][2].batch.select(np.arange(g * group_size, (g + 1) * group_size)) for r, g in picks]
    )
    metrics, histograms = batch.metrics(), batch.histograms()
  raw = gather("raw") if all(r[2].raw is not None for r in rounds) else None
  rewards = Rewards(
    gather("values"), gather("correct"), gather("truncated"), texts, metrics, histograms, components, batch, raw
  )
  return problems, rollout, rewards


def _spans(rows: np.ndarray) -> str:
  """``"0-15, 32-47"``: sorted row indices as contiguous spans."""
  spans, start = [], None
  for i, r in enumerate(rows.tolist()):
    if start is None:
      start = r
    if i + 1 == len(rows) or rows[i + 1] != r + 1:
      spans.append(f"{start}-{r}" if r > start else f"{r}")
      start = None
  return ", ".join(spans)


def _prompt_id(uid: str) -> int:
  """A stable 31-bit id of a prompt (its content hash), for device-side provenance."""
  return zlib.crc32(uid.encode()) & 0x7FFFFFFF


def digest(obj: Any) -> str:
  """A short stable digest of a JSON-able value (configuration and sampling-parameter versions)."""
  return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
  """One step's rollout: the Experience for the learner and what the host keeps beside it.

  Attributes:
    experience: the device/host arrays the learner consumes.
    problems: the prompts' problems, one per group.
    rollout: the sampler's output (lengths and finish reasons are logged).
    rewards: host-side rewards, texts and reward metrics.
    stats: rollout metrics (reward time, truncated prompts, dynamic-sampling and curriculum counts).
    temperature: the sampling temperature used.
    policy_version: the learner version (RL steps trained) whose weights generated it.
  """

  experience: Experience
  problems: list[Any]
  rollout: RolloutOutput
  rewards: Rewards
  stats: dict[str, float]
  temperature: float
  policy_version: int


class RolloutWorker:
  """Turns (the sampler's current weights, this step's prompts) into one :class:`RolloutBatch`.

  Args:
    cfg: the run configuration (rollout, data and algorithm settings are read).
    task: the task (prompts, verifier, held-out split).
    tokenizer: the run's tokenizer.
    sampler: the generator (:class:`~mimo_jax.rollout.Sampler`, or a scripted stand-in in tests).
    rewarder: the composite reward (``build_task_reward``).
    key: the generation key stream's starting key.
    pool: the finite prompt set of :func:`train_pool`, when the caller has it already (None: made here).
  """

  def __init__(
    self,
    cfg: Config,
    task: Any,
    tokenizer: Any,
    sampler: Any,
    rewarder: Any,
    key: jax.Array,
    *,
    pool: list[Any] | None = None,
  ):
    self.cfg = cfg
    self.task = task
    self.tokenizer = tokenizer
    self.sampler = sampler
    self.rewarder = rewarder
    self.buckets = cfg.rollout.buckets
    self.rows = cfg.data.prompts_per_step
    # Called once, with the padded prompt length, just before the next generate call (then cleared):
    # the first moment the rollout's shapes are known (the trainer compiles its learner from here on).
    self.on_prompt_length: Callable[[int], None] | None = None
    self.sampling = sampling_params(cfg.rollout, tokenizer)
    self.sampling_version = digest([dataclasses.asdict(self.sampling), dataclasses.asdict(cfg.rollout)])
    # Host state only: the key as its raw data (a device array held by a Python object would be
    # state outside every pytree), the data RNG, the curriculum, the batch records.
    self.key_data = np.asarray(jax.random.key_data(key))
    self.data_rng = np.random.default_rng(cfg.run.seed)
    self.prompt_sampler = self._prompt_sampler() if cfg.data.curriculum or cfg.data.is_mixture else None
    self.train_pool = pool if pool is not None else train_pool(task, cfg.data, cfg.run.seed)
    self.prompt_stream = None
    # The batch id from which a fixed prompt order is shuffled every epoch (a reward-jitter alarm's
    # intervention; None: never).  Set by the trainer; applied when that batch is made.
    self.reshuffle_at: int | None = None
    if cfg.data.data_order != "sample":
      shuffle = cfg.data.data_order == "shuffle"
      self.prompt_stream = PromptStream(len(self.train_pool), cfg.run.seed, shuffle=shuffle)
    self.batches: collections.deque[dict[str, Any]] = collections.deque(maxlen=_BATCH_RECORDS)
    self._rows_announced = False

  def _prompt_sampler(self) -> PromptSampler:
    """The prompt pool: with ``--curriculum``, weighted toward the pass-rate band (a pool refreshed 10% a
    step); for a task mixture, stratified by (task, level) (without the curriculum the pool is drawn
    afresh every step, so only the proportions differ from plain sampling)."""
    data = self.cfg.data
    strata = self.task.strata() if data.is_mixture else None
    if hasattr(self.task, "problem_from_dict"):
      factory = self.task.problem_from_dict
    else:
      cls = type(self.task.sample(np.random.default_rng(0), 1)[0])
      factory = lambda fields: cls(**fields)  # noqa: E731
    if data.curriculum:
      band = data.curriculum_band
      return PromptSampler(
        self.task.sample,
        pool_size=data.curriculum_pool,
        curriculum=PassRateCurriculum(target_band=(band[0], band[1])),
        strata=strata,
        heldout_uids={p.uid for p in self.task.heldout()},
        dedup_window=1,
        refresh_fraction=0.1,
        problem_factory=factory,
      )
    return PromptSampler(
      self.task.sample,
      pool_size=4 * self.rows,
      strata=strata,
      heldout_uids={p.uid for p in self.task.heldout()},
      refresh_fraction=1.0,
      problem_factory=factory,
    )

  # ---- weights in, batches out ---------------------------------------------------------------

  def update_params(self, params: Any) -> None:
    """The only way weights reach the rollout side (the learner's new policy after each update)."""
    self.sampler.update_params(params)

  def produce(self, step: int, policy_version: int) -> RolloutBatch:
    """Generates, rewards and packs RL step ``step``'s batch from the sampler's current weights.

    Args:
      step: the RL step that will train on the batch (its batch id).
      policy_version: the learner version (RL steps trained) of the sampler's current weights.
    """
    t0 = time.perf_counter()
    if self.reshuffle_at is not None and step >= self.reshuffle_at:
      self.reshuffle()  # no-op once shuffled
    temperature = self.temperature(step)
    problems, rollout, rewards, stats = self.rollout_batch(temperature)
    exp = self.experience(problems, rollout, rewards, batch_id=step, policy_version=policy_version)
    jax.block_until_ready(exp)
    stats["time_produce_s"] = time.perf_counter() - t0
    self.batches.append(
      {
        "batch_id": step,
        "policy_version": policy_version,
        "sampling_params_version": self.sampling_version,
        "status": "consumed",
        "num_rows": int(rewards.values.shape[0]),
        "temperature": float(temperature),
      }
    )
    return RolloutBatch(exp, problems, rollout, rewards, stats, temperature, policy_version)

  def temperature(self, step: int) -> float:
    """The sampling temperature of RL step ``step`` (linear from ``--temperature`` to ``--temperature_final``)."""
    r = self.cfg.rollout
    if r.temperature_final < 0 or self.cfg.run.max_steps <= 1:
      return r.temperature
    frac = step / (self.cfg.run.max_steps - 1)
    return r.temperature + frac * (r.temperature_final - r.temperature)

  def sample_problems(self) -> list[Any]:
    """This step's training prompts (from the curriculum's pool when on)."""
    if self.prompt_sampler is not None:
      return self.prompt_sampler.sample(self.data_rng, self.rows)
    if self.prompt_stream is not None:
      return [self.train_pool[i] for i in self.prompt_stream.next(self.rows)]
    if self.train_pool is not None:
      return [self.train_pool[i] for i in self.data_rng.integers(len(self.train_pool), size=self.rows).tolist()]
    return self.task.sample(self.data_rng, self.rows)

  def reshuffle(self) -> bool:
    """A fixed prompt order (``--data_order=sequential``) becomes a fresh order every epoch, from the next
    batch on (a reward-jitter alarm's intervention).  False when there is no fixed order to break."""
    if self.prompt_stream is None or self.prompt_stream.shuffle:
      return False
    self.prompt_stream.reshuffle()
    return True

  def reward(self, problems, rollout: RolloutOutput) -> Rewards:
    """Decodes the completions and scores them with the task's composite reward (host)."""
    G = self.cfg.rollout.num_samples
    truncated = multihost.to_host(rollout.finish_reason) == FINISH_LENGTH
    if multihost.multi_process():
      texts, batch = self._reward_own_rows(problems, rollout, truncated)
    else:
      texts = decode_completions(self.tokenizer, rollout)
      batch = self.rewarder(reward_samples(problems, texts, G, truncated))
    correct = (batch.components["correct"] > 0) & ~batch.failed["correct"]
    values = np.asarray(batch.rewards, np.float32)
    raw = None if batch.raw_rewards is None else np.asarray(batch.raw_rewards, np.float32)
    return Rewards(values, correct, truncated, texts, batch.metrics(), batch.histograms(), batch.components, batch, raw)

  def _reward_own_rows(self, problems, rollout: RolloutOutput, truncated: np.ndarray):
    """A multi-process run's rewards: this host decodes and scores only the rows on its devices; the raw
    components of all hosts' rows are gathered and mixed on every host (the same global batch, so the
    normaliser's statistics and every metric are the global ones).  Texts of other hosts' rows are None.

    Collective sources (a reward model, a judge: one program over every host's devices) are the
    exception: every host decodes the whole batch (once; its own rows' texts are taken from it) and calls
    them with it after the gather, so all hosts run those programs on the same inputs, in the same order,
    and get the same values."""
    G = self.cfg.rollout.num_samples
    B = int(truncated.shape[0])
    rows = multihost.local_rows(rollout.completion_tokens)
    if not self._rows_announced:
      self._rows_announced = True
      print(
        f"process {jax.process_index()} of {jax.process_count()}: decodes and scores {len(rows)} of the {B} "
        f"rollout rows (rows {_spans(rows)}), the ones on its devices",
        flush=True,
      )
    collective = [s.name for s in self.rewarder.sources if s.collective]
    if collective:  # they take every row's text: the whole batch is decoded once, this host's rows from it
      every = decode_completions(self.tokenizer, rollout)
      own = [every[r] for r in rows.tolist()]
    else:
      own = decode_completions(self.tokenizer, rollout, rows)
    names = [n for n in self.rewarder.names if n not in collective]
    samples = reward_samples(problems, own, G, truncated, rows.tolist())
    raw, failed, errors = self.rewarder.score(samples, names, rows=rows.tolist())
    full = multihost.gather_rows(B, rows, [raw[n] for n in names] + [failed[n] for n in names])
    raw, failed = dict(zip(names, full[: len(names)], strict=True)), dict(zip(names, full[len(names) :], strict=True))
    if multihost.multi_process() and any(f.any() for f in failed.values()):
      # Every host's first failure messages (``score`` gives them in source and row order), so that the
      # report names the failing rows of the whole batch, whichever host scored them; in that order.
      errors = sorted(multihost.gather_texts(errors[:_GATHERED_ERRORS]), key=_batch_order(names))
    if collective:
      more_raw, more_failed, more_errors = self.rewarder.score(
        reward_samples(problems, every, G, truncated), collective
      )
      raw.update({n: more_raw[n] for n in collective})
      failed.update({n: more_failed[n] for n in collective})
      errors = [*errors, *more_errors]
    batch = self.rewarder.mix(raw, failed, [problems[i // G].task for i in range(B)], errors)
    texts: list[str | None] = [None] * B
    for j, r in enumerate(rows.tolist()):
      texts[r] = own[j]
    return texts, batch

  def next_key(self) -> jax.Array:
    """The next key of the run's loop stream (generation and evaluation draw from it in turn)."""
    key, gen_key = jax.random.split(jax.random.wrap_key_data(self.key_data))
    self.key_data = np.asarray(jax.random.key_data(key))
    return gen_key

  def _generate(self, temperature: float) -> tuple[list[Any], RolloutOutput, int]:
    """Samples a batch of prompts and generates ``num_samples`` completions for each."""
    problems = self.sample_problems()
    tokens, mask, truncated = encode_prompts(self.tokenizer, [p.prompt for p in problems], self.buckets)
    if self.on_prompt_length is not None:
      hook, self.on_prompt_length = self.on_prompt_length, None
      hook(int(tokens.shape[1]))
    rollout = self.sampler.generate(
      tokens,
      mask,
      num_samples=self.cfg.rollout.num_samples,
      max_len=self.cfg.rollout.max_new_tokens,
      sampling=self.sampling,
      temperature=temperature,
      key=self.next_key(),
    )
    return problems, rollout, truncated

  def rollout_batch(self, temperature: float) -> tuple[list[Any], RolloutOutput, Rewards, dict[str, float]]:
    """Generate and reward one batch; with dynamic sampling, refill groups whose rewards are all equal.

    Dynamic sampling (DAPO) generates extra rounds of fresh prompts (each a full,
    static-shape batch), keeps the first ``prompts_per_step`` groups with a reward spread,
    and fills any shortfall after ``dynamic_sampling_max_rounds`` extra rounds with the
    earliest all-equal groups (their advantages are zero; ``ds_filled_groups`` counts them).
    """
    G = self.cfg.rollout.num_samples
    rounds: list[tuple[list[Any], RolloutOutput, Rewards]] = []
    stats = {"prompt_truncated": 0, "time_reward_s": 0.0}
    if self.prompt_sampler is not None:
      stats.update({f"curriculum/{k}": v for k, v in self.prompt_sampler.pass_rate_metrics().items()})
    keep: list[tuple[int, int]] = []  # (round, group) with a reward spread
    fill: list[tuple[int, int]] = []  # (round, group) all equal
    max_rounds = 1 + (self.cfg.algo.dynamic_sampling_max_rounds if self.cfg.algo.dynamic_sampling else 0)
    while len(rounds) < max_rounds:
      problems, rollout, truncated = self._generate(temperature)
      jax.block_until_ready(rollout)
      t_reward = time.perf_counter()
      rewards = self.reward(problems, rollout)
      if self.prompt_sampler is not None:
        self.prompt_sampler.observe(problems, rewards.correct.reshape(-1, G).mean(axis=1).tolist())
      stats["time_reward_s"] += time.perf_counter() - t_reward
      stats["prompt_truncated"] += truncated
      r = len(rounds)
      rounds.append((problems, rollout, rewards))
      groups = rewards.values.reshape(-1, G)
      for g, row in enumerate(groups):
        (fill if np.all(row == row[0]) else keep).append((r, g))
      if not self.cfg.algo.dynamic_sampling or len(keep) >= self.rows:
        break
    if len(rounds) == 1:
      problems, rollout, rewards = rounds[0]
      return problems, rollout, rewards, stats
    picks = (keep + fill)[: self.rows]
    stats.update(
      ds_rounds=len(rounds),
      ds_filled_groups=len(set(picks) & set(fill)),
      ds_kept_frac_first_round=sum(1 for r, _ in keep if r == 0) / self.rows,
    )
    return (*_select_groups(rounds, picks, G), stats)

  def experience(self, problems, rollout: RolloutOutput, rewards: Rewards, *, batch_id: int, policy_version: int):
    """The :class:`Experience` of one rollout batch: the sampler's arrays (on the mesh) and the host's
    rewards and provenance (small, moved once)."""
    B = rewards.values.shape[0]
    G = self.cfg.rollout.num_samples
    prompt_ids = np.repeat(np.asarray([_prompt_id(p.uid) for p in problems], np.int32), G)
    return Experience(
      prompt_tokens=rollout.prompt_tokens,
      prompt_mask=rollout.prompt_mask,
      completion_tokens=rollout.completion_tokens,
      completion_mask=rollout.completion_mask,
      lengths=rollout.lengths,
      # The host's flags the reward read (an eager device comparison would compile a program of its own
      # at the first step, beside the learner's compilation).
      truncated=rewards.truncated,
      rewards=np.asarray(rewards.values, np.float32),
      reward_components={k: np.asarray(v, np.float32) for k, v in sorted(rewards.components.items())},
      logprobs=rollout.logprobs,
      sampler_logprobs=rollout.sampler_logprobs,
      temperature=rollout.temperature,
      top_k=np.full((B,), rollout.top_k, np.int32),
      top_p=np.full((B,), rollout.top_p, np.float32),
      policy_version=np.full((B,), policy_version, np.int32),
      prompt_id=prompt_ids[:B],
      batch_id=np.full((B,), batch_id, np.int32),
    )

  # ---- checkpointed host state ----------------------------------------------------------------

  def host_state(self, *, with_data: bool) -> dict[str, Any]:
    """What a checkpoint keeps of the rollout side (the key travels in the array tree, the rest in the metadata)."""
    return {
      "loop_key": self.key_data,
      "data_rng": json.loads(json.dumps(self.data_rng.bit_generator.state)) if with_data else {},
      "prompt_sampler": self.prompt_sampler.state_dict() if self.prompt_sampler and with_data else None,
      "prompt_stream": self.prompt_stream.state_dict() if self.prompt_stream and with_data else None,
      "reward": self.rewarder.state_dict() if with_data else None,
      "batches": list(self.batches) if with_data else [],
    }

  def load_host_state(
    self, *, loop_key=None, data_rng=None, prompt_sampler=None, prompt_stream=None, reward=None, batches=None
  ) -> None:
    """Restores what :meth:`host_state` saved (fields left None are kept)."""
    if loop_key is not None:
      self.key_data = np.asarray(loop_key)
    if data_rng:
      self.data_rng.bit_generator.state = data_rng
    if self.prompt_sampler is not None and prompt_sampler:
      self.prompt_sampler.load_state_dict(prompt_sampler)
    if self.prompt_stream is not None and prompt_stream:
      self.prompt_stream.load_state_dict(prompt_stream)
    if reward:
      self.rewarder.load_state_dict(reward)
    if batches is not None:
      self.batches.clear()
      self.batches.extend(batches)
