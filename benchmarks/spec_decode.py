"""Cost of the speculative-decoding pieces that run beside the verify forward, per step.

1. The n-gram proposer (``jaxpaged.spec_decode.ngram_proposer.ngram_propose``, jitted) over a
   ``[B, L]`` token history on the default device, against the same proposals computed on the
   host in Python (``ngram_propose_batch_reference``, what a host proposer without numba costs),
   for B in ``--batch-sizes`` and L in ``--context-lengths``. Histories are repetitive text
   (a 40-token phrase repeated with 10% of tokens changed), so matches are found.
2. The rejection sampler (``rejection_sample``, jitted) on ``[B, K + 1, V]`` random logits with
   one-hot drafts, for the plain sampler variant and with every optional stage
   (penalties, top-k/top-p, logprobs).
3. One EAGLE-3 draft pass (``models.eagle3``, the Llama-3.1-8B head of
   ``benchmarks/configs/eagle3-llama3.1-instruct-8b`` with dummy bf16 weights): one token per
   row at context ``--eagle3-context`` over a paged KV cache, head forward plus the draft
   token (argmax over the draft vocabulary, mapped to target ids). A K-token proposal costs
   about K such passes (pass 1 over the verified tokens is wider).

Each time is the median of ``--iters`` calls after two warm-up calls, with the result on the
host (``block_until_ready``). ``--smoke`` runs tiny sizes (checks the script on CPU).

GPU: ``python benchmarks/spec_decode.py`` (defaults: B 1/64/256, L 2048/8192, K 4,
V 128256).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged.sample.logits_state import allocate_logits_state  # noqa: E402
from jaxpaged.sample.metadata import SamplerVariant, SamplingMetadata  # noqa: E402
from jaxpaged.spec_decode.ngram_proposer import (  # noqa: E402
    ngram_propose,
    ngram_propose_batch_reference,
)
from jaxpaged.spec_decode.rejection_sampler import rejection_sample  # noqa: E402
from models.attention_metadata import AttentionMetadata  # noqa: E402
from models.eagle3 import load_eagle3  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EAGLE3_HEAD = os.path.join(ROOT, "benchmarks", "configs", "eagle3-llama3.1-instruct-8b")


def _time(fn, *args, iters: int) -> float:
    """Median seconds of ``fn(*args)`` (result on the host) after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _histories(batch: int, width: int, rng) -> tuple[np.ndarray, np.ndarray]:
    phrase = rng.integers(0, 32000, 40)
    text = np.resize(phrase, width)
    tokens = np.stack([text.copy() for _ in range(batch)]).astype(np.int32)
    noise = rng.random(tokens.shape) < 0.1
    tokens[noise] = rng.integers(0, 32000, int(noise.sum()))
    lengths = rng.integers(width // 2, width + 1, batch).astype(np.int32)
    return tokens, lengths


def bench_ngram(args) -> None:
    rng = np.random.default_rng(0)
    kwargs = dict(num_speculative_tokens=args.k, min_n=args.min_n, max_n=args.max_n)
    print(f"\nn-gram proposer, K={args.k}, n in [{args.min_n}, {args.max_n}], "
          f"device {jax.devices()[0].device_kind}")  # fmt: skip
    print("| B | L | device, jitted (ms) | host Python (ms) | rows with drafts |")
    print("|---:|---:|---:|---:|---:|")
    for width in args.context_lengths:
        for batch in args.batch_sizes:
            tokens, lengths = _histories(batch, width, rng)
            propose = functools.partial(ngram_propose, **kwargs, max_model_len=width + args.k)
            device = _time(propose, jnp.asarray(tokens), jnp.asarray(lengths), iters=args.iters)
            host = float("nan")
            if batch * width <= args.max_host_tokens:
                start = time.perf_counter()
                want = ngram_propose_batch_reference(
                    tokens, lengths, **kwargs, max_model_len=width + args.k
                )
                host = time.perf_counter() - start
                got = propose(jnp.asarray(tokens), jnp.asarray(lengths))
                if not (np.asarray(got[1]) == want[1]).all():
                    raise RuntimeError("device and host proposals differ")
            drafted = int((np.asarray(propose(tokens, lengths)[1]) > 0).sum())
            print(f"| {batch} | {width} | {device * 1e3:.3f} | {host * 1e3:.1f} | "
                  f"{drafted}/{batch} |")  # fmt: skip


def _metadata(batch: int, *, penalties: bool) -> SamplingMetadata:
    def full(value, dtype):
        return jnp.full(batch, value, dtype)

    return SamplingMetadata(
        temperature=full(1.0, jnp.float32), top_k=full(50 if penalties else 0, jnp.int32),
        top_p=full(0.9 if penalties else 1.0, jnp.float32), min_p=full(0.0, jnp.float32),
        seed_lo=jnp.arange(batch, dtype=jnp.uint32), seed_hi=full(0, jnp.uint32),
        step=full(0, jnp.int32), presence_penalty=full(0.1 if penalties else 0.0, jnp.float32),
        frequency_penalty=full(0.0, jnp.float32),
        repetition_penalty=full(1.1 if penalties else 1.0, jnp.float32),
        state_slot=jnp.arange(batch, dtype=jnp.int32) if penalties else full(batch, jnp.int32),
        suppress_stop=full(0, jnp.int32), count_sampled=full(1, jnp.int32),
        num_logprobs=full(-1, jnp.int32), logprobs_mode=full(0, jnp.int32),
        prompt_target=jnp.full(batch, -1, jnp.int32),
    )  # fmt: skip


def bench_rejection(args) -> None:
    rng = np.random.default_rng(1)
    k, vocab = args.k, args.vocab_size
    variants = {
        "plain": SamplerVariant(),
        "penalties+filters+logprobs": SamplerVariant(uses_state=True, filters=True, logprobs=True),
    }
    print(f"\nrejection sampler, K={k}, V={vocab}, one-hot drafts")
    print("| B | " + " | ".join(f"{name} (ms)" for name in variants) + " |")
    print("|---:|" + "---:|" * len(variants))
    for batch in args.batch_sizes:
        logits = jnp.asarray(rng.normal(0, 3, (batch, k + 1, vocab)).astype(np.float32))
        drafts = jnp.asarray(rng.integers(0, vocab, (batch, k)).astype(np.int32))
        num_draft = jnp.full(batch, k, jnp.int32)
        state = allocate_logits_state(batch, vocab)
        row = []
        for name, variant in variants.items():
            metadata = _metadata(batch, penalties=name != "plain")
            run = jax.jit(functools.partial(rejection_sample, variant=variant, num_logprobs=5))
            row.append(_time(run, logits, drafts, num_draft, metadata, state, iters=args.iters))
        print(f"| {batch} | " + " | ".join(f"{t * 1e3:.3f}" for t in row) + " |")


def bench_eagle3(args) -> None:
    import flax.nnx as nnx

    import pallas_kernels

    backend = "pallas" if jax.default_backend() == "gpu" else "reference"
    head = load_eagle3(args.eagle3_head, target_vocab_size=args.eagle3_vocab, dtype="bfloat16",
                       load_format="dummy", attention_backend=backend)  # fmt: skip
    config = head.config.hf
    hidden = config.hidden_size
    hkv, d = config.num_key_value_heads, hidden // config.num_attention_heads
    graphdef, state = nnx.split(head)
    block_size, context = 16, args.eagle3_context
    per_seq = -(-(context + 1) // block_size)

    @jax.jit
    def draft_pass(state, ids, features, positions, kv, metadata, embed):
        model = nnx.merge(graphdef, state)
        normed, prenorm, kv = model(ids, features, positions, kv, metadata, embed_tokens=embed)
        return model.draft_token_ids(normed), prenorm, kv

    embed = jnp.zeros((args.eagle3_vocab, hidden), jnp.bfloat16)
    print(f"\nEAGLE-3 draft pass (hidden {hidden}, draft vocab {head.config.draft_vocab_size}), "
          f"context {context}, attention {backend}")  # fmt: skip
    print("| B | one draft token per row (ms) |")
    print("|---:|---:|")
    for batch in args.batch_sizes:
        shape = pallas_kernels.kv_cache_shape(batch * per_seq + 1, block_size, hkv, d)
        kv = (jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
        tables = 1 + np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
        metadata = AttentionMetadata(
            slot_mapping=jnp.asarray(tables[:, context // block_size] * block_size
                                     + context % block_size),
            block_tables=jnp.asarray(tables), seq_lens=jnp.full(batch, context + 1, jnp.int32),
            cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32), decode_only=True,
        )  # fmt: skip
        ids = jnp.zeros(batch, jnp.int32)
        features = jnp.zeros((batch, hidden), jnp.bfloat16)
        positions = jnp.full(batch, context, jnp.int32)
        args_ = (state, ids, features, positions, kv, metadata, embed)
        seconds = _time(draft_pass, *args_, iters=args.iters)
        print(f"| {batch} | {seconds * 1e3:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--max-n", type=int, default=5, help="prompt_lookup_max")
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--max-host-tokens", type=int, default=256 * 2048,
        help="skip the host Python reference above B * L tokens (it takes seconds)",
    )  # fmt: skip
    parser.add_argument("--skip-rejection", action="store_true")
    parser.add_argument("--skip-eagle3", action="store_true")
    parser.add_argument("--eagle3-head", default=EAGLE3_HEAD, help="the head's config directory")
    parser.add_argument("--eagle3-vocab", type=int, default=128256, help="the target's vocab")
    parser.add_argument("--eagle3-context", type=int, default=1024, help="tokens in the KV")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script")
    args = parser.parse_args()
    if args.smoke:
        args.batch_sizes, args.context_lengths, args.vocab_size, args.iters = [1, 4], [64], 97, 2
        args.eagle3_head, args.eagle3_vocab, args.eagle3_context = _tiny_head(), 97, 40
    bench_ngram(args)
    if not args.skip_rejection:
        bench_rejection(args)
    if not args.skip_eagle3:
        bench_eagle3(args)


def _tiny_head() -> str:
    """A tiny EAGLE-3 head config (``--smoke``) in a temporary directory."""
    import json
    import tempfile

    with open(os.path.join(EAGLE3_HEAD, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, draft_vocab_size=40)  # fmt: skip
    directory = tempfile.mkdtemp(prefix="eagle3-smoke-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


if __name__ == "__main__":
    main()
