"""SchedulerOutput -> padded numpy metadata -> one host-to-device transfer -> the jitted step.

This is the only place host arrays become device arrays. Every step's small int32 (and
bit-cast float32) arrays travel in one packed buffer, unpacked inside the jitted step by static
offsets. One executable per bucket is compiled ahead of time (``jit(...).lower().compile()``),
so an unplanned shape is a ``KeyError``-free lookup miss that compiles visibly rather than a
silent re-trace; ``num_compilations`` counts them for the tests.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.sample import logits_state as ls
from jaxpaged.sample.logprobs import (
    ModelRunnerOutput,
    host_token_logprobs,
    sampled_logprobs,
    step_prompt_logprobs,
)
from jaxpaged.sample.metadata import SamplerVariant, SamplingMetadata
from jaxpaged.sample.sampler import sample
from jaxpaged.structured_output.bitmask import apply_token_bitmask, num_words
from jaxpaged.worker.beam_candidates import top_logprobs
from jaxpaged.worker.buckets import make_buckets, round_up_to_bucket
from jaxpaged.worker.device_weights import DeviceWeights, array_specs
from jaxpaged.worker.executables import ExecutableTable
from jaxpaged.worker.input_prep import PackedInputBuilder
from jaxpaged.worker.step_buffer import PackedLayout
from jaxpaged.worker.step_timeline import StepTimeline
from models.attention_metadata import AttentionMetadata
from models.lora import LoRABatch

# Smallest token bucket of a step that carries a prefill chunk; decode-only steps use the
# sequence buckets, which start at 1.
_MIN_TOKEN_BUCKET = 16
# Bucket spacing above the powers of two (``make_buckets``' ``gap``): finer spacing pads less
# and compiles more step shapes.
SEQ_BUCKET_GAP = 512
TOKEN_BUCKET_GAP = 512
_DEFAULT_VARIANT = SamplerVariant()


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """Static shape of one compiled step: ``T`` tokens, ``B`` sequences, decode-only or mixed."""

    num_tokens: int
    num_seqs: int
    decode_only: bool
    # Beam search: top-k (token, logprob) pairs returned per row, a power of two; 0 (every
    # bucket compiled at start-up) returns none, so beam steps compile only when beams are used.
    num_beam_candidates: int = 0
    # Optional sampler stages; start-up compiles the default (none), others compile on first use.
    variant: SamplerVariant = _DEFAULT_VARIANT
    # "step": the whole step; "forward" / "sample": its two halves, for async steps that sample
    # under a grammar (the bitmask is filled while the forward runs; ``dispatch_forward``).
    part: str = "step"


@dataclasses.dataclass
class ForwardStep:
    """The forward half of a split step, dispatched: what its sample half needs."""

    scheduled: list
    key: BucketKey  # the sample half's bucket
    packed: jax.Array  # the step's packed inputs, on the device
    logits: jax.Array  # f32[B, vocab_size], on the device


@dataclasses.dataclass
class PendingStep:
    """A dispatched step: its scheduled sequences and its on-device outputs (None: empty)."""

    scheduled: list
    out: dict | None


class ModelRunner:
    """Runs the model on scheduled sequences and returns one sampled token per finished prefill
    or decode.

    Args:
        model: an NNX causal LM (``models.llama.LlamaForCausalLM``).
        kv_caches: per-layer ``(k, v)``, each ``[num_blocks, block_size, Hkv, D]``; owned (and
            donated to each step) by the runner from here on.
        block_size, max_model_len, max_num_seqs, max_num_batched_tokens: engine limits.
        mesh: tensor parallelism: the packed inputs and sampled tokens are replicated over it and
            the KV caches keep their head sharding through every (donated) step.
        vocab_size: rows of the per-request ``LogitsState`` are this wide.
        max_logprobs: top logprobs computed per sampled or prompt token (static).
        lora_manager: multi-LoRA (``jaxpaged.lora.manager.LoRAManager``): its slot weights
            join every step and each scheduled sequence's adapter gets a slot; None: base only.
    """

    def __init__(
        self,
        model: nnx.Module,
        kv_caches: list,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        vocab_size: int,
        max_logprobs: int = 20,
        mesh: Mesh | None = None,
        lora_manager=None,
        compiler_options: dict | None = None,
    ):
        self.lora_manager = lora_manager
        # XLA options every bucket compiles with (models.linear_backends.step_compiler_options).
        self.compiler_options = dict(compiler_options) if compiler_options else None
        # The parameters as one flat list of arrays, split from the module once (device_weights).
        self.weights = DeviceWeights(model, mesh)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.seq_buckets = make_buckets(max_num_seqs, gap=SEQ_BUCKET_GAP)
        self.token_buckets = make_buckets(
            max_num_batched_tokens,
            minimum=min(_MIN_TOKEN_BUCKET, max_num_batched_tokens),
            gap=TOKEN_BUCKET_GAP,
        )
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        # Per-request penalty counts, prompt/stop sets and bias rows (sample/logits_state.py).
        self.logits_state = ls.allocate_logits_state(max_num_seqs, vocab_size)
        self.slot_table = ls.SlotTable(max_num_seqs)
        self._input_builder = PackedInputBuilder(
            block_size=block_size,
            max_blocks=self.max_blocks,
            neutral_slot=self.logits_state.neutral_slot,
            max_cached_seqs=2 * max_num_seqs,
        )
        # Every bucket's executable, got once on whichever thread asks first (executables.py).
        self._executable_table = ExecutableTable(self._lower_and_compile)
        placement = {}
        self._input_sharding = None
        self._mesh = mesh
        if mesh is not None:
            self._input_sharding = NamedSharding(mesh, P())
            cache_shardings = jax.tree.map(lambda cache: cache.sharding, kv_caches)
            placement["out_shardings"] = (
                self._input_sharding,
                cache_shardings,
                self._input_sharding,
            )
            self.logits_state = jax.device_put(self.logits_state, self._input_sharding)
        self._jitted_step = jax.jit(
            self._step,
            static_argnames=("layout", "decode_only", "num_beam_candidates", "variant"),
            donate_argnames=("kv_caches", "logits_state"),
            **placement,
        )
        halves = {"forward": {}, "sample": {}}
        if mesh is not None:
            halves["forward"]["out_shardings"] = (self._input_sharding, cache_shardings)
            halves["sample"]["out_shardings"] = (self._input_sharding, self._input_sharding)
        self._jitted_forward = jax.jit(
            self._forward,
            static_argnames=("layout", "decode_only"),
            donate_argnames=("kv_caches",),
            **halves["forward"],
        )
        self._jitted_sample = jax.jit(
            self._sample,
            static_argnames=("layout", "variant"),
            donate_argnames=("logits_state",),
            **halves["sample"],
        )
        # Beam search output of the last execute_model: seq_id -> (token_ids, logprobs), each
        # [k] best first, for the sampled rows; empty when the step asked for none.
        self.beam_candidates: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # The last dispatched step's sampled ids, padded to the largest sequence bucket, and its
        # scheduled sequences (row order): the next step reads placeholder tokens from it.
        self._prev_tokens = jax.device_put(
            np.zeros(self.seq_buckets[-1], np.int32), self._input_sharding
        )
        self._prev_scheduled: list = []
        # What steps are lowered against: shapes, dtypes and (with a mesh) shardings, never the
        # arrays. The KV caches and LogitsState are donated by every step, so a background thread
        # could not lower against them (ExecutableTable); and one-device weights lower to the
        # same module (the same persistent-cache key) whether their loader committed them to
        # the device (orbax) or not (safetensors, dummy).
        self._kv_cache_specs = array_specs(kv_caches, mesh)
        self._logits_state_spec = array_specs(self.logits_state, mesh)
        self._prev_tokens_spec = array_specs(self._prev_tokens, mesh)
        # Set by the benchmarks to time each step on the device (``StepTimeline``).
        self.timeline: StepTimeline | None = None
        # Scheduled tokens and the bucket tokens they were padded to, over every dispatch.
        self.num_scheduled_tokens = 0
        self.num_bucket_tokens = 0

    def set_kv_caches(self, kv_caches: list) -> None:
        """Run the steps on ``kv_caches`` from now on (the worker allocates them after
        compiling against their shapes); they are donated to each step.

        Raises:
            ValueError: a layer count, shape or dtype other than the ones compiled for.
        """
        have = [(c.shape, c.dtype) for kv in self._kv_cache_specs for c in kv]
        got = [(c.shape, c.dtype) for kv in kv_caches for c in kv]
        if have != got:
            raise ValueError(
                f"kv_caches must be {len(self.kv_caches)} (k, v) pairs of shape and dtype "
                f"{have[:1]}, got {len(kv_caches)} pairs starting {got[:1]}"
            )
        self.kv_caches = kv_caches

    def release_kv_caches(self) -> None:
        """Free the device KV cache now (sleep mode); ``set_kv_caches`` gives the steps a new
        one of the compiled shapes. No step may run in between."""
        for pair in self.kv_caches:
            for cache in pair:
                if isinstance(cache, jax.Array):
                    cache.delete()
        self.kv_caches = list(self._kv_cache_specs)

    @property
    def has_kv_caches(self) -> bool:
        """Whether the steps have a device KV cache (False before allocation and in sleep)."""
        return all(isinstance(c, jax.Array) for pair in self.kv_caches for c in pair)

    @property
    def _executables(self) -> dict[BucketKey, jax.stages.Compiled]:
        """The executables got so far, by bucket."""
        return self._executable_table.compiled

    @property
    def num_compilations(self) -> int:
        """Executables got so far (each an XLA compilation or a persistent-cache load)."""
        return self._executable_table.num_compilations

    # ----------------------------------------------------------------- buckets and compilation
    def all_bucket_keys(self) -> list[BucketKey]:
        """Every shape the step can take: decode-only per sequence bucket, mixed per token bucket."""
        decode = [BucketKey(b, b, True) for b in self.seq_buckets]
        mixed = [BucketKey(t, self._mixed_num_seqs(t), False) for t in self.token_buckets]
        return decode + mixed

    def _mixed_num_seqs(self, num_tokens: int) -> int:
        # Each scheduled sequence has at least one token, so B <= T; one B per T bucket keeps the
        # number of compilations at one per token bucket.
        return min(num_tokens, self.seq_buckets[-1])

    def bucket_for(self, num_tokens: int, num_seqs: int, decode_only: bool) -> BucketKey:
        """The bucket a step of ``num_tokens`` tokens over ``num_seqs`` sequences is padded to.

        Raises:
            ValueError: if the step exceeds the largest bucket.
        """
        if decode_only:
            b = round_up_to_bucket(num_seqs, self.seq_buckets)
            return BucketKey(b, b, True)
        t = round_up_to_bucket(num_tokens, self.token_buckets)
        return BucketKey(t, self._mixed_num_seqs(t), False)

    def first_step_keys(self) -> list[BucketKey]:
        """The buckets a warm start gets before it returns (the rest load in the background):
        the smallest mixed bucket (a short prompt's prefill) and the smallest decode bucket."""
        return [self.bucket_for(1, 1, False), self.bucket_for(1, 1, True)]

    def compile_all(
        self,
        *,
        show_progress: bool = True,
        num_threads: int | None = None,
        keys: list[BucketKey] | None = None,
    ) -> None:
        """Compile every bucket (or ``keys``) now (start-up), with a progress bar.

        ``kv_caches`` may still be ``jax.ShapeDtypeStruct`` s (with their shardings): compiling
        before the cache is allocated leaves XLA's autotuner the memory the cache will take.
        XLA compiles outside the GIL, so buckets compile on ``num_threads`` threads (default:
        the CPU count, at most 16).
        """
        keys = self.all_bucket_keys() if keys is None else keys
        keys = [k for k in keys if k not in self._executable_table]
        num_threads = num_threads or min(16, os.cpu_count() or 1)
        with (
            concurrent.futures.ThreadPoolExecutor(num_threads) as pool,
            tqdm(total=len(keys), desc="Compiling step buckets", disable=not show_progress) as bar,
        ):
            futures = [pool.submit(self.executable, key) for key in keys]
            for future in concurrent.futures.as_completed(futures):
                future.result()
                bar.update()
        # The LogitsState row writer runs when a request first needs its row: compile it now
        # too, by writing nothing (every index past the last row is dropped).
        padding = np.full(ls.WRITE_ROWS, self.logits_state.neutral_slot + 1, np.int32)
        empty = ls.host_rows([], self.vocab_size)
        self.logits_state = ls.write_rows(self.logits_state, padding, empty)

    def load_in_background(self, keys: list[BucketKey]) -> None:
        """Get ``keys``' executables on a background thread (warm start: persistent-cache
        loads); a step that needs one first waits for it or gets it itself."""
        self._executable_table.load_in_background(keys)

    def wait_for_executables(self) -> None:
        """Return once every bucket given to ``load_in_background`` is there."""
        self._executable_table.wait()

    def executable(self, key: BucketKey) -> jax.stages.Compiled:
        """The executable of ``key`` (any key, also one outside ``all_bucket_keys``, e.g.
        ``profile_key``): got (compiled or loaded) once, on this or another thread; its
        ``memory_analysis()`` gives XLA's temporary, argument and output bytes."""
        return self._executable_table.get(key)

    def _layout(self, key: BucketKey) -> PackedLayout:
        # Only whole structured steps carry the token bitmask in the packed buffer (one variant
        # per bucket, any schema); split ones get it as an argument of the sample half.
        words = num_words(self.vocab_size) if key.variant.structured and key.part == "step" else 0
        return PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks, words)

    def _lower_and_compile(self, key: BucketKey) -> jax.stages.Compiled:
        layout = self._layout(key)
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        lora_weights = self._lora_weights()
        lora_spec = None if lora_weights is None else array_specs(lora_weights, self._mesh)
        if key.part == "forward":
            return self._jitted_forward.lower(
                self.weights.specs,
                self._kv_cache_specs,
                self._prev_tokens_spec,
                packed,
                lora_spec,
                layout=layout,
                decode_only=key.decode_only,
            ).compile(self.compiler_options)
        if key.part == "sample":
            b, words = key.num_seqs, num_words(self.vocab_size)
            return self._jitted_sample.lower(
                self._replicated_spec((b, self.vocab_size), jnp.float32),
                self._logits_state_spec,
                self._prev_tokens_spec,
                packed,
                self._replicated_spec((b, words), jnp.int32),
                layout=layout,
                variant=key.variant,
            ).compile(self.compiler_options)
        return self._jitted_step.lower(
            self.weights.specs,
            self._kv_cache_specs,
            self._logits_state_spec,
            self._prev_tokens_spec,
            packed,
            None if lora_weights is None else array_specs(lora_weights, self._mesh),
            layout=layout,
            decode_only=key.decode_only,
            num_beam_candidates=key.num_beam_candidates,
            variant=key.variant,
        ).compile(self.compiler_options)

    def _replicated_spec(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._input_sharding)

    def profile_key(self) -> BucketKey:
        """The bucket ``profile_run`` runs: the largest mixed bucket with every sampler stage
        on (every token asks for prompt logprobs), so that the largest variant's buffers and
        the logits chunks count in the peak."""
        key = self.bucket_for(self.token_buckets[-1], 1, False)
        return dataclasses.replace(key, variant=SamplerVariant(True, True, True, True))

    def profile_run(self) -> None:
        """Run the largest mixed bucket once on padding so the device's peak memory includes the
        step's activations (memory sizing reads it next)."""
        key = self.profile_key()
        layout = PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks)
        packed = self._prepare_inputs([], layout, [], profile=True)
        out, self.kv_caches, self.logits_state = self.executable(key)(
            self.weights.arrays,
            self.kv_caches,
            self.logits_state,
            self._prev_tokens,
            jax.device_put(packed, self._input_sharding),
            self._lora_weights(),
        )
        out["token_ids"].block_until_ready()

    # ---------------------------------------------------------------------------- the step
    def _step(
        self,
        weights,
        kv_caches,
        logits_state,
        prev_tokens,
        packed,
        lora_weights,
        *,
        layout: PackedLayout,
        decode_only: bool,
        num_beam_candidates: int = 0,
        variant: SamplerVariant = _DEFAULT_VARIANT,
    ):
        arrays = layout.unpack(packed)
        hidden, logits, kv_caches, model = self._run_model(
            weights, kv_caches, prev_tokens, arrays, lora_weights, layout, decode_only
        )
        bitmask = None
        if variant.structured:
            bitmask = arrays["token_bitmask"].reshape(layout.num_seqs, layout.bitmask_words)
        out, logits, logits_state = self._sample_rows(
            logits, logits_state, prev_tokens, arrays, bitmask, variant
        )
        out["prompt_logprobs"] = step_prompt_logprobs(
            hidden,
            logits,
            model.compute_logits,
            out.pop("sampling").prompt_target,
            self.max_logprobs,
            decode_only=decode_only,
            enabled=variant.prompt_logprobs,
        )
        if num_beam_candidates:
            temperature = SamplingMetadata.from_packed(arrays).temperature
            out["beams"] = top_logprobs(logits, temperature, num_beam_candidates)
        return out, kv_caches, logits_state

    def _forward(
        self, weights, kv_caches, prev_tokens, packed, lora_weights, *, layout, decode_only
    ):
        """The forward half of a split step: f32[B, vocab_size] logits of the sampling rows."""
        _, logits, kv_caches, _ = self._run_model(
            weights, kv_caches, prev_tokens, layout.unpack(packed), lora_weights, layout,
            decode_only,
        )  # fmt: skip
        return logits.astype(jnp.float32), kv_caches

    def _sample(self, logits, logits_state, prev_tokens, packed, bitmask, *, layout, variant):
        """The sample half of a split step (no prompt logprobs, no beams: those steps run
        whole)."""
        out, _, logits_state = self._sample_rows(
            logits, logits_state, prev_tokens, layout.unpack(packed), bitmask, variant
        )
        del out["sampling"]
        return out, logits_state

    def _run_model(
        self, weights, kv_caches, prev_tokens, arrays, lora_weights, layout, decode_only
    ):
        prev_index = arrays["prev_index"]
        input_ids = jnp.where(
            prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], arrays["input_ids"]
        )
        b = layout.num_seqs
        metadata = AttentionMetadata(
            slot_mapping=arrays["slot_mapping"],
            block_tables=arrays["block_tables"].reshape(b, layout.max_blocks),
            seq_lens=arrays["seq_lens"],
            cu_q_lens=arrays["cu_q_lens"],
            decode_only=decode_only,
        )
        model = self.weights.model(weights)
        lora = None
        if lora_weights is not None:
            lora = LoRABatch(arrays["lora_slots"], lora_weights, self.lora_manager.max_loras)
        # Families without LoRA support (GPT-2, BLOOM) take no adapter argument.
        extra = () if lora is None else (lora,)
        hidden, kv_caches = model(input_ids, arrays["positions"], kv_caches, metadata, *extra)
        # Only the rows that sample reach the LM head.
        logits = model.compute_logits(hidden[arrays["logits_indices"]])
        return hidden, logits, kv_caches, model

    def _sample_rows(self, logits, logits_state, prev_tokens, arrays, bitmask, variant):
        sampling = SamplingMetadata.from_packed(arrays)
        if bitmask is not None:
            # Grammar-disallowed tokens go to -inf before anything reads the logits, so the
            # sampler, the logprobs (raw ones too, as vLLM's) and beam candidates all see it.
            logits = apply_token_bitmask(logits.astype(jnp.float32), bitmask)
        token_ids, logprobs, logits_state = sample(
            logits, sampling, logits_state, num_logprobs=self.max_logprobs, variant=variant
        )
        out = {
            "token_ids": token_ids,
            "next_prev_tokens": jnp.zeros_like(prev_tokens).at[: token_ids.shape[0]].set(token_ids),
            "sampled_logprobs": sampled_logprobs(logits, token_ids, sampling, logprobs),
            "logprobs": logprobs,
            "sampling": sampling,
        }
        return out, logits, logits_state

    def execute_block_ops(self, scheduler_output: SchedulerOutput, block_mover) -> None:
        """Run the step's swap-out, swap-in and copy-on-write block moves, in that order, on the
        KV cache (``jaxpaged.worker.swap.BlockMover``); call before ``execute_model``."""
        self.kv_caches = block_mover.execute(self.kv_caches, scheduler_output)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the token sampled for each sequence that computed its last token, its
        logprob, the logprobs its request asked for and, for beam-search steps, each sampled
        row's best candidates (``self.beam_candidates``)."""
        return self.collect(self.dispatch(scheduler_output))

    def dispatch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Launch one step on the device and return at once (nothing waits for the device).

        A scheduled token equal to ``PLACEHOLDER_TOKEN_ID`` is read on the device from the
        previous dispatched step's sampled ids (async scheduling).
        """
        scheduled = scheduler_output.scheduled
        self.beam_candidates = {}
        if not scheduled:
            return PendingStep([], None)
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        key = self.bucket_for(scheduler_output.num_batched_tokens, len(scheduled), decode_only)
        num_candidates = getattr(scheduler_output, "num_beam_candidates", 0)
        if num_candidates:
            padded = min(1 << (num_candidates - 1).bit_length(), self.vocab_size)
            key = dataclasses.replace(key, num_beam_candidates=padded)
        slots = self._assign_logits_state_slots(scheduled)
        bitmask = scheduler_output.grammar_bitmask
        variant = SamplerVariant.for_step(scheduled, slots)
        if bitmask is not None:
            variant = dataclasses.replace(variant, structured=True)
        key = dataclasses.replace(key, variant=variant)
        layout = self._layout(key)
        packed = self._prepare_inputs(scheduled, layout, slots)
        if bitmask is not None:  # filled in place: at B=1024 and 128k tokens it is 16 MB
            span = layout.spans()["token_bitmask"]
            bitmask(packed[span].reshape(layout.num_seqs, layout.bitmask_words))
        self.num_scheduled_tokens += scheduler_output.num_batched_tokens
        self.num_bucket_tokens += key.num_tokens
        executable = self.executable(key)
        out, self.kv_caches, self.logits_state = executable(
            self.weights.arrays,
            self.kv_caches,
            self.logits_state,
            self._prev_tokens,
            jax.device_put(packed, self._input_sharding),
            self._lora_weights(),
        )
        self._prev_tokens = out.pop("next_prev_tokens")
        self._prev_scheduled = scheduled
        if self.timeline is not None:
            self.timeline.dispatched(out["token_ids"])
        return PendingStep(scheduled, out)

    def dispatch_forward(self, scheduler_output: SchedulerOutput) -> ForwardStep:
        """Launch the forward half of a step that samples under a grammar (async scheduling):
        the model runs while the host resolves the previous step's tokens and fills this
        step's bitmask; ``dispatch_sample`` then launches the sampling. Not for beam search or
        prompt-logprobs steps (they run whole)."""
        scheduled = scheduler_output.scheduled
        self.beam_candidates = {}
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        key = self.bucket_for(scheduler_output.num_batched_tokens, len(scheduled), decode_only)
        slots = self._assign_logits_state_slots(scheduled)
        variant = dataclasses.replace(SamplerVariant.for_step(scheduled, slots), structured=True)
        sample_key = dataclasses.replace(key, variant=variant, part="sample")
        layout = self._layout(sample_key)  # no bitmask section: the sample half takes it apart
        packed = jax.device_put(
            self._prepare_inputs(scheduled, layout, slots), self._input_sharding
        )
        self.num_scheduled_tokens += scheduler_output.num_batched_tokens
        self.num_bucket_tokens += key.num_tokens
        # One forward executable per bucket serves every sampler variant.
        forward = self.executable(dataclasses.replace(key, part="forward"))
        logits, self.kv_caches = forward(
            self.weights.arrays, self.kv_caches, self._prev_tokens, packed, self._lora_weights()
        )
        self._prev_scheduled = scheduled
        return ForwardStep(scheduled, sample_key, packed, logits)

    def dispatch_sample(self, step: ForwardStep, fill_bitmask) -> PendingStep:
        """Launch the sample half of ``step``; ``fill_bitmask(out)`` writes the grammar rows of
        ``out`` (i32[B, W], all ones) first. Returns at once, as ``dispatch``."""
        bitmask = np.full((step.key.num_seqs, num_words(self.vocab_size)), -1, np.int32)
        fill_bitmask(bitmask)
        out, self.logits_state = self.executable(step.key)(
            step.logits,
            self.logits_state,
            self._prev_tokens,
            step.packed,
            jax.device_put(bitmask, self._input_sharding),
        )
        self._prev_tokens = out.pop("next_prev_tokens")
        if self.timeline is not None:
            self.timeline.dispatched(out["token_ids"])
        return PendingStep(step.scheduled, out)

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a dispatched step and read its tokens (and what else it computed) back."""
        if pending.out is None:
            return ModelRunnerOutput({})
        scheduled, out = pending.scheduled, pending.out
        if "beams" in out:
            beam_ids, beam_logprobs = (np.asarray(x) for x in out["beams"])
            self.beam_candidates = {
                s.seq.seq_id: (beam_ids[i], beam_logprobs[i])
                for i, s in enumerate(scheduled)
                if s.do_sample
            }
        return self._runner_output(scheduled, out)

    def _assign_logits_state_slots(self, scheduled) -> list[int | None]:
        """LogitsState slot per scheduled sequence (None: needs none); rebuilds new rows."""
        users = [s.seq for s in scheduled if s.seq.sampling_params.uses_logits_state]
        if not users:
            return [None] * len(scheduled)
        slots, rebuild = self.slot_table.assign(users)
        for start in range(0, len(rebuild), ls.WRITE_ROWS):
            part = rebuild[start : start + ls.WRITE_ROWS]
            index = np.full(ls.WRITE_ROWS, self.logits_state.neutral_slot + 1, np.int32)
            index[: len(part)] = [slot for slot, _ in part]
            rows = ls.host_rows([seq for _, seq in part], self.vocab_size)
            self.logits_state = ls.write_rows(self.logits_state, index, rows)
        by_id = dict(zip((seq.seq_id for seq in users), slots, strict=True))
        return [by_id.get(s.seq.seq_id) for s in scheduled]

    def _runner_output(self, scheduled, out) -> ModelRunnerOutput:
        token_ids = np.asarray(out["token_ids"])
        chosen = np.asarray(out["sampled_logprobs"])
        sampled = [(i, s.seq.seq_id) for i, s in enumerate(scheduled) if s.do_sample]
        result = ModelRunnerOutput(
            {seq_id: int(token_ids[i]) for i, seq_id in sampled},
            sampled_logprobs={seq_id: float(chosen[i]) for i, seq_id in sampled},
        )
        # Logprob arrays leave the device only when some request of the step wants them.
        if any(s.do_sample and s.seq.sampling_params.logprobs is not None for s in scheduled):
            top = {k: np.asarray(v) for k, v in vars(out["logprobs"]).items()}
            for i, s in enumerate(scheduled):
                if s.do_sample and s.seq.sampling_params.logprobs is not None:
                    result.logprobs[s.seq.seq_id] = host_token_logprobs(top, i, token_ids[i])
        if any(s.seq.sampling_params.prompt_logprobs is not None for s in scheduled):
            top = {k: np.asarray(v) for k, v in vars(out["prompt_logprobs"]).items()}
            t = 0
            for s in scheduled:
                if s.seq.sampling_params.prompt_logprobs is not None:
                    entries = []
                    prompt = s.seq.prompt_token_ids
                    for j in range(s.num_new_tokens):
                        position = s.num_computed_tokens + j + 1
                        if position < len(prompt):
                            entries.append(
                                (position, host_token_logprobs(top, t + j, prompt[position]))
                            )
                    result.prompt_logprobs[s.seq.seq_id] = entries
                t += s.num_new_tokens
        return result

    def _prepare_inputs(
        self, scheduled, layout: PackedLayout, slots: list, *, profile: bool = False
    ) -> np.ndarray:
        lora_slots = None
        if self.lora_manager is not None and scheduled:
            lora_slots = self.lora_manager.slots_for_step([s.seq.lora_request for s in scheduled])
        return self._input_builder.build(
            scheduled,
            layout,
            slots,
            profile=profile,
            prev_scheduled=self._prev_scheduled,
            lora_slots=lora_slots,
        )

    def _lora_weights(self):
        """The LoRA slot arrays every step reads (None without LoRA: no argument at all)."""
        return None if self.lora_manager is None else self.lora_manager.slots.weights
