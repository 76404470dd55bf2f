"""``StructuredOutputsParams.reasoning_end_token_ids``: the grammar starts after the reasoning.

On stories260k (which never writes ``</think>``) the end marker is two tokens the model writes
anyway when greedy, so the test knows where the reasoning ends: the tokens up to and including
the marker must be exactly the unconstrained greedy ones, and the rest must parse and validate.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxpaged import SamplingParams
from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.structured_output.request_state import SequenceGrammar

SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "y"]}, "ok": {"type": "boolean"}},
    "required": ["a", "ok"],
    "additionalProperties": False,
}
PROMPT = "Once upon a time"
# The tiny model would fill any whitespace the grammar allows until max_tokens.
COMPACT = dict(disable_any_whitespace=True)


@pytest.fixture(scope="module")
def async_llm():
    from jaxpaged import LLM
    from tests.conftest import SMALL_ENGINE

    return LLM(dtype="float32", async_scheduling=True, **SMALL_ENGINE)


@pytest.mark.parametrize("engine", ["stories_llm", "async_llm"])
def test_grammar_waits_for_the_marker_then_constrains_the_rest(request, engine):
    llm = request.getfixturevalue(engine)  # async: the mask is filled while a step runs
    tokenizer = llm.get_tokenizer()
    (free,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    greedy = free.outputs[0].token_ids
    marker = greedy[3:5]
    end = next(i for i in range(len(greedy)) if greedy[i : i + 2] == marker) + 2
    constraint = StructuredOutputsParams(json=SCHEMA, reasoning_end_token_ids=marker, **COMPACT)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
    (out,) = llm.generate(PROMPT, params)
    ids = out.outputs[0].token_ids
    assert ids[:end] == greedy[:end]  # the "reasoning" is unconstrained
    assert out.outputs[0].finish_reason == "stop"
    answer = tokenizer.decode(ids[end:], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert ids[end:] != greedy[end : len(ids)]  # the grammar did change the output


def test_without_the_field_the_grammar_starts_at_the_first_token(stories_llm):
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, **COMPACT),
    )
    (out,) = stories_llm.generate(PROMPT, params)
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


class _Matcher:
    def __init__(self):
        self.accepted = []

    def accept_token(self, token):
        self.accepted.append(token)
        return True

    def is_terminated(self):
        return False


@pytest.mark.parametrize("split", [1, 2, 3, 4, 5])
def test_marker_found_across_syncs_feeds_only_what_follows(split):
    """The marker may arrive one token at a time, or behind an unresolved placeholder."""
    output = [7, 8, 5, 6, 9, 10]
    state = SequenceGrammar(_Matcher(), start_after=[5, 6])
    state.sync(output[:split])
    assert state.active == (split >= 4)
    assert state.matcher.accepted == output[4:split]
    state.sync(output[:split] + [-1])  # async scheduling's placeholder: not looked at
    state.sync(output)
    assert state.active and state.start == 4
    assert state.matcher.accepted == [9, 10]


def test_reasoning_end_token_ids_must_be_token_ids():
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        StructuredOutputsParams(regex="a", reasoning_end_token_ids=[-3])


# ------------------------------------------------------------------- implicit reasoning ends
# Qwen3 may start a <tool_call> without closing its thinking: that token ends the reasoning and
# is the grammar's first token (vLLM's implicit_reasoning_end_token_ids); one the grammar
# cannot start with is masked while the reasoning lasts. Before, the grammar waited for
# </think> only, and a reply read as "reasoning, then a call" was never constrained.
NEVER = [0, 0]  # an end marker stories260k never writes (<unk> twice)


def _first_new_token(greedy: list[int], start: int = 2) -> int:
    """The index of the first greedy token (from ``start``) that did not come before it."""
    return next(k for k in range(start, len(greedy)) if greedy[k] not in greedy[:k])


@pytest.mark.parametrize("engine", ["stories_llm", "async_llm"])
def test_an_implicit_end_is_the_grammars_first_token(request, engine):
    stories_llm = request.getfixturevalue(engine)
    tokenizer = stories_llm.get_tokenizer()
    (free,) = stories_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))
    greedy = free.outputs[0].token_ids
    k = _first_new_token(greedy)
    piece = tokenizer.convert_ids_to_tokens(greedy[k]).replace("\u2581", " ")
    choice = piece + "zq!"  # starts with that token's text; the model would not write the rest
    constraint = StructuredOutputsParams(
        choice=[choice], reasoning_end_token_ids=NEVER, reasoning_implicit_end_token_ids=[greedy[k]]
    )
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=constraint)
    (out,) = stories_llm.generate(PROMPT, params)
    ids = out.outputs[0].token_ids
    assert ids[: k + 1] == greedy[: k + 1]  # unconstrained up to and with the implicit end
    assert out.outputs[0].finish_reason == "stop"
    assert tokenizer.decode(ids[k:], skip_special_tokens=True).strip() == choice.strip()


def test_an_implicit_end_the_grammar_cannot_start_with_is_masked_while_reasoning(stories_llm):
    (free,) = stories_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))
    greedy = free.outputs[0].token_ids
    k = _first_new_token(greedy)
    constraint = StructuredOutputsParams(
        json=SCHEMA, reasoning_end_token_ids=NEVER, reasoning_implicit_end_token_ids=[greedy[k]]
    )
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=constraint)
    (out,) = stories_llm.generate(PROMPT, params)
    ids = out.outputs[0].token_ids
    assert ids[:k] == greedy[:k]  # nothing else is masked while reasoning
    assert greedy[k] not in ids  # a JSON object cannot start with it: never sampled
    assert out.outputs[0].finish_reason == "length"  # still reasoning


def test_the_first_end_wins_and_an_implicit_end_is_found_at_once():
    state = SequenceGrammar(_Matcher(), start_after=[5, 6], implicit_ends=[9])
    state.sync([7, 8, 9])  # the implicit end is the last token: the grammar starts with it
    assert state.active and state.start == 2 and state.matcher.accepted == [9]
    state = SequenceGrammar(_Matcher(), start_after=[5, 6], implicit_ends=[9])
    state.sync([7, 5, 6, 9, 10])  # the marker came first: the grammar starts after it
    assert state.start == 3 and state.matcher.accepted == [9, 10]
    state = SequenceGrammar(_Matcher(), start_after=[5, 6], implicit_ends=[9])
    state.sync([7, 5])  # half a marker: looked at again
    state.sync([7, 5, 6, 10])
    assert state.start == 3 and state.matcher.accepted == [10]


def test_implicit_ends_need_the_end_marker_and_token_ids():
    with pytest.raises(ValueError, match="reasoning_implicit_end_token_ids.*needs"):
        StructuredOutputsParams(regex="a", reasoning_implicit_end_token_ids=[3])
    with pytest.raises(ValueError, match="reasoning_implicit_end_token_ids"):
        StructuredOutputsParams(
            regex="a", reasoning_end_token_ids=[4], reasoning_implicit_end_token_ids=[True]
        )
