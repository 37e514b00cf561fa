"""Generation throughput: mimo-jax KV-cache sampler vs transformers vs a no-cache baseline.

    python -m mimo_jax.bench.generate [--preset small] [--batch 1,16,32] [--prompt_len 64] [--new_tokens 64]

All three run greedy decoding on identical weights (our random init, exported with
``save_hf`` and loaded by ``transformers``) and identical prompt batches, in one process.
Prefill throughput is timed from a call limited to one new token; decode throughput
from the difference to the full call.  Each measurement is the median of ``--repeats``
runs after a warm-up.  Output: a table and one JSON line per configuration.
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

from mimo_jax.models import Transformer, get_preset, save_hf
from mimo_jax.rollout import Sampler, SamplingParams, left_pad


def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def bench_ours(model, prompts, new_tokens, repeats):
  sampler = Sampler(model)
  tokens, mask = left_pad(prompts, len(prompts[0]), 0)
  kw = dict(num_samples=1, max_len=new_tokens, sampling=SamplingParams(), temperature=0.0, key=jax.random.key(0))

  def run(limit):
    return jax.block_until_ready(sampler.generate(tokens, mask, max_new_tokens=limit, **kw))

  run(new_tokens)  # compile
  t1 = _median_time(lambda: run(1), repeats)
  tn = _median_time(lambda: run(new_tokens), repeats)
  out = run(new_tokens)
  return t1, tn, np.asarray(out.completion_tokens)


def bench_no_cache(model, prompts, new_tokens, repeats):
  """Recomputes the full forward over a fixed [B, P + N] buffer at every step."""
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
  # One timed run: the baseline is O(N) times slower and only sets the scale.
  tn = _median_time(lambda: jax.block_until_ready(decode(state, buf)), 1)
  return tn, np.asarray(decode(state, buf))[:, P:]


def bench_transformers(path, prompts, new_tokens, repeats):
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  model.eval()
  ids = torch.tensor(prompts)
  attn = torch.ones_like(ids)

  def run(n):
    with torch.no_grad():
      return model.generate(
        ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
      )

  run(2)
  t1 = _median_time(lambda: run(1), repeats)
  tn = _median_time(lambda: run(new_tokens), repeats)
  return t1, tn, run(new_tokens)[:, len(prompts[0]) :].numpy()


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="small")
  parser.add_argument("--batch", default="1,16,32")
  parser.add_argument("--prompt_len", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--no_baselines", action="store_true", help="only time mimo-jax")
  parser.add_argument("--no_cache_max_batch", type=int, default=16, help="largest batch for the no-cache baseline")
  args = parser.parse_args()

  cfg = get_preset(args.preset).replace(param_dtype="float32", dtype="float32", remat="none")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tmp = tempfile.mkdtemp()
  if not args.no_baselines:
    save_hf(model, tmp)
  import torch

  print(
    f"# {cfg.name}: {cfg.num_params() / 1e6:.1f}M params, backend={jax.default_backend()}, "
    f"devices={jax.device_count()}, torch threads={torch.get_num_threads()}, cpus={os.cpu_count()}"
  )
  header = f"{'B':>4} {'impl':>12} {'prefill tok/s':>14} {'decode tok/s':>13} {'total s':>8} {'vs hf':>6}"
  print(header)
  rng = np.random.default_rng(0)
  for B in (int(b) for b in args.batch.split(",")):
    prompts = rng.integers(1, cfg.vocab_size, (B, args.prompt_len)).tolist()
    N, P = args.new_tokens, args.prompt_len
    t1, tn, ours_tokens = bench_ours(model, prompts, N, args.repeats)
    rows = {"mimo-jax": (B * P / t1, B * (N - 1) / max(tn - t1, 1e-9), tn)}
    agree = None
    if not args.no_baselines:
      h1, hn, hf_tokens = bench_transformers(tmp, prompts, N, args.repeats)
      rows["transformers"] = (B * P / h1, B * (N - 1) / max(hn - h1, 1e-9), hn)
      if B <= args.no_cache_max_batch:
        nc, _ = bench_no_cache(model, prompts, N, args.repeats)
        rows["no-cache"] = (float("nan"), B * N / nc, nc)
      agree = float(np.mean(ours_tokens == hf_tokens))
    for name, (pf, dec, tot) in rows.items():
      ratio = rows["transformers"][2] / tot if "transformers" in rows else float("nan")
      print(f"{B:>4} {name:>12} {pf:>14.0f} {dec:>13.0f} {tot:>8.2f} {ratio:>6.2f}")
    print(
      json.dumps(
        {
          "batch": B,
          "prompt_len": P,
          "new_tokens": N,
          "greedy_token_agreement_with_hf": agree,
          **{k: {"prefill_tok_s": v[0], "decode_tok_s": v[1], "total_s": v[2]} for k, v in rows.items()},
        }
      )
    )


if __name__ == "__main__":
  main()
