#!/usr/bin/env bash
# Rollout batch at a fixed sample budget: more prompts per step and fewer steps, or the reverse
# (prompts_per_step x max_steps = 3,200 prompts, 8 samples each), on the embedded default's sparse
# exact-match reward; the learning rate follows the batch by the +20%-per-doubling rule. The base
# (16 prompts x 200 steps) is the middle point. Three seeds.
set -euo pipefail
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" -m mimo_jax.sweep --base=experiments/grpo_tiny.flags \
  --axis=prompts_per_step:max_steps=8:400,16:200,32:100 --seeds=3 --out="${OUT:-sweeps/rollout_batch}" "$@" \
  -- --sft_steps=800 --max_steps=200 --eval_every=50 --checkpoint_every=50
