#!/bin/bash
# Seventh session, second H200 call (the last of the session's device time): orbax vs safetensors
# load (issue 18), the LoRA fold layout end to end and per layer (issue 15), the 8-bit GEMV
# compiled and timed (issue 14). Each step has its own timeout; logs in $OUT.
export PYTHONPATH=.
set -u
t0=$(date +%s)
el() { echo "$1 rc=$2 $(( $(date +%s) - t0 )) s"; }
mkdir -p "$OUT/rs" "$OUT/lora"
LOADS_ONLY=1 CHECKPOINT_STARTS=0 PAGE_CACHE="${PAGE_CACHE:-dropped warm}" OUT=$OUT/rs \
    timeout 230 bash benchmarks/results/restarts/run.sh > "$OUT/rs_run.log" 2>&1
el restarts $?
OUT=$OUT/lora timeout 235 bash benchmarks/results/lora/run.sh > "$OUT/lora_run.log" 2>&1
el lora_e2e $?
timeout 50 python3 benchmarks/results/lora/microbench.py --tokens 1 16 256 --reps 3 --kernels \
    > "$OUT/lora_micro.log" 2>&1
el lora_micro $?
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_w8_gemv.py \
    > "$OUT/w8_tests.log" 2>&1
el w8_tests $?
timeout 35 python3 benchmarks/results/quantization/microbench.py --tokens 1,16 --iters 10 \
    --methods bf16,fp8,fp8gemv,int8gemv > "$OUT/w8_micro.log" 2>&1
el w8_micro $?
tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/"
