#!/usr/bin/env bash
# GPU checks of the fused log-prob kernel, the policy update and decoding, in one run (about 7 minutes on one H100/H200).
#
#   bash bench/gpu_check.sh OUT_DIR
#
# Installs the package without dependencies (the machine's jax, flax, optax are used), then:
#   1. the kernel tests, with the compiled Pallas GPU (Triton) kernel against the reference (pytest.txt);
#   2. python -m mimo_jax.bench.logprobs: bf16, N = H = 4096, V in {32000, 128256, 151936}: the bare logits
#      matmul, reference, xla and pallas_gpu, forward and forward+backward, with output errors (logprobs.jsonl);
#   3. python -m mimo_jax.bench.update: the 1B preset's update step, full logits vs fused, with its model
#      FLOPs and MFU against the device's bf16 peak (update.jsonl);
#   4. python -m mimo_jax.bench.generate on the 1B preset in bf16 (generate.jsonl): greedy decode at batch 1, 16, 64
#      as the trainer's sampler runs it (the per-layer weights copied in each call), with the bytes a step
#      reads and their rate against the HBM bandwidth; then batch 16 with the copy kept between calls. The
#      difference is the train -> generate switch (the only work it does: update_params swaps a reference);
#   5. a block-size sweep of pallas_gpu and of the xla block at V = 128256 (sweep.jsonl).
# Stage stderr goes to errors.txt.
# Each stage has its own time limit, so a failure or a slow stage leaves the others' results.
set -u
OUT_DIR=${1:-gpu_out}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
SMALL=${GPU_CHECK_SMALL:-0}  # 1: tiny shapes, for a smoke test of this script off the GPU
if [ "$SMALL" = 1 ]; then N=256; H=128; VOCABS=3000,5000; VSWEEP=3000; PRESET=tiny; ROWS=8; PL=16; CL=32; REP=2; GN=8
else N=4096; H=4096; VOCABS=32000,128256,151936; VSWEEP=128256; PRESET=1b; ROWS=16; PL=128; CL=1024; REP=10; GN=256; fi

SITE=$(mktemp -d)
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" . >"$OUT_DIR/errors.txt" 2>&1 \
  || { echo "install failed"; cat "$OUT_DIR/errors.txt"; exit 1; }
export PYTHONPATH="$SITE"
rm -rf build
REPO=$(pwd)
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$SITE"  # not the checkout: its mimo_jax/ (without kernels/) would shadow the installed package

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
} | tee "$OUT_DIR/env.txt"

stage() {  # stage NAME SECONDS CMD...: runs CMD under a time limit, appending stdout to OUT_DIR/NAME
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))"
  echo "== $name: $*" >>"$OUT_DIR/errors.txt"
  timeout "$limit" "$@" 2>"$OUT_DIR/stage.err" | tee -a "$OUT_DIR/$name"
  echo "== $name exit ${PIPESTATUS[0]} ($(date +%T))"
  tail -5 "$OUT_DIR/stage.err"; tail -200 "$OUT_DIR/stage.err" >>"$OUT_DIR/errors.txt"; rm -f "$OUT_DIR/stage.err"
}

PLATFORM=${GPU_CHECK_PLATFORM:-cuda}
stage pytest.txt 120 env JAX_PLATFORMS=$PLATFORM python3 -m pytest -q -p no:cacheprovider \
  "$REPO/tests/test_kernels_fused_logprobs.py" -k "not sharded and not Interpret and not bad"
BENCH="python3 -m mimo_jax.bench.logprobs --n $N --h $H --dtype bfloat16 --repeats $REP"
stage logprobs.jsonl 150 $BENCH --vocab $VOCABS --impls reference,xla,pallas_gpu --check --matmul_baseline
stage update.jsonl 150 python3 -m mimo_jax.bench.update --preset $PRESET --rows $ROWS --prompt_len $PL \
  --completion_len $CL --repeats 3
GEN="python3 -m mimo_jax.bench.generate --preset $PRESET --dtype bfloat16 --prompt_len $PL --new_tokens $GN --no_baselines"
stage generate.jsonl 240 $GEN --batch 1,16,64 --layer_copy per_call
stage generate.jsonl 120 $GEN --batch 16 --layer_copy kept
for bs in block_n=128,block_v=128,block_h=64,num_warps=8 block_n=64,block_v=256,block_h=64,num_warps=8 \
  block_n=128,block_v=256,block_h=64,num_warps=8 block_n=64,block_v=128,block_h=32,num_warps=4,num_stages=4; do
  stage sweep.jsonl 30 $BENCH --vocab $VSWEEP --impls pallas_gpu --block_sizes $bs
done
stage sweep.jsonl 30 $BENCH --vocab $VSWEEP --impls xla --block_sizes block_v=8192
echo "done $(date +%T)"
