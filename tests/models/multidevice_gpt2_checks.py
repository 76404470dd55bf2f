"""Tensor-parallel checks of GPT-2 and BLOOM on 2 devices; run by ``test_gpt2.py`` in a
subprocess (the file name keeps plain ``pytest`` from collecting it in the one-device process).

BLOOM's fused ``query_key_value`` interleaves q/k/v per head; under ``tp=2`` each device must
get its own heads' q, k and v columns and its own heads' ALiBi slopes. GPT-2's ``c_attn`` is
split by columns ``[q | k | v]``. References: HF greedy ids, and the one-device model's logits
(itself checked against HF in ``test_gpt2.py``).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from models.sharded_weights import load_sharded_model
from models.sharding import kv_cache_sharding, make_mesh
from models.weights import load_model
from tests.models.conftest import PagedRunner, relative_diff
from tests.models.test_gpt2 import VOCAB, hf_greedy, make_checkpoint

NUM_DEVICES = 2
# Sharded against one device: the all-reduces add partial sums in another order (float32 ulps).
LOGITS_RTOL = 1e-5
PROMPTS = [[int(t) for t in np.random.default_rng(3).integers(0, VOCAB, n)] for n in (13, 5)]


@pytest.fixture(scope="module", autouse=True)
def _two_devices():
    if jax.device_count() < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} devices (--xla_force_host_platform_device_count)")


def _prefill_logits(model, config, mesh=None) -> np.ndarray:
    heads = config.num_attention_heads
    runner = PagedRunner(
        model, num_layers=config.num_hidden_layers, num_kv_heads=heads,
        head_dim=config.hidden_size // heads,
    )  # fmt: skip
    if mesh is not None:  # as the engine holds them: split over KV heads
        sharding = kv_cache_sharding(mesh)
        runner.kv_caches = [
            (jax.device_put(k, sharding), jax.device_put(v, sharding)) for k, v in runner.kv_caches
        ]
    return np.concatenate([np.stack(s.logits) for s in runner.generate(PROMPTS, 1)])


@pytest.mark.parametrize(
    "architecture, backend", [("GPT2LMHeadModel", "reference"), ("BloomForCausalLM", "pallas")]
)
def test_sharded_logits_match_one_device(tmp_path, architecture, backend):
    """BLOOM on the Pallas backend: each shard's kernels take that shard's ALiBi slopes."""
    path = make_checkpoint(str(tmp_path / architecture), architecture)
    one, config = load_model(path)
    sharded, _ = load_sharded_model(
        path, mesh=make_mesh(NUM_DEVICES), attention_backend=backend, interpret=True
    )
    qkv = sharded.model.layers[0].self_attn.qkv_proj.kernel[...]
    assert [s.data.shape[1] for s in qkv.addressable_shards] == [qkv.shape[1] // 2] * 2
    mesh = make_mesh(NUM_DEVICES)
    diff = relative_diff(_prefill_logits(sharded, config, mesh), _prefill_logits(one, config))
    assert diff < LOGITS_RTOL


def test_bloom_tensor_parallel_engine_matches_hf_greedy(tmp_path):
    path = make_checkpoint(str(tmp_path / "bloom"), "BloomForCausalLM")
    llm = LLM(
        path, tensor_parallel_size=NUM_DEVICES, dtype="float32", skip_tokenizer_init=True,
        max_model_len=32, max_num_seqs=2, max_num_batched_tokens=32, block_size=8,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(path, PROMPTS, 10)
