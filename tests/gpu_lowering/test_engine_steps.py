"""The engine's step programs, for every row of the matrix (``jaxpaged/benchmarks/matrix_rows.py``),
lowered on this CPU for the H100 and the H200 (``models.platform.abstract_gpu``): the programs
a GPU engine of that row compiles, with the kernels and linear paths a GPU picks, so that a row
that cannot lower fails here, named, before a GPU call.

Each row's engine is built as on a GPU (``Worker(platform="gpu")``: compiled Pallas kernels,
``attention_backend="auto"`` -> Pallas) from its model at a small real shape: the real per-head
geometry (head dim, query heads per KV head, experts) with few heads, two layers and a 1024-token
vocabulary (:func:`small_real_shape`), dummy weights, an unallocated 64-block cache. Lowered per
row: the batch-1 decode bucket (where the W4A16 kernel, the 8-bit GEMV, the LoRA kernel and the
MoE GEMV run), the profiling bucket (the largest mixed step with every sampler stage: XLA's
linears, Mosaic GPU's grouped GEMM) and the row's own workload's program (beam candidates; a
grammar's bitmask, whole or split into forward and sample under async scheduling). Programs
equal to one an earlier row lowered (same model graph, shapes, patches and bucket) are not
lowered again. Tilings and splits that need real widths or long contexts are in
``test_kernels.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
import re

import jax
import pytest

from jaxpaged.benchmarks import matrix
from jaxpaged.benchmarks.matrix_rows import MODELS, ROWS
from jaxpaged.config import EngineArgs
from jaxpaged.sample.metadata import SamplerVariant
from jaxpaged.worker.step_program import FORWARD, SAMPLE
from jaxpaged.worker.worker import Worker
from models.platform import GPU_DEVICE_KINDS, abstract_gpu

TRITON_CALL = re.compile(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "(\w+)"')
MOSAIC = "mosaic_gpu_v2"
NUM_BLOCKS = 64
# Kernels a row's programs must contain beyond the attention kernels (the row's point).
EXPECTED = {
    "awq-linear-auto": {"w4a16_matmul"},
    "awq-linear-pallas": {"w4a16_matmul"},
    "gptq-linear-pallas": {"w4a16_matmul"},
    "ct-w4a16-linear-pallas": {"w4a16_matmul"},
    "ct-w8a8-int8-w8-gemv": {"w8_gemv"},
    "fp8-online-w8-gemv": {"w8_gemv"},
    "lora-bgmv": {"lora_bgmv"},
    "mixtral-moe": {"expert_gemv", MOSAIC},
}
# Program digest -> the kernels its lowering held (per process: rows share programs).
_LOWERED: dict[str, frozenset[str]] = {}


def small_real_shape(config: dict) -> dict:
    """``config``'s keys that set sizes, small, with its per-head geometry kept: the head dim
    (given, or hidden / heads), the query heads per KV head (one KV head; two heads without
    GQA), the experts; hidden 512 where the head dim is given, intermediate 1024 (both divide
    the 4-bit group size 128), vocabulary 1024."""
    heads_key = "num_attention_heads" if "num_attention_heads" in config else "n_head"
    hidden_key = "hidden_size" if "hidden_size" in config else "n_embd"
    heads, hidden = config[heads_key], config[hidden_key]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    group = heads // kv_heads
    small_kv = 1 if group > 1 else 2
    out = {
        heads_key: group * small_kv,
        hidden_key: 512 if config.get("head_dim") else group * small_kv * head_dim,
    }
    if "num_key_value_heads" in config:
        out["num_key_value_heads"] = small_kv
    for key, value in (("intermediate_size", 1024), ("vocab_size", 1024)):
        if key in config:
            out[key] = value
    for key, value in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 0)):
        if isinstance(config.get(key), int):
            out[key] = value
    return out


def model_directory(row, workdir: pathlib.Path) -> str:
    """The row's model (``matrix.model_directory``) at :func:`small_real_shape` (stories260k:
    as it is, already small)."""
    directory, config = matrix.model_directory(row.model, str(workdir))
    if MODELS[row.model].config is not None:
        config.update(small_real_shape(config))
        (pathlib.Path(directory) / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def workload_keys(row, runner) -> list:
    """The buckets lowered for ``row`` (module docstring)."""
    decode = runner.bucket_for(1, 1, True)
    keys = [decode, runner.profile_key()]
    if row.workload == "beam":  # beam width 2: its candidates, padded to a power of two
        keys.append(dataclasses.replace(decode, num_beam_candidates=4))
    if row.workload == "structured_outputs":
        mixed = runner.bucket_for(16, 4, False)
        grammar = SamplerVariant(logprobs=True, structured=True)
        if row.engine.get("async_scheduling"):
            keys += [dataclasses.replace(mixed, segment=(FORWARD,)),
                     dataclasses.replace(mixed, variant=grammar, segment=(SAMPLE,))]  # fmt: skip
        else:
            keys.append(dataclasses.replace(mixed, variant=grammar))
    return keys


def _program(worker, runner, row) -> str:
    """What a row's step programs depend on besides the bucket: the model (its graph, static
    options included), the cache, the scheduler's sizes, LoRA, the constants the row patches."""
    sc = worker.config.scheduler_config
    parts = (repr(runner.weights.abstract_model()), worker.kv_cache_spec, worker.config.lora_config,
             (sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len, runner.vocab_size),
             sorted(row.patches.items()))  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-lowering")


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_row_steps_lower_for_the_h100_and_the_h200(row, workdir, caplog):
    args = matrix.engine_args(row, model_directory(row, workdir), reference=False, cache_dir=None)
    caplog.set_level(logging.ERROR, logger="jaxpaged")  # dummy FP8 scales' warning, per row
    with matrix.patched(row.patches):
        worker = Worker(EngineArgs(**args).create_engine_config(), show_progress=False,
                        platform="gpu")  # fmt: skip
        worker.load_model()
        runner = worker.abstract_runner(NUM_BLOCKS)
        found: set[str] = set()
        program = _program(worker, runner, row)
        for key in workload_keys(row, runner):
            digest = hashlib.sha256(repr((program, key)).encode()).hexdigest()
            if digest not in _LOWERED:
                _LOWERED[digest] = _lower_for_both_cards(row, runner, key)
            found |= _LOWERED[digest]
    expected = set(EXPECTED.get(row.name, ()))
    if worker.attention_backend == "pallas":
        expected |= {"paged_attention", "ragged_paged_attention"}
    assert expected <= found, f"{row.name}: lowered without {sorted(expected - found)}"


def _lower_for_both_cards(row, runner, key) -> frozenset[str]:
    """Trace ``key``'s program once (for the first card) and lower it for each card; the
    names of the kernels in the lowered text."""
    kinds = list(GPU_DEVICE_KINDS.items())
    with abstract_gpu(kinds[0][1]):
        traced = _named(row, key, "trace", runner.trace, key)
    found = set()
    for card, kind in kinds:
        with abstract_gpu(kind):
            text = _named(row, key, f"lower for the {card}", _lower, traced)
        found |= set(TRITON_CALL.findall(text)) | ({MOSAIC} if MOSAIC in text else set())
    return frozenset(found)


def _lower(traced) -> str:
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def _named(row, key, what: str, fn, *args):
    """``fn(*args)``, its error turned into a failure naming the row, the bucket and the step."""
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - reported with the row and bucket
        pytest.fail(f"matrix row {row.name}: {what} failed for bucket {key}: "
                    f"{type(error).__name__}: {str(error)[:2000]}")  # fmt: skip


def test_small_real_shape_keeps_each_familys_head_geometry():
    configs = pathlib.Path(matrix.CONFIGS_DIR)
    for name, want in (("llama-3-8b", (128, 4)), ("qwen2.5-7b", (128, 7)), ("gemma-2-9b", (256, 2)),
                       ("phi-3-mini-4k-instruct", (96, 1)), ("gpt2", (64, 1)),
                       ("bloom-560m", (64, 1))):  # fmt: skip
        config = json.loads((configs / name / "config.json").read_text())
        config.update(small_real_shape(config))
        heads = config.get("num_attention_heads") or config["n_head"]
        hidden = config.get("hidden_size") or config["n_embd"]
        kv_heads = config.get("num_key_value_heads") or heads
        assert (config.get("head_dim") or hidden // heads, heads // kv_heads) == want, name
        assert heads <= 8 and config.get("vocab_size", 1024) <= 1024
    assert jax.default_backend() == "cpu"  # everything above ran without a GPU
