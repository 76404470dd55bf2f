"""``StructuredOutputManager``: what the engine calls to constrain requests with grammars.

Life of a constrained request (vLLM v1's ``StructuredOutputManager`` plays the same part):

1. ``add_request`` (engine thread, when the request is added): the budgets are checked
   (``admission.check_budgets``: size, external ``$ref``), then the constraint is queued for
   the compile workers (``compiler.py``; or found in the cache), which check it with the
   backend, compile it against the vocabulary and probe it (``admission.compile_constraint``).
2. Admission (vLLM's ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``): the request enters the
   scheduler only once its grammar is compiled. The engine either waits for it (``wait``:
   ``LLM`` and direct ``add_request`` callers, so that a refused grammar raises there), or
   ``hold``s the request and, between steps, ``take_admitted`` hands over the requests whose
   grammar is ready and those refused (compile error, probe, or past
   ``structured_outputs_config.grammar_compile_timeout_s``): the engine core's way, which never
   waits, acks each add once its verdict is known, so a refusal is still an HTTP 400.
3. ``bitmask_filler`` (right before the segment that samples a step with a constrained row
   launches; ``engine/step_pipeline.py``): every such row's matcher is brought up to date with
   its committed tokens and fills its row of the packed bitmask; other rows allow everything.
4. ``update`` (after each commit): matchers accept the new tokens; a sequence whose token the
   grammar rejected is reported to be aborted; finished requests' state is dropped. A complete
   grammar needs no action: its mask allows only EOS, which stops the request (``stop``) by the
   engine's usual EOS rule, so the text keeps every grammar token and drops only the EOS.
5. ``remove_request`` on abort.

Start-up: the manager's first job imports the backend (xgrammar imports torch: seconds), loads
the tokenizer (the engine core process has none) and compiles a one-token grammar, on a worker,
so the first constrained request does not pay for it and the engine is not held up. The backend
``auto`` resolved to is logged then.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import numpy as np

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sequence import PLACEHOLDER_TOKEN_ID
from jaxpaged.structured_output import admission
from jaxpaged.structured_output.bitmask import ALL_ALLOWED, forbid, num_words
from jaxpaged.structured_output.compiler import GrammarCompiler
from jaxpaged.structured_output.config import StructuredOutputsConfig
from jaxpaged.structured_output.params import StructuredOutputsParams
from jaxpaged.structured_output.request_state import SequenceGrammar

logger = logging.getLogger(__name__)

_PENDING = object()  # no verdict yet


class _RequestGrammar:
    """A request's compilation (a ``compiler.Compilation``) and its sequences' matchers."""

    __slots__ = ("future", "so", "seqs", "group", "start_after", "implicit_ends", "masked")

    def __init__(self, future, so: StructuredOutputsParams):
        self.future = future
        self.so = so
        self.start_after = so.reasoning_end_token_ids
        self.implicit_ends = so.reasoning_implicit_end_token_ids
        self.masked: tuple[int, ...] | None = None  # implicit ends the grammar cannot start with
        self.seqs: dict[str, SequenceGrammar] = {}
        self.group = None  # the SequenceGroup, known once one of its sequences samples


class StructuredOutputManager:
    """Per-request grammars of one engine.

    Args:
        config: the engine's ``StructuredOutputsConfig``.
        load_tokenizer: returns the HF tokenizer (called once, on a compile worker).
        vocab_size: the model's vocabulary size (bitmask width ``ceil(vocab_size / 32)``).
        eos_token_id: the engine's EOS: the one token a completed grammar allows.
        warm_up: start the backend on a worker now (see the module doc).
    """

    def __init__(
        self,
        config: StructuredOutputsConfig,
        load_tokenizer,
        *,
        vocab_size: int,
        eos_token_id: int | None,
        warm_up: bool = True,
    ):
        self.config = config
        self.vocab_size = vocab_size
        self.num_words = num_words(vocab_size)
        self._load_tokenizer = load_tokenizer
        self._eos_token_id = eos_token_id
        self._backend = None
        self._backend_lock = threading.Lock()
        # As vLLM's grammar pool: half the cores (at least 2, so that one slow grammar does
        # not hold up every other); the workers run at a lower priority than the engine.
        self._compiler = GrammarCompiler(
            lambda compiled: self._backend.nbytes(compiled),
            max_workers=max(2, min(8, (os.cpu_count() or 2) // 2)),
            max_bytes=config.grammar_cache_bytes,
        )
        self._requests: dict[str, _RequestGrammar] = {}
        self._held: dict[str, object] = {}  # request id -> SequenceGroup waiting for grammar
        self.warm_up = self._compiler.run(self._warm_up) if warm_up else None

    @property
    def backend(self):
        """The grammar backend (created on a compile worker at start-up, or here)."""
        return self._backend or self._ready_backend()

    def _ready_backend(self):
        with self._backend_lock:
            if self._backend is None:
                cls, reason = _backend_class(self.config.backend)
                self._backend = cls(
                    self._load_tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=None if self._eos_token_id is None else [self._eos_token_id],
                    disable_any_whitespace=self.config.disable_any_whitespace,
                    disable_additional_properties=self.config.disable_additional_properties,
                )
                logger.info(
                    "structured outputs: backend %s (structured_outputs_config.backend %r%s)",
                    cls.name,
                    self.config.backend,
                    reason,
                )
        return self._backend

    def _warm_up(self) -> float:
        started = time.monotonic()
        try:
            self._compile(StructuredOutputsParams(regex="a"))
        except Exception as error:  # the first request reports it, naming the field
            logger.warning(
                "structured outputs: the grammar backend did not start (constrained requests "
                "will be refused with this reason): %s",
                error,
            )
            raise
        seconds = time.monotonic() - started
        logger.info("structured outputs: %s ready in %.1f s", self._backend.name, seconds)
        return seconds

    def _compile(self, so: StructuredOutputsParams):
        return admission.compile_constraint(self._ready_backend(), so)

    @property
    def num_compiled(self) -> int:
        """Grammar compilations submitted so far (cache misses)."""
        return self._compiler.num_compiled

    @property
    def cache_bytes(self) -> int:
        """Bytes of the compiled grammars kept for reuse (``grammar_cache_bytes`` metric)."""
        return self._compiler.cache_bytes

    @property
    def num_compiling(self) -> int:
        """Compile jobs running now (those past their time budget included)."""
        return self._compiler.num_running

    @property
    def num_held(self) -> int:
        """Requests held back until their grammar is compiled (``hold``)."""
        return len(self._held)

    def has_requests(self) -> bool:
        return bool(self._requests)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._requests

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    # --------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, params: SamplingParams) -> None:
        """Check the request's budgets and queue its constraint for compilation (no-op when
        unconstrained); the engine then ``wait``s or ``hold``s.

        Raises:
            SamplingParamsError: (a ``ValueError``) naming the constraint field: larger than
                ``max_grammar_bytes``, or an external ``$ref``.
            GrammarCompilerBusy: too many compilations past their time budget are still
                running (retry later).
        """
        so = params.structured_outputs
        if so is None:
            return
        admission.check_budgets(so, self.config)
        future = self._compiler.submit(so.cache_key, lambda: self._compile(so))
        self._requests[request_id] = _RequestGrammar(future, so)

    def wait(self, request_id: str) -> None:
        """Block until the request's grammar is compiled.

        Raises:
            SamplingParamsError: (a ``ValueError``) the grammar was refused (the request's
                grammar state is dropped): the backend's reason, or past the time budget.
        """
        request = self._requests[request_id]
        future = request.future
        while (verdict := self._verdict(request, time.monotonic())) is _PENDING:
            if future.started is None:  # queued: its clock has not started
                timeout = 0.05
            else:
                timeout = future.started + self.config.grammar_compile_timeout_s
                timeout = max(0.0, timeout - time.monotonic()) + 0.001
            concurrent.futures.wait([future], timeout)
        if verdict is not None:
            self._requests.pop(request_id, None)
            raise verdict

    def hold(self, group) -> None:
        """Keep ``group`` (its request added) out of the scheduler until ``take_admitted``
        hands it over."""
        self._held[group.request_id] = group

    def take_admitted(self) -> list[tuple[object, ValueError | None]]:
        """Held requests whose verdict is known, as ``(group, None)`` (grammar ready: schedule
        it) or ``(group, error)`` (refused; its grammar state is dropped). Never blocks; a
        compilation past the time budget is abandoned here."""
        if not self._held:
            return []
        now, verdicts = time.monotonic(), []
        for request_id, group in list(self._held.items()):
            verdict = self._verdict(self._requests[request_id], now)
            if verdict is _PENDING:
                continue
            del self._held[request_id]
            if verdict is not None:
                del self._requests[request_id]
            verdicts.append((group, verdict))
        return verdicts

    def _verdict(self, request: _RequestGrammar, now: float):
        """None (compiled), the refusal, or ``_PENDING``."""
        future = request.future
        if future.done():
            error = future.exception()
            return None if error is None else admission.refusal(request.so, error)
        budget = self.config.grammar_compile_timeout_s
        if future.started is not None and now - future.started > budget:
            self._compiler.abandon(future)
            return admission.timed_out(request.so, self.config)
        return _PENDING

    def remove_request(self, request_id: str) -> None:
        """Forget an aborted or finished request's grammar state."""
        self._requests.pop(request_id, None)
        self._held.pop(request_id, None)

    def _seq_state(self, seq) -> SequenceGrammar | None:
        request = self._requests.get(seq.group.request_id)
        if request is None:
            return None
        request.group = seq.group
        state = request.seqs.get(seq.seq_id)
        if state is None:
            # Admitted, so compiled (``wait`` / ``take_admitted``): this never waits.
            compiled = request.future.result(timeout=0)
            if request.masked is None:  # once per request: the grammar cannot start with them
                request.masked = tuple(
                    token
                    for token in request.implicit_ends or ()
                    if not self.backend.matcher(compiled).accept_token(token)
                )
            state = request.seqs[seq.seq_id] = SequenceGrammar(
                self.backend.matcher(compiled),
                request.start_after,
                request.implicit_ends,
                request.masked,
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
                if s is None or s.failed:
                    continue  # all allowed (``update`` aborts a failed sequence)
                if not s.active:  # still reasoning: all but the implicit ends it cannot take
                    forbid(out[i], s.masked_while_reasoning)
                    continue
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
            The unfinished sequences whose last token the grammar rejected (the engine aborts
            them).
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
    """``(backend class, why)`` for ``structured_outputs_config.backend``; ``auto`` takes
    xgrammar when it imports (it needs torch), else guidance. Imports the backend's package.
    """
    from jaxpaged.structured_output.backend import XGrammarBackend
    from jaxpaged.structured_output.backend_guidance import GuidanceBackend

    if name == "xgrammar":
        return XGrammarBackend, ""
    if name == "guidance":
        return GuidanceBackend, ""
    try:
        import xgrammar  # noqa: F401
    except Exception as error:  # ImportError, or a broken install (its native library, torch)
        return GuidanceBackend, f": xgrammar does not import ({type(error).__name__}: {error})"
    return XGrammarBackend, ": xgrammar imports"
