"""The two parser registries (``--tool-call-parser``, ``--reasoning-parser``) are one type:
every name resolves to a parser of its kind, an unknown one is refused naming the flag and the
known names; and the JSON scanner under the tool parsers imports none of them (no circle)."""

from __future__ import annotations

import ast
import inspect

import pytest

from jaxpaged.entrypoints.openai.parser_registry import ParserRegistry
from jaxpaged.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from jaxpaged.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, json_scan


@pytest.mark.parametrize(
    "registry, base, flag",
    [
        (TOOL_PARSERS, ToolParser, "--tool-call-parser"),
        (REASONING_PARSERS, ReasoningParser, "--reasoning-parser"),
    ],
)
def test_each_registry_resolves_its_names_and_refuses_unknown_ones(registry, base, flag):
    assert isinstance(registry, ParserRegistry)
    for name in registry:
        assert issubclass(registry.get_class(name), base), name
    with pytest.raises(ValueError, match=f"{flag} 'nope' is not a known .*{sorted(registry)[0]}"):
        registry.get_class("nope")


def test_the_json_scanner_imports_no_parser_module():
    modules = set()
    for node in ast.walk(ast.parse(inspect.getsource(json_scan))):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    assert not [m for m in modules if m.startswith("jaxpaged")], modules
