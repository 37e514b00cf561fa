"""Token sampling: temperature, top-k, top-p (nucleus), greedy.

Pure functions of arrays.  Two log-probabilities come back for every sampled token:

- ``logprob``: under the policy at the sampling temperature, ``log_softmax(logits / T)``
  (``T = 1`` for greedy).  This is the distribution the trainer recomputes and
  optimises; a temperature mismatch here silently biases the importance ratio.
- ``sampler_logprob``: under the distribution actually sampled from, i.e. after the
  vocabulary limit, top-k / top-p truncation and renormalisation (0 for greedy, which is
  deterministic).  Equal to ``logprob`` when no truncation is active.

Vocabulary policy: a model's embedding table is often padded past its tokenizer's
vocabulary (to a multiple of 64 or 128, or a checkpoint shared by several tokenizers).
Ids at or above ``vocab_limit`` (the tokenizer's size) have no text; they are never
sampled, not even by greedy decoding: their logits are set to ``-inf`` before the argmax,
top-k/top-p and the draw.  ``logprob`` stays the full-vocabulary policy the trainer
recomputes (the masked ids only lower it by their share of the probability mass).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mimo_jax.config_base import check


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings of one generate call (hashable: a jit static argument).

  Attributes:
    top_k: keep the k most likely tokens (0: off).
    top_p: keep the smallest set of tokens whose mass reaches top_p (1: off).
    stop_ids: tokens that end a completion (kept in the completion).
    pad_id: the token written after a completion ends.
    vocab_limit: only ids ``< vocab_limit`` are ever sampled, normally the tokenizer's
      ``vocab_size`` when the model's vocabulary is larger (0: no limit; a limit at or
      above the model's vocabulary changes nothing).
  """

  top_k: int = 0
  top_p: float = 1.0
  stop_ids: tuple[int, ...] = ()
  pad_id: int = 0
  vocab_limit: int = 0

  def __post_init__(self):
    check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0")
    check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
    check(self.vocab_limit >= 0, "vocab_limit", self.vocab_limit, "must be >= 0 (0: no limit)")
    object.__setattr__(self, "stop_ids", tuple(int(s) for s in self.stop_ids))
    object.__setattr__(self, "vocab_limit", int(self.vocab_limit))
    if self.vocab_limit:
      for name, ids in (("stop_ids", self.stop_ids), ("pad_id", (int(self.pad_id),))):
        bad = [i for i in ids if not 0 <= i < self.vocab_limit]
        check(not bad, name, bad, f"must be ids below vocab_limit={self.vocab_limit}")


def limit_vocab(logits_bv: jax.Array, vocab_limit: int) -> jax.Array:
  """Sets the logits of ids ``>= vocab_limit`` to ``-inf`` (static limit; 0 or >= V: unchanged)."""
  V = logits_bv.shape[-1]
  if vocab_limit <= 0 or vocab_limit >= V:
    return logits_bv
  valid = jnp.arange(V, dtype=jnp.int32) < vocab_limit
  return jnp.where(valid, logits_bv, -jnp.inf)


def truncate_logits(logits_bv: jax.Array, *, top_k: int, top_p: float) -> jax.Array:
  """Sets logits outside the top-k / top-p set to ``-inf`` (float32 ``[B, V]``).

  Ties at the boundary are kept (the set may be slightly larger than k).
  """
  x = logits_bv.astype(jnp.float32)
  if top_k <= 0 and top_p >= 1.0:
    return x
  if top_k > 0:
    # [B, k], sorted descending: enough for both filters.
    cand = jax.lax.top_k(x, min(top_k, x.shape[-1]))[0]
  else:
    cand = -jnp.sort(-x, axis=-1)
  threshold = cand[:, -1:]
  if top_p < 1.0:
    probs = jax.nn.softmax(cand, axis=-1)
    # Keep a token if the mass strictly before it is below top_p (the first always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(cand, num_kept - 1, axis=-1)
  return jnp.where(x < threshold, -jnp.inf, x)


def sample_tokens(
  logits_bv: jax.Array,
  keys_b: jax.Array,
  temperature_b: jax.Array,
  *,
  top_k: int = 0,
  top_p: float = 1.0,
  vocab_limit: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Samples one token per row.

  Args:
    logits_bv: ``[B, V]`` raw logits (any float dtype; computed in float32).
    keys_b: ``[B]`` PRNG keys, one per row.
    temperature_b: ``[B]`` float32; ``<= 0`` means greedy for that row.
    top_k: static top-k (0: off).
    top_p: static nucleus mass (1: off).
    vocab_limit: static; ids ``>= vocab_limit`` are never chosen, greedy included (0: off).

  Returns:
    ``(tokens [B] int32, logprob [B] f32, sampler_logprob [B] f32)`` (see module doc).
  """
  logits = logits_bv.astype(jnp.float32)
  greedy = temperature_b <= 0
  temp = jnp.where(greedy, 1.0, temperature_b).astype(jnp.float32)
  scaled = logits / temp[:, None]
  allowed = limit_vocab(scaled, vocab_limit)
  truncated = truncate_logits(allowed, top_k=top_k, top_p=top_p)

  # Only the kind of choice some row needs runs: all-greedy batches (evaluation) skip the random
  # draw, all-sampled ones (a rollout) the argmax.
  def pick_greedy():
    return first_argmax(limit_vocab(logits, vocab_limit))

  def draw():
    return _inverse_cdf_sample(keys_b, truncated)

  def both():
    return jnp.where(greedy, pick_greedy(), draw())

  # One count, so one cross-device reduction where the rows are sharded.
  num_greedy = jnp.sum(greedy.astype(jnp.int32))
  which = jnp.where(num_greedy == greedy.shape[0], 0, jnp.where(num_greedy > 0, 2, 1))
  tokens = jax.lax.switch(which, (pick_greedy, draw, both)).astype(jnp.int32)
  logprob = log_softmax_at(scaled, tokens)
  # Without a vocabulary limit, top-k or top-p the sampled distribution is the policy's.
  untouched = top_k <= 0 and top_p >= 1.0 and not 0 < vocab_limit < logits.shape[-1]
  sampler_logp = logprob if untouched else log_softmax_at(truncated, tokens)
  return tokens, logprob, jnp.where(greedy, 0.0, sampler_logp)


def first_argmax(x_bv: jax.Array) -> jax.Array:
  """``jnp.argmax(x, axis=-1)`` as a max and a min over the matching indices (``[B]`` int32).

  The same ids as ``argmax`` (the first maximum; the first NaN in a row with one), at about a
  third of the cost on CPU, where XLA's argmax is one reduction over (value, index) pairs.
  """
  V = x_bv.shape[-1]
  best = jnp.max(x_bv, axis=-1, keepdims=True)
  ids = jax.lax.broadcasted_iota(jnp.int32, x_bv.shape, x_bv.ndim - 1)
  return jnp.min(jnp.where((x_bv == best) | jnp.isnan(x_bv), ids, V), axis=-1)


def log_softmax_at(x_bv: jax.Array, ids_b: jax.Array) -> jax.Array:
  """``log_softmax(x)[b, ids[b]]`` without writing the ``[B, V]`` log-probabilities.

  The same operations as ``jax.nn.log_softmax`` (shift by the max, then subtract the log of the
  shifted sum): the same values, up to the order in which XLA sums a row.
  """
  best = jnp.max(x_bv, axis=-1, keepdims=True)
  shifted = x_bv - best
  at = jnp.take_along_axis(shifted, ids_b[:, None], axis=-1)[:, 0]
  return at - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))


def _inverse_cdf_sample(keys_b: jax.Array, logits_bv: jax.Array) -> jax.Array:
  """One categorical draw per row from ``softmax(logits)`` by inverting the CDF.

  One uniform number per row instead of the V Gumbel numbers of ``jax.random.categorical``:
  at V = 32k the Gumbel noise costs about as much as the decode step's matmuls on CPU.
  The token is the first one of nonzero probability whose ``cdf`` reaches ``u * cdf[-1]`` (the last
  such token where rounding leaves none), so a token with zero probability (a truncated one) is never
  drawn.  Counting the entries below the threshold instead is only right on a CDF that never falls
  and is flat across such tokens: XLA:CPU sums each prefix on its own (a reduce-window), which wobbles
  by a last bit either way, and a ``u`` of exactly 0 counted nothing (token 0, whatever its
  probability).  A row with no token of nonzero probability (NaN logits) gives token 0.
  """
  u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_b)
  return _invert_cdf(u, logits_bv)


def _invert_cdf(u_b: jax.Array, logits_bv: jax.Array) -> jax.Array:
  """The token of :func:`_inverse_cdf_sample` for uniforms ``u_b`` (``logits_bv``: ``[B, V]`` or one
  row, ``[1, V]``, for all of them)."""
  probs = jax.nn.softmax(logits_bv, axis=-1)
  cdf = jnp.cumsum(probs, axis=-1)
  threshold = u_b * cdf[:, -1]
  V = logits_bv.shape[-1]
  ids = jax.lax.broadcasted_iota(jnp.int32, logits_bv.shape, 1)
  # One reduction: a kept token that reaches the threshold ranks by its id (the first wins), one that
  # does not by 2V - 1 - id (the last wins, where none reaches it), a removed one at 2V.
  rank = jnp.where(probs > 0, jnp.where(cdf >= threshold[:, None], ids, 2 * V - 1 - ids), 2 * V)
  best = jnp.min(rank, axis=-1)
  return jnp.where(best < V, best, jnp.where(best < 2 * V, 2 * V - 1 - best, 0)).astype(jnp.int32)


def row_keys(key: jax.Array, batch: int) -> jax.Array:
  """One key per row, derived from one key by the row index (independent of sharding)."""
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch, dtype=jnp.uint32))
