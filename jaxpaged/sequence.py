"""One request's tokens, counters and status (host only; no JAX).

A `Sequence` is what the scheduler queues, the KV cache manager keys block tables by, and the model
runner reads token ids from. Token regions, as vLLM v1 draws them for a `Request`:

    |<------------------------- num_tokens -------------------------->|
    |<------ num_prompt_tokens ------>|<----- num_output_tokens ----->|
    |<-- num_computed_tokens -->|<------- not yet computed ---------->|

`num_computed_tokens` counts the tokens whose K/V sit in the paged cache. Right after a token is
sampled it is the only uncomputed token: the next step feeds it to the model (a decode). Recompute
preemption sets `num_computed_tokens` back to 0, so the prompt *and* the generated tokens are
prefilled again before the next token is sampled; swap preemption keeps it (the K/V wait in host
memory).

A `SequenceGroup` is one request: a single sequence, or the `best_of` samples (vLLM's parallel
sampling) or `beam_width` beams that fork from its prompt and share its KV blocks.
"""

from __future__ import annotations

import copy
import enum
import time
from collections.abc import Sequence as SequenceABC


class EngineSleepingError(RuntimeError):
    """A request reached an engine whose memory ``sleep`` freed (``wake_up`` first; after
    ``sleep(level=2)`` also ``update_weights``); the server answers it like a refused prompt."""


EMPTY_PROMPT = "The decoder prompt cannot be empty"
"""vLLM's refusal of a prompt of no tokens (``vllm/v1/engine/input_processor.py``)."""


class PromptError(ValueError):
    """A prompt the engine cannot take (empty, ids that are not integers or lie outside the
    vocabulary, too long for ``max_model_len`` or the KV cache); ``parameter`` names the request
    field (HTTP 400)."""

    parameter = "prompt"


def check_prompt_text(text: str) -> None:
    """Refuse a prompt string no UTF-8 can encode (a lone surrogate such as ``"\\ud800"``),
    in the words the server's 400 uses.

    Raises:
        PromptError: naming the code point and its position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise PromptError(
            f"prompt holds a lone surrogate U+{code:04X} at character {error.start}, which is "
            "not valid Unicode"
        ) from None


def is_token_id_list(ids) -> bool:
    """True when ``ids`` is a sequence of Python ints (bools are not token ids).

    The usual list of exact ints is recognised in one C-level pass over the element types
    (a request's admission cost: the served core adds thousands a second); int subclasses
    other than bool take the element-by-element path.
    """
    if not isinstance(ids, SequenceABC):
        return False
    types = set(map(type, ids))
    if types <= {int}:
        return True
    return bool not in types and all(isinstance(t, int) for t in ids)


def check_prompt_vocab(ids: list[int], vocab_size: int) -> None:
    """Refuse prompt token ids outside ``[0, vocab_size)``.

    Args:
        ids: the prompt's token ids (Python ints, any size: a JSON body may hold ``2**70``).
        vocab_size: the model's vocabulary size.

    Raises:
        PromptError: naming the first id outside the vocabulary.
    """
    if ids and 0 <= min(ids) and max(ids) < vocab_size:  # two C-level passes, the usual case
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise PromptError(  # "out of vocabulary": vLLM's words, which clients match
            f"prompt token id {bad[0]} is out of vocabulary: outside the vocabulary "
            f"[0, {vocab_size})"
        )


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence; the three FINISHED_* states are terminal (vLLM's names)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted by swap: its K/V sit in host blocks
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Could never fit in the KV cache (a multi-sequence group that outgrew it): vLLM v0's name.
    FINISHED_IGNORED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self._is_finished


# vLLM's `CompletionOutput.finish_reason` strings.
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}
# Stored on each member because testing membership hashes the enum in Python (enum.__hash__),
# and the engine asks every sequence of the batch several times per step.
for _status in SequenceStatus:
    _status._is_finished = _status in _FINISH_REASONS
del _status


class Sequence:
    """One request: its prompt, the tokens generated so far and the scheduling counters.

    `sampling_params` is read by duck typing: `max_tokens` (None = up to max_model_len),
    `ignore_eos`, `stop_token_ids` (list or None) and `min_tokens` (0 when absent).

    Invariant: `token_ids == prompt_token_ids + output_token_ids` and
    `0 <= num_computed_tokens <= num_tokens`. All three lists only grow at the end, by
    `append_token`, so they are kept side by side instead of being rebuilt on access.
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        sampling_params,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        block_hash_extra_keys: tuple = (),
        lora_request=None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"prompt of sequence {seq_id!r} must have at least 1 token, got 0")
        self.seq_id = seq_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Prompt + outputs in one list so the model runner can slice any token range cheaply.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens served by the prefix cache at first admission (RequestOutput.num_cached_tokens).
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # The stop token id (or, set by the engine, the stop string) that ended the sequence.
        self.stop_reason: int | str | None = None
        # Prefix caching must not serve this sequence's prompt from cached blocks: prompt
        # logprobs need the logits of every prompt position (vLLM's skip_reading_prefix_cache).
        self.skip_prefix_cache = bool(getattr(sampling_params, "skip_reading_prefix_cache", False))
        # Seed of this sequence's sampling stream (the engine sets it; forks derive their own).
        self.sampling_seed = 0
        # Sum of the sampled tokens' log-probabilities (best_of ranking, beam scores).
        self.cumulative_logprob = 0.0
        # Prefix caching: keys mixed into every block hash besides the tokens (e.g. a LoRA id),
        # and the hashes of the full blocks of token_ids computed so far (append-only, like them).
        self.block_hash_extra_keys = tuple(block_hash_extra_keys)
        # The LoRA adapter (``jaxpaged.lora.request.LoRARequest``) it runs with; None = base
        # model. Forks share it. The scheduler reads ``lora_int_id`` (``max_loras`` per step).
        self.lora_request = lora_request
        self.block_hashes: list[bytes] = []
        # Beam search: the top candidates' {token_id: logprob} at each generated position.
        self.beam_logprobs: list[dict[int, float]] = []
        # The group (request) this sequence belongs to; set by SequenceGroup.
        self.group: SequenceGroup | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (vLLM's convention)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids: the live list, not a copy (read it, don't mutate it)."""
        return self.token_ids

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not in the cache yet (at least 1 for an unfinished sequence)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True unless the sequence is decoding.

        Decoding means exactly one token lacks K/V and it is a sampled one:
        `num_output_tokens > 0 and num_computed_tokens == num_tokens - 1`. Everything else is a
        prefill: a new prompt (even a 1-token one), a prompt part-way through chunked prefill, or
        a recomputed sequence re-prefilling its prompt and outputs.
        """
        return not self.output_token_ids or self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status._is_finished

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish reason once finished: `"stop"`, `"length"` or `"abort"`; else None."""
        return _FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        """Record a sampled token; its K/V are computed by the next step that schedules it."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def replace_last_token(self, token_id: int) -> None:
        """Write the real id over the ``PLACEHOLDER_TOKEN_ID`` that async scheduling appended
        while the token was still on the device."""
        self.token_ids[-1] = token_id
        self.output_token_ids[-1] = token_id

    def drop_placeholder(self) -> bool:
        """Remove a trailing ``PLACEHOLDER_TOKEN_ID`` (an aborted sequence's token that never
        reached the host); True if there was one."""
        if not self.output_token_ids or self.output_token_ids[-1] != PLACEHOLDER_TOKEN_ID:
            return False
        self.token_ids.pop()
        self.output_token_ids.pop()
        return True

    def stop_status(self, max_model_len: int) -> SequenceStatus | None:
        """The status this sequence finishes with after its last token (vLLM's stop checks, in
        order), or None; sets ``stop_reason`` for a stop token. Does not finish it."""
        params = self.sampling_params
        last = self.last_token_id
        num_output_tokens = self.num_output_tokens
        # EOS and stop tokens only count after min_tokens (the sampler masks them before that).
        if num_output_tokens >= (getattr(params, "min_tokens", 0) or 0):
            if not params.ignore_eos and last == self.eos_token_id:
                return SequenceStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                self.stop_reason = last
                return SequenceStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if max_tokens is not None and num_output_tokens >= max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def fork(self, seq_id: str) -> Sequence:
        """A copy with its own token lists, counters and id, in the same group.

        The copy's KV blocks are the caller's business (`KVCacheManager.fork` shares the
        parent's table); the prompt list is shared because nothing ever mutates it.
        """
        child = copy.copy(self)
        child.seq_id = seq_id
        child.output_token_ids = list(self.output_token_ids)
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        child.beam_logprobs = list(self.beam_logprobs)
        return child


# Async scheduling commits a dispatched step before its tokens reach the host: each sampled
# token is appended as this id and replaced once read back (``engine/async_scheduling.py``).
PLACEHOLDER_TOKEN_ID = -1


def derive_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `seed`, in [0, 2**63).

    Index 0 keeps the request's seed, so `n=1` and the first of `n` samples draw the same tokens;
    other indices mix (seed, index) with SplitMix64's finalizer (Steele et al., 2014), which
    spreads neighbouring inputs over the whole range.
    """
    if index == 0:
        return seed
    mask = 2**64 - 1
    z = (seed + index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


class SequenceGroup:
    """One request and the sequences it samples (vLLM v0's `SequenceGroup`).

    Three kinds, all starting from one sequence holding the prompt (`seqs[0]`, whose id is the
    request id):
      - a single sample (`best_of == 1`, no beams);
      - parallel sampling (`best_of > 1`): the prompt is computed once, up to its last token,
        then the group forks into `best_of` sequences sharing those blocks (copy-on-write), each
        with its own seed stream (`derive_seed`); `n <= best_of` of them are returned;
      - beam search (`beam_width >= 1`): after every step the best `beam_width` continuations
        among the beams' top candidates survive, forking beams that several of them extend.
    Sequences of a multi-sequence group sample in the same step (the scheduler keeps them in
    step), so that beams can be compared and forks share one prompt computation.
    """

    def __init__(
        self,
        request_id: str,
        seq: Sequence,
        *,
        best_of: int = 1,
        beam_width: int = 0,
        beam_params=None,
    ) -> None:
        if seq.seq_id != request_id:
            raise ValueError(f"the first sequence's id must be the request id {request_id!r}")
        if best_of < 1 or beam_width < 0 or (beam_width and best_of != 1):
            raise ValueError(
                f"need best_of >= 1 and beam_width >= 0, not both above 1; got {best_of=} "
                f"{beam_width=}"
            )
        self.request_id = request_id
        self.seqs: list[Sequence] = [seq]
        seq.group = self
        self.best_of = best_of
        self.beam_width = beam_width
        # Duck-typed beam parameters (beam_width, max_tokens, ignore_eos, length_penalty).
        self.beam_params = beam_params
        # Parallel sampling forks once, when the prompt is computed up to its last token.
        self.forked = best_of == 1
        # Beams that ended with EOS, kept until the group finishes (vLLM's `completed` list).
        self.completed_beams: list[Sequence] = []
        self.arrival_time = seq.arrival_time
        self.num_cached_tokens: int | None = None  # set at first admission
        self.first_scheduled_time: float | None = None  # time.monotonic() at first admission
        self._num_children = 0

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id!r}, seqs={self.seqs!r})"

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 0

    @property
    def sampling_params(self):
        return self.seqs[0].sampling_params

    @property
    def unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.status._is_finished]

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, without all()'s generator
            return seqs[0].status._is_finished
        return all(seq.status._is_finished for seq in seqs)

    @property
    def num_seats(self) -> int:
        """Running sequences this group may need at once (counted against `max_num_seqs`)."""
        if self.is_beam_search:
            return self.beam_width
        if not self.forked:
            return self.best_of
        return len(self.unfinished_seqs)

    @property
    def needs_fork(self) -> bool:
        """True when parallel sampling should fork now: all but the last prompt token computed."""
        parent = self.seqs[0]
        return not self.forked and parent.num_computed_tokens == parent.num_prompt_tokens - 1

    def new_child_id(self) -> str:
        """An id for the next forked sequence; unique among this group's sequences."""
        self._num_children += 1
        return f"{self.request_id}#{self._num_children}"
