"""FP8 KV-cache scales from a checkpoint (models.kv_scales) and their attachment to a model."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxpaged import LLM, SamplingParams
from models.kv_scales import attach_kv_scales, read_kv_scales
from models.weights import load_model
from tests.conftest import SMALL_ENGINE


def _scales(num_layers, skip=None):
    tensors = {}
    for i in range(num_layers):
        for kind, base in (("k", 0.01), ("v", 0.02)):
            name = f"model.layers.{i}.self_attn.{kind}_scale"
            if name != skip:
                tensors[name] = np.asarray(base * (i + 1), np.float32)
    return tensors


def test_scales_are_read_per_layer_from_any_safetensors_file(tmp_path):
    save_file(_scales(3), str(tmp_path / "kv_scales.safetensors"))
    got = read_kv_scales(str(tmp_path), 3)
    np.testing.assert_allclose(got, [(0.01 * (i + 1), 0.02 * (i + 1)) for i in range(3)])
    assert read_kv_scales(str(tmp_path / "nothing_here"), 3) is None


def test_incomplete_or_bad_scales_are_refused_naming_the_tensor(tmp_path):
    save_file(_scales(3, skip="model.layers.1.self_attn.v_scale"), str(tmp_path / "a.safetensors"))
    with pytest.raises(ValueError, match=r"not model\.layers\.1\.self_attn\.v_scale"):
        read_kv_scales(str(tmp_path), 3)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"model.layers.0.self_attn.k_scale": np.float32([0.0])}, str(bad / "a.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale must be finite"):
        read_kv_scales(str(bad), 1)


def _cache_after_one_prompt(llm, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    k, v = llm.llm_engine.worker.model_runner.kv_caches[0]
    return out.outputs[0].token_ids, np.asarray(k, np.float32), np.asarray(v, np.float32)


def test_the_engine_stores_and_reads_kv_with_the_checkpoints_scales(tmp_path, stories_dir, golden):
    """Scales of 1/4 (K) and 1/2 (V), powers of two: every cache entry in e4m3's normal range
    is exactly 4x (2x) the unit-scale engine's, and the greedy tokens are the same."""
    for name in os.listdir(stories_dir):  # stories260k plus one file of scales
        os.symlink(os.path.join(stories_dir, name), tmp_path / name)
    scales = {}
    for i in range(5):
        scales[f"model.layers.{i}.self_attn.k_scale"] = np.asarray(0.25, np.float32)
        scales[f"model.layers.{i}.self_attn.v_scale"] = np.asarray([0.5], np.float32)
    save_file(scales, str(tmp_path / "kv_scales.safetensors"))
    prompt = golden["cases"][1]["prompt_ids"]
    scaled = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp8", **SMALL_ENGINE)
    assert scaled.llm_engine.worker.kv_scales == [(0.25, 0.5)] * 5
    unit = LLM(dtype="float32", kv_cache_dtype="fp8", **SMALL_ENGINE)
    assert unit.llm_engine.worker.kv_scales == [(1.0, 1.0)] * 5
    tokens, k, v = _cache_after_one_prompt(scaled, prompt)
    unit_tokens, k1, v1 = _cache_after_one_prompt(unit, prompt)
    assert tokens == unit_tokens
    for got, base, factor in ((k, k1, 4.0), (v, v1, 2.0)):
        normal = (np.abs(base) >= 2.0**-6) & (np.abs(base) * factor <= 448)
        assert normal.sum() > 100
        np.testing.assert_array_equal(got[normal], factor * base[normal])


def test_attaching_scales_for_the_wrong_number_of_layers_is_refused(stories_dir):
    model, _ = load_model(stories_dir, dtype="float32")
    with pytest.raises(ValueError, match="has 5 attention layers .* got scales for 2 layers"):
        attach_kv_scales(model, [(1.0, 1.0)] * 2)
