#!/bin/bash
# Every option value that selects a kernel or code path, each on a small engine (2 layers of the
# real config's shapes, dummy weights; stories260k where tokens are compared with HF's), compared
# with the plain-JAX reference path: `jaxpaged bench matrix` (jaxpaged/benchmarks/matrix.py; the
# rows are declared in jaxpaged/benchmarks/matrix_rows.py). One process, one row per
# configuration: compiled, matches, max |delta logprob|, start-up s, compile s, step ms. Table on
# stdout and in $OUT/table.txt, JSON in $OUT/matrix.json (rewritten after every row, so a run cut
# short keeps its rows), progress and engine logs in $OUT/matrix.log.
#   bash benchmarks/matrix.sh                          # every row, one H200
#   ONLY="kv-fp8 awq" bash benchmarks/matrix.sh        # rows whose name contains one of these
#   SMOKE=1 ONLY=llama3-bf16 bash benchmarks/matrix.sh # tiny shapes (--shrink), on CPU
#   RESUME=1 bash benchmarks/matrix.sh                 # keep $OUT/matrix.json's rows, run the rest
# CACHE: the persistent compilation cache the rows share (default $OUT/xla-cache; identical
# programs compile once, and a re-run compiles nothing: delete it to time compiles again).
# LIMIT: seconds before the walk is stopped (default: none); its rows so far stay in the JSON.
# WORKERS: processes sharing the GPU, each compiling its own rows (default 4; 1 with SMOKE=1 or
# RESUME=1). The first GPU run (H100, one process) took ~30 s a row, mostly compiling on the host.
set -u
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/matrix_out}
CACHE=${CACHE:-$OUT/xla-cache}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
EXTRA=""
[ "${SMOKE:-0}" = 1 ] && EXTRA="--shrink"
PY=$(command -v python3 || command -v python)
# shellcheck disable=SC2086
WORKERS=${WORKERS:-4}
[ "${SMOKE:-0}" = 1 ] && WORKERS=1
[ "${RESUME:-0}" = 1 ] && EXTRA="$EXTRA --resume" && WORKERS=1
[ "$WORKERS" -gt 1 ] && EXTRA="$EXTRA --workers $WORKERS"
${LIMIT:+timeout $LIMIT} $PY -m jaxpaged.entrypoints.cli bench matrix --out "$OUT/matrix.json" \
    --compilation-cache-dir "$CACHE" $EXTRA ${ONLY:+--only $ONLY} 2> "$OUT/matrix.log" \
    | tee "$OUT/table.txt"
