#!/bin/bash
# Quantized faster than bf16: the whole GPU story in one call (H100 or H200) of at most 9 minutes on a cold machine; each step has
# its own time box inside the whole budget, writes JSON and a log to $OUT, and a failed or
# skipped step leaves the others running. One table at the end (lib/quant_gpu_summary.py).
#   1. tests   the W4A16 and 8-bit GEMV kernels' tests, compiled cases only (pytest; the
#              interpreted ones are the CPU's)
#   2. probe   start-up, one step bucket at a time (startup_probe.py; parallel processes),
#              2-layer Llama-3-8B shapes: FP8 + FP8 KV with XLA's Triton GEMMs ("on") and the
#              engine's choice ("auto": cuBLASLt), INT8 W8A8, bf16, AWQ; the FP8 GEMMs found in
#              each optimized module (__cublas$lt$matmul$f8); FP8's profiling bucket at 32
#              layers (the start-up that stalled)
#   3. sweep   quant_kernels.py per layer at T = 1 (the floors: every W4A16 and 8-bit GEMV
#              candidate, the new slots3d and reduce_steps forms included, against bf16 and
#              W8A8); sweep-all: T = 16 ... 1024, each kernel's first two candidates
#   4. e2e     benchmarks/e2e_suite.py per row, one engine process each, cold caches:
#              1000 x 128/128 output tok/s, batch-1 TPOT at 128/128 and start-up; rows that
#              no longer fit the budget are listed with the command that runs them
#   bash benchmarks/quant_gpu.sh              # GPU
#   bash benchmarks/quant_gpu.sh --smoke      # CPU: tiny shapes, kernels interpreted
# Environment: OUT (default /tmp/quant_gpu), STEPS (default "tests probe sweep e2e"; add
# "sweep-all" for T = 16 ... 1024), ROWS (e2e rows in order, default "fp8 bf16 int8 awq gptq"),
# PROBES (default "fp8-on fp8-auto fp8-auto-L32 int8-auto bf16-on awq-auto"; also int8-on,
# bf16-off), BUDGET_S (530 on a GPU), CACHE (the e2e rows' persistent compilation cache;
# default a fresh directory in /tmp).
# A cold row takes about two minutes (start-up ~100 s on an H100), so one call runs the checks
# and about two rows; the rest in a second call: STEPS=e2e ROWS="bf16 int8 awq gptq" (bf16
# again: compare rows of one call, one card).
# Needs jax (with its CUDA plugin), flax, numpy, transformers, safetensors, and pytest for step 1
# (skipped without it); wheels in .whl/ (benchmarks/gpu_wheels.sh) are installed first if there.
set -u
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/quant_gpu}
STEPS=${STEPS:-tests probe sweep e2e}  # also: sweep-all
ROWS=${ROWS:-fp8 bf16 int8 awq gptq}
PY=$(command -v python3 || command -v python)
START=$SECONDS
mkdir -p "$OUT"
: > "$OUT/steps.txt"

left() { echo $((BUDGET_S - (SECONDS - START))); }

step() {  # name, seconds, command...: time-boxed to what the budget has left, logged
    local name=$1 limit=$2; shift 2
    local remaining
    remaining=$(($(left) - 5))
    if [ "$remaining" -lt "$limit" ]; then limit=$remaining; fi
    if [ "$limit" -lt 15 ]; then
        echo "$name: skipped (budget spent)" | tee -a "$OUT/steps.txt"
        return 1
    fi
    local begin=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc, $((SECONDS - begin)) s (box $limit s)" | tee -a "$OUT/steps.txt"
    return $rc
}

wants() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if [ "${1:-}" = "--smoke" ]; then
    BUDGET_S=${BUDGET_S:-2400}
    $PY benchmarks/lib/quantization_summary.py --smoke-configs "$OUT/configs" || exit 1
    C=$OUT/configs/tiny
    ENGINE="--load-format dummy --skip-tokenizer-init --dtype float32 --max-model-len 128
        --max-num-seqs 8 --max-num-batched-tokens 64 --async-scheduling"
    WORK="--num-prompts 8 --input-len 16 --output-len 8 --latency-input-len 16
        --latency-output-len 8 --latency-warmup 1 --latency-iters 1"
    PROBE="--load-format dummy --skip-tokenizer-init --dtype float32 --max-model-len 128
        --max-num-seqs 8 --max-num-batched-tokens 64"
    PROBE_LAYERS=1; PROBE_BUCKETS=1d,16m; BIG_LAYERS=2
    SWEEP1="--tiny --tokens 1 --budget-s 60 --max-candidates 3"
    SWEEP_ALL="--tiny --tokens 16,64 --budget-s 60 --max-candidates 2"
    ROW_BOX=400; PROBE_BOX=900; SWEEP_BOX=400
else
    BUDGET_S=${BUDGET_S:-530}
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
        > "$OUT/gpu.txt" 2>&1
    if ls .whl/*.whl > /dev/null 2>&1; then
        step wheels 60 $PY -m pip install -q --no-index --find-links .whl .whl/*.whl
    fi
    C=benchmarks/configs/llama-3-8b
    ENGINE="--load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048
        --max-num-seqs 512 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.9
        --async-scheduling"
    WORK="--num-prompts 1000 --input-len 128 --output-len 128 --latency-input-len 128
        --latency-output-len 128 --latency-warmup 1 --latency-iters 3"
    PROBE="--load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048
        --max-num-seqs 512 --max-num-batched-tokens 4096"
    PROBE_LAYERS=2; PROBE_BUCKETS=profile,1d,16m,512m; BIG_LAYERS=32
    # Two distinct layers per chain: one 4-bit layer (113 MB) is already past the 50 MB L2.
    SWEEP1="--tokens 1 --layers 2 --iters 5 --budget-s 75"
    SWEEP_ALL="--tokens 16,32,256,1024 --layers 2 --iters 5 --budget-s 80 --max-candidates 2"
    ROW_BOX=150; PROBE_BOX=100; SWEEP_BOX=110
fi

if wants tests; then
    if $PY -c "import pytest" 2> /dev/null; then
        # The compiled cases only (interpret=False); -v: a timed-out run still shows each result.
        step kernel_tests 50 $PY benchmarks/lib/compiled_kernel_tests.py -v -x -rs \
            tests/pallas_kernels/test_w4a16_matmul.py tests/pallas_kernels/test_w8_gemv.py
        grep -cE " PASSED| FAILED" "$OUT/kernel_tests.log" | sed 's/^/kernel tests run: /'
    else
        echo "kernel_tests: skipped (no pytest; the sweep still checks every kernel)" \
            | tee -a "$OUT/steps.txt"
    fi
fi

if wants probe; then
    # Parallel processes on one GPU: no preallocated pool, so they share its memory.
    probe() {  # name, layers, buckets, config, flags...
        local name=$1 layers=$2 buckets=$3 model=$4; shift 4
        XLA_PYTHON_CLIENT_PREALLOCATE=false $PY benchmarks/startup_probe.py --model "$model" \
            --layers "$layers" --buckets "$buckets" $PROBE "$@" --out "$OUT/probe-$name.json" \
            > "$OUT/probe-$name.log" 2>&1
    }
    run_probes() {
        local L=$PROBE_LAYERS B=$PROBE_BUCKETS FP8="--quantization fp8 --kv-cache-dtype fp8"
        for name in $PROBES; do
            case $name in
                fp8-on) probe $name $L $B $C $FP8 --triton-gemm on & ;;
                fp8-auto) probe $name $L $B $C $FP8 --triton-gemm auto \
                    --hlo-dir "$OUT/hlo-fp8-auto" & ;;
                fp8-auto-L*) probe $name $BIG_LAYERS profile $C $FP8 --triton-gemm auto & ;;
                int8-on | int8-auto) probe $name $L $B $C-w8a8-int8 --triton-gemm ${name#int8-} & ;;
                bf16-on | bf16-off) probe $name $L $B $C --triton-gemm ${name#bf16-} & ;;
                awq-auto) probe $name $L $B $C-awq --triton-gemm auto & ;;
                *) echo "unknown probe $name" ;;
            esac
        done
        wait
    }
    PROBES=${PROBES:-fp8-on fp8-auto fp8-auto-L$BIG_LAYERS int8-auto bf16-on awq-auto}
    export PY PROBE OUT
    step probes $PROBE_BOX bash -c "$(declare -f probe run_probes); \
        PROBE_LAYERS=$PROBE_LAYERS PROBE_BUCKETS=$PROBE_BUCKETS BIG_LAYERS=$BIG_LAYERS C=$C \
        PROBES='$PROBES' run_probes"
fi

if wants sweep; then
    step sweep $SWEEP_BOX $PY benchmarks/quant_kernels.py $SWEEP1 \
        --kernels w4a16,w8gemv-fp8,w8gemv-int8,fp8-w8a8,int8-w8a8 --out "$OUT/quant_kernels.json"
    tail -4 "$OUT/sweep.log"
fi
if wants sweep-all; then
    step sweep-all $SWEEP_BOX $PY benchmarks/quant_kernels.py $SWEEP_ALL \
        --out "$OUT/quant_kernels-all.json"
    tail -4 "$OUT/sweep-all.log"
fi

if wants e2e; then
    # A fresh persistent compilation cache (cold start-ups), outside OUT: its files stay here.
    CACHE=${CACHE:-/tmp/quant-gpu-xla-$$}
    for row in $ROWS; do
        case $row in
            bf16) model=$C; extra="" ;;
            fp8) model=$C; extra="--quantization fp8 --kv-cache-dtype fp8" ;;
            int8) model=$C-w8a8-int8; extra="" ;;
            awq) model=$C-awq; extra="--linear-backend auto" ;;
            gptq) model=$C-gptq; extra="--linear-backend auto" ;;
            *) echo "unknown row $row"; continue ;;
        esac
        if [ "$(left)" -lt 90 ]; then
            echo "e2e-$row: not run (budget); next call: STEPS=e2e ROWS=\"$row ...\"" \
                "bash benchmarks/quant_gpu.sh" | tee -a "$OUT/steps.txt"
            continue
        fi
        mkdir -p "$OUT/e2e-$row"
        step "e2e-$row" $ROW_BOX $PY benchmarks/e2e_suite.py --model $model $ENGINE \
            $extra $WORK --compilation-cache-dir "$CACHE" --workloads random latency \
            --output-dir "$OUT/e2e-$row"
        grep -E "Start-up|Throughput|Avg time per output" "$OUT/e2e-$row.log" | tail -3
    done
fi

echo "total $((SECONDS - START)) s of $BUDGET_S" | tee -a "$OUT/steps.txt"
$PY benchmarks/lib/quant_gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
