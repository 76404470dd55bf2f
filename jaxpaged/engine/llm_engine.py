"""``LLMEngine``: ``add_request`` / ``step`` / ``abort_request`` over the scheduler and the runner.

One ``step`` is DESIGN.md §2: schedule (host), prepare + run (one transfer, one jitted step),
commit (append tokens, check stops, free finished sequences' blocks, emit outputs).

With ``async_scheduling`` (the default) the commit of step N waits until step N+1 is on the
device (``jaxpaged.engine.async_scheduling``): each ``step()`` call schedules and dispatches the
next step, then commits the previous one, so its outputs are one step behind.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC

import jax
import jax.numpy as jnp
from transformers import AutoTokenizer

from jaxpaged.config import EngineArgs, EngineConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.detokenizer import decode_output_text
from jaxpaged.engine.async_scheduling import InFlightStep, apply_placeholders, resolve_step
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sequence import Sequence, SequenceStatus
from jaxpaged.worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCacheSpec,
    MemoryBudget,
    allocate_kv_caches,
    bytes_in_use,
    kv_cache_shapes,
    measure_kv_budget,
    num_blocks_for_budget,
)
from jaxpaged.worker.model_runner import ModelRunner
from models.weights import load_model

logger = logging.getLogger(__name__)

PromptType = str | Mapping


class LLMEngine:
    """The offline engine: a scheduler, a KV cache and a model runner on one device.

    Build it with ``LLMEngine.from_engine_args(EngineArgs(...))``.
    """

    def __init__(self, config: EngineConfig, *, show_progress: bool = True):
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        on_gpu = jax.default_backend() == "gpu"
        backend = config.attention_backend
        if backend == "auto":
            backend = "pallas" if on_gpu else "reference"
        self.attention_backend = backend
        self.dtype = _resolve_dtype(mc.dtype, mc.hf_config_json)

        # skip_tokenizer_init (vLLM's name): prompts are token ids and outputs carry empty text,
        # so a config-only directory with dummy weights is enough (benchmarks).
        self.tokenizer = (
            None if mc.skip_tokenizer_init else AutoTokenizer.from_pretrained(mc.tokenizer)
        )
        model, self.hf_config = load_model(
            mc.model,
            dtype=self.dtype,
            load_format=mc.load_format,
            attention_backend=backend,
            interpret=backend == "pallas" and not on_gpu,
            seed=mc.seed,
        )
        self.vocab_size = int(self.hf_config.vocab_size)
        self.eos_token_id = _first_eos(self.hf_config, self.tokenizer)
        spec = KVCacheSpec(
            num_layers=int(self.hf_config.num_hidden_layers),
            num_kv_heads=int(self.hf_config.num_key_value_heads),
            head_dim=_head_dim(self.hf_config),
            block_size=cc.block_size,
            dtype=self.dtype,
        )
        self.kv_cache_spec = spec
        max_blocks_per_seq = -(-sc.max_model_len // cc.block_size)
        runner_kwargs = dict(
            block_size=cc.block_size,
            max_model_len=sc.max_model_len,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
        )
        self.memory_budget: MemoryBudget | None = None
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        elif cc.kv_cache_memory_bytes is not None:
            num_blocks = num_blocks_for_budget(spec, cc.kv_cache_memory_bytes, cap=2**31 - 1)
        else:
            self.memory_budget = self._profile_memory(model, spec, runner_kwargs)
            if self.memory_budget is None:  # no device memory statistics (CPU): fixed budget
                cap = sc.max_num_seqs * max_blocks_per_seq + 1
                num_blocks = num_blocks_for_budget(spec, DEFAULT_CPU_KV_CACHE_BYTES, cap=cap)
            else:
                num_blocks = num_blocks_for_budget(spec, self.memory_budget.kv_bytes, cap=2**31 - 1)
        self.num_blocks = num_blocks
        # Compile against the cache's shapes before allocating it: XLA's autotuning scratch then
        # comes out of memory the cache will occupy, not out of the activations' share.
        self.model_runner = ModelRunner(model, kv_cache_shapes(spec, num_blocks), **runner_kwargs)
        enforce_eager = config.enforce_eager
        if enforce_eager is None:
            # XLA:CPU takes seconds per bucket and CPU runs are short: compile what is used.
            enforce_eager = not on_gpu
        self.compile_seconds = 0.0
        if not enforce_eager:
            start = time.perf_counter()
            self.model_runner.compile_all(show_progress=show_progress)
            self.compile_seconds = time.perf_counter() - start
        self.model_runner.kv_caches = allocate_kv_caches(spec, num_blocks)
        if not enforce_eager:
            self.model_runner.warmup()
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size)
        self.scheduler = Scheduler(sc, self.kv_cache_manager)
        self.async_scheduling = config.async_scheduling
        self._in_flight: InFlightStep | None = None
        logger.info("%s", self.kv_cache_report())

        self._requests: dict[str, _Request] = {}
        self._seed_counter = itertools.count()

    def _profile_memory(self, model, spec: KVCacheSpec, runner_kwargs: dict) -> MemoryBudget | None:
        """Memory left for KV blocks after one profiling step at the full token budget (vLLM's
        rule), or None when the device reports no memory statistics (CPU)."""
        device = jax.devices()[0]
        weights = bytes_in_use(device)
        if weights is None:
            return None
        sc = self.config.scheduler_config
        probe_blocks = -(-sc.max_num_batched_tokens // spec.block_size) + 1
        probe = ModelRunner(model, allocate_kv_caches(spec, probe_blocks), **runner_kwargs)
        probe.profile_run()
        del probe
        return measure_kv_budget(
            self.config.cache_config.gpu_memory_utilization, device, weights_bytes=weights
        )

    def kv_cache_report(self) -> str:
        """One line: KV blocks, tokens and GiB, and (after profiling) their share of the memory
        left after weights and activations."""
        block_size = self.config.cache_config.block_size
        kv_bytes = self.num_blocks * self.kv_cache_spec.bytes_per_block
        line = (
            f"KV cache: {kv_bytes / 2**30:.2f} GiB, {self.num_blocks} blocks of {block_size} "
            f"tokens = {self.num_blocks * block_size} tokens"
        )
        budget = self.memory_budget
        if budget is not None:
            left = budget.left_after_weights_and_activations
            line += (
                f"; device {budget.total / 2**30:.1f} GiB, gpu_memory_utilization "
                f"{self.config.cache_config.gpu_memory_utilization} -> usable "
                f"{budget.usable / 2**30:.2f} GiB (JAX pool {budget.pool / 2**30:.2f} GiB), "
                f"weights {budget.weights / 2**30:.2f} GiB, peak after profiling "
                f"{budget.peak / 2**30:.2f} GiB, left {left / 2**30:.2f} GiB, of which the KV "
                f"cache takes {100 * kv_bytes / max(left, 1):.1f}%"
            )
        return line

    def fragmentation_report(self) -> str:
        """One line: tokens stored / slots held by the running sequences (internal
        fragmentation, the PagedAttention paper's < 4% claim)."""
        stored, held = self.kv_cache_manager.slots_stored_vs_held()
        waste = 100 * (1 - stored / held) if held else 0.0
        return (
            f"KV slots: {stored} tokens stored / {held} held = {waste:.2f}% internal fragmentation"
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> LLMEngine:
        return cls(engine_args.create_engine_config(), **kwargs)

    # ------------------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request.

        Args:
            prompt: text, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}`` (TokensPrompt).
            final_only: emit a ``RequestOutput`` only when the request finishes.

        Raises:
            ValueError: duplicate id, empty prompt, token ids outside the vocabulary, a prompt
                that leaves no room under ``max_model_len`` or does not fit in the KV cache.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._check_prompt(prompt_ids)
        seq = Sequence(
            seq_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        seq.sampling_seed = self._request_seed(params)
        self._requests[request_id] = _Request(seq, prompt_text, final_only)
        self.scheduler.add_request(seq)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if self.tokenizer is None and (
            isinstance(prompt, str)
            or (isinstance(prompt, Mapping) and "prompt_token_ids" not in prompt)
        ):
            raise ValueError(
                "prompt text needs a tokenizer but the engine has skip_tokenizer_init=True; "
                "pass {'prompt_token_ids': [...]}"
            )
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, SequenceABC) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], list(self.tokenizer.encode(prompt["prompt"]))
        raise ValueError(
            "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}"
        )

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        max_model_len = self.config.scheduler_config.max_model_len
        if not prompt_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_ids) >= max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}, "
                "which must leave room for at least one generated token"
            )
        capacity = self.num_blocks * self.config.cache_config.block_size
        if len(prompt_ids) + 1 > capacity:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but the KV cache holds only {capacity} "
                f"tokens ({self.num_blocks} blocks)"
            )

    def _request_seed(self, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        # Unseeded requests still get a reproducible stream per engine seed and arrival order.
        return (self.config.model_config.seed * 1_000_003 + next(self._seed_counter)) % 2**63

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any state, free its blocks, and return its final output
        (``finish_reason="abort"``); None if the id is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        in_flight = self._in_flight
        if in_flight is not None and any(seq is request.seq for seq in in_flight.sampled_seqs):
            # Its last token is still a placeholder: wait for the step and report the real one.
            request.seq.replace_last_token(in_flight.pending.result()[request_id][0])
        self.scheduler.abort(request_id)
        return self._make_output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the outputs of requests that advanced or finished.

        With async scheduling the outputs are those of the step dispatched by the previous call
        (this call's step is still running on the device when it returns).
        """
        if not self.async_scheduling:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty:
                return []
            sampled = self.model_runner.execute_model(scheduler_output)
            updated = self.scheduler.update_from_output(
                scheduler_output, {sid: tok for sid, (tok, _) in sampled.items()}
            )
            return self._emit(updated, sampled)

        scheduler_output = self.scheduler.schedule()
        pending = None
        if not scheduler_output.is_empty:
            pending = self.model_runner.dispatch(scheduler_output)
        outputs: list[RequestOutput] = []
        if self._in_flight is not None:
            # The device runs the step just dispatched while the host commits the one before.
            in_flight, self._in_flight = self._in_flight, None
            sampled = in_flight.pending.result()
            updated = resolve_step(self.scheduler, in_flight, sampled, self._is_live)
            outputs = self._emit(updated, sampled)
        if pending is not None:
            self._in_flight = apply_placeholders(self.scheduler, scheduler_output, pending)
        return outputs

    def _is_live(self, seq: Sequence) -> bool:
        """The sequence's request was neither aborted nor replaced since it was scheduled."""
        request = self._requests.get(seq.seq_id)
        return request is not None and request.seq is seq

    def _emit(self, updated: list[Sequence], sampled: dict[str, tuple[int, float]]):
        now = time.monotonic()
        outputs = []
        for seq in updated:
            request = self._requests[seq.seq_id]
            request.cumulative_logprob += sampled[seq.seq_id][1]
            if request.first_token_time is None:
                request.first_token_time = now
            finished = seq.status.is_finished
            if finished:
                request.finished_time = now
                del self._requests[seq.seq_id]
            if finished or not request.final_only:
                outputs.append(self._make_output(request))
        return outputs

    def _make_output(self, request: _Request) -> RequestOutput:
        seq = request.seq
        params = seq.sampling_params
        completion = CompletionOutput(
            index=0,
            text=""
            if self.tokenizer is None
            else decode_output_text(
                self.tokenizer,
                seq.prompt_token_ids,
                seq.output_token_ids,
                skip_special_tokens=params.skip_special_tokens,
            ),
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=request.prompt_text,
            prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion],
            finished=seq.status.is_finished,
            metrics={
                "arrival_time": seq.arrival_time,
                "first_token_time": request.first_token_time,
                "finished_time": request.finished_time,
            },
        )


class _Request:
    """Engine-side record of one request: its sequence plus what only the frontend needs."""

    def __init__(self, seq: Sequence, prompt_text: str | None, final_only: bool):
        self.seq = seq
        self.prompt_text = prompt_text
        self.final_only = final_only
        self.cumulative_logprob = 0.0
        self.first_token_time: float | None = None
        self.finished_time: float | None = None


_DTYPE_NAMES = {
    "float32": jnp.float32,
    "float": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "half": jnp.float16,
}


def _resolve_dtype(dtype: str, hf_config_json: dict):
    """``auto`` keeps the checkpoint's dtype (departure from vLLM, which maps float32
    checkpoints to float16: we keep float32 so CPU results match HF exactly)."""
    if dtype == "auto":
        dtype = hf_config_json.get("torch_dtype") or hf_config_json.get("dtype") or "float32"
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES)} or auto, got {dtype!r}")
    return _DTYPE_NAMES[dtype]


def _head_dim(hf_config) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def _first_eos(hf_config, tokenizer) -> int | None:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos


# Sequence status is re-exported for callers that inspect engine state.
__all__ = ["LLMEngine", "SequenceStatus"]
