#!/usr/bin/env bash
# Model size vs RL gain over the warm start, at CPU scale: three widths of the embedded default's
# decoder (d_model 64 / 128 / 192 with the MLP at 3x; about 0.16M / 0.5M / 1.1M parameters), three
# seeds each, coupled learning rate, KL and clip (mimo_jax/sweep/coupling.py). The full default
# (1500 SFT and 400 RL steps; the first version, shortened to 800 and 200, left every warm start at
# 1-5% and measured nothing): about two hours on 2 cores. Results: BUILD_NOTES.md, "Scaling studies".
set -euo pipefail
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" -m mimo_jax.sweep --base=experiments/grpo_tiny.flags \
  --axis=d_model:mlp_dim=64:192,128:384,192:576 --seeds=3 --out="${OUT:-sweeps/model_size}" "$@"
