"""``LLMEngine``: ``add_request`` / ``step`` / ``abort_request`` over the scheduler and the worker.

One ``step`` (docs/architecture.md, "One engine step"): schedule (host), prepare + run (one
transfer, one jitted step), commit (append tokens, check stops, free finished sequences'
blocks), then the output processor detokenizes, applies stop strings and emits outputs; the
step's plan (synchronous, pipelined under async scheduling, or split around a grammar's
bitmask) is ``engine/step_pipeline.py``'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping

from jaxpaged.beam_search import BeamSearchParams
from jaxpaged.config import EngineArgs, EngineConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.kv_cache_snapshot import KVCacheSnapshot, take_snapshot
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.stats import SchedulerStats
from jaxpaged.core.step_history import StepHistory
from jaxpaged.engine.async_scheduling import StepTimes
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.startup import StartupTimer, prefetch_transformers
from jaxpaged.engine.step_pipeline import StepPipeline
from jaxpaged.lora.request import LoRARequest
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, verify_for_model
from jaxpaged.sequence import (
    EMPTY_PROMPT,
    EngineSleepingError,
    PromptError,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    check_prompt_text,
    check_prompt_vocab,
    is_token_id_list,
)
from jaxpaged.structured_output.manager import StructuredOutputManager
from jaxpaged.worker.compilation_cache import cache_root
from jaxpaged.worker.worker import Worker
from models.config_cache import read_cached_config
from models.weights import load_config

logger = logging.getLogger(__name__)

PromptType = str | Mapping


class LLMEngine:
    """The offline engine: a scheduler, a KV cache and a model runner on one device, or on a
    ``("tp",)`` mesh of ``tensor_parallel_size`` devices (``models.sharding``), possibly spanning
    processes (``jaxpaged.worker.distributed``).

    Build it with ``LLMEngine.from_engine_args(EngineArgs(...))``.
    """

    def __init__(self, config: EngineConfig, *, show_progress: bool = True):
        self.config = config
        mc, cc = config.model_config, config.cache_config
        # Seconds per start-up phase, logged as one line at the end (engine/startup.py).
        self.startup = StartupTimer()
        # The resolved HF config of an earlier start (models.config_cache), beside the
        # compilation cache and on with it: without a tokenizer, a hit needs no transformers.
        config_cache_dir = (
            cache_root(config.compilation_cache_dir) if config.enable_compilation_cache else None
        )
        reading = time.perf_counter()  # milliseconds: added to the config/tokenizer phase
        hf_config = (
            None if config_cache_dir is None else read_cached_config(mc.model, config_cache_dir)
        )
        reading = time.perf_counter() - reading
        read_note = "config cached" if hf_config is not None else "config via transformers"
        # transformers (seconds: it imports PyTorch when installed) while the backend starts.
        importing = (
            None if hf_config is not None and mc.skip_tokenizer_init else prefetch_transformers()
        )
        # The worker owns the device: weights, memory profiling, KV cache, compiled buckets.
        with self.startup.phase("backend"):
            self.worker = Worker(config, show_progress=show_progress)
        with self.startup.phase("config/tokenizer"):
            if importing is not None:
                importing.join()
            if hf_config is None:  # also reports a bad directory before the weights
                hf_config = load_config(mc.model, cache_dir=config_cache_dir)
            # skip_tokenizer_init (vLLM's name): prompts are token ids and outputs carry empty
            # text, so a config-only directory with dummy weights is enough (benchmarks).
            self.tokenizer = None
            if not mc.skip_tokenizer_init:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        self.startup.add("config/tokenizer", reading, read_note)
        with self.startup.phase("weights"):
            self.worker.load_model(hf_config)
        with self.startup.phase("memory profiling"):
            self.num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(self.num_blocks)
        w = self.worker
        self.startup.add(
            "executables",
            w.compile_seconds,
            f"{w.executables_loaded} loaded, {w.executables_compiled} compiled, "
            f"{w.executables_deferred} loading in the background",
        )
        self.startup.add("KV allocation", w.kv_allocation_seconds)
        self.vocab_size = self.worker.vocab_size
        self.eos_token_id = _first_eos(self.worker.hf_config, self.tokenizer)
        # Multi-LoRA (None: off): the worker's, which its model runner steps with.
        self.lora_manager = self.worker.lora_manager

        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            cc.block_size,
            enable_caching=cc.enable_prefix_caching,
            num_cpu_blocks=self.worker.num_cpu_blocks,
        )
        self.scheduler = Scheduler(
            config.scheduler_config,
            self.kv_cache_manager,
            max_loras=self.lora_manager.max_loras if self.lora_manager else 0,
        )
        # What each step scheduled (jaxpaged.viz draws it; bounded, oldest dropped).
        self.step_history = StepHistory()

        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        # Grammars of constrained requests (structured outputs); nothing is loaded until the
        # first one arrives.
        self.structured_output = StructuredOutputManager(
            config.structured_outputs_config,
            self._grammar_tokenizer,
            vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id,
        )
        # One step's stages, along the plan each step needs (engine/step_pipeline.py); it
        # holds the step in flight under async scheduling.
        self.pipeline = StepPipeline(
            self.scheduler,
            self.worker,
            self.structured_output,
            self.output_processor,
            self.step_history,
            self.kv_cache_manager,
        )
        # Async scheduling (vLLM's --async-scheduling). The flag may be switched between runs
        # (benchmarks compare both); a step still in flight keeps the pipeline going until a
        # step leaves nothing in flight.
        self.async_scheduling = config.async_scheduling
        self._seed_counter = itertools.count()
        # Sleep mode: 0 awake, else the level of the last sleep() (vLLM's is_sleeping).
        self._sleep_level = 0
        self.startup.log()

    def _grammar_tokenizer(self):
        """The tokenizer grammars compile against: the engine's, or loaded for them (the
        engine core runs without one)."""
        if self.tokenizer is not None:
            return self.tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.config.model_config.tokenizer)

    def wait_for_executables(self) -> None:
        """Return once every step bucket is compiled or loaded (a warm start loads most on a
        background thread while serving; benchmarks call this before they time anything)."""
        self.worker.wait_for_executables()

    def kv_cache_report(self) -> str:
        """One line on the KV cache's size and memory share (``Worker.kv_cache_report``)."""
        return self.worker.kv_cache_report()

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
        params: SamplingParams | BeamSearchParams,
        *,
        arrival_time: float | None = None,
        final_only: bool = False,
        lora_request: LoRARequest | None = None,
        wait_for_grammar: bool = True,
    ) -> None:
        """Queue a request.

        Args:
            prompt: text, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}`` (TokensPrompt).
            params: ``SamplingParams`` (``n`` / ``best_of`` > 1 fork the prompt's blocks), or
                ``BeamSearchParams`` for a beam search (its output holds the ranked beams).
            final_only: emit a ``RequestOutput`` only when the request finishes (overrides
                ``params.output_kind``, as ``LLM.generate`` does; beam searches always do).
            lora_request: the LoRA adapter to run with (None: the base model); registered
                (read and checked) on first use. Its blocks are cached under its own key, so
                no other adapter shares its prefix.
            wait_for_grammar: a constrained request waits here until its grammar is compiled
                (a refused one raises). False (the engine core): it waits outside the
                scheduler instead, and ``admit_grammars`` (call it between steps) schedules or
                refuses it once its grammar's verdict is known.

        Raises:
            ValueError: duplicate id, empty prompt, token ids outside the vocabulary, a prompt
                that leaves no room under ``max_model_len`` or does not fit in the KV cache,
                ``logprobs`` above ``max_logprobs``, ``best_of`` / ``beam_width`` above
                ``max_num_seqs``, a ``lora_request`` without ``enable_lora`` or with a bad
                adapter, a ``structured_outputs`` constraint the backend refuses or past a
                ``structured_outputs_config`` budget (naming the field).
        """
        if self._sleep_level:
            raise EngineSleepingError(
                f"the engine is sleeping (level {self._sleep_level}): call wake_up() first"
            )
        if not self.worker.has_weights:
            raise EngineSleepingError(
                "the weights were released by sleep(level=2): give new ones with "
                "update_weights() first"
            )
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(
                f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}"
            )
        if isinstance(params, SamplingParams):
            if params.bad_words_token_ids is None:  # not yet resolved by an API process
                params.update_from_tokenizer(self.tokenizer)  # bad_words -> token ids
            verify_for_model(
                params,
                vocab_size=self.vocab_size,
                max_logprobs=self.config.model_config.max_logprobs,
            )
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._check_prompt(prompt_ids)
        self._check_lora(lora_request)
        if isinstance(params, SamplingParams):
            # Last check: a constraint past its budgets raises here, naming the field; it then
            # compiles on the manager's workers (structured_output/manager.py, "Admission").
            self.structured_output.add_request(request_id, params)
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
            if params.logprobs_mode is None:  # the engine's --logprobs-mode
                params.logprobs_mode = self.config.model_config.logprobs_mode
        seq = Sequence(
            seq_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=seq_params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            block_hash_extra_keys=lora_cache_keys(lora_request),
            lora_request=lora_request,
        )
        seq.sampling_seed = self._request_seed(params)
        group = SequenceGroup(request_id, seq, **group_kwargs)
        try:
            if self.structured_output.is_constrained(request_id) and not wait_for_grammar:
                self.structured_output.hold(group)  # scheduled by admit_grammars
            else:
                if self.structured_output.is_constrained(request_id):
                    self.structured_output.wait(request_id)  # a refused grammar raises
                self.scheduler.add_request(group)
        except Exception:
            self.structured_output.remove_request(request_id)
            raise
        output_kind = RequestOutputKind.FINAL_ONLY if final_only else seq_params.output_kind
        self.output_processor.add_request(group, prompt_text, output_kind)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        is_text = isinstance(prompt, str) or (
            isinstance(prompt, Mapping) and "prompt_token_ids" not in prompt and "prompt" in prompt
        )
        if is_text and self.tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer, but the engine was built with "
                "skip_tokenizer_init=True: give {'prompt_token_ids': [...]} instead"
            )
        if isinstance(prompt, str):
            check_prompt_text(prompt)
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not is_token_id_list(ids):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                check_prompt_text(prompt["prompt"])
                return prompt["prompt"], list(self.tokenizer.encode(prompt["prompt"]))
        raise ValueError(
            "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}"
        )

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        max_model_len = self.config.scheduler_config.max_model_len
        if not prompt_ids:
            raise PromptError(f"{EMPTY_PROMPT}: it must have at least one token")
        check_prompt_vocab(prompt_ids, self.vocab_size)
        if len(prompt_ids) >= max_model_len:
            raise PromptError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}, "
                "which must leave room for at least one generated token"
            )
        capacity = self.num_blocks * self.config.cache_config.block_size
        if len(prompt_ids) + 1 > capacity:
            raise PromptError(
                f"prompt has {len(prompt_ids)} tokens but the KV cache holds only {capacity} "
                f"tokens ({self.num_blocks} blocks)"
            )

    def _check_lora(self, lora_request: LoRARequest | None) -> bool:
        if lora_request is None:
            return False
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}"
            )
        if self.lora_manager is None:
            raise ValueError(
                f"lora_request {lora_request.lora_name!r} needs an engine built with "
                "enable_lora=True"
            )
        return self.lora_manager.add_adapter(lora_request)

    def _request_seed(self, params: SamplingParams | BeamSearchParams) -> int:
        seed = getattr(params, "seed", None)
        if seed is not None:
            return seed
        # Unseeded requests still get a reproducible stream per engine seed and arrival order.
        return (self.config.model_config.seed * 1_000_003 + next(self._seed_counter)) % 2**63

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any state, free its blocks, and return its final output
        (``finish_reason="abort"``); None if the id is unknown or already finished."""
        state = self.output_processor.requests.get(request_id)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        self.structured_output.remove_request(request_id)
        # With async scheduling the scheduler may already have finished (and forgotten) the
        # group by length on a token still on the device. That token is not part of the
        # output, and the sequence counts as aborted so that resolving the step leaves it be.
        for seq in state.group.seqs:
            if seq.drop_placeholder():
                seq.status = SequenceStatus.FINISHED_ABORTED
        return self.output_processor.abort(request_id)

    def admit_grammars(self) -> list[tuple[str, ValueError | None]]:
        """Schedule the requests added with ``wait_for_grammar=False`` whose grammar is now
        compiled, and forget (without an output) those whose grammar was refused. Returns
        ``(request_id, None or the refusal)`` for each; never blocks."""
        verdicts = []
        for group, error in self.structured_output.take_admitted():
            if error is None:
                try:
                    self.scheduler.add_request(group)
                except ValueError as refused:
                    error = refused
            if error is not None:
                self.structured_output.remove_request(group.request_id)
                self.output_processor.abort(group.request_id)
            verdicts.append((group.request_id, error))
        return verdicts

    @property
    def num_waiting_for_grammar(self) -> int:
        """Requests held outside the scheduler until their grammar is compiled."""
        return self.structured_output.num_held

    def is_waiting_for_grammar(self, request_id: str) -> bool:
        return self.structured_output.is_held(request_id)

    def get_stats(self) -> SchedulerStats:
        """Scheduler and KV-cache counters for metrics (fields named after vLLM's metrics);
        requests waiting for their grammar count as waiting, as in vLLM."""
        stats = self.scheduler.get_stats()
        return dataclasses.replace(
            stats,
            num_requests_waiting=stats.num_requests_waiting + self.num_waiting_for_grammar,
            grammar_cache_bytes=self.structured_output.cache_bytes,
        )

    @property
    def compilation_cache_dir(self) -> str | None:
        """Directory of JAX's persistent compilation cache, None when it is off."""
        return self.worker.compilation_cache_dir

    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """A read-only copy of every KV block's state and every sequence's block table."""
        return take_snapshot(self.kv_cache_manager)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (blocks in use keep their K/V). Returns True."""
        self.kv_cache_manager.reset_prefix_cache()
        return True

    # ------------------------------------------------- weights from memory and sleep mode
    def get_weights(self) -> dict:
        """The engine's weights in the model's own layout (``Worker.get_weights``)."""
        return self.worker.get_weights()

    def update_weights(self, params, *, on_leaf=None) -> int:
        """Replace the weights with ``params`` (``{HF name: array}`` or our own layout; on any
        device or the host, sharded or not), placed leaf by leaf into the engine's layout and
        shardings without recompiling, and forget every cached prefix (its K/V came from the
        old weights). Returns the number of weights replaced.

        Like vLLM's weight sync between steps, but refused while requests are unfinished
        (vLLM leaves that to the caller; here a step would mix two policies).

        Raises:
            ValueError: a missing, extra or misshapen parameter, or a non-float dtype (named;
                the engine keeps its previous weights).
            RuntimeError: requests are unfinished.
        """
        self._check_idle("update_weights")
        replaced = self.worker.update_weights(params, on_leaf=on_leaf)
        self.reset_prefix_cache()
        return replaced

    def sleep(self, level: int = 1) -> None:
        """Free device memory until ``wake_up`` (vLLM's ``LLM.sleep``): level 1 the KV cache,
        level 2 also the weights. Compiled executables are kept. vLLM's level 1 also moves the
        weights to host memory; here they stay on the device (a trainer in the same process
        usually holds them anyway). Sleeping again while asleep is a no-op with a warning
        (vLLM's).

        Raises:
            ValueError: the engine was built without ``enable_sleep_mode``, or a level other
                than 1 or 2.
            RuntimeError: requests are unfinished.
        """
        self._check_sleep_mode()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self._sleep_level:
            logger.warning("the engine is already sleeping (level %d)", self._sleep_level)
            return
        self._check_idle("sleep")
        self.kv_cache_manager.reset_prefix_cache()  # the cached K/V go with the cache
        self.worker.sleep(level)
        self._sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate the KV cache at its compiled shapes (vLLM's ``LLM.wake_up``; ``tags``
        ``["weights"]`` / ``["kv_cache"]`` are accepted for vLLM's callers: weights are brought
        back by ``update_weights``, which works while asleep). Waking an engine that is not
        sleeping is a no-op with a warning, as in vLLM.

        Raises:
            ValueError: no ``enable_sleep_mode``, or an unknown tag.
        """
        self._check_sleep_mode()
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be 'weights' or 'kv_cache', got {sorted(unknown)}")
        if not self._sleep_level:
            logger.warning("wake_up(): the engine is not sleeping")
            return
        if tags is None or "kv_cache" in tags:
            self.worker.wake_up()
            self._sleep_level = 0

    def is_sleeping(self) -> bool:
        """Whether ``sleep`` freed the KV cache and ``wake_up`` has not restored it yet."""
        return bool(self._sleep_level)

    def _check_sleep_mode(self) -> None:
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode needs an engine built with enable_sleep_mode=True")

    def _check_idle(self, what: str) -> None:
        for _ in range(2):  # async scheduling: resolve a last step still on the device
            if self.pipeline.in_flight is None or self.has_unfinished_requests():
                break
            self.step()
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"{what} needs an idle engine; {self.get_num_unfinished_requests()} request(s) "
                "are unfinished: wait for them (or abort them) first"
            )

    # ------------------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register (read and check) an adapter ahead of its requests (vLLM's ``add_lora``);
        False if it is already registered.

        Raises:
            ValueError: LoRA is off, the id or name is taken, or the adapter is bad.
        """
        return self._check_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter and zero its device slot; False if unknown or LoRA is off."""
        return self.lora_manager is not None and self.lora_manager.remove_adapter(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the registered adapters (vLLM's ``list_loras``)."""
        return set() if self.lora_manager is None else set(self.lora_manager.list_adapters())

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ---------------------------------------------------------------------------------- step
    def step(self, *, token_deltas: bool = False) -> list[RequestOutput] | list[list]:
        """Run one engine step and return the outputs of requests that advanced or finished.

        With ``async_scheduling`` the outputs are those of the previous step, read back while
        this step runs on the device (``engine/step_pipeline.py``, ``async_scheduling.py``).

        Args:
            token_deltas: the engine core's form: each output is its text-free token delta
                (``engine/deltas.py``) and nothing is detokenized (``OutputProcessor.process``).
        """
        return self.pipeline.step(async_scheduling=self.async_scheduling, token_deltas=token_deltas)

    @property
    def step_times(self) -> StepTimes | None:
        """Host-clock marks of the last step, when it overlapped resolving the previous one
        (async scheduling; None otherwise): the engine core's late scheduling reads them."""
        return self.pipeline.step_times

    def step_in_flight_done(self) -> bool | None:
        """Async scheduling: whether the step on the device has computed its tokens (never
        blocks); None when no step is in flight."""
        return self.pipeline.in_flight_done()


def lora_cache_keys(lora_request: LoRARequest | None) -> tuple:
    """Prefix-cache extra keys of a request's blocks: the adapter's id and name (K/V computed
    under one adapter must never serve another), nothing for the base model."""
    if lora_request is None:
        return ()
    return ("lora", lora_request.lora_int_id, lora_request.lora_name)


def _first_eos(hf_config, tokenizer) -> int | None:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos


# Sequence status is re-exported for callers that inspect engine state.
__all__ = ["EngineSleepingError", "LLMEngine", "SequenceStatus"]
