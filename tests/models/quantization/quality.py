"""Quality of a quantized model against its float32 twin: token agreement and logprob drift.

Two measures over a set of prompts and the float model's greedy continuations (for
stories260k: ``golden.json``'s HF greedy ids, which the float32 model reproduces):

- teacher-forced: prompt + continuation prefilled through both models in one step; at every
  continuation position, whether both models' top-1 token agree, and ``|Δ logprob|`` of the
  float model's greedy token (natural log);
- free-running: each model's own greedy continuation; the fraction of positions equal to the
  float one's, and of sequences equal in full.

Usage (prints the table of ``docs/quantization.md``): ``python -m
tests.models.quantization.quality``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numpy as np

from models.quantization.config import resolve_quantization
from models.weights import load_model
from tests.models.conftest import STORIES_DIR, PagedRunner, Seq

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "..", "data", "stories260k", "golden.json")


@dataclasses.dataclass(frozen=True)
class Quality:
    teacher_forced_agreement: float  # top-1 agreement at the continuation positions
    mean_abs_dlogprob: float  # mean |Δ log p(float's greedy token)|, nats
    max_abs_dlogprob: float
    greedy_token_agreement: float  # free-running: positions equal to the float model's
    greedy_sequences_equal: int  # free-running: whole continuations equal
    num_sequences: int


def make_runner(model, config, token_bucket: int, num_seqs: int) -> PagedRunner:
    """A paged runner for :func:`greedy` and teacher-forced prefills (``config``: HF)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return PagedRunner(
        model, num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim, token_bucket=token_bucket, seq_bucket=num_seqs, max_blocks=32,
        num_blocks=2 * token_bucket // 4 + 8 * num_seqs + 1,
    )  # fmt: skip


def greedy(runner: PagedRunner, prompts: list[list[int]], num_new: int) -> list[Seq]:
    """``PagedRunner.generate``, with every step (the one-token ones too) through the ragged
    prefill path at the runner's one token bucket: one compilation per model (CPU test time)."""
    seqs = [Seq(tokens=[], blocks=[], logits=[]) for _ in prompts]
    runner.run_step(list(zip(seqs, prompts, strict=True)), decode_only=False)
    for _ in range(num_new - 1):
        runner.run_step([(s, [int(np.argmax(s.logits[-1]))]) for s in seqs], decode_only=False)
    for s in seqs:
        s.next_token = int(np.argmax(s.logits[-1]))
    return seqs


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def compare(reference, quantized, prompts: list[list[int]], num_new: int) -> Quality:
    """``reference`` / ``quantized``: ``(model, hf_config)`` from ``load_model``."""
    total = sum(len(p) + num_new for p in prompts)
    runners = {
        key: make_runner(model, config, total, len(prompts))
        for key, (model, config) in (("ref", reference), ("quant", quantized))
    }
    runs = {}
    for key, runner in runners.items():
        free = greedy(runner, prompts, num_new)
        runs[key] = [s.tokens[len(p) :] + [s.next_token] for s, p in zip(free, prompts)]  # noqa: B905
    forced_prompts = [p + c[:-1] for p, c in zip(prompts, runs["ref"], strict=True)]
    logits = {}
    for key, runner in runners.items():  # the same token bucket: no new compilation
        seqs = greedy(runner, forced_prompts, 1)
        logits[key] = [np.stack(s.logits)[len(p) - 1 :] for s, p in zip(seqs, prompts)]  # noqa: B905
    agree, dlogp = [], []
    for ref, quant, cont in zip(logits["ref"], logits["quant"], runs["ref"], strict=True):
        agree.extend(ref.argmax(-1) == quant.argmax(-1))
        rows = np.arange(len(cont))
        dlogp.extend(np.abs(_log_softmax(ref)[rows, cont] - _log_softmax(quant)[rows, cont]))
    equal = [np.mean(np.equal(a, b)) for a, b in zip(runs["ref"], runs["quant"], strict=True)]
    return Quality(
        teacher_forced_agreement=float(np.mean(agree)),
        mean_abs_dlogprob=float(np.mean(dlogp)),
        max_abs_dlogprob=float(np.max(dlogp)),
        greedy_token_agreement=float(np.mean(equal)),
        greedy_sequences_equal=int(sum(e == 1.0 for e in equal)),
        num_sequences=len(prompts),
    )


def stories260k_int8_w8a8(out_dir: str) -> str:
    """stories260k as a compressed-tensors W8A8 INT8 checkpoint (per-channel weights, dynamic
    per-token activations), written by compressed-tensors' own compressor."""
    from tests.models.quantization.checkpoints import (
        compressed_tensors_quantizer,
        quantize_checkpoint,
    )

    quantize, config = compressed_tensors_quantizer(
        dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
        "int-quantized",
    )
    quantize_checkpoint(STORIES_DIR, out_dir, os.path.join(out_dir, "reference"), quantize, config)
    return out_dir


def stories260k_quality(method: str, num_new: int | None = None) -> Quality:
    """``method``: ``"fp8"`` (online FP8, vLLM's) or ``"int8"`` (W8A8 INT8 checkpoint), against
    stories260k in float32 on golden.json's prompts (``num_new``: default its 32 tokens)."""
    with open(GOLDEN) as f:
        golden = json.load(f)
    prompts = [case["prompt_ids"] for case in golden["cases"]]
    num_new = num_new or golden["max_new_tokens"]
    reference = load_model(STORIES_DIR, dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        if method == "fp8":
            quantized = load_model(
                STORIES_DIR, dtype="float32", quant_config=resolve_quantization("fp8", None)
            )
        else:
            quantized = load_model(stories260k_int8_w8a8(tmp), dtype="float32")
    return compare(reference, quantized, prompts, num_new)


if __name__ == "__main__":
    print("| method | teacher-forced top-1 agreement | mean abs dlogprob | max | greedy tokens "
          "equal | sequences equal |\n| --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for name in ("fp8", "int8"):
        q = stories260k_quality(name)
        print(f"| {name} | {q.teacher_forced_agreement:.4f} | {q.mean_abs_dlogprob:.4f} | "
              f"{q.max_abs_dlogprob:.4f} | {q.greedy_token_agreement:.4f} | "
              f"{q.greedy_sequences_equal}/{q.num_sequences} |")  # fmt: skip
