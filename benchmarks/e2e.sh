#!/bin/bash
# The end-to-end job of docs/benchmarks.md on an nvidia-h200-x2 machine: HF transformers on
# GPU 1, jaxpaged's parity check, suite and a traced batch-1 pass on GPU 0. Results in $OUT.
set -u
export PYTHONPATH=.
C=benchmarks/configs/llama-3-8b
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt
CUDA_VISIBLE_DEVICES=1 python3 benchmarks/hf_baseline.py --model $C \
    --batch-sizes 1 64 256 1024 --sharegpt-batch-sizes 64 --output-json $OUT/hf.json > $OUT/hf.log 2>&1 &
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/gpu_parity.py --skip-llama > $OUT/parity.log 2>&1
tail -3 $OUT/parity.log
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/e2e_suite.py --model $C --load-format dummy \
    --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 --max-num-seqs 1024 \
    --max-num-batched-tokens 4096 --gpu-memory-utilization 0.9 --async-scheduling \
    --compare-sync random --latency-iters 5 --output-dir $OUT > $OUT/suite.log 2>&1
grep -v "Compiling\|cuda_timer" $OUT/suite.log | tail -32
CUDA_VISIBLE_DEVICES=0 python3 scripts/profile_step.py --model $C --load-format dummy \
    --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.9 \
    --async-scheduling --max-num-seqs 8 --max-num-batched-tokens 512 --workload latency \
    --latency-iters 3 --trace-dir /tmp/trace_latency --trace-start 16 --trace-steps 24 \
    --output-json $OUT/profile.json > /tmp/profile.log 2>&1
grep -v "Compiling\|cuda_timer" /tmp/profile.log | tail -20
cp $(find /tmp/trace_latency -name "*.trace.json.gz" | head -1) $OUT/latency.trace.json.gz
wait
grep -v "cuda_timer" $OUT/hf.log | tail -12
