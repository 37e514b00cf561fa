#!/usr/bin/env bash
# Rollout batch at a fixed sample budget: more prompts per step and fewer steps, or the reverse
# (prompts_per_step x max_steps = 6,400 prompts, 8 samples each: 51,200 samples), on the embedded
# default's sparse exact-match reward. The learning rate follows the batch by the
# +20%-per-doubling rule and the gradient clip follows the learning rate; the warm start does not
# move (it takes only the sft_* optimizer flags). The base (16 prompts x 400 steps) is the middle
# point. The full default (1500 SFT steps), three seeds. For the dense-reward arm pass
# `-- --digit_reward_weight=1` with its own OUT. Results: BUILD_NOTES.md, "Scaling studies".
set -euo pipefail
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" -m mimo_jax.sweep --base=experiments/grpo_tiny.flags \
  --axis=prompts_per_step:max_steps=8:800,16:400,32:200 --seeds=3 --out="${OUT:-sweeps/rollout_batch}" "$@"
