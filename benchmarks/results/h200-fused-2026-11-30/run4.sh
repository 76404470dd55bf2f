#!/bin/bash
# After fusion: a trace of the 128/128 run's decode phase (steps 100-111, batch 1024) on GPU 0
# while TP's batch-1 phase at tp 1 runs on GPU 1; then tp 2 on both GPUs.
set -u
export PYTHONPATH=.
C=benchmarks/configs/llama-3-8b
(CUDA_VISIBLE_DEVICES=0 timeout 240 python3 scripts/profile_step.py --model $C --load-format dummy \
  --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.9 \
  --async-scheduling --max-num-seqs 1024 --max-num-batched-tokens 4096 --workload random \
  --trace-dir /tmp/trace_random --trace-start 100 --trace-steps 12 \
  --output-json $OUT/decode1024.json > /tmp/decode1024.log 2>&1
 cp $(find /tmp/trace_random -name "*.trace.json.gz" | head -1) $OUT/decode1024.trace.json.gz) &
CUDA_VISIBLE_DEVICES=1 python3 scripts/check_tensor_parallel.py --phases llama8b-tp1 \
  --async-scheduling > $OUT/tp1.log 2>&1
wait
python3 scripts/check_tensor_parallel.py --phases llama8b-tp2 --async-scheduling > $OUT/tp2.log 2>&1
grep -v "Compiling\|cuda_timer" /tmp/decode1024.log | tail -24
tail -5 $OUT/tp1.log; tail -5 $OUT/tp2.log
