"""``SpeculativeConfig``: the engine's ``speculative_config`` (vLLM 0.34's keys), checked once.

Accepted as a dict (``LLM(..., speculative_config={...})``), its JSON text
(``jaxpaged serve --speculative-config '<json>'``) or a config. Keys and defaults follow vLLM's
``vllm/config/speculative.py``:

- ``method``: ``"ngram"`` (prompt lookup; ``"ngram_gpu"`` and ``"[ngram]"`` are aliases, since
  our n-gram proposer already runs on the device), ``"draft_model"`` (a smaller checkpoint of
  the same vocabulary), ``"eagle"`` / ``"eagle3"`` (draft heads fed the target's hidden states).
  None infers it as vLLM does: ``model`` "ngram" -> ngram; a model name containing ``eagle3``
  (or a config whose architecture names Eagle3) -> eagle3; containing ``eagle-`` -> eagle;
  else draft_model.
- ``num_speculative_tokens`` (K): required, >= 1, and ``K + 1`` query tokens of one sequence must
  fit ``max_model_len`` and ``max_num_batched_tokens``.
- ``prompt_lookup_min`` / ``prompt_lookup_max``: n-gram sizes, >= 1, min <= max; both None ->
  5 / 5, one given -> the other copies it (vLLM 0.34's rule).
- ``model``, ``revision``: the draft checkpoint (directory or Hub id).
- ``max_model_len``: sequences longer than this get no drafts; <= the target's (and the draft
  model's) limit; None -> the smaller of the two.
- ``draft_tensor_parallel_size``: None or the target's ``tensor_parallel_size`` (one mesh).
- ``disable_by_batch_size``: vLLM's late-2025 key (0.34 replaced it by the next one): with at
  least this many running sequences, none gets drafts; >= 2.
- ``num_speculative_tokens_per_batch_size``: vLLM 0.34's schedule ``[(first, last, K), ...]``
  of inclusive batch-size ranges (the first starting at 1, K >= 0, non-overlapping; a gap or a
  batch past the last range keeps the previous K).

Every other key of vLLM's config is accepted only at its default value and refused by name
otherwise; an unknown key is refused listing the known ones. What is refused and why:
``docs/spec_decode.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from typing import Any

from models.hub import resolve_model_path

# Methods this engine implements; the aliases map onto them.
METHODS = ("ngram", "draft_model", "eagle", "eagle3")
_METHOD_ALIASES = {"ngram_gpu": "ngram", "[ngram]": "ngram"}
# vLLM 0.34's other methods (and its *_mtp model types), refused by name.
_VLLM_ONLY_METHODS = (
    "medusa", "mlp_speculator", "suffix", "mtp", "extract_hidden_states", "dflash", "dspark",
)  # fmt: skip
_NEEDS_MODEL = ("draft_model", "eagle", "eagle3")

# vLLM's defaults of the keys accepted only at those values (0.34, plus the late-2025
# speculative_token_tree and disable_padded_drafter_batch).
_DEFAULT_ONLY_KEYS: dict[str, Any] = {
    "quantization": None,
    "code_revision": None,
    "enforce_eager": None,
    "draft_load_config": None,
    "kv_cache_dtype": None,
    "attention_backend": None,
    "moe_backend": None,
    "draft_decode_context_parallel_size": None,
    "index_share_for_mtp_iteration": None,
    "disable_eagle_block_drop": False,
    "disable_lookahead_block_hashes": False,
    "draft_lm_head_quantization": None,
    "use_local_argmax_reduction": False,
    "parallel_drafting": None,
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_corpus_tokens": 1 << 20,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
    "rejection_sample_method": "standard",
    "synthetic_acceptance_rates": None,
    "synthetic_acceptance_length": None,
    "enable_adaptive_verification": False,
    "draft_sample_method": "greedy",
    "dspark_draft_topk": None,
    "xpress_topc": None,
    "speculator_options": None,
    "fly_window_size": None,
    "fly_entropy_threshold": 0.3,
    "fly_entropy_top_k": 3,
    "speculative_token_tree": None,
    "disable_padded_drafter_batch": False,
}
# Filled by vLLM's engine, never by users.
_ENGINE_KEYS = (
    "target_model_config", "target_parallel_config", "draft_model_config",
    "draft_parallel_config", "custom_method",
)  # fmt: skip
_DEFAULT_LOOKUP = 5  # vLLM 0.34's prompt_lookup_min / _max when neither is given


@dataclasses.dataclass(frozen=True)
class SpeculationTarget:
    """What the checks need to know about the target engine (``jaxpaged.config`` fills it)."""

    hf_config_json: dict  # the target's config.json
    max_model_len: int
    max_num_batched_tokens: int
    tensor_parallel_size: int = 1
    enable_lora: bool = False
    load_format: str = "auto"  # "dummy": a draft directory needs only its config.json
    download_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """A checked ``speculative_config`` (module docstring: keys, defaults, rules).

    Build it with :meth:`parse`; the fields hold resolved values (``model`` a local directory,
    ``max_model_len`` an int, the n-gram sizes set for ngram and None otherwise).
    """

    method: str  # one of METHODS
    num_speculative_tokens: int  # K, drafts per sequence per step
    model: str | None = None  # local directory of the draft checkpoint (draft_model / eagle*)
    prompt_lookup_min: int | None = None  # ngram only
    prompt_lookup_max: int | None = None  # ngram only
    max_model_len: int | None = None  # no drafts for sequences at or past this length
    disable_by_batch_size: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    revision: str | None = None
    draft_tensor_parallel_size: int | None = None
    draft_hf_config_json: dict | None = None  # the draft checkpoint's config.json
    # eagle3: the target layers whose input residual stream the head reads (models.llama).
    aux_hidden_state_layer_ids: tuple[int, ...] | None = None

    @property
    def uses_aux_hidden_states(self) -> bool:
        """Whether the target step must return hidden states of several layers (EAGLE-3)."""
        return self.method == "eagle3"

    @property
    def uses_draft_kv_cache(self) -> bool:
        """Whether the proposer keeps its own KV (draft model, EAGLE heads; not n-gram)."""
        return self.method in _NEEDS_MODEL

    def num_tokens_for_batch(self, batch_size: int) -> int:
        """K for a step of ``batch_size`` running sequences: 0 when ``disable_by_batch_size``
        is reached, else the ``num_speculative_tokens_per_batch_size`` entry (capped at
        ``num_speculative_tokens``), else ``num_speculative_tokens``."""
        k = self.num_speculative_tokens
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            return 0
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule:
            chosen = schedule[0][2]
            for first, _, entry_k in schedule:  # sorted; a gap keeps the previous K
                if first <= batch_size:
                    chosen = entry_k
            k = min(k, chosen)
        return k

    @classmethod
    def parse(cls, value: Any, target: SpeculationTarget) -> SpeculativeConfig | None:
        """The checked config of ``value``: None (no speculation), a dict, its JSON text, or a
        ``SpeculativeConfig`` (checked again against ``target``).

        Raises:
            ValueError: bad JSON; an unknown key, or a vLLM key not at its default (named); an
                unknown or unsupported method; K missing, <= 0 or too large for the context or
                the token budget; bad n-gram sizes; a draft checkpoint that is missing, of
                another vocabulary or hidden size, or of a family the method cannot use; an
                option the method cannot combine with (``docs/spec_decode.md``).
        """
        if value is None:
            return None
        if isinstance(value, cls):
            value = {
                f.name: getattr(value, f.name)
                for f in dataclasses.fields(cls)
                if f.name not in ("draft_hf_config_json", "aux_hidden_state_layer_ids")
            }
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a dict or its JSON text, got {type(value).__name__}"
            )
        return _build(cls, dict(value), target)


def _build(cls, raw: dict, target: SpeculationTarget) -> SpeculativeConfig:
    _check_keys(raw)
    model = raw.get("model")
    method = _resolve_method(raw.get("method"), model)
    if method == "ngram" and model in ("ngram", "[ngram]"):
        model = None  # it named the method
    k = raw.get("num_speculative_tokens")
    if k is None:
        raise ValueError("speculative_config.num_speculative_tokens is required (K >= 1)")
    _check_int("num_speculative_tokens", k, minimum=1)
    for limit, name in (
        (target.max_model_len, "max_model_len"),
        (target.max_num_batched_tokens, "max_num_batched_tokens"),
    ):
        if k + 1 > limit:
            raise ValueError(
                f"speculative_config.num_speculative_tokens ({k}) is larger than the context "
                f"allows: a verify step runs K + 1 = {k + 1} tokens of one sequence, but "
                f"{name} is {limit}"
            )
    lookup = _lookup_sizes(method, raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max"))
    disable = raw.get("disable_by_batch_size")
    if disable is not None:
        _check_int("disable_by_batch_size", disable, minimum=2)
    schedule = _batch_schedule(raw.get("num_speculative_tokens_per_batch_size"))
    if disable is not None and schedule is not None:
        raise ValueError(
            "speculative_config: give disable_by_batch_size or "
            "num_speculative_tokens_per_batch_size, not both (both choose K by batch size)"
        )
    draft_tp = raw.get("draft_tensor_parallel_size")
    if draft_tp is not None and draft_tp != target.tensor_parallel_size:
        raise ValueError(
            f"speculative_config.draft_tensor_parallel_size must be the target's "
            f"tensor_parallel_size ({target.tensor_parallel_size}; the draft runs on the same "
            f"mesh), got {draft_tp}"
        )
    draft_json, aux_layers, draft_limit = None, None, None
    if method in _NEEDS_MODEL:
        if model is None:
            raise ValueError(f"speculative_config.model is required for method {method!r}")
        model = resolve_model_path(
            model, revision=raw.get("revision"), download_dir=target.download_dir,
            require_weights=target.load_format != "dummy",
        )  # fmt: skip
        draft_json = _read_config(model)
        _check_combinations(method, target)
        draft_limit, aux_layers = _check_draft(method, draft_json, target)
    elif model is not None:
        raise ValueError(f"speculative_config.model is not used by method {method!r}: {model!r}")
    max_len = _spec_max_model_len(raw.get("max_model_len"), target.max_model_len, draft_limit)
    return cls(
        method=method,
        num_speculative_tokens=k,
        model=model,
        prompt_lookup_min=lookup[0],
        prompt_lookup_max=lookup[1],
        max_model_len=max_len,
        disable_by_batch_size=disable,
        num_speculative_tokens_per_batch_size=schedule,
        revision=raw.get("revision"),
        draft_tensor_parallel_size=draft_tp,
        draft_hf_config_json=draft_json,
        aux_hidden_state_layer_ids=aux_layers,
    )


def _check_keys(raw: dict) -> None:
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {
        "draft_hf_config_json", "aux_hidden_state_layer_ids",
    }  # fmt: skip
    for key, value in raw.items():
        if key == "tensor_parallel_size":
            raise ValueError(
                "speculative_config.tensor_parallel_size is not a valid key; the draft's is "
                "draft_tensor_parallel_size (vLLM's rule)"
            )
        if key in _ENGINE_KEYS:
            raise ValueError(f"speculative_config.{key} is set by the engine, not by users")
        if key in _DEFAULT_ONLY_KEYS:
            if value != _DEFAULT_ONLY_KEYS[key]:
                raise ValueError(
                    f"speculative_config.{key} is not supported (only its default "
                    f"{_DEFAULT_ONLY_KEYS[key]!r}), got {value!r}"
                )
            continue
        if key not in known:
            raise ValueError(
                f"speculative_config.{key} is not a known key; supported keys are {sorted(known)}"
            )


def _resolve_method(method: Any, model: Any) -> str:
    if method is None:
        if model is None:
            raise ValueError("speculative_config needs a method (one of "
                             f"{list(METHODS)}) or a draft model")  # fmt: skip
        if model in ("ngram", "[ngram]"):
            return "ngram"
        return _infer_from_model(str(model))
    if not isinstance(method, str):
        raise ValueError(f"speculative_config.method must be a string, got {method!r}")
    method = _METHOD_ALIASES.get(method, method)
    if method in METHODS:
        return method
    if method in _VLLM_ONLY_METHODS or method.endswith("_mtp"):
        raise ValueError(
            f"speculative_config.method {method!r} is vLLM's but not supported here; "
            f"supported: {list(METHODS)}"
        )
    raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {method!r}")


def _infer_from_model(model: str) -> str:
    """vLLM's detection by name, plus the architecture of a local directory's config."""
    name = model.lower()
    architectures = []
    config = os.path.join(model, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            architectures = json.load(f).get("architectures") or []
    if "eagle3" in name or any("eagle3" in a.lower() for a in architectures):
        return "eagle3"
    if "eagle-" in name or any(a.lower().startswith("eagle") for a in architectures):
        return "eagle"
    return "draft_model"


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"speculative_config.{name} must be an integer >= {minimum}, got {value!r}"
        )


def _lookup_sizes(method: str, lo: Any, hi: Any) -> tuple[int | None, int | None]:
    if method != "ngram":
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                raise ValueError(
                    f"speculative_config.{name} applies to method 'ngram' only, not {method!r}"
                )
        return None, None
    if lo is None and hi is None:
        return _DEFAULT_LOOKUP, _DEFAULT_LOOKUP
    for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if value is not None:
            _check_int(name, value, minimum=1)
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo > hi:
        raise ValueError(
            f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
        )
    return lo, hi


def _batch_schedule(value: Any) -> tuple[tuple[int, int, int], ...] | None:
    """vLLM 0.34's ``num_speculative_tokens_per_batch_size`` rules, sorted."""
    if value is None:
        return None
    name = "speculative_config.num_speculative_tokens_per_batch_size"
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{name} must be a non-empty list of [first, last, K], got {value!r}")
    entries = []
    for entry in value:
        if (
            not isinstance(entry, (list, tuple))
            or len(entry) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry)
        ):
            raise ValueError(f"{name} entries must be [first, last, K] integers, got {entry!r}")
        first, last, k = entry
        if first < 1 or last < first or k < 0:
            raise ValueError(f"{name} entry {list(entry)} needs 1 <= first <= last and K >= 0")
        entries.append((first, last, k))
    entries.sort()
    if entries[0][0] != 1:
        raise ValueError(f"{name}: the first range must start at batch size 1, got {entries[0]}")
    for (_, last, _), (first, _, _) in zip(entries, entries[1:], strict=False):
        if first <= last:
            raise ValueError(f"{name}: ranges overlap at batch size {first}")
    return tuple(entries)


def _read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"speculative_config.model {model_dir!r} has no config.json")
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def _check_combinations(method: str, target: SpeculationTarget) -> None:
    """Engine options a draft model or head cannot run with yet (``docs/spec_decode.md``)."""
    if target.tensor_parallel_size > 1:
        raise ValueError(
            f"speculative_config.method {method!r} with tensor_parallel_size "
            f"{target.tensor_parallel_size} is not supported yet (the draft's sharding rules "
            "are not written); method 'ngram' is"
        )
    if target.enable_lora:
        raise ValueError(
            f"speculative_config.method {method!r} with enable_lora is not supported yet (the "
            "draft would run without the request's adapter); method 'ngram' is"
        )


def _check_draft(
    method: str, draft: dict, target: SpeculationTarget
) -> tuple[int | None, tuple[int, ...] | None]:
    """Vocabulary, hidden size and family checks; returns the draft's own context limit
    (draft_model; None for heads, whose RoPE follows the target's positions) and the EAGLE-3
    layer ids."""
    from models.registry import get_model_class  # imports the model code (JAX): only here

    tgt = target.hf_config_json
    vocab, draft_vocab = tgt.get("vocab_size"), draft.get("vocab_size")
    if draft_vocab != vocab:
        raise ValueError(
            f"speculative_config.model has vocab_size {draft_vocab} but the target has "
            f"{vocab}: the draft must share the target's vocabulary (same tokenizer)"
        )
    if method == "draft_model":
        get_model_class(types.SimpleNamespace(architectures=draft.get("architectures")))
        limit = draft.get("max_position_embeddings") or draft.get("n_positions") or 2048
        return int(limit), None
    target_class = get_model_class(types.SimpleNamespace(architectures=tgt.get("architectures")))
    if not getattr(target_class, "supports_aux_hidden_states", False):
        raise ValueError(
            f"speculative_config.method {method!r} needs a target that returns its hidden "
            f"states (the Llama family); {tgt.get('architectures')} does not"
        )
    target_hidden = draft.get("target_hidden_size") or draft.get("hidden_size")
    if target_hidden != tgt.get("hidden_size"):
        raise ValueError(
            f"speculative_config.model was trained on hidden states of size {target_hidden}, "
            f"but the target's hidden_size is {tgt.get('hidden_size')}"
        )
    if method == "eagle":
        return None, None
    from models.eagle3 import Eagle3Config  # the head's own checks (variants it lacks)

    Eagle3Config.from_dict(draft)
    return None, _aux_layer_ids(draft, int(tgt["num_hidden_layers"]))


def _aux_layer_ids(draft: dict, num_layers: int) -> tuple[int, ...]:
    """The EAGLE-3 head's target layers: ``eagle_aux_hidden_state_layer_ids`` (top level or in
    ``eagle_config``), else vLLM's default ``(2, L // 2, L - 3)``; index ``i`` is the residual
    stream entering layer ``i`` (``i = L``: leaving the last layer, before the final norm)."""
    eagle_config = draft.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state", True) is False:
        raise ValueError(
            "speculative_config.model: eagle_config.use_aux_hidden_state = false (an EAGLE-1 "
            "style head in an EAGLE-3 checkpoint) is not supported"
        )
    ids = draft.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    ids = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    if any(not isinstance(i, int) or not 0 <= i <= num_layers for i in ids):
        raise ValueError(
            f"EAGLE-3 layer ids {list(ids)} must lie in [0, {num_layers}] for a target of "
            f"{num_layers} layers (set eagle_aux_hidden_state_layer_ids in the head's config)"
        )
    num_aux = draft.get("num_aux_hidden_states")
    if num_aux is not None and num_aux != len(ids):
        raise ValueError(
            f"EAGLE-3 config: num_aux_hidden_states ({num_aux}) != number of layer ids {len(ids)}"
        )
    return ids


def _spec_max_model_len(value: Any, target_limit: int, draft_limit: int | None) -> int:
    limits = [("the target's max_model_len", target_limit)]
    if draft_limit is not None:
        limits.append(("the draft model's max_position_embeddings", draft_limit))
    if value is None:
        return min(limit for _, limit in limits)
    _check_int("max_model_len", value, minimum=1)
    for name, limit in limits:
        if value > limit:
            raise ValueError(
                f"speculative_config.max_model_len ({value}) cannot be larger than {name} ({limit})"
            )
    return value
