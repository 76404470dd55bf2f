#!/bin/bash
# Multi-LoRA on one H200: Llama-3-8B shapes, bf16, dummy base weights; 1000 requests
# of 128 prompt / 128 output tokens with 8 random rank-16 adapters on all seven projections
# spread round-robin over the requests, vs the base model alone; batch-1 TPOT with one adapter
# vs the base; an XLA micro-benchmark of the batched LoRA matmul. Two processes (one engine
# each), then one table of ratios against the targets (>= 0.8x throughput, <= 15% TPOT
# overhead). Results in $OUT. `bash benchmarks/lora.sh --smoke` runs the same logic on CPU in a minute
# (stories260k, float32, tiny workload).
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/lora_out}
mkdir -p "$OUT"
if [ "${1:-}" = "--smoke" ]; then
    COMMON="--dtype float32 --max-model-len 128 --max-num-seqs 8 --max-num-batched-tokens 64
        --num-prompts 8 --input-len 16 --output-len 8 --tpot-iters 1"
    RANK=8; LIMIT=600
else
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
        > "$OUT/gpu.txt"
    COMMON="--model benchmarks/configs/llama-3-8b --load-format dummy --skip-tokenizer-init
        --dtype bfloat16 --max-model-len 2048 --max-num-seqs 1024 --max-num-batched-tokens 4096
        --gpu-memory-utilization 0.9 --async-scheduling --num-prompts 1000 --input-len 128
        --output-len 128 --tpot-iters 3"
    RANK=16; LIMIT=250
fi
PY=$(command -v python3 || command -v python)
timeout $LIMIT $PY benchmarks/lora.py $COMMON --num-adapters 0 \
    --output-json "$OUT/base.json" > "$OUT/base.log" 2>&1
echo "base: rc=$?"; grep -v "Compiling\|cuda_timer" "$OUT/base.log" | tail -3
timeout $LIMIT $PY benchmarks/lora.py $COMMON --num-adapters 8 --adapter-rank $RANK \
    --micro --output-json "$OUT/lora.json" > "$OUT/lora.log" 2>&1
echo "lora: rc=$?"; grep -v "Compiling\|cuda_timer" "$OUT/lora.log" | tail -9
$PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
base, lora = (json.loads((out / f"{n}.json").read_text()) for n in ("base", "lora"))
tput = lora["output_tokens_per_second"] / base["output_tokens_per_second"]
tpot = lora["batch1_tpot_seconds"] / base["batch1_tpot_seconds"] - 1
rows = [
    ("output tok/s, 8 adapters vs base", f"{base['output_tokens_per_second']:.0f}",
     f"{lora['output_tokens_per_second']:.0f}", f"{tput:.3f}x", ">= 0.80x", tput >= 0.8),
    ("batch-1 TPOT ms, 1 adapter vs base", f"{1e3 * base['batch1_tpot_seconds']:.3f}",
     f"{1e3 * lora['batch1_tpot_seconds']:.3f}", f"{100 * tpot:+.1f}%", "<= +15%", tpot <= 0.15),
]
print(f"{'metric':<36} {'base':>10} {'LoRA':>10} {'ratio':>9} {'target':>9}  ok")
for name, b, l, r, t, ok in rows:
    print(f"{name:<36} {b:>10} {l:>10} {r:>9} {t:>9}  {'yes' if ok else 'NO'}")
print(f"LoRA slot arrays: {lora['lora_slot_bytes'] / 2**20:.1f} MiB, "
      f"slot writes: {lora['slot_writes']}")
for row in lora.get("micro", []):
    print(f"micro {row['projection']:>12} T={row['tokens']:>5}: XLA base "
          f"{row['base_us']:.1f} us, +LoRA {row['lora_us']:.1f} us "
          f"({row['lora_us'] / row['base_us']:.2f}x)")
PYEOF
