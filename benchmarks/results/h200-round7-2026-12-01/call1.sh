#!/bin/bash
# Sixth session, first H200 call: compiled kernel checks, kernel tables, layer micro-benchmarks,
# import-time profile. Every log goes straight to $OUT.
export PYTHONPATH=.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
git rev-parse HEAD >> "$OUT/gpu.txt" 2>/dev/null
python3 -X importtime -c "import jaxpaged; from jaxpaged import LLM" 2> "$OUT/importtime.txt"
( time python3 -c "import jaxpaged; from jaxpaged import LLM" ) 2> "$OUT/import_wall.txt"
( time python3 -c "import torch" ) 2>> "$OUT/import_wall.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/pallas_kernels/test_w4a16_matmul.py tests/pallas_kernels/test_lora_bgmv.py \
    "tests/pallas_kernels/test_paged_attention.py::TestPagedAttentionCompiled" \
    "tests/pallas_kernels/test_ragged_paged_attention.py" -k "compiled or Compiled or False" \
    > "$OUT/kernel_tests.log" 2>&1
timeout 150 python3 benchmarks/results/lora/microbench.py --tokens 1 4 16 256 --reps 5 \
    > "$OUT/lora_micro.log" 2>&1
timeout 150 python3 benchmarks/results/quantization/microbench.py --tokens 1,16,1024 --iters 10 \
    --methods bf16,fp8,int8,awq,pallas > "$OUT/quant_micro.log" 2>&1
timeout 200 python3 scripts/benchmark_kernels.py --out "$OUT/kernels" > "$OUT/kernels.log" 2>&1
echo done > "$OUT/done.txt"
