#!/bin/bash
# Sixth session, second H200 call: the kernels fixed after call 1 compiled and checked, the MoE
# tile sweep and decode path, LoRA and quantized-linear layer micro-benchmarks. Logs in $OUT.
export PYTHONPATH=.
set -u
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/pallas_kernels/test_w4a16_matmul.py tests/pallas_kernels/test_lora_bgmv.py \
    tests/pallas_kernels/test_expert_gemv.py tests/pallas_kernels/test_grouped_matmul.py \
    "tests/pallas_kernels/test_ragged_paged_attention.py::TestRaggedPagedAttentionCompiled" \
    -k "compiled or Compiled or False or gpu or GPU" > "$OUT/kernel_tests.log" 2>&1
timeout 200 python3 scripts/benchmark_moe.py --sweep --budget-s 110 \
    --output-json "$OUT/moe_sweep.json" > "$OUT/moe_sweep.log" 2>&1
timeout 100 python3 benchmarks/results/lora/microbench.py --tokens 1 4 16 256 --reps 5 \
    > "$OUT/lora_micro.log" 2>&1
timeout 120 python3 benchmarks/results/quantization/microbench.py --tokens 1,16,256,1024 \
    --iters 10 --methods bf16,fp8,fp8w,int8,int8w,pallas > "$OUT/quant_micro.log" 2>&1
echo done > "$OUT/done.txt"
