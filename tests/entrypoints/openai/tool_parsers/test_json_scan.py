"""The partial-JSON scanner under the JSON parsers: on every prefix of a call, what it reports
is a prefix of what the whole text gives (random JSON arguments, hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.entrypoints.openai.tool_parsers.json_scan import (
    MalformedToolCall,
    scan_call_object,
    value_end,
)

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(arguments=st.dictionaries(st.text(), _json, max_size=4), name=st.text(min_size=1))
def test_every_prefix_reports_a_prefix_of_the_final_call(arguments, name):
    text = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    whole = scan_call_object(text, 0, ("arguments",), final=True)
    assert whole.name == name and json.loads(whole.arguments(text)) == arguments
    assert whole.end == len(text)
    for cut in range(len(text)):
        part = scan_call_object(text[:cut], 0, ("arguments",), final=False)
        assert part.name in (None, name)
        assert whole.arguments(text).startswith(part.arguments(text[:cut]))
        assert part.end is None


@pytest.mark.parametrize(
    "text, end",
    [('"a\\"b" x', 6), ("[1, [2], {}] x", 12), ("123,", 3), ('{"a": "}"}', 10), ("12", None)],
)
def test_value_end_skips_strings_and_nesting_and_waits_on_open_numbers(text, end):
    assert value_end(text, 0, final=False) == end


@pytest.mark.parametrize("text", ["[1}", "}", '{"name": 1, "arguments": {}}', '{"a" 1}'])
def test_malformed_text_is_refused(text):
    with pytest.raises(MalformedToolCall):
        if text.startswith("{"):
            scan_call_object(text, 0, ("arguments",), final=True)
        else:
            value_end(text, 0, final=True)
