#!/bin/bash
# Third profiling call: the two traces again (the earlier calls' did not come back), with the
# flat-weights dispatch; trace files copied to $OUT as they are.
set -u
export PYTHONPATH=.
C=benchmarks/configs/llama-3-8b
COMMON="--model $C --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.9 --async-scheduling"
(CUDA_VISIBLE_DEVICES=0 timeout 240 python3 scripts/profile_step.py $COMMON \
  --max-num-seqs 8 --max-num-batched-tokens 512 --workload latency --latency-iters 3 \
  --trace-dir /tmp/trace_latency --trace-start 16 --trace-steps 24 \
  --output-json $OUT/latency.json > $OUT/latency.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 240 python3 scripts/profile_step.py $COMMON \
  --max-num-seqs 1024 --max-num-batched-tokens 4096 --workload random \
  --trace-dir /tmp/trace_random --trace-start 24 --trace-steps 16 \
  --output-json $OUT/random.json > $OUT/random.log 2>&1) &
wait
cp $(find /tmp/trace_latency -name "*.trace.json.gz" | head -1) $OUT/latency.trace.json.gz
cp $(find /tmp/trace_random -name "*.trace.json.gz" | head -1) $OUT/random.trace.json.gz
ls -la $OUT
grep -v "Compiling\|cuda_timer" $OUT/latency.log | tail -30
grep -v "Compiling\|cuda_timer" $OUT/random.log | tail -30
