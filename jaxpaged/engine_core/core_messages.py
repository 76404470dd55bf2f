"""What the API process and the engine-core process say to each other, and how it is encoded.

vLLM v1's split (``vllm/v1/engine/__init__.py``, ``serial_utils.py``): requests reach the core
already tokenized, and outputs leave it as token ids, logprobs and finish reasons; text never
crosses. Every message is one msgpack frame, ``[kind, payload]``. numpy arrays travel as a
msgpack extension (type ``NDARRAY_EXT``) holding ``[dtype.str, shape, raw bytes]``; nothing is
pickled, so a peer can only ever send data, never code.

API process -> core (``INPUT_*`` kinds); ``client_index`` is the sending API process's index
among the core's clients (vLLM's ``EngineCoreRequest.client_index``; 0 with one API process):

- ``add``: ``[request_id, prompt_token_ids i32[P], sampling params dict, arrival_time,
  lora, client_index]`` (``EngineCoreRequest``; ``arrival_time`` is ``time.monotonic()``, one
  clock per host; ``lora`` is None for the base model, else ``[lora_name, lora_int_id,
  lora_path]``, ``lora_to_wire``).
- ``abort``: ``[client_index, [request_id, ...]]`` (only that client's requests are touched).
- ``utility``: ``[client_index, call_id, method name, args list]`` (answered by an ``utility``
  output to that client).
- ``shutdown``: ``None`` (from the process that started the core).

Core -> API process (``OUTPUT_*`` kinds), on the client's own output socket:

- ``acks``: ``[[request_id, None | [error class name, message, parameter]], ...]`` for every
  ``add`` of this client applied before a step; an error means the request never entered the
  engine.
- ``outputs``: ``[[delta, ...], stats dict]`` after each step (client 0: every step; another
  client: steps with news for it), one delta per request of this client that advanced or
  finished, carrying only what is new (DELTA; FINAL_ONLY for ``best_of > n`` and beam search:
  the ranked completions, once). The deltas are the engine's own token deltas, sent as they
  are: full or short, in the layouts of ``jaxpaged.engine.deltas`` (``LLMEngine.step(
  token_deltas=True)`` builds them straight from the sequences: no ``RequestOutput``, no
  text); ``decode_output`` reads both forms. ``stats`` is
  ``LLMEngine.get_stats()`` as a dict plus ``num_steps``, ``num_unfinished_requests``,
  ``num_free_blocks``, ``step_start`` (``time.monotonic()`` when the step began) and
  ``scheduled`` (this client's ids that entered the running batch this step), and with LoRA
  ``max_loras``, ``running_lora_adapters`` and ``waiting_lora_adapters``
  (``jaxpaged.lora.metrics.lora_stats``).
- ``stats``: the ``stats`` dict of ``outputs`` without ``step_start`` and ``scheduled``, to
  client 0 only, when aborts leave the core with nothing to step (no step follows to carry
  the engine's state, so the API process's gauges would keep the last step's values).
- ``utility``: ``[call_id, result, error message or None]``.
- ``heartbeat``: ``None``, every ``HEARTBEAT_INTERVAL_S`` from a thread of the core process.
- ``dead``: ``error message``: the loop died on an exception; the process exits after it.
"""

from __future__ import annotations

import dataclasses
import enum

import msgpack
import numpy as np

from jaxpaged.beam_search import BeamSearchParams
from jaxpaged.core.stats import SchedulerStats
from jaxpaged.lora.request import LoRARequest
from jaxpaged.outputs import CompletionOutput, Logprob
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

NDARRAY_EXT = 1
HEARTBEAT_INTERVAL_S = 0.5


class Kind(enum.StrEnum):
    """The first element of every message."""

    ADD = "add"
    ABORT = "abort"
    UTILITY = "utility"
    SHUTDOWN = "shutdown"
    ACKS = "acks"
    OUTPUTS = "outputs"
    STATS = "stats"
    HEARTBEAT = "heartbeat"
    DEAD = "dead"


def _default(obj):
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise TypeError("object arrays cannot be sent (they would need pickling)")
        array = np.ascontiguousarray(obj)
        return msgpack.ExtType(
            NDARRAY_EXT, msgpack.packb([array.dtype.str, list(array.shape), array.tobytes()])
        )
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} in an engine-core message")


def _ext_hook(code: int, data: bytes):
    if code != NDARRAY_EXT:
        raise ValueError(f"unknown msgpack extension type {code} in an engine-core message")
    dtype, shape, raw = msgpack.unpackb(data)
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)


def encode(kind: Kind, payload) -> bytes:
    """One message as msgpack bytes.

    Raises:
        TypeError: ``payload`` holds something that is not plain data or a numpy array.
    """
    return msgpack.packb([str(kind), payload], default=_default, use_bin_type=True)


def decode(frame: bytes) -> tuple[Kind, object]:
    """``(kind, payload)`` of a frame; arrays come back read-only (they view the frame).

    Raises:
        ValueError: the frame is not a message of this protocol.
    """
    try:
        kind, payload = msgpack.unpackb(frame, ext_hook=_ext_hook, strict_map_key=False)
        return Kind(kind), payload
    except (msgpack.UnpackException, ValueError, TypeError) as error:
        raise ValueError(f"not an engine-core message: {error}") from error


# ------------------------------------------------------------------------- sampling params
def params_to_wire(params: SamplingParams | BeamSearchParams) -> dict:
    """The fields of ``params`` as a dict (only those that differ from the defaults); a beam
    search is ``{"beam_search": its fields}``."""
    if isinstance(params, BeamSearchParams):
        return {"beam_search": dataclasses.asdict(params)}
    out = {}
    for field in dataclasses.fields(SamplingParams):
        value = getattr(params, field.name)
        if value == field.default:
            continue
        if isinstance(value, RequestOutputKind):
            value = value.name
        elif isinstance(value, StructuredOutputsParams):
            value = value.to_wire()  # a dict; SamplingParams converts it back
        out[field.name] = value
    return out


def params_from_wire(values: dict) -> SamplingParams | BeamSearchParams:
    """Rebuild (and so re-validate) the ``SamplingParams`` (or ``BeamSearchParams``) of
    ``params_to_wire``.

    Raises:
        SamplingParamsError: a field out of range (the constructor's checks).
    """
    if "beam_search" in values:
        return BeamSearchParams(**values["beam_search"])
    values = dict(values)
    if "output_kind" in values:
        values["output_kind"] = RequestOutputKind[values["output_kind"]]
    # Resolved by the API process, which has the tokenizer (the core has none).
    bad_words_token_ids = values.pop("bad_words_token_ids", None)
    params = SamplingParams(**values)
    params.bad_words_token_ids = bad_words_token_ids
    return params


# ----------------------------------------------------------------------------------- LoRA
def lora_to_wire(request: LoRARequest | None) -> list | None:
    """``[lora_name, lora_int_id, lora_path]`` of an adapter, None for the base model."""
    if request is None:
        return None
    return [request.lora_name, request.lora_int_id, request.lora_path]


def lora_from_wire(wire: list | None) -> LoRARequest | None:
    """The ``LoRARequest`` of ``lora_to_wire`` (re-validated by its constructor).

    Raises:
        ValueError: a malformed entry, or one ``LoRARequest`` refuses.
    """
    if wire is None:
        return None
    if not isinstance(wire, (list, tuple)) or len(wire) != 3:
        raise ValueError(f"a LoRA request travels as [name, int id, path], got {wire!r}")
    name, lora_int_id, path = wire
    return LoRARequest(name, int(lora_int_id), path)


# --------------------------------------------------------------------------------- outputs
def _logprobs_from_wire(steps):
    """``{token_id: Logprob}`` or None per position of ``deltas.logprobs_delta``'s form."""
    if steps is None:
        return None
    return [
        None if step is None else {t: Logprob(logprob=lp, rank=rank) for t, lp, rank in step}
        for step in steps
    ]


@dataclasses.dataclass
class EngineCoreOutput:
    """One request's delta from one step, as the API process receives it (text-free)."""

    request_id: str
    finished: bool
    num_cached_tokens: int | None  # None: unchanged since the request's previous delta
    # [arrival_time, first_token_time, finished_time], time.monotonic() or None each; the
    # whole list is None when unchanged since the previous delta (a short delta).
    times: list | None
    completions: list[CompletionOutput]  # text "", token_ids and logprobs are the new ones
    prompt_logprobs: list | None


def decode_output(wire: list) -> EngineCoreOutput:
    """The ``EngineCoreOutput`` of a full (``deltas.request_delta``) or short
    (``deltas.token_delta``) delta."""
    if len(wire) == 2:
        request_id, token_id = wire
        return EngineCoreOutput(
            request_id=request_id,
            finished=False,
            num_cached_tokens=None,
            times=None,
            completions=[CompletionOutput(index=0, text="", token_ids=[token_id])],
            prompt_logprobs=None,
        )
    request_id, finished, num_cached, times, completions, prompt_logprobs = wire
    return EngineCoreOutput(
        request_id=request_id,
        finished=finished,
        num_cached_tokens=num_cached,
        times=times,
        completions=[
            CompletionOutput(
                index=index,
                text="",
                token_ids=list(token_ids),
                cumulative_logprob=cumulative,
                logprobs=_logprobs_from_wire(logprobs),
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
            for index, token_ids, cumulative, logprobs, finish_reason, stop_reason in completions
        ],
        prompt_logprobs=_logprobs_from_wire(prompt_logprobs),
    )


_STATS_FIELDS = tuple(field.name for field in dataclasses.fields(SchedulerStats))


def scheduler_stats(stats: dict) -> SchedulerStats:
    """The ``SchedulerStats`` inside a core's ``stats`` dict (which carries extra keys, such as
    ``scheduled`` and ``step_start``, beside the dataclass's fields)."""
    return SchedulerStats(**{name: stats[name] for name in _STATS_FIELDS})
