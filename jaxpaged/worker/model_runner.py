"""SchedulerOutput -> padded numpy metadata -> one host-to-device transfer -> the jitted step.

This is the only place host arrays become device arrays. Every step's small int32 (and
bit-cast float32) arrays travel in one packed buffer, unpacked inside the jitted step by static
offsets. One executable per bucket is compiled ahead of time (``jit(...).lower().compile()``),
so an unplanned shape is a ``KeyError``-free lookup miss that compiles visibly rather than a
silent re-trace; ``num_compilations`` counts them for the tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.sample.sampler import SamplingMetadata, sample
from jaxpaged.worker.beam_candidates import top_logprobs
from jaxpaged.worker.buckets import make_buckets, round_up_to_bucket
from models.attention_metadata import AttentionMetadata

# Smallest token bucket of a step that carries a prefill chunk; decode-only steps use the
# sequence buckets, which start at 1.
_MIN_TOKEN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """Static shape of one compiled step: ``T`` tokens, ``B`` sequences, decode-only or mixed."""

    num_tokens: int
    num_seqs: int
    decode_only: bool
    # Beam search: top-k (token, logprob) pairs returned per row, a power of two; 0 (every
    # bucket compiled at start-up) returns none, so beam steps compile only when beams are used.
    num_beam_candidates: int = 0


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

    def unpack(self, packed: jax.Array) -> dict[str, jax.Array]:
        out, offset = {}, 0
        for name, n in self.sections():
            out[name] = packed[offset : offset + n]
            offset += n
        return out


class ModelRunner:
    """Runs the model on scheduled sequences and returns one sampled token per finished prefill
    or decode.

    Args:
        model: an NNX causal LM (``models.llama.LlamaForCausalLM``).
        kv_caches: per-layer ``(k, v)``, each ``[num_blocks, block_size, Hkv, D]``; owned (and
            donated to each step) by the runner from here on.
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
        self.vocab_size = int(model.vocab_size)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.seq_buckets = make_buckets(max_num_seqs)
        self.token_buckets = make_buckets(
            max_num_batched_tokens, minimum=min(_MIN_TOKEN_BUCKET, max_num_batched_tokens)
        )
        self._executables: dict[BucketKey, jax.stages.Compiled] = {}
        self.num_compilations = 0
        self._jitted_step = jax.jit(
            self._step,
            static_argnames=("layout", "decode_only", "num_beam_candidates"),
            donate_argnames=("kv_caches",),
        )
        # Beam search output of the last execute_model: seq_id -> (token_ids, logprobs), each
        # [k] best first, for the sampled rows; empty when the step asked for none.
        self.beam_candidates: dict[str, tuple[np.ndarray, np.ndarray]] = {}

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

    def compile_all(self, *, show_progress: bool = True) -> None:
        """Compile every bucket now (start-up), with a progress bar."""
        keys = [k for k in self.all_bucket_keys() if k not in self._executables]
        for key in tqdm(keys, desc="Compiling step buckets", disable=not show_progress):
            self._compile(key)

    def _compile(self, key: BucketKey) -> jax.stages.Compiled:
        layout = _PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks)
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        compiled = self._jitted_step.lower(
            self._state,
            self.kv_caches,
            packed,
            layout=layout,
            decode_only=key.decode_only,
            num_beam_candidates=key.num_beam_candidates,
        ).compile()
        self._executables[key] = compiled
        self.num_compilations += 1
        return compiled

    def profile_run(self) -> None:
        """Run the largest mixed bucket once on padding so the device's peak memory includes the
        step's activations (memory sizing reads it next)."""
        key = self.bucket_for(self.token_buckets[-1], 1, False)
        layout = _PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks)
        packed = self._prepare_inputs([], layout)
        token_ids, _, self.kv_caches = self._compile(key)(
            self._state, self.kv_caches, jax.device_put(packed)
        )
        token_ids.block_until_ready()

    # ---------------------------------------------------------------------------- the step
    def _step(
        self,
        state,
        kv_caches,
        packed,
        *,
        layout: _PackedLayout,
        decode_only: bool,
        num_beam_candidates: int = 0,
    ):
        arrays = layout.unpack(packed)
        b = layout.num_seqs
        metadata = AttentionMetadata(
            slot_mapping=arrays["slot_mapping"],
            block_tables=arrays["block_tables"].reshape(b, layout.max_blocks),
            seq_lens=arrays["seq_lens"],
            cu_q_lens=arrays["cu_q_lens"],
            decode_only=decode_only,
        )
        as_f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
        as_u32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)  # noqa: E731
        sampling = SamplingMetadata(
            temperature=as_f32(arrays["temperature"]),
            top_k=arrays["top_k"],
            top_p=as_f32(arrays["top_p"]),
            min_p=as_f32(arrays["min_p"]),
            seed_lo=as_u32(arrays["seed_lo"]),
            seed_hi=as_u32(arrays["seed_hi"]),
            step=arrays["step"],
        )
        model = nnx.merge(self._graphdef, state)
        hidden, kv_caches = model(arrays["input_ids"], arrays["positions"], kv_caches, metadata)
        # Only the rows that sample reach the LM head.
        logits = model.compute_logits(hidden[arrays["logits_indices"]])
        token_ids, logprobs = sample(logits, sampling)
        if num_beam_candidates:
            beams = top_logprobs(logits, sampling.temperature, num_beam_candidates)
            return token_ids, logprobs, kv_caches, beams
        return token_ids, logprobs, kv_caches

    def execute_block_ops(self, scheduler_output: SchedulerOutput, block_mover) -> None:
        """Run the step's swap-out, swap-in and copy-on-write block moves, in that order, on the
        KV cache (``jaxpaged.worker.swap.BlockMover``); call before ``execute_model``."""
        self.kv_caches = block_mover.execute(self.kv_caches, scheduler_output)

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, tuple[int, float]]:
        """Run one step; returns ``{seq_id: (token_id, logprob)}`` for sequences that sample."""
        scheduled = scheduler_output.scheduled
        self.beam_candidates = {}
        if not scheduled:
            return {}
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        key = self.bucket_for(scheduler_output.num_batched_tokens, len(scheduled), decode_only)
        num_candidates = getattr(scheduler_output, "num_beam_candidates", 0)
        if num_candidates:
            padded = min(1 << (num_candidates - 1).bit_length(), self.vocab_size)
            key = dataclasses.replace(key, num_beam_candidates=padded)
        layout = _PackedLayout(key.num_tokens, key.num_seqs, self.max_blocks)
        packed = self._prepare_inputs(scheduled, layout)
        executable = self._executables.get(key) or self._compile(key)
        token_ids, logprobs, self.kv_caches, *beams = executable(
            self._state, self.kv_caches, jax.device_put(packed)
        )
        token_ids, logprobs = np.asarray(token_ids), np.asarray(logprobs)
        if beams:
            beam_ids, beam_logprobs = (np.asarray(x) for x in beams[0])
            self.beam_candidates = {
                s.seq.seq_id: (beam_ids[i], beam_logprobs[i])
                for i, s in enumerate(scheduled)
                if s.do_sample
            }
        return {
            s.seq.seq_id: (int(token_ids[i]), float(logprobs[i]))
            for i, s in enumerate(scheduled)
            if s.do_sample
        }

    def _prepare_inputs(self, scheduled, layout: _PackedLayout) -> np.ndarray:
        t_pad, b_pad, bs = layout.num_tokens, layout.num_seqs, self.block_size
        input_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.full(t_pad, -1, np.int32)
        block_tables = np.zeros((b_pad, self.max_blocks), np.int32)
        seq_lens = np.zeros(b_pad, np.int32)
        cu_q_lens = np.zeros(b_pad + 1, np.int32)
        logits_indices = np.zeros(b_pad, np.int32)
        top_k = np.zeros(b_pad, np.int32)
        seed = np.zeros(b_pad, np.uint64)
        step = np.zeros(b_pad, np.int32)
        temperature = np.zeros(b_pad, np.float32)
        top_p = np.ones(b_pad, np.float32)
        min_p = np.zeros(b_pad, np.float32)

        t = 0
        for i, s in enumerate(scheduled):
            start, n = s.num_computed_tokens, s.num_new_tokens
            input_ids[t : t + n] = s.seq.token_ids[start : start + n]
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[t : t + n] = pos
            table = np.asarray(s.block_table, np.int32)
            slot_mapping[t : t + n] = table[pos // bs] * bs + pos % bs
            block_tables[i, : len(table)] = table
            seq_lens[i] = start + n
            t += n
            cu_q_lens[i + 1] = t
            logits_indices[i] = t - 1
            params = s.seq.sampling_params
            temperature[i] = params.effective_temperature
            top_k[i] = params.top_k
            top_p[i] = params.top_p
            min_p[i] = params.min_p
            seed[i] = s.seq.sampling_seed
            step[i] = s.seq.num_output_tokens
        cu_q_lens[len(scheduled) + 1 :] = t

        parts = {
            "input_ids": input_ids,
            "positions": positions,
            "slot_mapping": slot_mapping,
            "block_tables": block_tables.reshape(-1),
            "seq_lens": seq_lens,
            "cu_q_lens": cu_q_lens,
            "logits_indices": logits_indices,
            "top_k": top_k,
            "seed_lo": (seed & 0xFFFFFFFF).astype(np.uint32).view(np.int32),
            "seed_hi": (seed >> 32).astype(np.uint32).view(np.int32),
            "step": step,
            "temperature": temperature.view(np.int32),
            "top_p": top_p.view(np.int32),
            "min_p": min_p.view(np.int32),
        }
        return np.concatenate([parts[name] for name, _ in layout.sections()])
