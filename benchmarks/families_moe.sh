#!/bin/bash
# Second half of families.sh (see there): the MoE layer's grouped matmuls at Mixtral-8x7B's shapes
# (benchmarks/moe.py: both grouped_matmul backends at T = 1 .. 4096 against the
# active-parameter ceiling 2 x active params x T / 716 TFLOP/s, next to plain GEMMs), then
# Mixtral-8x7B-Instruct (~93 GB of bf16 weights; gpu_memory_utilization 0.9) and Phi-3-mini-4k
# end to end.
MOE_BENCH=1 MODELS=${MODELS:-"mixtral-8x7b-instruct-v0.1 phi-3-mini-4k-instruct"} \
  bash "$(dirname "$0")/families.sh"
