"""The jitted step updates the donated KV cache in place for every bucket."""

from __future__ import annotations

import re

import pytest

from jaxpaged import LLM
from tests.conftest import SMALL_ENGINE

NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def runner():
    llm = LLM(dtype="float32", num_gpu_blocks_override=NUM_BLOCKS, **SMALL_ENGINE)
    return llm.llm_engine.worker.model_runner


@pytest.mark.parametrize("num_seqs, decode_only", [(1, True), (2, True), (16, False)])
def test_step_never_copies_the_kv_cache(runner, num_seqs, decode_only):
    """A copy of a cache-sized buffer per step would cost a full cache write each step
    (XLA turns a one-row scatter into a dynamic-update-slice it duplicates)."""
    key = runner.bucket_for(num_seqs, num_seqs, decode_only)
    hlo = runner.executable(key).as_text()
    k_cache = runner.kv_caches[0][0]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    cache_dims = "|".join(
        re.escape(",".join(map(str, dims)))
        for dims in (k_cache.shape, (num_slots, *k_cache.shape[2:]))
    )
    copies = [
        line for line in hlo.splitlines() if re.search(rf"\[({cache_dims})\]\S* copy\(", line)
    ]
    assert not copies, copies[:3]
