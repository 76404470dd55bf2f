#!/bin/bash
# Profiling call of the third session (2 x H200): batch-1 decode under three command-buffer
# settings on GPU 0; the 128/128 and ShareGPT-like workloads with default and finer step
# buckets on GPU 1. Writes logs, JSON and traces under $OUT.
set -u
export PYTHONPATH=.
C=benchmarks/configs/llama-3-8b
COMMON="--model $C --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.9 --async-scheduling"
SMALL="--max-num-seqs 8 --max-num-batched-tokens 512"
BIG="--max-num-seqs 1024 --max-num-batched-tokens 4096"
CB_ALL="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
XLA_FLAGS=--help CUDA_VISIBLE_DEVICES=0 python3 -c "import jax; print(jax.devices())" 2>&1 \
    | grep -i -A2 "command_buffer\|graph_min\|graph_level" > $OUT/xla_flags_help.txt

gpu0() {
  for v in default cb_off cb_all; do
    case $v in default) F="";; cb_off) F="--xla_gpu_enable_command_buffer=";; cb_all) F="$CB_ALL";; esac
    XLA_FLAGS="$F" CUDA_VISIBLE_DEVICES=0 timeout 200 python3 scripts/profile_step.py $COMMON $SMALL \
      --workload latency --latency-iters 3 --trace-dir $OUT/trace_latency_$v --trace-start 16 \
      --trace-steps 32 --output-json $OUT/latency_$v.json > $OUT/latency_$v.log 2>&1
    tail -25 $OUT/latency_$v.log | sed "s/^/[lat $v] /"
  done
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 scripts/profile_step.py $COMMON $BIG \
    --workload sharegpt-synthetic --output-json $OUT/sharegpt_default.json > $OUT/sharegpt_default.log 2>&1
  tail -4 $OUT/sharegpt_default.log | sed "s/^/[sgpt default] /"
}
gpu1() {
  CUDA_VISIBLE_DEVICES=1 timeout 220 python3 scripts/profile_step.py $COMMON $BIG \
    --workload random --trace-dir $OUT/trace_random --trace-start 24 --trace-steps 24 \
    --output-json $OUT/random_default.json > $OUT/random_default.log 2>&1
  tail -25 $OUT/random_default.log | sed "s/^/[rand default] /"
  CUDA_VISIBLE_DEVICES=1 timeout 220 python3 scripts/profile_step.py $COMMON $BIG \
    --seq-bucket-gap 128 --token-bucket-gap 256 --workload sharegpt-synthetic \
    --output-json $OUT/sharegpt_fine.json > $OUT/sharegpt_fine.log 2>&1
  tail -4 $OUT/sharegpt_fine.log | sed "s/^/[sgpt fine] /"
}
gpu0 > $OUT/gpu0.out 2>&1 &
gpu1 > $OUT/gpu1.out 2>&1 &
wait
cat $OUT/xla_flags_help.txt | cut -c1-250
cat $OUT/gpu0.out $OUT/gpu1.out
