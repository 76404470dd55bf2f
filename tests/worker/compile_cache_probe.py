"""Subprocess body of tests/worker/test_compilation_cache.py: build stories260k engines with the
persistent compilation cache in ``argv[1]`` and print, per build, the XLA compilations it
needed and its first greedy token, as one JSON line.

argv[2:] are ``max_num_seqs`` values: one engine each, in order, in this one process
(``jax.clear_caches()`` between builds drops JAX's in-memory executables, so each build
reads the disk cache as a restarted process would).
"""

from __future__ import annotations

import json
import sys

import jax

from jaxpaged import LLM, SamplingParams
from jaxpaged.worker.compilation_cache import CompileCounter
from jaxpaged.worker.memory_pool import backends_initialized


def main() -> None:
    cache_dir, seqs = sys.argv[1], [int(s) for s in sys.argv[2:]]
    results = []
    started_before = backends_initialized()
    for max_num_seqs in seqs:
        if results:
            jax.clear_caches()
        with CompileCounter() as counter:
            llm = LLM(
                dtype="float32",
                max_model_len=64,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=16,
                enforce_eager=False,  # compile every bucket at start-up, as on a GPU
                compilation_cache_dir=cache_dir,
                gpu_memory_utilization=0.7,
            )
            out = llm.generate("Once upon a time", SamplingParams(max_tokens=4), use_tqdm=False)
            # a warm start loads most buckets on a background thread: count those too
            llm.llm_engine.wait_for_executables()
        results.append(
            dict(
                max_num_seqs=max_num_seqs,
                buckets=len(llm.llm_engine.worker.model_runner.all_bucket_keys()),
                compiled=counter.compiled,
                requests=counter.requests,
                cache_hits=counter.cache_hits,
                deferred=llm.llm_engine.worker.executables_deferred,
                startup=llm.llm_engine.startup.as_dict(),
                tokens=list(out[0].outputs[0].token_ids),
                cache_dir=llm.llm_engine.compilation_cache_dir,
                # the first engine of the process sized JAX's (GPU) pool before the backend started
                started_before=started_before,
                client_options=jax.config.jax_pjrt_client_create_options,
            )
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
