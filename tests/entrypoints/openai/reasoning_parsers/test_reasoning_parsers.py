"""``deepseek_r1`` and ``qwen3``: ``<think>…</think>`` split from replies in the models' own
formats (DeepSeek-R1 and Qwen3 chat templates), whole and streamed in random pieces."""

from __future__ import annotations

import re

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


# ---------------------------------------------------------------------------------------------
# Cases of vLLM 0.34's own tests (tests/reasoning/test_deepseekr1_reasoning_parser.py and
# test_qwen3_reasoning_parser.py), same outputs and expected splits. vLLM streams them one token
# at a time (the models' tokenizers); ``_tokens`` cuts a text the same way at the markers, the
# words and the whitespace before them.


def _tokens(text: str) -> list[str]:
    return re.findall(r"</?think>|<tool_call>|\s*\w+|\s+|.", text)


def _stream_deltas(parser, deltas: list[str]) -> tuple[str | None, str | None]:
    """(reasoning, content) reassembled from a stream of ``deltas``, None where nothing came."""
    reasoning = content = None
    current = ""
    for n, piece in enumerate(deltas):
        previous, current = current, current + piece
        delta = parser.extract_reasoning_streaming(
            previous, current, piece, final=n == len(deltas) - 1
        )
        if delta is None:
            continue
        if delta.reasoning is not None:
            reasoning = (reasoning or "") + delta.reasoning
        if delta.content is not None:
            content = (content or "") + delta.content
    return reasoning, content


R1_WHOLE = [  # (output, reasoning, content)
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    ("This is content", "This is content", None),
    ("This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("</think>This is the rest", "", "This is the rest"),
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    ("", "", None),
    ("\n<think>This is a reasoning section</think>\nThis is the rest",
     "This is a reasoning section", "\nThis is the rest"),
]  # fmt: skip
R1_STREAMED = [  # (output, reasoning, content): what a token-by-token stream adds up to
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    ("This is a reasoning section", "This is a reasoning section", None),
    ("This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("</think>This is the rest", None, "This is the rest"),
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    ("", None, None),
    # vLLM's stream gives "\nThis is a reasoning section" here (its test notes it cannot tell
    # a newline before "<think>" from reasoning); here the newline waits, and the stream
    # equals the whole reply's split.
    ("\n<think>This is a reasoning section</think>\nThis is the rest",
     "This is a reasoning section", "\nThis is the rest"),
]  # fmt: skip

QWEN3_TOOL_CALL = (
    "<tool_call>\n<function=bash>\n<parameter=command>"
    "\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CASES = [  # (output, reasoning, content): the same whole and streamed
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("This is the rest", "This is the rest", None),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This is a reasoning\nsection</think>This is the rest\nThat",
     "This is a reasoning\nsection", "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    ("This is a reasoning section", "This is a reasoning section", None),
    # <tool_call> without </think> ends the reasoning.
    ("I need to read the file.\n\n" + QWEN3_TOOL_CALL, "I need to read the file.\n\n",
     QWEN3_TOOL_CALL),
    ("<think>I need to read the file.\n\n" + QWEN3_TOOL_CALL, "I need to read the file.\n\n",
     QWEN3_TOOL_CALL),
]  # fmt: skip
QWEN3_MULTI_TOKEN_DELTAS = [  # (deltas, reasoning, content)
    (["<think>This is a reasoning section", "</think>", "This is the rest"],
     "This is a reasoning section", "This is the rest"),
    (["reasoning section", "</think>This is the rest"], "reasoning section", "This is the rest"),
    (["<think>reasoning</think>"], "reasoning", None),
    (["reasoning section", "</think>content"], "reasoning section", "content"),
    (["I need to read the file.\n\n", "<tool_call>\n<function=bash>"],
     "I need to read the file.\n\n", "<tool_call>\n<function=bash>"),
]  # fmt: skip
QWEN3_THINKING_DISABLED = [
    "This is plain content",
    "Some output without think tokens",
    "I need to read the file.\n\n" + QWEN3_TOOL_CALL,
]


@pytest.mark.parametrize("output, reasoning, content", R1_WHOLE)
def test_vllm_deepseek_r1_whole(output, reasoning, content):
    assert R1(None).extract_reasoning(output) == (reasoning, content)


@pytest.mark.parametrize("output, reasoning, content", R1_STREAMED)
def test_vllm_deepseek_r1_streamed(output, reasoning, content):
    assert _stream_deltas(R1(None), _tokens(output)) == (reasoning, content)


@pytest.mark.parametrize("output, reasoning, content", QWEN3_CASES)
def test_vllm_qwen3_whole(output, reasoning, content):
    assert QWEN3(None).extract_reasoning(output) == (reasoning, content)


@pytest.mark.parametrize("output, reasoning, content", QWEN3_CASES)
def test_vllm_qwen3_streamed(output, reasoning, content):
    assert _stream_deltas(QWEN3(None), _tokens(output)) == (reasoning, content)


@pytest.mark.parametrize("deltas, reasoning, content", QWEN3_MULTI_TOKEN_DELTAS)
def test_vllm_qwen3_multi_token_deltas(deltas, reasoning, content):
    assert _stream_deltas(QWEN3(None), deltas) == (reasoning, content)


@pytest.mark.parametrize("output", QWEN3_THINKING_DISABLED)
def test_vllm_qwen3_thinking_disabled_is_all_content(output):
    parser = QWEN3(None, chat_template_kwargs={"enable_thinking": False})
    assert parser.extract_reasoning(output) == (None, output)


def test_implicit_ends_are_the_markers_that_are_one_token():
    """Qwen3's ``<tool_call>`` is one special token of its vocabulary: a constraint starts at
    it. A vocabulary that spells it in pieces (stories260k) has no implicit end, and neither
    has a parser without such markers, or Qwen3 with thinking switched off."""
    from transformers import AutoTokenizer

    from jaxpaged.config import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    qwen3, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    assert qwen3(tokenizer).implicit_end_token_ids() == []
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    (tool_call,) = tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert qwen3(tokenizer).implicit_end_token_ids() == [tool_call]
    off = {"enable_thinking": False}
    assert qwen3(tokenizer, chat_template_kwargs=off).implicit_end_token_ids() == []
    assert r1(tokenizer).implicit_end_token_ids() == []
