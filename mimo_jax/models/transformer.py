"""Decoder-only transformer (Llama 2/3, Qwen2/2.5 family) as Flax NNX modules.

Shapes use letters: B batch, T query length, S key length (cache slots), D model width,
N query heads, K key/value heads, G = N // K heads per KV group, H head dim, F MLP width,
V vocabulary, L layers.

The layers are stacked (every layer parameter has a leading ``layers`` axis) and run
with ``jax.lax.scan``, so compile time does not grow with depth; the scanned body is
optionally rematerialised.  Decoding is the exception: with a per-layer cache
(:meth:`KVCache.per_layer`) the stack runs as an unrolled loop over per-layer weights
(:meth:`Decoder.layer_states`), so a decode step neither slices the stacked weights nor
copies a layer's cache out of the stack and back; the decode step's program then grows
with depth (the prefill still runs the scanned stack).  Norms, softmax and logits are float32 whatever the
parameter and compute dtypes are.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax.kernels import cpu_rows
from mimo_jax.models.config import ModelConfig, RopeScaling
from mimo_jax.sharding import constrain

_INIT_STD = 0.02
_MASK_VALUE = -1e30  # finite, so a fully masked row (a pad query) stays NaN-free


def _normal(rngs: nnx.Rngs, shape, dtype) -> jax.Array:
  return (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def project(x: jax.Array, w: jax.Array, contract: int = 1, preferred_element_type=None) -> jax.Array:
  """``x [..., *in] @ w [*in, *out]`` (``in`` = the last ``contract`` dims of ``x``) as one 2-D product.

  The leading dims (``B, T``) are merged into one row dim first.  Written as a ``[B, T, D]`` einsum,
  the weight gradient contracts over two dims, and XLA:CPU lowers that with a transposing copy of
  the ``[B, T, F]`` activation (the SwiGLU derivative fused into it, read column-wise) that costs more
  than the product itself; over rows it is one plain ``x^T @ g``.  The merge is a bitcast: the rows
  are the major dims, and sharded the same way (``batch`` major).
  """
  lead, inner = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :]
  k = math.prod(inner)
  if isinstance(w, cpu_rows.Panels):  # a weight packed once for the decode's few rows (cpu_rows)
    if w.k != k:
      raise ValueError(f"project: x {x.shape} contracts {k} features, the packed weight {w.k}")
    return cpu_rows.rows_matmul(x.reshape(-1, k), w.data, w.n).reshape(*lead, w.n)
  if w.shape[:contract] != inner:
    raise ValueError(f"project: x {x.shape} and w {w.shape} disagree on the {contract} contracted dims")
  out = w.shape[contract:]
  x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
  return jnp.dot(x2, w2, preferred_element_type=preferred_element_type).reshape(*lead, *out)


# ----------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """Inverse frequencies ``[H/2]`` (float32), with optional linear or Llama-3 scaling."""
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if scaling is None:
    pass
  elif scaling.kind == "linear":
    inv_freq = inv_freq / scaling.factor
  elif scaling.kind == "llama3":
    # Llama 3.1: keep high frequencies, divide low frequencies by `factor`, and
    # interpolate smoothly in between (wavelength bands set by the two factors).
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  else:  # pragma: no cover - RopeScaling validates kind
    raise ValueError(scaling.kind)
  return inv_freq.astype(np.float32)


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates ``x`` by position (the half-split convention of Hugging Face Llama/Qwen2)."""
  # [B, T, H/2]
  angles = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  # The tables are made once: fused into the rotation, XLA:CPU would evaluate the cosine and sine
  # (and the positions' cumulative sum) again for every head's element (a batch-16 CPU generate call
  # took ~1.5% longer).
  cos, sin = jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x = x_btnh.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_btnh.dtype)


# ----------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------


class RMSNorm(nnx.Module):
  """Root-mean-square layer norm, computed in float32."""

  def __init__(self, dim: int, eps: float, *, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE and an optional KV cache."""

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    qkv_bias: bool,
    o_bias: bool,
    dtype,
    param_dtype,
    rngs: nnx.Rngs,
  ):
    D, N, K, H = d_model, num_heads, num_kv_heads, head_dim
    self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = N, K, H, dtype
    self.w_q_dnh = nnx.Param(_normal(rngs, (D, N, H), param_dtype), logical_axes=("embed", "heads", "head_dim"))
    self.w_k_dkh = nnx.Param(_normal(rngs, (D, K, H), param_dtype), logical_axes=("embed", "kv_heads", "head_dim"))
    self.w_v_dkh = nnx.Param(_normal(rngs, (D, K, H), param_dtype), logical_axes=("embed", "kv_heads", "head_dim"))
    self.w_o_nhd = nnx.Param(_normal(rngs, (N, H, D), param_dtype), logical_axes=("heads", "head_dim", "embed"))
    if qkv_bias:
      self.b_q_nh = nnx.Param(jnp.zeros((N, H), param_dtype), logical_axes=("heads", "head_dim"))
      self.b_k_kh = nnx.Param(jnp.zeros((K, H), param_dtype), logical_axes=("kv_heads", "head_dim"))
      self.b_v_kh = nnx.Param(jnp.zeros((K, H), param_dtype), logical_axes=("kv_heads", "head_dim"))
    else:
      self.b_q_nh = self.b_k_kh = self.b_v_kh = None
    self.b_o_d = nnx.Param(jnp.zeros((D,), param_dtype), logical_axes=("norm",)) if o_bias else None

  def __call__(
    self,
    x_btd: jax.Array,
    positions_bt: jax.Array,
    mask_bts: jax.Array,
    inv_freq: np.ndarray,
    kv_cache: tuple[jax.Array, jax.Array] | None = None,
    cache_index: jax.Array | None = None,
    queries: int | None = None,
    prompt_kv: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    fuse_projections: bool = False,
    fused_qkv: jax.Array | cpu_rows.Panels | None = None,
    w_o: cpu_rows.Panels | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """Args: x [B,T,D]; positions [B,T]; mask [B,T,S] (True = attend); optional cache
    (k ``[B,K,H,S]``, v ``[B,K,S,H]``: the :class:`KVCache` layout) and the slot where this
    call's T tokens are written.

    ``prompt_kv`` (with a cache): a prompt's keys ``[N, K, H, P]``, values ``[N, K, P, H]`` and
    valid mask ``[N, P]``, one copy shared by ``B / N`` consecutive rows
    (:meth:`KVCache.from_prompt` with ``share_prompt``).  The rows attend to it before their
    own slots, in one softmax: the arithmetic of a cache that holds the prompt in every row,
    up to the order of float sums.

    ``queries`` (no cache): only the last ``queries`` positions attend (``mask`` then has
    that many rows); keys and values still cover all T.

    ``fuse_projections``: queries, keys and values from one product with the three weights
    side by side (see :meth:`_qkv`); ``fused_qkv``: that weight made before the call
    (:meth:`fused_qkv_weight`), else it is concatenated here.  ``w_o``: the output projection
    packed for a decode step (:meth:`Block.decode_weights`), else the parameter.

    Returns: output [B,T,D] (or [B,queries,D]) and the updated cache; without a cache, this
    call's keys and values ``[B,T,K,H]`` (after RoPE; a prefill writes them into a fresh cache).
    """
    dt = self.dtype
    if queries is not None and kv_cache is not None:
      raise ValueError("queries= is for a call without a cache (a prefill's last layer)")
    q, k, v = self._qkv(x_btd, positions_bt, inv_freq, queries, fuse_projections, fused_qkv)
    B, T = q.shape[:2]
    if kv_cache is None:
      new_cache = (k, v)  # unused (and dead code to XLA) except by a prefill
      out = _attend(q, k, v, mask_bts, "BSKH", "BSKH", dt)
    else:
      k_cache, v_cache = kv_cache
      zero = jnp.zeros((), jnp.int32)
      k_new = jnp.transpose(k, (0, 2, 3, 1)).astype(k_cache.dtype)  # [B, K, H, T]
      v_new = jnp.transpose(v, (0, 2, 1, 3)).astype(v_cache.dtype)  # [B, K, T, H]
      k_cache = jax.lax.dynamic_update_slice(k_cache, k_new, (zero, zero, zero, cache_index))
      v_cache = jax.lax.dynamic_update_slice(v_cache, v_new, (zero, zero, cache_index, zero))
      new_cache = (k_cache, v_cache)
      k, v = k_cache.astype(dt), v_cache.astype(dt)
      if prompt_kv is None:
        args = (q, k, v, mask_bts)
        batched = functools.partial(_attend, k_spec="BKHS", v_spec="BKSH", dt=dt)

        def single(q, k, v, mask):
          return _single_query_attention(q[:, 0], k, v, mask[:, 0], dt)[:, None]

      else:
        pk, pv, pvalid = prompt_kv
        args = (q, k, v, mask_bts, pk.astype(dt), pv.astype(dt), pvalid)
        batched = functools.partial(_attend_after_prompt, dt=dt)

        def single(q, k, v, mask, pk, pv, pvalid):
          return _single_query_attention(q[:, 0], k, v, mask[:, 0], dt, (pk, pv, pvalid))[:, None]

      if T == 1:
        # The form is the lowering platform's (an AOT compile for a TPU topology on a CPU host
        # gets the accelerator's), not the host's default backend: only that branch is lowered.
        out = jax.lax.platform_dependent(*args, cpu=single, default=batched)
      else:
        out = batched(*args)
    return self._output(out, w_o), new_cache

  def fused_qkv_weight(self) -> jax.Array:
    """``[w_q | w_k | w_v]`` as one ``[D, (N + 2 K) H]`` weight in the compute dtype (see :meth:`_qkv`)."""
    ws = (self.w_q_dnh[...], self.w_k_dkh[...], self.w_v_dkh[...])
    return jnp.concatenate([w.astype(self.dtype).reshape(w.shape[0], -1) for w in ws], axis=1)

  def _qkv(self, x_btd, positions_bt, inv_freq, queries=None, fuse=False, fused_w=None):
    """Queries ``[B, T, K, G, H]`` (grouped by the KV head they share; the last ``queries``
    positions only, when given), keys and values ``[B, T, K, H]``, RoPE applied.

    ``fuse``: one product ``x @ [w_q | w_k | w_v]`` instead of three (for a decode step, whose
    few rows make each product's fixed cost count).  The weight is ``fused_w`` when given (made
    once for many calls: ``Sampler``'s kept layer copy), else :meth:`fused_qkv_weight` here, which a
    decode loop over per-layer weights builds once per call (it is loop-invariant).
    """
    dt = self.dtype
    x = x_btd.astype(dt)
    x_q, positions_q = (x, positions_bt) if queries is None else (x[:, -queries:], positions_bt[:, -queries:])
    if fuse and queries is None:
      w = self.fused_qkv_weight() if fused_w is None else fused_w
      widths = np.cumsum([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim])
      q, k, v = jnp.split(project(x, w), widths, axis=-1)
      q = q.reshape(*x.shape[:2], self.num_heads, self.head_dim)
      k, v = (part.reshape(*x.shape[:2], self.num_kv_heads, self.head_dim) for part in (k, v))
    else:
      q = project(x_q, self.w_q_dnh[...].astype(dt))
      k = project(x, self.w_k_dkh[...].astype(dt))
      v = project(x, self.w_v_dkh[...].astype(dt))
    if self.b_q_nh is not None:
      q = q + self.b_q_nh[...].astype(dt)
      k = k + self.b_k_kh[...].astype(dt)
      v = v + self.b_v_kh[...].astype(dt)
    q = constrain(apply_rope(q, positions_q, inv_freq), ("batch", "seq", "heads", "head_dim"))
    k = constrain(apply_rope(k, positions_bt, inv_freq), ("batch", "seq", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
    B, T, N, H = q.shape
    return q.reshape(B, T, self.num_kv_heads, N // self.num_kv_heads, H), k, v

  def _output(self, out_btkgh: jax.Array, w_o: cpu_rows.Panels | None = None) -> jax.Array:
    """The output projection of the attention's ``[B, T, K, G, H]`` result (``w_o``: packed, see ``__call__``)."""
    B, T, K, G, H = out_btkgh.shape
    out = constrain(out_btkgh.reshape(B, T, K * G, H), ("batch", "seq", "heads", "head_dim"))
    y = project(out, self.w_o_nhd[...].astype(self.dtype) if w_o is None else w_o, contract=2)
    if self.b_o_d is not None:
      y = y + self.b_o_d[...].astype(self.dtype)
    return y

  def with_prompt(self, x_gsd, positions_gs, prompt_len, mask_gpp, mask_btt, inv_freq):
    """Attention of ``G`` prompts and the ``B = G x R`` continuations that follow them, each
    prompt's work done once.

    ``x_gsd`` is ``[G, P + R x T, D]``: group ``g``'s prompt (``P`` positions), then its ``R``
    continuations of ``T`` tokens each (``positions_gs`` likewise).  The prompt attends causally
    over itself (``mask_gpp [G, P, P]``); a continuation attends to its prompt's real positions
    (``mask_gpp``'s last row) and causally over itself (``mask_btt [B, T, T]``), in one softmax:
    the arithmetic of one call over each continuation concatenated after its prompt, up to the
    order of float sums.  Returns ``[G, P + R x T, D]``.
    """
    dt = self.dtype
    P = prompt_len
    q, k, v = self._qkv(x_gsd, positions_gs, inv_freq)
    G = q.shape[0]
    B, T = mask_btt.shape[:2]
    R = B // G
    _, _, K, Gq, H = q.shape
    qp, kp, vp = q[:, :P], k[:, :P], v[:, :P]
    q6 = q[:, P:].reshape(G, R, T, K, Gq, H)
    ks, vs = k[:, P:].reshape(B, T, K, H), v[:, P:].reshape(B, T, K, H)
    out_p = _attend(qp, kp, vp, mask_gpp, "BSKH", "BSKH", dt)
    # A continuation's keys: its prompt's (broadcast over the group; the backward sums them back), then its own.
    k_cont = jnp.concatenate([jnp.repeat(kp, R, axis=0), ks], axis=1)  # [B, P + T, K, H]
    v_cont = jnp.concatenate([jnp.repeat(vp, R, axis=0), vs], axis=1)
    prompt_keys = jnp.repeat(mask_gpp[:, -1:, :], R, axis=0)  # [B, 1, P]: the prompt's real positions
    mask = jnp.concatenate([jnp.broadcast_to(prompt_keys, (B, T, P)), mask_btt], axis=-1)
    out_s = _attend(q6.reshape(B, T, K, Gq, H), k_cont, v_cont, mask, "BSKH", "BSKH", dt)
    out = jnp.concatenate([out_p, out_s.reshape(G, R * T, K, Gq, H)], axis=1)
    return self._output(out)


def _attend(q_btkgh, k, v, mask_bts, k_spec: str, v_spec: str, dt) -> jax.Array:
  """Masked softmax attention as two batched products (``k_spec`` / ``v_spec`` name the
  key and value layouts in einsum letters); scores and softmax in float32, the
  probabilities rounded to the compute dtype.  Returns ``[B, T, K, G, H]``."""
  scores = jnp.einsum(f"BTKGH,{k_spec}->BKGTS", q_btkgh, k, preferred_element_type=jnp.float32)
  scores = scores / np.sqrt(q_btkgh.shape[-1]).astype(np.float32)
  scores = jnp.where(mask_bts[:, None, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  return jnp.einsum(f"BKGTS,{v_spec}->BTKGH", probs, v)


def _attend_after_prompt(q_btkgh, k_bkhs, v_bksh, mask_bts, pk_nkhp, pv_nkph, pvalid_np, dt) -> jax.Array:
  """:func:`_attend` over a shared prompt and the rows' own cache slots, in one softmax.

  Rows ``n R .. n R + R - 1`` (``R = B / N``) read prompt ``n``'s keys ``[N, K, H, P]`` and
  values ``[N, K, P, H]`` from one copy: on accelerators the prompt's products are batched
  over the group's ``R x G`` queries.  Precision as :func:`_attend`; the two halves of the
  output are summed in float32.  Returns ``[B, T, K, G, H]``.
  """
  B, T, K, G, H = q_btkgh.shape
  N, P = pvalid_np.shape
  R = B // N
  f32 = jnp.float32
  scale = np.sqrt(H).astype(np.float32)
  q6 = q_btkgh.reshape(N, R, T, K, G, H)
  sp = jnp.einsum("NRTKGH,NKHP->NRKGTP", q6, pk_nkhp, preferred_element_type=f32) / scale
  sp = jnp.where(pvalid_np[:, None, None, None, None, :], sp, _MASK_VALUE).reshape(B, K, G, T, P)
  so = jnp.einsum("BTKGH,BKHS->BKGTS", q_btkgh, k_bkhs, preferred_element_type=f32) / scale
  so = jnp.where(mask_bts[:, None, None, :, :], so, _MASK_VALUE)
  probs = jax.nn.softmax(jnp.concatenate([sp, so], axis=-1), axis=-1).astype(dt)
  pp = probs[..., :P].reshape(N, R, K, G, T, P)
  out_p = jnp.einsum("NRKGTP,NKPH->NRTKGH", pp, pv_nkph, preferred_element_type=f32).reshape(B, T, K, G, H)
  out_s = jnp.einsum("BKGTS,BKSH->BTKGH", probs[..., P:], v_bksh, preferred_element_type=f32)
  return (out_p + out_s).astype(dt)


def _single_query_attention(q_bkgh, k_bkhs, v_bksh, mask_bs, dt, prompt_kv=None):
  """Attention of one query per row (a CPU decode step) as two multiply-reduce fusions.

  In the cache's layout both reductions run over a middle axis with a contiguous minor
  one (S for the scores, H for the output), which XLA:CPU vectorises well; as batched
  dots the products are tiny matrices per (row, KV head), which cost more than the
  arithmetic on CPU.  The precision is the batched form's: inputs in the compute dtype,
  products summed in float32, the probabilities rounded to the compute dtype, so the
  sampler's log-probs match the learner's forward.  Returns ``[B, K, G, H]`` in ``dt``.
  (Accelerators keep the batched form: there the products are matrix-unit work.)

  With ``prompt_kv`` (see :func:`_attend_after_prompt`) the rows first attend to their
  group's shared prompt: there ``R x G`` queries meet the same keys, so those two products
  are batched dots over (prompt, KV head), and the prompt is read once per group.
  """
  f32 = jnp.float32  # q, k and v arrive in the compute dtype
  scale = np.sqrt(q_bkgh.shape[-1]).astype(np.float32)
  scores = jnp.sum(q_bkgh.astype(f32)[..., None] * k_bkhs.astype(f32)[:, :, None], axis=3)  # [B, K, G, S]
  scores = scores / scale
  scores = jnp.where(mask_bs[:, None, None, :], scores, _MASK_VALUE)
  if prompt_kv is None:
    probs = jax.nn.softmax(scores, axis=-1).astype(dt).astype(f32)
    return jnp.sum(probs[..., None] * v_bksh.astype(f32)[:, :, None], axis=3).astype(dt)
  pk, pv, pvalid = prompt_kv
  B, K, G, H = q_bkgh.shape
  N, P = pvalid.shape
  R = B // N
  sp = jnp.einsum("NRKGH,NKHP->NRKGP", q_bkgh.reshape(N, R, K, G, H), pk, preferred_element_type=f32) / scale
  sp = jnp.where(pvalid[:, None, None, None, :], sp, _MASK_VALUE).reshape(B, K, G, P)
  # One softmax over both parts, without concatenating them.
  top = jnp.maximum(jnp.max(sp, axis=-1, keepdims=True), jnp.max(scores, axis=-1, keepdims=True))
  ep, es = jnp.exp(sp - top), jnp.exp(scores - top)
  total = jnp.sum(ep, axis=-1, keepdims=True) + jnp.sum(es, axis=-1, keepdims=True)
  pp, ps = (ep / total).astype(dt), (es / total).astype(dt).astype(f32)
  out_p = jnp.einsum("NRKGP,NKPH->NRKGH", pp.reshape(N, R, K, G, P), pv, preferred_element_type=f32)
  out_s = jnp.sum(ps[..., None] * v_bksh.astype(f32)[:, :, None], axis=3)
  return (out_p.reshape(B, K, G, H) + out_s).astype(dt)


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, d_model: int, mlp_dim: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    self.w_gate_df = nnx.Param(_normal(rngs, (d_model, mlp_dim), param_dtype), logical_axes=("embed", "mlp"))
    self.w_up_df = nnx.Param(_normal(rngs, (d_model, mlp_dim), param_dtype), logical_axes=("embed", "mlp"))
    self.w_down_fd = nnx.Param(_normal(rngs, (mlp_dim, d_model), param_dtype), logical_axes=("mlp", "embed"))

  def fused_gate_up_weight(self) -> jax.Array:
    """``[w_gate | w_up]`` as one ``[D, 2 F]`` weight in the compute dtype."""
    return jnp.concatenate([self.w_gate_df[...].astype(self.dtype), self.w_up_df[...].astype(self.dtype)], axis=1)

  def __call__(
    self,
    x_btd: jax.Array,
    fuse_projections: bool = False,
    fused_gate_up: jax.Array | cpu_rows.Panels | None = None,
    w_down: cpu_rows.Panels | None = None,
  ) -> jax.Array:
    """``fuse_projections``: gate and up from one product ``x @ [w_gate | w_up]`` (see
    :meth:`Attention._qkv`), with ``fused_gate_up`` as that weight when given; ``w_down``: the down
    projection packed for a decode step (:meth:`Block.decode_weights`), else the parameter."""
    dt = self.dtype
    x = x_btd.astype(dt)
    if fuse_projections:
      w = self.fused_gate_up_weight() if fused_gate_up is None else fused_gate_up
      gate, up = jnp.split(project(x, w), 2, axis=-1)
    else:
      gate = project(x, self.w_gate_df[...].astype(dt))
      up = project(x, self.w_up_df[...].astype(dt))
    h = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    return project(h, self.w_down_fd[...].astype(dt) if w_down is None else w_down)


class Block(nnx.Module):
  """Pre-norm transformer layer: x + attn(norm(x)); x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, param_dtype=param_dtype)
    self.attn = Attention(
      cfg.d_model,
      cfg.num_heads,
      cfg.num_kv_heads,
      cfg.resolved_head_dim,
      qkv_bias=cfg.qkv_bias,
      o_bias=cfg.o_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, param_dtype=param_dtype)
    self.mlp = MLP(cfg.d_model, cfg.mlp_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(
    self,
    x,
    positions,
    mask,
    inv_freq,
    kv_cache=None,
    cache_index=None,
    queries=None,
    prompt_kv=None,
    fuse_projections=False,
    fused_weights=None,
  ):
    """``queries``: only the last that many positions come out; ``prompt_kv``: a shared
    prompt's keys and values; ``fuse_projections``: q|k|v and gate|up each as one product (see
    :class:`Attention`), with ``fused_weights`` (:meth:`fused_projection_weights`, or
    :meth:`decode_weights` for a decode step's few rows) as their weights when given."""
    fused_qkv, fused_gate_up, w_o, w_down = (None,) * 4 if fused_weights is None else (*fused_weights, None, None)[:4]
    h, new_cache = self.attn(
      self.attn_norm(x),
      positions,
      mask,
      inv_freq,
      kv_cache,
      cache_index,
      queries,
      prompt_kv,
      fuse_projections,
      fused_qkv,
      w_o,
    )
    if queries is not None:
      x = x[:, -queries:]
    x = constrain(x + h.astype(x.dtype), ("batch", "seq", "act_embed"))
    x = x + self.mlp(self.mlp_norm(x), fuse_projections, fused_gate_up, w_down).astype(x.dtype)
    return constrain(x, ("batch", "seq", "act_embed")), new_cache

  def fused_projection_weights(self) -> tuple[jax.Array, jax.Array]:
    """The layer's ``[w_q | w_k | w_v]`` and ``[w_gate | w_up]`` weights, for a decode step that fuses
    its projections."""
    return self.attn.fused_qkv_weight(), self.mlp.fused_gate_up_weight()

  def decode_weights(self) -> tuple[cpu_rows.Panels, ...]:
    """The layer's ``[w_q | w_k | w_v]``, ``[w_gate | w_up]``, output and down projections, each packed
    for :func:`mimo_jax.kernels.cpu_rows.rows_matmul` (a decode step's few rows on CPU; ``__call__``'s
    ``fused_weights``, with ``fuse_projections``)."""
    w_o = self.attn.w_o_nhd[...].astype(self.attn.dtype)
    w_down = self.mlp.w_down_fd[...].astype(self.mlp.dtype)
    return tuple(
      cpu_rows.Panels.of(w) for w in (*self.fused_projection_weights(), w_o.reshape(-1, w_o.shape[-1]), w_down)
    )

  def with_prompt(self, x, positions, prompt_len, mask_pp, mask_ss, inv_freq):
    """The layer over prompts and their continuations, ``[G, P + R x T, D]`` (see
    :meth:`Attention.with_prompt`): norms, projections and MLP over all the rows at once."""
    h = self.attn.with_prompt(self.attn_norm(x), positions, prompt_len, mask_pp, mask_ss, inv_freq)
    x = constrain(x + h.astype(x.dtype), ("batch", "seq", "act_embed"))
    x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
    return constrain(x, ("batch", "seq", "act_embed"))


# ----------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class KVCache:
  """Preallocated key/value cache for all layers.

  Keys are stored with the slot axis last and values heads-major, so one query's
  attention reduces over a middle axis with a contiguous minor one in both products, and
  a batched product finds its batch axes (row, KV head) leading.

  A cache may also hold a shared prompt (:meth:`from_prompt` with ``share_prompt``): the
  keys and values of ``N`` prompts, one copy each, read by ``B / N`` consecutive rows (the
  samples of a prompt), which attend to it before their own slots.  The prompt is then
  neither stored nor read ``B / N`` times.

  Attributes:
    k: ``[L, B, K, H, S]`` keys (compute dtype), or a tuple of ``L`` per-layer
      ``[B, K, H, S]`` arrays (see :meth:`per_layer`).
    v: ``[L, B, K, S, H]`` values, or a tuple of ``L`` per-layer ``[B, K, S, H]``.
    valid: ``[B, S]`` bool, which slots hold real (non-padding) tokens.
    index: int32 scalar, the next slot to write (shared by all rows: prompts are
      left-padded to a common length, so every row writes the same slot).
    prompt_k, prompt_v: the shared prompt's keys ``[L, N, K, H, P]`` and values
      ``[L, N, K, P, H]`` (per-layer tuples in the per-layer form), or None.
    prompt_valid: ``[N, P]`` bool, the shared prompt's real tokens, or None.
  """

  k: jax.Array
  v: jax.Array
  valid: jax.Array
  index: jax.Array
  prompt_k: Any = None
  prompt_v: Any = None
  prompt_valid: jax.Array | None = None

  @classmethod
  def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dtype = jnp.dtype(dtype or cfg.dtype)
    L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.resolved_head_dim
    return cls(
      k=jnp.zeros((L, batch, K, H, max_len), dtype),
      v=jnp.zeros((L, batch, K, max_len, H), dtype),
      valid=jnp.zeros((batch, max_len), bool),
      index=jnp.zeros((), jnp.int32),
    )

  @classmethod
  def from_prompt(
    cls,
    k_lbtkh: jax.Array,
    v_lbtkh: jax.Array,
    mask_bt: jax.Array,
    max_len: int,
    *,
    repeats: int = 1,
    per_layer: bool = False,
    dtype=None,
    share_prompt: bool = False,
  ) -> KVCache:
    """The cache after a prefill (:meth:`Decoder.prefill`): the prompt's keys and values in
    slots ``[0, T)``, empty slots up to ``max_len``, the next write at slot ``T``.

    ``repeats`` fans every row out to that many contiguous rows (the samples of a prompt
    share its prefill); ``per_layer`` gives the decode loop's form (:meth:`per_layer`).
    Padding, fan-out and the per-layer split are one expression per buffer, so XLA writes
    each buffer once.

    ``share_prompt``: the prompt is not fanned out but kept once per prompt
    (``prompt_k``, ``prompt_v``, ``prompt_valid``) for its ``repeats`` rows; the rows' own
    buffers then hold only the ``max_len - T`` slots after it, the next write at their slot 0.
    """
    T = k_lbtkh.shape[2]
    if max_len < T:
      raise ValueError(f"a cache of {max_len} slots cannot hold a prompt of {T} tokens")
    dtype = jnp.dtype(dtype or k_lbtkh.dtype)

    def build(x, perm, rows, slots):  # [B, T, K, H] or [L, B, T, K, H] -> the cache layout
      lead = x.ndim - 4
      x = jnp.repeat(x.astype(dtype), rows, axis=lead) if rows > 1 else x.astype(dtype)
      x = jnp.transpose(x, tuple(range(lead)) + tuple(lead + i for i in perm))
      pad = [(0, 0)] * x.ndim
      pad[lead + perm.index(1)] = (0, slots - T)
      return jnp.pad(x, pad)

    def per_layer_or_stacked(make):
      L = k_lbtkh.shape[0]
      return tuple(make(i) for i in range(L)) if per_layer else make(slice(None))

    k_perm, v_perm = (0, 2, 3, 1), (0, 2, 1, 3)  # [B, K, H, S], [B, K, S, H]
    if share_prompt:
      (N, _, K, H), M = k_lbtkh.shape[1:], max_len - T
      lead = () if per_layer else (k_lbtkh.shape[0],)
      return cls(
        k=per_layer_or_stacked(lambda i: jnp.zeros((*lead, N * repeats, K, H, M), dtype)),
        v=per_layer_or_stacked(lambda i: jnp.zeros((*lead, N * repeats, K, M, H), dtype)),
        valid=jnp.zeros((N * repeats, M), bool),
        index=jnp.zeros((), jnp.int32),
        prompt_k=per_layer_or_stacked(lambda i: build(k_lbtkh[i], k_perm, 1, T)),
        prompt_v=per_layer_or_stacked(lambda i: build(v_lbtkh[i], v_perm, 1, T)),
        prompt_valid=mask_bt.astype(bool),
      )
    k = per_layer_or_stacked(lambda i: build(k_lbtkh[i], k_perm, repeats, max_len))
    v = per_layer_or_stacked(lambda i: build(v_lbtkh[i], v_perm, repeats, max_len))
    valid = jnp.pad(jnp.repeat(mask_bt.astype(bool), repeats, axis=0), ((0, 0), (0, max_len - T)))
    return cls(k=k, v=v, valid=valid, index=jnp.asarray(T, jnp.int32))

  @property
  def max_len(self) -> int:
    """The rows' own slots (after a shared prompt, when there is one)."""
    return self.valid.shape[1]

  @property
  def shares_prompt(self) -> bool:
    return self.prompt_valid is not None

  @property
  def is_per_layer(self) -> bool:
    return isinstance(self.k, tuple)

  def per_layer(self) -> KVCache:
    """The same cache as one array per layer (the decode loop's form:
    each layer's slot write is then in place in its own buffer)."""
    if self.is_per_layer:
      return self
    L = self.k.shape[0]

    def split(x):
      return None if x is None else tuple(x[i] for i in range(L))

    return self.replace(k=split(self.k), v=split(self.v), prompt_k=split(self.prompt_k), prompt_v=split(self.prompt_v))


K_CACHE_LOGICAL_AXES = ("layers", "batch", "kv_heads", "head_dim", "cache_seq")
V_CACHE_LOGICAL_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


def causal_mask(mask_bt: jax.Array) -> jax.Array:
  """``[B, T, T]``: query ``t`` attends to keys ``<= t`` that are real tokens (``mask_bt``)."""
  T = mask_bt.shape[1]
  return jnp.tril(jnp.ones((T, T), bool))[None] & mask_bt.astype(bool)[:, None, :]


def positions_from_mask(mask_bt: jax.Array) -> jax.Array:
  """Position ids ``[B, T]`` from a padding mask: 0, 1, ... over the real tokens.

  Works for left- and right-padded batches (pad slots get the neighbouring position,
  which is harmless because they are masked as keys).
  """
  return jnp.maximum(jnp.cumsum(mask_bt.astype(jnp.int32), axis=-1) - 1, 0)


# ----------------------------------------------------------------------------
# Decoder stack
# ----------------------------------------------------------------------------


_REMAT_POLICIES = {
  "full": None,
  "dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Decoder(nnx.Module):
  """Token embedding, the scanned stack of layers and the final norm (no head)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    param_dtype = jnp.dtype(cfg.param_dtype)
    self.embed_vd = nnx.Param(
      _normal(rngs, (cfg.vocab_size, cfg.d_model), param_dtype), logical_axes=("vocab", "embed")
    )

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers", "logical_axes": "layers"})
    def make_layers(rngs: nnx.Rngs) -> Block:
      return Block(cfg, rngs=rngs)

    self.layers = make_layers(rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, param_dtype=param_dtype)

  def layer_states(self) -> tuple[nnx.State, ...]:
    """Each layer's parameters as its own arrays (static slices of the stacked ones).

    Inside a jitted program this is one copy of the layer weights; a decode loop that
    takes them from outside its body reads them in place at every step instead of slicing
    the stack each time.
    """
    _, stacked = nnx.split(self.layers)
    return tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(self.config.num_layers))

  def fused_projection_weights(self, layers: tuple[nnx.State, ...]) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """Each layer's ``[w_q | w_k | w_v]`` and ``[w_gate | w_up]`` (:meth:`Block.fused_projection_weights`)
    from its weights ``layers`` (:meth:`layer_states`): made once, they spare a decode that fuses its
    projections the concatenation at every call (``__call__``'s ``fused_weights``)."""
    graphdef, _ = nnx.split(self.layers)
    return tuple(nnx.merge(graphdef, state_l).fused_projection_weights() for state_l in layers)

  def decode_weights(self, layers: tuple[nnx.State, ...]) -> tuple[tuple[cpu_rows.Panels, ...], ...]:
    """Each layer's :meth:`Block.decode_weights` from its weights ``layers`` (:meth:`layer_states`):
    made once, kept between calls (``__call__``'s ``fused_weights``; not for a prefill's many rows)."""
    graphdef, _ = nnx.split(self.layers)
    return tuple(nnx.merge(graphdef, state_l).decode_weights() for state_l in layers)

  def _remat(self, body):
    """A training scan's layer body under the config's rematerialisation policy."""
    if self.config.remat == "none":
      return body
    return jax.checkpoint(body, policy=_REMAT_POLICIES[self.config.remat], prevent_cse=False)

  def _embed(self, tokens_bt: jax.Array) -> jax.Array:
    # FSDP: gather the table's D dimension before the lookup (it stays vocab-parallel),
    # so the looked-up rows come out batch-sharded instead of D-sharded.
    table = constrain(self.embed_vd[...], ("vocab", None))
    x = jnp.take(table, tokens_bt, axis=0).astype(jnp.dtype(self.config.dtype))
    return constrain(x, ("batch", "seq", "act_embed"))

  def prefill(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    mask_bt: jax.Array,
    layers: tuple[nnx.State, ...] | None = None,
    fused_weights: tuple[tuple[jax.Array, jax.Array], ...] | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The stack over a prompt batch that starts an empty cache.

    Attention is causal over the call's own ``T`` tokens (padding keys masked), not over
    a cache's ``T + M`` slots, of which the last ``M`` are still empty: half the
    attention work when ``M = T``, and no cache to zero and then overwrite.  The first
    ``L - 1`` layers run as a scan (a program that does not grow with depth).  Of the last
    layer only its keys and values are needed at every position (they come from its
    input) and its output only at the last one, the only one unembedded: its queries,
    attention output and MLP run on that position alone (``1 / L`` of the prefill's
    matmul work, less).  Given per-layer weights (:meth:`layer_states`, made outside the
    program), the layers run unrolled on them and no weight is sliced or copied; with their
    concatenated projections too (``fused_weights``, :meth:`fused_projection_weights`), q|k|v and
    gate|up are one product each (the last layer's queries, on one position, stay separate).

    Returns:
      The last position's final-normed hidden state ``[B, 1, D]`` and every layer's keys
      and values, ``[L, B, T, K, H]`` each (for :meth:`KVCache.from_prompt`).
    """
    cfg = self.config
    mask = causal_mask(mask_bt)
    graphdef, layer_state = nnx.split(self.layers)
    inv_freq = rope_inv_freq(cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling)

    L = cfg.num_layers
    if fused_weights is not None and layers is None:
      raise ValueError("fused_weights need the per-layer weights (layers) they were made from")
    if fused_weights is not None and any(isinstance(w, cpu_rows.Panels) for f in fused_weights for w in f):
      raise ValueError("a prefill takes fused_projection_weights, not decode_weights (packed for a few rows)")
    fused = [None] * L if fused_weights is None else list(fused_weights)
    if layers is not None and not len(layers) == len(fused) == L:
      raise ValueError(f"{L} layers but {len(layers)} layer states and {len(fused)} fused weights")
    x = self._embed(tokens_bt)
    if layers is None:

      def body(x, i):
        state_l = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), layer_state)
        return nnx.merge(graphdef, state_l)(x, positions_bt, mask, inv_freq)

      x, (k, v) = jax.lax.scan(body, x, jnp.arange(L - 1))
      ks, vs = [k], [v]
      last = nnx.merge(graphdef, jax.tree.map(lambda a: a[L - 1], layer_state))
    else:
      ks, vs = [], []
      for state_l, fused_l in zip(layers[:-1], fused[:-1], strict=True):
        layer = nnx.merge(graphdef, state_l)
        x, (k, v) = layer(x, positions_bt, mask, inv_freq, fuse_projections=fused_l is not None, fused_weights=fused_l)
        ks.append(k[None])
        vs.append(v[None])
      last = nnx.merge(graphdef, layers[-1])
    last = functools.partial(last, fuse_projections=fused[-1] is not None, fused_weights=fused[-1])
    x, (k, v) = last(x, positions_bt, mask[:, -1:], inv_freq, queries=1)
    kv = (jnp.concatenate([*ks, k[None]]), jnp.concatenate([*vs, v[None]]))
    return self.final_norm(x), kv

  def with_prompt(
    self,
    prompt_tokens_gp: jax.Array,
    prompt_positions_gp: jax.Array,
    prompt_mask_gp: jax.Array,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    mask_bt: jax.Array,
  ) -> tuple[jax.Array, jax.Array]:
    """The stack over ``G`` prompts, each followed by ``R = B / G`` continuations, every prompt
    run once instead of once per continuation.

    Rows ``g R .. g R + R - 1`` of ``tokens_bt`` continue prompt ``g``: the result equals the
    stack over each continuation's row concatenated after its prompt (up to the order of
    float sums), and a group's prompt work (its projections, MLP and attention) is done
    once rather than ``R`` times.  The gradient flows to the shared prompt from all of its
    continuations.

    Args:
      prompt_tokens_gp, prompt_positions_gp, prompt_mask_gp: ``[G, P]`` (left-padded).
      tokens_bt, positions_bt, mask_bt: ``[B, T]``, the continuations (positions continue
        the prompt's).

    Returns:
      Final-normed hidden states of the prompts ``[G, P, D]`` and continuations ``[B, T, D]``.
    """
    cfg = self.config
    (G, P), (B, T) = prompt_tokens_gp.shape, tokens_bt.shape
    if B % G:
      raise ValueError(f"{B} continuations do not split over {G} prompts")
    R = B // G
    mask_pp, mask_ss = causal_mask(prompt_mask_gp), causal_mask(mask_bt)
    graphdef, layer_state = nnx.split(self.layers)
    inv_freq = rope_inv_freq(cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling)
    # One row per group: its prompt, then its R continuations (a group stays on one batch shard).
    positions = jnp.concatenate([prompt_positions_gp, positions_bt.reshape(G, R * T)], axis=1)
    x = jnp.concatenate([self._embed(prompt_tokens_gp), self._embed(tokens_bt).reshape(G, R * T, -1)], axis=1)
    x = constrain(x, ("batch", "seq", "act_embed"))

    def body(x, state_l):
      return nnx.merge(graphdef, state_l).with_prompt(x, positions, P, mask_pp, mask_ss, inv_freq), None

    x, _ = jax.lax.scan(self._remat(body), x, layer_state)
    x = self.final_norm(x)
    return x[:, :P], x[:, P:].reshape(B, T, -1)

  def __call__(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    mask_bt: jax.Array,
    cache: KVCache | None = None,
    layers: tuple[nnx.State, ...] | None = None,
    fuse_projections: bool = False,
    fused_weights: tuple[tuple[jax.Array, jax.Array], ...] | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """Runs the stack.

    Args:
      tokens_bt: int32 ``[B, T]``.
      positions_bt: int32 ``[B, T]`` RoPE positions.
      mask_bt: bool ``[B, T]``, True for real tokens.
      cache: optional KV cache; this call's tokens are written at ``cache.index``.  A
        per-layer cache runs the layers as an unrolled loop.
      layers: with a per-layer cache, the weights from :meth:`layer_states` (default:
        sliced here); ignored otherwise.
      fuse_projections: with a per-layer cache, q|k|v and gate|up each as one product
        (:meth:`Attention._qkv`); ignored otherwise (a scanned stack would concatenate the
        weights at every call).
      fused_weights: with ``fuse_projections``, each layer's concatenated weights
        (:meth:`fused_projection_weights`, made outside the call), else they are made here; or,
        for a decode step's few rows on CPU, each layer's packed weights (:meth:`decode_weights`).

    Returns:
      Final-normed hidden states ``[B, T, D]`` (compute dtype) and the updated cache.
    """
    cfg = self.config
    B, T = tokens_bt.shape
    mask_bt = mask_bt.astype(bool)
    x = self._embed(tokens_bt)

    if cache is None:
      mask = causal_mask(mask_bt)  # [B, T, S=T]: causal within the call, padding keys masked
      cache_index = None
    else:
      S = cache.max_len
      cache_index = cache.index
      valid = jax.lax.dynamic_update_slice(cache.valid, mask_bt, (jnp.zeros((), jnp.int32), cache_index))
      # Query t sits in slot index + t and sees slots <= its own that hold real tokens (and
      # every real token of a shared prompt, which precedes them all).
      q_slot = cache_index + jnp.arange(T)
      mask = (jnp.arange(S)[None, :] <= q_slot[:, None])[None] & valid[:, None, :]

    graphdef, layer_state = nnx.split(self.layers)
    inv_freq = rope_inv_freq(cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling)

    if cache is None:

      def body(x, state_l):
        layer = nnx.merge(graphdef, state_l)
        y, _ = layer(x, positions_bt, mask, inv_freq)
        return y, None

      x, _ = jax.lax.scan(self._remat(body), x, layer_state)
      new_cache = None
    elif cache.is_per_layer:
      states = layers if layers is not None else self.layer_states()
      if not len(states) == len(cache.k) == cfg.num_layers:
        raise ValueError(
          f"{cfg.num_layers} layers, {len(cache.k)} per-layer cache buffers and {len(states)} layer states"
        )
      if fused_weights is not None and (not fuse_projections or len(fused_weights) != cfg.num_layers):
        raise ValueError(
          f"fused_weights for {len(fused_weights)} layers need fuse_projections=True and {cfg.num_layers} layers"
        )
      ks, vs = list(cache.k), list(cache.v)
      for i, state_l in enumerate(states):
        layer = nnx.merge(graphdef, state_l)
        prompt = (cache.prompt_k[i], cache.prompt_v[i], cache.prompt_valid) if cache.shares_prompt else None
        x, (ks[i], vs[i]) = layer(
          x,
          positions_bt,
          mask,
          inv_freq,
          (ks[i], vs[i]),
          cache_index,
          prompt_kv=prompt,
          fuse_projections=fuse_projections,
          fused_weights=None if fused_weights is None else fused_weights[i],
        )
      new_cache = cache.replace(k=tuple(ks), v=tuple(vs), valid=valid, index=cache_index + T)
    else:

      def body(carry, xs):
        x, k_all, v_all = carry
        state_l, i, prompt_kv = xs
        layer = nnx.merge(graphdef, state_l)
        kv = (k_all[i], v_all[i])
        prompt = None if prompt_kv is None else (*prompt_kv, cache.prompt_valid)
        y, (k_l, v_l) = layer(x, positions_bt, mask, inv_freq, kv, cache_index, prompt_kv=prompt)
        # In-place write of this layer's slice keeps the cache update O(slice).
        k_all = jax.lax.dynamic_update_index_in_dim(k_all, k_l, i, axis=0)
        v_all = jax.lax.dynamic_update_index_in_dim(v_all, v_l, i, axis=0)
        return (y, k_all, v_all), None

      prompt_kv = (cache.prompt_k, cache.prompt_v) if cache.shares_prompt else None
      xs = (layer_state, jnp.arange(cfg.num_layers), prompt_kv)
      (x, k_all, v_all), _ = jax.lax.scan(body, (x, cache.k, cache.v), xs)
      new_cache = cache.replace(k=k_all, v=v_all, valid=valid, index=cache_index + T)

    return self.final_norm(x), new_cache


# ----------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------


class Transformer(nnx.Module):
  """Causal language model: ``model(tokens)`` maps int32 ``[B, T]`` to float32 logits ``[B, T, V]``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    self.decoder = Decoder(cfg, rngs=rngs)
    if cfg.tie_embeddings:
      self.lm_head_dv = None
    else:
      self.lm_head_dv = nnx.Param(
        _normal(rngs, (cfg.d_model, cfg.vocab_size), jnp.dtype(cfg.param_dtype)), logical_axes=("embed", "vocab")
      )

  def unembedding(self) -> jax.Array:
    """The unembedding matrix ``[D, V]`` (the transposed embedding when tied)."""
    if self.lm_head_dv is None:
      return self.decoder.embed_vd[...].T
    return self.lm_head_dv[...]

  def logits_from_hidden(self, hidden_btd: jax.Array, unembedding: cpu_rows.Panels | None = None) -> jax.Array:
    """float32 logits ``[B, T, V]`` from final hidden states (``unembedding``: the matrix packed for a
    decode step, :meth:`decode_weights`; else :meth:`unembedding`)."""
    dt = jnp.dtype(self.config.dtype)
    w = self.unembedding().astype(dt) if unembedding is None else unembedding
    logits = project(hidden_btd.astype(dt), w, preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "vocab"))

  def decode_weights(
    self, layers: tuple[nnx.State, ...]
  ) -> tuple[tuple[tuple[cpu_rows.Panels, ...], ...], cpu_rows.Panels]:
    """Each layer's packed weights (:meth:`Decoder.decode_weights`) and the packed unembedding, for
    a decode step's few rows on CPU (``__call__``'s ``fused_weights`` and ``unembedding``).  Float32
    models only (:func:`mimo_jax.kernels.cpu_rows.rows_matmul`)."""
    if jnp.dtype(self.config.dtype) != jnp.float32:
      raise ValueError(f"decode_weights: float32 models only (compute dtype {self.config.dtype})")
    return self.decoder.decode_weights(layers), cpu_rows.Panels.of(self.unembedding().astype(jnp.float32))

  def hidden(
    self,
    tokens_bt,
    *,
    attention_mask=None,
    positions=None,
    cache=None,
    layers=None,
    fuse_projections=False,
    fused_weights=None,
  ):
    """Final hidden states ``[B, T, D]`` and the updated cache (see :meth:`Decoder.__call__`)."""
    if attention_mask is None:
      attention_mask = jnp.ones(tokens_bt.shape, bool)
    if positions is None:
      positions = positions_from_mask(attention_mask)
    return self.decoder(tokens_bt, positions, attention_mask, cache, layers, fuse_projections, fused_weights)

  def __call__(
    self,
    tokens_bt: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
    cache: KVCache | None = None,
    layers: tuple[nnx.State, ...] | None = None,
    fuse_projections: bool = False,
    fused_weights: tuple[tuple[jax.Array, jax.Array], ...] | None = None,
    unembedding: cpu_rows.Panels | None = None,
  ) -> Any:
    """Logits for a batch.

    Args:
      tokens_bt: int32 ``[B, T]``.
      attention_mask: ``[B, T]``, 1 for real tokens, 0 for padding (left or right);
        all ones by default.
      positions: int32 ``[B, T]``; by default counted over the real tokens.
      cache: optional KV cache; when given, returns ``(logits, new_cache)``.
      layers: per-layer weights for a per-layer cache (:meth:`Decoder.layer_states`).
      fuse_projections, fused_weights: see :meth:`Decoder.__call__`.
      unembedding: the unembedding packed for a decode step (:meth:`decode_weights`).

    Returns:
      float32 logits ``[B, T, V]`` (and the updated cache when one is passed).
    """
    hidden, new_cache = self.hidden(
      tokens_bt,
      attention_mask=attention_mask,
      positions=positions,
      cache=cache,
      layers=layers,
      fuse_projections=fuse_projections,
      fused_weights=fused_weights,
    )
    logits = self.logits_from_hidden(hidden, unembedding)
    return logits if cache is None else (logits, new_cache)


class ValueModel(nnx.Module):
  """The same backbone with a scalar head: ``model(tokens)`` gives float32 values ``[B, T]``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    self.decoder = Decoder(cfg, rngs=rngs)
    self.value_head_d = nnx.Param(jnp.zeros((cfg.d_model,), jnp.float32), logical_axes=("embed",))
    self.value_bias = nnx.Param(jnp.zeros((), jnp.float32), logical_axes=())

  @classmethod
  def from_policy(cls, policy: Transformer, *, rngs: nnx.Rngs | None = None) -> ValueModel:
    """A value model whose backbone is a copy of ``policy``'s (head initialised to zero)."""
    value = cls(policy.config, rngs=rngs or nnx.Rngs(0))
    nnx.update(value.decoder, jax.tree.map(jnp.copy, nnx.state(policy.decoder)))
    return value

  def hidden(self, tokens_bt, *, attention_mask=None, positions=None) -> tuple[jax.Array, None]:
    """Final-normed hidden states ``[B, T, D]`` (and no cache), as :meth:`Transformer.hidden`."""
    if attention_mask is None:
      attention_mask = jnp.ones(tokens_bt.shape, bool)
    if positions is None:
      positions = positions_from_mask(attention_mask)
    return self.decoder(tokens_bt, positions, attention_mask)

  def values_from_hidden(self, hidden_btd: jax.Array) -> jax.Array:
    """The scalar head: float32 ``[B, T]``."""
    return jnp.einsum("BTD,D->BT", hidden_btd.astype(jnp.float32), self.value_head_d[...]) + self.value_bias[...]

  def __call__(self, tokens_bt, *, attention_mask=None, positions=None) -> jax.Array:
    hidden, _ = self.hidden(tokens_bt, attention_mask=attention_mask, positions=positions)
    return self.values_from_hidden(hidden)
