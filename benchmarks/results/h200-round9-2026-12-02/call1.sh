#!/bin/bash
# Eighth session, the only H200 call (251 s of device time were left): FP8 W8A8 + FP8 KV cache
# on the Llama-3-8B shape (dummy weights, online FP8), 1000 x 128/128 timed, then a second pass
# of the same workload with engine steps 60-67 (decode at 512 running) traced and summarized
# (issue 14: where the time goes). Engine configuration as benchmarks/results/quantization/run.sh.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout "${LIMIT:-170}" python3 scripts/profile_step.py --model benchmarks/configs/llama-3-8b \
    --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 \
    --max-num-seqs 512 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.9 \
    --async-scheduling --quantization fp8 --kv-cache-dtype fp8 \
    --workload random --num-prompts 1000 --input-len 128 --output-len 128 \
    --trace-dir /tmp/fp8_trace --trace-start 60 --trace-steps 8 \
    --output-json "$OUT/fp8_profile.json" > "$OUT/fp8_profile.log" 2>&1
echo "profile_step rc=$?" >> "$OUT/fp8_profile.log"
