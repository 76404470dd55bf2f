"""Host-side pieces of structured outputs: the request surface, the engine config, the bitmask
layout against a plain-numpy reference, and the compile cache."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from jaxpaged import SamplingParams, StructuredOutputsParams
from jaxpaged.engine_core.core_messages import params_from_wire, params_to_wire
from jaxpaged.sampling_params import SamplingParamsError
from jaxpaged.structured_output.bitmask import allowed_tokens, apply_token_bitmask, num_words
from jaxpaged.structured_output.compiler import GrammarCompiler, GrammarCompilerBusy
from jaxpaged.structured_output.config import StructuredOutputsConfig


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({}, "structured_outputs"),
        ({"json": {}, "regex": "a"}, "regex"),
        ({"choice": ["a"], "grammar": "root ::= x"}, "grammar"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", 1]}, "choice"),
        ({"json": 3}, "json"),
        ({"regex": ""}, "regex"),
        ({"json_object": False}, "json_object"),
        ({"json": {}, "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
    ],
)
def test_structured_outputs_params_refuse_by_name(fields, name):
    with pytest.raises(SamplingParamsError) as info:
        StructuredOutputsParams(**fields)
    assert info.value.parameter == name


def test_one_constraint_gives_kind_spec_and_cache_key():
    so = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert so.kind == "json" and so.spec == '{"b": 1, "a": 2}'  # key order kept
    assert so.cache_key != StructuredOutputsParams(json={"a": 2, "b": 1}).cache_key
    compact = StructuredOutputsParams(json={"b": 1, "a": 2}, disable_any_whitespace=True)
    assert so.cache_key != compact.cache_key
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]


def test_sampling_params_take_a_dict_and_cross_the_core_wire():
    params = SamplingParams(structured_outputs={"regex": "[ab]+", "disable_any_whitespace": True})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    back = params_from_wire(params_to_wire(params))
    assert back.structured_outputs == params.structured_outputs
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


@pytest.mark.parametrize(
    ("value", "backend"),
    [
        (None, "auto"),
        ("xgrammar", "xgrammar"),
        ("guidance", "guidance"),
        ('{"backend": "guidance"}', "guidance"),
        ({"backend": "auto", "disable_any_whitespace": True}, "auto"),
    ],
)
def test_structured_outputs_config_parses_vllm_forms(value, backend):
    assert StructuredOutputsConfig.parse(value).backend == backend


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("outlines", "'outlines'"),
        ({"backend": "lm-format-enforcer"}, "lm-format-enforcer"),
        ({"reasoning_parser": 3}, "reasoning_parser"),
        ("{bad json", "not valid JSON"),
        ({"disable_any_whitespace": 1}, "disable_any_whitespace"),
    ],
)
def test_structured_outputs_config_refuses_by_name(value, needle):
    with pytest.raises(ValueError, match=needle):
        StructuredOutputsConfig.parse(value)


def test_engine_args_validate_the_config():
    from jaxpaged.config import EngineArgs

    with pytest.raises(ValueError, match="outlines"):
        EngineArgs(structured_outputs_config="outlines").create_engine_config()
    config = EngineArgs(structured_outputs_config='{"backend": "xgrammar"}').create_engine_config()
    assert config.structured_outputs_config.backend == "xgrammar"


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 512])
def test_apply_token_bitmask_matches_a_numpy_reference(vocab_size):
    rng = np.random.default_rng(vocab_size)
    b, w = 3, num_words(vocab_size)
    bitmask = rng.integers(-(2**31), 2**31, size=(b, w), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # an unconstrained row
    logits = rng.standard_normal((b, vocab_size)).astype(np.float32)
    got = np.asarray(apply_token_bitmask(logits, bitmask))
    for row in range(b):
        allowed = [bool((int(bitmask[row, t // 32]) >> (t % 32)) & 1) for t in range(vocab_size)]
        want = np.where(allowed, logits[row], -np.inf)
        np.testing.assert_array_equal(got[row], want)
        np.testing.assert_array_equal(allowed_tokens(bitmask[row], vocab_size), allowed)
    np.testing.assert_array_equal(got[1], logits[1])


def test_compiler_caches_by_key_and_runs_off_the_calling_thread():
    threads = []

    def job(text):
        def run():
            threads.append(threading.current_thread().name)
            return text.upper()

        return run

    compiler = GrammarCompiler(len, max_bytes=1 << 20)
    first = compiler.submit(("regex", "a"), job("a"))
    assert compiler.submit(("regex", "a"), job("a")) is first
    assert first.result() == "A" and compiler.num_compiled == 1
    assert all(name.startswith("jaxpaged-grammar") for name in threads)
    compiler.shutdown(wait=True)


def test_compiler_cache_is_bounded_by_bytes_and_keeps_no_failure():
    # sizeof: the result's length; each entry also counts its key's text ("regex", "k0").
    compiler = GrammarCompiler(len, max_bytes=250)
    for i in range(10):
        compiler.submit(("regex", f"k{i}"), lambda: "x" * 100).result()
    # 107 bytes each: two fit in 250, the least recently used go first.
    assert compiler.cache_bytes == 214
    compiler.submit(("regex", "k8"), lambda: "never run")  # a hit: k8 is now the newest
    compiler.submit(("regex", "big"), lambda: "y" * 1000).result()  # larger than the budget
    assert compiler.cache_bytes <= 250
    assert compiler.submit(("regex", "k8"), lambda: "z").result() == "x" * 100
    assert compiler.submit(("regex", "k7"), lambda: "new").result() == "new"  # evicted
    failed = compiler.submit(("regex", "bad"), lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    assert compiler.submit(("regex", "bad"), lambda: "ok").result() == "ok"  # not cached
    compiler.shutdown(wait=True)


def test_an_abandoned_job_gets_a_replacement_worker_and_busy_refuses():
    release = threading.Event()
    compiler = GrammarCompiler(len, max_workers=1, max_abandoned=1)
    slow = compiler.submit(("regex", "slow"), lambda: release.wait(30) and "slow")
    while slow.started is None:
        time.sleep(0.001)
    queued = compiler.submit(("regex", "next"), lambda: "next")
    assert not queued.done()  # its only worker is busy
    compiler.abandon(slow)
    assert queued.result(timeout=10) == "next"  # served by the replacement
    with pytest.raises(GrammarCompilerBusy, match="past their time budget"):
        compiler.submit(("regex", "another"), lambda: "x")
    release.set()
    assert slow.result(timeout=10) == "slow"
    assert compiler.submit(("regex", "another"), lambda: "x").result(timeout=10) == "x"
    compiler.shutdown(wait=True)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="thread priorities are Linux's")
def test_compile_workers_run_below_the_engine_threads_priority():
    compiler = GrammarCompiler(len)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def niceness():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert compiler.run(niceness).result(timeout=10) > own
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    compiler.shutdown(wait=True)


def test_auto_backend_falls_back_to_guidance_without_xgrammar(monkeypatch):
    import sys

    from jaxpaged.structured_output.backend import XGrammarBackend
    from jaxpaged.structured_output.backend_guidance import GuidanceBackend
    from jaxpaged.structured_output.manager import _backend_class

    assert _backend_class("guidance")[0] is GuidanceBackend
    assert _backend_class("xgrammar")[0] is XGrammarBackend
    assert _backend_class("auto") == (XGrammarBackend, ": xgrammar imports")
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if it were not installed
    backend, reason = _backend_class("auto")
    assert backend is GuidanceBackend and "xgrammar does not import" in reason
