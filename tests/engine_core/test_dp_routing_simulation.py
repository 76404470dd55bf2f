"""The claim of docs/deployment.md for ``--dp-routing prefix``, at the level reachable without
engine processes.

Real in-process ``LLMEngine``s of the embedded model on CPU stand in for the data-parallel engine
cores: ``DPBalancer`` routes each request of a shared-prefix workload (prompt families sharing a
3-block prefix, requests interleaved across families, in waves) and the engines' own prefix-cache
counters (``get_stats()``) give the hit rate. Against one engine serving everything:
prefix routing keeps >= 0.9x its hit rate, least-loaded routing falls to <= 0.6x (each family's
prefix is recomputed once on every engine it lands on), and greedy outputs are identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_core.dp_balancer import DPBalancer
from jaxpaged.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_FAMILIES = 3
NUM_WAVES = 3  # requests per family
PREFIX_LEN = 3 * BLOCK_SIZE
SUFFIX_LEN = 8
ENGINE = dict(
    dtype="float32",
    block_size=BLOCK_SIZE,
    max_model_len=96,
    max_num_seqs=4,
    max_num_batched_tokens=64,
)
PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def shared_compilation_cache(tmp_path_factory):
    """The engines compile identical step shapes; a persistent cache lets the second and third
    engine load the first one's executables instead of compiling them again (~10 s each)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = {name: getattr(jax.config, name) for name in names}
    jax.config.update(names[0], str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update(names[1], 0)
    jax.config.update(names[2], 0)
    compilation_cache.reset_cache()
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def _workload() -> list[tuple[str, list[int]]]:
    """(request id, prompt ids) interleaved by wave: f0w0, f1w0, f2w0, f0w1, ..."""
    # Seed 15: the prefix hash happens to put the three families on both engines (2 + 1).
    rng = np.random.default_rng(15)
    prefixes = [[1, *rng.integers(3, 512, PREFIX_LEN - 1).tolist()] for _ in range(NUM_FAMILIES)]
    return [
        (f"f{f}w{w}", prefixes[f] + rng.integers(3, 512, SUFFIX_LEN).tolist())
        for w in range(NUM_WAVES)
        for f in range(NUM_FAMILIES)
    ]


def _serve(engines, balancer, workload):
    """Route and run the workload one wave (one request per family) at a time; returns
    (token ids by request, prefix-cache hit rate over all engines)."""
    before = [e.get_stats() for e in engines]
    outputs = {}
    for start in range(0, len(workload), NUM_FAMILIES):
        for request_id, prompt in workload[start : start + NUM_FAMILIES]:
            engine = balancer.add_request(request_id, prompt)
            engines[engine].add_request(request_id, {"prompt_token_ids": prompt}, PARAMS)
        while any(e.has_unfinished_requests() for e in engines):
            for engine in engines:
                for output in engine.step() if engine.has_unfinished_requests() else ():
                    if output.finished:
                        outputs[output.request_id] = list(output.outputs[0].token_ids)
                        balancer.finish_request(output.request_id)
        balancer.check_invariants()
    after = [e.get_stats() for e in engines]
    pairs = list(zip(after, before, strict=True))
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in pairs)
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in pairs)
    return outputs, hits / queries


def test_prefix_routing_keeps_the_single_engine_hit_rate_and_least_loaded_loses_it(
    shared_compilation_cache,
):
    engines = [
        LLMEngine.from_engine_args(EngineArgs(**ENGINE), show_progress=False) for _ in range(3)
    ]
    single, dp = engines[:1], engines[1:]
    workload = _workload()

    reference, single_rate = _serve(single, DPBalancer(1), workload)
    assert single_rate > 0.5  # every request after a family's first hits its 48-token prefix

    prefix_balancer = DPBalancer(2, routing="prefix", block_size=BLOCK_SIZE)
    prefix_outputs, prefix_rate = _serve(dp, prefix_balancer, workload)
    for engine in dp:
        engine.reset_prefix_cache()
    least_balancer = DPBalancer(2)
    least_outputs, least_rate = _serve(dp, least_balancer, workload)

    assert prefix_outputs == reference
    assert least_outputs == reference
    assert all(prefix_balancer.num_routed) and all(least_balancer.num_routed)
    assert prefix_rate >= 0.9 * single_rate, (prefix_rate, single_rate)
    assert least_rate <= 0.6 * single_rate, (least_rate, single_rate)
