"""``scripts/trace_request_life.py``'s ``--load`` specs (the traced run itself is exercised by
``benchmarks/results/server-split/run.sh --smoke``)."""

from __future__ import annotations

import pytest

from scripts.trace_request_life import Load, parse_load

DEFAULTS = Load("load", 400, 512, 128, 20.0, 16)


def test_a_load_spec_overrides_only_the_keys_it_names():
    assert parse_load("conc16:rate=0,concurrency=16,in=50,n=160", DEFAULTS) == Load(
        "conc16", 160, 50, 128, 0.0, 16
    )
    assert parse_load("same", DEFAULTS) == Load("same", 400, 512, 128, 20.0, 16)


@pytest.mark.parametrize(
    "spec, message",
    [
        (":n=3", "give NAME"),
        ("x:n", "give NAME"),
        ("x:size=3", r"unknown keys \['size'\]"),
        ("x:n=0", "at least 1"),
        ("x:rate=-1", "rate must be >= 0"),
    ],
)
def test_a_bad_load_spec_is_refused_naming_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_load(spec, DEFAULTS)
