"""Turning output token ids into text the way a reader sees it after the prompt.

SentencePiece-style tokenizers drop the leading space of the first decoded piece, so decoding the
output ids alone would lose the space between prompt and continuation. Like vLLM's detokenizer
(``vllm/transformers_utils/detokenizer_utils.py``: decode with a few prompt tokens of context,
then strip the context's text), we decode a short window of prompt context with the outputs.
"""

from __future__ import annotations

# Tokens of prompt context decoded before the outputs; vLLM uses 5 (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_CONTEXT_TOKENS = 5


def decode_output_text(
    tokenizer,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    *,
    skip_special_tokens: bool = True,
) -> str:
    """Text of ``output_token_ids`` as it reads after the prompt (leading spaces kept)."""
    if not output_token_ids:
        return ""
    context = prompt_token_ids[-_CONTEXT_TOKENS:]
    prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(context + output_token_ids, skip_special_tokens=skip_special_tokens)
    if full.startswith(prefix):
        return full[len(prefix) :]
    # Context and output merged into different characters (rare byte-fallback cases).
    return tokenizer.decode(output_token_ids, skip_special_tokens=skip_special_tokens)
