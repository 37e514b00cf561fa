"""Generation throughput: mimo-jax KV-cache sampler vs transformers vs a no-cache baseline.

    python -m mimo_jax.bench.generate [--preset small|tunix] [--batch 1,16,64] [--prompt_len 64] [--dtype float32]
                                      [--new_tokens 64] [--repeats 3] [--json_out FILE]
                                      [--num_layers N --d_model D ...]

All three run greedy decoding on identical weights (our random init, exported with
``save_hf`` and loaded by ``transformers``, float32 unless ``--dtype``, torch threads = usable cores) and
identical prompt batches, in one process, with EOS off.  ``--preset tunix`` is the shape
of the GRPO benchmark against Tunix (4 layers, d_model 256, MLP 1024, 8 query / 4 KV heads
of 32, vocabulary 512); the shape flags override any preset's fields.

After one warm-up of each, every round times mimo-jax and then transformers (alternating,
so a machine that drifts drifts for both): a call limited to one new token (prefill, the
first token included) and the full call.  Decode throughput is the difference.  Reported
per side: the medians over ``--repeats`` rounds and their (min, max); the ratio is
transformers' median total time over ours (> 1: we are faster).  Greedy tokens are
compared position by position.  For our decode: the bytes a step reads (every weight it multiplies
by, and all ``P + M`` slots of every layer's KV cache) and the rate that implies, against the HBM
bandwidth of a known accelerator (``mimo_jax.bench.devices``).  Output: a table and one JSON line per batch size (also
written to ``--json_out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax.bench.devices import peak
from mimo_jax.bench.grpo_step import TUNIX_SHAPE as _PEER_SHAPE
from mimo_jax.models import Transformer, get_preset, save_hf
from mimo_jax.rollout import Sampler, SamplingParams, left_pad

# The model of ``python -m mimo_jax.bench.grpo_step --shape tunix`` (Tunix's own benchmark model).
TUNIX_SHAPE = dict(
  num_layers=_PEER_SHAPE["layers"],
  d_model=_PEER_SHAPE["d_model"],
  mlp_dim=_PEER_SHAPE["mlp"],
  num_heads=_PEER_SHAPE["heads"],
  num_kv_heads=_PEER_SHAPE["kv_heads"],
  head_dim=_PEER_SHAPE["head_dim"],
  vocab_size=_PEER_SHAPE["vocab"],
)
SHAPE_FLAGS = ("num_layers", "d_model", "mlp_dim", "num_heads", "num_kv_heads", "head_dim", "vocab_size")


def _timed(fn, *args) -> float:
  t0 = time.perf_counter()
  fn(*args)
  return time.perf_counter() - t0


def ours(model, prompts, new_tokens, keep_layer_copy=True, fuse_projections=None, cpu_rows_products=None):
  """(run(n) -> None, tokens): greedy generation of n tokens with the trainer's sampler
  (by default as ``rollout.generate`` builds it: the per-layer weights kept between calls;
  ``fuse_projections``, ``cpu_rows_products``: the sampler's options, None for its rules)."""
  sampler = Sampler(
    model, keep_layer_copy=keep_layer_copy, fuse_projections=fuse_projections, cpu_rows_products=cpu_rows_products
  )
  tokens, mask = left_pad(prompts, len(prompts[0]), 0)
  kw = dict(num_samples=1, max_len=new_tokens, sampling=SamplingParams(), temperature=0.0, key=jax.random.key(0))

  def run(limit):
    return jax.block_until_ready(sampler.generate(tokens, mask, max_new_tokens=limit, **kw))

  out = run(new_tokens)  # compiles the one program both limits use
  return (lambda n: run(n)), np.asarray(out.completion_tokens)


def transformers_side(path, prompts, new_tokens, dtype="float32"):
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
  model.eval()
  ids = torch.tensor(prompts)
  attn = torch.ones_like(ids)

  def run(n):
    with torch.no_grad():
      return model.generate(
        ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
      )

  out = run(new_tokens)
  return run, out[:, len(prompts[0]) :].numpy()


def no_cache_seconds(model, prompts, new_tokens) -> tuple[float, np.ndarray]:
  """Recomputes the full forward over a fixed [B, P + N] buffer at every step (one timed run:
  the baseline is O(N) times slower and only sets the scale)."""
  graphdef, state = nnx.split(model)
  B, P = len(prompts), len(prompts[0])
  buf = np.zeros((B, P + new_tokens), np.int32)
  buf[:, :P] = prompts

  @jax.jit
  def decode(state, buf):
    m = nnx.merge(graphdef, state)

    def step(t, buf):
      mask = jnp.arange(P + new_tokens)[None] < P + t
      logits = m(buf, attention_mask=jnp.broadcast_to(mask, buf.shape))
      nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, P + t - 1, axis=1, keepdims=False), -1)
      return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(jnp.int32)[:, None], P + t, axis=1)

    return jax.lax.fori_loop(0, new_tokens, step, buf)

  jax.block_until_ready(decode(state, buf))
  seconds = _timed(lambda: jax.block_until_ready(decode(state, buf)))
  return seconds, np.asarray(decode(state, buf))[:, P:]


def decode_bytes_per_step(cfg, batch: int, cache_slots: int, cache_itemsize: int | None = None) -> int:
  """Bytes one decode step reads: the weights it multiplies by (all but the embedding table, of which
  it gathers ``batch`` rows, unless the table is also the unembedding) and every layer's keys and
  values over all ``cache_slots`` slots (the loop attends over the whole buffer, masked)."""
  param_size = np.dtype(cfg.param_dtype).itemsize
  cache_size = cache_itemsize or np.dtype(cfg.dtype).itemsize
  weights = cfg.num_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
  cache = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.resolved_head_dim * cache_slots
  return weights * param_size + cache * cache_size


def _stats(values: list[float]) -> dict:
  return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _rates(B, P, N, first: list[float], full: list[float]) -> dict:
  t1, tn = statistics.median(first), statistics.median(full)
  return {
    "prefill_s": _stats(first),
    "total_s": _stats(full),
    "prefill_tok_s": B * P / t1,
    "decode_tok_s": B * (N - 1) / max(tn - t1, 1e-9),
    "generate_tok_s": B * N / tn,
  }


def model_config(args: argparse.Namespace):
  if args.preset == "tunix":
    cfg = get_preset("tiny").replace(name="tunix", max_seq_len=2048, **TUNIX_SHAPE)
  else:
    cfg = get_preset(args.preset)
  overrides = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
  return cfg.replace(param_dtype=args.dtype, dtype=args.dtype, remat="none", **overrides)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="small", help="a model preset, or tunix (the GRPO benchmark's shape)")
  for name in SHAPE_FLAGS:
    parser.add_argument(f"--{name}", type=int, default=None, help="overrides the preset's field")
  parser.add_argument("--batch", default="1,16,64")
  parser.add_argument(
    "--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and compute (and the KV cache)"
  )
  parser.add_argument("--prompt_len", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per batch size")
  parser.add_argument("--no_baselines", action="store_true", help="only time mimo-jax")
  parser.add_argument("--no_cache_max_batch", type=int, default=16, help="largest batch for the no-cache baseline")
  parser.add_argument("--json_out", default="", help="also write the per-batch records here (a JSON list)")
  parser.add_argument(
    "--layer_copy",
    choices=("kept", "per_call"),
    default="kept",
    help="kept: the per-layer weights made once and kept between calls (rollout.generate's sampler); "
    "per_call: copied inside every call (the trainer's sampler)",
  )
  parser.add_argument(
    "--also_separate_projections",
    action="store_true",
    help="also time mimo-jax with q|k|v and gate|up as separate products (side 'separate'), alternated with "
    "the default, which fuses them at small batches on CPU",
  )
  parser.add_argument(
    "--also_xla_products",
    action="store_true",
    help="also time mimo-jax with the decode step's products on XLA's kernels (side 'xla-products'), "
    "alternated with the default, which runs them on mimo_jax.kernels.cpu_rows at 1-16 rows on one CPU device",
  )
  args = parser.parse_args(argv)
  try:
    args.batches = [int(b) for b in args.batch.split(",")]
  except ValueError:
    parser.error(f"--batch={args.batch!r}: expected comma-separated positive integers")
  if not args.batches or min(args.batches) < 1:
    parser.error(f"--batch={args.batch!r}: expected comma-separated positive integers")
  for name in ("prompt_len", "new_tokens", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name}={getattr(args, name)}: must be >= 1")
  return args


def main(argv=None):
  args = parse_args(argv)
  cfg = model_config(args)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tmp = tempfile.mkdtemp()
  if not args.no_baselines:
    save_hf(model, tmp)
    import torch

    threads = torch.get_num_threads()
  else:
    threads = None
  print(
    f"# {cfg.name}: {cfg.num_params() / 1e6:.1f}M params, backend={jax.default_backend()}, "
    f"devices={jax.device_count()}, torch threads={threads}, cpus={os.cpu_count()}, "
    f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  )
  print(
    f"{'B':>4} {'impl':>12} {'prefill tok/s':>14} {'decode tok/s':>13} {'total s':>8} {'(min-max)':>13} {'vs hf':>6}"
  )
  rng = np.random.default_rng(0)
  records = []
  for B in args.batches:
    prompts = rng.integers(1, cfg.vocab_size, (B, args.prompt_len)).tolist()
    N, P = args.new_tokens, args.prompt_len
    kept = args.layer_copy == "kept"
    sides = {"mimo-jax": ours(model, prompts, N, keep_layer_copy=kept)}
    if args.also_separate_projections:
      sides["separate"] = ours(model, prompts, N, keep_layer_copy=kept, fuse_projections=False)
    if args.also_xla_products:
      sides["xla-products"] = ours(model, prompts, N, keep_layer_copy=kept, cpu_rows_products=False)
    if not args.no_baselines:
      sides["transformers"] = transformers_side(tmp, prompts, N, args.dtype)
    times = {name: ([], []) for name in sides}
    for _ in range(args.repeats):
      for name, (run, _) in sides.items():
        times[name][0].append(_timed(run, 1))
        times[name][1].append(_timed(run, N))
    rows = {name: _rates(B, P, N, *times[name]) for name in sides}
    record: dict = {"batch": B, "prompt_len": P, "new_tokens": N, "repeats": args.repeats, "model": cfg.name}
    default = Sampler(model)
    record.update(
      layer_copy=args.layer_copy,
      fused_projections=default.fuses_projections(B),
      ynn_dots=default.uses_ynn_dots(B),
      cpu_rows_products=default.uses_cpu_rows(B),
      **rows,
    )
    step_bytes = decode_bytes_per_step(cfg, B, P + N)
    gbps = step_bytes * rows["mimo-jax"]["decode_tok_s"] / B / 1e9
    record["mimo-jax"].update(decode_bytes_per_step=step_bytes, decode_gbps=round(gbps, 2))
    if device_peak := peak():
      record["mimo-jax"].update(hbm_share=round(gbps / device_peak["hbm_gbps"], 4), peak=device_peak)
    if "transformers" in rows:
      record["greedy_token_agreement_with_hf"] = float(np.mean(sides["mimo-jax"][1] == sides["transformers"][1]))
      record["ratio_total_hf_over_ours"] = (
        rows["transformers"]["total_s"]["median"] / rows["mimo-jax"]["total_s"]["median"]
      )
      record["ratio_prefill_hf_over_ours"] = (
        rows["transformers"]["prefill_s"]["median"] / rows["mimo-jax"]["prefill_s"]["median"]
      )
      if B <= args.no_cache_max_batch:
        seconds, _ = no_cache_seconds(model, prompts, N)
        rows["no-cache"] = record["no-cache"] = {"total_s": _stats([seconds]), "decode_tok_s": B * N / seconds}
    for name, r in rows.items():
      ratio = (
        rows["transformers"]["total_s"]["median"] / r["total_s"]["median"] if "transformers" in rows else float("nan")
      )
      spread = f"{r['total_s']['min']:.2f}-{r['total_s']['max']:.2f}"
      print(
        f"{B:>4} {name:>12} {r.get('prefill_tok_s', float('nan')):>14.0f} {r['decode_tok_s']:>13.0f} "
        f"{r['total_s']['median']:>8.3f} {spread:>13} {ratio:>6.2f}"
      )
    print(json.dumps(record), flush=True)
    records.append(record)
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(records, f, indent=1)
  return records


if __name__ == "__main__":
  main()
