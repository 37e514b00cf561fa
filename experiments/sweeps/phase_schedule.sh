#!/usr/bin/env bash
# Phased (reward-slope) schedule vs a fixed cosine schedule on the embedded default, three seeds
# (the phase schedule ramps the learning rate itself: no separate warm-up). The full default
# (1500 SFT steps, 400 RL steps). Results: BUILD_NOTES.md, "Scaling studies".
set -euo pipefail
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" -m mimo_jax.sweep --base=experiments/grpo_tiny.flags \
  --axis=phase_schedule:warmup_steps=false:5,true:0 --seeds=3 --out="${OUT:-sweeps/phase_schedule}" "$@"
