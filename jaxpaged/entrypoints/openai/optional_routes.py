"""vLLM's secondary routes: ``POST /invocations`` (SageMaker), ``GET /load`` and, behind its
flag, ``GET /tokenizer_info``.

- ``/invocations``: SageMaker sends every request to one path; the body's shape picks the
  handler, tried in vLLM's order (a chat request, then a completion request). A body that fits
  neither is a 400 naming the expected types, or the validation error of the one it resembles
  (``messages`` -> chat, ``prompt`` -> completions).
- ``/load`` (vLLM's ``--enable-server-load-tracking``): ``{"server_load": n}``, the generation
  requests in flight (a streamed one until its last chunk is sent or the client leaves); 0 while
  tracking is off.
- ``/tokenizer_info`` (``--enable-tokenizer-info-endpoint``): the tokenizer's configuration
  (``tokenizer_config.json``'s entries as the tokenizer holds them), its class and the chat
  template the server uses; off by default, as in vLLM, because it reveals the template.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxpaged.entrypoints.openai.errors import BadRequestError
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

_INVOCATION_TYPES = (ChatCompletionRequest, CompletionRequest)  # vLLM's order


class ServerLoad:
    """Generation requests in flight, counted only when ``enabled``."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.count = 0

    async def call(self, handler: Awaitable[Response]) -> Response:
        """Await ``handler``, counting it until its response (a stream: its body) ends."""
        if not self.enabled:
            return await handler
        self.count += 1
        try:
            response = await handler
        except BaseException:
            self.count -= 1
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._counted(response.body_iterator)
        else:
            self.count -= 1
        return response

    async def _counted(self, body: AsyncIterator) -> AsyncIterator:
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.count -= 1


def add_optional_routes(
    app: FastAPI,
    *,
    load: ServerLoad,
    handlers: dict[type, Callable[[object, Request], Awaitable[Response]]],
    tokenizer,
    chat_template: str | None,
    enable_tokenizer_info_endpoint: bool,
) -> None:
    """Register ``/invocations``, ``/load`` and (when enabled) ``/tokenizer_info`` on ``app``.

    Args:
        handlers: request model -> the route function serving it (chat, completions).
        chat_template: the server's template (``--chat-template``), else the tokenizer's.
    """

    @app.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        try:
            body = await raw_request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BadRequestError(f"the request body is not valid JSON: {error}") from None
        errors = {}
        for request_type in _INVOCATION_TYPES:
            try:
                request = request_type.model_validate(body)
            except pydantic.ValidationError as error:
                errors[request_type] = error
                continue
            return await handlers[request_type](request, raw_request)
        resembles = None
        if isinstance(body, dict):
            resembles = (
                ChatCompletionRequest
                if "messages" in body
                else CompletionRequest
                if "prompt" in body
                else None
            )
        if resembles is not None:  # its own validation error, as its route would answer
            raise RequestValidationError(errors[resembles].errors())
        names = [t.__name__ for t in _INVOCATION_TYPES]
        raise BadRequestError(f"Cannot find suitable handler for request. Expected one of: {names}")

    @app.get("/load")
    async def server_load() -> JSONResponse:
        return JSONResponse({"server_load": load.count})

    if enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            if tokenizer is None:
                raise BadRequestError(
                    "/tokenizer_info needs a tokenizer, but the server was started with "
                    "--skip-tokenizer-init"
                )
            return JSONResponse(tokenizer_info_of(tokenizer, chat_template))


def tokenizer_info_of(tokenizer, chat_template: str | None) -> dict:
    """``/tokenizer_info``'s body: the tokenizer's init keywords (its configuration) made JSON
    safe, without the tokenizer object and the added-token table (vLLM leaves both out), plus
    ``tokenizer_class`` and the ``chat_template`` in use (None: none)."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    config.pop("tokenizer_object", None)
    config.pop("added_tokens_decoder", None)
    config = {key: _json_safe(value) for key, value in config.items()}
    config["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def _json_safe(value):
    """``value`` with what JSON cannot hold (AddedToken objects, paths) written as strings."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
