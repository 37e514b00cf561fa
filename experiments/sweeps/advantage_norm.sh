#!/usr/bin/env bash
# Group vs global advantage normalisation on a mixed-difficulty task: the embedded default's
# arithmetic mixes two levels (1-2 digit operands, which the warm start mostly solves, and 3-digit
# operands, which it mostly gets wrong), so groups of 8 range from all-correct to all-wrong.
# GRPO divides each group's centred rewards by that group's std (a near-solved group's lone failure
# gets a large advantage); REINFORCE with a group baseline (`reinforce_baseline`) divides by the
# whole batch's std instead. The full default (1500 SFT steps, 400 RL steps), three seeds.
# Results: BUILD_NOTES.md, "Scaling studies".
set -euo pipefail
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" -m mimo_jax.sweep --base=experiments/grpo_tiny.flags \
  --axis=advantage=grpo,reinforce_baseline --seeds=3 --out="${OUT:-sweeps/advantage_norm}" "$@"
