"""``StructuredOutputManager``: what the engine calls to constrain requests with grammars.

Life of a constrained request (vLLM v1's ``StructuredOutputManager`` plays the same part):

1. ``add_request`` (engine thread, when the request is added): the constraint is parsed into a
   tokenizer-free grammar, so a bad schema, regex or grammar raises ``ValueError`` naming the
   field before the request enters the scheduler (no blocks taken); then its compilation is
   submitted to the thread pool (or found in the cache).
2. ``bitmask_filler`` (right before the segment that samples a step with a constrained row
   launches; ``engine/step_pipeline.py``): every such row's matcher is brought up to date with
   its committed tokens and fills its row of the bitmask; other rows allow everything. A
   grammar still compiling is waited for here. (``grammar_bitmask`` returns the same rows as
   an array, for tests and tools.)
3. ``update`` (after each commit): matchers accept the new tokens; a sequence whose token the
   grammar rejected is reported to be aborted; finished requests' state is dropped. A complete
   grammar needs no action: its mask allows only EOS, which stops the request (``stop``) by the
   engine's usual EOS rule, so the text keeps every grammar token and drops only the EOS.
4. ``remove_request`` on abort.

The tokenizer is loaded on the first compilation (the engine core process has none), on the
compile thread.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sequence import PLACEHOLDER_TOKEN_ID
from jaxpaged.structured_output.bitmask import ALL_ALLOWED, num_words
from jaxpaged.structured_output.compiler import GrammarCompiler
from jaxpaged.structured_output.config import StructuredOutputsConfig
from jaxpaged.structured_output.request_state import SequenceGrammar

logger = logging.getLogger(__name__)


class _RequestGrammar:
    """A request's compiled grammar (a future) and its sequences' matchers."""

    __slots__ = ("future", "seqs", "error", "group", "start_after")

    def __init__(self, future, start_after: list[int] | None = None):
        self.future = future
        self.start_after = start_after  # StructuredOutputsParams.reasoning_end_token_ids
        self.seqs: dict[str, SequenceGrammar] = {}
        self.error: str | None = None
        self.group = None  # the SequenceGroup, known once one of its sequences samples


class StructuredOutputManager:
    """Per-request grammars of one engine.

    Args:
        config: the engine's ``StructuredOutputsConfig``.
        load_tokenizer: returns the HF tokenizer (called once, on the compile thread).
        vocab_size: the model's vocabulary size (bitmask width ``ceil(vocab_size / 32)``).
        eos_token_id: the engine's EOS: the one token a completed grammar allows.
    """

    def __init__(
        self,
        config: StructuredOutputsConfig,
        load_tokenizer,
        *,
        vocab_size: int,
        eos_token_id: int | None,
    ):
        self.config = config
        self.vocab_size = vocab_size
        self.num_words = num_words(vocab_size)
        self._load_tokenizer = load_tokenizer
        self._eos_token_id = eos_token_id
        self._backend = None
        self._compiler: GrammarCompiler | None = None
        self._requests: dict[str, _RequestGrammar] = {}

    @property
    def backend(self):
        """The grammar backend, created (and xgrammar imported) on first use."""
        if self._backend is None:
            self._backend = _backend_class(self.config.backend)(
                self._load_tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=None if self._eos_token_id is None else [self._eos_token_id],
                disable_any_whitespace=self.config.disable_any_whitespace,
                disable_additional_properties=self.config.disable_additional_properties,
            )
            self._compiler = GrammarCompiler(self._backend.compile)
        return self._backend

    @property
    def num_compiled(self) -> int:
        """Grammar compilations submitted so far (cache misses)."""
        return 0 if self._compiler is None else self._compiler.num_compiled

    def has_requests(self) -> bool:
        return bool(self._requests)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._requests

    # --------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, params: SamplingParams) -> None:
        """Check the request's constraint and start compiling it (no-op when unconstrained).

        Raises:
            SamplingParamsError: (a ``ValueError``) naming the constraint field when the
                backend cannot parse it or does not support it.
        """
        so = params.structured_outputs
        if so is None:
            return
        grammar = self.backend.check(so)
        self._requests[request_id] = _RequestGrammar(
            self._compiler.submit(so.cache_key, grammar), so.reasoning_end_token_ids
        )

    def remove_request(self, request_id: str) -> None:
        """Forget an aborted or finished request's grammar state."""
        self._requests.pop(request_id, None)

    def _seq_state(self, seq) -> SequenceGrammar | None:
        request = self._requests.get(seq.group.request_id)
        if request is None or request.error is not None:
            return None
        request.group = seq.group
        state = request.seqs.get(seq.seq_id)
        if state is None:
            try:  # compiled on the pool since add_request; waits if it is still compiling
                compiled = request.future.result()
            except Exception as error:  # validated at add; a compile failure is a backend bug
                logger.error("grammar of request %s failed to compile: %s", seq.seq_id, error)
                request.error = str(error)
                return None
            state = request.seqs[seq.seq_id] = SequenceGrammar(
                self.backend.matcher(compiled), request.start_after
            )
        state.sync(seq.output_token_ids)
        return state

    # ------------------------------------------------------------------------------ steps
    def grammar_bitmask(self, scheduled) -> np.ndarray | None:
        """The step's bitmask rows, i32[len(scheduled), W] in ``scheduled`` order (all ones for
        rows that are unconstrained, do not sample, or finished), or None when no row samples
        under a grammar. (Tests and tools; the engine uses ``bitmask_filler``.)"""
        fill = self.bitmask_filler(scheduled)
        if fill is None:
            return None
        bitmask = np.full((len(scheduled), self.num_words), ALL_ALLOWED, np.int32)
        fill(bitmask)
        return bitmask

    def bitmask_filler(self, scheduled):
        """None when no row of ``scheduled`` samples under a grammar; else ``fill(out)``, which
        writes the constrained rows of ``out`` (i32[>= len(scheduled), W], already all ones:
        the model runner's packed buffer) in ``scheduled`` order, bringing their matchers up
        to date with the committed tokens first."""
        if not self._requests:
            return None
        rows = [
            i
            for i, s in enumerate(scheduled)
            if s.do_sample and s.seq.group.request_id in self._requests and not s.seq.is_finished
        ]
        if not rows:
            return None

        def fill(out: np.ndarray) -> None:
            states = [(i, self._seq_state(scheduled[i].seq)) for i in rows]
            live = []
            for i, s in states:
                if s is None or s.failed or not s.active:
                    continue  # all allowed (``update`` aborts a failed sequence; an inactive
                    # one is still reasoning)
                if s.is_terminated:
                    # Complete (guidance) or past EOS (xgrammar with ignore_eos): only EOS.
                    out[i] = 0
                    if self._eos_token_id is not None:
                        word = np.array([1 << (self._eos_token_id % 32)], np.uint32)
                        out[i, self._eos_token_id // 32] = word.view(np.int32)[0]
                else:
                    live.append((i, s))
            if live:
                self.backend.fill_bitmask([s.matcher for _, s in live], out, [i for i, _ in live])

        return fill

    def needs_bitmask(self, scheduled) -> bool:
        """Whether some row of ``scheduled`` samples under a grammar (such a step needs its
        rows' previous tokens on the host: the engine runs it synchronously)."""
        return bool(self._requests) and any(
            s.do_sample and s.seq.group.request_id in self._requests for s in scheduled
        )

    def update(self, seqs) -> list:
        """Advance the matchers of ``seqs`` (just committed) and drop finished requests.

        Returns:
            The unfinished sequences whose last token the grammar rejected or whose grammar
            failed to compile (the engine aborts them).
        """
        rejected, pending = [], []
        if not self._requests:
            return rejected
        # Requests finished outside the commit (stop strings, found by the detokenizer).
        done = [rid for rid, r in self._requests.items() if r.group and r.group.is_finished]
        for request_id in done:
            del self._requests[request_id]
        for seq in seqs:
            request_id = seq.group.request_id
            request = self._requests.get(request_id)
            if request is None:
                continue
            if seq.group.is_finished:
                self._requests.pop(request_id, None)
                continue
            if seq.is_finished:
                request.seqs.pop(seq.seq_id, None)
                continue
            if request.error is not None:
                rejected.append(seq)
                continue
            state = request.seqs.get(seq.seq_id)
            if state is None:
                continue  # not sampled under the grammar yet
            pending.append((seq, state))
        self._sync(pending)
        rejected += [seq for seq, state in pending if state.failed]
        return rejected

    def _sync(self, pending: list) -> None:
        """Bring matchers up to date: one batched call for the usual one new token each."""
        one = [
            (seq, state)
            for seq, state in pending
            if state.num_behind(seq.output_token_ids) == 1 and not state.matcher.is_terminated()
        ]
        if one:
            tokens = [seq.output_token_ids[-1] for seq, _ in one]
            if PLACEHOLDER_TOKEN_ID not in tokens:
                accepted = self.backend.accept_tokens([s.matcher for _, s in one], tokens)
                for (_, state), ok in zip(one, accepted, strict=True):
                    state.accepted(ok)
        for seq, state in pending:
            state.sync(seq.output_token_ids)

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()


def _backend_class(name: str):
    """The backend class of ``structured_outputs_config.backend``; ``auto`` takes xgrammar
    when it imports (it needs torch), else guidance.

    Raises:
        ValueError: the chosen backend's package is not installed (naming it).
    """
    from jaxpaged.structured_output.backend import XGrammarBackend
    from jaxpaged.structured_output.backend_guidance import GuidanceBackend

    if name == "xgrammar":
        return XGrammarBackend
    if name == "guidance":
        return GuidanceBackend
    try:
        import xgrammar  # noqa: F401
    except Exception:  # ImportError, or a broken install (its native library, torch)
        return GuidanceBackend
    return XGrammarBackend
