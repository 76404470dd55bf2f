"""Beam selection and the length-penalized score, against hand-computed cases."""

import pytest

from jaxpaged.core.beam_search import BeamCandidate, beam_search_score, select_beams


def test_score_divides_by_length_to_the_penalty_and_skips_a_final_eos():
    assert beam_search_score(4, -2.0, 1.0, False) == -0.5
    assert beam_search_score(5, -2.0, 1.0, True) == -0.5
    assert beam_search_score(4, -2.0, 0.0, False) == -2.0
    assert beam_search_score(4, -2.0, 2.0, False) == pytest.approx(-0.125)


def test_best_continuations_across_beams_survive_and_eos_completes():
    completed, continuing = select_beams(
        [-1.0, -2.0],
        [[(5, -0.1), (2, -0.2), (6, -3.0), (7, -4.0)], [(8, -0.05), (9, -0.5), (1, -9.0)]],
        beam_width=2,
        eos_token_id=2,
        ignore_eos=False,
    )
    assert completed == [BeamCandidate(0, 2, -0.2, -1.2)]
    assert continuing == [BeamCandidate(0, 5, -0.1, -1.1), BeamCandidate(1, 8, -0.05, -2.05)]


def test_only_the_first_two_beam_width_proposals_count_and_ignore_eos_keeps_eos_live():
    proposals = [[(2, -0.1), (3, -0.2), (4, -0.3)]]
    completed, continuing = select_beams(
        [0.0], proposals, beam_width=1, eos_token_id=2, ignore_eos=True
    )
    assert completed == [] and [c.token_id for c in continuing] == [2]
    completed, continuing = select_beams(
        [0.0], proposals, beam_width=1, eos_token_id=2, ignore_eos=False
    )
    assert [c.token_id for c in completed] == [2] and [c.token_id for c in continuing] == [3]


def test_ties_keep_beam_then_proposal_order():
    _, continuing = select_beams(
        [0.0, 0.0],
        [[(1, -1.0), (2, -1.0)], [(3, -1.0)]],
        beam_width=2,
        eos_token_id=None,
        ignore_eos=False,
    )
    assert [c.token_id for c in continuing] == [1, 2]
