"""Tensor-parallel checks that need 8 devices; run by ``test_sharding.py`` in a subprocess.

The file name does not match ``test_*.py`` on purpose: plain ``pytest`` never collects it in the
main (one-device) process. ``test_sharding.py`` runs ``pytest`` on it with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``, which must be set before JAX starts.

References: ``golden.json`` (HF transformers greedy ids) and HF greedy for the tiny Qwen2;
logits against the unsharded model (itself checked against HF elsewhere in the suite). Logits
come from one ragged prefill step over a NaN-filled paged cache; decode steps are covered by the
engines' greedy runs. Compilations dominate the run time, so each check compiles few programs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jaxpaged import LLM, SamplingParams
from models import weights
from models.sharded_weights import load_sharded_model
from models.sharding import kv_cache_sharding, make_mesh
from models.weights import load_model
from tests.conftest import SMALL_ENGINE
from tests.models.conftest import STORIES_DIR, PagedRunner, make_hf_checkpoint, relative_diff

NUM_DEVICES = 8
# Sharded against one device: the all-reduces add partial sums in another order, a few
# float32 ulps of |logits| (<= ~20 here); the Pallas kernels against the references add ~1e-6.
LOGITS_RTOL = 1e-5
PROMPTS = [[1, 317, 269, 274, 287, 263, 377, 267, 265, 282, 295, 433, 426], [1, 403, 407, 261]]
QWEN2_PROMPTS = [[p % 128 for p in prompt] for prompt in PROMPTS]  # tiny vocab: 128


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() < NUM_DEVICES:
        pytest.skip(
            f"needs {NUM_DEVICES} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)"
        )


def _flat(state_or_model) -> dict[str, jax.Array]:
    state = state_or_model
    if isinstance(state_or_model, nnx.Module):
        state = nnx.state(state_or_model, nnx.Param)
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def _greedy(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _prefill_logits(model, prompts, *, num_kv_heads, head_dim, num_layers, mesh=None):
    """``f32[total prompt tokens, vocab]`` from one ragged prefill over a NaN paged cache."""
    runner = PagedRunner(model, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if mesh is not None:  # as the engine holds them: split over KV heads
        sharding = kv_cache_sharding(mesh)
        runner.kv_caches = [
            (jax.device_put(k, sharding), jax.device_put(v, sharding)) for k, v in runner.kv_caches
        ]
    seqs = runner.generate(prompts, 1)
    return np.concatenate([np.stack(s.logits) for s in seqs])


def _engine_model(llm):
    runner = llm.llm_engine.worker.model_runner
    return runner.weights.model()


@pytest.fixture(scope="module")
def stories_logits() -> np.ndarray:
    model, _ = load_model(STORIES_DIR)
    return _prefill_logits(model, PROMPTS, num_kv_heads=4, head_dim=8, num_layers=5)


# --------------------------------------------------------------------------- stories260k


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_engine_matches_golden_and_one_device_logits(tp, golden, stories_logits):
    llm = LLM(dtype="float32", tensor_parallel_size=tp, **SMALL_ENGINE)
    cases = golden["cases"]
    got = _greedy(llm, [c["prompt_ids"] for c in cases], golden["max_new_tokens"])
    assert got == [c["greedy_new_ids"] for c in cases]

    engine = llm.llm_engine
    logits = _prefill_logits(
        _engine_model(llm),
        PROMPTS,
        num_kv_heads=4,
        head_dim=8,
        num_layers=5,
        mesh=engine.worker.mesh,
    )
    assert relative_diff(logits, stories_logits) < LOGITS_RTOL

    # The KV cache is split over its 4 KV heads: each device holds 4 / tp of them.
    for k_cache, v_cache in engine.worker.model_runner.kv_caches:
        for cache in (k_cache, v_cache):
            assert cache.shape == pallas_kernels.kv_cache_shape(engine.num_blocks, 16, 4, 8)
            local = pallas_kernels.kv_cache_shape(engine.num_blocks, 16, 4 // tp, 8)
            assert [s.data.shape for s in cache.addressable_shards] == [local] * tp
    _check_stories_param_shardings(
        _flat(engine.worker.model_runner.weights.state()), engine.worker.mesh, tp
    )
    _check_step_updates_cache_shards_in_place(engine.worker.model_runner, num_seqs=len(cases))


def test_fp8_kv_cache_under_tensor_parallelism_matches_one_device(golden):
    """kv_cache_dtype="fp8": the per-layer scales are replicated and reach every shard's
    attention (shard_over_heads carries them with the metadata); tp=2 equals one device."""
    prompts = [golden["cases"][1]["prompt_ids"]]
    one, two = (
        LLM(dtype="float32", kv_cache_dtype="fp8", tensor_parallel_size=tp, **SMALL_ENGINE)
        for tp in (1, 2)
    )
    assert _greedy(two, prompts, 8) == _greedy(one, prompts, 8)
    k_cache, _ = two.llm_engine.worker.model_runner.kv_caches[0]
    assert k_cache.dtype == jnp.float8_e4m3fn and len(k_cache.addressable_shards) == 2


def _check_step_updates_cache_shards_in_place(runner, num_seqs):
    """The compiled decode step neither gathers a cache onto one device nor copies it: each
    device writes its own heads in place (only hidden-state all-reduces cross devices)."""
    hlo = runner._executables[runner.bucket_for(num_seqs, num_seqs, True)].as_text()
    cache = runner.kv_caches[0][0]
    local = cache.addressable_shards[0].data.shape
    shapes = {cache.shape, local}
    shapes |= {(shape[0] * shape[1], *shape[2:]) for shape in list(shapes)}  # flat slots
    dims = "|".join(re.escape(",".join(map(str, shape))) for shape in shapes)
    offending = [
        line
        for line in hlo.splitlines()
        if re.search(rf"\[({dims})\]\S* (copy|all-gather|all-to-all)\(", line)
    ]
    assert not offending, offending[:3]
    assert "all-reduce" in hlo


def _check_stories_param_shardings(params: dict, mesh, tp: int):
    """Every stories260k parameter's spec and per-device shape (hidden 64, Hq 8 x D 8,
    Hkv 4 x D 8, intermediate 172, vocab 512, tied embeddings)."""
    expected = {  # suffix -> (spec, per-device shape); written out, not derived from the rules
        "embed_tokens.embedding": (P("tp", None), (512 // tp, 64)),
        "qkv_proj.kernel": (P(None, "tp"), (64, (64 + 32 + 32) // tp)),
        "o_proj.kernel": (P("tp", None), (64 // tp, 64)),
        "gate_up_proj.kernel": (P(None, "tp"), (64, 2 * 172 // tp)),
        "down_proj.kernel": (P("tp", None), (172 // tp, 64)),
        "norm.weight": (P(), (64,)),
    }
    assert len(params) == 32
    for name, value in params.items():
        spec, local = next(v for k, v in expected.items() if name.endswith(k))
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim), name
        assert [s.data.shape for s in value.addressable_shards] == [local] * tp, name


def test_pallas_kernels_per_shard_with_repeated_kv_heads_and_padded_mlp(stories_logits):
    """tp=8 > Hkv=4: each KV head is held twice (one per device); the intermediate size 172 is
    padded to 176. The Pallas kernels (interpret mode) run per shard inside shard_map."""
    mesh = make_mesh(8)
    model, _ = load_sharded_model(
        STORIES_DIR, mesh=mesh, attention_backend="pallas", interpret=True
    )
    logits = _prefill_logits(model, PROMPTS, num_kv_heads=8, head_dim=8, num_layers=5, mesh=mesh)
    assert relative_diff(logits, stories_logits) < LOGITS_RTOL


# ------------------------------------------------------------------------- tiny Qwen2 (Hkv=2)


def _hf_greedy(model_dir, prompts, max_tokens):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
            results.append(ids[len(prompt) :])
    return results


def test_replicated_kv_heads_qwen2_matches_one_device(tmp_path, stories_dir):
    """Hkv=2 < tp=4: every device holds one copy of the KV head its query head reads; q/k/v
    biases split with their columns; layer 1 has a sliding window."""
    pytest.importorskip("torch")
    path = make_hf_checkpoint(str(tmp_path / "qwen2"), "qwen2")
    llm = LLM(
        model=path, tokenizer=stories_dir, dtype="float32", tensor_parallel_size=4, **SMALL_ENGINE
    )
    assert _greedy(llm, QWEN2_PROMPTS, 12) == _hf_greedy(path, QWEN2_PROMPTS, 12)

    engine = llm.llm_engine
    one, _ = load_model(path)
    ref = _prefill_logits(one, QWEN2_PROMPTS, num_kv_heads=2, head_dim=16, num_layers=2)
    logits = _prefill_logits(
        _engine_model(llm),
        QWEN2_PROMPTS,
        num_kv_heads=4,
        head_dim=16,
        num_layers=2,
        mesh=engine.worker.mesh,
    )
    assert relative_diff(logits, ref) < LOGITS_RTOL

    assert engine.worker.kv_cache_spec.num_kv_heads == 4
    local = pallas_kernels.kv_cache_shape(engine.num_blocks, 16, 1, 16)
    assert [
        s.data.shape for s in engine.worker.model_runner.kv_caches[0][0].addressable_shards
    ] == [local] * 4
    params = _flat(engine.worker.model_runner.weights.state())
    for name, local_shape in [("qkv_proj.bias", (3 * 16,)), ("qkv_proj.kernel", (64, 3 * 16))]:
        value = params[f"model.layers.0.self_attn.{name}"]
        assert [s.data.shape for s in value.addressable_shards] == [local_shape] * 4
    # Device d holds query head d, then KV head d // 2 (the checkpoint's head 0 on devices
    # 0-1, head 1 on 2-3) for k and for v.
    qkv_bias = {
        s.device.id: np.asarray(s.data)
        for s in params["model.layers.0.self_attn.qkv_proj.bias"].addressable_shards
    }
    checkpoint = np.asarray(_flat(one)["model.layers.0.self_attn.qkv_proj.bias"])
    q, k, v = checkpoint[:64].reshape(4, 16), checkpoint[64:96].reshape(2, 16), checkpoint[96:]
    v = v.reshape(2, 16)
    for rank, device in enumerate(engine.worker.mesh.devices.flat):
        np.testing.assert_array_equal(
            qkv_bias[device.id], np.concatenate([q[rank], k[rank // 2], v[rank // 2]])
        )


# ------------------------------------------------------------- Mixtral (MoE) and Phi-3 (fused)


def test_mixtral_experts_split_over_tp_match_hf_and_one_device(tmp_path, stories_dir):
    """tp=4: each device holds every expert's 32 / 4 intermediate columns (gate/up) and rows
    (down) and one copy of the KV head its query head reads (Hkv=2); the routed grouped matmuls
    run per device and one psum adds them."""
    pytest.importorskip("torch")
    path = make_hf_checkpoint(str(tmp_path / "mixtral"), "mixtral")
    llm = LLM(
        model=path, tokenizer=stories_dir, dtype="float32", tensor_parallel_size=4, **SMALL_ENGINE
    )
    assert _greedy(llm, QWEN2_PROMPTS, 8) == _hf_greedy(path, QWEN2_PROMPTS, 8)

    engine = llm.llm_engine
    one, _ = load_model(path)
    ref = _prefill_logits(one, QWEN2_PROMPTS, num_kv_heads=2, head_dim=16, num_layers=2)
    logits = _prefill_logits(
        _engine_model(llm), QWEN2_PROMPTS, num_kv_heads=4, head_dim=16, num_layers=2,
        mesh=engine.worker.mesh,
    )  # fmt: skip
    assert relative_diff(logits, ref) < LOGITS_RTOL
    params = _flat(engine.worker.model_runner.weights.state())
    experts = "model.layers.0.block_sparse_moe.experts"
    for name, local in [("gate_up_proj", (4, 64, 2 * 8)), ("down_proj", (4, 8, 64))]:
        assert [s.data.shape for s in params[f"{experts}.{name}"].addressable_shards] == [local] * 4
    # Device 1's gate_up block: its 8 columns of each expert's w1, then of w3.
    tensors = safetensors.numpy.load_file(f"{path}/model.safetensors")
    shard = next(
        np.asarray(s.data)
        for s in params[f"{experts}.gate_up_proj"].addressable_shards
        if s.device == engine.worker.mesh.devices.flat[1]
    )
    hf = "model.layers.0.block_sparse_moe.experts"
    for e in range(4):
        w1, w3 = tensors[f"{hf}.{e}.w1.weight"].T, tensors[f"{hf}.{e}.w3.weight"].T
        np.testing.assert_array_equal(shard[e], np.concatenate([w1[:, 8:16], w3[:, 8:16]], -1))


def test_phi3_fused_checkpoint_tensors_split_into_shards(tmp_path):
    """Phi-3 stores qkv_proj and gate_up_proj fused; at tp=2 each device reads its q, k, v
    (gate, up) rows out of them, and the logits equal one device's (D = 24)."""
    pytest.importorskip("torch")
    path = make_hf_checkpoint(str(tmp_path / "phi3"), "phi3")
    one, _ = load_model(path)
    ref = _prefill_logits(one, QWEN2_PROMPTS, num_kv_heads=2, head_dim=24, num_layers=2)
    mesh = make_mesh(2)
    model, _ = load_sharded_model(path, mesh=mesh)
    logits = _prefill_logits(
        model, QWEN2_PROMPTS, num_kv_heads=2, head_dim=24, num_layers=2, mesh=mesh
    )
    assert relative_diff(logits, ref) < LOGITS_RTOL
    qkv = _flat(model)["model.layers.1.self_attn.qkv_proj.kernel"]
    fused = safetensors.numpy.load_file(f"{path}/model.safetensors")[
        "model.layers.1.self_attn.qkv_proj.weight"
    ].T  # [96, q 96 | k 48 | v 48]: device 1 holds q heads 2-3 and KV head 1
    shard = {s.device: np.asarray(s.data) for s in qkv.addressable_shards}[mesh.devices.flat[1]]
    expected = np.concatenate([fused[:, 48:96], fused[:, 120:144], fused[:, 168:192]], -1)
    np.testing.assert_array_equal(shard, expected)


# ------------------------------------------------------------------------------------ loading


def _expected_physical(one: dict[str, np.ndarray], name: str) -> np.ndarray:
    """stories260k parameter ``name`` as the tp=8 model holds it, built with numpy from the
    one-device ``[q | k | v]`` and ``[gate | up]``: k/v columns repeat each of the 4 heads
    (D=8) twice in place; gate/up/down pad 172 -> 176 with zeros; the fused columns then go
    shard by shard, ``[q_s | k_s | v_s]`` and ``[gate_s | up_s]`` for s = 0..7."""
    value = one[name]
    if name.endswith("qkv_proj.kernel"):
        q, k, v = value[:, :64], value[:, 64:96], value[:, 96:]
        k, v = (np.repeat(x.reshape(64, 4, 8), 2, axis=1).reshape(64, 64) for x in (k, v))
        return np.concatenate([x.reshape(64, 8, 8) for x in (q, k, v)], axis=2).reshape(64, -1)
    if name.endswith("gate_up_proj.kernel"):
        gate, up = (np.pad(x, ((0, 0), (0, 4))) for x in (value[:, :172], value[:, 172:]))
        return np.concatenate([x.reshape(64, 8, 22) for x in (gate, up)], axis=2).reshape(64, -1)
    if name.endswith("down_proj.kernel"):
        return np.pad(value, ((0, 4), (0, 0)))
    return value


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_sharded_values_equal_single_device_values(load_format):
    """tp=8 parameters, gathered, equal the one-device ones mapped by hand (repeat / pad); the
    dummy ones too (the same random draws, generated on their shards)."""
    one = _flat(load_model(STORIES_DIR, load_format=load_format)[0])
    one = {name: np.asarray(value) for name, value in one.items()}
    mesh = make_mesh(8)
    sharded = _flat(load_sharded_model(STORIES_DIR, mesh=mesh, load_format=load_format)[0])
    assert sharded.keys() == one.keys()
    for name, value in sharded.items():
        np.testing.assert_array_equal(np.asarray(value), _expected_physical(one, name), name)


# (checkpoint, tp, num_layers, Hq, Hkv, D, intermediate_size)
_FUSED_CASES = {
    # Hkv 4 < tp 8: each KV head held twice; intermediate 172 padded to 176; no biases.
    "stories260k": (8, 5, 8, 4, 8, 172),
    # Biases on q/k/v/o and gate/up/down; Hkv 2 < tp 4.
    "llama_bias": (4, 2, 4, 2, 16, 96),
}


@pytest.mark.parametrize("name", sorted(_FUSED_CASES))
def test_each_shard_of_a_fused_parameter_holds_its_own_checkpoint_columns(tmp_path, name):
    """Device ``s``'s block of ``qkv_proj`` is its query heads' columns of ``q_proj``, then its
    KV head's columns of ``k_proj`` and of ``v_proj``; its block of ``gate_up_proj`` is its
    slice of ``gate_proj`` then of ``up_proj`` (zero past the checkpoint's intermediate size).
    Kernels and biases, against the safetensors file read with numpy."""
    tp, num_layers, hq, hkv, d, inter = _FUSED_CASES[name]
    path = STORIES_DIR if name == "stories260k" else make_hf_checkpoint(str(tmp_path), name)
    tensors = safetensors.numpy.load_file(f"{path}/model.safetensors")
    mesh = make_mesh(tp)
    params = _flat(load_sharded_model(path, mesh=mesh)[0])
    replicas, inter_per_shard = max(1, tp // hkv), -(-inter // tp)
    kv_per_shard = hkv * replicas // tp

    def heads(value, indices):  # [..., H * D] -> the columns of heads ``indices``
        return np.concatenate([value[..., h * d : (h + 1) * d] for h in indices], axis=-1)

    def mlp_slice(value, rank):  # [..., I] -> shard ``rank``'s columns, zero padded
        padded = np.pad(value, [(0, 0)] * (value.ndim - 1) + [(0, inter_per_shard * tp - inter)])
        return padded[..., rank * inter_per_shard : (rank + 1) * inter_per_shard]

    checked = 0
    for layer in range(num_layers):
        for leaf, hf_leaf in (("kernel", "weight"), ("bias", "bias")):

            def hf(module, layer=layer, hf_leaf=hf_leaf):  # [in, out] or [out]
                value = tensors[f"model.layers.{layer}.{module}.{hf_leaf}"]
                return value.T if hf_leaf == "weight" else value

            qkv = params.get(f"model.layers.{layer}.self_attn.qkv_proj.{leaf}")
            gate_up = params.get(f"model.layers.{layer}.mlp.gate_up_proj.{leaf}")
            if qkv is None:  # stories260k has no biases
                assert gate_up is None and f"model.layers.{layer}.mlp.up_proj.bias" not in tensors
                continue
            qkv_shards = {s.device.id: np.asarray(s.data) for s in qkv.addressable_shards}
            mlp_shards = {s.device.id: np.asarray(s.data) for s in gate_up.addressable_shards}
            for rank, device in enumerate(mesh.devices.flat):
                q_heads = range(rank * hq // tp, (rank + 1) * hq // tp)
                kv_heads = [(rank * kv_per_shard + j) // replicas for j in range(kv_per_shard)]
                expected = [heads(hf("self_attn.q_proj"), q_heads),
                            heads(hf("self_attn.k_proj"), kv_heads),
                            heads(hf("self_attn.v_proj"), kv_heads)]  # fmt: skip
                np.testing.assert_array_equal(qkv_shards[device.id], np.concatenate(expected, -1))
                expected = [mlp_slice(hf("mlp.gate_proj"), rank),
                            mlp_slice(hf("mlp.up_proj"), rank)]  # fmt: skip
                np.testing.assert_array_equal(mlp_shards[device.id], np.concatenate(expected, -1))
                checked += 1
    assert checked == num_layers * tp * (2 if name == "llama_bias" else 1)


def test_safetensors_reads_only_each_devices_slice(monkeypatch):
    """No parameter passes whole through one read: a column- or row-parallel kernel is read
    as tp slices of 1/tp of its elements, one per device."""
    reads: dict[str, list[int]] = {}
    original = weights._TensorReader.read_slice

    def recording(self, name, index):
        block = original(self, name, index)
        reads.setdefault(name, []).append(block.size)
        return block

    monkeypatch.setattr(weights._TensorReader, "read_slice", recording)
    load_sharded_model(STORIES_DIR, mesh=make_mesh(4))
    # A fused kernel is read part by part: each device reads its q, k and v slices.
    assert reads["model.layers.0.self_attn.q_proj.weight"] == [64 * 64 // 4] * 4
    assert reads["model.layers.0.self_attn.v_proj.weight"] == [32 * 64 // 4] * 4
    assert reads["model.layers.0.mlp.up_proj.weight"] == [172 * 64 // 4] * 4
    assert reads["model.layers.0.mlp.down_proj.weight"] == [172 * 64 // 4] * 4
    assert reads["model.embed_tokens.weight"] == [512 * 64 // 4] * 4


def test_untied_lm_head_is_vocab_parallel(tmp_path):
    pytest.importorskip("torch")
    path = make_hf_checkpoint(str(tmp_path / "llama3"), "llama3")
    mesh = make_mesh(4)
    params = _flat(load_sharded_model(path, mesh=mesh)[0])
    lm_head = params["lm_head.kernel"]
    assert lm_head.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)
    assert [s.data.shape for s in lm_head.addressable_shards] == [(64, 128 // 4)] * 4


# ---------------------------------------------------------------------------- quantized


def test_quantized_models_split_over_tp2_match_one_device(tmp_path):
    """Packed int4 (GPTQ act-order: sorted column layers, g_idx row layers) and online FP8
    at tensor_parallel_size 2: every quantized leaf stays quantized and split on its method's
    axis, and the greedy tokens equal one device's (logits: all-reduce order only)."""
    from models.quantization.config import resolve_quantization
    from models.quantized_linear import QuantizedWeight
    from tests.models.quantization import checkpoints as ckpt
    from tests.models.quantization.quality import greedy, make_runner

    tiny = ckpt.tiny_llama(str(tmp_path / "float"))
    gptq = ckpt.quantize_checkpoint(tiny, str(tmp_path / "gptq"), str(tmp_path / "gptq_ref"),
                                    *ckpt.gptq_quantizer(4, 32, True, False))[0]  # fmt: skip
    fp8 = {"quant_config": resolve_quantization("fp8", None)}
    mesh = make_mesh(2)
    prompts = [p[:8] for p in QWEN2_PROMPTS]
    for model_dir, kwargs in ((gptq, {}), (tiny, fp8)):
        one = load_model(model_dir, dtype="float32", **kwargs)
        two = load_sharded_model(model_dir, mesh=mesh, dtype="float32", **kwargs)
        leaves = {".".join(map(str, p)): v.get_value()
                  for p, v in nnx.to_flat_state(nnx.state(two[0], QuantizedWeight))}  # fmt: skip
        qkv = next(v for k, v in leaves.items() if "layers.0.self_attn.qkv_proj" in k
                   and v.dtype != np.float32)  # fmt: skip
        assert qkv.dtype in (np.int32, jax.numpy.float8_e4m3fn), qkv.dtype
        down = leaves[next(k for k in leaves if k.endswith("layers.1.mlp.down_proj.qweight")
                           or k.endswith("layers.1.mlp.down_proj.weight"))]  # fmt: skip
        assert "tp" in tuple(down.sharding.spec), down.sharding
        runner = make_runner(*two, 32, len(prompts))
        sharding = kv_cache_sharding(mesh)
        runner.kv_caches = [
            (jax.device_put(k, sharding), jax.device_put(v, sharding)) for k, v in runner.kv_caches
        ]
        ours = greedy(runner, prompts, 5)
        ref = greedy(make_runner(*one, 32, len(prompts)), prompts, 5)
        for a, b in zip(ours, ref, strict=True):
            assert a.tokens + [a.next_token] == b.tokens + [b.next_token], model_dir
            assert relative_diff(np.stack(a.logits), np.stack(b.logits)) < LOGITS_RTOL
