"""``StructuredOutputsConfig``: the engine's ``structured_outputs_config`` (vLLM's names)."""

from __future__ import annotations

import dataclasses
import json

# vLLM's names: xgrammar, guidance (llguidance); auto picks xgrammar when it imports.
BACKENDS = ("auto", "xgrammar", "guidance")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide settings of constrained decoding (``--structured-outputs-config``).

    The last three fields are jaxpaged's budgets (vLLM's nearest knobs are environment
    variables: ``VLLM_XGRAMMAR_CACHE_MB``, 512, for xgrammar's own cache, and
    ``VLLM_REGEX_COMPILATION_TIMEOUT_S``, 5, for regexes only). A request past a budget is
    refused when it is added (HTTP 400) with a message naming its constraint field and the
    budget's ``structured_outputs_config.<name>``.

    Raises:
        ValueError: an unknown backend or key, or a value of the wrong type or range, naming it.
    """

    backend: str = "auto"
    """Grammar library: ``xgrammar`` (vLLM's default; imports torch), ``guidance``
    (llguidance; torch-free) or ``auto`` (xgrammar when it imports, else guidance)."""
    disable_any_whitespace: bool = False
    """Default for every request: JSON output without whitespace between tokens."""
    disable_additional_properties: bool = False
    """Default for every request: JSON objects get only the properties their schema names."""
    reasoning_parser: str | None = None
    """A reasoning parser's name (``deepseek_r1``, ``qwen3``): offline (``LLM``), a constrained
    request's grammar starts after that parser's end of thinking (``</think>``, or at one of
    its implicit ends), unless its ``reasoning_end_token_ids`` say otherwise. ``jaxpaged
    serve`` takes it as its ``--reasoning-parser`` (vLLM's rule), which does the same for the
    server's requests."""
    grammar_cache_mb: float = 512.0
    """Compiled grammars kept for reuse, in MiB (least recently used dropped first; the size is
    xgrammar's ``CompiledGrammar.memory_size_bytes``, or the grammar text for llguidance). One
    grammar larger than this is used by its request but not kept. Its size now is the
    ``grammar_cache_bytes`` metric."""
    grammar_compile_timeout_s: float = 60.0
    """Most seconds one constraint may take to be converted and compiled against the vocabulary
    (on the compile threads; the engine keeps stepping meanwhile). Wall-clock seconds from when
    a worker picks the job up: the workers run at a lower CPU priority than the engine, so on a
    busy host an ordinary schema that compiles in a second can take several times that (on a
    2-core machine running two test processes, over 10 s); the default leaves room for that."""
    max_grammar_bytes: int = 1 << 20
    """Largest constraint accepted, in bytes of its UTF-8 text (the schema as JSON, the regex,
    the grammar, the choices as a JSON list, the structural tag)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of {list(BACKENDS)}, "
                f"got {self.backend!r}"
            )
        if self.reasoning_parser is not None and not isinstance(self.reasoning_parser, str):
            raise ValueError(
                "structured_outputs_config.reasoning_parser must be a parser name, "
                f"got {self.reasoning_parser!r}"
            )
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"structured_outputs_config.{name} must be a boolean, "
                    f"got {getattr(self, name)!r}"
                )
        for name in ("grammar_cache_mb", "grammar_compile_timeout_s", "max_grammar_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(
                    f"structured_outputs_config.{name} must be a positive number, got {value!r}"
                )

    @property
    def grammar_cache_bytes(self) -> int:
        """``grammar_cache_mb`` in bytes."""
        return int(self.grammar_cache_mb * (1 << 20))

    @classmethod
    def parse(cls, value) -> StructuredOutputsConfig:
        """From None (defaults), a dict, its JSON text, a bare backend name, or a config.

        Raises:
            ValueError: bad JSON, an unknown key or backend, naming it.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as error:
                    raise ValueError(
                        f"structured_outputs_config is not valid JSON: {error}"
                    ) from None
            else:
                value = {"backend": text}
        if not isinstance(value, dict):
            raise ValueError(
                "structured_outputs_config must be a dict, its JSON text or a backend name, "
                f"got {type(value).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs_config.{unknown[0]} is not supported; known keys are "
                f"{sorted(known)}"
            )
        return cls(**value)
