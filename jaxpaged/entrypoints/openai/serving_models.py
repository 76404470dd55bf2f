"""The models a server answers to: the base model's names and its LoRA adapters.

vLLM's ``vllm/entrypoints/openai/serving_models.py``: a request's ``model`` field names the base
model (any served name) or a LoRA adapter; ``GET /v1/models`` lists both, adapters with
``parent`` = the base model's first name and ``root`` = the adapter path; with ``--enable-lora``,
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) change the adapters of a running server
(vLLM additionally requires ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; here ``--enable-lora`` is
enough). Answers are vLLM's: plain-text success messages, 400 for an adapter loaded twice or a
bad adapter directory, 404 for an unknown adapter or model.

With ``--api-server-count`` above 1 each API process keeps its own adapter list, so runtime
loading and unloading is refused (400 naming the flag; vLLM's ``--api-server-count`` has no
cross-process adapter list either): adapters are served through ``--lora-modules``, which every
API process loads at start-up (the engine core registers each adapter once).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
import time
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import Field

from jaxpaged.entrypoints.openai.errors import BadRequestError, NotFoundError
from jaxpaged.entrypoints.openai.protocol_base import OpenAIBaseModel, OpenAIRequest
from jaxpaged.lora.request import LoRARequest


# The body of ``GET /v1/models`` (OpenAI's model list, with vLLM's extra fields).
class ModelPermission(OpenAIBaseModel):
    id: str
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxpaged"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: an adapter name, its directory, optionally its base."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: Sequence[str] | None) -> list[LoRAModulePath]:
    """``--lora-modules`` values: ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``.

    Raises:
        ValueError: an entry of neither form, naming it.
    """
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                modules.append(
                    LoRAModulePath(entry["name"], entry["path"], entry.get("base_model_name"))
                )
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(
                    f"--lora-modules entry {value!r} must be name=path or JSON with "
                    f"'name' and 'path' ({error})"
                ) from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {value!r} must be name=path")
        modules.append(LoRAModulePath(name, path))
    return modules


def check_lora_modules(
    modules: Sequence[LoRAModulePath],
    enable_lora: bool,
    base_model_names: Sequence[str],
    max_lora_rank: int | None = None,
) -> None:
    """Refuse ``--lora-modules`` without ``--enable-lora``, a name used twice (or a served
    base model name), a path that is not an adapter directory, or (given ``max_lora_rank``)
    an adapter of a larger rank; cheap, so ``jaxpaged serve`` runs it before it loads the
    model (the engine checks the tensors themselves when it loads the adapter).

    Raises:
        ValueError: any of those, naming it.
    """
    if modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = [module.name for module in modules]
    for name in names:
        if names.count(name) > 1 or name in base_model_names:
            raise ValueError(f"--lora-modules: the name {name!r} is used twice")
    if not modules:
        return
    # Lazy: jaxpaged.lora.peft pulls in JAX (models.lora), which a server without adapters
    # never imports in the API process.
    from jaxpaged.lora.peft import adapter_rank, read_adapter_config

    for module in modules:
        try:
            config = read_adapter_config(module.path)
            if max_lora_rank is not None:
                adapter_rank(module.path, config, max_lora_rank)
        except ValueError as error:
            raise ValueError(f"--lora-modules {module.name}: {error}") from None


class LoadLoRAAdapterRequest(OpenAIRequest):
    """Body of ``POST /v1/load_lora_adapter`` (an undeclared field is a 400 naming it)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIRequest):
    """Body of ``POST /v1/unload_lora_adapter``; ``lora_int_id``, when given, must be the
    adapter's."""

    lora_name: str
    lora_int_id: int | None = None


class OpenAIServingModels:
    """Base model names and LoRA adapters of one server.

    Args:
        engine: the ``EngineCoreClient``: adapters load in the engine core, between steps
            (its ``add_lora`` / ``remove_lora`` utility calls), and requests carry theirs.
        base_model_names: the served names of the base model; the first is adapters' parent.
        model_root: the base model's path (``root`` of its cards).
        max_model_len: shown on the cards.
        api_server_count: API processes over the engine core (``--api-server-count``); above
            1, runtime adapter loading and unloading is refused.
    """

    def __init__(
        self,
        engine,
        base_model_names: Sequence[str],
        model_root: str,
        max_model_len: int,
        *,
        api_server_count: int = 1,
    ):
        self.engine = engine
        self.api_server_count = api_server_count
        self.base_model_names = list(base_model_names)
        self.model_root = model_root
        self.max_model_len = max_model_len
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine core was built with ``enable_lora`` (its ``max_loras``)."""
        return self.engine.info.get("max_loras") is not None

    def check_static_loras(self, modules: Sequence[LoRAModulePath]) -> None:
        """``check_lora_modules`` against this server's engine and names (before serving).

        Raises:
            ValueError: as ``check_lora_modules``.
        """
        check_lora_modules(modules, self.lora_enabled, self.base_model_names)

    async def init_static_loras(self, modules: Sequence[LoRAModulePath]) -> None:
        """Load ``--lora-modules`` in the engine core (at start-up, once the client runs).

        Raises:
            ValueError: LoRA is off, a duplicate name, or a bad adapter directory.
        """
        self.check_static_loras(modules)
        for module in modules:
            request = self._new_request(module.name, module.path, module.base_model_name)
            await self.engine.add_lora(request)
            self.lora_requests[module.name] = request

    def lora_request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no model).

        Raises:
            NotFoundError: neither a served name nor a loaded adapter (HTTP 404).
        """
        if model is None or model in self.base_model_names:
            return None
        request = self.lora_requests.get(model)
        if request is None:
            raise NotFoundError(f"The model `{model}` does not exist.", param="model")
        return request

    def model_list(self) -> ModelList:
        """``GET /v1/models``: the base model's names, then each adapter (parent = base)."""

        def card(model_id, root, parent):
            return ModelCard(
                id=model_id,
                root=root,
                parent=parent,
                max_model_len=self.max_model_len,
                permission=[ModelPermission(id=f"modelperm-{secrets.token_hex(16)}")],
            )

        cards = [card(name, self.model_root, None) for name in self.base_model_names]
        cards += [
            card(name, request.lora_path, self.base_model_names[0])
            for name, request in self.lora_requests.items()
        ]
        return ModelList(data=cards)

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        """Load an adapter into a running server.

        Raises:
            BadRequestError: empty fields, a name already in use, a bad adapter, or several
                API processes (400).
        """
        self._check_runtime_updates()
        name = body.lora_name
        for field, value in (("lora_name", name), ("lora_path", body.lora_path)):
            if not value:
                raise BadRequestError(
                    f"Both 'lora_name' and 'lora_path' must be provided: {field} is empty.",
                    param=field,
                )
        if name in self.lora_requests or name in self.base_model_names:
            raise BadRequestError(
                f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        request = self._new_request(name, body.lora_path)
        try:
            await self.engine.add_lora(request)
        except ValueError as error:
            raise BadRequestError(str(error), param="lora_path") from None
        self.lora_requests[name] = request
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        """Unload an adapter; requests already running with it finish with it.

        Raises:
            NotFoundError: no adapter of that name (404).
            BadRequestError: several API processes (400).
        """
        self._check_runtime_updates()
        request = self.lora_requests.get(body.lora_name)
        if request is None:
            raise NotFoundError(
                f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name"
            )
        if body.lora_int_id is not None and body.lora_int_id != request.lora_int_id:
            raise BadRequestError(
                f"lora_int_id {body.lora_int_id} is not the id of adapter '{body.lora_name}' "
                f"({request.lora_int_id})",
                param="lora_int_id",
            )
        del self.lora_requests[body.lora_name]
        await self.engine.remove_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def _check_runtime_updates(self) -> None:
        if self.api_server_count > 1:
            raise BadRequestError(
                "Loading or unloading LoRA adapters at runtime needs --api-server-count 1 "
                f"(this server runs {self.api_server_count} API processes, each with its own "
                "adapter list); serve adapters with --lora-modules instead."
            )

    def _new_request(self, name: str, path: str, base: str | None = None) -> LoRARequest:
        if not self.lora_enabled:
            raise BadRequestError(
                f"LoRA adapter '{name}' needs a server started with --enable-lora"
            )
        used = {r.lora_int_id for r in self.lora_requests.values()}
        lora_id = next(i for i in self._lora_ids if i not in used)
        return LoRARequest(name, lora_id, path, base or self.base_model_names[0])


def add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (with --enable-lora)."""
    if not models.lora_enabled:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.load_lora_adapter(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.unload_lora_adapter(body))
