"""The OpenAI-compatible HTTP server: a FastAPI app in the API process, over an engine core.

This process does HTTP, tokenization, detokenization, stop strings and streaming; the engine
core runs in its own process (``jaxpaged/engine_core/core.py``) and is reached through an
``EngineCoreClient`` (vLLM v1's split). ``python -m jaxpaged.entrypoints.openai.api_server``
takes the same flags as ``jaxpaged serve``.

Routes (vLLM's, ``vllm/entrypoints/openai/api_server.py``): ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` (200, or 503 once the engine
core has died), ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``
(Prometheus text), ``POST /invocations`` (SageMaker), ``GET /load`` and, with its flag,
``GET /tokenizer_info`` (``optional_routes.py``). With an API key, only ``/v1/*`` paths require
``Authorization: Bearer <key>`` (401 otherwise), as in vLLM. With ``--skip-tokenizer-init``
there is no tokenizer: prompts must be token ids and outputs carry no text.

The options are one frozen ``ServeConfig`` (``serve_config.py``; ``jaxpaged serve``'s flags).
``build_app`` builds one process's app in parts: ``_Serving`` (the handlers, the metrics and
the lifespan they share), then the status, LoRA, dev, generation and tokenizer routes.
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
import dataclasses
import secrets
import sys
from collections.abc import Awaitable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers

import jaxpaged
from jaxpaged.engine_core.core import freeze_gc_heap
from jaxpaged.engine_core.core_client import EngineCoreClient
from jaxpaged.engine_core.dp_client import DPEngineCoreClient
from jaxpaged.entrypoints.cli_args import add_serve_args, serve_config
from jaxpaged.entrypoints.env import prometheus_multiproc_dir, set_jax_memory_fraction
from jaxpaged.entrypoints.openai.chat_template import load_chat_template
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
    TokenizeRequest,
    TokenizeResponse,
)
from jaxpaged.entrypoints.openai.serve_config import ServeConfig
from jaxpaged.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxpaged.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxpaged.entrypoints.openai.serving_models import (
    LoRAModulePath,
    ModelList,
    OpenAIServingModels,
    add_lora_routes,
)
from jaxpaged.entrypoints.openai.template_sandbox import TemplateSandbox
from jaxpaged.metrics import ServerMetrics, render_all, render_multiprocess


def build_app(
    client: EngineCoreClient,
    config: ServeConfig,
    *,
    model: str,
    tokenizer,
    api_server_index: int = 0,
    multiprocess_metrics_dir: str | None = None,
) -> FastAPI:
    """The server app over ``client`` (a spawned ``EngineCoreClient``, or one connected to a
    core the parent process started), with the options of ``config`` that concern one API
    process; the client's tasks start with the app's lifespan, and a core the client started
    is shut down with it.

    Args:
        model: the model path, reported as ``root`` by ``/v1/models`` (and the served name
            when ``config`` gives none).
        tokenizer: the API process's tokenizer; None serves token-id prompts only.
        api_server_index: this process's index among the ``config.api_server_count`` API
            processes of one engine core. Only index 0 keeps the engine-level metrics; with a
            count above 1 runtime LoRA loading is refused (HTTP 400: each process has its own
            adapter list).
        multiprocess_metrics_dir: the ``PROMETHEUS_MULTIPROC_DIR`` of several API processes;
            ``/metrics`` then renders every process's values (``render_multiprocess``). None:
            this process's own registries.

    ``app.state.engine`` is the client, ``app.state.metrics`` its ``ServerMetrics``,
    ``app.state.chat`` the chat handler (its ``template_sandbox`` renders requests' templates).

    Raises:
        ValueError: a bad chat template, ``lora_modules`` without LoRA or with a name used
            twice (and what ``ServeConfig.check`` refuses).
    """
    serving = _Serving.create(
        client,
        config,
        model=model,
        tokenizer=tokenizer,
        api_server_index=api_server_index,
        multiprocess=multiprocess_metrics_dir is not None,
    )
    app = FastAPI(title="jaxpaged OpenAI-compatible server", lifespan=serving.lifespan)
    app.state.engine = client
    app.state.metrics = serving.engine_metrics[0]
    app.state.chat = serving.chat
    install_error_handlers(app)
    if config.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=config.api_key)
    _add_status_routes(app, serving, multiprocess_metrics_dir)
    add_lora_routes(app, serving.models)
    if config.enable_dev_endpoints:
        add_dev_routes(app, client)
    _add_generation_routes(app, serving, config)
    _add_tokenizer_routes(app, serving)
    return app


@dataclasses.dataclass
class _Serving:
    """What the routes of one app share: the engine client, the handlers and the metrics."""

    engine: EngineCoreClient
    tokenizer: object
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    models: OpenAIServingModels
    load: ServerLoad
    engine_metrics: list[ServerMetrics]
    chat_template: str | None
    lora_modules: tuple[LoRAModulePath, ...]

    @classmethod
    def create(
        cls,
        client: EngineCoreClient,
        config: ServeConfig,
        *,
        model: str,
        tokenizer,
        api_server_index: int,
        multiprocess: bool,
    ) -> _Serving:
        names = list(config.model_names(model))
        # One ServerMetrics per engine core (``engine`` label), rendered as one exposition.
        engine_metrics = client.attach_metrics(
            lambda index: ServerMetrics(
                names[0],
                prefix=config.metrics_prefix,
                engine_index=index,
                max_loras=client.info.get("max_loras") or 0,
                observes_engine=api_server_index == 0,
                multiprocess=multiprocess,
            )
        )
        max_model_len = client.info["max_model_len"]
        common = dict(
            engine=client,
            tokenizer=tokenizer,
            served_model_names=names,
            max_model_len=max_model_len,
            return_tokens_as_token_ids=config.return_tokens_as_token_ids,
            enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        )
        chat_template = load_chat_template(config.chat_template)
        sandbox = TemplateSandbox(
            num_workers=config.chat_template_workers,
            max_queued=config.max_queued_chat_templates,
        )  # its workers start on first use
        chat = OpenAIServingChat(
            **common,
            chat_template=chat_template,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            template_sandbox=sandbox,
            **resolve_parsers(
                config.enable_auto_tool_choice, config.tool_call_parser, config.reasoning_parser
            ),
        )
        completion = OpenAIServingCompletion(**common)
        models = OpenAIServingModels(
            client, names, model, max_model_len, api_server_count=config.api_server_count
        )
        models.check_static_loras(config.lora_modules)
        completion.models = chat.models = models
        load = ServerLoad(config.enable_server_load_tracking)
        return cls(
            client, tokenizer, completion, chat, models, load, engine_metrics, chat_template,
            config.lora_modules,
        )  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI):
        """Start the client's tasks and load ``--lora-modules``; at the end, stop the
        template workers and the client (and a core it started)."""
        await self.engine.start()
        try:
            await self.models.init_static_loras(self.lora_modules)
            yield
        finally:
            self.chat.close()
            await self.engine.shutdown()


def _add_status_routes(app: FastAPI, serving: _Serving, multiprocess_dir: str | None) -> None:
    """``GET /health``, ``/version``, ``/v1/models`` and ``/metrics``."""
    engine = serving.engine

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
        return serving.models.model_list()

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if multiprocess_dir is not None:
            text = await asyncio.to_thread(render_multiprocess, multiprocess_dir)
        else:
            text = render_all(serving.engine_metrics)
        return Response(text, media_type=CONTENT_TYPE_LATEST)


def _add_generation_routes(app: FastAPI, serving: _Serving, config: ServeConfig) -> None:
    """``POST /v1/completions``, ``/v1/chat/completions`` and the routes that reach them
    (``optional_routes``: ``/invocations``, ``/load``, ``/tokenizer_info``)."""
    load = serving.load

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await load.call(
            _cancel_on_disconnect(raw_request, serving.completion.create_completion(request))
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await load.call(
            _cancel_on_disconnect(raw_request, serving.chat.create_chat_completion(request))
        )

    add_optional_routes(
        app,
        load=load,
        handlers={ChatCompletionRequest: chat_completions, CompletionRequest: completions},
        tokenizer=serving.tokenizer,
        chat_template=serving.chat_template,
        enable_tokenizer_info_endpoint=config.enable_tokenizer_info_endpoint,
    )


def _add_tokenizer_routes(app: FastAPI, serving: _Serving) -> None:
    """``POST /tokenize`` (a prompt, or messages through the chat template) and
    ``/detokenize``."""
    completion, chat, tokenizer = serving.completion, serving.chat, serving.tokenizer

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
            count=len(ids), max_model_len=completion.max_model_len, tokens=ids, token_strs=strs
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
    engine_args, config: ServeConfig, *, multiprocess_metrics_dir: str | None = None
) -> int:
    """Start the engine core(s) for ``engine_args`` (``EngineArgs``) and serve ``config`` until
    interrupted; returns the exit status (0, or 1 when an API process of several died).

    The tokenizer is loaded here (the API process) unless ``engine_args.skip_tokenizer_init``.
    ``config.api_server_count`` > 1: that many API processes over one core
    (``multi_api_server.run_multi_api_server``), whose metrics live in
    ``multiprocess_metrics_dir`` (``PROMETHEUS_MULTIPROC_DIR``, exported by ``jaxpaged serve``).

    Raises:
        ValueError: invalid engine arguments (checked before the core starts), several API
            processes without ``multiprocess_metrics_dir``.
        RuntimeError: the engine core failed to start.
    """
    import uvicorn

    if config.api_server_count > 1:
        from jaxpaged.entrypoints.openai.multi_api_server import run_multi_api_server

        if multiprocess_metrics_dir is None:
            raise ValueError(
                f"--api-server-count {config.api_server_count} needs a multiprocess_metrics_dir "
                "(the PROMETHEUS_MULTIPROC_DIR of the API processes)"
            )
        return run_multi_api_server(
            engine_args,
            config,
            multiprocess_metrics_dir=multiprocess_metrics_dir,
            build_app=build_app,
        )
    model_config = engine_args.create_engine_config().model_config
    tokenizer = load_tokenizer(model_config)
    spawn_args = dict(tokenizer=tokenizer, max_num_queued_requests=config.max_num_queued_requests)
    if config.data_parallel_size == 1 and config.dp_routing == "least_loaded":
        client = EngineCoreClient.spawn(engine_args, **spawn_args)
    else:  # N engine cores, each on its own device group, behind one balancer
        client = DPEngineCoreClient.spawn(
            engine_args,
            data_parallel_size=config.data_parallel_size,
            dp_routing=config.dp_routing,
            **spawn_args,
        )
    app = build_app(client, config, model=model_config.model, tokenizer=tokenizer)
    freeze_gc_heap()  # the tokenizer and the app live as long as this process
    uvicorn.run(
        app, host=config.host or "0.0.0.0", port=config.port, log_level=config.uvicorn_log_level
    )
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
        ValueError: bad flags (``cli_args.serve_config``) or engine arguments.
    """
    engine_args, config = serve_config(args)
    set_jax_memory_fraction(engine_args.gpu_memory_utilization)
    if config.api_server_count == 1:
        return run_server(engine_args, config)
    with prometheus_multiproc_dir() as metrics_dir:
        return run_server(engine_args, config, multiprocess_metrics_dir=metrics_dir)


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
