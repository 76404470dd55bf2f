#!/bin/bash
# Quantized serving on one H200: Llama-3-8B shape, dummy weights, max_num_seqs 512, async scheduling,
# one engine process per configuration (benchmarks/e2e_suite.py: 1000 x 128/128 random
# output tok/s, then batch-1 TPOT of 128/128; fp8 also 1000 ShareGPT-like requests), side by
# side: bf16 | fp8 online + fp8 KV | INT8 W8A8 (compressed-tensors) | W4A16 AWQ, XLA path |
# W4A16 AWQ, Pallas kernel (--linear-backend pallas). First the kernels' compiled GPU tests and
# the one-layer micro-benchmark. One table at the end (summarize.py), against bf16 and targets.
#   bash benchmarks/quantization.sh           # H200, about 8 minutes (README below)
#   bash benchmarks/quantization.sh --smoke   # CPU, a 2-layer 128-wide config
# Environment: OUT (results, default /tmp/quant_out), ROWS (configurations to run, default all:
# "bf16 fp8 int8 awq-xla awq-pallas"), SKIP_CHECKS=1 (skip the tests and the micro-benchmark),
# CACHE (persistent compilation cache, default /tmp/jaxpaged-quant-xla). Each step has its own
# timeout and writes its log to $OUT/<step>.log; a failed step leaves the others running.
set -u
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/quant_out}
CACHE=${CACHE:-/tmp/jaxpaged-quant-xla}
ROWS=${ROWS:-bf16 fp8 int8 awq-xla awq-pallas}
PY=$(command -v python3 || command -v python)
mkdir -p "$OUT" "$CACHE"
if [ "${1:-}" = "--smoke" ]; then
    CONFIGS="$OUT/configs"
    $PY benchmarks/lib/quantization_summary.py --smoke-configs "$CONFIGS" || exit 1
    C=$CONFIGS/tiny
    ENGINE="--load-format dummy --skip-tokenizer-init --dtype float32 --max-model-len 128
        --max-num-seqs 8 --max-num-batched-tokens 64 --async-scheduling"
    WORK="--num-prompts 8 --input-len 16 --output-len 8 --latency-input-len 16
        --latency-output-len 8 --latency-warmup 1 --latency-iters 1"
    MICRO="--tiny --budget-s 60"; LIMIT=300
    SHAREGPT=""  # its prompts are longer than the tiny config's context
else
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
        > "$OUT/gpu.txt" 2>&1
    C=benchmarks/configs/llama-3-8b
    ENGINE="--load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048
        --max-num-seqs 512 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.9
        --async-scheduling"
    WORK="--num-prompts 1000 --input-len 128 --output-len 128 --latency-input-len 128
        --latency-output-len 128 --latency-warmup 1 --latency-iters 3"
    MICRO="--budget-s 200"; LIMIT=150; SHAREGPT=sharegpt-synthetic
fi
ENGINE="$ENGINE --compilation-cache-dir $CACHE"

step() {  # name, timeout seconds, command...: log to $OUT/name.log, one status line
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
}

if [ "${SKIP_CHECKS:-0}" != 1 ]; then
    # Compiled on a GPU (the tests' non-interpret cases skip without one), interpreted too.
    step kernel_tests 150 $PY -m pytest -q -rs tests/pallas_kernels/test_w4a16_matmul.py \
        tests/pallas_kernels/test_lora_bgmv.py tests/pallas_kernels/test_fp8_attention.py
    tail -4 "$OUT/kernel_tests.log"
    step microbench 240 $PY benchmarks/quant_kernels.py $MICRO --out "$OUT/quant_kernels.json"
    tail -14 "$OUT/microbench.log"
fi

for row in $ROWS; do
    case $row in
        bf16) model=$C; extra=""; loads="random latency" ;;
        fp8) model=$C; extra="--quantization fp8 --kv-cache-dtype fp8"
            loads="random $SHAREGPT latency" ;;
        int8) model=$C-w8a8-int8; extra=""; loads="random latency" ;;
        awq-xla) model=$C-awq; extra="--linear-backend xla"; loads="random latency" ;;
        awq-pallas) model=$C-awq; extra="--linear-backend pallas"; loads="random latency" ;;
        *) echo "unknown row $row"; continue ;;
    esac
    mkdir -p "$OUT/$row"
    step "$row" $LIMIT $PY benchmarks/e2e_suite.py --model $model $ENGINE $extra $WORK \
        --workloads $loads --output-dir "$OUT/$row"
    tail -3 "$OUT/$row.log"
done
$PY benchmarks/lib/quantization_summary.py "$OUT" | tee "$OUT/summary.txt"
