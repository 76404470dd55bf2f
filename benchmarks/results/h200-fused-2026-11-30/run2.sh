#!/bin/bash
# Second profiling call: traces (device kernels + host dispatch) of batch-1 decode (GPU 0, with
# the optimized HLO dumped) and of the 128/128 workload (GPU 1); everything in one tarball.
set -u
export PYTHONPATH=.
C=benchmarks/configs/llama-3-8b
COMMON="--model $C --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.9 --async-scheduling"
R=$OUT/r; mkdir -p $R
(XLA_FLAGS="--xla_dump_to=$R/hlo --xla_dump_hlo_module_re=.*step.* --xla_dump_hlo_as_text" \
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 scripts/profile_step.py $COMMON \
  --max-num-seqs 8 --max-num-batched-tokens 512 --workload latency --latency-iters 3 \
  --trace-dir $R/trace_latency --trace-start 16 --trace-steps 32 \
  --output-json $R/latency.json > $R/latency.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 240 python3 scripts/profile_step.py $COMMON \
  --max-num-seqs 1024 --max-num-batched-tokens 4096 --workload random \
  --trace-dir $R/trace_random --trace-start 24 --trace-steps 24 \
  --output-json $R/random.json > $R/random.log 2>&1) &
wait
tar czf $OUT/r.tgz -C $OUT r
grep -v "Compiling\|cuda_timer" $R/latency.log | tail -45
grep -v "Compiling\|cuda_timer" $R/random.log | tail -30
