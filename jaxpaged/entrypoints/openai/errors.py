"""HTTP errors in OpenAI's JSON shape, and the FastAPI handlers that produce them.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (vLLM's current shape);
``type`` is the name of the exception the ``openai`` Python client raises for that status
(``BadRequestError`` for 400, ...), ``code`` the HTTP status. Request-body validation failures
are answered 400, as vLLM does, instead of FastAPI's 422.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxpaged.engine_core.core_client import EngineDeadError, QueueFullError
from jaxpaged.entrypoints.openai.protocol_base import ErrorInfo, ErrorResponse
from jaxpaged.sequence import EngineSleepingError
from jaxpaged.structured_output.compiler import GrammarCompilerBusy

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error answered with an HTTP status and OpenAI's error body."""

    status_code = HTTPStatus.BAD_REQUEST

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequestError(OpenAIError):
    status_code = HTTPStatus.BAD_REQUEST


class ServiceUnavailableError(OpenAIError):
    """A 503 that a load balancer should retry (elsewhere, or here after ``retry_after_s``)."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE

    def __init__(self, message: str, *, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AuthenticationError(OpenAIError):
    status_code = HTTPStatus.UNAUTHORIZED


class NotFoundError(OpenAIError):
    status_code = HTTPStatus.NOT_FOUND


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return ErrorResponse(
        error=ErrorInfo(message=message, type=error_type, param=param, code=status)
    )


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status)


def error_from_exception(error: BaseException) -> ErrorResponse:
    """The body for an exception raised while serving (also used inside SSE streams)."""
    if isinstance(error, OpenAIError):
        return error_body(int(error.status_code), error.message, error.param)
    if isinstance(error, QueueFullError):
        return error_body(429, str(error))
    if isinstance(error, ValueError):
        # SamplingParamsError (and similar) name the offending field in ``parameter``.
        return error_body(400, str(error), getattr(error, "parameter", None))
    if isinstance(error, (EngineDeadError, EngineSleepingError, GrammarCompilerBusy)):
        return error_body(503, str(error))
    return error_body(500, f"internal server error: {type(error).__name__}: {error}")


SLEEPING_RETRY_AFTER_S = 1
"""``Retry-After`` of a request refused by a sleeping engine: woken by an operator, not by
time, so a balancer that honours it tries another replica (or this one a second later)."""
GRAMMAR_BUSY_RETRY_AFTER_S = 1
"""``Retry-After`` of a constrained request refused while grammar compilations past their time
budget still run (they end on their own, and the refusals stop once fewer run)."""


def retry_after(error: BaseException) -> dict[str, str]:
    """The ``Retry-After`` header of a 503 that may succeed later (a sleeping engine, a full
    template-rendering queue, grammar compilations past their budget still running); no header
    for other errors (a dead engine stays dead)."""
    if isinstance(error, ServiceUnavailableError):
        return {"Retry-After": str(error.retry_after_s)}
    if isinstance(error, EngineSleepingError):
        return {"Retry-After": str(SLEEPING_RETRY_AFTER_S)}
    if isinstance(error, GrammarCompilerBusy):
        return {"Retry-After": str(GRAMMAR_BUSY_RETRY_AFTER_S)}
    return {}


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error as "field: rule (got value)" and the field's dotted name."""
    errors = error.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    field_error = getattr((first.get("ctx") or {}).get("error"), "parameter", None)
    if param is None and field_error is not None:
        # A body-level validator's FieldValueError: its message names the value already (the
        # input would be the whole body).
        return message, field_error
    if "input" in first and first.get("type") != "missing":
        got = repr(first["input"])
        message = f"{message} (got {got[:100]}{'...' if len(got) > 100 else ''})"
    if first.get("type") not in (None, "value_error"):
        # pydantic's error type, as pydantic (and so vLLM's 400) writes it: clients match on
        # it ("greater_than_equal", "int_parsing", ...).
        message = f"{message} [type={first['type']}]"
    if param is None:  # a body-level validator names its field on its error (FieldValueError)
        return message, getattr((first.get("ctx") or {}).get("error"), "parameter", None)
    return f"{param}: {message}", param


def install_error_handlers(app: FastAPI) -> None:
    """Map validation errors, our ``OpenAIError``s, HTTP errors and crashes to OpenAI bodies."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))

    async def _known(_: Request, error: Exception) -> JSONResponse:
        body = error_from_exception(error)
        if body.error.code >= 500 and not retry_after(error):
            logger.error("request failed: %s", error)
        return JSONResponse(
            body.model_dump(), status_code=body.error.code, headers=retry_after(error)
        )

    # Expected failures get their own handlers (Starlette re-raises what only the catch-all
    # ``Exception`` handler answers, which would log a traceback for every 400).
    for error_class in (
        OpenAIError, ValueError, QueueFullError, EngineDeadError, EngineSleepingError,
        GrammarCompilerBusy,
    ):  # fmt: skip
        app.add_exception_handler(error_class, _known)

    app.add_middleware(_InternalErrorMiddleware)


class _InternalErrorMiddleware:
    """Answer an unexpected exception with a 500 in OpenAI's shape, and keep the connection.

    Starlette's catch-all handler (``exception_handler(Exception)``) sends the response and
    then re-raises, and uvicorn closes a connection whose application raised: the client's next
    request on that keep-alive connection failed with "connection reset". Here the exception
    ends with the response. Pure ASGI (``BaseHTTPMiddleware`` would wrap streaming bodies); a
    failure after a response started is re-raised, as nothing can be answered any more."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:
            if started:
                raise
            logger.error("request failed", exc_info=error)
            body = error_from_exception(error)
            response = JSONResponse(body.model_dump(), status_code=body.error.code)
            await response(scope, receive, send)
