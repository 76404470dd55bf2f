"""jaxpaged: vLLM's serving ideas rebuilt natively in JAX/XLA with Pallas kernels.

``from jaxpaged import LLM, SamplingParams`` is the offline API. Names resolve lazily so that
host-only subpackages (``jaxpaged.core``) import without JAX.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxpaged.entrypoints.llm",
    "LLMEngine": "jaxpaged.engine.llm_engine",
    "EngineArgs": "jaxpaged.config",
    "SamplingParams": "jaxpaged.sampling_params",
    "StructuredOutputsParams": "jaxpaged.structured_output.params",
    "RequestOutput": "jaxpaged.outputs",
    "CompletionOutput": "jaxpaged.outputs",
    "BeamSearchParams": "jaxpaged.beam_search",
    "ModelRegistry": "jaxpaged.model_registry",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxpaged' has no attribute {name!r}")
