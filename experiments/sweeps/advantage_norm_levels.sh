#!/usr/bin/env bash
# Group vs global advantage normalisation on a wider spread of difficulty than advantage_norm.sh:
# the embedded default with arithmetic levels 1-3 (1-2, 2-3 and 3-4 digit operands), so one batch
# holds groups the warm start solves, groups it half-solves and groups it almost never solves. There
# a lone success in a near-hopeless group (or a lone failure in a near-solved one) gets a large
# advantage under GRPO's per-group std and a small one under `reinforce_baseline`'s batch std, which
# is the mechanism the reports blame. Held-out accuracy is logged per level (eval/level<l>/...).
# The full default budget (1500 SFT steps, 400 RL steps), three seeds.
# Results: BUILD_NOTES.md, "Scaling studies". Extra sweep flags go before the script's own `--`.
set -euo pipefail
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" -m mimo_jax.sweep --base=experiments/grpo_tiny.flags \
  --axis=advantage=grpo,reinforce_baseline --seeds=3 --out="${OUT:-sweeps/advantage_norm_levels}" "$@" \
  -- --arith_levels=1,2,3
