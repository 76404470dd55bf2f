"""Start-up and load-time benchmark: cold vs warm start (compilation cache), orbax vs safetensors.

Each measurement runs in a fresh process, started by ``benchmarks/restarts.sh``:

    python benchmarks/restarts.py write-checkpoint --config DIR --out CKPT --dtype bfloat16
    python benchmarks/restarts.py start --model DIR --cache CACHE --json OUT.json \
        --launched-at "$(date +%s.%N)" [engine flags]
    python benchmarks/restarts.py load --model CKPT --json OUT.json --launched-at ...
    python benchmarks/restarts.py report RESULTS_DIR

``start`` builds an ``LLM`` and generates one token; it reports seconds from the process launch
(``--launched-at``, the shell's clock just before ``python`` started) to the first token, the
engine construction time, its start-up phases (``LLMEngine.startup``: backend, config/tokenizer,
weights, memory profiling, executables loaded / compiled / left to the background thread, KV
allocation), the time until the background thread has every bucket, and the XLA compilations it
needed (``CompileCounter``, background included). ``load`` times only the weights reaching the
device through the paths the engine takes (``models.weights.load_model`` for safetensors,
``load_orbax_model`` for a converted directory, then ``block_until_ready``; the config is read
first and timed apart, ``config_s``, as the engine reads it before the weights; ``load_cpu_s``: the
process's CPU seconds meanwhile, all threads); ``run.sh`` runs it with the page cache dropped and again right after (the files just read: a notebook restart).
``write-checkpoint`` writes random weights of the config's real shapes as HF safetensors shards
(``model-0000i-of-0000n.safetensors`` + index), the layout the loader reads.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: import time counts towards a start

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

SHARD_BYTES = 5 * 2**30


def _hf_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama checkpoint's tensors (HF ``LlamaForCausalLM``)."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (heads * d, h)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * d, h)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * d, h)),
            (f"{p}.self_attn.o_proj.weight", (h, heads * d)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h)))
    return out


def write_checkpoint(args) -> None:
    """Random ``normal * 0.02`` weights (norms: ones) as HF safetensors shards + config."""
    import safetensors.torch
    import torch

    with open(os.path.join(args.config, "config.json")) as f:
        config = json.load(f)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    tensors = _hf_tensors(config)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    shards, current, size = [], {}, 0
    for name, shape in tensors:
        nbytes = itemsize * int(torch.Size(shape).numel())
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = shape
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for name, shape in shard.items():
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            else:
                t = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
                t = (t * 0.02).to(dtype).cpu()
            data[name] = t
            weight_map[name] = file
            total += t.numel() * t.element_size()
        safetensors.torch.save_file(data, os.path.join(args.out, file))
        del data
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config["torch_dtype"] = args.dtype
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {total / 2**30:.2f} GiB in {len(shards)} shards to {args.out}", flush=True)


def start(args) -> None:
    """Launch -> first token of a fresh ``LLM``; compilations counted."""
    logging.basicConfig(level=logging.INFO)  # the engine's start-up line goes to the log
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.worker.compilation_cache import CompileCounter

    t_imported = time.time()
    kwargs = dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        load_format=args.load_format,
        skip_tokenizer_init=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=False,  # compile every bucket at start-up (the GPU default)
    )
    if args.cache:
        kwargs["compilation_cache_dir"] = args.cache
    else:
        kwargs["enable_compilation_cache"] = False
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    with CompileCounter() as counter:
        llm = LLM(args.model, **kwargs)
        t_built = time.time()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False)
        t_first = time.time()
        llm.llm_engine.wait_for_executables()  # the warm start's background loads
        t_all = time.time()
    engine = llm.llm_engine
    result = dict(
        model=args.model,
        load_format=args.load_format,
        cache=args.cache,
        launch_to_first_token_s=t_first - args.launched_at,
        python_start_s=T_START - args.launched_at,
        import_s=t_imported - T_START,
        construct_s=t_built - t_imported,
        first_token_s=t_first - t_built,
        compile_seconds=engine.worker.compile_seconds,
        startup_phases=engine.startup.as_dict(),
        executables_loaded=engine.worker.executables_loaded,
        executables_compiled=engine.worker.executables_compiled,
        executables_deferred=engine.worker.executables_deferred,
        launch_to_all_executables_s=t_all - args.launched_at,
        xla_compilations=counter.compiled,
        cache_hits=counter.cache_hits,
        buckets=len(engine.worker.model_runner.all_bucket_keys()),
        first_token=list(out[0].outputs[0].token_ids),
        kv_cache_report=engine.kv_cache_report(),
        compilation_cache_dir=engine.compilation_cache_dir,
    )
    _write(args.json, result)


def load(args) -> None:
    """Weights to the device only: safetensors (``load_model``) or orbax (``load_orbax_model``)."""
    import jax

    from jaxpaged.worker.memory_pool import configure_memory_pool
    from models.orbax_checkpoint import is_orbax_checkpoint, load_orbax_model
    from models.weights import load_config, load_model

    configure_memory_pool(0.9)
    t_imported = time.time()
    orbax = is_orbax_checkpoint(args.model)
    loader = load_orbax_model if orbax else load_model
    jax.devices()
    t_backend = time.time()
    # The engine reads the config before the weights (LLMEngine; a warm start from its cache):
    # timed apart, so that importing transformers (and PyTorch) is not counted as loading.
    hf_config = load_config(args.model)
    t_config, cpu_config = time.time(), time.process_time()
    model, _ = loader(args.model, dtype=args.dtype, hf_config=hf_config)
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    t_loaded, cpu_loaded = time.time(), time.process_time()
    _write(
        args.json,
        dict(
            model=args.model,
            format="orbax" if orbax else "safetensors",
            page_cache=args.page_cache,
            load_s=t_loaded - t_config,
            load_cpu_s=cpu_loaded - cpu_config,
            config_s=t_config - t_backend,
            backend_start_s=t_backend - t_imported,
            launch_to_loaded_s=t_loaded - args.launched_at,
            gib=sum(x.nbytes for x in leaves) / 2**30,
        ),
    )


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)


def report(args) -> None:
    """One table: each measurement, its target and the ratio."""
    d = args.results

    def read(name):
        path = os.path.join(d, name)
        return json.load(open(path)) if os.path.isfile(path) else None

    cold, warm = read("start_cold.json"), read("start_warm.json")
    st_e2e, ob_e2e = read("start_safetensors_warm.json"), read("start_orbax_warm.json")
    convert = read("convert.json")
    rows = []
    if cold:
        rows.append(("cold start to first token (s)", cold["launch_to_first_token_s"], "", ""))
        rows.append(("  cold: XLA compilations", cold["xla_compilations"], "", ""))
    if warm:
        ratio = cold["launch_to_first_token_s"] / warm["launch_to_first_token_s"] if cold else 0
        rows.append(("warm start to first token (s)", warm["launch_to_first_token_s"], "<= 12",
                     f"{12 / warm['launch_to_first_token_s']:.2f}x of target; {ratio:.1f}x faster"))  # fmt: skip
        rows.append(("  warm: XLA compilations", warm["xla_compilations"], "0", ""))
        if cold:
            same = warm["first_token"] == cold["first_token"]
            rows.append(("  warm first token == cold", str(same), "True", ""))
    if convert:
        rows.append(("jaxpaged convert (s)", convert["seconds"], "", ""))
    for cache in ("dropped", "warm"):
        st, ob = read(f"load_safetensors_{cache}.json"), read(f"load_orbax_{cache}.json")
        if st and ob:
            name = f"page cache {cache}" if cache == "warm" else f"page cache {st['page_cache']}"
            rows.append((f"load safetensors, {name} (s)", st["load_s"], "",
                         f"{st['gib']:.1f} GiB, {st['gib'] / st['load_s']:.2f} GiB/s"))  # fmt: skip
            rows.append((f"load orbax, {name} (s)", ob["load_s"], ">= 2x faster",
                         f"{st['load_s'] / ob['load_s']:.2f}x faster, "
                         f"{ob['gib'] / ob['load_s']:.2f} GiB/s"))  # fmt: skip
    if st_e2e and ob_e2e:
        rows.append(("warm start, safetensors (s)", st_e2e["launch_to_first_token_s"], "", ""))
        rows.append(("warm start, orbax (s)", ob_e2e["launch_to_first_token_s"], "",
                     f"{st_e2e['launch_to_first_token_s'] / ob_e2e['launch_to_first_token_s']:.2f}x"))  # fmt: skip
    print(f"{'measurement':42s} {'value':>10s}  {'target':>13s}  ratio")
    for name, value, target, ratio in rows:
        shown = f"{value:10.2f}" if isinstance(value, float) else f"{value!s:>10s}"
        print(f"{name:42s} {shown}  {target:>13s}  {ratio}")
    for name in ("start_cold.json", "start_warm.json", "start_safetensors_warm.json",
                 "start_orbax_warm.json"):  # fmt: skip
        r = read(name)
        if r:
            phases = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in r["startup_phases"].items()
                               if v is not None)  # fmt: skip
            print(f"{name}: import {r['import_s']:.1f} s, construct {r['construct_s']:.1f} s "
                  f"(executables {r['executables_loaded']} loaded, {r['executables_compiled']} "
                  f"compiled, {r['executables_deferred']} in the background, all there "
                  f"{r['launch_to_all_executables_s']:.1f} s after launch), first token "
                  f"{r['first_token_s']:.2f} s, {r['buckets']} buckets; phases (s): {phases}; "
                  f"{r['kv_cache_report']}")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-checkpoint")
    w.add_argument("--config", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--dtype", default="bfloat16")
    s = sub.add_parser("start")
    s.add_argument("--model", required=True)
    s.add_argument("--cache", default="", help="compilation cache dir; empty: cache off")
    s.add_argument("--json", required=True)
    s.add_argument("--launched-at", type=float, required=True)
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--load-format", default="auto")
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=2048)
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--enforce-eager", action="store_true")
    ld = sub.add_parser("load")
    ld.add_argument("--model", required=True)
    ld.add_argument("--json", required=True)
    ld.add_argument("--launched-at", type=float, required=True)
    ld.add_argument("--dtype", default="bfloat16")
    ld.add_argument("--page-cache", default="", help="recorded as is: dropped, kept, warm")
    r = sub.add_parser("report")
    r.add_argument("results")
    args = parser.parse_args(argv)
    {"write-checkpoint": write_checkpoint, "start": start, "load": load, "report": report}[
        args.command
    ](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
