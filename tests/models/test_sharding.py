"""Tensor parallelism (models.sharding, models.tp_layout, models.sharded_weights).

Layout arithmetic, index maps and errors run here; the checks that need several devices run in
one subprocess with 8 CPU devices (``multidevice_sharding_checks.py``), since the device count
must be fixed before JAX starts.
"""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jaxpaged import LLM
from jaxpaged.config import EngineArgs
from models.sharded_weights import axis_maps, map_indices
from models.sharding import kv_cache_partition_spec, make_mesh, param_partition_spec
from models.tp_layout import TPLayout
from models.weights import load_config
from tests.conftest import SMALL_ENGINE
from tests.multidevice import run_on_cpu_devices

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIGS = REPO / "benchmarks" / "configs"
# multidevice_sharding_checks.py (quantized TP and FP8 KV under tp included)
NUM_MULTIDEVICE_CHECKS = 14


def test_multidevice_checks_pass_on_8_cpu_devices():
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
    checks = str(HERE / "multidevice_sharding_checks.py")
    report = run_on_cpu_devices([*pytest_args, checks], 8, timeout=900)
    # Every check ran: none skipped for lack of devices or of torch.
    assert re.search(rf"\b{NUM_MULTIDEVICE_CHECKS} passed\b", report), report
    assert "skipped" not in report, report


# --------------------------------------------------------------------------------- layouts


def test_layout_repeats_kv_heads_and_pads_intermediate_size():
    layout = TPLayout(
        tensor_parallel_size=8, num_heads=8, num_kv_heads=2, intermediate_size=172,
        vocab_size=512,
    )  # fmt: skip
    assert layout.kv_head_replicas == 4
    assert layout.num_kv_heads_physical == 8
    assert layout.intermediate_size_padded == 176
    assert layout.shard_vocab
    plain = TPLayout(2, num_heads=64, num_kv_heads=8, intermediate_size=29568, vocab_size=152064)
    assert (plain.kv_head_replicas, plain.intermediate_size_padded) == (1, 29568)
    assert not TPLayout(2, 4, 2, 96, vocab_size=32001).shard_vocab  # replicated instead


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(num_heads=14, num_kv_heads=2), r"num_attention_heads \(14\) .* tensor_parallel_size \(4\)"),
        (dict(num_heads=24, num_kv_heads=6), r"num_key_value_heads \(6\) .* tensor_parallel_size \(4\)"),
        (dict(num_heads=12, num_kv_heads=3), r"num_key_value_heads \(3\)"),
    ],
)  # fmt: skip
def test_impossible_layouts_raise_naming_the_dimension(sizes, message):
    with pytest.raises(ValueError, match=message):
        TPLayout(4, intermediate_size=64, vocab_size=128, **sizes)


def test_engine_args_reject_a_layout_the_model_cannot_take(stories_dir):
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(8\) .* tensor_parallel_size \(3\)"
    ):
        EngineArgs(tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1, got 0"):
        EngineArgs(tensor_parallel_size=0).create_engine_config()
    config = EngineArgs(tensor_parallel_size=8).create_engine_config()  # Hkv 4 repeats twice
    assert config.parallel_config.tensor_parallel_size == 8


def test_more_shards_than_devices_raise():
    num_devices = jax.device_count()
    with pytest.raises(
        ValueError, match=rf"larger than the number of cpu devices \({num_devices}\)"
    ):
        make_mesh(num_devices + 1)
    if num_devices == 1:  # stories260k takes tp=2; this process has one device
        with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) is larger"):
            LLM(dtype="float32", tensor_parallel_size=2, **SMALL_ENGINE)


@pytest.mark.parametrize("name", ["qwen2.5-72b-instruct", "llama-3-70b", "llama-3-8b"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_benchmark_configs_split_evenly(name, tp):
    layout = TPLayout.from_hf_config(load_config(str(CONFIGS / name)), tp)
    assert layout.kv_head_replicas == 1
    assert layout.intermediate_size_padded == layout.intermediate_size
    assert layout.shard_vocab


# ---------------------------------------------------------------------- rules and index maps


def test_partition_specs_follow_megatron_layout():
    layout = TPLayout(2, 8, 4, 172, 512)
    spec = lambda *path: param_partition_spec(("model", "layers", 0, *path), layout)  # noqa: E731
    assert spec("self_attn", "qkv_proj", "kernel") == P(None, "tp")
    assert spec("self_attn", "qkv_proj", "bias") == P("tp")
    assert spec("mlp", "gate_up_proj", "kernel") == P(None, "tp")
    assert spec("self_attn", "o_proj", "kernel") == P("tp", None)
    assert spec("self_attn", "o_proj", "bias") == P()  # added once, after the all-reduce
    assert spec("mlp", "down_proj", "kernel") == P("tp", None)
    assert spec("input_layernorm", "weight") == P()
    assert param_partition_spec(("lm_head", "kernel"), layout) == P(None, "tp")
    with pytest.raises(ValueError, match="no tensor-parallel rule for parameter model.rotary.x"):
        param_partition_spec(("model", "rotary", "x"), layout)


def test_kv_cache_splits_over_the_kv_heads_axis_of_the_kernel_layout():
    spec = kv_cache_partition_spec()
    shape = pallas_kernels.kv_cache_shape(num_blocks=11, block_size=13, num_kv_heads=17,
                                          head_dim=19)  # fmt: skip
    assert len(spec) == len(shape)
    assert [size for size, axis in zip(shape, spec, strict=True) if axis == "tp"] == [17]


def test_index_maps_repeat_kv_heads_in_place_and_pad_with_minus_one():
    layout = TPLayout(4, num_heads=4, num_kv_heads=2, intermediate_size=6, vocab_size=8)
    k_maps = axis_maps(("self_attn", "k_proj", "kernel"), (5, 4 * 3), layout)
    assert k_maps[0] is None
    np.testing.assert_array_equal(map_indices(k_maps[1], 12), [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5])
    bias_maps = axis_maps(("self_attn", "v_proj", "bias"), (12,), layout)
    assert bias_maps == (k_maps[1],)
    down = axis_maps(("mlp", "down_proj", "kernel"), (8, 5), layout)
    np.testing.assert_array_equal(map_indices(down[0], 8), [0, 1, 2, 3, 4, 5, -1, -1])
    assert axis_maps(("mlp", "down_proj", "bias"), (5,), layout) == (None,)
    assert axis_maps(("self_attn", "q_proj", "kernel"), (5, 12), layout) == (None, None)


def test_fused_columns_are_laid_out_shard_by_shard():
    """tp=4, Hq=4, Hkv=2 (each repeated twice), D=2, intermediate 6 (padded to 8). Values are
    indices into the one-device checkpoint [q | k | v] (q 0-7, k 8-11, v 12-15) and
    [gate | up] (gate 0-5, up 6-11), -1 for padding; written out by hand."""
    layout = TPLayout(4, num_heads=4, num_kv_heads=2, intermediate_size=6, vocab_size=8)
    merged = {("self_attn", "qkv_proj"): (8, 8, 8), ("mlp", "gate_up_proj"): (8, 8)}
    qkv = axis_maps(("self_attn", "qkv_proj", "kernel"), (5, 24), layout, merged)
    assert qkv[0] is None
    np.testing.assert_array_equal(
        map_indices(qkv[1], 24).reshape(4, 6),
        [
            [0, 1, 8, 9, 12, 13],  # shard 0: query head 0, KV head 0
            [2, 3, 8, 9, 12, 13],  # shard 1: query head 1, KV head 0 again
            [4, 5, 10, 11, 14, 15],  # shard 2: query head 2, KV head 1
            [6, 7, 10, 11, 14, 15],
        ],
    )
    assert axis_maps(("self_attn", "qkv_proj", "bias"), (24,), layout, merged) == (qkv[1],)
    gate_up = axis_maps(("mlp", "gate_up_proj", "kernel"), (5, 16), layout, merged)
    np.testing.assert_array_equal(
        map_indices(gate_up[1], 16).reshape(4, 4),
        [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11], [-1, -1, -1, -1]],
    )
