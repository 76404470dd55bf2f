"""``ServeConfig``: every option of the OpenAI server that is not an engine argument, in one
frozen value (as ``EngineConfig`` is for the engine).

``jaxpaged serve``'s flags become an ``(EngineArgs, ServeConfig)`` pair
(``cli_args.serve_config``); ``run_server`` starts the processes it describes and
``build_app`` builds each API process's app from it. The fields keep the flags' names (vLLM's
where vLLM has the flag). ``check`` refuses what can be refused without the engine; the LoRA
modules' directories are checked by ``cli_args`` against the engine arguments.
"""

from __future__ import annotations

import dataclasses

from jaxpaged.engine_core.dp_balancer import DP_ROUTING_CHOICES
from jaxpaged.entrypoints.openai.serving_models import LoRAModulePath
from jaxpaged.entrypoints.openai.template_sandbox import DEFAULT_MAX_QUEUED, DEFAULT_NUM_WORKERS
from jaxpaged.metrics import DEFAULT_METRICS_PREFIX, METRICS_PREFIX_CHOICES

# uvicorn's --log-level values (``--uvicorn-log-level``).
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The server's options. Lists given as lists are kept as tuples.

    Raises:
        ValueError: from ``check``, naming the flag.
    """

    # ------------------------------------------------------------------ what clients see
    served_model_names: tuple[str, ...] | None = None
    """Accepted ``model`` values; the first is echoed in responses and labels the metrics.
    None: the model path."""
    api_key: str | None = None
    """Required as ``Authorization: Bearer <key>`` on ``/v1/*``; None: no key."""
    chat_template: str | None = None
    """A file path or inline Jinja template replacing the tokenizer's."""
    lora_modules: tuple[LoRAModulePath, ...] = ()
    """LoRA adapters loaded at start-up (``--lora-modules``; the engine needs
    ``enable_lora``)."""
    enable_auto_tool_choice: bool = False
    """Serve ``tool_choice="auto"``, reading calls with ``tool_call_parser``."""
    tool_call_parser: str | None = None
    """The model family's tool-call format (``tool_parsers``)."""
    reasoning_parser: str | None = None
    """Split ``<think>…</think>`` into ``reasoning`` (``reasoning_parsers``)."""
    return_tokens_as_token_ids: bool = False
    """Logprob tokens written ``token_id:<id>`` unless a request says otherwise."""
    enable_prompt_tokens_details: bool = False
    """Usage carries ``prompt_tokens_details.cached_tokens``."""
    enable_tokenizer_info_endpoint: bool = False
    """Serve ``GET /tokenizer_info`` (it reveals the chat template)."""
    enable_server_load_tracking: bool = False
    """``GET /load`` counts the generation requests in flight."""
    enable_dev_endpoints: bool = False
    """vLLM's dev-mode routes: sleep mode and the prefix-cache reset
    (``dev_endpoints.add_dev_routes``); never on a public endpoint."""
    metrics_prefix: str = DEFAULT_METRICS_PREFIX
    """``/metrics`` name prefix: ``jaxpaged`` or ``vllm`` (``jaxpaged.metrics``)."""
    # ------------------------------------------------------------------ requests' own templates
    chat_template_workers: int = DEFAULT_NUM_WORKERS
    """Processes rendering requests' own chat templates (``template_sandbox``), >= 1."""
    max_queued_chat_templates: int = DEFAULT_MAX_QUEUED
    """Renders that may wait for one of them; more are a 503 with ``Retry-After``, >= 0."""
    # ------------------------------------------------------------------ processes (run_server)
    host: str | None = None
    """Address to listen on; None: all interfaces."""
    port: int = 8000
    max_num_queued_requests: int | None = None
    """Requests that may wait for a batch slot in the core; more are a 429. None: unbounded."""
    data_parallel_size: int = 1
    """Engine cores behind this server (``DPEngineCoreClient``)."""
    dp_routing: str = "least_loaded"
    """How a request picks its engine core (``dp_balancer``)."""
    api_server_count: int = 1
    """API processes over one engine core (``multi_api_server``)."""
    uvicorn_log_level: str = "info"

    def __post_init__(self) -> None:
        if self.served_model_names is not None:
            object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        self.check()

    def check(self) -> None:
        """Refuse what is wrong whatever the engine: empty names, a bad count, bound, choice or
        parser name, dev endpoints with data parallelism, several API processes with data
        parallelism.

        Raises:
            ValueError: naming the flag, the rule and the value.
        """
        from jaxpaged.entrypoints.openai.chat_tools import resolve_parsers

        names = self.served_model_names
        if names is not None and not (names and all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"--served-model-name must be non-empty names, got {list(names)!r}")
        _check_at_least("--port", self.port, 0)
        _check_at_least("--data-parallel-size", self.data_parallel_size, 1)
        _check_at_least("--api-server-count", self.api_server_count, 1)
        _check_at_least("--chat-template-workers", self.chat_template_workers, 1)
        _check_at_least("--max-queued-chat-templates", self.max_queued_chat_templates, 0)
        if self.max_num_queued_requests is not None:
            _check_at_least("--max-num-queued-requests", self.max_num_queued_requests, 0)
        _check_choice("--metrics-prefix", self.metrics_prefix, METRICS_PREFIX_CHOICES)
        _check_choice("--dp-routing", self.dp_routing, DP_ROUTING_CHOICES)
        _check_choice("--uvicorn-log-level", self.uvicorn_log_level, UVICORN_LOG_LEVELS)
        if self.api_server_count > 1 and self.data_parallel_size > 1:
            raise ValueError(
                f"--api-server-count {self.api_server_count} needs --data-parallel-size 1 "
                "(several API processes share one engine core), got --data-parallel-size "
                f"{self.data_parallel_size}"
            )
        if self.enable_dev_endpoints and self.data_parallel_size != 1:
            raise ValueError(
                "--enable-dev-endpoints needs --data-parallel-size 1 (sleep mode is per "
                "engine core)"
            )
        # Before any engine loads: an unknown parser name fails at once.
        resolve_parsers(self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser)

    def model_names(self, model: str) -> tuple[str, ...]:
        """The served names, ``(model,)`` when none were given."""
        return self.served_model_names or (model,)


def _check_at_least(flag: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{flag} must be at least {minimum}, got {value!r}")


def _check_choice(flag: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {list(choices)}, got {value!r}")
