"""Sampling features of the engine (stop strings, logprobs, echo) reach clients through the server
and agree with ``LLM.generate`` on the same engine arguments."""

from __future__ import annotations

import math

from tests.live_server import MODEL_NAME

PROMPT = "Once upon a time"


def test_completion_logprobs_match_the_offline_engine(client, server, greedy_reference):
    (reference,) = greedy_reference([PROMPT], 6, logprobs=2)
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=2
    )
    choice = response.choices[0]
    assert choice.text == reference.outputs[0].text
    offline = reference.outputs[0].logprobs
    assert len(choice.logprobs.token_logprobs) == len(offline) == 6
    for served, step, token_id in zip(
        choice.logprobs.token_logprobs, offline, reference.outputs[0].token_ids, strict=True
    ):
        assert math.isclose(served, step[token_id].logprob, abs_tol=1e-5)
    # The greedy token is the most likely one: it leads every top-logprobs entry.
    for top, served in zip(
        choice.logprobs.top_logprobs, choice.logprobs.token_logprobs, strict=True
    ):
        assert len(top) >= 2 and max(top.values()) == served


def test_stop_string_cuts_the_text_like_the_offline_engine(client, server, greedy_reference):
    (full,) = greedy_reference([PROMPT], 16)
    text = full.outputs[0].text
    stop = text[5:8]  # a stop string that starts inside the continuation
    (reference,) = greedy_reference([PROMPT], 16, stop=[stop])
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.0, stop=[stop]
    )
    choice = response.choices[0]
    assert choice.text == reference.outputs[0].text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"


def test_echo_prepends_the_prompt(client, server, greedy_reference):
    (reference,) = greedy_reference([PROMPT], 4)
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.0, echo=True
    )
    assert response.choices[0].text == PROMPT + reference.outputs[0].text
