#!/bin/bash
# Run-to-run check of the suite's figures: the ShareGPT-like and 128/128 workloads again, each
# alone on the machine, one after the other, with scripts/benchmark_throughput.py (vLLM's script).
set -u
export PYTHONPATH=.
C=benchmarks/configs/llama-3-8b
F="--model $C --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 --max-num-seqs 1024 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.9 --async-scheduling --num-prompts 1000"
CUDA_VISIBLE_DEVICES=0 python3 scripts/benchmark_throughput.py $F --dataset-name sharegpt-synthetic \
  --output-json $OUT/repeat_sharegpt.json > $OUT/repeat_sharegpt.log 2>&1
CUDA_VISIBLE_DEVICES=0 python3 scripts/benchmark_throughput.py $F --dataset-name random \
  --input-len 128 --output-len 128 --output-json $OUT/repeat_random.json > $OUT/repeat_random.log 2>&1
grep -v "Compiling\|cuda_timer" $OUT/repeat_sharegpt.log | tail -8
grep -v "Compiling\|cuda_timer" $OUT/repeat_random.log | tail -8
