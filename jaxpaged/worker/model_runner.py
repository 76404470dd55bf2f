"""The host side of one step: SchedulerOutput -> packed inputs -> launched segments -> outputs.

This is the only place host arrays become device arrays. One step goes through the runner as
``prepare`` (bucket key, LogitsState slots, sampler variant, the packed int32 inputs, counters:
the one preparation every step shares) -> ``launch`` of each of its segments (the device stages
of ``worker/step_program.py``, one executable per segment) -> ``collect`` (the outputs read back,
``worker/step_output.py``). Every step's small int32 (and bit-cast float32) arrays travel in one
packed buffer, unpacked inside the jitted segment by static offsets. One executable per bucket
and segment is compiled ahead of time (``jit(...).lower().compile()``), so an unplanned shape is
a lookup miss that compiles visibly rather than a silent re-trace; ``num_compilations`` counts
them for the tests.
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

from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.sample import logits_state as ls
from jaxpaged.sample.metadata import SamplerVariant
from jaxpaged.structured_output.bitmask import num_words
from jaxpaged.worker.buckets import make_buckets, round_up_to_bucket
from jaxpaged.worker.device_weights import DeviceWeights, array_specs
from jaxpaged.worker.executables import ExecutableTable
from jaxpaged.worker.input_prep import PackedInputBuilder
from jaxpaged.worker.step_buffer import PackedLayout
from jaxpaged.worker.step_output import ModelRunnerOutput, read_back
from jaxpaged.worker.step_program import FORWARD, SAMPLE, WHOLE, BucketKey, StepProgram
from jaxpaged.worker.step_timeline import StepTimeline

# Smallest token bucket of a step that carries a prefill chunk; decode-only steps use the
# sequence buckets, which start at 1.
_MIN_TOKEN_BUCKET = 16
# Bucket spacing above the powers of two (``make_buckets``' ``gap``): finer spacing pads less
# and compiles more step shapes.
SEQ_BUCKET_GAP = 512
TOKEN_BUCKET_GAP = 512


@dataclasses.dataclass
class DeviceStep:
    """One step on its way through the device: prepared on the host (``ModelRunner.prepare``),
    its segments launched in order (``launch``), its outputs read back (``collect``)."""

    scheduled: list  # ``ScheduledSequence``s in row order; empty: nothing runs
    key: BucketKey | None = None  # the whole step's key (each segment's: ``key.for_segment``)
    layout: PackedLayout | None = None  # the packed inputs' layout, shared by every segment
    packed: np.ndarray | None = None  # i32[layout.size], the packed inputs on the host
    inputs: jax.Array | None = None  # the same on the device, once the first segment launched
    handed: dict | None = None  # what the last launched segment hands to the next
    out: dict | None = None  # the sampled outputs on the device, once ``sample`` launched


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
        # The device stages (step_program.py); every segment of every bucket is this one
        # function, jitted with the segment's static key.
        self.program = StepProgram(
            self.weights,
            max_logprobs=max_logprobs,
            max_loras=lora_manager.max_loras if lora_manager is not None else 0,
        )
        self._jitted_run = jax.jit(
            self.program.step_segment,
            static_argnames=("key", "layout"),
            donate_argnames=("kv_caches", "logits_state"),
            **placement,
        )
        # The last launched step's sampled ids, padded to the largest sequence bucket, and its
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
        # The token bitmask rides in the packed inputs only when the segment that samples also
        # carries them (one variant per bucket, any schema); a later sampling segment takes it
        # as an input of its own (``handed``), so every segment of a step shares one layout.
        words = 0
        if key.variant.structured and FORWARD in key.segment and SAMPLE in key.segment:
            words = num_words(self.vocab_size)
        return PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks, words)

    def _lower_and_compile(self, key: BucketKey) -> jax.stages.Compiled:
        return self.lower(key).compile(self.compiler_options)

    def lower(self, key: BucketKey, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The program of bucket ``key`` lowered for ``platforms`` (None: the default backend;
        ``("cuda",)`` inside ``models.platform.abstract_gpu`` lowers for that GPU on any
        host)."""
        traced = self.trace(key)
        return traced.lower() if platforms is None else traced.lower(lowering_platforms=platforms)

    def trace(self, key: BucketKey) -> jax.stages.Traced:
        """The program of bucket ``key`` (its segment of the step) traced against
        the shapes of the weights, caches and inputs, never their arrays; the platform choices
        made while tracing (``models.platform.target_platform``) are those of the caller's
        context."""
        layout = self._layout(key)
        lora_weights = self._lora_weights()
        handed = None
        if FORWARD not in key.segment:  # what the step's forward segment hands on
            b = key.num_seqs
            handed = {"logits": self._replicated_spec((b, self.vocab_size), jnp.float32)}
            if key.variant.structured:
                words = num_words(self.vocab_size)
                handed["token_bitmask"] = self._replicated_spec((b, words), jnp.int32)
        return self._jitted_run.trace(
            self.weights.specs,
            self._kv_cache_specs,
            self._logits_state_spec,
            self._prev_tokens_spec,
            jax.ShapeDtypeStruct((layout.size,), jnp.int32),
            None if lora_weights is None else array_specs(lora_weights, self._mesh),
            handed,
            key=key,
            layout=layout,
        )

    def _replicated_spec(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._input_sharding)

    def profile_key(self) -> BucketKey:
        """The bucket ``profile_run`` runs: the largest mixed bucket with every sampler stage
        on (every token asks for prompt logprobs), so that the largest variant's buffers and
        the logits chunks count in the peak."""
        key = self.bucket_for(self.token_buckets[-1], 1, False)
        every_stage = SamplerVariant(True, True, True, True, token_logprobs=True)
        return dataclasses.replace(key, variant=every_stage)

    def profile_run(self) -> None:
        """Run the largest mixed bucket once on padding so the device's peak memory includes the
        step's activations (memory sizing reads it next)."""
        key = self.profile_key()
        layout = self._layout(key)
        packed = self._prepare_inputs([], layout, [], profile=True)
        out, self.kv_caches, self.logits_state = self.executable(key)(
            self.weights.arrays,
            self.kv_caches,
            self.logits_state,
            self._prev_tokens,
            jax.device_put(packed, self._input_sharding),
            self._lora_weights(),
            None,
        )
        out["token_ids"].block_until_ready()

    # ---------------------------------------------------------------------------- the step
    def execute_block_ops(self, scheduler_output: SchedulerOutput, block_mover) -> None:
        """Run the step's swap-out, swap-in and copy-on-write block moves, in that order, on the
        KV cache (``jaxpaged.worker.swap.BlockMover``); call before ``prepare``."""
        self.kv_caches = block_mover.execute(self.kv_caches, scheduler_output)

    def execute_model(
        self, scheduler_output: SchedulerOutput, fill_bitmask=None
    ) -> ModelRunnerOutput:
        """Run one step whole and wait for it: the token sampled for each sequence that computed
        its last token, its logprob, the logprobs its request asked for and, for beam-search
        steps, each sampled row's best candidates. ``fill_bitmask`` as in ``launch`` (None: no
        row samples under a grammar)."""
        step = self.prepare(scheduler_output, structured=fill_bitmask is not None)
        return self.collect(self.launch(step, WHOLE, fill_bitmask=fill_bitmask))

    def prepare(
        self,
        scheduler_output: SchedulerOutput,
        *,
        structured: bool = False,
        segments: tuple[tuple[str, ...], ...] = (WHOLE,),
    ) -> DeviceStep:
        """The host work of one step before anything launches: its bucket key (beam candidates
        and sampler variant included), each row's LogitsState slot (rows it lacks are rebuilt
        on the device now), the packed inputs, and the token counters.

        Args:
            structured: some row samples under a grammar: the step takes a token bitmask.
            segments: how the step's stages will be launched (``step_program.STAGES`` cut into
                contiguous runs); the packed inputs' layout depends on the first.
        """
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return DeviceStep([])
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        key = self.bucket_for(scheduler_output.num_batched_tokens, len(scheduled), decode_only)
        num_candidates = scheduler_output.num_beam_candidates
        if num_candidates:
            padded = min(1 << (num_candidates - 1).bit_length(), self.vocab_size)
            key = dataclasses.replace(key, num_beam_candidates=padded)
        slots = self._assign_logits_state_slots(scheduled)
        variant = SamplerVariant.for_step(scheduled, slots)
        if structured:
            variant = dataclasses.replace(variant, structured=True)
        key = dataclasses.replace(key, variant=variant)
        layout = self._layout(key.for_segment(segments[0]))
        packed = self._prepare_inputs(scheduled, layout, slots)
        self._prev_scheduled = scheduled
        self.num_scheduled_tokens += scheduler_output.num_batched_tokens
        self.num_bucket_tokens += key.num_tokens
        return DeviceStep(scheduled, key, layout, packed)

    def launch(self, step: DeviceStep, segment=WHOLE, *, fill_bitmask=None) -> DeviceStep:
        """Launch one segment of a prepared step and return at once (nothing waits for the
        device); segments launch in stage order. A token equal to ``PLACEHOLDER_TOKEN_ID`` is
        read on the device from the previous launched step's sampled ids (async scheduling).

        Args:
            fill_bitmask: for the segment that samples a structured step: ``fill(out)`` writes
                the constrained rows of ``out`` (i32[B, W], all ones, rows in ``scheduled``
                order); into the packed inputs when they travel with this segment, else into
                an input of its own. None: every row allowed.
        """
        if not step.scheduled:
            return step
        key = step.key.for_segment(segment)
        if step.inputs is None:  # the first segment carries the packed inputs
            if fill_bitmask is not None and step.layout.bitmask_words:
                # Filled in place: at B=1024 and 128k tokens the bitmask is 16 MB.
                span = step.layout.spans()["token_bitmask"]
                fill_bitmask(step.packed[span].reshape(key.num_seqs, step.layout.bitmask_words))
            step.inputs = jax.device_put(step.packed, self._input_sharding)
        handed = step.handed
        if FORWARD not in segment and key.variant.structured:
            bitmask = np.full((key.num_seqs, num_words(self.vocab_size)), -1, np.int32)
            if fill_bitmask is not None:
                fill_bitmask(bitmask)
            handed = {**handed, "token_bitmask": jax.device_put(bitmask, self._input_sharding)}
        out, self.kv_caches, self.logits_state = self.executable(key)(
            self.weights.arrays,
            self.kv_caches,
            self.logits_state,
            self._prev_tokens,
            step.inputs,
            self._lora_weights(),
            handed,
        )
        if SAMPLE not in segment:
            step.handed = out
            return step
        self._prev_tokens = out.pop("next_prev_tokens")
        step.out, step.handed = out, None
        if self.timeline is not None:
            self.timeline.dispatched(out["token_ids"])
        return step

    def collect(self, step: DeviceStep) -> ModelRunnerOutput:
        """Wait for a launched step and read its tokens (and what else it computed) back."""
        if step.out is None:
            return ModelRunnerOutput({})
        return read_back(step.scheduled, step.out)

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
