"""Turning a beam-search request's final ``RequestOutput`` into vLLM's ``BeamSearchOutput``."""

from __future__ import annotations

from jaxpaged.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.outputs import RequestOutput


def beam_search_outputs(
    outputs: list[RequestOutput], tokenizer, eos_token_id: int | None, params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """One ``BeamSearchOutput`` per request: its completions (already ranked by the engine) as
    ``BeamSearchSequence``s with prompt + generated ``tokens`` and the generated ``text``, where
    a final EOS is left out of the text (vLLM's behaviour)."""
    results = []
    eos = eos_token_id
    for output in outputs:
        sequences = []
        for completion in output.outputs:
            generated = completion.token_ids
            if generated and generated[-1] == eos and not params.ignore_eos:
                generated = generated[:-1]
            sequences.append(
                BeamSearchSequence(
                    tokens=[*output.prompt_token_ids, *completion.token_ids],
                    logprobs=completion.logprobs or [],
                    cum_logprob=completion.cumulative_logprob or 0.0,
                    text=(
                        None
                        if tokenizer is None  # skip_tokenizer_init
                        else tokenizer.decode(generated, skip_special_tokens=True)
                    ),
                    finish_reason=completion.finish_reason,
                )
            )
        results.append(BeamSearchOutput(sequences=sequences))
    return results
