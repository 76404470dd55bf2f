"""One request's outputs in the API process, and the errors a client raises for it.

``RequestStream`` is what ``EngineCoreClient.add_request`` returns: the request's cumulative
``RequestOutput``s as an async iterator, fed by the client's receive task. ``EngineDeadError``
ends every open stream when the core dies (HTTP 503); ``refusal_error`` rebuilds the core's
refusal of an ``add`` (HTTP 400, 429 for a full queue, 503 for a sleeping engine or a busy
grammar compiler).
"""

from __future__ import annotations

import asyncio

from jaxpaged.engine_core.core import QueueFullError
from jaxpaged.outputs import RequestOutput
from jaxpaged.sequence import EngineSleepingError
from jaxpaged.structured_output.compiler import GrammarCompilerBusy


class EngineDeadError(RuntimeError):
    """The engine core has died; no request can be served any more."""


class RequestStream:
    """The outputs of one request as an async iterator (consumed on the event loop).

    Outputs are cumulative (``RequestState.update``), so a stream holds only the newest one: if
    the consumer falls behind (a slow client, or an event loop busy with many streams at
    saturation), the steps it missed arrive merged into one output instead of queueing up,
    as vLLM v1's ``RequestOutputCollector`` does. An error is raised after the newest output.
    """

    def __init__(self, request_id: str, client):
        # client: the EngineCoreClient whose abort() a close calls (None in tests).
        self.request_id = request_id
        self._client = client
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False
        self._closed = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._latest = item  # includes any unread older output
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._latest is None and self._error is None:
            await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        if item is None:
            self.finished = True
            raise self._error
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it has finished; idempotent."""
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._client.abort(self.request_id)


class RequestRefusedError(ValueError):
    """The core refused a request's prompt or parameters (HTTP 400); ``parameter`` names the
    field when the core's error did (``SamplingParamsError``)."""

    def __init__(self, message: str, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


def refusal_error(name: str, message: str, parameter: str | None) -> Exception:
    """The core's refusal as the exception the server maps to a status (400, 429, or 503 for
    a sleeping engine or a busy grammar compiler)."""
    for retryable in (QueueFullError, EngineSleepingError, GrammarCompilerBusy):
        if name == retryable.__name__:
            return retryable(message)
    return RequestRefusedError(message, parameter)
