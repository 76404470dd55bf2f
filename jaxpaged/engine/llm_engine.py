"""``LLMEngine``: ``add_request`` / ``step`` / ``abort_request`` over the scheduler and the runner.

One ``step`` is DESIGN.md §2: schedule (host), prepare + run (one transfer, one jitted step),
commit (append tokens, check stops, free finished sequences' blocks, emit outputs).
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

from jaxpaged.beam_search import BeamSearchParams
from jaxpaged.config import EngineArgs, EngineConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.stats import SchedulerStats
from jaxpaged.detokenizer import decode_output_text
from jaxpaged.engine.group_outputs import ranked_completions
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sequence import Sequence, SequenceGroup, SequenceStatus
from jaxpaged.worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCacheSpec,
    allocate_kv_caches,
    device_kv_budget,
    num_blocks_for_budget,
)
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.swap import BlockMover
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

        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
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
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        elif cc.kv_cache_memory_bytes is not None:
            num_blocks = num_blocks_for_budget(spec, cc.kv_cache_memory_bytes, cap=2**31 - 1)
        else:
            num_blocks = self._profile_num_blocks(model, spec, runner_kwargs)
            if num_blocks is None:  # no device memory statistics (CPU): fixed budget
                cap = sc.max_num_seqs * max_blocks_per_seq + 1
                num_blocks = num_blocks_for_budget(spec, DEFAULT_CPU_KV_CACHE_BYTES, cap=cap)
        self.num_blocks = num_blocks
        kv_caches = allocate_kv_caches(spec, num_blocks)
        self.model_runner = ModelRunner(model, kv_caches, **runner_kwargs)
        num_cpu_blocks = cc.swap_space_bytes // spec.bytes_per_block
        self.block_mover = BlockMover(spec, num_cpu_blocks)
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cc.block_size,
            enable_caching=cc.enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
        )
        self.scheduler = Scheduler(sc, self.kv_cache_manager)
        enforce_eager = config.enforce_eager
        if enforce_eager is None:
            # XLA:CPU takes seconds per bucket and CPU runs are short: compile what is used.
            enforce_eager = not on_gpu
        if not enforce_eager:
            self.model_runner.compile_all(show_progress=show_progress)

        self._requests: dict[str, _Request] = {}
        self._seed_counter = itertools.count()

    def _profile_num_blocks(self, model, spec: KVCacheSpec, runner_kwargs: dict) -> int | None:
        """Blocks that fit after one profiling step at the full token budget (vLLM's rule), or
        None when the device reports no memory statistics (CPU)."""
        device = jax.devices()[0]
        if device_kv_budget(1.0, device) is None:
            return None
        sc = self.config.scheduler_config
        probe_blocks = -(-sc.max_num_batched_tokens // spec.block_size) + 1
        probe = ModelRunner(model, allocate_kv_caches(spec, probe_blocks), **runner_kwargs)
        probe.profile_run()
        del probe
        budget = device_kv_budget(self.config.cache_config.gpu_memory_utilization, device)
        return num_blocks_for_budget(spec, budget, cap=2**31 - 1)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> LLMEngine:
        return cls(engine_args.create_engine_config(), **kwargs)

    # ------------------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        *,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request.

        Args:
            prompt: text, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}`` (TokensPrompt).
            params: ``SamplingParams`` (``n`` / ``best_of`` > 1 fork the prompt's blocks), or
                ``BeamSearchParams`` for a beam search (its output holds the ranked beams).
            final_only: emit a ``RequestOutput`` only when the request finishes (beam searches
                always do).

        Raises:
            ValueError: duplicate id, empty prompt, token ids outside the vocabulary, a prompt
                that leaves no room under ``max_model_len`` or does not fit in the KV cache,
                ``best_of`` / ``beam_width`` above ``max_num_seqs``.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(
                f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}"
            )
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._check_prompt(prompt_ids)
        group_kwargs = {}
        seq_params = params
        if isinstance(params, BeamSearchParams):
            if 2 * params.beam_width > self.vocab_size:
                raise ValueError(
                    f"beam_width must be at most vocab_size / 2 ({self.vocab_size // 2}), "
                    f"got {params.beam_width}"
                )
            # The rows' temperature scales the beams' top-k log-probabilities; the token the
            # sampler draws for them is ignored.
            seq_params = SamplingParams(
                temperature=params.temperature,
                max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos,
            )
            group_kwargs = dict(beam_width=params.beam_width, beam_params=params)
        else:
            group_kwargs = dict(best_of=getattr(params, "best_of", None) or params.n)
        seq = Sequence(
            seq_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=seq_params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        seq.sampling_seed = self._request_seed(params)
        group = SequenceGroup(request_id, seq, **group_kwargs)
        self.scheduler.add_request(group)
        self._requests[request_id] = _Request(group, prompt_text, final_only)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
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

    def _request_seed(self, params: SamplingParams | BeamSearchParams) -> int:
        seed = getattr(params, "seed", None)
        if seed is not None:
            return seed
        # Unseeded requests still get a reproducible stream per engine seed and arrival order.
        return (self.config.model_config.seed * 1_000_003 + next(self._seed_counter)) % 2**63

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any state, free its blocks, and return its final output
        (``finish_reason="abort"``); None if the id is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.abort(request_id)
        return self._make_output(request)

    def get_stats(self) -> SchedulerStats:
        """Scheduler and KV-cache counters for metrics (fields named after vLLM's metrics)."""
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (blocks in use keep their K/V). Returns True."""
        self.kv_cache_manager.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the outputs of requests that advanced or finished."""
        scheduler_output = self.scheduler.schedule()
        sampled = {}
        if not scheduler_output.is_empty:
            self.model_runner.execute_block_ops(scheduler_output, self.block_mover)
            sampled = self.model_runner.execute_model(scheduler_output)
        now = time.monotonic()
        updated = self.scheduler.update_from_output(
            scheduler_output,
            {seq_id: token for seq_id, (token, _) in sampled.items()},
            {seq_id: logprob for seq_id, (_, logprob) in sampled.items()},
            beam_candidates=self.model_runner.beam_candidates,
        )
        outputs = []
        for request_id in dict.fromkeys(seq.group.request_id for seq in updated):
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            finished = request.group.is_finished
            if finished:
                request.finished_time = now
                del self._requests[request_id]
            if finished or not (request.final_only or request.group.is_beam_search):
                outputs.append(self._make_output(request))
        return outputs

    def _make_output(self, request: _Request) -> RequestOutput:
        group = request.group
        completions = [
            CompletionOutput(
                index=index,
                text=decode_output_text(
                    self.tokenizer,
                    seq.prompt_token_ids,
                    seq.output_token_ids,
                    skip_special_tokens=seq.sampling_params.skip_special_tokens,
                ),
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if group.is_beam_search else None,
                logprobs=list(seq.beam_logprobs) if group.is_beam_search else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for index, seq in enumerate(ranked_completions(group))
        ]
        parent = group.seqs[0]
        return RequestOutput(
            request_id=group.request_id,
            prompt=request.prompt_text,
            prompt_token_ids=list(parent.prompt_token_ids),
            outputs=completions,
            finished=group.is_finished,
            num_cached_tokens=group.num_cached_tokens or 0,
            metrics={
                "arrival_time": group.arrival_time,
                "first_token_time": request.first_token_time,
                "finished_time": request.finished_time,
            },
        )


class _Request:
    """Engine-side record of one request: its sequence group plus what only the frontend needs."""

    def __init__(self, group: SequenceGroup, prompt_text: str | None, final_only: bool):
        self.group = group
        self.prompt_text = prompt_text
        self.final_only = final_only
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
    return eos if eos is not None else tokenizer.eos_token_id


# Sequence status is re-exported for callers that inspect engine state.
__all__ = ["LLMEngine", "SequenceStatus"]
