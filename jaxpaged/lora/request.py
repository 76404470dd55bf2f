"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, eq=False)
class LoRARequest:
    """A LoRA adapter to apply to one request.

    Args:
        lora_name: the adapter's name (what the server's ``model`` field selects); requests
            compare and hash by it, as in vLLM.
        lora_int_id: a positive integer, unique per adapter (like vLLM, uniqueness is the
            caller's job; the engine refuses a second adapter under an id already in use).
        lora_path: a local PEFT adapter directory (``adapter_config.json`` +
            ``adapter_model.safetensors``).
        base_model_name: the base model it was trained on (informational, as in vLLM).

    Raises:
        ValueError: ``lora_int_id`` below 1, an empty ``lora_name`` or ``lora_path``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool):
            raise ValueError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not self.lora_path:
            raise ValueError(
                f"lora_path must name a PEFT adapter directory, got {self.lora_path!r}"
            )

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
