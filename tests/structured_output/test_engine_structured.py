"""Structured outputs end to end on stories260k (a model that never writes valid JSON unaided).

Every constrained output must parse and validate (``jsonschema``), match its regex or be one of
its choices, and finish with ``stop``; unconstrained requests in the same batch must produce
the tokens they produce alone. JSON requests use ``disable_any_whitespace``: with free
whitespace the tiny model writes newlines until ``max_tokens``.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from jaxpaged.sampling_params import SamplingParamsError
from tests.structured_output.conftest import ENGINE
from tests.structured_output.schemas import SCHEMAS

pytest.importorskip("xgrammar")

PROMPT = "Once upon a time"
MAX_TOKENS = 120
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER

REGEXES = [
    r"[a-c]{3}-\d{2}",
    r"(yes|no|maybe)",
    r"\d{1,3}(\.\d{1,2})?",
    r"[A-Z][a-z]{1,5} [A-Z][a-z]{1,5}",
    r"(ab){1,3}c",
    r"0x[0-9a-f]{4}",
    r"\w{2,6}@\w{2,6}\.(com|org)",
]
CHOICES = [["yes", "no"], ["red", "green", "blue"], ["Lily", "Tom", "a long answer"], ['q"uote']]


def _has_number(schema) -> bool:
    return '"number"' in json.dumps(schema)


def _json_params(
    schema, temperature: float, seed: int, disable_additional_properties=False, **kw
) -> SamplingParams:
    so = StructuredOutputsParams(
        json=schema,
        disable_any_whitespace=True,
        disable_additional_properties=disable_additional_properties,
    )
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=so, **kw
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_json_schema_output_parses_and_validates(llm, temperature):
    assert len(SCHEMAS) >= 50
    params = [_json_params(s, temperature, i) for i, s in enumerate(SCHEMAS)]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert llm.llm_engine.structured_output.backend.name == "xgrammar"
    for schema, out in zip(SCHEMAS, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema, format_checker=FORMATS)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_json_schema_output_validates_with_the_guidance_backend(guidance_llm, temperature):
    # llguidance leaves a number's fraction digits unbounded (the tiny model writes zeros
    # until max_tokens) and allows properties a schema does not name unless told otherwise.
    schemas = [s for s in SCHEMAS if not _has_number(s)]
    assert len(schemas) >= 50
    params = [
        _json_params(s, temperature, i, disable_additional_properties=True)
        for i, s in enumerate(schemas)
    ]
    outputs = guidance_llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert guidance_llm.llm_engine.structured_output.backend.name == "guidance"
    for schema, out in zip(schemas, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema, format_checker=FORMATS)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice_outputs_match(request, backend, temperature):
    llm = request.getfixturevalue("llm" if backend == "xgrammar" else "guidance_llm")
    params = [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(regex=rx),
        )
        for i, rx in enumerate(REGEXES)
    ] + [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(choice=choice),
        )
        for i, choice in enumerate(CHOICES)
    ]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for rx, out in zip(REGEXES, outputs, strict=False):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert re.fullmatch(rx, out.outputs[0].text), (rx, out.outputs[0].text)
    for choice, out in zip(CHOICES, outputs[len(REGEXES) :], strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert out.outputs[0].text in choice


def test_date_format_has_the_date_shape(llm):
    # xgrammar's date grammar bounds month and day digits but not the calendar (see schemas.py).
    params = [_json_params({"type": "string", "format": "date"}, 1.0, s) for s in range(4)]
    for out in llm.generate([PROMPT] * 4, params, use_tqdm=False):
        assert re.fullmatch(r'"\d{4}-[01]\d-[0-3]\d"', out.outputs[0].text), out.outputs[0].text


def test_ebnf_grammar_and_json_object(llm):
    grammar = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-z] | [0-9]'
    params = [
        SamplingParams(
            temperature=t,
            seed=1,
            max_tokens=60,
            structured_outputs=StructuredOutputsParams(grammar=grammar),
        )
        for t in (0.0, 1.0)
    ] + [
        SamplingParams(
            temperature=t,
            seed=2,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(
                json_object=True, disable_any_whitespace=True
            ),
        )
        for t in (0.0, 1.0)
    ]
    outputs = llm.generate([PROMPT] * 4, params, use_tqdm=False)
    for out in outputs[:2]:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(r"\([a-z0-9](,[a-z0-9]){0,2}\)", out.outputs[0].text), out.outputs[
            0
        ].text
    for out in outputs[2:]:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text), dict)
        else:  # an object may nest deeper than max_tokens allows; it is still an object so far
            assert out.outputs[0].text.startswith("{")


def test_unconstrained_rows_keep_their_tokens_beside_constrained_ones(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(seed=5, max_tokens=30)]
    prompts = ["Once upon a time", "The cat"]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed_params = [plain[0], _json_params(SCHEMAS[17], 0.0, 0), plain[1]]
    mixed_params.append(_json_params(SCHEMAS[20], 1.0, 3))
    mixed = llm.generate(
        prompts[:1] + [PROMPT] + prompts[1:] + [PROMPT], mixed_params, use_tqdm=False
    )
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids


def test_max_tokens_mid_structure_finishes_with_length(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    params = _json_params(schema, 0.0, 0)
    params.max_tokens = 3
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].text.startswith("{")


def test_n_samples_each_follow_the_grammar(llm):
    params = _json_params(SCHEMAS[17], 1.0, 11)
    params.n = 4
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMAS[17])


def test_prefix_cache_hit_gives_the_same_constrained_output(llm):
    prompt = "Once upon a time there was a little girl named Lily. She loved to play"
    params = _json_params(SCHEMAS[20], 0.0, 0)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    jsonschema.validate(json.loads(second.outputs[0].text), SCHEMAS[20])


def test_equal_constraints_compile_once_and_no_step_recompiles_per_schema(llm):
    engine = llm.llm_engine
    manager = engine.structured_output
    first = {"type": "integer", "minimum": 0, "maximum": 7}  # schemas no other test uses
    second = {"type": "integer", "minimum": 0, "maximum": 8}
    llm.generate([PROMPT] * 2, [_json_params(first, 0.0, 0)] * 2, use_tqdm=False)
    compiled = manager.num_compiled
    executables = engine.worker.model_runner.num_compilations
    llm.generate([PROMPT] * 2, [_json_params(first, 0.0, 0)] * 2, use_tqdm=False)
    assert manager.num_compiled == compiled  # cached by key
    llm.generate([PROMPT] * 2, [_json_params(second, 0.0, 0)] * 2, use_tqdm=False)
    assert manager.num_compiled == compiled + 1
    assert engine.worker.model_runner.num_compilations == executables  # no new step variant


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        (dict(json={"type": "bogus"}), "json"),
        (dict(json="{not json"), "json"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="root ::= missing_rule"), "grammar"),
        (dict(json={"type": "string"}, whitespace_pattern=" *"), "whitespace_pattern"),
        (dict(structural_tag="{not json"), "structural_tag"),
    ],
)
def test_a_constraint_the_backend_cannot_compile_is_refused_by_name(llm, fields, name):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**fields))
    with pytest.raises(SamplingParamsError) as info:
        engine.add_request("bad", PROMPT, params)
    assert info.value.parameter == name
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage_perc == 0.0
    # The engine still serves.
    out = llm.generate([PROMPT], _json_params(SCHEMAS[2], 0.0, 0), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_constrained_requests_still_validate(llm, async_scheduling):
    # 10 blocks of 16 tokens; 8 distinct prompts of ~3 blocks each: recompute preemption.
    small = LLM(
        **{**ENGINE, "max_num_seqs": 8, "max_model_len": 128},
        num_gpu_blocks_override=10,
        async_scheduling=async_scheduling,
    )
    story = "Lily and Tom went to the park to play with a big red ball in the sun. "
    prompts = [f"{i} {story}{story}" for i in range(8)]
    params = [_json_params(s, 0.0, i) for i, s in enumerate(SCHEMAS[16:24])]
    outs = small.generate(prompts, params, use_tqdm=False)
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.get_stats().num_preemptions > 0
    for schema, out, ref in zip(SCHEMAS[16:24], outs, expected, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_async_scheduling_gives_the_synchronous_outputs(llm):
    async_llm = LLM(**ENGINE, async_scheduling=True)
    params = [_json_params(s, t, i) for i, s in enumerate(SCHEMAS[:12]) for t in (0.0, 1.0)]
    params += [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(seed=9, max_tokens=40),
    ]
    forked = _json_params(SCHEMAS[17], 1.0, 21)
    forked.n = 3  # each sample its own matcher, forked under the split steps
    params.append(forked)
    prompts = [PROMPT] * len(params)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    want = llm.generate(prompts, params, use_tqdm=False)
    # The grammar steps ran split (forward, then sample once the bitmask was filled), not whole.
    segments = {key.segment for key in async_llm.llm_engine.worker.model_runner._executables}
    assert {("forward",), ("sample",)} <= segments
    for g, w in zip(got, want, strict=True):
        assert len(g.outputs) == len(w.outputs)
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
    for completion in got[-1].outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMAS[17])


def test_special_tokens_are_never_allowed_by_a_grammar(llm):
    # "<s>" (BOS) starts with "<": xgrammar's default vocabulary view would allow it here.
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        structured_outputs=StructuredOutputsParams(grammar='root ::= "<" [a-z] [a-z]? ">"'),
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"<[a-z]{1,2}>", out.text), (out.text, out.token_ids)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        (dict(json={"type": "bogus"}), "json"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="start: nowhere"), "grammar"),
        (dict(structural_tag='{"structures": [], "triggers": []}'), "structural_tag"),
    ],
)
def test_the_guidance_backend_refuses_by_name_too(guidance_llm, fields, name):
    engine = guidance_llm.llm_engine
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**fields))
    with pytest.raises(SamplingParamsError) as info:
        engine.add_request("bad", PROMPT, params)
    assert info.value.parameter == name
    assert not engine.has_unfinished_requests()


def test_guidance_whitespace_pattern_is_honoured(guidance_llm):
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 3}
    so = StructuredOutputsParams(json=schema, whitespace_pattern=" ")
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    out = guidance_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
    assert not set(re.sub(r'"[ab]"', "", out.text)) - set("[], ")


def test_chunked_prefill_masks_only_the_sampling_chunk(llm):
    # ~150 prompt tokens over a 64-token step budget: three chunks, only the last samples.
    story = "Lily and Tom went to the park to play with a big red ball in the sun. " * 8
    prompt_ids = llm.get_tokenizer().encode(story)
    assert len(prompt_ids) > 2 * ENGINE["max_num_batched_tokens"]
    params = [_json_params(SCHEMAS[17], 0.0, 0), SamplingParams(temperature=0.0, max_tokens=20)]
    prompts = [{"prompt_token_ids": prompt_ids}, PROMPT]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    jsonschema.validate(json.loads(mixed[0].outputs[0].text), SCHEMAS[17])
    alone = llm.generate([PROMPT], params[1], use_tqdm=False)[0]
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
