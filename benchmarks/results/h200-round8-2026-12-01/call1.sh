#!/bin/bash
# Seventh session, first H200 call: the 8-bit GEMV compiled and timed (issue 14), the server
# split with four benchmark client processes (issue 13), cold/warm start with the config cache
# (issue 18). Logs in $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
set -u
date +%s > "$OUT/t0.txt"
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_w8_gemv.py \
    > "$OUT/w8_tests.log" 2>&1
echo "w8 tests rc=$? $(tail -1 $OUT/w8_tests.log) $(( $(date +%s) - $(cat $OUT/t0.txt) )) s"
timeout 120 python3 benchmarks/results/quantization/microbench.py --tokens 1,4,16 --iters 10 \
    --methods bf16,fp8,fp8w,fp8gemv,int8gemv > "$OUT/w8_micro.log" 2>&1
echo "w8 micro rc=$? $(( $(date +%s) - $(cat $OUT/t0.txt) )) s"
mkdir -p "$OUT/ss"
OUT=$OUT/ss timeout 280 bash benchmarks/results/server-split/run.sh > "$OUT/ss_run.log" 2>&1
rc=$?; pkill -INT -f openai.api_server; sleep 3; pkill -9 -f openai.api_server
echo "server split rc=$rc $(( $(date +%s) - $(cat $OUT/t0.txt) )) s"
mkdir -p "$OUT/rs"
STARTS_ONLY=1 OUT=$OUT/rs timeout 150 bash benchmarks/results/restarts/run.sh > "$OUT/rs_run.log" 2>&1
echo "restarts rc=$? $(( $(date +%s) - $(cat $OUT/t0.txt) )) s"
tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/"
