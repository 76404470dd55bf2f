#!/bin/bash
# The first GPU call: the whole GPU story of one tree in priority order, each step time-boxed,
# resumable, all results as JSON, one table at the end. Whoever gets a GPU runs this first and
# commits its results.json under benchmarks/results/figures/ (docs/benchmarks.md's current table
# is rendered from there: `python benchmarks/render.py --write`).
#
# Steps in priority order, each with its time box in seconds (STEPS overrides the list). A step
# gets the smaller of its box and the time left before DEADLINE_S (counted from this script's
# start, less 15 s for the table and the archive); one that would get under 60 s is deferred.
# The boxes assume cold compilation caches: every GPU call starts on a bare machine. All steps
# share the engine's default persistent cache (~/.cache/jaxpaged/xla), so later steps on the bf16
# engine's flags (structured, server) load its buckets from what the bf16 step compiled in the
# same call. A step past its box is stopped with SIGABRT first: its log then ends with every
# Python thread's stack (PYTHONFAULTHANDLER), i.e. where the time went.
#   bf16         200  Llama-3-8B shape, dummy weights, bf16, max_num_seqs 512, async scheduling:
#                     1000 x 128/128 output tok/s, batch-1 TPOT 128/128, start-up, first token
#   fp8          150  the same with online FP8 weights and an FP8 KV cache
#   int8         150  INT8 W8A8 (compressed-tensors config), linear_backend auto
#   awq          120  W4A16 AWQ, linear_backend auto
#   gptq         120  W4A16 GPTQ, linear_backend auto
#   structured   150  every request under a JSON schema vs none: throughput, batch-1 TPOT
#   weight_sync  150  update_weights, sleep / wake_up, throughput before and after
#   server       240  jaxpaged serve, 4 API processes: served / offline, P99 TTFT / TPOT at 20 req/s
#   matrix       rest every option value's 2-layer engine against the reference (4 workers)
STEPS=${STEPS:-"bf16:200 fp8:150 int8:150 awq:120 gptq:120 structured:150 weight_sync:150 server:240 matrix:rest"}
DEADLINE_S=${DEADLINE_S:-560}  # one GPU call runs at most 600 s
#
#   bash benchmarks/gpu.sh                    # GPU: results in $OUT (results.json, table.txt,
#                                             # logs.tar.gz); step outputs in $WORK
#   RESUME=old/results.json bash benchmarks/gpu.sh   # keep its ok steps (same device), run the rest
#   bash benchmarks/gpu.sh --smoke            # CPU: the same steps on tiny configs and counts
# Environment: OUT (default /tmp/gpu_out), WORK (default /tmp/gpu_work), RESUME, STEPS,
# DEADLINE_S, TREE (the commit to record when the copy has no .git). With .whl/ in the tree
# (benchmarks/gpu_wheels.sh fills it; the GPU call carries it), its wheels are installed first
# into /tmp/site, the packages the GPU image lacks.
set -u
STARTED=$(date +%s.%N)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
WORK=${WORK:-/tmp/gpu_work}
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then
    SMOKE=--smoke
    STEPS=${SMOKE_STEPS:-"bf16:900 fp8:900 int8:900 awq:900 gptq:900 structured:900 weight_sync:900 server:900 matrix:rest"}
    DEADLINE_S=${SMOKE_DEADLINE_S:-7200}
    OUT=${SMOKE_OUT:-/tmp/gpu_smoke_out}
    WORK=${SMOKE_WORK:-/tmp/gpu_smoke_work}
    export JAX_PLATFORMS=cpu
fi
mkdir -p "$OUT" "$WORK"
PY=$(command -v python3 || command -v python)
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1 && [ -z "$SMOKE" ] \
    && [[ ":${PYTHONPATH:-}:" != *:/tmp/site:* ]]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl > "$WORK/wheels.log" 2>&1 \
        || { echo "wheel install failed (see wheels.log)"; tail -5 "$WORK/wheels.log"; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
[ -z "$SMOKE" ] && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv > "$WORK/gpu.txt" 2>&1
$PY benchmarks/lib/gpu_run.py $SMOKE --steps "$STEPS" --deadline-s "$DEADLINE_S" \
    --started-at "$STARTED" --work "$WORK" --out "$OUT" ${RESUME:+--resume "$RESUME"}
