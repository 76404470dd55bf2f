"""A lean asyncio HTTP/1.1 client for streamed (server-sent-event) POSTs, for load generation.

``jaxpaged bench serve`` reads thousands of SSE events a second; through ``httpx`` each event
costs the client about 100 µs of CPU (``httpcore``/``h11`` framing, ``anyio`` reads, incremental
text decoding, line iteration), enough to make the client, not the server, the bottleneck. This
client does only what a benchmark needs on the hot path: one ``StreamReader.read`` per arrival,
chunked-transfer de-framing (RFC 9112 §7.1) over a byte buffer, and a split into ``data:`` lines
(the SSE format, WHATWG HTML §9.2), each kept as raw bytes with the arrival time of the read
that completed it. Decoding the JSON payloads is left to the caller, after the run.

Connections are kept alive (HTTP/1.1 default) and reused one request at a time; a request on a
reused connection that the server has closed meanwhile is retried once on a new connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
import time
import urllib.parse

_READ_SIZE = 1 << 16


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


class _ClosedEarly(ConnectionError):
    """The server closed a reused keep-alive connection before answering."""


class StreamingClient:
    """POSTs JSON to one server and collects its SSE stream; see the module docstring.

    ``base_url``: ``http://host[:port]`` or ``https://...`` (a path prefix is kept);
    ``headers``: sent with every request (e.g. ``Authorization``)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None):
        self._url = urllib.parse.urlsplit(base_url)
        self._headers = dict(headers or {})
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post_stream(self, path: str, body: dict) -> StreamedResponse:
        """POST ``body`` as JSON to ``path`` and read the response to its end.

        Raises ``ConnectionError``/``OSError`` on network failures, ``ValueError`` on a
        malformed HTTP response."""
        payload = json.dumps(body).encode()
        head = self._request_head(path, len(payload))
        while self._idle:
            reader, writer = self._idle.pop()
            if reader.at_eof():
                writer.close()
                continue
            try:
                return await self._exchange(reader, writer, head + payload, reused=True)
            except _ClosedEarly:
                continue
        reader, writer = await self._connect()
        return await self._exchange(reader, writer, head + payload, reused=False)

    async def aclose(self) -> None:
        """Close the idle connections."""
        while self._idle:
            _, writer = self._idle.pop()
            writer.close()

    def _request_head(self, path: str, length: int) -> bytes:
        host = self._url.netloc
        lines = [
            f"POST {self._url.path.rstrip('/')}{path} HTTP/1.1",
            f"Host: {host}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {length}",
        ]
        lines += [f"{key}: {value}" for key, value in self._headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        https = self._url.scheme == "https"
        port = self._url.port or (443 if https else 80)
        context = ssl.create_default_context() if https else None
        return await asyncio.open_connection(self._url.hostname, port, ssl=context)

    async def _exchange(self, reader, writer, request: bytes, reused: bool) -> StreamedResponse:
        try:
            writer.write(request)
            status_line = await reader.readuntil(b"\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            writer.close()
            if reused:
                raise _ClosedEarly from error
            raise ConnectionError(f"the server closed the connection: {error}") from error
        try:
            response, keep_alive = await _read_response(reader, status_line)
        except BaseException:
            writer.close()
            raise
        if keep_alive:
            self._idle.append((reader, writer))
        else:
            writer.close()
        return response


async def _read_response(reader: asyncio.StreamReader, status_line: bytes):
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    status = int(parts[1])
    headers = {}
    for line in (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower()] = value.strip().lower()
    chunked = b"chunked" in headers.get(b"transfer-encoding", b"")
    length = None if chunked else headers.get(b"content-length")
    keep_alive = headers.get(b"connection") != b"close" and (chunked or length is not None)
    if length is not None:
        body = await reader.readexactly(int(length))
        return _parse_whole(status, body), keep_alive
    lines = _SSELines()
    body = bytearray()
    frames = _Dechunker() if chunked else None
    while True:
        data = await reader.read(_READ_SIZE)
        now = time.perf_counter()
        if not data:
            if frames is not None:
                raise ValueError("the connection closed inside a chunked body")
            break
        if frames is not None:
            data = frames.feed(data)
        if status == 200:
            lines.feed(data, now)
        else:
            body += data
        if frames is not None and frames.done:
            break
    if status != 200:
        return StreamedResponse(status, [], time.perf_counter(), bytes(body)), keep_alive
    return StreamedResponse(status, lines.events, lines.end or time.perf_counter()), keep_alive


def _parse_whole(status: int, body: bytes) -> StreamedResponse:
    if status != 200:
        return StreamedResponse(status, [], time.perf_counter(), body)
    lines = _SSELines()
    now = time.perf_counter()
    lines.feed(body, now)
    return StreamedResponse(status, lines.events, lines.end or now)


class _Dechunker:
    """Incremental decoder of ``Transfer-Encoding: chunked`` (size line, data, CRLF; ``0``
    ends; trailers are skipped)."""

    def __init__(self):
        self.buffer = bytearray()
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buffer = self.buffer
        buffer += data
        out = bytearray()
        pos = 0
        while not self.done:
            eol = buffer.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(bytes(buffer[pos:eol]).split(b";", 1)[0], 16)
            if size == 0:
                self.done = buffer.find(b"\r\n\r\n", eol) >= 0  # the empty line after trailers
                if self.done:
                    pos = len(buffer)
                break
            if len(buffer) < eol + 2 + size + 2:
                break
            out += buffer[eol + 2 : eol + 2 + size]
            pos = eol + 2 + size + 2
        del buffer[:pos]
        return bytes(out)


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
