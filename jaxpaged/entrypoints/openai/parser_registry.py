"""``ParserRegistry``: the parsers a server flag can name, imported only when chosen.

The tool-call parsers (``--tool-call-parser``) and the reasoning parsers (``--reasoning-parser``)
are each one registry of this type (vLLM keeps a ``ToolParserManager`` and a
``ReasoningParserManager`` with the same lazy ``module:class`` entries).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class ParserRegistry(Mapping[str, str], Generic[T]):
    """Parser names (vLLM's) to ``"module:Class"`` under ``package``.

    A read-only mapping of name -> entry; ``get_class(name)`` imports the module and returns the
    class.

    Args:
        flag: the server flag that names a parser (used in errors), e.g.
            ``--tool-call-parser``.
        kind: what the parsers are, for errors ("tool parser").
        package: the package the modules live in (``__name__`` of the registering package).
        entries: name -> ``"module:Class"``.
    """

    def __init__(self, flag: str, kind: str, package: str, entries: Mapping[str, str]):
        self.flag = flag
        self.kind = kind
        self.package = package
        self._entries = dict(entries)

    def __getitem__(self, name: str) -> str:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get_class(self, name: str) -> type[T]:
        """The parser class registered as ``name`` (its module is imported now).

        Raises:
            ValueError: an unknown name; the message names the flag and lists the known ones.
        """
        if name not in self._entries:
            raise ValueError(
                f"{self.flag} {name!r} is not a known {self.kind}; choose one of {sorted(self)}"
            )
        module, _, cls = self._entries[name].partition(":")
        return getattr(importlib.import_module(f"{self.package}.{module}"), cls)
