"""Admission of constrained requests: budgets, compilation off the engine thread, and refusals
when a request is added (HTTP 400 in the server) rather than aborts later.

The stress test drives an engine as the engine core does (``wait_for_grammar=False``, then
``admit_grammars`` between steps): hostile grammars beside plain requests, whose latency must
stay within 2x of idle while the hostile ones compile, and memory must come back.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import re
import statistics
import time

import jsonschema
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from jaxpaged.sampling_params import SamplingParamsError
from jaxpaged.structured_output.admission import check_budgets
from jaxpaged.structured_output.backend import unsupported_json_feature
from jaxpaged.structured_output.config import StructuredOutputsConfig
from jaxpaged.structured_output.params import MAX_STRUCTURED_OUTPUT_JSON_NESTING
from tests.structured_output.conftest import ENGINE

pytest.importorskip("xgrammar")

PROMPT = "Once upon a time"
PLAIN = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# The stress engine's budgets: small enough that a hostile grammar meets them in a test.
BUDGETS = {"grammar_cache_mb": 4, "grammar_compile_timeout_s": 0.5}


def _nested_object(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _nested_array_text(levels: int) -> str:
    return '{"type": "array", "items": ' * (levels - 1) + '{"type": "string"}' + "}" * (levels - 1)


def _constrained(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**fields))


def _refusal(engine, **fields) -> SamplingParamsError:
    with pytest.raises(SamplingParamsError) as info:
        engine.add_request("refused", PROMPT, _constrained(**fields))
    assert not engine.has_unfinished_requests()
    return info.value


@pytest.fixture(scope="module")
def budget_llm():
    return LLM(**ENGINE, structured_outputs_config=BUDGETS)


# --------------------------------------------------------------------------- size budgets
def test_a_deep_schema_is_refused_at_once_naming_the_nesting_limit():
    # A 440-level object schema once took 57.6 s of the engine thread.
    for value in (_nested_object(440), json.dumps(_nested_object(440)), "[" * 200_000):
        started = time.monotonic()
        with pytest.raises(SamplingParamsError, match="nested too deeply") as info:
            SamplingParams(structured_outputs={"json": value})
        assert time.monotonic() - started < 1.0
        assert info.value.parameter == "json"
        assert f"at most {MAX_STRUCTURED_OUTPUT_JSON_NESTING} levels" in str(info.value)
    # vLLM's boundary: 64 levels pass, 65 do not; a structural tag has 16 more.
    StructuredOutputsParams(json=_nested_array_text(MAX_STRUCTURED_OUTPUT_JSON_NESTING))
    with pytest.raises(SamplingParamsError, match="nested too deeply"):
        StructuredOutputsParams(json=_nested_array_text(MAX_STRUCTURED_OUTPUT_JSON_NESTING + 1))
    tag = {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a>"]}
    tag["structures"][0]["schema"] = json.loads(_nested_array_text(70))
    StructuredOutputsParams(structural_tag=json.dumps(tag))


def test_a_constraint_past_max_grammar_bytes_is_refused_naming_the_budget(llm):
    config = StructuredOutputsConfig(max_grammar_bytes=1000)
    with pytest.raises(SamplingParamsError, match="max_grammar_bytes is 1000") as info:
        check_budgets(StructuredOutputsParams(choice=[f"c{i}" for i in range(200)]), config)
    assert info.value.parameter == "choice"
    # A 100,000-string enum (once over 300 s of compilation) is past the default 1 MiB.
    started = time.monotonic()
    error = _refusal(llm.llm_engine, json={"enum": [f"item{i:06d}" for i in range(100_000)]})
    assert error.parameter == "json" and "max_grammar_bytes is 1048576" in str(error)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("ref", ["http://example.com/schema.json", "file:///etc/passwd"])
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_an_external_ref_is_refused(request, backend, ref):
    # xgrammar treated it as any JSON value.
    llm = request.getfixturevalue("llm" if backend == "xgrammar" else "guidance_llm")
    error = _refusal(llm.llm_engine, json={"type": "object", "properties": {"a": {"$ref": ref}}})
    assert error.parameter == "json" and f"external $ref {ref!r}" in str(error)
    # A reference inside the schema still works.
    local = {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}
    out = llm.generate(PROMPT, _constrained(json=local), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" or isinstance(json.loads(out.text), int)


# ------------------------------------------------------------------- refusals at admission
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize(
    ("fields", "name"),
    [(dict(grammar='root ::= root "a"'), "grammar"), (dict(regex=r"[^\s\S]"), "regex")],
)
def test_a_grammar_that_matches_no_text_is_refused_when_added(request, backend, fields, name):
    # Before: accepted, then finished with "abort" (xgrammar) or an empty "stop" (guidance).
    llm = request.getfixturevalue("llm" if backend == "xgrammar" else "guidance_llm")
    error = _refusal(llm.llm_engine, **fields)
    assert error.parameter == name and "matches no complete text" in str(error)


@pytest.mark.parametrize(
    ("fields", "name", "needle"),
    [
        (dict(choice=[f"item{i}" for i in range(20_000)]), "choice", "at most 1999"),
        (dict(choice=[f"item{i}" for i in range(1999)]), None, None),
        (dict(regex="a{1000000}"), "regex", "too many expressions"),
    ],
)
def test_llguidance_limits_are_refused_when_added(guidance_llm, fields, name, needle):
    # Before: accepted, then aborted after the first token ("max is 2000").
    if name is None:  # the largest choice list llguidance takes still works
        out = guidance_llm.generate(PROMPT, _constrained(**fields), use_tqdm=False)[0]
        assert out.outputs[0].text in fields["choice"]
        return
    error = _refusal(guidance_llm.llm_engine, **fields)
    assert error.parameter == name and needle in str(error)


def test_compilation_past_the_time_budget_is_refused_and_the_engine_serves_on(budget_llm):
    engine = budget_llm.llm_engine
    started = time.monotonic()
    error = _refusal(engine, choice=[f"x{i}" for i in range(50_000)])
    assert error.parameter == "choice"
    assert "grammar_compile_timeout_s (0.5 s)" in str(error)
    assert time.monotonic() - started < 5.0  # the compilation itself runs on, off the engine
    out = budget_llm.generate(PROMPT, _constrained(regex="[a-z]+"), use_tqdm=False)[0]
    assert out.outputs[0].text.isalpha()
    assert engine.get_stats().kv_cache_usage_perc == 0.0


# --------------------------------------------------------------------- xgrammar's surface
UNSUPPORTED_BY_XGRAMMAR = [  # vLLM 0.34's lists (tests/v1/structured_output/test_backend_xgrammar)
    {"type": "number", "multipleOf": 120},
    {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}},
    {"type": ["number", "null"], "multipleOf": 3},
    {"type": "array", "uniqueItems": True},
    {"type": "array", "contains": {"type": "string"}},
    {"type": "array", "minContains": 1},
    {"type": "array", "maxContains": 5},
    {"type": "string", "format": "non_existing_format"},
    {"type": "string", "pattern": "^a+$", "maxLength": 2},
    {"type": "string", "format": "email", "maxLength": 10},
    {"type": "object", "propertyNames": {"pattern": "^g_[0-9]$"}, "patternProperties": {"^g": {}}},
    {"type": "object", "propertyNames": {"pattern": "^a+$", "maxLength": 2}},
    {"type": "object", "propertyNames": {"enum": ["good"]}, "properties": {"Bad": {}}},
    {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "unevaluatedProperties": False},
    {"type": "object", "patternProperties": {"^x$": {"type": "integer"}}, "properties": {"x": {}}},
    {"type": "object", "patternProperties": {"^a": {"type": "string"}, "z$": {"type": "integer"}}},
    {"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]},
    {"type": "object", "properties": {"s": {"allOf": [{"type": "integer"}, {"minimum": 0}]}}},
]
SUPPORTED_BY_XGRAMMAR = [
    {"type": "object", "patternProperties": {"^grade_[0-9]+$": {"type": "integer"}}},
    {"type": "object", "propertyNames": {"pattern": "^[a-z_]+$"}},
    {"type": "object", "propertyNames": {"pattern": "^[a-z_]+$"}, "additionalProperties": {}},
    {"allOf": [{"type": "string"}]},
    {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "object", "properties": {"allOf": {"type": "string"}}},
    {"type": "string", "format": "email"},
    {"type": "string", "minLength": 2, "maxLength": 5},
]


def test_xgrammar_refuses_what_it_would_not_enforce_as_vllm_does(llm):
    for schema in UNSUPPORTED_BY_XGRAMMAR:
        assert unsupported_json_feature(schema) is not None, schema
    for schema in SUPPORTED_BY_XGRAMMAR:
        assert unsupported_json_feature(schema) is None, schema
    # Before: multipleOf was ignored with only a log line.
    error = _refusal(llm.llm_engine, json={"type": "integer", "multipleOf": 3})
    assert error.parameter == "json" and "uses multipleOf" in str(error)
    error = _refusal(llm.llm_engine, json=UNSUPPORTED_BY_XGRAMMAR[14])
    assert "patternProperties beside properties" in str(error)


def test_the_guidance_backend_enforces_multiple_of(guidance_llm):
    schema = {"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 99}
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    for out in guidance_llm.generate([PROMPT] * 4, params, use_tqdm=False):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "bogus"},
        {"type": "integer", "maximum": 10**40},
        {"type": "object", "properties": {"a": {"type": "str"}}},
    ],
)
def test_xgrammar_messages_keep_no_cpp_source_position(llm, schema):
    error = str(_refusal(llm.llm_engine, json=schema))
    assert ".cc:" not in error and "/project/" not in error and "Check failed" not in error
    assert "cannot be compiled by xgrammar: " in error


LARK = """
start: "id=" NUMBER tag? LF?
tag: " #" /[a-z]+/ -> label
NUMBER: /[0-9]+/
%import common.LF
"""


def test_a_lark_grammar_works_with_xgrammar(llm):
    # vLLM 0.34 parses Lark natively with xgrammar (tests/v1/structured_output/..._lark.py).
    params = SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(grammar=LARK),
    )
    for out in llm.generate([PROMPT] * 4, params, use_tqdm=False):
        text = out.outputs[0].text
        if out.outputs[0].finish_reason == "stop":
            assert re.fullmatch(r"id=[0-9]+( #[a-z]+)?\n?", text), text
        else:
            assert re.fullmatch(r"id=[0-9]*( #[a-z]*)?", text), text
    for bad in ('rule: "hello"', "start: 'hello'"):  # no start rule; a single-quoted literal
        assert _refusal(llm.llm_engine, grammar=bad).parameter == "grammar"


def test_structural_tag_works_with_guidance(guidance_llm):
    # vLLM builds llguidance StructTags from the {"structures", "triggers"} form.
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tag = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]}
    manager = guidance_llm.llm_engine.structured_output
    so = StructuredOutputsParams(structural_tag=json.dumps(tag), disable_any_whitespace=True)
    backend = manager.backend
    compiled = backend.compile(backend.check(so))
    tokenizer = guidance_llm.get_tokenizer()

    def accepts(text: str) -> bool:
        matcher = backend.matcher(compiled)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in ids)

    assert accepts('Lily said <f>{"n":42}</f> and left')
    assert not accepts('Lily said <f>{"n":"x"}</f>')
    xgrammar_form = json.dumps({"type": "structural_tag", "format": {"type": "any_text"}})
    error = _refusal(guidance_llm.llm_engine, structural_tag=xgrammar_form)
    assert error.parameter == "structural_tag" and "structures" in str(error)


# ----------------------------------------------------------------- start-up and the metric
def test_the_backend_starts_with_the_engine_and_auto_is_logged(caplog):
    from transformers import AutoTokenizer

    from jaxpaged.config import default_model_path
    from jaxpaged.structured_output.manager import StructuredOutputManager

    with caplog.at_level(logging.INFO, logger="jaxpaged.structured_output.manager"):
        manager = StructuredOutputManager(
            StructuredOutputsConfig(),
            lambda: AutoTokenizer.from_pretrained(default_model_path()),
            vocab_size=512,
            eos_token_id=2,
        )
        # No request yet: the backend is imported, the tokenizer loaded and a grammar compiled.
        assert manager.warm_up.result(timeout=120) >= 0
    assert manager.backend.name == "xgrammar"
    assert "backend xgrammar (structured_outputs_config.backend 'auto': xgrammar imports)" in (
        caplog.text
    )
    manager.shutdown()


def test_the_cache_is_bounded_by_bytes_least_recently_used_first(budget_llm):
    engine = budget_llm.llm_engine
    manager = engine.structured_output
    bound = BUDGETS["grammar_cache_mb"] << 20
    schemas = [  # distinct, ~0.75 MB each compiled on this vocabulary
        {"type": "object", "properties": {f"p{i}_{j}": {"type": "integer"} for j in range(160)}}
        for i in range(8)
    ]

    def generate(schema) -> int:
        budget_llm.generate(PROMPT, _constrained(json=schema), use_tqdm=False)
        cached = engine.get_stats().grammar_cache_bytes
        assert 0 < cached <= bound
        return cached

    # Ordinary schemas, which a loaded machine may take seconds to compile: the fixture's
    # 0.5 s time budget is not what this test is about.
    config = manager.config
    manager.config = dataclasses.replace(config, grammar_compile_timeout_s=60.0)
    try:
        before = engine.get_stats().grammar_cache_bytes
        one = generate(schemas[0]) - before
        assert one * len(schemas) > bound + one  # the first one must make room for the last
        for schema in schemas[1:]:
            generate(schema)
        compiled = manager.num_compiled
        generate(schemas[-1])  # the most recently used is kept
        assert manager.num_compiled == compiled
        generate(schemas[0])  # the least recently used was dropped: compiled again
        assert manager.num_compiled == compiled + 1
    finally:
        manager.config = config
    assert engine.get_stats().grammar_cache_bytes == manager.cache_bytes


# ------------------------------------------------------------------------------- stress
class _CoreLikeDriver:
    """Adds requests without waiting for their grammar and steps as the engine core does."""

    def __init__(self, engine):
        self.engine = engine
        self.verdicts: dict[str, Exception | None] = {}
        self._count = 0

    def add_hostile(self, request_id: str, fields: dict) -> None:
        try:
            self.engine.add_request(
                request_id, PROMPT, _constrained(**fields), wait_for_grammar=False
            )
        except SamplingParamsError as error:  # refused before queueing
            self.verdicts[request_id] = error

    def plain_latency(self) -> float:
        """Seconds from adding an 8-token request to its last token."""
        self._count += 1
        request_id = f"plain-{self._count}"
        started = time.perf_counter()
        self.engine.add_request(request_id, PROMPT, PLAIN, wait_for_grammar=False)
        while True:
            for rid, error in self.engine.admit_grammars():
                self.verdicts[rid] = error
            if self.engine.get_num_unfinished_requests() <= self.engine.num_waiting_for_grammar:
                time.sleep(0.001)  # nothing to step: only grammars pending
                continue
            for out in self.engine.step():
                if out.request_id == request_id and out.finished:
                    return time.perf_counter() - started


HOSTILE = {
    "enum": dict(json={"enum": [f"item{i:06d}" for i in range(100_000)]}),
    "ref": dict(json={"$ref": "file:///etc/passwd"}),
    "left-recursive": dict(grammar='root ::= root "a"'),
    "empty": dict(regex=r"[^\s\S]"),
    "multipleOf": dict(json={"type": "integer", "multipleOf": 3}),
    "slow": None,  # 50,000 strings, seconds to compile: past the 0.5 s budget (built below)
}


def _rss_bytes() -> int:
    """This process's resident memory, after handing freed heap pages back where glibc can."""
    import ctypes
    import ctypes.util

    import psutil

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)
    return psutil.Process().memory_info().rss


def _live_compiled_grammars() -> int:
    import xgrammar

    return sum(type(o) is xgrammar.CompiledGrammar for o in gc.get_objects())


def test_hostile_grammars_beside_normal_requests(budget_llm):
    engine = budget_llm.llm_engine
    driver = _CoreLikeDriver(engine)
    for _ in range(3):  # compile the plain request's step buckets
        driver.plain_latency()
    idle = statistics.median(driver.plain_latency() for _ in range(9))
    baseline, grammars = _rss_bytes(), _live_compiled_grammars()
    with pytest.raises(SamplingParamsError, match="nested too deeply"):
        _constrained(json=_nested_object(440))  # once 57.6 s of the engine thread
    for name, fields in HOSTILE.items():
        driver.add_hostile(name, fields or dict(choice=[f"x{i}" for i in range(50_000)]))
    busy = []  # plain requests while the hostile grammars compile
    while engine.num_waiting_for_grammar:
        busy.append(driver.plain_latency())
    for name in HOSTILE:
        assert isinstance(driver.verdicts[name], SamplingParamsError), name
    assert "grammar_compile_timeout_s" in str(driver.verdicts["slow"])
    # Had a compilation run on the engine thread, it would have ended before a third plain
    # request could start. 2x idle, plus 20 ms for timer and scheduler noise on a loaded
    # 2-core machine (idle is ~10 ms there).
    assert len(busy) >= 3, busy
    assert statistics.median(busy) <= 2 * idle + 0.02, (idle, busy)
    while engine.structured_output.num_compiling:  # the abandoned one runs on, then goes
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage_perc == 0.0
    assert engine.get_stats().grammar_cache_bytes <= BUDGETS["grammar_cache_mb"] << 20
    # The 50,000-string grammar held ~65 MB compiled: it may not stay alive. The process keeps
    # some freed memory in its allocator's per-thread arenas (measured: under 130 MB after any
    # number of such compilations, where each kept grammar would add 65 MB).
    assert _live_compiled_grammars() <= grammars  # earlier tests' grammars may go meanwhile
    assert _rss_bytes() - baseline < 160 << 20
