#!/bin/bash
# Second half of run.sh (see there): the MoE layer's grouped matmuls at Mixtral-8x7B's shapes
# (scripts/benchmark_moe.py: utilisation at T = 1 .. 4096 against the active-parameter ceiling
# 2 x active params x T / 716 TFLOP/s, next to plain GEMMs and JAX's Mosaic GPU grouped GEMM),
# then Mixtral-8x7B-Instruct (~93 GB of bf16 weights; gpu_memory_utilization 0.9) end to end.
MOE_BENCH=1 MODELS=${MODELS:-"mixtral-8x7b-instruct-v0.1"} PER_MODEL_TIMEOUT=${PER_MODEL_TIMEOUT:-330} \
  bash "$(dirname "$0")/run.sh"
