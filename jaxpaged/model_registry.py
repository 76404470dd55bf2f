"""``ModelRegistry``: vLLM's name for the map from HF architecture names to model classes."""

from __future__ import annotations

from collections.abc import Callable

from models import registry


class ModelRegistry:
    """The architectures jaxpaged serves (vLLM's ``vllm.ModelRegistry``), ours and a user's.

    ``ModelRegistry.register_model("MyLlamaForCausalLM", MyLlamaForCausalLM)`` makes every
    checkpoint whose ``config.json`` lists ``"architectures": ["MyLlamaForCausalLM"]`` load into
    that class (``docs/model_protocol.md`` says what it must provide). Register before the
    engine is built, in the process that builds it: ``LLM(...)`` in your script, or
    ``jaxpaged serve --model-impl-module my_pkg.my_model`` for the server's engine-core process
    (the module registers on import).
    """

    @staticmethod
    def register_model(
        model_arch: str, model_cls: type | str, *, checkpoint_view: Callable | None = None
    ) -> None:
        """Serve ``model_arch`` with ``model_cls`` (a class, or ``"module:ClassName"`` imported
        on first use); ``checkpoint_view`` adapts a checkpoint whose tensors differ from the
        standard HF layout (``models.checkpoint_views``). Replaces an earlier registration.

        Raises:
            ValueError: an empty name or a ``model_cls`` that is neither form.
        """
        registry.register_model(model_arch, model_cls, view=checkpoint_view)

    @staticmethod
    def get_supported_archs() -> list[str]:
        """Every registered architecture name, sorted."""
        return registry.supported_architectures()

    @staticmethod
    def is_supported(model_arch: str) -> bool:
        """Whether ``model_arch`` is registered."""
        return model_arch in registry.supported_architectures()
