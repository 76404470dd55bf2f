"""Streamed (server-sent-event) POSTs for load generation: raw ``data:`` lines and arrival times.

``jaxpaged bench serve`` reads thousands of SSE events a second. Reading them with ``httpx``'s
``aiter_lines`` and decoding each event's JSON as it arrives cost the client about 100 µs of CPU
per event on the CPU machine, enough to make the client, not the server, the bottleneck on the
H200 (docs/benchmarks.md, serving). Here each network read (``httpx``'s ``aiter_bytes``: HTTP
framing stays httpx's) is split into ``data:`` lines (the SSE format, WHATWG HTML §9.2) kept as
raw bytes with the read's arrival time; the caller decodes the JSON after the run.
"""

from __future__ import annotations

import dataclasses
import time

import httpx


@dataclasses.dataclass
class StreamedResponse:
    """One streamed response.

    ``events``: ``(arrival, payload)`` per ``data: `` line before ``data: [DONE]``, ``arrival``
    in ``time.perf_counter()`` seconds, ``payload`` the raw bytes after the prefix. ``end``: the
    ``perf_counter()`` time of ``[DONE]``, or of the body's end when no ``[DONE]`` came.
    ``body``: the whole body for a status other than 200 (then ``events`` is empty)."""

    status: int
    events: list[tuple[float, bytes]]
    end: float
    body: bytes = b""


class StreamingClient:
    """POSTs JSON to one server and collects its SSE stream (module docstring).

    ``base_url``: ``http://host[:port]`` or ``https://...``; ``headers``: sent with every
    request (e.g. ``Authorization``). Connections are pooled and kept alive by httpx."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=httpx.Timeout(None), limits=limits
        )

    async def post_stream(self, path: str, body: dict) -> StreamedResponse:
        """POST ``body`` as JSON to ``path`` and read the response to its end.

        Raises ``httpx.HTTPError`` on network failures."""
        async with self._http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return StreamedResponse(
                    response.status_code, [], time.perf_counter(), await response.aread()
                )
            lines = _SSELines()
            async for data in response.aiter_bytes():
                lines.feed(data, time.perf_counter())
            return StreamedResponse(200, lines.events, lines.end or time.perf_counter())

    async def aclose(self) -> None:
        await self._http.aclose()


class _SSELines:
    """Splits a byte stream into lines and keeps each ``data: `` payload with its arrival."""

    def __init__(self):
        self.pending = b""
        self.events: list[tuple[float, bytes]] = []
        self.end: float | None = None

    def feed(self, data: bytes, now: float) -> None:
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            if not line.startswith(b"data: ") or self.end is not None:
                continue
            payload = line[6:].rstrip(b"\r")
            if payload == b"[DONE]":
                self.end = now
            else:
                self.events.append((now, payload))
