"""How long a request that first uses a sampling feature holds every other request.

``PYTHONPATH=. python benchmarks/first_use_stalls.py --out stalls.json`` (any machine; the
embedded stories260k by default). On a GPU, Llama-3-8B's shapes with random weights::

    PYTHONPATH=. python benchmarks/first_use_stalls.py --model benchmarks/configs/llama-3-8b \
        --load-format dummy --tokenizer jaxpaged/model_data/stories260k --dtype bfloat16 \
        --max-model-len 2048 --fresh-cache --out stalls.json

The engine runs each step as a compiled program per sampler variant (penalties, top-k / top-p /
min-p, logprobs, prompt logprobs, beams; ``docs/architecture.md``) and batch bucket: the first
request that needs a variant not compiled yet compiles it (or loads it from the persistent
compilation cache) on the engine thread, and every request in flight waits. For each feature,
one server (engine core in its own process, as ``jaxpaged serve`` runs it) gets the feature's
request and, 50 ms later, a plain 4-token completion; then the same pair again. Printed per
feature: the plain request's latency beside the first use and beside the second, against
idle. ``--fresh-cache`` points the persistent compilation cache at an empty directory (a first
deployment); without it, what an earlier run stored is loaded (a restart).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import threading
import time

FEATURES = {
    "logprobs": {"logprobs": 5},
    "top_k": {"top_k": 5, "temperature": 1.0},
    "top_p": {"top_p": 0.9, "temperature": 1.0},
    "min_p": {"min_p": 0.1, "temperature": 1.0},
    "presence_penalty": {"presence_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "logit_bias": {"logit_bias": {"5": 10}},
    "prompt_logprobs": {"prompt_logprobs": 2},
    "n=3": {"n": 3, "temperature": 1.0},
    "beam search": {"use_beam_search": True, "n": 2},
    "logprob_token_ids": {"logprobs": 1, "logprob_token_ids": [5, 6, 7]},
}


def _start(args):
    import uvicorn
    from transformers import AutoTokenizer

    from jaxpaged.config import EngineArgs, default_model_path
    from jaxpaged.engine_core.core_client import EngineCoreClient
    from jaxpaged.entrypoints.openai.api_server import build_app
    from jaxpaged.entrypoints.openai.serve_config import ServeConfig

    model = args.model or default_model_path()
    tokenizer_dir = args.tokenizer or model
    engine_args = EngineArgs(
        model=model, tokenizer=tokenizer_dir, dtype=args.dtype, max_model_len=args.max_model_len,
        load_format=args.load_format,
        compilation_cache_dir=tempfile.mkdtemp(prefix="jaxpaged-xla-") if args.fresh_cache else None,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    client = EngineCoreClient.spawn(engine_args, tokenizer=tokenizer)
    app = build_app(
        client, ServeConfig(served_model_names=["m"], uvicorn_log_level="warning"),
        model=model, tokenizer=tokenizer,
    )  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def _timed(http, fields: dict) -> float:
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    start = time.perf_counter()
    response = http.post("/v1/completions", json=body | fields)
    response.raise_for_status()
    return time.perf_counter() - start


def _beside(http, fields: dict) -> tuple[float, float]:
    """(the feature request's latency, a plain request's sent 50 ms after it)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        feature = pool.submit(_timed, http, fields)
        time.sleep(0.05)
        plain = _timed(http, {})
        return feature.result(), plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: stories260k)")
    parser.add_argument("--tokenizer", default=None, help="(default: the model's; a config-only "
                        "model directory takes stories260k's)")  # fmt: skip
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--fresh-cache", action="store_true", help="an empty compilation cache")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    import httpx

    server, url = _start(args)
    rows = {}
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            for _ in range(3):
                _timed(http, {})
            idle = statistics.median(_timed(http, {}) for _ in range(9))
            for name, fields in FEATURES.items():
                first = _beside(http, fields)
                second = _beside(http, fields)
                rows[name] = {"first_plain_s": first[1], "second_plain_s": second[1]}
                print(f"{name:20s} plain beside its first use {first[1] * 1e3:8.0f} ms, "
                      f"second {second[1] * 1e3:6.0f} ms (idle {idle * 1e3:.0f} ms)", flush=True)  # fmt: skip
    finally:
        server.should_exit = True
    result = {"idle_plain_s": idle, "features": rows, "args": vars(args)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
