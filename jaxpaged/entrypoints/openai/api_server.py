"""The OpenAI-compatible HTTP server: a FastAPI app in the API process, over an engine core.

This process does HTTP, tokenization, detokenization, stop strings and streaming; the engine
core runs in its own process (``jaxpaged/engine/core.py``) and is reached through an
``EngineCoreClient`` (vLLM v1's split). ``python -m jaxpaged.entrypoints.openai.api_server``
takes the same flags as ``jaxpaged serve``.

Routes (vLLM's, ``reference/vllm_surface.md`` section 2.2): ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` (200, or 503 once the engine
core has died), ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``
(Prometheus text), ``POST /invocations`` (SageMaker), ``GET /load`` and, with its flag,
``GET /tokenizer_info`` (``optional_routes.py``). With an API key, only ``/v1/*`` paths require
``Authorization: Bearer <key>`` (401 otherwise), as in vLLM. With ``--skip-tokenizer-init``
there is no tokenizer: prompts must be token ids and outputs carry no text.

``--api-server-count N`` runs N such processes in front of one engine core, sharing one
listening socket (``multi_api_server.py``); ``build_app`` then gets the process's index and the
multiprocess metrics directory.

A client that disconnects has its engine requests aborted: streaming responses through
Starlette's disconnect listener (which cancels the body iterator), whole responses through
``_cancel_on_disconnect``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import sys
from collections.abc import Awaitable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers

import jaxpaged
from jaxpaged.engine.core import freeze_gc_heap
from jaxpaged.engine.core_client import EngineCoreClient
from jaxpaged.engine.dp_client import DPEngineCoreClient
from jaxpaged.entrypoints.cli_args import add_serve_args, check_api_server_count, serve_options
from jaxpaged.entrypoints.env import prometheus_multiproc_dir, set_jax_memory_fraction
from jaxpaged.entrypoints.openai.chat_tools import resolve_parsers
from jaxpaged.entrypoints.openai.dev_endpoints import add_dev_routes
from jaxpaged.entrypoints.openai.errors import (
    BadRequestError,
    error_response,
    install_error_handlers,
)
from jaxpaged.entrypoints.openai.optional_routes import ServerLoad, add_optional_routes
from jaxpaged.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from jaxpaged.entrypoints.openai.serving_chat import OpenAIServingChat, load_chat_template
from jaxpaged.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxpaged.entrypoints.openai.serving_models import (
    LoRAModulePath,
    OpenAIServingModels,
    add_lora_routes,
)
from jaxpaged.metrics import ServerMetrics, render_all, render_multiprocess


def build_app(
    client: EngineCoreClient,
    *,
    model: str,
    tokenizer,
    served_model_names: Sequence[str] | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
    metrics_prefix: str = "jaxpaged",
    lora_modules: Sequence[LoRAModulePath] = (),
    api_server_index: int = 0,
    api_server_count: int = 1,
    multiprocess_metrics_dir: str | None = None,
    return_tokens_as_token_ids: bool = False,
    enable_prompt_tokens_details: bool = False,
    enable_tokenizer_info_endpoint: bool = False,
    enable_server_load_tracking: bool = False,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    enable_dev_endpoints: bool = False,
) -> FastAPI:
    """The server app over ``client`` (a spawned ``EngineCoreClient``, or one connected to a
    core the parent process started); the client's tasks start with the app's lifespan, and a
    core the client started is shut down with it.

    Args:
        model: the model path, reported as ``root`` by ``/v1/models``.
        tokenizer: the API process's tokenizer; None serves token-id prompts only.
        served_model_names: accepted ``model`` values; the first is echoed in responses and
            is the ``model_name`` metric label. None: ``model``.
        api_key: required as ``Authorization: Bearer <key>`` on ``/v1/*``; None: no key.
        chat_template: a file path or inline Jinja template replacing the tokenizer's.
        metrics_prefix: ``/metrics`` name prefix, ``"jaxpaged"`` or ``"vllm"`` (vLLM's names,
            for gateways and autoscalers; ``jaxpaged.metrics``).
        lora_modules: LoRA adapters loaded at start-up (``--lora-modules``; needs an engine
            core built with ``enable_lora``), in the core once the app's lifespan starts.
        api_server_index / api_server_count: this process's index among the API processes of
            one engine core (``--api-server-count``). Only index 0 keeps the engine-level
            metrics; with a count above 1 runtime LoRA loading is refused (HTTP 400: each
            process has its own adapter list).
        multiprocess_metrics_dir: the ``PROMETHEUS_MULTIPROC_DIR`` of several API processes;
            ``/metrics`` then renders every process's values (``render_multiprocess``). None:
            this process's own registries.
        return_tokens_as_token_ids: logprob tokens written ``token_id:<id>`` unless a request
            sets ``return_tokens_as_token_ids`` (vLLM's ``--return-tokens-as-token-ids``).
        enable_prompt_tokens_details: usage carries ``prompt_tokens_details.cached_tokens``.
        enable_tokenizer_info_endpoint: serve ``GET /tokenizer_info``.
        enable_server_load_tracking: ``GET /load`` counts the generation requests in flight.
        enable_auto_tool_choice / tool_call_parser: serve ``tool_choice="auto"``, reading
            calls with the named parser (``tool_parsers``); the flag needs a parser.
        reasoning_parser: split ``<think>…</think>`` into ``reasoning``
            (``reasoning_parsers``); None: replies are all content.
        enable_dev_endpoints: add vLLM's dev-mode routes (``dev_endpoints.add_dev_routes``:
            sleep mode and prefix-cache reset); vLLM reads ``VLLM_SERVER_DEV_MODE``, here the
            caller decides (``jaxpaged serve --enable-dev-endpoints``).

    ``app.state.engine`` is the client, ``app.state.metrics`` its ``ServerMetrics``.

    Raises:
        ValueError: an empty served name list, a bad chat template or metrics prefix,
            ``lora_modules`` without LoRA or with a name used twice, an unknown tool or
            reasoning parser, --enable-auto-tool-choice without a tool parser.
    """
    parsers = resolve_parsers(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    names = list(served_model_names or [model])
    if not names or not all(names):
        raise ValueError(f"served_model_names must be non-empty names, got {names!r}")
    # One ServerMetrics per engine core (``engine`` label), rendered as one exposition.
    engine_metrics = client.attach_metrics(
        lambda index: ServerMetrics(
            names[0],
            prefix=metrics_prefix,
            engine_index=index,
            max_loras=client.info.get("max_loras") or 0,
            observes_engine=api_server_index == 0,
            multiprocess=multiprocess_metrics_dir is not None,
        )
    )
    metrics = engine_metrics[0]
    engine = client
    max_model_len = client.info["max_model_len"]
    common = dict(
        engine=engine,
        tokenizer=tokenizer,
        served_model_names=names,
        max_model_len=max_model_len,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )
    chat_template = load_chat_template(chat_template)
    completion = OpenAIServingCompletion(**common)
    chat = OpenAIServingChat(
        **common,
        chat_template=chat_template,
        enable_auto_tool_choice=enable_auto_tool_choice,
        **parsers,
    )
    load = ServerLoad(enable_server_load_tracking)
    models = OpenAIServingModels(
        engine, names, model, max_model_len, api_server_count=api_server_count
    )
    models.check_static_loras(lora_modules)
    completion.models = chat.models = models

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        try:
            await models.init_static_loras(lora_modules)
            yield
        finally:
            chat.close()
            await engine.shutdown()

    app = FastAPI(title="jaxpaged OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.chat = chat  # its template_sandbox: swapped by the tests
    install_error_handlers(app)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return error_response(503, f"the engine core has died: {engine.dead_error}")
        alive = engine.engine_health()
        if not all(alive):  # data parallelism: still serving on the live cores
            dead = [index for index, ok in enumerate(alive) if not ok]
            return JSONResponse({"status": "degraded", "dead_engines": dead})
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": jaxpaged.__version__})

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return models.model_list()

    add_lora_routes(app, models)
    if enable_dev_endpoints:
        add_dev_routes(app, engine)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await load.call(
            _cancel_on_disconnect(raw_request, completion.create_completion(request))
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await load.call(
            _cancel_on_disconnect(raw_request, chat.create_chat_completion(request))
        )

    add_optional_routes(
        app,
        load=load,
        handlers={ChatCompletionRequest: chat_completions, CompletionRequest: completions},
        tokenizer=tokenizer,
        chat_template=chat_template,
        enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint,
    )

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        completion.check_model(request.model)
        completion.require_tokenizer("/tokenize")
        if request.messages is not None:
            text = await chat.render_messages(
                request.messages,
                chat_template=request.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
                tools=[t.model_dump(exclude_none=True) for t in request.tools]
                if request.tools
                else None,
            )
            add_special = bool(request.add_special_tokens)
        else:
            text = request.prompt
            add_special = request.add_special_tokens is not False
        ids = await completion.encode(text, add_special_tokens=add_special)
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        completion.check_model(request.model)
        completion.require_tokenizer("/detokenize")
        bad = [t for t in request.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise BadRequestError(
                f"token id {bad[0]} is out of vocabulary: outside the vocabulary "
                f"[0, {len(tokenizer)})",
                param="tokens",
            )
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if multiprocess_metrics_dir is not None:
            text = await asyncio.to_thread(render_multiprocess, multiprocess_metrics_dir)
        else:
            text = render_all(engine_metrics)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


async def _cancel_on_disconnect(raw_request: Request, handler: Awaitable[Response]) -> Response:
    """Run ``handler``, cancelling it (its ``finally`` blocks abort the engine requests) if the
    client disconnects first. vLLM's ``with_cancellation`` does the same."""
    handler_task = asyncio.ensure_future(handler)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    done, _ = await asyncio.wait(
        {handler_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED
    )
    if handler_task in done:
        disconnect_task.cancel()
        return handler_task.result()
    handler_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await handler_task
    # Nobody reads this: the client is gone.
    return Response(status_code=499)


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


class _APIKeyMiddleware:
    """Pure ASGI middleware (``BaseHTTPMiddleware`` would wrap streaming responses and hide
    client disconnects): ``/v1/*`` needs ``Authorization: Bearer <api_key>``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
        ):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self._expected):
                response = error_response(401, "Unauthorized: missing or invalid API key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def run_server(
    engine_args,
    *,
    host: str | None = None,
    port: int = 8000,
    served_model_names: Sequence[str] | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
    max_num_queued_requests: int | None = None,
    metrics_prefix: str = "jaxpaged",
    data_parallel_size: int = 1,
    dp_routing: str = "least_loaded",
    uvicorn_log_level: str = "info",
    lora_modules: Sequence[LoRAModulePath] = (),
    api_server_count: int = 1,
    multiprocess_metrics_dir: str | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    enable_dev_endpoints: bool = False,
    **response_options,
) -> int:
    """Start the engine core for ``engine_args`` (``EngineArgs``) and serve until interrupted;
    returns the exit status (0, or 1 when an API process of several died).

    ``host`` None listens on all interfaces (vLLM's default). The tokenizer is loaded here
    (the API process) unless ``engine_args.skip_tokenizer_init``. ``api_server_count`` > 1:
    that many API processes over one core (``multi_api_server.run_multi_api_server``), whose
    metrics live in ``multiprocess_metrics_dir`` (``PROMETHEUS_MULTIPROC_DIR``, exported by
    ``jaxpaged serve``). The parser options are ``build_app``'s (every API process gets them).
    ``response_options``: ``build_app``'s ``return_tokens_as_token_ids``,
    ``enable_prompt_tokens_details``, ``enable_tokenizer_info_endpoint`` and
    ``enable_server_load_tracking``.

    Raises:
        ValueError: invalid engine arguments (checked before the core starts),
            ``api_server_count`` < 1 or above 1 with data parallelism or without
            ``multiprocess_metrics_dir``, an unknown tool or reasoning parser,
            ``enable_dev_endpoints`` with data parallelism.
        RuntimeError: the engine core failed to start.
    """
    import uvicorn

    app_options = dict(
        served_model_names=served_model_names,
        api_key=api_key,
        chat_template=chat_template,
        metrics_prefix=metrics_prefix,
        lora_modules=lora_modules,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        enable_dev_endpoints=enable_dev_endpoints,
        **response_options,
    )
    resolve_parsers(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    if enable_dev_endpoints and data_parallel_size != 1:
        raise ValueError(
            "--enable-dev-endpoints needs --data-parallel-size 1 (sleep mode is per engine core)"
        )
    if api_server_count != 1 or data_parallel_size != 1:
        check_api_server_count(api_server_count, data_parallel_size)
    if api_server_count > 1:
        from jaxpaged.entrypoints.openai.multi_api_server import run_multi_api_server

        if multiprocess_metrics_dir is None:
            raise ValueError(
                f"--api-server-count {api_server_count} needs a multiprocess_metrics_dir "
                "(the PROMETHEUS_MULTIPROC_DIR of the API processes)"
            )
        return run_multi_api_server(
            engine_args,
            api_server_count=api_server_count,
            multiprocess_metrics_dir=multiprocess_metrics_dir,
            host=host,
            port=port,
            max_num_queued_requests=max_num_queued_requests,
            uvicorn_log_level=uvicorn_log_level,
            app_options=app_options,
            build_app=build_app,
        )
    model_config = engine_args.create_engine_config().model_config
    tokenizer = load_tokenizer(model_config)
    spawn_args = dict(tokenizer=tokenizer, max_num_queued_requests=max_num_queued_requests)
    if data_parallel_size == 1 and dp_routing == "least_loaded":
        client = EngineCoreClient.spawn(engine_args, **spawn_args)
    else:  # N engine cores, each on its own device group, behind one balancer
        client = DPEngineCoreClient.spawn(
            engine_args, data_parallel_size=data_parallel_size, dp_routing=dp_routing, **spawn_args
        )
    app = build_app(client, model=model_config.model, tokenizer=tokenizer, **app_options)
    freeze_gc_heap()  # the tokenizer and the app live as long as this process
    uvicorn.run(app, host=host or "0.0.0.0", port=port, log_level=uvicorn_log_level)
    return 0


def load_tokenizer(model_config):
    """The API process's tokenizer for ``model_config`` (``ModelConfig``); None with
    ``skip_tokenizer_init``."""
    if model_config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer)


def serve(args: argparse.Namespace) -> int:
    """Run the server for parsed ``jaxpaged serve`` flags (``cli_args.add_serve_args``): size
    JAX's memory pool for the engine core (a child process that inherits the variable; this
    process never uses JAX), export ``PROMETHEUS_MULTIPROC_DIR`` for several API processes, and
    ``run_server``.

    Raises:
        ValueError: bad flags (``cli_args.serve_options``) or engine arguments.
    """
    options = serve_options(args)
    set_jax_memory_fraction(options["engine_args"].gpu_memory_utilization)
    if options["api_server_count"] == 1:
        return run_server(**options)
    with prometheus_multiproc_dir() as metrics_dir:
        return run_server(**options, multiprocess_metrics_dir=metrics_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxpaged.entrypoints.openai.api_server [flags]``: ``jaxpaged serve`` without
    the ``jaxpaged`` command; a bad flag value prints the error and returns 2."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxpaged.entrypoints.openai.api_server",
        description="The OpenAI-compatible HTTP server (same flags as `jaxpaged serve`).",
    )
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        return serve(args)
    except ValueError as error:
        print(f"jaxpaged: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
