"""Incremental detokenization and stop strings against ``tokenizer.decode`` of whole sequences.

stories260k's tokenizer is SentencePiece-style with byte-fallback pieces (``<0xE6>``), so CJK
and emoji become several tokens per character: the cases that break naive incremental decoding.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from jaxpaged.detokenizer import IncrementalDetokenizer
from jaxpaged.sampling_params import SamplingParams

MULTIBYTE = "日本語 😀 and ünïcödé"


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    return AutoTokenizer.from_pretrained(stories_dir)


def _stream(tokenizer, prompt_ids, output_ids, params, *, use_fast, stop_terminated=False):
    """Feed outputs one at a time; return (increments, detokenizer, stop string)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params, use_fast=use_fast)
    pieces, stop = [], None
    for i, token_id in enumerate(output_ids):
        last = i == len(output_ids) - 1
        stop = detok.update([token_id], stop_terminated=stop_terminated and last, finished=last)
        pieces.append(detok.get_next_output_text(finished=last or stop is not None, delta=True))
        if stop is not None:
            break
    return pieces, detok, stop


def _expected_text(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    """The output's text as it reads after the prompt, from two whole-sequence decodes."""
    kwargs = dict(skip_special_tokens=skip_special_tokens)
    before = tokenizer.decode(prompt_ids, **kwargs)
    full = tokenizer.decode(prompt_ids + output_ids, **kwargs)
    assert full.startswith(before)
    return full[len(before) :]


@pytest.mark.parametrize("use_fast", [True, False])
def test_multibyte_characters_stream_without_replacement_characters(tokenizer, use_fast):
    prompt = tokenizer.encode("Once upon a time")
    output = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert len(output) > len(MULTIBYTE.split()) + 6  # byte-fallback: several tokens per char
    pieces, detok, _ = _stream(tokenizer, prompt, output, SamplingParams(), use_fast=use_fast)
    assert "".join(pieces) == detok.output_text == _expected_text(tokenizer, prompt, output)
    assert MULTIBYTE in detok.output_text
    assert all("\ufffd" not in piece for piece in pieces)
    # Some tokens (the first bytes of a character) add nothing until the character completes.
    assert "" in pieces


# Output pieces: encoded text (its byte-fallback runs are valid UTF-8), special tokens
# (<unk>, <s>, </s>) and ordinary pieces (ids past the 256 byte tokens 3..258).
_SEGMENTS = st.one_of(
    st.text(min_size=1, max_size=6).map(lambda s: ("text", s)),
    st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=2).map(lambda ids: ("ids", ids)),
    st.lists(st.integers(259, 511), min_size=1, max_size=4).map(lambda ids: ("ids", ids)),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt_text=st.text(min_size=0, max_size=12),
    segments=st.lists(_SEGMENTS, min_size=1, max_size=6),
    use_fast=st.booleans(),
    skip_special_tokens=st.booleans(),
)
def test_increments_concatenate_to_whole_sequence_decode(
    tokenizer, prompt_text, segments, use_fast, skip_special_tokens
):
    """Random text (any Unicode), special tokens and pieces after any text prompt.

    Byte runs are valid UTF-8 here: tokenizers renders an *invalid* run as one U+FFFD per byte,
    so a later byte can change how earlier, already streamed bytes decode; no streaming
    detokenizer can equal that.
    """
    prompt = tokenizer.encode(prompt_text)
    output_ids = []
    for kind, value in segments:
        output_ids += tokenizer.encode(value, add_special_tokens=False) if kind == "text" else value
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    pieces, detok, _ = _stream(tokenizer, prompt, output_ids, params, use_fast=use_fast)
    expected = _expected_text(tokenizer, prompt, output_ids, skip_special_tokens)
    assert "".join(pieces) == detok.output_text == expected


def test_both_decoders_agree_with_the_engine_text_of_golden(tokenizer, golden):
    for case in golden["cases"]:
        for use_fast in (True, False):
            _, detok, _ = _stream(
                tokenizer,
                case["prompt_ids"],
                case["greedy_new_ids"],
                SamplingParams(),
                use_fast=use_fast,
            )
            if case["prompt"]:
                assert detok.output_text == case["new_text"]


def _ids_and_boundary_stop(tokenizer):
    """Output ids of a sentence and a stop string that straddles a token boundary."""
    prompt = tokenizer.encode("Once upon a time")
    # Drop the "▁" that SentencePiece puts before a text's first word: a model continuing
    # "time" emits "," directly.
    output = tokenizer.encode(", there was a little girl named Lily.", add_special_tokens=False)
    output = output[1:] if tokenizer.convert_ids_to_tokens(output[0]) == "\u2581" else output
    text = _expected_text(tokenizer, prompt, output)
    # The boundary after the 5th token; 2 chars either side of it.
    cut = len(_expected_text(tokenizer, prompt, output[:5]))
    stop = text[cut - 2 : cut + 2]
    assert len(stop) == 4 and text.find(stop) == cut - 2
    return prompt, output, text, stop, cut


@pytest.mark.parametrize("use_fast", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens_is_found_and_cut(tokenizer, use_fast, include):
    prompt, output, text, stop, cut = _ids_and_boundary_stop(tokenizer)
    params = SamplingParams(stop=["zzz", stop], include_stop_str_in_output=include)
    pieces, detok, found = _stream(tokenizer, prompt, output, params, use_fast=use_fast)
    assert found == stop
    expected = text[: cut + 2] if include else text[: cut - 2]
    assert detok.output_text == expected == "".join(pieces)
    # Found on the token that completes it: the 6th.
    assert len(pieces) == 6


@pytest.mark.parametrize("use_fast", [True, False])
def test_streaming_holds_back_text_that_could_become_a_stop_string(tokenizer, use_fast):
    prompt, output, text, _, _ = _ids_and_boundary_stop(tokenizer)
    params = SamplingParams(stop=["never appears", "xy"])  # hold back 12 characters
    pieces, detok, found = _stream(tokenizer, prompt, output, params, use_fast=use_fast)
    assert found is None and "".join(pieces) == text
    streamed = ""
    detok2 = IncrementalDetokenizer(tokenizer, prompt, params, use_fast=use_fast)
    for token_id in output[:-1]:
        detok2.update([token_id], stop_terminated=False, finished=False)
        streamed += detok2.get_next_output_text(finished=False, delta=True)
        assert streamed == detok2.output_text[: max(len(detok2.output_text) - 12, 0)]
    assert detok2.get_next_output_text(finished=False, delta=False) == streamed


def test_stop_strings_wait_for_min_tokens_and_earliest_match_wins(tokenizer):
    prompt, output, text, _, _ = _ids_and_boundary_stop(tokenizer)
    assert _expected_text(tokenizer, prompt, output[:1]) == ","
    # min_tokens=1: the stop string in the first token's text does not count.
    params = SamplingParams(stop=[",", "little"], min_tokens=1)
    _, detok, found = _stream(tokenizer, prompt, output, params, use_fast=True)
    assert found == "little" and detok.output_text == text[: text.index("little")]
    # Both strings in the same new text: the one that starts first wins (not list order).
    both = SamplingParams(stop=["girl", "ttle g"])
    detok = IncrementalDetokenizer(tokenizer, prompt, both)
    assert detok.update(output, stop_terminated=False, finished=False) == "ttle g"
    assert detok.output_text == text[: text.index("ttle g")]


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_included(tokenizer, include):
    prompt, output, text, _, _ = _ids_and_boundary_stop(tokenizer)
    params = SamplingParams(stop_token_ids=[output[3]], include_stop_str_in_output=include)
    _, detok, found = _stream(
        tokenizer, prompt, output[:4], params, use_fast=True, stop_terminated=True
    )
    assert found is None
    n = 4 if include else 3
    assert detok.output_text == _expected_text(tokenizer, prompt, output[:n])


def test_bytes_of_an_unfinished_character_are_flushed_when_the_request_ends(tokenizer):
    prompt = tokenizer.encode("Hi")
    output = tokenizer.encode("ok 日", add_special_tokens=False)[:-1]  # cut inside 日
    for use_fast in (True, False):
        pieces, detok, _ = _stream(tokenizer, prompt, output, SamplingParams(), use_fast=use_fast)
        assert detok.output_text == _expected_text(tokenizer, prompt, output)
        assert detok.output_text.endswith("\ufffd")
        assert "".join(pieces) == detok.output_text


def test_ids_that_break_the_decode_stream_prefix_do_not_raise(tokenizer):
    # Random byte-fallback ids (what dummy-weight models sample) made tokenizers' DecodeStream
    # raise "Invalid prefix encountered" on the fifth token; the stream must recover.
    output_ids = [344, 292, 130, 164, 368, 300, 301]
    pieces, detok, _ = _stream(tokenizer, [1], output_ids, SamplingParams(), use_fast=True)
    assert len(pieces) == len(output_ids)
    assert "".join(pieces) == detok.output_text
    assert detok.output_text.endswith(tokenizer.decode([300, 301]).strip()[-3:])


@pytest.mark.parametrize("use_fast", [True, False])
@pytest.mark.parametrize("num_prompt_bytes", [1, 2])
def test_a_prompt_ending_inside_a_character_leaks_no_prompt_text(
    tokenizer, use_fast, num_prompt_bytes
):
    """ "世" is three byte-fallback tokens; the prompt holds the first one or two. The output
    token that completes the character shows the character, and nothing of the prompt before
    it (the fast decoder once repeated "Hello world世", the window decoder dropped it)."""
    ids = tokenizer.encode("Hello world世")
    assert tokenizer.convert_ids_to_tokens(ids[-3:]) == ["<0xE4>", "<0xB8>", "<0x96>"]
    prompt, output = ids[: len(ids) - 3 + num_prompt_bytes], ids[len(ids) - 3 + num_prompt_bytes :]
    more = tokenizer.encode("Hello world世 and more", add_special_tokens=False)[len(ids) - 1 :]
    pieces, detok, _ = _stream(
        tokenizer, prompt, output + more, SamplingParams(), use_fast=use_fast
    )
    assert pieces[: len(output)] == [""] * (len(output) - 1) + ["世"]
    assert "".join(pieces) == detok.output_text == "世 and more"
