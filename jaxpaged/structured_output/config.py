"""``StructuredOutputsConfig``: the engine's ``structured_outputs_config`` (vLLM's names)."""

from __future__ import annotations

import dataclasses
import json

# vLLM's names: xgrammar, guidance (llguidance); auto picks xgrammar when it imports.
BACKENDS = ("auto", "xgrammar", "guidance")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide settings of constrained decoding (``--structured-outputs-config``).

    Raises:
        ValueError: an unknown backend or key, naming it.
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
    request's grammar starts after that parser's end of thinking (``</think>``), unless its
    ``reasoning_end_token_ids`` say otherwise. The server's ``--reasoning-parser`` does the
    same for its requests."""

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
