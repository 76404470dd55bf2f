"""models.weights: safetensors (single and sharded) loading, dummy init, dtypes, and errors."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from models.llama import LlamaForCausalLM
from models.weights import hf_name, load_model, resolve_dtype
from tests.models.conftest import STORIES_DIR, make_hf_checkpoint


def _flat_params(model) -> dict[str, np.ndarray]:
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _copy_config_only(src: str, dst: str) -> str:
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    return dst


def test_stories260k_loads_every_tensor_by_hf_name():
    model, config = load_model(STORIES_DIR)
    assert isinstance(model, LlamaForCausalLM)
    params = _flat_params(model)
    assert sum(v.size for v in params.values()) == 260_032
    assert all(v.dtype == np.float32 for v in params.values())
    tensors = safetensors.numpy.load_file(os.path.join(STORIES_DIR, "model.safetensors"))
    assert len(params) == len(tensors) == 47
    for path, value in params.items():
        name, transposed = hf_name(tuple(path.split(".")))
        np.testing.assert_array_equal(value, tensors[name].T if transposed else tensors[name])
    assert model.lm_head is None  # tied: logits use embed_tokens
    assert config.num_key_value_heads == 4


def test_sharded_index_loads_same_weights_as_single_file(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama3"]
    tensors = safetensors.numpy.load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    dst = _copy_config_only(src, str(tmp_path / "sharded"))
    weight_map = {}
    for file, shard_names in shards.items():
        safetensors.numpy.save_file(
            {n: tensors[n] for n in shard_names}, os.path.join(dst, file), metadata={"format": "pt"}
        )
        weight_map.update({n: file for n in shard_names})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)

    sharded = _flat_params(load_model(dst)[0])
    single = _flat_params(load_model(src)[0])
    assert sharded.keys() == single.keys()
    for key in single:
        np.testing.assert_array_equal(sharded[key], single[key])


def test_bfloat16_checkpoint_loads_as_bfloat16(tmp_path):
    pytest.importorskip("torch")
    path = make_hf_checkpoint(str(tmp_path / "bf16"), "qwen2", dtype="bfloat16")
    model, _ = load_model(path)  # dtype="auto": the config's bfloat16
    params = _flat_params(model)
    assert {v.dtype for v in params.values()} == {jnp.dtype(jnp.bfloat16)}
    f32 = _flat_params(load_model(path, dtype="float32")[0])
    bias = "model.layers.0.self_attn.q_proj.bias"
    np.testing.assert_array_equal(f32[bias], params[bias].astype(np.float32))
    assert np.any(f32[bias] != 0)


def test_dummy_load_needs_only_config_and_is_deterministic(tmp_path):
    config_dir = _copy_config_only(STORIES_DIR, str(tmp_path / "cfg"))
    model, _ = load_model(config_dir, load_format="dummy", dtype="bfloat16", seed=3)
    params = _flat_params(model)
    real = _flat_params(load_model(STORIES_DIR)[0])
    assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in real.items()}
    assert {v.dtype for v in params.values()} == {jnp.dtype(jnp.bfloat16)}
    q = params["model.layers.0.self_attn.q_proj.kernel"].astype(np.float32)
    assert 0.01 < q.std() < 0.03
    np.testing.assert_array_equal(params["model.norm.weight"].astype(np.float32), 1.0)
    again = _flat_params(load_model(config_dir, load_format="dummy", dtype="bfloat16", seed=3)[0])
    other = _flat_params(load_model(config_dir, load_format="dummy", dtype="bfloat16", seed=4)[0])
    key = "model.embed_tokens.embedding"
    np.testing.assert_array_equal(params[key], again[key])
    assert not np.array_equal(params[key], other[key])


def test_load_builds_abstractly_without_random_init(monkeypatch):
    """The real-shape random init would double peak memory for big models: the model must be
    constructed under tracing (nnx.eval_shape), never with concrete random arrays."""
    built = []
    init = LlamaForCausalLM.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self.model.embed_tokens.embedding.get_value())

    monkeypatch.setattr(LlamaForCausalLM, "__init__", spy)
    load_model(STORIES_DIR)
    assert built and all(isinstance(v, jax.core.Tracer) for v in built)


def test_missing_directory_raises_naming_it(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="nope"):
        load_model(missing)


def test_missing_config_json_raises_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_missing_weights_raise_unless_dummy(tmp_path):
    config_dir = _copy_config_only(STORIES_DIR, str(tmp_path / "cfg"))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(config_dir)


def test_unsupported_architecture_raises(tmp_path):
    config_dir = _copy_config_only(STORIES_DIR, str(tmp_path / "cfg"))
    with open(os.path.join(config_dir, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["LlamaForSequenceClassification"]
    with open(os.path.join(config_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="LlamaForSequenceClassification"):
        load_model(config_dir, load_format="dummy")


def _with_tensors(tmp_path, edit) -> str:
    dst = _copy_config_only(STORIES_DIR, str(tmp_path / "edited"))
    tensors = safetensors.numpy.load_file(os.path.join(STORIES_DIR, "model.safetensors"))
    edit(tensors)
    safetensors.numpy.save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_shape_mismatch_names_the_parameter(tmp_path):
    name = "model.layers.3.mlp.up_proj.weight"
    path = _with_tensors(tmp_path, lambda t: t.update({name: t[name][:100]}))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.up_proj\.kernel.*shape"):
        load_model(path)


def test_missing_parameter_is_named(tmp_path):
    path = _with_tensors(tmp_path, lambda t: t.pop("model.layers.2.self_attn.v_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.v_proj\.kernel.*missing"):
        load_model(path)


@pytest.mark.parametrize("bad", [dict(dtype="float8"), dict(load_format="pt")])
def test_bad_options_raise(bad):
    with pytest.raises(ValueError, match=str(next(iter(bad.values())))):
        load_model(STORIES_DIR, **bad)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("auto", jnp.float32),
        ("float", jnp.float32),
        ("half", jnp.float16),
        ("bfloat16", jnp.bfloat16),
        (jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_resolve_dtype(dtype, expected):
    class Config:
        pass

    assert resolve_dtype(dtype, Config()) == jnp.dtype(expected)
