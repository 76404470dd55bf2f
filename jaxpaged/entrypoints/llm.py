"""``LLM``: the offline API (vLLM's ``vllm.LLM``)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

import jax
from tqdm.auto import tqdm

from jaxpaged.beam_search import BeamSearchOutput, BeamSearchParams
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine, PromptType
from jaxpaged.entrypoints.beam_search import beam_search_outputs
from jaxpaged.entrypoints.chat import Conversation, chat_prompt, is_single_conversation
from jaxpaged.lora.request import LoRARequest
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.distributed import is_driver

# Where ``LLM.start_profile`` writes its trace when given no directory (relative to the cwd).
DEFAULT_PROFILE_DIR = "jaxpaged_profile"


class LLM:
    """Generate from a local HF checkpoint with paged KV and continuous batching.

    Every keyword is an ``EngineArgs`` field with vLLM's name (``dtype``, ``max_model_len``,
    ``block_size``, ``gpu_memory_utilization``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``num_gpu_blocks_override``, ``seed``, ``load_format``, ...). ``model=None`` loads the
    embedded stories260k checkpoint.

    GPU memory: JAX preallocates a pool when it first touches the GPU, and the KV cache can
    only use memory inside it. Built before any other JAX operation, the engine sizes that pool
    to ``gpu_memory_utilization`` itself; built later, it warns with the pool's size and the fix
    (``jaxpaged/worker/memory_pool.py``).

    Restarts: compiled step executables are kept on disk (``compilation_cache_dir``, default
    ``~/.cache/jaxpaged/xla``; ``enable_compilation_cache=False`` turns it off), so a second
    construction of the same engine compiles nothing.

    Raises:
        ValueError: for an invalid argument or a missing / unsupported model directory.
    """

    def __init__(self, model: str | None = None, **kwargs):
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown LLM arguments: {sorted(unknown)}")
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        reasoning_parser = _reasoning_parser(config)
        self.llm_engine = LLMEngine(config)
        # structured_outputs_config.reasoning_parser: where constrained requests' grammars start
        # (after its end marker, or at one of its implicit ends).
        self._reasoning_end_ids = self._implicit_end_ids = None
        if reasoning_parser:
            parser = reasoning_parser(self.get_tokenizer())
            self._reasoning_end_ids = parser.end_token_ids()
            self._implicit_end_ids = parser.implicit_end_token_ids() or None
        self._request_counter = itertools.count()
        self._profile_dir: str | None = None  # set while a profiler trace runs

    def start_profile(self, profile_dir: str = DEFAULT_PROFILE_DIR) -> None:
        """Start a JAX profiler trace (vLLM's ``LLM.start_profile``) of what runs until
        ``stop_profile``; open it with TensorBoard's profile plugin or Perfetto
        (``<profile_dir>/plugins/profile/<run>/*.trace.json.gz``).

        Args:
            profile_dir: directory the trace is written to (vLLM reads it from
                ``VLLM_TORCH_PROFILER_DIR``; here it is an argument).

        Raises:
            RuntimeError: a profile is already running.
        """
        if self._profile_dir is not None:
            raise RuntimeError(
                f"a profile is already running (into {self._profile_dir}); call stop_profile()"
            )
        jax.profiler.start_trace(profile_dir)
        self._profile_dir = profile_dir

    def stop_profile(self) -> str:
        """Stop the trace ``start_profile`` began and write it; returns its directory.

        Raises:
            RuntimeError: no profile is running.
        """
        if self._profile_dir is None:
            raise RuntimeError("no profile is running; call start_profile() first")
        jax.profiler.stop_trace()
        profile_dir, self._profile_dir = self._profile_dir, None
        return profile_dir

    @classmethod
    def from_params(cls, model: str, params, **kwargs) -> LLM:
        """An engine for the HF-style directory ``model`` (its ``config.json`` is enough) whose
        weights come from ``params`` in memory (as ``update_weights`` takes them) instead of
        its safetensors: built with ``load_format="dummy"``, then updated.

        Raises:
            ValueError: as ``LLM(...)`` and ``update_weights``.
        """
        llm = cls(model, **{**kwargs, "load_format": "dummy"})
        llm.update_weights(params)
        return llm

    def get_weights(self) -> dict:
        """The engine's weights in the model's own nested layout (a dict of the engine's arrays,
        not copies; ``jaxpaged.model_api.make_forward`` runs the same model on them and
        ``update_weights`` takes the structure back).

        Raises:
            RuntimeError: the weights were released by ``sleep(level=2)``.
        """
        return self.llm_engine.get_weights()

    def update_weights(self, params) -> None:
        """Generate with ``params`` from now on: weights from memory, e.g. a trainer's.

        ``params``: ``{HF name: array}`` (the safetensors names and layouts, e.g.
        ``"model.layers.0.self_attn.q_proj.weight"`` ``[out, in]``) or the engine's own layout
        (``get_weights()``'s structure); numpy or JAX arrays, on the host or any device, sharded
        or not; float dtypes are cast to the engine's. Everything is checked before anything is
        replaced; then each parameter is placed in the engine's layout and sharding as the old
        one is released (peak memory: one copy of the weights; arrays already in the engine's
        dtype and placement are used without a copy, so don't delete or donate them
        afterwards). Nothing recompiles. Cached prefixes are forgotten. Also how weights come
        back after ``sleep(level=2)``.

        Raises:
            ValueError: a missing, extra or misshapen parameter or a non-float dtype (named; the
                engine keeps its previous weights); quantized models and ``enable_lora``.
            RuntimeError: requests are unfinished (the offline API never leaves any).
        """
        self.llm_engine.update_weights(params)

    def sleep(self, level: int = 1) -> None:
        """Free device memory until ``wake_up`` (vLLM's ``LLM.sleep``; needs
        ``enable_sleep_mode=True``): level 1 the KV cache, level 2 also the weights (restore
        them with ``update_weights``). Compiled executables are kept.

        Raises:
            ValueError: no ``enable_sleep_mode``, or a level other than 1 or 2.
        """
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate the KV cache freed by ``sleep`` at the same shapes, without recompiling
        (vLLM's ``LLM.wake_up``); a no-op with a warning when not sleeping, as in vLLM.

        Raises:
            ValueError: no ``enable_sleep_mode``, or a tag other than weights / kv_cache.
        """
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (``sleep`` without ``wake_up`` since)."""
        return self.llm_engine.is_sleeping()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's ``LLM.reset_prefix_cache``)."""
        return self.llm_engine.reset_prefix_cache()

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's ``LLM.beam_search``); outputs in input order.

        The beams of a prompt are forked sequences of one request that share their KV blocks
        (copy-on-write); each step keeps the best ``beam_width`` of the beams' top
        ``2 * beam_width`` continuations. Each output lists the best ``beam_width`` beams by
        ``cum_logprob / len ** length_penalty``, best first.

        Raises:
            TypeError: ``prompts`` is neither a prompt nor a list of them.
            ValueError: for a bad prompt or parameter (nothing is queued then).
        """
        prompts = _prompt_list(prompts)
        request_ids = self._add_requests(prompts, [params] * len(prompts))
        outputs = self._run_engine(request_ids, use_tqdm=use_tqdm)
        engine = self.llm_engine
        return beam_search_outputs(outputs, engine.tokenizer, engine.eos_token_id, params)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Args:
            prompts: a string, a ``{"prompt_token_ids": [...]}`` / ``{"prompt": str}`` dict, or a
                list of them.
            sampling_params: one for all prompts, or one per prompt; None means
                ``SamplingParams()``.
            use_tqdm: show a progress bar with output tokens/s.
            lora_request: one LoRA adapter for all prompts, or one per prompt (None entries:
                the base model); needs ``enable_lora=True``.

        Raises:
            TypeError: ``prompts`` is neither a prompt nor a list of them (None, a number).
            ValueError: for a bad prompt (a lone surrogate in its text, ids outside the
                vocabulary, ...), a bad adapter, or a parameter list of the wrong length.
                Requests are validated before any is queued, so one bad prompt queues nothing.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; "
                    "give one, or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompts)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompts):
                raise ValueError(
                    f"got {len(lora_list)} lora_request for {len(prompts)} prompts; "
                    "give one, or one per prompt"
                )
        request_ids = self._add_requests(prompts, params_list, lora_list)
        return self._run_engine(request_ids, use_tqdm=use_tqdm)

    def _after_reasoning(self, params):
        """``params`` whose constraint starts after the reasoning (a copy; the caller's are
        left alone), with ``structured_outputs_config.reasoning_parser`` set."""
        so = getattr(params, "structured_outputs", None)
        if self._reasoning_end_ids is None or so is None or so.reasoning_end_token_ids:
            return params
        so = dataclasses.replace(
            so,
            reasoning_end_token_ids=list(self._reasoning_end_ids),
            reasoning_implicit_end_token_ids=self._implicit_end_ids
            and list(self._implicit_end_ids),
        )
        return dataclasses.replace(params, structured_outputs=so)

    def _add_requests(self, prompts: list, params_list: list, lora_list=None) -> list[str]:
        engine = self.llm_engine
        request_ids = [str(next(self._request_counter)) for _ in prompts]
        lora_list = lora_list or [None] * len(prompts)
        added = []
        try:
            for request_id, prompt, params, lora in zip(
                request_ids, prompts, params_list, lora_list, strict=True
            ):
                params = self._after_reasoning(params)
                engine.add_request(request_id, prompt, params, final_only=True, lora_request=lora)
                added.append(request_id)
        except ValueError:
            for request_id in added:  # one bad prompt must not leave the others queued
                engine.abort_request(request_id)
            raise
        return request_ids

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: Sequence[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (vLLM's ``LLM.chat``).

        Each conversation (``[{"role": ..., "content": ...}, ...]``) is rendered with
        ``chat_template`` (None: the tokenizer's; ``tools``, OpenAI-style tool dicts, passed
        to it) and tokenized without adding special tokens,
        then generated as by ``generate`` (``lora_request`` as there); one output per
        conversation, in order.

        Raises:
            ValueError: a malformed conversation, no chat template, or as ``generate``.
        """
        if not messages:
            raise ValueError("messages must hold at least one message, got an empty list")
        conversations = [messages] if is_single_conversation(messages) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            chat_prompt(
                tokenizer,
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run_engine(self, request_ids: list[str], *, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        output_tokens = 0
        with tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm or not is_driver(),  # multi-host: only rank 0 prints
            unit="req",
        ) as bar:
            while len(finished) < len(wanted):
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"output: {output_tokens / elapsed:.1f} toks/s")
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _reasoning_parser(config):
    """The reasoning parser class ``structured_outputs_config.reasoning_parser`` names, or None.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    name = config.structured_outputs_config.reasoning_parser
    if name is None:
        return None
    # Imported when asked for: the parsers bring the server's pydantic protocol with them.
    from jaxpaged.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    if name not in REASONING_PARSERS:
        raise ValueError(
            f"structured_outputs_config.reasoning_parser {name!r} is not a known reasoning "
            f"parser; choose one of {sorted(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS.get_class(name)


def _prompt_list(prompts) -> list:
    """``prompts`` as a list: one prompt (a string or a prompt dict) or a sequence of them.

    Raises:
        TypeError: anything else (None, a number, ...), named by its type.
    """
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        return list(prompts)
    raise TypeError(
        "prompts must be a string, a prompt dict ({'prompt': str} or {'prompt_token_ids': "
        f"[...]}}) or a list of them, got {type(prompts).__name__}"
    )
