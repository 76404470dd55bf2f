"""Structured outputs at tensor_parallel_size=2 on two CPU devices (run in a subprocess by
``test_tensor_parallel.py``): the bitmask travels replicated with the packed inputs, so greedy
constrained outputs equal the one-device engine's and validate."""

from __future__ import annotations

import json

import jax
import jsonschema

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from tests.structured_output.schemas import SCHEMAS


def main() -> None:
    assert len(jax.devices()) == 2, jax.devices()
    # Few buckets (compiling them twice dominates the run).
    engine = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16)
    schemas = [SCHEMAS[i] for i in (17, 26, 36)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=60,
            structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True),
        )
        for s in schemas
    ]
    params.append(SamplingParams(temperature=0.0, max_tokens=30))
    prompts = ["Once upon a time"] * len(params)
    tp2 = LLM(**engine, tensor_parallel_size=2).generate(prompts, params, use_tqdm=False)
    tp1 = LLM(**engine).generate(prompts, params, use_tqdm=False)
    for schema, a in zip(schemas, tp2, strict=False):
        assert a.outputs[0].finish_reason == "stop", a.outputs[0].text
        jsonschema.validate(json.loads(a.outputs[0].text), schema)
    for a, b in zip(tp2, tp1, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0], b.outputs[0])
    print("tp=2: constrained greedy outputs validate and equal tp=1's")
    print("ALL OK")


if __name__ == "__main__":
    main()
