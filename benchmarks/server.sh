#!/bin/bash
# The same engine offline and behind `jaxpaged serve` (API processes + engine-core
# process), on one H200: Llama-3-8B shape, bf16, dummy weights, max_num_seqs 512, async
# scheduling. The server runs --api-server-count $API_SERVERS (default 4 of the host's 16 CPU
# cores; one Python API process cannot stream 16k tok/s). Logs and JSON in $OUT; one table at
# the end (benchmarks/lib/server_summary.py).
#   bash benchmarks/server.sh           # H200 (about 6-8 minutes)
#   API_SERVERS=1 bash benchmarks/server.sh   # the one-API-process baseline
#   bash benchmarks/server.sh --smoke   # CPU, stories260k, tiny counts
#   SATURATION_ONLY=1 ...   # only the server's warm-up and saturation runs (diagnosis); every
#   run samples `top` once a second during saturation (which process is busy) into $OUT.
# The saturation run's load comes from $CLIENTS benchmark processes (default 4;
# --num-client-processes), so the client is not what it measures; CLIENTS=1 for one.
# After the server: the request-life trace of the 20 req/s and 16-client loads
# (scripts/trace_request_life.py: the engine-core process alone, driven over its wire; arrival ->
# add -> first scheduled step -> first token, per request) with late scheduling and, for
# comparison, without (TRACE_COMPARE=0 skips that run; TRACE=0 skips the trace). Then
# summarize.py's table, also as summary.json.
set -u
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/server-split}
mkdir -p "$OUT"
PORT=8011
if [ "${1:-}" = "--smoke" ]; then
    API_SERVERS=${API_SERVERS:-2}
    ENGINE="--skip-tokenizer-init --dtype float32 --max-model-len 256 --max-num-seqs 8
        --max-num-batched-tokens 128 --async-scheduling"
    N_SAT=16; IN_SAT=16; OUT_SAT=8; N_RATE=8; RATE=20; IN_RATE=32; OUT_RATE=8
    N_CONC=8; CONC=4; IN_CONC=16; OUT_CONC=8; WAIT=300
else
    API_SERVERS=${API_SERVERS:-4}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
    ENGINE="--model benchmarks/configs/llama-3-8b --load-format dummy --skip-tokenizer-init
        --dtype bfloat16 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 4096
        --gpu-memory-utilization 0.9 --async-scheduling"
    N_SAT=1000; IN_SAT=128; OUT_SAT=128; N_RATE=400; RATE=20; IN_RATE=512; OUT_RATE=128
    N_CONC=160; CONC=16; IN_CONC=50; OUT_CONC=128; WAIT=420
fi
CLI="python3 -m jaxpaged.entrypoints.cli"

# 1. Offline: LLM.generate over the whole batch (the engine's ceiling).
[ "${SATURATION_ONLY:-0}" = 1 ] || $CLI bench throughput $ENGINE --dataset-name random --input-len $IN_SAT --output-len $OUT_SAT \
    --num-prompts $N_SAT --output-json "$OUT/offline.json" > "$OUT/offline.log" 2>&1
grep -E "Throughput|KV cache" "$OUT/offline.log" 2>/dev/null

# 2. The server on the same engine configuration, with $API_SERVERS API processes.
echo "api_server_count $API_SERVERS client_processes ${CLIENTS:-4}" > "$OUT/server-config.txt"
python3 -m jaxpaged.entrypoints.openai.api_server --host 127.0.0.1 --port $PORT $ENGINE \
    --api-server-count $API_SERVERS --uvicorn-log-level warning > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq $WAIT); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" \
        2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -20 "$OUT/server.log"; exit 1; }
    sleep 1
done
metrics() {  # the server's Prometheus text to $OUT/$1.prom (summarize.py diffs the histograms)
    python3 -c "import httpx; print(httpx.get('http://127.0.0.1:$PORT/metrics').text)" \
        > "$OUT/$1.prom" 2>/dev/null
}
bench() {  # name, then benchmark flags
    local name=$1; shift
    metrics "$name.before"
    $CLI bench serve --port $PORT --dataset-name random --ignore-eos --disable-tqdm \
        --save-result --result-dir "$OUT" --result-filename "$name.json" "$@" \
        > "$OUT/$name.log" 2>&1
    metrics "$name.after"
    grep -E "Output token throughput|P99 TTFT|Mean TPOT|P99 TPOT|Failed" "$OUT/$name.log"
}
bench warmup --num-prompts 64 --random-input-len $IN_SAT --random-output-len $OUT_SAT \
    --request-rate inf
ps -eo pid,cputime,etime,args --sort=-cputime | head -15 > "$OUT/ps_before_saturation.txt"
top -b -d 1 -w 250 > "$OUT/top_saturation.txt" 2>&1 &
TOP=$!
bench saturation --num-prompts $N_SAT --random-input-len $IN_SAT --random-output-len $OUT_SAT \
    --request-rate inf --num-client-processes ${CLIENTS:-4}
kill $TOP
ps -eo pid,cputime,etime,args --sort=-cputime | head -15 > "$OUT/ps_after_saturation.txt"
if [ "${SATURATION_ONLY:-0}" = 1 ]; then
    kill -INT $SERVER; wait $SERVER; exit 0
fi
bench rate20 --num-prompts $N_RATE --random-input-len $IN_RATE --random-output-len $OUT_RATE \
    --request-rate $RATE
bench concurrent16 --num-prompts $N_CONC --random-input-len $IN_CONC \
    --random-output-len $OUT_CONC --request-rate inf --max-concurrency $CONC
kill -INT $SERVER; wait $SERVER
if [ "${TRACE:-1}" = 1 ]; then
    COMPARE=$([ "${TRACE_COMPARE:-1}" = 1 ] && echo --compare)
    python3 -m scripts.trace_request_life $ENGINE --warmup-prompts 32 $COMPARE \
        --load rate20:n=$N_RATE,rate=$RATE,in=$IN_RATE,out=$OUT_RATE \
        --load concurrent16:n=$N_CONC,rate=0,concurrency=$CONC,in=$IN_CONC,out=$OUT_CONC \
        --out "$OUT/trace.json" > "$OUT/trace.log" 2>&1
    grep -E "^==|^lag|^device|^core_ttft|^ttft_ms" "$OUT/trace.log"
fi
python3 benchmarks/lib/server_summary.py "$OUT" | tee "$OUT/summary.txt"
