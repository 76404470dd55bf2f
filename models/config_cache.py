"""The model's resolved HF config, kept on disk so that a warm start need not import transformers.

``transformers.AutoConfig`` fills a checkpoint's ``config.json`` with its class's defaults
(``LlamaConfig``'s ``rope_theta``, ``rms_norm_eps``, ...), renames older keys (``rope_scaling`` ->
``rope_parameters``) and maps aliases (``attribute_map``: GPT-2's ``hidden_size`` is ``n_embd``).
Importing transformers takes seconds, most of them PyTorch's import when it is installed (9.8 s of
an 18 s warm start on the H200; docs/benchmarks.md, "Start-up and checkpoint loading"). The first start therefore stores what the engine reads
of the resolved config, and a later start with the same ``config.json`` rebuilds it as a
``CachedConfig`` without importing transformers.

An entry is one JSON file ``<cache_dir>/hf_configs/<key>.json``: the config class's name, its
instance attributes (``vars(config)``), the values of its public properties (``rope_scaling``,
``num_labels``, ...) and its ``attribute_map``. ``config_cache_key`` hashes the ``config.json``
bytes, the model directory's path (``_name_or_path`` is an attribute) and the installed
transformers version (read from its package metadata, not imported), so a changed config, another
directory or another transformers release never reads a stale entry. A config with a value that
JSON cannot hold (other than the dtype, stored by name) is not stored: it is always read with
transformers.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# Bumped when an entry's layout changes: older entries are then never read.
_FORMAT = 1
_SUBDIR = "hf_configs"
# Deprecated aliases transformers warns about when read (of ``dtype``, ``return_dict``): not
# stored, so a ``CachedConfig`` has no such attribute.
_DEPRECATED_ALIASES = frozenset({"torch_dtype", "use_return_dict"})


class CachedConfig:
    """A stored HF config: attribute reads (``getattr`` with or without default, ``vars``),
    attribute writes, ``copy.deepcopy`` and pickle behave as on the ``PreTrainedConfig`` it was
    taken from, except that the dtype is a name (``"bfloat16"``, not ``torch.bfloat16``).

    Reads follow transformers' order: an ``attribute_map`` alias first, then the instance
    attributes, then the stored property values (a snapshot: they do not follow later writes).
    Missing names raise ``AttributeError``.
    """

    # The bookkeeping lives in slots so that ``vars(config)`` is the config's attributes only.
    __slots__ = ("class_name", "_properties", "_attribute_map", "__dict__")

    def __init__(self, class_name: str, attributes: dict, properties: dict, attribute_map: dict):
        object.__setattr__(self, "class_name", class_name)  # e.g. "LlamaConfig"
        object.__setattr__(self, "_properties", properties)
        object.__setattr__(self, "_attribute_map", attribute_map)
        vars(self).update(attributes)

    def __getattribute__(self, name: str) -> Any:
        attribute_map = object.__getattribute__(self, "_attribute_map")
        return object.__getattribute__(self, attribute_map.get(name, name))

    def __getattr__(self, name: str) -> Any:  # names not found by __getattribute__
        properties = object.__getattribute__(self, "_properties")
        if name in properties:
            return properties[name]
        raise AttributeError(f"{self.class_name} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, self._attribute_map.get(name, name), value)

    def __reduce__(self):  # copy.deepcopy (models.sharding.tp_model_config) and pickle
        return (
            CachedConfig,
            (self.class_name, dict(vars(self)), self._properties, self._attribute_map),
        )

    def __repr__(self) -> str:
        return f"CachedConfig({self.class_name}, {vars(self)})"


def config_cache_key(model_dir: str) -> str:
    """SHA-256 (hex, 32 digits) of ``model_dir``'s ``config.json`` bytes, its absolute path, the
    installed transformers version and this cache's format.

    Raises:
        OSError: ``config.json`` cannot be read.
    """
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        digest = hashlib.sha256(f.read())
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    digest.update(json.dumps([os.path.abspath(model_dir), version, _FORMAT]).encode())
    return digest.hexdigest()[:32]


def read_cached_config(model_dir: str, cache_dir: str) -> CachedConfig | None:
    """The stored config of ``model_dir`` (``CachedConfig``), or None: no entry for this
    ``config.json`` and transformers version, or an unreadable one (a warning; it is rewritten
    by the next ``write_cached_config``)."""
    try:
        path = _entry_path(cache_dir, config_cache_key(model_dir))
    except OSError:
        return None  # no config.json: the caller reports it
    try:
        with open(path) as f:
            entry = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("ignoring the unreadable config cache entry %s: %s", path, error)
        return None
    try:
        return CachedConfig(
            entry["class_name"],
            {name: _decode(value) for name, value in entry["attributes"].items()},
            {name: _decode(value) for name, value in entry["properties"].items()},
            entry["attribute_map"],
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        logger.warning("ignoring the malformed config cache entry %s: %s", path, error)
        return None


def write_cached_config(model_dir: str, cache_dir: str, hf_config: Any) -> bool:
    """Store ``hf_config`` (a transformers ``PreTrainedConfig`` read from ``model_dir``) for
    ``read_cached_config``. Returns False, storing nothing, when a value cannot be stored
    exactly (the next start reads the config with transformers again); a failure to write only
    logs."""
    attributes = _encode(vars(hf_config))
    properties = _property_values(hf_config)
    if attributes is None:
        logger.debug("config of %s has values JSON cannot hold: not cached", model_dir)
        return False
    entry = {
        "class_name": type(hf_config).__name__,
        "attributes": attributes,
        "properties": properties,
        "attribute_map": dict(getattr(type(hf_config), "attribute_map", {}) or {}),
    }
    try:
        path = _entry_path(cache_dir, config_cache_key(model_dir))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)  # atomic: a concurrent start reads the old entry or the new one
    except OSError as error:
        logger.warning("could not store the config cache entry for %s: %s", model_dir, error)
        return False
    return True


def _entry_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, _SUBDIR, f"{key}.json")


def _property_values(hf_config: Any) -> dict:
    """Values of the config class's public properties, encoded as ``_encode`` does (those that
    cannot be stored are left out: reading them from a ``CachedConfig`` raises
    ``AttributeError``)."""
    values = {}
    for klass in type(hf_config).__mro__:
        for name, member in vars(klass).items():
            if name.startswith("_") or name in values or not isinstance(member, property):
                continue
            if name in _DEPRECATED_ALIASES:
                continue
            try:
                values[name] = _encode_value(getattr(hf_config, name))
            except Exception:  # noqa: BLE001  (a property that cannot be read is not stored)
                continue
    return values


class _NotStorable(Exception):
    pass


def _encode(attributes: dict) -> dict | None:
    """``attributes`` as JSON values (None: one cannot be stored exactly). A torch dtype becomes
    ``{"__dtype__": name}``, a tuple ``{"__tuple__": [...]}``, a dict with non-string keys
    (``id2label``) ``{"__items__": [[key, value], ...]}``."""
    try:
        return {name: _encode_value(value) for name, value in attributes.items()}
    except _NotStorable:
        return None


def _encode_value(value: Any) -> Any:
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_encode_value(v) for v in value]
    if type(value) is tuple:
        return {"__tuple__": [_encode_value(v) for v in value]}
    if type(value) is dict:
        if all(type(k) is str for k in value) and not set(value) & _TAGS:
            return {k: _encode_value(v) for k, v in value.items()}
        if all(type(k) in (str, int) for k in value):
            return {"__items__": [[k, _encode_value(v)] for k, v in value.items()]}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"__dtype__": str(value).removeprefix("torch.")}
    raise _NotStorable(type(value).__name__)


def _decode(value: Any) -> Any:
    if type(value) is list:
        return [_decode(v) for v in value]
    if type(value) is not dict:
        return value
    if set(value) == {"__dtype__"}:
        return value["__dtype__"]
    if set(value) == {"__tuple__"}:
        return tuple(_decode(v) for v in value["__tuple__"])
    if set(value) == {"__items__"}:
        return {k: _decode(v) for k, v in value["__items__"]}
    return {k: _decode(v) for k, v in value.items()}


_TAGS = {"__dtype__", "__tuple__", "__items__"}
