"""``BucketKey.for_segment``: which executable each segment of a step runs."""

from __future__ import annotations

import pytest

from jaxpaged.sample.metadata import SamplerVariant
from jaxpaged.worker.step_program import FORWARD, SAMPLE, WHOLE, BucketKey

STRUCTURED = SamplerVariant(uses_state=True, filters=True, structured=True)


def test_whole_segment_keeps_every_static_option():
    key = BucketKey(64, 8, False, num_beam_candidates=4, variant=STRUCTURED)
    assert key.for_segment(WHOLE) == key


def test_forward_segment_serves_every_sampler_variant():
    plain = BucketKey(64, 8, False)
    constrained = BucketKey(64, 8, False, variant=STRUCTURED)
    assert constrained.for_segment((FORWARD,)) == plain.for_segment((FORWARD,))
    assert constrained.for_segment((FORWARD,)).segment == (FORWARD,)


def test_sample_segment_keeps_the_variant():
    key = BucketKey(64, 8, False, variant=STRUCTURED).for_segment((SAMPLE,))
    assert key.variant == STRUCTURED and key.segment == (SAMPLE,)


@pytest.mark.parametrize("segment", [(), ("sample", "forward"), ("propose",), ("forward", "x")])
def test_a_segment_must_be_a_contiguous_run_of_the_stages(segment):
    with pytest.raises(ValueError, match="contiguous run"):
        BucketKey(64, 8, False).for_segment(segment)


@pytest.mark.parametrize(
    "key",
    [
        BucketKey(64, 8, False, variant=SamplerVariant(prompt_logprobs=True)),
        BucketKey(8, 8, True, num_beam_candidates=4),
    ],
)
def test_hidden_state_readers_cannot_sample_apart_from_the_forward(key):
    with pytest.raises(ValueError, match="need the forward"):
        key.for_segment((SAMPLE,))
