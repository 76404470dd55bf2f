"""SchedulerOutput -> padded numpy metadata -> one host-to-device transfer -> the jitted step.

This is the only place host arrays become device arrays. Every step's small int32 (and
bit-cast float32) arrays travel in one packed buffer, unpacked inside the jitted step by static
offsets. One executable per bucket is compiled ahead of time (``jit(...).lower().compile()``),
so an unplanned shape is a ``KeyError``-free lookup miss that compiles visibly rather than a
silent re-trace; ``num_compilations`` counts them for the tests.

Dispatch is asynchronous (``dispatch`` returns a ``PendingStep`` at once; its ``result`` reads
the tokens back). With async scheduling the engine prepares step N+1 before step N's tokens are
on the host: a decode row whose input token is still ``PLACEHOLDER_TOKEN_ID`` takes it from the
previous step's on-device output (vLLM v1's async scheduling), so the device never waits for
Python between steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.sample.sampler import SamplingMetadata, sample
from jaxpaged.worker.buckets import make_buckets, round_up_to_bucket
from jaxpaged.worker.input_batch import PersistentRows
from models.attention_metadata import AttentionMetadata

# Smallest token bucket of a step that carries a prefill chunk; decode-only steps use the
# sequence buckets, which start at 1.
_MIN_TOKEN_BUCKET = 16
# Above this many rows a decode step's matmuls are compute-bound, so padding costs time in
# proportion: sequence buckets step linearly by this much instead of doubling.
_SEQ_BUCKET_GAP = 128
# Token buckets double up to max(512, max_num_batched_tokens / 8), then step linearly by that:
# about a dozen compilations for any budget, at most ~1/8 of the budget padded.
_TOKEN_BUCKET_STEPS = 8
# Token id of a sampled token that is still on the device (async scheduling); ids are >= 0.
PLACEHOLDER_TOKEN_ID = -1


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """Static shape of one compiled step: ``T`` tokens, ``B`` sequences, decode-only or mixed."""

    num_tokens: int
    num_seqs: int
    decode_only: bool


@dataclasses.dataclass(frozen=True)
class SamplerKey:
    """Static shape of one compiled sampler: ``B`` rows, with or without top-k/top-p/min-p."""

    num_seqs: int
    apply_filters: bool


# The per-row sampling sections of the packed buffer, in order (the sampler's input rows).
_SAMPLING_SECTIONS = ("top_k", "seed_lo", "seed_hi", "step", "temperature", "top_p", "min_p")
_NUM_SAMPLING_ROWS = len(_SAMPLING_SECTIONS)


@dataclasses.dataclass(frozen=True)
class _PackedLayout:
    """Offsets of each array inside the packed int32 buffer of one bucket."""

    num_tokens: int
    num_seqs: int
    max_blocks: int

    def sections(self) -> list[tuple[str, int]]:
        t, b = self.num_tokens, self.num_seqs
        return [
            ("input_ids", t),
            ("input_src", t),  # row of the previous step's output to read the id from; -1: none
            ("positions", t),
            ("slot_mapping", t),
            ("block_tables", b * self.max_blocks),
            ("seq_lens", b),
            ("cu_q_lens", b + 1),
            ("logits_indices", b),
            ("top_k", b),
            ("seed_lo", b),
            ("seed_hi", b),
            ("step", b),
            ("temperature", b),  # float32 bit patterns
            ("top_p", b),
            ("min_p", b),
        ]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.sections())

    def offsets(self) -> dict[str, tuple[int, int]]:
        out, offset = {}, 0
        for name, n in self.sections():
            out[name] = (offset, offset + n)
            offset += n
        return out

    def unpack(self, packed: jax.Array) -> dict[str, jax.Array]:
        return {name: packed[a:b] for name, (a, b) in self.offsets().items()}


@dataclasses.dataclass
class StepStats:
    """Counters of dispatched steps, for benchmarks.

    ``wait_seconds`` is the host time spent blocked on step outputs (with async scheduling:
    the time the host had nothing to do). ``launch_to_ready_seconds`` sums, per step, the time
    from handing the prepared inputs to the executables until the tokens were on the host; when
    steps run synchronously (each result read right after its launch) that is the device's busy
    time plus launch overhead, whether or not the launch call itself blocks.
    """

    num_steps: int = 0
    num_tokens: int = 0  # scheduled tokens, padding excluded
    num_padded_tokens: int = 0  # tokens of the buckets the steps ran in
    wait_seconds: float = 0.0
    launch_to_ready_seconds: float = 0.0


class PendingStep:
    """A dispatched step whose sampled tokens may still be on the device.

    ``result()`` blocks until they are on the host and returns ``{seq_id: (token_id,
    logprob)}`` for the sequences that sample in the step.
    """

    def __init__(
        self,
        out: jax.Array | None,
        sampled: list[tuple[str, int]],
        stats: StepStats | None = None,
        launched_at: float = 0.0,
    ):
        self._out = out
        self._sampled = sampled
        self._stats = stats
        self._launched_at = launched_at
        self._result: dict[str, tuple[int, float]] | None = None

    def result(self) -> dict[str, tuple[int, float]]:
        if self._result is None:
            if self._out is None:
                self._result = {}
            else:
                start = time.perf_counter()
                host = np.asarray(self._out)
                if self._stats is not None:
                    ready = time.perf_counter()
                    self._stats.wait_seconds += ready - start
                    self._stats.launch_to_ready_seconds += ready - self._launched_at
                token_ids = host[0].tolist()
                logprobs = host[1].view(np.float32).tolist()
                self._result = {sid: (token_ids[i], logprobs[i]) for sid, i in self._sampled}
                self._out = None
        return self._result


class ModelRunner:
    """Runs the model on scheduled sequences and returns one sampled token per finished prefill
    or decode.

    Args:
        model: an NNX causal LM (``models.llama.LlamaForCausalLM``).
        kv_caches: per-layer ``(k, v)``, each ``[num_blocks, block_size, Hkv, D]``; owned (and
            donated to each step) by the runner from here on. ``jax.ShapeDtypeStruct`` leaves
            are allowed until the first step: buckets can then be compiled before the cache is
            allocated, while the memory it will take is still free for the compiler.
        block_size, max_model_len, max_num_seqs, max_num_batched_tokens: engine limits.
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
    ):
        # Split once: jitting a pure function of the flat state keeps the HLO free of baked-in
        # weights and avoids re-traversing NNX objects every step (milliseconds on big models).
        self._graphdef, self._state = nnx.split(model)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.seq_buckets = make_buckets(max_num_seqs, gap=_SEQ_BUCKET_GAP)
        self.token_buckets = make_buckets(
            max_num_batched_tokens,
            minimum=min(_MIN_TOKEN_BUCKET, max_num_batched_tokens),
            gap=max(512, max_num_batched_tokens // _TOKEN_BUCKET_STEPS),
        )
        # Every step's output is [2, max_out_rows] (ids, logprob bits) whatever its bucket, so
        # the next step can read it without one compilation per pair of buckets.
        self._max_out_rows = self.seq_buckets[-1]
        self._rows = PersistentRows(max_num_seqs, self.max_blocks)
        self._vocab_size = int(model.vocab_size)
        self._executables: dict[BucketKey, jax.stages.Compiled] = {}
        self._sampler_executables: dict[SamplerKey, jax.stages.Compiled] = {}
        self.num_compilations = 0
        self._jitted_forward = jax.jit(
            self._forward,
            static_argnames=("layout", "decode_only"),
            donate_argnames=("kv_caches",),
        )
        self._jitted_sample = jax.jit(self._sample, static_argnames=("apply_filters",))
        self._prev_out = jnp.zeros((2, self._max_out_rows), jnp.int32)
        self._prev_rows: dict[str, int] = {}
        self.stats = StepStats()

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

    def all_sampler_keys(self) -> list[SamplerKey]:
        """Every sampler shape: each ``B`` a step bucket has, with and without the filters."""
        num_seqs = sorted({key.num_seqs for key in self.all_bucket_keys()})
        return [SamplerKey(b, f) for b in num_seqs for f in (False, True)]

    def compile_all(self, *, show_progress: bool = True, num_threads: int | None = None) -> None:
        """Compile every step bucket and sampler shape now (start-up), with a progress bar.

        Tracing runs here one program after another (it holds the GIL); XLA's compilation of the
        traced programs runs on ``num_threads`` threads (default: one per CPU core, at most 16).
        """
        todo = [k for k in self.all_bucket_keys() if k not in self._executables]
        todo += [k for k in self.all_sampler_keys() if k not in self._sampler_executables]
        if not todo:
            return
        lowered = [self._lower(key) for key in todo]
        workers = num_threads or min(16, os.cpu_count() or 1, len(todo))
        with (
            ThreadPoolExecutor(max_workers=workers) as pool,
            tqdm(total=len(todo), desc="Compiling step buckets", disable=not show_progress) as bar,
        ):
            futures = [pool.submit(low.compile) for low in lowered]
            for key, future in zip(todo, futures, strict=True):
                self._store(key, future.result())
                bar.update(1)

    def _lower(self, key: BucketKey | SamplerKey) -> jax.stages.Lowered:
        if isinstance(key, SamplerKey):
            logits = jax.ShapeDtypeStruct((key.num_seqs, self._vocab_size), jnp.float32)
            params = jax.ShapeDtypeStruct((_NUM_SAMPLING_ROWS, key.num_seqs), jnp.int32)
            return self._jitted_sample.lower(logits, params, apply_filters=key.apply_filters)
        layout = _PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks)
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        kv_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.kv_caches)
        return self._jitted_forward.lower(
            self._state,
            kv_shapes,
            packed,
            self._prev_out,
            layout=layout,
            decode_only=key.decode_only,
        )

    def _store(self, key: BucketKey | SamplerKey, compiled: jax.stages.Compiled) -> None:
        if isinstance(key, SamplerKey):
            self._sampler_executables[key] = compiled
        else:
            self._executables[key] = compiled
        self.num_compilations += 1

    def _compile(self, key: BucketKey | SamplerKey) -> jax.stages.Compiled:
        compiled = self._lower(key).compile()
        self._store(key, compiled)
        return compiled

    def _run(self, key: BucketKey, packed: np.ndarray, apply_filters: bool) -> jax.Array:
        """Launch the forward of bucket ``key`` and its sampler; returns the step's output
        ``i32[2, max_out_rows]`` (token ids, logprob bits) without waiting for it."""
        forward = self._executables.get(key) or self._compile(key)
        sampler_key = SamplerKey(key.num_seqs, apply_filters)
        sampler = self._sampler_executables.get(sampler_key) or self._compile(sampler_key)
        logits, params, self.kv_caches = forward(
            self._state, self.kv_caches, jax.device_put(packed), self._prev_out
        )
        return sampler(logits, params)

    def warmup(self) -> None:
        """Run every compiled step bucket and sampler once on padding (no cache slot is
        written), so that loading each executable onto the device happens at start-up rather
        than in the first steps."""
        for key in list(self._executables):
            layout = _PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks)
            packed = self._prepare_inputs([], layout)
            for apply_filters in (False, True):
                self._run(key, packed, apply_filters).block_until_ready()

    def profile_run(self) -> None:
        """Run the largest mixed bucket once on padding, with the filtering sampler, so the
        device's peak memory includes the step's activations (memory sizing reads it next)."""
        key = self.bucket_for(self.token_buckets[-1], 1, False)
        layout = _PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks)
        self._run(key, self._prepare_inputs([], layout), True).block_until_ready()

    # ---------------------------------------------------------------------------- the step
    def _forward(
        self, state, kv_caches, packed, prev_out, *, layout: _PackedLayout, decode_only: bool
    ):
        """The model on one bucket: ``(logits f32[B, V], sampling rows i32[7, B], kv_caches)``."""
        arrays = layout.unpack(packed)
        b = layout.num_seqs
        metadata = AttentionMetadata(
            slot_mapping=arrays["slot_mapping"],
            block_tables=arrays["block_tables"].reshape(b, layout.max_blocks),
            seq_lens=arrays["seq_lens"],
            cu_q_lens=arrays["cu_q_lens"],
            decode_only=decode_only,
        )
        # Async scheduling: tokens sampled by the previous step never went through the host.
        src = arrays["input_src"]
        input_ids = jnp.where(src >= 0, prev_out[0][jnp.maximum(src, 0)], arrays["input_ids"])
        model = nnx.merge(self._graphdef, state)
        hidden, kv_caches = model(input_ids, arrays["positions"], kv_caches, metadata)
        # Only the rows that sample reach the LM head.
        logits = model.compute_logits(hidden[arrays["logits_indices"]])
        sampling_rows = jnp.stack([arrays[name] for name in _SAMPLING_SECTIONS])
        return logits, sampling_rows, kv_caches

    def _sample(self, logits, sampling_rows, *, apply_filters: bool):
        """Sample each row; ``i32[2, max_out_rows]``: token ids, then logprobs' float32 bits.

        A separate executable from the forward so that the host, which knows whether any row
        filters, picks the variant: a ``lax.cond`` on the device would sync XLA:GPU mid-step.
        """
        rows = dict(zip(_SAMPLING_SECTIONS, sampling_rows, strict=True))
        as_f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
        as_u32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)  # noqa: E731
        metadata = SamplingMetadata(
            temperature=as_f32(rows["temperature"]),
            top_k=rows["top_k"],
            top_p=as_f32(rows["top_p"]),
            min_p=as_f32(rows["min_p"]),
            seed_lo=as_u32(rows["seed_lo"]),
            seed_hi=as_u32(rows["seed_hi"]),
            step=rows["step"],
        )
        token_ids, logprobs = sample(logits, metadata, apply_filters=apply_filters)
        b = logits.shape[0]
        out = jnp.zeros((2, self._max_out_rows), jnp.int32)
        out = out.at[0, :b].set(token_ids)
        return out.at[1, :b].set(jax.lax.bitcast_convert_type(logprobs, jnp.int32))

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, tuple[int, float]]:
        """Run one step and wait for it; returns ``{seq_id: (token_id, logprob)}`` for sequences
        that sample."""
        return self.dispatch(scheduler_output).result()

    def dispatch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Prepare and launch one step without waiting for the device.

        Input tokens equal to ``PLACEHOLDER_TOKEN_ID`` are read on the device from the output of
        the step dispatched just before this one.

        Raises:
            RuntimeError: a placeholder token that the previous step did not sample.
        """
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return PendingStep(None, [])
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        key = self.bucket_for(scheduler_output.num_batched_tokens, len(scheduled), decode_only)
        layout = _PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks)
        packed = self._prepare_inputs(scheduled, layout)
        apply_filters = _needs_filters(packed, layout)
        launched_at = time.perf_counter()
        out = self._run(key, packed, apply_filters)
        # Start the device-to-host copy now so that result() finds the tokens already there.
        out.copy_to_host_async()
        sampled = [(s.seq.seq_id, i) for i, s in enumerate(scheduled) if s.do_sample]
        self._prev_out = out
        self._prev_rows = dict(sampled)
        self.stats.num_steps += 1
        self.stats.num_tokens += scheduler_output.num_batched_tokens
        self.stats.num_padded_tokens += key.num_tokens
        return PendingStep(out, sampled, self.stats, launched_at)

    def _prepare_inputs(self, scheduled, layout: _PackedLayout) -> np.ndarray:
        """The packed ``i32[layout.size]`` buffer of one step (see ``_PackedLayout``)."""
        n = len(scheduled)
        bs = self.block_size
        packed = np.zeros(layout.size, np.int32)
        view = {name: packed[a:b] for name, (a, b) in layout.offsets().items()}
        view["slot_mapping"][:] = -1
        view["input_src"][:] = -1
        rows_padded = np.full(layout.num_seqs, self._rows.padding_row, np.int64)
        cu_q_lens = view["cu_q_lens"]
        if n:
            rows = self._rows.assign(scheduled)
            rows_padded[:n] = rows
            starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
            lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
            if int(lens.max()) == 1:
                num_tokens = n
                ids = np.fromiter(
                    (s.seq.token_ids[s.num_computed_tokens] for s in scheduled), np.int64, n
                )
                positions, token_rows = starts, rows
            else:
                num_tokens = int(lens.sum())
                ids = np.fromiter(
                    itertools.chain.from_iterable(
                        s.seq.token_ids[
                            s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens
                        ]
                        for s in scheduled
                    ),
                    np.int64,
                    num_tokens,
                )
                firsts = np.cumsum(lens) - lens
                positions = np.arange(num_tokens) - np.repeat(firsts - starts, lens)
                token_rows = np.repeat(rows, lens)
            placeholders = np.flatnonzero(ids == PLACEHOLDER_TOKEN_ID)
            if placeholders.size:
                view["input_src"][placeholders] = self._placeholder_sources(
                    scheduled, lens, placeholders
                )
                ids[placeholders] = 0
            view["input_ids"][:num_tokens] = ids
            view["positions"][:num_tokens] = positions
            tables = self._rows.block_tables
            view["slot_mapping"][:num_tokens] = (
                tables[token_rows, positions // bs] * bs + positions % bs
            )
            view["seq_lens"][:n] = starts + lens
            np.cumsum(lens, out=cu_q_lens[1 : n + 1])
            cu_q_lens[n + 1 :] = cu_q_lens[n]
            view["logits_indices"][:n] = cu_q_lens[1 : n + 1] - 1
            view["step"][:n] = np.fromiter(
                (len(s.seq.output_token_ids) for s in scheduled), np.int64, n
            )
        rows_store = self._rows
        view["block_tables"][:] = rows_store.block_tables[rows_padded].reshape(-1)
        view["top_k"][:] = rows_store.top_k[rows_padded]
        seed = rows_store.seed[rows_padded]
        view["seed_lo"][:] = (seed & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
        view["seed_hi"][:] = (seed >> 32).astype(np.uint32).view(np.int32)
        view["temperature"][:] = rows_store.temperature[rows_padded].view(np.int32)
        view["top_p"][:] = rows_store.top_p[rows_padded].view(np.int32)
        view["min_p"][:] = rows_store.min_p[rows_padded].view(np.int32)
        return packed

    def _placeholder_sources(self, scheduled, lens: np.ndarray, placeholders: np.ndarray):
        """Row of the previous step's output that holds each placeholder token."""
        owner = (
            placeholders
            if int(lens.max()) == 1
            else np.repeat(np.arange(len(lens)), lens)[placeholders]
        )
        sources = []
        for j in owner.tolist():
            seq_id = scheduled[j].seq.seq_id
            source = self._prev_rows.get(seq_id)
            if source is None or lens[j] != 1:
                raise RuntimeError(
                    f"sequence {seq_id!r} has a placeholder token that the previous step did not "
                    f"sample ({lens[j]=})"
                )
            sources.append(source)
        return sources


def _needs_filters(packed: np.ndarray, layout: _PackedLayout) -> bool:
    """Whether any row of the step uses top-k, top-p or min-p (padding rows use none)."""
    offsets = layout.offsets()
    section = lambda name: packed[slice(*offsets[name])]  # noqa: E731
    return bool(
        (section("top_k") > 0).any()
        or (section("top_p").view(np.float32) < 1.0).any()
        or (section("min_p").view(np.float32) > 0.0).any()
    )
