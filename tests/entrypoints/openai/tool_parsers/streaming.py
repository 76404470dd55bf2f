"""Feeding a parser a text in random-sized pieces and reassembling what it streams, as an
OpenAI client does (``tool_calls`` deltas merged by ``index``)."""

from __future__ import annotations

import json
import random

from jaxpaged.entrypoints.openai.tool_parsers import ToolParser


def pieces(text: str, seed: int) -> list[str]:
    """``text`` cut at random points (1 to 8 characters a piece; seed -1: one per char)."""
    if seed == -1:
        return list(text)
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        size = rng.randint(1, 8)
        out.append(text[i : i + size])
        i += size
    return out


def reassemble(parser: ToolParser, text: str, seed: int) -> tuple[str, list[dict]]:
    """(content, calls) streamed by ``parser`` for ``text``; each call ``{id, name,
    arguments}``. Checks the wire rules on the way: a call's first delta has id, type and
    name, later ones only argument fragments, and indexes count up from 0."""
    return reassemble_pieces(parser, pieces(text, seed))


def reassemble_pieces(parser: ToolParser, chunks: list[str]) -> tuple[str, list[dict]]:
    """``reassemble`` for a text already cut into ``chunks`` (the last one is final)."""
    content, calls = "", []
    current = ""
    for n, piece in enumerate(chunks):
        previous, current = current, current + piece
        delta = parser.extract_tool_calls_streaming(
            previous, current, piece, final=n == len(chunks) - 1
        )
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.index == len(calls):
                assert call.id, call
                assert call.type == "function" and call.function.name is not None, call
                calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
            else:
                assert call.index < len(calls), call
                assert call.id is None and call.function.name is None, call
            calls[call.index]["arguments"] += call.function.arguments or ""
    return content, calls


def check_stream_matches_whole(parser_cls, text: str, *, seeds=(-1, 0, 1, 2, 3)) -> None:
    """The streamed content and calls equal ``extract_tool_calls`` on the whole text."""
    whole = parser_cls().extract_tool_calls(text)
    for seed in seeds:
        content, calls = reassemble(parser_cls(), text, seed)
        assert content == (whole.content or ""), seed
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.tool_calls
        ], seed
        for call in calls:
            json.loads(call["arguments"])
