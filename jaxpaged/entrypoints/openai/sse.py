"""Server-sent events of the streaming routes: one JSON writer for completions and chat.

Every event is ``data: <json>`` and a blank line; the stream ends with ``data: [DONE]``. The
JSON is written as vLLM writes it (pydantic's ``model_dump_json``): no spaces after ``,`` and
``:``, non-ASCII characters as they are (UTF-8), not ``\\uXXXX`` escapes. Chat used to write
Python's ``json.dumps`` default (``", "`` / ``": "``, ASCII escapes) and completions the
compact form: now both write the compact one.

The per-token event of a stream (one choice's new text, nothing else) is the hot path: a chunk
per generated token. ``DeltaFrames`` cuts it once per stream from a probe event that the
stream's own general serializer wrote, with sentinel values where the index, the text, the
finish reason and the stop reason go; each token's event is then a string join, byte for byte
what the serializer would write (vLLM's completion stream does the same).
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from jaxpaged.entrypoints.openai.protocol_base import ErrorResponse

encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""A JSON value as pydantic's ``model_dump_json`` writes it (compact, UTF-8)."""

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (a ``str`` is already JSON)."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    elif isinstance(payload, dict):
        data = encode_json(payload)
    else:
        data = payload
    return f"data: {data}\n\n"


def sse_error(error: ErrorResponse) -> str:
    """An error after the response started: vLLM sends it as an event before ``[DONE]``."""
    return sse(error)


class DeltaFrames:
    """The per-token events of one stream, cut from a probe event (see the module docstring).

    Use ``from_probe``; ``frame`` then writes one event.
    """

    INDEX = 987654321
    TEXT = "zZ_jaxpaged_sse_text_Zz"
    FINISH = "zZ_jaxpaged_sse_finish_Zz"
    STOP = "zZ_jaxpaged_sse_stop_Zz"

    def __init__(self, parts: tuple[str, str, str, str, str]):
        self._parts = parts

    @classmethod
    def from_probe(cls, probe: str) -> DeltaFrames | None:
        """Frames of the stream whose serializer wrote ``probe``: its event for one choice
        with index ``INDEX``, text ``TEXT``, finish reason ``FINISH`` and stop reason
        ``STOP``. None when a sentinel is not found exactly once, in that order (a request id
        holding one): the stream then writes every event with its serializer."""
        markers = [str(cls.INDEX), *(encode_json(v) for v in (cls.TEXT, cls.FINISH, cls.STOP))]
        parts, rest = [], probe
        for marker in markers:
            if probe.count(marker) != 1 or marker not in rest:
                return None
            head, rest = rest.split(marker, 1)
            parts.append(head)
        return cls((*parts, rest))

    def frame(self, index: int, text: str, finish_reason, stop_reason) -> str:
        """The event of choice ``index`` adding ``text``; ``finish_reason`` / ``stop_reason``
        as the choice has them (None, a string, or a stop token id)."""
        head, after_index, after_text, after_finish, tail = self._parts
        return (
            f"{head}{index}{after_index}{encode_json(text)}{after_text}"
            f"{encode_json(finish_reason)}{after_finish}{encode_json(stop_reason)}{tail}"
        )
