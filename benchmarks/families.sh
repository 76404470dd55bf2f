#!/bin/bash
# The model families on one H200 (docs/benchmarks.md, "Model families"), dummy bf16 weights of
# the published configs (benchmarks/configs/): per model, 1000 x 128/128 offline throughput and
# batch-1 TPOT
# (benchmarks/e2e_suite.py, one engine for both), then one table next to the
# weight-read floors (benchmarks/lib/families_report.py). families.sh first runs the GPU-only
# tests (tiny HF checkpoints through the compiled Pallas kernels and the Mosaic GPU grouped
# GEMM against references). Results and logs in $OUT.
#
#   bash benchmarks/families.sh    # Qwen3-8B, Gemma-2-9B                 (~6-8 min)
#   bash benchmarks/families_moe.sh   # MoE layer benchmark, Mixtral-8x7B, Phi-3-mini
#   SMOKE=1 OUT=/tmp/out bash benchmarks/families.sh   # tiny configs on CPU
set -u
export PYTHONPATH=.
MODELS=${MODELS:-"qwen3-8b gemma-2-9b"}
timeout_for() {  # seconds one model may take (start-up + 1000 requests + batch-1 latency)
  case $1 in
    mixtral*) echo 280 ;;
    phi-3*) echo 130 ;;
    *) echo 195 ;;
  esac
}
ENGINE="--load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048
  --max-num-seqs 1024 --max-num-batched-tokens 2048 --gpu-memory-utilization 0.9
  --async-scheduling"
WORK="--num-prompts 1000 --input-len 128 --output-len 128 --latency-input-len 128
  --latency-output-len 128 --latency-warmup 2 --latency-iters 5"
CONFIGS=benchmarks/configs
if [ "${SMOKE:-0}" = 1 ]; then  # tiny random configs of the same families, on CPU
  CONFIGS=/tmp/families_smoke_configs
  python3 benchmarks/lib/families_smoke_configs.py $CONFIGS
  ENGINE="--load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 64
    --max-num-seqs 8 --max-num-batched-tokens 64 --async-scheduling"
  WORK="--num-prompts 8 --input-len 16 --output-len 8 --latency-input-len 16
    --latency-output-len 8 --latency-warmup 1 --latency-iters 1"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
  > $OUT/gpu.txt 2>/dev/null
if [ -n "${MOE_BENCH:-}" ]; then
  MOE_ARGS="--model $CONFIGS/mixtral-8x7b-instruct-v0.1"
  [ "${SMOKE:-0}" = 1 ] && MOE_ARGS="--smoke --batch-sizes 1 64 --iters 2"
  timeout 120 python3 benchmarks/moe.py $MOE_ARGS --output-json $OUT/moe.json \
    > $OUT/moe.log 2>&1
  grep -v "cuda_timer" $OUT/moe.log | tail -14
fi
if [ "${SMOKE:-0}" != 1 ] && [ -z "${MOE_BENCH:-}" ]; then  # GPU correctness first (~1 min)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/models/test_families.py \
    tests/pallas_kernels/test_grouped_matmul.py -k "gpu or mosaic" > $OUT/gpu_tests.log 2>&1
  tail -3 $OUT/gpu_tests.log
fi
REPORT=""
for m in $MODELS; do
  mkdir -p $OUT/$m
  echo "=== $m"
  timeout $(timeout_for $m) python3 benchmarks/e2e_suite.py --model $CONFIGS/$m \
    $ENGINE $WORK --workloads random latency --output-dir $OUT/$m > $OUT/$m/suite.log 2>&1
  echo "exit $?"
  grep -E "^KV cache|^Start-up|^Throughput|^Elapsed|^Avg time per output|Error|error" \
    $OUT/$m/suite.log | grep -v cuda_timer | tail -8
  REPORT="$REPORT --run $m $CONFIGS/$m $OUT/$m/suite.json"
done
python3 benchmarks/lib/families_report.py $REPORT --moe-json $OUT/moe.json \
  --output-json $OUT/report.json | tee $OUT/report.md
