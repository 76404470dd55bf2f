"""Flag definitions shared by the entry points: one ``--flag`` per ``EngineArgs`` field, the
flags of ``jaxpaged serve``, and the ``(EngineArgs, ServeConfig)`` they make.

``jaxpaged`` (``entrypoints/cli.py``), ``python -m jaxpaged.entrypoints.openai.api_server`` and
the benchmarks import this module; it imports no entry point, so imports point one way:
``cli`` -> ``openai/api_server`` -> ``openai/multi_api_server``, all of them -> this module.
Environment variables are read in ``entrypoints/env.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping

from jaxpaged.config import EngineArgs
from jaxpaged.engine_core.dp_balancer import DP_ROUTING_CHOICES
from jaxpaged.entrypoints.env import api_key_from_env, server_dev_mode_from_env
from jaxpaged.entrypoints.openai.serve_config import UVICORN_LOG_LEVELS
from jaxpaged.entrypoints.openai.template_sandbox import DEFAULT_MAX_QUEUED, DEFAULT_NUM_WORKERS
from jaxpaged.metrics import DEFAULT_METRICS_PREFIX, METRICS_PREFIX_CHOICES

# vLLM's short aliases of engine flags.
_SHORT_FLAGS = {"quantization": ("-q",)}


def add_engine_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per ``EngineArgs`` field, with the field's help text and default."""
    group = parser.add_argument_group("engine arguments")
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        if field.name in skip:
            continue
        flags = ["--" + field.name.replace("_", "-"), *_SHORT_FLAGS.get(field.name, ())]
        base = _base_type(hints[field.name])
        help_text = f"{field.metadata.get('help', '')} (default: {field.default})"
        if base is bool:
            group.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=field.default,
                help=help_text,
            )  # fmt: skip
        else:
            group.add_argument(*flags, type=base, default=field.default, help=help_text)


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` of the engine flags in ``namespace`` (fields it lacks keep their
    defaults).

    Raises:
        ValueError: from ``EngineArgs`` validation, naming the field.
    """
    values = {
        f.name: getattr(namespace, f.name)
        for f in dataclasses.fields(EngineArgs)
        if hasattr(namespace, f.name)
    }
    return EngineArgs(**values)


def _base_type(hint) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """Add the flags of ``jaxpaged serve`` (server options, then every engine argument) to
    ``serve``."""
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local HF model directory; omitted: the embedded stories260k (same as --model)",
    )
    serve.add_argument(
        "--host", default=None, help="address to listen on (default: all interfaces)"
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients send as `model`; the first is echoed in responses and "
        "labels the metrics (default: MODEL, or stories260k for the embedded model)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (default: env JAXPAGED_API_KEY, "
        "else no key)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="chat template file path or inline Jinja, replacing the tokenizer's",
    )
    serve.add_argument(
        "--max-num-queued-requests",
        type=int,
        default=None,
        help="most requests that may wait for a batch slot; more get HTTP 429 "
        "(default: unbounded, as vLLM)",
    )
    serve.add_argument(
        "--metrics-prefix",
        default=DEFAULT_METRICS_PREFIX,
        choices=METRICS_PREFIX_CHOICES,
        help="/metrics name prefix: jaxpaged:<name>, or vllm:<name> for gateways, autoscalers "
        "and dashboards built for vLLM (default: jaxpaged)",
    )
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine cores, each with its own KV cache and scheduler on its own device group of "
        "--tensor-parallel-size devices, behind this one API server (default: 1)",
    )
    serve.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        help="API server processes (HTTP, tokenization, detokenization, streaming) in front of "
        "the one engine core, sharing one listening port; more keep up with a fast GPU; "
        ">= 1, and 1 with --data-parallel-size > 1 (default: 1)",
    )
    serve.add_argument(
        "--dp-routing",
        default="least_loaded",
        choices=DP_ROUTING_CHOICES,
        help="how the API server picks an engine core: least_loaded (fewest outstanding "
        "requests) or prefix (the hash of the prompt's first full KV block, so requests that "
        "share a prefix share a prefix cache) (default: least_loaded)",
    )
    _add_feature_args(serve)
    add_engine_args(serve)


def _add_feature_args(serve: argparse.ArgumentParser) -> None:
    """``jaxpaged serve``'s flags of what the server offers: LoRA modules, tools and reasoning,
    vLLM's on/off switches, dev routes, request templates' workers, uvicorn's log level."""
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="LoRA adapters served at start-up (with --enable-lora): name=path, or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; clients select one by `model`',
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" on /v1/chat/completions: the --tool-call-parser finds '
        'tool calls in the model\'s text (default: off; "auto" is then a 400)',
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="the model family's tool-call format: hermes, llama3_json, mistral or pythonic "
        "(docs/tool_calling.md)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split the reply's <think>...</think> into the message's reasoning field: "
        "deepseek_r1 or qwen3 (default: none, all text is content)",
    )
    for flag, help_text in SERVE_SWITCHES.items():
        serve.add_argument(flag, action="store_true", help=help_text)
    serve.add_argument(
        "--enable-dev-endpoints",
        action="store_true",
        help="serve the development routes POST /sleep, POST /wake_up, GET /is_sleeping and "
        "POST /reset_prefix_cache (vLLM's dev mode; also on with env VLLM_SERVER_DEV_MODE=1); "
        "never expose them publicly",
    )
    serve.add_argument(
        "--chat-template-workers",
        type=int,
        default=DEFAULT_NUM_WORKERS,
        help="processes rendering the chat templates requests send (chat_template), each "
        f"sandboxed; >= 1 (default: {DEFAULT_NUM_WORKERS})",
    )
    serve.add_argument(
        "--max-queued-chat-templates",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        help="request templates that may wait for a rendering process; more get HTTP 503 with "
        f"Retry-After; >= 0 (default: {DEFAULT_MAX_QUEUED})",
    )
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's log level (default: info)",
    )


# vLLM's on/off serving flags (all off by default) -> their help; each is a ServeConfig field.
SERVE_SWITCHES = {
    "--return-tokens-as-token-ids": "write logprob tokens as 'token_id:<id>' unless a request "
    "sets return_tokens_as_token_ids (for tokens JSON cannot carry)",
    "--enable-prompt-tokens-details": "add usage.prompt_tokens_details.cached_tokens (prompt "
    "tokens read from the prefix cache) to responses",
    "--enable-tokenizer-info-endpoint": "serve GET /tokenizer_info (the tokenizer's "
    "configuration and chat template; off because it reveals the template)",
    "--enable-server-load-tracking": "count generation requests in flight for GET /load "
    "(otherwise it reports 0)",
}


def serve_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> tuple:
    """``(EngineArgs, ServeConfig)`` from parsed ``serve`` flags. ``environ`` supplies
    ``JAXPAGED_API_KEY``, the key when ``--api-key`` is not given, and ``VLLM_SERVER_DEV_MODE``
    (``"1"`` turns on ``--enable-dev-endpoints``) (None: this process's environment, through
    ``env.api_key_from_env`` / ``env.server_dev_mode_from_env``).

    Raises:
        ValueError: MODEL and --model disagree, --reasoning-parser and
            --structured-outputs-config's ``reasoning_parser`` disagree, a bad server flag
            (``ServeConfig.check``), bad --lora-modules (``check_lora_modules``), or bad engine
            arguments.
    """
    from jaxpaged.config import DEFAULT_MODEL_NAME
    from jaxpaged.entrypoints.openai.serve_config import ServeConfig
    from jaxpaged.entrypoints.openai.serving_models import check_lora_modules, parse_lora_modules

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(
            f"MODEL ({args.model_tag!r}) and --model ({args.model!r}) disagree; give one"
        )
    args.model = args.model_tag or args.model
    env_api_key = api_key_from_env() if environ is None else environ.get("JAXPAGED_API_KEY")
    env_dev_mode = (
        server_dev_mode_from_env()
        if environ is None
        else environ.get("VLLM_SERVER_DEV_MODE") == "1"
    )
    # Checked before the engine arguments: an unknown parser name fails at once.
    config = ServeConfig(
        served_model_names=args.served_model_name or [args.model or DEFAULT_MODEL_NAME],
        api_key=args.api_key or env_api_key or None,
        chat_template=args.chat_template,
        lora_modules=parse_lora_modules(args.lora_modules),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=_server_reasoning_parser(args),
        enable_dev_endpoints=bool(args.enable_dev_endpoints or env_dev_mode),
        metrics_prefix=args.metrics_prefix,
        chat_template_workers=args.chat_template_workers,
        max_queued_chat_templates=args.max_queued_chat_templates,
        host=args.host,
        port=args.port,
        max_num_queued_requests=args.max_num_queued_requests,
        data_parallel_size=args.data_parallel_size,
        dp_routing=args.dp_routing,
        api_server_count=args.api_server_count,
        uvicorn_log_level=args.uvicorn_log_level,
        **{_switch_key(flag): getattr(args, _switch_key(flag)) for flag in SERVE_SWITCHES},
    )
    engine_args = engine_args_from(args)
    # Before the engine core loads the model, not after.
    check_lora_modules(
        config.lora_modules,
        engine_args.enable_lora,
        config.served_model_names,
        engine_args.max_lora_rank,
    )
    return engine_args, config


def _server_reasoning_parser(args: argparse.Namespace) -> str | None:
    """The server's reasoning parser: ``--reasoning-parser``, else
    ``--structured-outputs-config``'s ``reasoning_parser`` (vLLM serves with
    ``structured_outputs_config.reasoning_parser``, which its flag sets; an empty name is none).

    Raises:
        ValueError: the config is malformed, or it and the flag name different parsers.
    """
    from jaxpaged.structured_output.config import StructuredOutputsConfig

    nested = StructuredOutputsConfig.parse(args.structured_outputs_config).reasoning_parser
    flag = args.reasoning_parser
    if flag and nested and flag != nested:
        raise ValueError(
            f"--reasoning-parser {flag!r} and --structured-outputs-config's reasoning_parser "
            f"{nested!r} disagree; give one"
        )
    if nested and not flag:
        from jaxpaged.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

        if nested not in REASONING_PARSERS:
            raise ValueError(
                f"structured_outputs_config.reasoning_parser {nested!r} is not a known "
                f"reasoning parser; choose one of {sorted(REASONING_PARSERS)}"
            )
    return flag or nested or None


def _switch_key(flag: str) -> str:
    """``--enable-x-y`` -> ``enable_x_y`` (argparse's attribute and the ServeConfig field)."""
    return flag.removeprefix("--").replace("-", "_")
