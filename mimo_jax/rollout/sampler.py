"""Jitted KV-cache generation on the mesh: prefill once per prompt, fan out, decode.

One ``generate`` call is one jitted function of ``(params, prompts, temperatures, key)``:

1. **Prefill** the ``Np`` left-padded prompts ``[Np, P]`` once (attention over the
   prompt's own tokens).
2. **Fan out** to ``G`` samples per prompt (``M`` = the static completion buffer;
   ``B = Np * G`` rows, the samples of a prompt contiguous): the last-position logits, and
   a cache of ``M`` slots per row after the prompt's keys and values, which its ``G`` rows
   share (one copy per prompt, ``share_prompt_cache``; otherwise ``P + M`` slots per row,
   the prompt copied into each).
3. **Decode** in a ``lax.while_loop`` over a fixed ``[B, M]`` token buffer with a
   ``done`` mask; the loop exits early once every row has stopped.  The first token
   comes from the prefill's logits, so no forward runs after the last token.  By
   default the loop carries one cache buffer per layer and reads per-layer weights
   sliced once before it (``unrolled_decode``): a step then writes its cache slots in
   place and copies no weights, at the price of a decode program that grows with depth.
   With ``keep_layer_copy`` that per-layer copy is made once per set of weights, outside
   the call, and the prefill runs on it too: a call on unchanged weights copies none.

Shapes are static per (prompt bucket ``P``, ``Np``, ``G``, ``M``): after warm-up, a new
batch in a seen bucket compiles nothing.  Parameters are the live training state
(``update_params`` swaps the reference, no copy); the KV cache is laid out by the
generation rules (batch over data/fsdp, KV heads over tensor).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from mimo_jax import sharding, xla_defaults
from mimo_jax.kernels import cpu_rows
from mimo_jax.models.logprobs import completion_logprobs
from mimo_jax.models.transformer import (
  K_CACHE_LOGICAL_AXES,
  V_CACHE_LOGICAL_AXES,
  KVCache,
  Transformer,
  positions_from_mask,
)
from mimo_jax.rollout.sampling import SamplingParams, row_keys, sample_tokens

FINISH_STOP = 0
FINISH_LENGTH = 1

# Rows per batch shard (inclusive range) for which a CPU decode step fuses its q|k|v and gate|up
# products (:meth:`Sampler.fuses_projections`).
FUSED_DECODE_ROWS = (8, 16)
# Rows per batch shard (inclusive range) for which a CPU generate program takes YNNPACK's products
# instead of the process's Eigen ones (:meth:`Sampler.uses_ynn_dots`).
YNN_DECODE_ROWS = (32, 64)
# Rows per decode step whose products run on mimo_jax.kernels.cpu_rows on CPU (one device):
# BUILD_NOTES, "A decode step's products on both cores".
CPU_ROWS_DECODE_ROWS = (1, 32)


@flax.struct.dataclass
class RolloutOutput:
  """The result of one generate call; ``B = num_prompts * num_samples`` rows.

  Attributes:
    prompt_tokens: int32 ``[B, P]``, left-padded prompt of each row.
    prompt_mask: bool ``[B, P]``.
    completion_tokens: int32 ``[B, M]``, right-padded with ``pad_id``.
    completion_mask: bool ``[B, M]``, True for generated tokens (the stop token included).
    lengths: int32 ``[B]``, completion lengths.
    finish_reason: int32 ``[B]``, ``FINISH_STOP`` (a stop id was produced) or ``FINISH_LENGTH``.
    logprobs: float32 ``[B, M]``, ``log softmax(logits / T)`` of each sampled token under
      the policy at the row's temperature (``T = 1`` for greedy rows); 0 where masked.
    sampler_logprobs: float32 ``[B, M]``, the same under the truncated (top-k/top-p)
      distribution actually sampled from.
    temperature: float32 ``[B]``, the sampling temperature of each row (0 = greedy).
    prompt_index: int32 ``[B]``, which input prompt each row came from.
    top_k: static, the top-k used.
    top_p: static, the top-p used.
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completion_tokens: jax.Array
  completion_mask: jax.Array
  lengths: jax.Array
  finish_reason: jax.Array
  logprobs: jax.Array
  sampler_logprobs: jax.Array
  temperature: jax.Array
  prompt_index: jax.Array
  top_k: int = flax.struct.field(pytree_node=False, default=0)
  top_p: float = flax.struct.field(pytree_node=False, default=1.0)

  def take(self, n: int) -> RolloutOutput:
    """The first ``n`` rows (drops padding rows added to fill a batch bucket)."""
    return jax.tree.map(lambda x: x[:n], self)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= ``length``; ValueError naming the buckets otherwise."""
  for b in sorted(buckets):
    if length <= b:
      return b
  raise ValueError(f"prompt of {length} tokens is longer than the largest prompt bucket {max(buckets)}")


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists to ``[len(prompts), length]`` (tokens, mask)."""
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    if len(p) > length:
      raise ValueError(f"prompt {i} has {len(p)} tokens, more than the bucket length {length}")
    tokens[i, length - len(p) :] = p
    mask[i, length - len(p) :] = True
  return tokens, mask


class Sampler:
  """Generation over a model's live parameters on one mesh.

  The rollout interface: :meth:`generate`, :meth:`per_token_logps`, :meth:`update_params`.
  """

  def __init__(
    self,
    model: Transformer,
    *,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.GENERATE_RULES,
    cache_dtype: str | None = None,
    unrolled_decode: bool = True,
    keep_layer_copy: bool = False,
    share_prompt_cache: bool = True,
    fuse_projections: bool | None = None,
    ynn_dots: bool | None = None,
    cpu_rows_products: bool | None = None,
  ):
    """Args:
    model: the policy; its parameters are read, never copied outside a generate call.
    mesh: the mesh the parameters live on (None: one device, no constraints).
    rules: logical-axis rules for activations and the KV cache.
    cache_dtype: KV cache dtype (default: the model's compute dtype).
    unrolled_decode: decode with per-layer caches and per-layer weights, the layers
      unrolled (one transient copy of the layer weights per generate call, and a decode
      program that grows with depth); False: the scanned stack, which slices each
      layer's weights and cache out of the stacks at every step and needs no copy.
      Read when a shape is first compiled.
    keep_layer_copy: make the per-layer copy of the layer weights once per set of
      parameters, outside the generate program, and keep it between calls (the prefill
      then also runs on it, unrolled): calls with unchanged weights (serving, evaluation)
      copy and slice no weight, at the price of one more copy of the layer weights held
      while the parameters stay unchanged.  Calls that fuse their projections
      (:meth:`fuses_projections`) also keep each layer's concatenated q|k|v and gate|up
      weights, made at the first such call (on CPU, :data:`FUSED_DECODE_ROWS` rows per batch shard:
      a second copy of those weights, which a call would otherwise build every time); calls whose
      decode runs on :mod:`~mimo_jax.kernels.cpu_rows` (:meth:`uses_cpu_rows`) keep every layer
      weight and the unembedding packed for it instead (:meth:`Transformer.decode_weights`).  Off in
      training, where the weights change every step and the copy would be held through the
      update.  Needs ``unrolled_decode``.
    share_prompt_cache: keep a prompt's keys and values once for its ``num_samples`` rows
      instead of once per row (:meth:`KVCache.from_prompt` with ``share_prompt``): the
      decode steps read the prompt once per group, and its cache takes ``1 / num_samples``
      of the memory.  The same tokens and log-probs up to the order of float sums.  Used
      when ``num_samples > 1`` and the prompts split evenly over the batch shards (see
      :meth:`shares_prompt_cache`).
    fuse_projections: in the unrolled decode, compute q|k|v and gate|up each as one product
      of the step's rows with the weights side by side (XLA concatenates them once per call).
      None (default): on CPU when a batch shard holds :data:`FUSED_DECODE_ROWS` rows and the
      weights' feature axes are not split over devices (see :meth:`fuses_projections`);
      True / False: always / never (with ``unrolled_decode``).
    ynn_dots: compile the generate program with YNNPACK's matrix products on CPU
      (:func:`xla_defaults.ynn_dots_compiler_options`) instead of the process's Eigen ones.
      None (default): in the unrolled decode when a batch shard holds :data:`YNN_DECODE_ROWS`
      rows (see :meth:`uses_ynn_dots`); True / False: always / never where the process's
      choice allows it (never when ``MIMO_JAX_CPU_DOTS`` is set or ``XLA_FLAGS`` names the option).
    cpu_rows_products: run the decode step's matrix products on :mod:`mimo_jax.kernels.cpu_rows`
      (the weights packed once per call, split over all cores without a thread hand-off's delay).
      None (default): on CPU with one device, the unrolled decode and :data:`CPU_ROWS_DECODE_ROWS`
      rows, where the library builds (see :meth:`uses_cpu_rows`); False: never (and under
      ``fuse_projections=False``); True: wherever it can run (one CPU device, the unrolled decode).
      The weights are packed once per call before the decode loop (:meth:`Transformer.decode_weights`),
      or kept packed with ``keep_layer_copy``.
    """
    if keep_layer_copy and not unrolled_decode:
      raise ValueError("keep_layer_copy=True needs unrolled_decode=True (the scanned decode reads the stacked weights)")
    if cpu_rows_products and fuse_projections is False:
      raise ValueError(
        "cpu_rows_products=True needs fuse_projections=None or True (its packed weights are q|k|v and gate|up side by side)"
      )
    self.config = model.config
    self.mesh = mesh
    self.rules = rules
    self.cache_dtype = cache_dtype
    self.unrolled_decode = unrolled_decode
    self.keep_layer_copy = keep_layer_copy
    self.share_prompt_cache = share_prompt_cache
    self.fuse_projections = fuse_projections
    self.ynn_dots = ynn_dots
    self.cpu_rows_products = cpu_rows_products
    self._graphdef, self._state = nnx.split(model)
    # (the parameter leaves it was made from, the per-layer weights); None until needed.
    self._layer_copy: tuple[list, tuple[nnx.State, ...]] | None = None
    # The weights kept for calls that fuse their projections, made from the kept copy when first
    # needed and dropped with it.  Under True (a decode on cpu_rows): Transformer.decode_weights, the
    # layers' and the unembedding's weights packed; under False: each layer's concatenated q|k|v and
    # gate|up weights (Decoder.fused_projection_weights), and None.
    self._fused_copy: dict[bool, tuple] = {}
    # One jitted generate per set of compiler options (see generate_program).
    self._generate_programs: dict[tuple, Callable] = {}
    self._split_layers = jax.jit(lambda state: nnx.merge(self._graphdef, state).decoder.layer_states())
    self._fuse_layers = jax.jit(
      lambda state, layers: nnx.merge(self._graphdef, state).decoder.fused_projection_weights(layers)
    )
    self._pack_layers = jax.jit(lambda state, layers: nnx.merge(self._graphdef, state).decode_weights(layers))
    self._logps = jax.jit(self._logps_impl)

  # ------------------------------------------------------------------ params

  def update_params(self, model_or_state: Transformer | nnx.State) -> None:
    """Points the sampler at new parameters (a model or the state half of ``nnx.split``)."""
    if isinstance(model_or_state, nnx.Module):
      _, model_or_state = nnx.split(model_or_state)
    if self._layer_copy is not None:
      made_from, new = self._layer_copy[0], jax.tree.leaves(model_or_state)
      # Arrays are immutable: the same leaves are the same weights.
      if len(made_from) != len(new) or any(a is not b for a, b in zip(made_from, new, strict=True)):
        self._layer_copy = None
        self._fused_copy = {}
    self._state = model_or_state

  def _layers(self) -> tuple[nnx.State, ...] | None:
    """The kept per-layer weights (made now if the parameters changed); None when not kept."""
    if not self.keep_layer_copy:
      return None
    if self._layer_copy is None:
      self._layer_copy = (jax.tree.leaves(self._state), self._split_layers(self._state))
    return self._layer_copy[1]

  def _fused_layers(self, rows: int) -> tuple[tuple | None, cpu_rows.Panels | None]:
    """The kept weights of a call of ``rows`` rows that fuses its projections (made now if needed):
    each layer's concatenated weights and None, or, when its decode runs on
    :mod:`~mimo_jax.kernels.cpu_rows` (:meth:`uses_cpu_rows`), each layer's weights and the
    unembedding packed for it.  (None, None) when the call does not fuse or nothing is kept (the call
    then makes what it needs)."""
    if not self.keep_layer_copy or not self.fuses_projections(rows):
      return None, None
    packed = self.uses_cpu_rows(rows)
    if packed not in self._fused_copy:
      if packed:
        self._fused_copy[packed] = self._pack_layers(self._state, self._layers())
      else:
        self._fused_copy[packed] = (self._fuse_layers(self._state, self._layers()), None)
    return self._fused_copy[packed]

  @property
  def batch_shards(self) -> int:
    """How many ways the batch dimension is split (rows must be a multiple)."""
    if self.mesh is None:
      return 1
    spec = sharding.logical_to_spec(("batch",), self.rules, self.mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return int(np.prod([self.mesh.shape[a] for a in axes]))

  def shares_prompt_cache(self, num_prompts: int, num_samples: int) -> bool:
    """Whether a call with ``num_prompts`` x ``num_samples`` rows keeps each prompt's cache once
    (a group's rows and its prompt then sit on the same batch shard)."""
    return self.share_prompt_cache and num_samples > 1 and num_prompts % self.batch_shards == 0

  def fuses_projections(self, rows: int) -> bool:
    """Whether a decode step over ``rows`` rows computes q|k|v and gate|up as one product each.

    Measured on XLA:CPU (BUILD_NOTES, "One product for q|k|v and one for gate|up in a small decode
    step"): generation 2-8% faster with 8 to 16 rows, 13% slower with 1 and 10% slower with 64
    (Eigen's kernels block the wider product differently).  Weights whose feature axes are split
    over devices are never fused (the concatenation would move them).
    """
    if not self.unrolled_decode:
      return False
    if self.fuse_projections is not None:
      return self.fuse_projections
    if self.uses_cpu_rows(rows):
      return True
    if sharding.mesh_platform(self.mesh) != "cpu" or not self._shard_rows_in(rows, FUSED_DECODE_ROWS):
      return False
    if self.mesh is None:
      return True
    specs = sharding.logical_to_spec(("heads", "kv_heads", "mlp"), self.rules, self.mesh)
    axes = [a for spec in specs if spec is not None for a in ((spec,) if isinstance(spec, str) else spec)]
    return all(self.mesh.shape[a] == 1 for a in axes)

  def uses_cpu_rows(self, rows: int) -> bool:
    """Whether a decode step over ``rows`` rows runs its products on :mod:`mimo_jax.kernels.cpu_rows`.

    Measured on XLA:CPU (BUILD_NOTES, "A decode step's products on both cores").  Only on one CPU
    device (the custom call is not partitioned over a mesh), in the unrolled decode (whose
    weights are loop-invariant, so the packing runs once per call) and with fused projections (the
    packed weights hold q|k|v and gate|up side by side).
    """
    if self.cpu_rows_products is False or not self.unrolled_decode or self.fuse_projections is False:
      return False
    if sharding.mesh_platform(self.mesh) != "cpu" or (self.mesh is not None and self.mesh.size != 1):
      return False
    if jnp.dtype(self.config.dtype) != jnp.float32:
      return False
    if self.cpu_rows_products is None and not self._shard_rows_in(rows, CPU_ROWS_DECODE_ROWS):
      return False
    return cpu_rows.available()

  def uses_ynn_dots(self, rows: int) -> bool:
    """Whether the generate program for calls of ``rows`` rows takes YNNPACK's products.

    Measured on XLA:CPU (BUILD_NOTES, "YNNPACK's products for a decode of 32 to 64 rows"): with 32 to
    64 rows per batch shard whole generate calls took 0.79-0.95x the time on Eigen's products; with
    16 rows (products fused) 1.09x, with 24 and 128 the same.  The learner's programs keep Eigen's.
    """
    return self._compiler_options(rows) is not None

  def _compiler_options(self, rows: int) -> dict | None:
    """The generate program's ``compiler_options`` for calls of ``rows`` rows (None: the process's)."""
    options = xla_defaults.ynn_dots_compiler_options(sharding.mesh_platform(self.mesh))
    if options is None:
      return None
    wanted = (
      self.ynn_dots
      if self.ynn_dots is not None
      else (self.unrolled_decode and self._shard_rows_in(rows, YNN_DECODE_ROWS))
    )
    return options if wanted else None

  def _shard_rows_in(self, rows: int, bounds: tuple[int, int]) -> bool:
    """Whether a batch shard of a ``rows``-row call holds ``bounds[0]`` to ``bounds[1]`` rows (inclusive)."""
    low, high = bounds
    return low <= rows // self.batch_shards <= high

  def generate_program(self, rows: int) -> Callable:
    """The jitted generate function for calls of ``rows`` rows (compiled per shape on first use;
    its compiler options follow :meth:`uses_ynn_dots`)."""
    options = self._compiler_options(rows)
    key = tuple(sorted((options or {}).items()))
    if key not in self._generate_programs:
      self._generate_programs[key] = jax.jit(
        self._generate_impl, static_argnames=("num_samples", "max_len", "sampling"), compiler_options=options
      )
    return self._generate_programs[key]

  def _rules_ctx(self):
    if self.mesh is None:
      return contextlib.nullcontext()
    return sharding.use_rules(self.mesh, self.rules)

  # ------------------------------------------------------------------ jitted bodies

  def _generate_impl(
    self,
    state,
    layers,
    prompt_tokens,
    prompt_mask,
    temperature,
    key,
    max_new_tokens,
    fused_layers=None,
    unembedding=None,
    *,
    num_samples: int,
    max_len: int,
    sampling: SamplingParams,
  ) -> RolloutOutput:
    model = nnx.merge(self._graphdef, state)
    Np, P = prompt_tokens.shape
    G, M = num_samples, max_len
    B = Np * G
    stop_ids = jnp.asarray(sampling.stop_ids or (-1,), jnp.int32)

    with self._rules_ctx():
      # ---- prefill (once per prompt: the scanned stack, whose program does not grow with
      # depth, or unrolled on the kept per-layer weights)
      positions = positions_from_mask(prompt_mask)
      # (a decode's packed weights are not the prefill's: it multiplies many rows)
      packed = unembedding is not None
      prefill_fused = None if packed else fused_layers
      hidden, (k, v) = model.decoder.prefill(prompt_tokens, positions, prompt_mask, layers, prefill_fused)
      # ---- fan out to G samples per prompt: the cache is built fanned out (and, for the
      # unrolled decode, split per layer) in one write per buffer.
      cache = _constrain_cache(
        KVCache.from_prompt(
          k,
          v,
          prompt_mask,
          P + M,
          repeats=G,
          per_layer=self.unrolled_decode,
          dtype=self.cache_dtype or k.dtype,
          share_prompt=self.shares_prompt_cache(Np, G),
        )
      )
      # Unless kept between calls: one copy of the layer weights for the whole call, read in
      # place by every decode step.
      if layers is None and self.unrolled_decode:
        layers = model.decoder.layer_states()
      # A decode on cpu_rows without the kept packed copy packs its weights here, once per call,
      # outside the loop (the prefill above ran on the plain ones).
      if self.uses_cpu_rows(B) and unembedding is None:
        fused_layers, unembedding = model.decode_weights(layers)
      # Left padding: the last slot is the last real token. Unembed only that position
      # (the full [Np, P, V] logits would cost P times the head's FLOPs for nothing).
      last_logits = model.logits_from_hidden(hidden[:, -1:])[:, 0]

      def fan(x):
        return jnp.repeat(x, G, axis=0)

      cur_logits = sharding.constrain(fan(last_logits), ("batch", "vocab"))
      next_pos = fan(jnp.sum(prompt_mask, axis=1).astype(jnp.int32))
      keys = row_keys(key, B)
      limit = jnp.minimum(max_new_tokens, M)

      # ---- decode: token 0 is sampled from the prefill's logits; each loop step runs the
      # model on the last token and samples the next, so no forward runs after the last one.
      def sample(t, logits, done, tokens, logps, slogps, stopped):
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, t)
        tok, lp, slp = sample_tokens(
          logits,
          step_keys,
          temperature,
          top_k=sampling.top_k,
          top_p=sampling.top_p,
          vocab_limit=sampling.vocab_limit,
        )
        active = ~done
        tok = jnp.where(active, tok, sampling.pad_id)
        tokens = tokens.at[:, t].set(tok)
        logps = logps.at[:, t].set(jnp.where(active, lp, 0.0))
        slogps = slogps.at[:, t].set(jnp.where(active, slp, 0.0))
        hit_stop = active & jnp.any(tok[:, None] == stop_ids[None, :], axis=1)
        return tok, active, done | hit_stop, tokens, logps, slogps, stopped | hit_stop

      def cond(c):
        t, done = c[0], c[5]
        return (t < limit) & ~jnp.all(done)

      def body(c):
        t, cache, tok, active, next_pos, done, tokens, logps, slogps, stopped = c
        logits, cache = model(
          tok[:, None],
          attention_mask=active[:, None],
          positions=next_pos[:, None],
          cache=_constrain_cache(cache),
          layers=layers,
          fuse_projections=self.fuses_projections(B),
          fused_weights=fused_layers,
          unembedding=unembedding,
        )
        logits = sharding.constrain(logits[:, 0], ("batch", "vocab"))
        tok, active, done, tokens, logps, slogps, stopped = sample(t, logits, done, tokens, logps, slogps, stopped)
        return (t + 1, cache, tok, active, next_pos + 1, done, tokens, logps, slogps, stopped)

      # A limit of 0 samples nothing: every row starts done.
      first = sample(
        jnp.zeros((), jnp.int32),
        cur_logits,
        jnp.broadcast_to(limit <= 0, (B,)),
        jnp.full((B, M), sampling.pad_id, jnp.int32),
        jnp.zeros((B, M), jnp.float32),
        jnp.zeros((B, M), jnp.float32),
        jnp.zeros((B,), bool),
      )
      tok, active, done, tokens, logps, slogps, stopped = first
      init = (jnp.minimum(limit, 1), cache, tok, active, next_pos, done, tokens, logps, slogps, stopped)
      t_end, *_, tokens, logps, slogps, stopped = jax.lax.while_loop(cond, body, init)

    # Rows still running at the end were cut by the length limit.
    steps = jnp.arange(M)[None, :]
    lengths = _lengths(tokens, stop_ids, stopped, t_end)
    completion_mask = steps < lengths[:, None]
    return RolloutOutput(
      prompt_tokens=fan(prompt_tokens),
      prompt_mask=fan(prompt_mask),
      completion_tokens=tokens,
      completion_mask=completion_mask,
      lengths=lengths,
      finish_reason=jnp.where(stopped, FINISH_STOP, FINISH_LENGTH).astype(jnp.int32),
      logprobs=jnp.where(completion_mask, logps, 0.0),
      sampler_logprobs=jnp.where(completion_mask, slogps, 0.0),
      temperature=temperature,
      prompt_index=jnp.repeat(jnp.arange(Np, dtype=jnp.int32), G),
      top_k=sampling.top_k,
      top_p=sampling.top_p,
    )

  def _logps_impl(self, state, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature):
    model = nnx.merge(self._graphdef, state)
    with self._rules_ctx():
      return completion_logprobs(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature)

  # ------------------------------------------------------------------ public API

  def generate(
    self,
    prompt_tokens: np.ndarray | jax.Array,
    prompt_mask: np.ndarray | jax.Array,
    *,
    num_samples: int,
    max_len: int,
    sampling: SamplingParams,
    temperature: float | np.ndarray | jax.Array,
    key: jax.Array,
    max_new_tokens: int | None = None,
  ) -> RolloutOutput:
    """Samples ``num_samples`` completions for each left-padded prompt.

    Args:
      prompt_tokens: int32 ``[Np, P]``, left-padded (``P`` a bucket length).
      prompt_mask: bool ``[Np, P]``; every row has at least one real token.
      num_samples: G, samples per prompt (static).
      max_len: M, the static completion buffer length.
      sampling: static top-k/top-p/stop ids/pad id/vocabulary limit.
      temperature: a float or ``[Np * G]`` per-row temperatures (0 = greedy); dynamic.
      key: one PRNG key for the whole call.
      max_new_tokens: dynamic limit <= ``max_len`` (default ``max_len``).

    Returns:
      A :class:`RolloutOutput` with ``B = Np * G`` rows.
    """
    Np = prompt_tokens.shape[0]
    B = Np * num_samples
    if B % self.batch_shards:
      raise ValueError(f"num_prompts * num_samples = {B} must be a multiple of the batch shards ({self.batch_shards})")
    # Host values stay numpy until the call: each eager jnp op here would be a program
    # dispatch of its own (~0.3 ms each on a CPU host).
    host = not isinstance(temperature, jax.Array)
    temp = (np if host else jnp).broadcast_to((np if host else jnp).asarray(temperature, np.float32), (B,))
    limit = np.asarray(max_len if max_new_tokens is None else max_new_tokens, np.int32)
    prompt_tokens, prompt_mask = self._place(_as(prompt_tokens, np.int32)), self._place(_as(prompt_mask, bool))
    return self.generate_program(B)(
      self._state,
      self._layers(),
      prompt_tokens,
      prompt_mask,
      temp,
      key,
      limit,
      *self._fused_layers(B),
      num_samples=num_samples,
      max_len=max_len,
      sampling=sampling,
    )

  def per_token_logps(self, out: RolloutOutput, temperature: float | jax.Array | None = None) -> jax.Array:
    """Recomputes ``[B, M]`` log-probs of ``out``'s completions with a full forward pass
    (at the recorded temperatures unless ``temperature`` is given)."""
    temp = out.temperature if temperature is None else temperature
    return self._logps(
      self._state, out.prompt_tokens, out.prompt_mask, out.completion_tokens, out.completion_mask, temp
    )

  def _place(self, x: jax.Array) -> jax.Array:
    if self.mesh is None:
      return x
    spec = sharding.logical_to_spec(("batch",) + (None,) * (x.ndim - 1), self.rules, self.mesh, x.shape)
    return jax.device_put(x, NamedSharding(self.mesh, spec))


def _as(x, dtype):
  """``x`` as ``dtype``: a device array stays on the device, anything else becomes numpy."""
  if isinstance(x, jax.Array):
    return x if x.dtype == dtype else x.astype(dtype)
  return np.asarray(x, dtype)


def _lengths(tokens, stop_ids, stopped, t_end):
  """Completion length per row: through the first stop token, else the steps run."""
  is_stop = jnp.any(tokens[..., None] == stop_ids[None, None, :], axis=-1)
  first_stop = jnp.argmax(is_stop, axis=1) + 1
  return jnp.where(stopped, first_stop, t_end).astype(jnp.int32)


def _constrain_cache(cache: KVCache) -> KVCache:
  """The cache in the generation layout (a shared prompt's leading axis, its prompts, is split
  over the batch shards like the rows that read it)."""
  k_axes, v_axes = K_CACHE_LOGICAL_AXES, V_CACHE_LOGICAL_AXES
  if cache.is_per_layer:
    k_axes, v_axes = k_axes[1:], v_axes[1:]

  def put(x, axes):
    if x is None:
      return None
    if isinstance(x, tuple):
      return tuple(sharding.constrain(a, axes) for a in x)
    return sharding.constrain(x, axes)

  valid_axes = ("batch", "cache_seq")
  return cache.replace(
    k=put(cache.k, k_axes),
    v=put(cache.v, v_axes),
    valid=put(cache.valid, valid_axes),
    prompt_k=put(cache.prompt_k, k_axes),
    prompt_v=put(cache.prompt_v, v_axes),
    prompt_valid=put(cache.prompt_valid, valid_axes),
  )


# ----------------------------------------------------------------------------
# Convenience entry point
# ----------------------------------------------------------------------------

DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


# The samplers of ``generate``, one per live model, by its id: an entry leaves with its model
# (``weakref.finalize``), so the id is never another model's, and the sampler (which holds the model's
# arrays and a kept per-layer copy of them) never outlives it.
_SAMPLERS: dict[int, Sampler] = {}


def _get_sampler(model: Transformer, mesh: Mesh | None, keep_layer_copy: bool) -> Sampler:
  key = id(model)
  sampler = _SAMPLERS.get(key)
  if sampler is None:
    weakref.finalize(model, _SAMPLERS.pop, key, None)
  if sampler is None or sampler.mesh is not mesh or sampler.keep_layer_copy != keep_layer_copy:
    sampler = _SAMPLERS[key] = Sampler(model, mesh=mesh, keep_layer_copy=keep_layer_copy)
  else:
    sampler.update_params(model)
  return sampler


def generate(
  model: Transformer,
  prompts: Sequence[Sequence[int]],
  *,
  max_new_tokens: int,
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  num_samples: int = 1,
  stop_ids: Sequence[int] = (),
  seed: int = 0,
  pad_id: int = 0,
  mesh: Mesh | None = None,
  prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
  vocab_limit: int = 0,
  keep_layer_copy: bool = True,
) -> RolloutOutput:
  """Generates completions for token-id prompts of any lengths (users and notebooks).

  Prompts are left-padded to the smallest fitting bucket and the prompt count is
  padded to a power of two (and a multiple of the mesh's batch shards), so repeated
  calls of similar size reuse compiled code.

  Args:
    model: the policy.
    prompts: token-id lists (each non-empty).
    max_new_tokens: completion buffer length M.
    temperature: sampling temperature; 0 means greedy.
    top_p: nucleus mass (1: off).
    top_k: top-k (0: off).
    num_samples: samples per prompt (contiguous in the output).
    stop_ids: token ids that end a completion.
    seed: PRNG seed.
    pad_id: token written after a completion ends.
    mesh: the mesh the model's parameters live on, if any.
    prompt_buckets: allowed padded prompt lengths.
    vocab_limit: never sample ids ``>= vocab_limit`` (the tokenizer's vocabulary size when
      the model's is larger; 0: no limit).
    keep_layer_copy: keep a per-layer copy of the model's layer weights between calls
      while its weights are unchanged (:class:`Sampler`): repeated calls copy no weight,
      at the price of that copy's memory.  False: copy inside each call instead.

  Returns:
    A :class:`RolloutOutput` with ``len(prompts) * num_samples`` rows;
    ``completion_tokens``/``completion_mask``/``logprobs`` are ``[rows, max_new_tokens]``.
  """
  if not prompts:
    raise ValueError("prompts is empty")
  sampler = _get_sampler(model, mesh, keep_layer_copy)
  P = bucket_for(max(len(p) for p in prompts), prompt_buckets)
  n = len(prompts)
  shards = sampler.batch_shards
  n_pad = 1 << (n - 1).bit_length()
  while (n_pad * num_samples) % shards:
    n_pad *= 2
  filler = [[pad_id]] * (n_pad - n)
  tokens, mask = left_pad(list(prompts) + filler, P, pad_id)
  out = sampler.generate(
    tokens,
    mask,
    num_samples=num_samples,
    max_len=max_new_tokens,
    sampling=SamplingParams(top_k=top_k, top_p=top_p, stop_ids=tuple(stop_ids), pad_id=pad_id, vocab_limit=vocab_limit),
    temperature=temperature,
    key=jax.random.key(seed),
  )
  return out.take(n * num_samples)
