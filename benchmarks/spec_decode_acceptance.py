"""n-gram acceptance under greedy verification, replayed over the engine's own greedy outputs.

Greedy verification accepts a draft exactly while it equals the target's argmax, so the tokens
a speculative engine emits are the ordinary greedy ones and its steps follow from them alone:
at each step the proposer drafts from the tokens so far, the drafts that match the greedy
continuation are accepted, and one more token (the correction or the bonus) is emitted. This
script generates the greedy continuations with the ordinary engine (``LLM.generate``,
temperature 0), replays those steps with ``ngram_propose_reference`` and prints vLLM's
``SpecDecoding metrics`` line, the tokens per target step (the upper bound of the speed-up when
a verify step costs what a decode step does) and the acceptance per position.

Default: the embedded stories260k on prompts that repeat a sentence; ``--model`` any local
model. CPU: ``python benchmarks/spec_decode_acceptance.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpaged import LLM, SamplingParams  # noqa: E402
from jaxpaged.spec_decode.metrics import SpecDecodingStats  # noqa: E402
from jaxpaged.spec_decode.ngram_proposer import ngram_propose_reference  # noqa: E402

PROMPTS = [
    "Lily went to the park. She saw a big dog. Lily went to the park. She saw",
    "Tom had a red ball. He liked to play with it every day. Tom had a red ball. He",
    "Once upon a time, there was a little cat. The cat was very happy. Once upon a time,",
    "The sun was hot. The bird sang a song. The sun was hot. The bird",
]


def replay(prompt_ids, output_ids, stats: SpecDecodingStats, **kwargs) -> int:
    """Greedy speculative steps over one request's outputs; returns the number of steps."""
    tokens = list(prompt_ids) + list(output_ids)
    pos, steps = len(prompt_ids), 0
    while pos < len(tokens):
        drafts = ngram_propose_reference(tokens[:pos], **kwargs)
        accepted = 0
        while (
            accepted < len(drafts)
            and pos + accepted < len(tokens)
            and (drafts[accepted] == tokens[pos + accepted])
        ):
            accepted += 1
        stats.observe_draft(len(drafts), accepted)
        pos += accepted + 1
        steps += 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="local model directory (default: stories260k)"
    )
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument(
        "--k", type=int, nargs="+", default=[2, 4, 6], help="num_speculative_tokens"
    )
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(model=args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    max_len = llm.llm_engine.config.model_config.max_model_len
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{len(PROMPTS)} prompts, {generated} greedy tokens, n in [{args.min_n}, {args.max_n}]")
    print("| K | target steps | tokens / step | acceptance rate | per-position acceptance |")
    print("|---:|---:|---:|---:|---|")
    for k in args.k:
        stats = SpecDecodingStats(num_spec_tokens=k)
        steps = sum(
            replay(o.prompt_token_ids, o.outputs[0].token_ids, stats, num_speculative_tokens=k,
                   min_n=args.min_n, max_n=args.max_n, max_model_len=max_len)
            for o in outputs
        )  # fmt: skip
        rates = ", ".join(f"{r:.2f}" for r in stats.acceptance_rate_per_pos)
        print(f"| {k} | {steps} | {generated / steps:.2f} | {stats.acceptance_rate:.1%} | "
              f"{rates} |")  # fmt: skip
        print(stats.log_line(elapsed_s=1.0), file=sys.stderr)


if __name__ == "__main__":
    main()
