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
from models.weights import hf_names, load_model, resolve_dtype
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
    # 5 layers x (qkv, o, gate_up, down, 2 norms) + embedding + norm; HF has 3 + 2 more a layer.
    assert (len(params), len(tensors)) == (32, 47)
    used = set()
    for path, value in params.items():
        names, transposed = hf_names(tuple(path.split(".")))
        parts = [tensors[name].T if transposed else tensors[name] for name in names]
        np.testing.assert_array_equal(value, np.concatenate(parts, axis=-1))
        used.update(names)
    assert used == set(tensors)
    assert model.lm_head is None  # tied: logits use embed_tokens
    assert config.num_key_value_heads == 4


def test_hf_names_map_fused_parameters_to_their_parts_in_column_order():
    assert hf_names(("model", "layers", 3, "self_attn", "qkv_proj", "kernel")) == (
        tuple(f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"),
        True,
    )
    assert hf_names(("model", "layers", 0, "mlp", "gate_up_proj", "bias")) == (
        ("model.layers.0.mlp.gate_proj.bias", "model.layers.0.mlp.up_proj.bias"),
        False,
    )
    assert hf_names(("model", "embed_tokens", "embedding")) == (
        ("model.embed_tokens.weight",),
        False,
    )
    assert hf_names(("lm_head", "kernel")) == (("lm_head.weight",), True)


@pytest.mark.parametrize("name", ["qwen2", "llama_bias"])
def test_fused_column_blocks_equal_the_checkpoint_tensors(tiny_checkpoints, name):
    """qkv_proj's columns are [q | k | v] and gate_up_proj's [gate | up] (one device), kernels
    and biases (Qwen2: q/k/v biases; Llama attention_bias / mlp_bias), read from the random
    checkpoint independently of the loader's name mapping."""
    path = tiny_checkpoints[name]
    params = _flat_params(load_model(path)[0])
    tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    q, kv = 4 * 16, 2 * 16  # Hq x D, Hkv x D of the tiny configs
    blocks = {"self_attn.qkv_proj": {"q_proj": (0, q), "k_proj": (q, q + kv),
                                     "v_proj": (q + kv, q + 2 * kv)},
              "mlp.gate_up_proj": {"gate_proj": (0, 96), "up_proj": (96, 192)}}  # fmt: skip
    for layer in range(2):
        for fused, parts in blocks.items():
            prefix = f"model.layers.{layer}.{fused.split('.')[0]}"
            kernel = params[f"model.layers.{layer}.{fused}.kernel"]
            bias = params.get(f"model.layers.{layer}.{fused}.bias")  # Qwen2: no MLP bias
            assert kernel.shape == (64, max(hi for _, hi in parts.values()))
            for part, (lo, hi) in parts.items():
                weight = tensors[f"{prefix}.{part}.weight"]
                np.testing.assert_array_equal(kernel[:, lo:hi], weight.T)
                assert (bias is None) == (f"{prefix}.{part}.bias" not in tensors)
                if bias is not None:
                    np.testing.assert_array_equal(bias[lo:hi], tensors[f"{prefix}.{part}.bias"])
                    assert np.all(bias[lo:hi] != 0)


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
    bias = "model.layers.0.self_attn.qkv_proj.bias"
    np.testing.assert_array_equal(f32[bias], params[bias].astype(np.float32))
    assert np.any(f32[bias] != 0)


def test_dummy_load_needs_only_config_and_is_deterministic(tmp_path):
    config_dir = _copy_config_only(STORIES_DIR, str(tmp_path / "cfg"))
    model, _ = load_model(config_dir, load_format="dummy", dtype="bfloat16", seed=3)
    params = _flat_params(model)
    real = _flat_params(load_model(STORIES_DIR)[0])
    assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in real.items()}
    assert {v.dtype for v in params.values()} == {jnp.dtype(jnp.bfloat16)}
    for fused in ("self_attn.qkv_proj", "mlp.gate_up_proj"):  # the same draw as any kernel
        kernel = params[f"model.layers.0.{fused}.kernel"].astype(np.float32)
        assert 0.01 < kernel.std() < 0.03 and abs(kernel.mean()) < 0.005
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
    match = (
        r"model\.layers\.3\.mlp\.gate_up_proj\.kernel "
        r"\(HF name 'model\.layers\.3\.mlp\.up_proj\.weight'\) has shape \(100, 64\)"
        r".*expected \(172, 64\)"
    )
    with pytest.raises(ValueError, match=match):
        load_model(path)


def test_missing_parameter_is_named(tmp_path):
    path = _with_tensors(tmp_path, lambda t: t.pop("model.layers.2.self_attn.v_proj.weight"))
    match = (
        r"model\.layers\.2\.self_attn\.qkv_proj\.kernel "
        r"\(HF name 'model\.layers\.2\.self_attn\.v_proj\.weight'\) is missing"
    )
    with pytest.raises(ValueError, match=match):
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


def test_a_float_tensor_stored_as_integers_is_refused_naming_it(tmp_path):
    """A header marking a float tensor ``I32`` loaded silently (its bits read as integers, cast
    to float) and changed every output; the loaders now check dtypes as update_weights does."""
    name = "model.layers.0.self_attn.q_proj.weight"
    path = _with_tensors(tmp_path, lambda t: t.update({name: t[name].view(np.int32)}))
    match = (
        r"model\.layers\.0\.self_attn\.qkv_proj\.kernel \(HF name "
        r"'model\.layers\.0\.self_attn\.q_proj\.weight'\) has dtype int32 .*expected a floating"
    )
    with pytest.raises(ValueError, match=match):
        load_model(path)
    # A float16 tensor in a float32 checkpoint is a float: cast, as before.
    half = _with_tensors(tmp_path / "half", lambda t: t.update({name: t[name].astype(np.float16)}))
    load_model(half)


def test_a_config_with_more_layers_than_the_checkpoint_fails_before_building(tmp_path, monkeypatch):
    """``num_hidden_layers: 100000`` ran 180 s and 1.7 GB (the abstract model of 100000
    layers) before the first missing tensor was found."""
    import models.weights

    path = _with_tensors(tmp_path, lambda t: None)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config | {"num_hidden_layers": 100000}, f)

    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(models.weights, "abstract_model", never)
    with pytest.raises(ValueError, match=r"num_hidden_layers is 100000, but the checkpoint"):
        load_model(path)
