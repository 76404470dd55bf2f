"""The benchmark workloads: fixed lengths, and the ShareGPT-like length distribution."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged.benchmarks.dataset import (
    MAX_PROMPT_LEN,
    MAX_TOTAL_LEN,
    MIN_LEN,
    make_requests,
    random_requests,
    sharegpt_synthetic_lengths,
    sharegpt_synthetic_requests,
)


def test_random_requests_have_fixed_lengths_and_ids_in_vocabulary():
    requests = random_requests(7, 12, 5, vocab_size=50, seed=3)
    assert len(requests) == 7
    assert all(r.prompt_len == 12 and r.output_len == 5 for r in requests)
    ids = np.array([r.prompt_token_ids for r in requests])
    assert ids.min() >= 0 and ids.max() < 50
    assert random_requests(7, 12, 5, vocab_size=50, seed=3) == requests
    assert random_requests(7, 12, 5, vocab_size=50, seed=4) != requests


def test_sharegpt_lengths_pass_vllms_filter_and_average_about_200():
    lengths = np.array(sharegpt_synthetic_lengths(4000, seed=0))
    prompt, output = lengths[:, 0], lengths[:, 1]
    assert prompt.min() >= MIN_LEN and output.min() >= MIN_LEN
    assert prompt.max() <= MAX_PROMPT_LEN and (prompt + output).max() <= MAX_TOTAL_LEN
    assert 180 <= prompt.mean() <= 220 and 180 <= output.mean() <= 220
    # Heavy-tailed like ShareGPT: the median sits well below the mean.
    assert np.median(output) < 0.8 * output.mean()


def test_sharegpt_requests_are_seeded():
    a = sharegpt_synthetic_requests(20, vocab_size=100, seed=1)
    assert a == sharegpt_synthetic_requests(20, vocab_size=100, seed=1)
    assert a != sharegpt_synthetic_requests(20, vocab_size=100, seed=2)
    assert [r.prompt_len for r in a] == [p for p, _ in sharegpt_synthetic_lengths(20, seed=1)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dataset_name="sharegpt", input_len=1, output_len=1), "dataset_name must be one of"),
        (dict(dataset_name="random", input_len=None, output_len=4), "needs --input-len"),
        (dict(dataset_name="random", input_len=0, output_len=4), "input_len must be at least 1"),
    ],
)
def test_bad_workload_arguments_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_requests(num_prompts=3, vocab_size=10, **kwargs)
