#!/bin/bash
# Start-up and load-time figures on one H200 (<= 8 min), Llama-3-8B shapes, bf16:
#   1. cold start (empty compilation cache) and warm start (cache filled) to the first token,
#      each in a fresh process, dummy weights (no weight files: start-up = import + compile);
#      each start's JSON holds its start-up phases and when the background thread had every
#      executable (a warm start loads the first steps' buckets, the rest in the background);
#   2. random Llama-3-8B weights written as HF safetensors shards on local disk, converted with
#      `jaxpaged convert`, then weights -> device in fresh processes, safetensors vs orbax: first
#      with the page cache dropped (where the machine allows it), then again at once with the
#      files just read (page cache warm: what a notebook restart sees);
#   3. warm start to the first token from each checkpoint (the whole start a user sees).
# No XLA_PYTHON_CLIENT_MEM_FRACTION: the engine sizes JAX's pool from gpu_memory_utilization.
# Prints one table (benchmarks/restarts.py report). `bash benchmarks/restarts.sh --smoke`: the same steps
# on CPU with a tiny config (seconds). STARTS_ONLY=1: step 1 only;
# LOADS_ONLY=1: steps 2-3 only.
set -u
export PYTHONPATH=.
PY=${PY:-python3}
B="$PY benchmarks/restarts.py"
if [ "${1:-}" = "--smoke" ]; then
  OUT=${OUT:-/tmp/restarts_smoke_out}
  WORK=$(mktemp -d)
  export JAX_PLATFORMS=cpu
  mkdir -p $WORK/config
  cat > $WORK/config/config.json <<'JSON'
{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
 "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
 "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
 "tie_word_embeddings": false, "model_type": "llama", "torch_dtype": "float32"}
JSON
  CONFIG=$WORK/config
  DT=float32
  ENGINE="--dtype $DT --max-model-len 128 --max-num-seqs 4 --max-num-batched-tokens 32"
  T=120
else
  WORK=${WORK:-/tmp/restarts_work}
  CONFIG=benchmarks/configs/llama-3-8b
  DT=bfloat16
  ENGINE="--dtype $DT --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048"
  T=150
  mkdir -p $OUT
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt 2>&1
fi
mkdir -p $OUT $WORK
rm -rf $WORK/cache $WORK/st $WORK/orbax
now() { date +%s.%N; }
drop_caches() { sync; (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null && echo dropped || echo kept; }

# 1. cold / warm start, dummy weights, one compilation cache (LOADS_ONLY=1 skips it).
for run in $([ "${LOADS_ONLY:-0}" = 1 ] || echo cold warm); do
  timeout $T $B start --model $CONFIG --load-format dummy --cache $WORK/cache $ENGINE \
    --json $OUT/start_$run.json --launched-at $(now) > $OUT/start_$run.log 2>&1
  echo "[start $run] rc=$? $(tail -c 300 $OUT/start_$run.log | tr '\n' ' ' | cut -c1-300)"
done
du -sh $WORK/cache > $OUT/cache_size.txt 2>&1
if [ "${STARTS_ONLY:-0}" = 1 ]; then  # step 1 only (when device time is short)
  cat $OUT/cache_size.txt; rm -rf $WORK; $B report $OUT | tee $OUT/table.txt; exit 0
fi

# 2. safetensors checkpoint, convert, load each in a fresh process.
timeout $T $B write-checkpoint --config $CONFIG --out $WORK/st --dtype $DT > $OUT/write.log 2>&1
echo "[write] rc=$? $(tail -1 $OUT/write.log)"
t0=$(now)
timeout $T $PY -m jaxpaged.entrypoints.cli convert $WORK/st $WORK/orbax --dtype $DT \
  > $OUT/convert.log 2>&1
rc=$?
echo "{\"seconds\": $($PY -c "print($(now) - $t0)")}" > $OUT/convert.json
echo "[convert] rc=$rc $(tail -1 $OUT/convert.log)"
du -sh $WORK/st $WORK/orbax > $OUT/checkpoint_sizes.txt 2>&1
for fmt in safetensors orbax; do
  dir=$WORK/st; [ $fmt = orbax ] && dir=$WORK/orbax
  state=$(drop_caches)
  echo "page cache before load_${fmt}_dropped: $state" >> $OUT/page_cache.txt
  for cache in ${PAGE_CACHE:-dropped warm}; do  # PAGE_CACHE=dropped: the first only
    [ $cache = dropped ] && label=$state || label=warm
    timeout $T $B load --model $dir --dtype $DT --page-cache $label \
      --json $OUT/load_${fmt}_$cache.json --launched-at $(now) > $OUT/load_${fmt}_$cache.log 2>&1
    echo "[load $fmt, page cache $label] rc=$? $(tail -c 300 $OUT/load_${fmt}_$cache.log | tr '\n' ' ')"
  done
done

# 3. warm start from each checkpoint (compilation cache filled by step 1: same shapes);
#    CHECKPOINT_STARTS=0 skips it (when device time is short).
for fmt in $([ "${CHECKPOINT_STARTS:-1}" = 0 ] || echo safetensors orbax); do
  dir=$WORK/st; [ $fmt = orbax ] && dir=$WORK/orbax
  echo "page cache before start_$fmt: $(drop_caches)" >> $OUT/page_cache.txt
  timeout $T $B start --model $dir --cache $WORK/cache $ENGINE \
    --json $OUT/start_${fmt}_warm.json --launched-at $(now) > $OUT/start_${fmt}_warm.log 2>&1
  echo "[start $fmt warm] rc=$? $(tail -c 200 $OUT/start_${fmt}_warm.log | tr '\n' ' ')"
done
cat $OUT/page_cache.txt $OUT/cache_size.txt $OUT/checkpoint_sizes.txt
rm -rf $WORK
$B report $OUT | tee $OUT/table.txt
