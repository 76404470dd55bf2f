"""``LLM(structured_outputs_config={"reasoning_parser": ...})`` (vLLM's offline switch): a
constrained request's grammar starts after the reasoning parser's end of thinking, so until the
model writes ``</think>`` it generates freely (stories260k never does: its constrained greedy
reply is its free greedy reply), while an engine without the switch constrains from the first
token."""

from __future__ import annotations

import json

import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import SMALL_ENGINE

pytest.importorskip("xgrammar")

PROMPT = "Once upon a time"
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}},
    "required": ["a"],
    "additionalProperties": False,
}


def _constrained() -> SamplingParams:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)


def test_the_grammar_waits_for_the_end_of_thinking(stories_llm):
    llm = LLM(
        dtype="float32",
        **SMALL_ENGINE,
        structured_outputs_config={"reasoning_parser": "deepseek_r1"},
    )
    params = _constrained()
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    (free,) = stories_llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False
    )
    assert out.outputs[0].text == free.outputs[0].text
    # The caller's params are left as they were.
    assert params.structured_outputs.reasoning_end_token_ids is None
    (bound,) = stories_llm.generate([PROMPT], params, use_tqdm=False)  # no parser: JSON at once
    assert isinstance(json.loads(bound.outputs[0].text)["a"], bool)


def test_an_unknown_reasoning_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="reasoning_parser.*deepseek_r1"):
        LLM(dtype="float32", **SMALL_ENGINE, structured_outputs_config={"reasoning_parser": "x"})
