"""The stored HF config (``models.config_cache``) against transformers' own.

- every architecture's tiny config (``TINY_CONFIGS``, ``FAMILY_CONFIGS``, GPT-2, BLOOM, and the
  real stories260k): the model is built through ``load_model`` from a proxy that serves the
  ``CachedConfig``'s values and checks each one the code reads (present or missing, ``vars``
  included) against the transformers config's; the built models have equal parameters and
  equal float32 logits (stories260k: its real weights);
- the engine: a second ``LLM`` with the cache on reads the stored config, gives the same greedy
  tokens and log-probabilities, and (fresh process) never imports transformers, while the
  first does;
- a changed ``config.json`` (or another transformers version) misses; a corrupt entry is ignored.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config_cache
from models.config_cache import CachedConfig, read_cached_config
from models.registry import get_model_class
from models.sharding import tp_model_config
from models.tp_layout import TPLayout
from models.weights import (
    abstract_model,
    load_config,
    load_model,
    model_quantization,
    resolve_dtype,
)
from tests.models.conftest import FAMILY_CONFIGS, STORIES_DIR, TINY_CONFIGS, make_hf_config

transformers = pytest.importorskip("transformers")

_MISSING = object()
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _normal(value):
    """A torch dtype and its stored name compare equal ("torch.float32" == "float32")."""
    text = str(value)
    return text.removeprefix("torch.") if text.startswith("torch.") else value


class _Checked:
    """Serves ``cached``'s attributes; every read must agree with ``reference``'s."""

    __slots__ = ("_cached", "_reference", "reads")

    def __init__(self, cached, reference):
        object.__setattr__(self, "_cached", cached)
        object.__setattr__(self, "_reference", reference)
        object.__setattr__(self, "reads", set())

    def __getattr__(self, name):
        got = getattr(self._cached, name, _MISSING)
        want = getattr(self._reference, name, _MISSING)
        assert (got is _MISSING) == (want is _MISSING), f"{name}: {got!r} vs {want!r}"
        assert _normal(got) == _normal(want), f"{name}: {got!r} vs {want!r}"
        self.reads.add(name)
        if got is _MISSING:
            raise AttributeError(name)
        return got

    @property
    def __dict__(self):
        assert vars(self._cached).keys() == vars(self._reference).keys()
        self.reads.add("__dict__")
        return vars(self._cached)


def _config_dirs(root) -> dict[str, str]:
    configs = {name: make_hf_config(name) for name in {**TINY_CONFIGS, **FAMILY_CONFIGS}}
    configs["gpt2"] = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.1,
        bos_token_id=0, eos_token_id=0, architectures=["GPT2LMHeadModel"],
    )  # fmt: skip
    configs["bloom"] = transformers.BloomConfig(
        vocab_size=128, hidden_size=96, n_layer=2, n_head=6, architectures=["BloomForCausalLM"]
    )
    dirs = {}
    for name, config in configs.items():
        dirs[name] = str(root / name)
        config.save_pretrained(dirs[name])
    dirs["stories260k"] = STORIES_DIR
    return dirs


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    return _config_dirs(tmp_path_factory.mktemp("configs"))


def _cached(model_dir, cache_dir) -> tuple[CachedConfig, object]:
    reference = load_config(model_dir, cache_dir=str(cache_dir))  # miss: stores the entry
    cached = load_config(model_dir, cache_dir=str(cache_dir))
    assert isinstance(cached, CachedConfig) and not isinstance(reference, CachedConfig)
    assert cached.class_name == type(reference).__name__
    return cached, reference


def _logits(model, hf_config, tokens: list[int]) -> np.ndarray:
    from models.attention import kv_cache_head_dim
    from tests.models.conftest import PagedRunner

    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    runner = PagedRunner(
        model,
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=kv_cache_head_dim(head_dim, "reference"),
    )
    return np.stack(runner.generate([tokens], 2)[0].logits)


# Sliding windows and soft caps (dummy weights); a real checkpoint read through the loader.
_WITH_LOGITS = ("gemma2", "stories260k")


def _abstract(hf_config):
    dtype = resolve_dtype("auto", hf_config)
    assert model_quantization(hf_config, None, "dummy") is None
    return abstract_model(
        get_model_class(hf_config), hf_config, dtype,
        attention_backend="reference", interpret=False, seed=0,
    )  # fmt: skip


@pytest.mark.parametrize("name", [*TINY_CONFIGS, *FAMILY_CONFIGS, "gpt2", "bloom", "stories260k"])
def test_model_reads_the_same_values(config_dirs, tmp_path, name):
    model_dir = config_dirs[name]
    cached, reference = _cached(model_dir, tmp_path)
    checked = _Checked(cached, reference)
    if name in _WITH_LOGITS:  # the whole loader, and the logits
        load_format = "auto" if name == "stories260k" else "dummy"
        ours, _ = load_model(model_dir, load_format=load_format, hf_config=checked)
        theirs, _ = load_model(model_dir, load_format=load_format, hf_config=reference)
        leaves = [jax.tree.leaves(nnx.state(m)) for m in (ours, theirs)]
        for x, y in zip(*leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        tokens = [3, 17, 5, 9, 11, 2, 30, 7]
        np.testing.assert_allclose(
            _logits(ours, cached, tokens), _logits(theirs, reference, tokens), rtol=0, atol=1e-6
        )
    else:  # what load_model reads before it fills the weights (dummy weights follow the seed)
        ours, theirs = (_abstract(config) for config in (checked, reference))
        shapes = [jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(m)) for m in (ours, theirs)]
        assert shapes[0] == shapes[1]
    assert {"architectures", "hidden_size", "vocab_size"} <= checked.reads
    # Equal static structure (every config-derived module attribute).
    assert nnx.graphdef(ours) == nnx.graphdef(theirs)
    # What the worker, the LoRA manager and the tensor-parallel loader read besides the model.
    model_class = get_model_class(reference)
    if "lora_projection_specs" in vars(model_class):
        assert model_class.lora_projection_specs(checked) == model_class.lora_projection_specs(
            reference
        )
    for config in (cached, reference):
        assert int(config.num_hidden_layers) and int(config.vocab_size)
    for tp in (1, 2, 4):
        try:
            layout = TPLayout.from_hf_config(reference, tp)
        except ValueError:
            continue
        assert TPLayout.from_hf_config(cached, tp) == layout
        physical_cached = tp_model_config(cached, layout)
        physical = tp_model_config(reference, layout)
        for key in ("num_key_value_heads", "intermediate_size", "hidden_size"):
            assert getattr(physical_cached, key) == getattr(physical, key)
        # tp_model_config changed a copy.
        assert getattr(cached, "num_key_value_heads", None) == getattr(
            reference, "num_key_value_heads", None
        )


def test_changed_config_misses(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(STORIES_DIR, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    cache = tmp_path / "cache"
    cached, _ = _cached(str(model_dir), cache)
    assert cached.num_hidden_layers == 5
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "num_hidden_layers": 3}))
    assert read_cached_config(str(model_dir), str(cache)) is None
    fresh = load_config(str(model_dir), cache_dir=str(cache))
    assert not isinstance(fresh, CachedConfig) and fresh.num_hidden_layers == 3
    assert read_cached_config(str(model_dir), str(cache)).num_hidden_layers == 3
    # Another transformers release: another key.
    key = config_cache.config_cache_key(str(model_dir))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.metadata, "version", lambda name: "0.0.0")
        assert config_cache.config_cache_key(str(model_dir)) != key
    # A corrupt entry is ignored (and rewritten by the next read through transformers).
    entry = cache / "hf_configs" / f"{key}.json"
    entry.write_text("{not json")
    assert read_cached_config(str(model_dir), str(cache)) is None
    assert not isinstance(load_config(str(model_dir), cache_dir=str(cache)), CachedConfig)
    assert read_cached_config(str(model_dir), str(cache)) is not None


def test_cached_config_aliases_copies_and_dtype(config_dirs, tmp_path):
    cached, reference = _cached(config_dirs["gpt2"], tmp_path)
    assert cached.hidden_size == cached.n_embd == reference.hidden_size == 64
    copied = copy.deepcopy(cached)
    copied.hidden_size = 32  # through the alias, as transformers does
    assert copied.n_embd == 32 and cached.n_embd == 64
    assert "hidden_size" not in vars(copied)
    with pytest.raises(AttributeError, match="no_such_field"):
        cached.no_such_field  # noqa: B018
    cached, reference = _cached(config_dirs["stories260k"], tmp_path)
    assert cached.dtype == "float32" and str(reference.dtype) == "torch.float32"
    assert cached.rope_scaling == reference.rope_scaling  # a property of PreTrainedConfig
    assert resolve_dtype("auto", cached) == resolve_dtype("auto", reference) == jnp.float32


_ENGINE = textwrap.dedent(
    """
    import json, sys
    from jaxpaged import LLM, SamplingParams
    llm = LLM(sys.argv[1], load_format="dummy", skip_tokenizer_init=True,
              compilation_cache_dir=sys.argv[2], max_model_len=64, max_num_seqs=2)
    out = llm.generate([{"prompt_token_ids": [1, 5, 9, 3]}],
                       SamplingParams(max_tokens=4, temperature=0, logprobs=1))[0].outputs[0]
    print(json.dumps({
        "transformers": "transformers" in sys.modules,
        "cached": type(llm.llm_engine.worker.hf_config).__name__ == "CachedConfig",
        "tokens": list(out.token_ids),
        "logprobs": [[v.logprob for v in step.values()] for step in out.logprobs],
    }))
    """
)


def test_warm_engine_does_not_import_transformers(tmp_path):
    model_dir = tmp_path / "model"  # config-only: dummy weights, no tokenizer
    os.makedirs(model_dir)
    shutil.copy(os.path.join(STORIES_DIR, "config.json"), model_dir)
    env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT), "JAX_PLATFORMS": "cpu"}
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _ENGINE, str(model_dir), str(tmp_path / "cache")],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["transformers"] and not cold["cached"]
    assert not warm["transformers"] and warm["cached"]
    assert warm["tokens"] == cold["tokens"]
    np.testing.assert_allclose(warm["logprobs"], cold["logprobs"], rtol=0, atol=1e-6)
