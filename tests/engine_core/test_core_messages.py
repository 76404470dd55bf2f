"""Engine-core messages: msgpack frames with numpy arrays as raw bytes, never pickle."""

from __future__ import annotations

import math
import pickle

import msgpack
import numpy as np
import pytest

from jaxpaged.engine.deltas import delta_finished, token_delta
from jaxpaged.engine_core.core_messages import (
    Kind,
    decode,
    decode_output,
    encode,
    params_from_wire,
    params_to_wire,
)
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_core.wire_reference import encode_output


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.uint8, np.float64])
def test_arrays_round_trip_with_dtype_and_shape(dtype):
    array = (np.arange(24) * 3 - 7).astype(dtype).reshape(2, 3, 4)
    kind, payload = decode(encode(Kind.ADD, {"a": array, "empty": np.zeros((0, 5), dtype)}))
    assert kind is Kind.ADD
    assert payload["a"].dtype == array.dtype and payload["a"].shape == (2, 3, 4)
    np.testing.assert_array_equal(payload["a"], array)
    assert payload["empty"].shape == (0, 5)


def test_frames_are_msgpack_not_pickle_and_refuse_objects():
    frame = encode(Kind.ABORT, ["r1", "r2"])
    assert msgpack.unpackb(frame) == ["abort", ["r1", "r2"]]
    with pytest.raises(TypeError, match="pickling"):
        encode(Kind.ADD, np.array([object()], dtype=object))
    with pytest.raises(TypeError, match="cannot encode"):
        encode(Kind.ADD, {1, 2})
    with pytest.raises(ValueError, match="not an engine-core message"):
        decode(pickle.dumps(["add", None]))
    with pytest.raises(ValueError, match="unknown msgpack extension"):
        decode(msgpack.packb(["add", msgpack.ExtType(7, b"x")]))


def test_sampling_params_round_trip_and_are_checked_again():
    params = SamplingParams(
        n=2,
        temperature=0.7,
        top_k=5,
        stop=["\n", "The"],
        stop_token_ids=[3],
        logit_bias={5: 1.5},
        logprobs=2,
        seed=11,
        output_kind=RequestOutputKind.DELTA,
    )
    wire = params_to_wire(params)
    assert decode(encode(Kind.ADD, wire))[1] == wire
    assert params_from_wire(decode(encode(Kind.ADD, wire))[1]) == params
    with pytest.raises(ValueError, match="temperature"):
        params_from_wire({"temperature": -1.0})


def test_request_output_delta_round_trips_without_text():
    output = RequestOutput(
        request_id="cmpl-1-0",
        prompt="hello",
        prompt_token_ids=[1, 2],
        outputs=[
            CompletionOutput(
                index=1,
                text="ignored",
                token_ids=[7, 8],
                cumulative_logprob=-1.25,
                logprobs=[{7: Logprob(-0.5, 1)}, {8: Logprob(-0.75, 2), 9: Logprob(-math.inf, 3)}],
                finish_reason="length",
            )
        ],
        finished=True,
        prompt_logprobs=[None, {2: Logprob(-3.0, 4)}],
        num_cached_tokens=16,
        metrics={"arrival_time": 1.0, "first_token_time": 2.0, "finished_time": 3.5},
    )
    _, (wire,) = decode(encode(Kind.OUTPUTS, [encode_output(output)]))
    delta = decode_output(wire)
    assert (delta.request_id, delta.finished, delta.num_cached_tokens) == ("cmpl-1-0", True, 16)
    assert delta.times == [1.0, 2.0, 3.5]
    (completion,) = delta.completions
    assert completion.text == ""  # text never crosses: the API process detokenizes
    assert completion.token_ids == [7, 8] and completion.index == 1
    assert completion.logprobs == output.outputs[0].logprobs
    assert (completion.cumulative_logprob, completion.finish_reason) == (-1.25, "length")
    assert delta.prompt_logprobs == output.prompt_logprobs


def test_short_delta_is_one_token_for_completion_zero_and_never_finishes():
    (wire,) = decode(encode(Kind.OUTPUTS, [token_delta("cmpl-2-0", 17)]))[1]
    delta = decode_output(wire)
    assert not delta_finished(wire) and not delta.finished
    assert (delta.request_id, delta.times, delta.num_cached_tokens) == ("cmpl-2-0", None, None)
    (completion,) = delta.completions
    assert (completion.index, completion.token_ids, completion.finish_reason) == (0, [17], None)
    assert completion.logprobs is None and completion.cumulative_logprob is None
