"""``SamplingParamsError``: the ``ValueError`` a request's parameters raise when one breaks its
rule (``SamplingParams``, ``StructuredOutputsParams``, ``BeamSearchParams``), naming the
parameter and the value so the HTTP layer can answer 400 naming the field (vLLM's
``VLLMValidationError`` carries the same two).

Its own module so that each parameter type's module can raise it without importing another's.
"""

from __future__ import annotations


class SamplingParamsError(ValueError):
    """A sampling parameter broke its rule; ``parameter`` and ``value`` name the culprit."""

    def __init__(self, parameter: str, value, rule: str):
        self.parameter = parameter
        self.value = value
        super().__init__(f"{parameter} {rule}, got {value!r}")
