"""``deepseek_r1`` and ``qwen3``: ``<think>…</think>`` split from replies in the models' own
formats (DeepSeek-R1 and Qwen3 chat templates), whole and streamed in random pieces."""

from __future__ import annotations

import pytest

from jaxpaged.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from tests.entrypoints.openai.tool_parsers.streaming import pieces

R1 = get_reasoning_parser("deepseek_r1")
QWEN3 = get_reasoning_parser("qwen3")


def _stream(parser, text: str, seed: int) -> tuple[str, str]:
    reasoning = content = current = ""
    chunks = pieces(text, seed)
    for n, piece in enumerate(chunks):
        previous, current = current, current + piece
        delta = parser.extract_reasoning_streaming(
            previous, current, piece, final=n == len(chunks) - 1
        )
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    return reasoning, content


CASES = [
    # (parser, chat_template_kwargs, reply, reasoning, content)
    (R1, None, "<think>\n9.11 < 9.8? Compare tenths.\n</think>\n\n9.8 is larger.",
     "\n9.11 < 9.8? Compare tenths.\n", "\n\n9.8 is larger."),
    # The template put "<think>\n" in the prompt: the reply starts inside the reasoning.
    (R1, None, "Compare tenths.\n</think>\n\n9.8", "Compare tenths.\n", "\n\n9.8"),
    # Cut off while thinking: all reasoning.
    (R1, None, "<think>Let me think about </th", "Let me think about </th", None),
    (QWEN3, None, "<think>\nThe user greets me.\n</think>\n\nHello!",
     "\nThe user greets me.\n", "\n\nHello!"),
    (QWEN3, None, "Still thinking", "Still thinking", None),
    # enable_thinking=False: no </think> means no reasoning.
    (QWEN3, {"enable_thinking": False}, "Hello! <b>", None, "Hello! <b>"),
    # An explicit empty think block is still split off.
    (QWEN3, {"enable_thinking": False}, "<think>\n\n</think>\n\nHi", "\n\n", "\n\nHi"),
]  # fmt: skip


@pytest.mark.parametrize("parser_cls, kwargs, reply, reasoning, content", CASES)
def test_whole_reply_splits_like_vllm(parser_cls, kwargs, reply, reasoning, content):
    parser = parser_cls(None, chat_template_kwargs=kwargs)
    assert parser.extract_reasoning(reply) == (reasoning, content)


@pytest.mark.parametrize("seed", [-1, 0, 1, 2])
@pytest.mark.parametrize("parser_cls, kwargs, reply, reasoning, content", CASES)
def test_streamed_pieces_reassemble_to_the_whole_split(
    parser_cls, kwargs, reply, reasoning, content, seed
):
    parser = parser_cls(None, chat_template_kwargs=kwargs)
    assert _stream(parser, reply, seed) == (reasoning or "", content or "")


def test_a_partial_end_tag_is_held_back_until_it_resolves():
    parser = R1(None)
    assert parser.extract_reasoning_streaming("", "abc</thi", "").reasoning == "abc"
    delta = parser.extract_reasoning_streaming("", "abc</think>X", "")
    assert (delta.reasoning, delta.content) == (None, "X")


def test_end_token_ids_encode_the_end_marker():
    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return [ord(c) for c in text]

    assert R1(Tokenizer()).end_token_ids() == [ord(c) for c in "</think>"]


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        get_reasoning_parser("nope")
