"""The speculative-decoding scripts: the greedy replay and the cost benchmark's smoke run."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.spec_decode_acceptance import replay
from jaxpaged.spec_decode.metrics import SpecDecodingStats


def test_replay_accepts_drafts_while_they_equal_the_greedy_continuation():
    # After "1 2 3 1" the proposer (n = 1) drafts what followed the first 1: "2 3"; the greedy
    # continuation is "2 3 1 5", so both are accepted and the third token (1) is the bonus.
    # Then from "... 1 2 3 1" again it drafts "2 3" (earliest occurrence); 5 differs: rejected,
    # the correction 5 ends the request.
    stats = SpecDecodingStats(num_spec_tokens=2)
    kwargs = dict(num_speculative_tokens=2, min_n=1, max_n=1, max_model_len=100)
    steps = replay([1, 2, 3, 1], [2, 3, 1, 5], stats, **kwargs)
    assert steps == 2
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 4, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1]


def test_cost_benchmark_smoke_run_prints_its_three_tables():
    done = subprocess.run(
        [sys.executable, "benchmarks/spec_decode.py", "--smoke"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    for table in ("n-gram proposer", "rejection sampler", "EAGLE-3 draft pass"):
        assert table in done.stdout, table
    assert done.stdout.count("| 4 |") == 3  # B = 4 in each table
