import pytest

from jaxpaged.worker.buckets import make_buckets, round_up_to_bucket


def test_buckets_double_then_step_linearly_and_end_at_maximum():
    assert make_buckets(2048, minimum=16, gap=512) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert make_buckets(100, minimum=16, gap=512) == [16, 32, 64, 100]
    assert make_buckets(8) == [1, 2, 4, 8]
    assert make_buckets(1) == [1]


def test_buckets_are_strictly_increasing_for_awkward_maxima():
    for maximum in (3, 17, 511, 513, 1000, 4097):
        buckets = make_buckets(maximum, minimum=16, gap=512)
        assert buckets == sorted(set(buckets)) and buckets[-1] == maximum


def test_round_up_exact_fit_one_over_and_largest():
    buckets = make_buckets(64, minimum=16)
    assert round_up_to_bucket(16, buckets) == 16
    assert round_up_to_bucket(17, buckets) == 32
    assert round_up_to_bucket(64, buckets) == 64
    assert round_up_to_bucket(1, buckets) == 16


def test_round_up_above_largest_bucket_names_value_and_limit():
    with pytest.raises(ValueError, match=r"65 is larger than the largest bucket \(64\)"):
        round_up_to_bucket(65, make_buckets(64, minimum=16))


def test_invalid_bucket_arguments_raise():
    with pytest.raises(ValueError):
        make_buckets(0)
