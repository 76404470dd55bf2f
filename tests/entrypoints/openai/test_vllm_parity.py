"""vLLM 0.34's request and response behaviours that clients depend on, against live servers:
the shared one (default flags) and one started with vLLM's on/off serving flags and
``--max-logprobs -1``. Expected values come from ``LLM.generate`` on the same model or from the
tokenizer, never from the server under test."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.live_server import API_KEY, CHAT_TEMPLATE, MODEL_NAME, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
VOCAB_SIZE = 512  # stories260k


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def flagged():
    """A server with every on/off flag of vLLM's serve on, and logprobs over the whole
    vocabulary allowed (``max_logprobs=-1``)."""
    running = start_server(
        chat_template=CHAT_TEMPLATE,
        max_logprobs=-1,
        app_options=dict(
            return_tokens_as_token_ids=True,
            enable_prompt_tokens_details=True,
            enable_tokenizer_info_endpoint=True,
            enable_server_load_tracking=True,
        ),
    )
    yield running
    running.stop()


@pytest.fixture
def fhttp(flagged):
    with httpx.Client(base_url=flagged.url, timeout=60) as client:
        yield client


def _body(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0.0, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0.0, **fields}


def _events(response) -> list[dict]:
    return [
        json.loads(line[len("data: ") :])
        for line in response.iter_lines()
        if line.startswith("data: {")
    ]


def _stream(client, route: str, body: dict) -> list[dict]:
    with client.stream("POST", f"/v1/{route}", json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        return _events(response)


def _error(response, param: str, *fragments: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error


# ---------------------------------------------------------------------------- return_token_ids
def test_return_token_ids_puts_prompt_and_output_ids_on_each_completion_choice(
    http, greedy_reference, stories_llm
):
    (reference,) = greedy_reference([PROMPT], 6)
    plain = http.post("/v1/completions", json=_body(max_tokens=6)).json()["choices"][0]
    assert "prompt_token_ids" in plain and plain["prompt_token_ids"] is None
    assert plain["token_ids"] is None
    choice = http.post("/v1/completions", json=_body(max_tokens=6, return_token_ids=True)).json()[
        "choices"
    ][0]
    assert choice["prompt_token_ids"] == stories_llm.get_tokenizer().encode(PROMPT)
    assert choice["token_ids"] == reference.outputs[0].token_ids
    assert choice["text"] == reference.outputs[0].text
    # With echo, the ids carry the prompt: vLLM leaves its text out.
    echoed = http.post(
        "/v1/completions", json=_body(max_tokens=6, return_token_ids=True, echo=True)
    ).json()["choices"][0]
    assert echoed["text"] == reference.outputs[0].text


def test_streamed_return_token_ids_send_prompt_ids_first_and_each_chunks_new_ids(
    http, greedy_reference, stories_llm
):
    (reference,) = greedy_reference([PROMPT], 8)
    events = _stream(http, "completions", _body(max_tokens=8, return_token_ids=True))
    choices = [event["choices"][0] for event in events]
    assert choices[0]["prompt_token_ids"] == stories_llm.get_tokenizer().encode(PROMPT)
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == reference.outputs[0].token_ids


def test_chat_return_token_ids_put_prompt_ids_on_the_response_and_output_ids_on_choices(http):
    plain = http.post("/v1/chat/completions", json=_chat(max_tokens=4)).json()
    assert "prompt_token_ids" in plain and plain["prompt_token_ids"] is None
    whole = http.post(
        "/v1/chat/completions", json=_chat(max_tokens=4, return_token_ids=True)
    ).json()
    rendered = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()
    assert whole["prompt_token_ids"] == rendered["tokens"]
    assert len(whole["choices"][0]["token_ids"]) == whole["usage"]["completion_tokens"] == 4
    events = _stream(http, "chat/completions", _chat(max_tokens=4, return_token_ids=True))
    assert events[0]["prompt_token_ids"] == rendered["tokens"]
    assert all("prompt_token_ids" not in event for event in events[1:])
    streamed = [t for event in events for c in event["choices"] for t in c["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"]


# ----------------------------------------------------------------------- truncation_side
@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_side_keeps_the_last_or_the_first_tokens(
    http, greedy_reference, stories_llm, side
):
    ids = stories_llm.get_tokenizer().encode("Lily and Ben went to the park to play with a ball")
    kept = ids[-5:] if side == "left" else ids[:5]
    body = _body(prompt=ids, max_tokens=4, truncate_prompt_tokens=5, truncation_side=side)
    response = http.post("/v1/completions", json=body).json()
    (reference,) = greedy_reference([{"prompt_token_ids": kept}], 4)
    assert response["usage"]["prompt_tokens"] == 5
    assert response["choices"][0]["text"] == reference.outputs[0].text


def test_truncate_prompt_tokens_minus_one_is_max_model_len_and_zero_is_refused(http):
    long_prompt = list(range(3, 3 + 200))  # longer than max_model_len (128)
    body = _body(prompt=long_prompt, max_tokens=None, truncate_prompt_tokens=-1)
    # All 128 kept leave no room for output: the context-length rule answers.
    _error(http.post("/v1/completions", json=body), "prompt", "maximum context length is 128")
    body = _body(prompt=long_prompt[:20], max_tokens=2, truncate_prompt_tokens=-1)
    assert http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"] == 20
    _error(
        http.post("/v1/completions", json=_body(truncate_prompt_tokens=0)),
        "truncate_prompt_tokens",
    )
    _error(http.post("/v1/completions", json=_body(truncation_side="middle")), "truncation_side")


# ------------------------------------------------------------- echo with max_tokens 0 (scoring)
def test_echo_with_zero_max_tokens_scores_the_prompt(http, greedy_reference, stories_llm):
    """lm-evaluation-harness's loglikelihood request: the prompt comes back with its tokens'
    logprobs (the first null), nothing generated in the text."""
    ids = stories_llm.get_tokenizer().encode(PROMPT)
    (reference,) = greedy_reference([PROMPT], 1, prompt_logprobs=1)
    body = _body(max_tokens=0, echo=True, logprobs=1)
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == PROMPT
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [
        step[token].logprob
        for step, token in zip(reference.prompt_logprobs[1:], ids[1:], strict=True)
    ]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    streamed = _stream(http, "completions", body)
    assert "".join(e["choices"][0]["text"] for e in streamed) == PROMPT
    _error(http.post("/v1/completions", json=_body(max_tokens=0)), "max_tokens", "at least 1")


# ------------------------------------------------------------------------ logprobs: ordering
def test_completion_top_logprobs_list_the_sampled_token_first(http):
    body = _body(max_tokens=12, temperature=1.5, seed=11, logprobs=2)
    body["return_tokens_as_token_ids"] = True
    logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    below_top = 0
    for token, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert next(iter(top)) == token and top[token] == value
        assert 2 <= len(top) <= 3  # the sampled token and the 2 best
        below_top += value < max(top.values())
    assert below_top > 0  # some sampled token was not the best: the order was tested


# ------------------------------------------------------------- whole vocabulary, chosen ids
def test_logprobs_minus_one_needs_max_logprobs_to_cover_the_vocabulary(http):
    _error(http.post("/v1/completions", json=_body(logprobs=-1)), "logprobs", "--max-logprobs -1")
    _error(
        http.post("/v1/completions", json=_body(logprob_token_ids=[5])),
        "logprob_token_ids",
        "needs logprobs",
    )
    chat = _chat(logprobs=True, top_logprobs=-1, max_tokens=2)
    _error(http.post("/v1/chat/completions", json=chat), "logprobs", "--max-logprobs -1")


def test_logprobs_minus_one_return_the_whole_vocabulary(fhttp):
    body = _body(max_tokens=3, logprobs=-1, prompt_logprobs=-1)
    choice = fhttp.post("/v1/completions", json=body).json()["choices"][0]
    for top in choice["logprobs"]["top_logprobs"]:
        assert len(top) == VOCAB_SIZE  # tokens written token_id:<id> (the server's flag)
        total = sum(pytest.importorskip("math").exp(v) for v in top.values())
        assert total == pytest.approx(1.0, abs=1e-3)
    assert all(len(step) == VOCAB_SIZE for step in choice["prompt_logprobs"][1:])
    chat = _chat(logprobs=True, top_logprobs=-1, max_tokens=2)
    content = fhttp.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]
    assert all(len(entry["top_logprobs"]) == VOCAB_SIZE for entry in content["content"])


def test_logprob_token_ids_return_exactly_those_ids_with_their_logprobs(fhttp):
    full = fhttp.post("/v1/completions", json=_body(max_tokens=4, logprobs=-1)).json()
    wanted = [7, 300, 42]
    body = _body(max_tokens=4, logprobs=1, logprob_token_ids=wanted)
    chosen = fhttp.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    full_top = full["choices"][0]["logprobs"]["top_logprobs"]
    assert chosen["tokens"] == full["choices"][0]["logprobs"]["tokens"]
    for token, top, whole in zip(chosen["tokens"], chosen["top_logprobs"], full_top, strict=True):
        expected_keys = list(dict.fromkeys([token] + [f"token_id:{t}" for t in wanted]))
        assert list(top) == expected_keys
        for key in top:
            assert top[key] == pytest.approx(whole[key], abs=1e-5)
    chat = _chat(max_tokens=3, logprobs=True, top_logprobs=1, logprob_token_ids=wanted)
    entries = fhttp.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]
    for entry in entries["content"]:
        names = [alt["token"] for alt in entry["top_logprobs"]]
        assert set(names) == {entry["token"]} | {f"token_id:{t}" for t in wanted}
    bad = _body(max_tokens=2, logprobs=1, logprob_token_ids=[5, VOCAB_SIZE + 1])
    _error(fhttp.post("/v1/completions", json=bad), "logprob_token_ids", "out of vocabulary")


def test_logprob_token_ids_take_128_ids_under_the_default_max_logprobs(http, fhttp):
    """vLLM's MAX_LOGPROB_TOKEN_IDS: up to 128 in-vocabulary ids whatever --max-logprobs (the
    shared server keeps the default 20); before, any id needed --max-logprobs -1. Values
    against the whole vocabulary's from the server started with --max-logprobs -1."""
    full = fhttp.post("/v1/completions", json=_body(max_tokens=3, logprobs=-1)).json()
    wanted = list(range(VOCAB_SIZE - 1, 0, -4))[:128]
    body = _body(
        max_tokens=3, logprobs=1, logprob_token_ids=wanted, return_tokens_as_token_ids=True
    )
    chosen = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    whole = full["choices"][0]["logprobs"]
    assert chosen["tokens"] == whole["tokens"]
    for token, top, every in zip(chosen["tokens"], chosen["top_logprobs"], whole["top_logprobs"],
                                 strict=True):  # fmt: skip
        assert list(top) == list(dict.fromkeys([token] + [f"token_id:{t}" for t in wanted]))
        for key, value in top.items():
            assert value == pytest.approx(every[key], abs=1e-5)
    too_many = _body(max_tokens=2, logprobs=1, logprob_token_ids=list(range(129)))
    _error(http.post("/v1/completions", json=too_many), "logprob_token_ids", "max allowed: 128")
    outside = _body(max_tokens=2, logprobs=1, logprob_token_ids=[5, VOCAB_SIZE])
    _error(http.post("/v1/completions", json=outside), "logprob_token_ids", "out of vocabulary")


# --------------------------------------------------------------------------- stream_options
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_stream_options_usage_none_by_default_last_chunk_or_every_chunk(http, route):
    body = _body(max_tokens=4) if route == "completions" else _chat(max_tokens=4)
    if route == "chat/completions":
        body.pop("prompt", None)
    no_usage = _stream(http, route, body | {"stream_options": {}})
    assert all(event.get("usage") is None for event in no_usage)
    last = _stream(http, route, body | {"stream_options": {"include_usage": True}})
    assert all(event.get("usage") is None for event in last[:-1])
    assert last[-1]["choices"] == [] and last[-1]["usage"]["completion_tokens"] == 4
    options = {"include_usage": True, "continuous_usage_stats": True}
    every = _stream(http, route, body | {"stream_options": options})
    assert all(event.get("usage") for event in every)  # the first chunk too
    assert every[-1]["usage"]["completion_tokens"] == 4
    prompt_tokens = every[-1]["usage"]["prompt_tokens"]
    assert all(event["usage"]["prompt_tokens"] == prompt_tokens for event in every)


# ------------------------------------------------------------------------- server flags
def test_return_tokens_as_token_ids_flag_is_the_default_a_request_may_override(fhttp, http):
    body = _body(max_tokens=3, logprobs=0)
    tokens = fhttp.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert all(token.startswith("token_id:") for token in tokens)
    texts = fhttp.post("/v1/completions", json=body | {"return_tokens_as_token_ids": False})
    assert not any(
        t.startswith("token_id:") for t in texts.json()["choices"][0]["logprobs"]["tokens"]
    )
    default = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert not any(token.startswith("token_id:") for token in default)


def test_prompt_tokens_details_count_prefix_cache_hits(fhttp, http):
    prompt = "Lily and Ben went to the park to play with a big red ball and a kite"
    body = _body(prompt=prompt, max_tokens=2)
    first = fhttp.post("/v1/completions", json=body).json()["usage"]
    second = fhttp.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["prompt_tokens"] and cached % 16 == 0  # whole blocks
    events = _stream(fhttp, "completions", body | {"stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"] is None


def test_tokenizer_info_is_served_only_with_its_flag(fhttp, http, stories_llm):
    info = fhttp.get("/tokenizer_info").json()
    tokenizer = stories_llm.get_tokenizer()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == CHAT_TEMPLATE
    assert "added_tokens_decoder" not in info and "tokenizer_object" not in info
    assert http.get("/tokenizer_info").status_code == 404


def test_load_counts_generation_requests_in_flight(fhttp, flagged, http):
    assert fhttp.get("/load").json() == {"server_load": 0}
    flagged.call("set_step_delay", 0.05)
    try:
        results = []

        def stream():
            results.append(_stream(fhttp, "completions", _body(max_tokens=20, ignore_eos=True)))

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 20
        seen = 0
        while thread.is_alive() and time.monotonic() < deadline:
            seen = max(seen, fhttp.get("/load").json()["server_load"])
            time.sleep(0.02)
        thread.join(30)
    finally:
        flagged.call("set_step_delay", 0.0)
    assert seen == 1 and results
    assert fhttp.get("/load").json() == {"server_load": 0}
    assert http.get("/load").json() == {"server_load": 0}  # tracking off


# ---------------------------------------------------------------------- POST /invocations
def test_invocations_route_by_body_shape(http):
    chat = http.post("/invocations", json=_chat(max_tokens=2)).json()
    assert chat["object"] == "chat.completion"
    completion = http.post("/invocations", json=_body(max_tokens=2)).json()
    assert completion["object"] == "text_completion"
    streamed = http.post("/invocations", json=_body(max_tokens=2, stream=True))
    assert streamed.text.rstrip().endswith("data: [DONE]")
    _error(http.post("/invocations", json=_chat(max_tokens="many")), "max_tokens", "valid integer")
    neither = http.post("/invocations", json={"model": MODEL_NAME, "input": "x"})
    assert neither.status_code == 400
    assert "Cannot find suitable handler" in neither.json()["error"]["message"]


# ------------------------------------------------------------------------- error texts, seed
def test_seed_takes_any_64_bit_integer_and_range_errors_read_as_pydantics(http):
    body = _body(max_tokens=6, temperature=1.0, seed=-(2**63))
    first = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == first
    _error(http.post("/v1/completions", json=_body(seed=2**63)), "seed", "less than or equal to")
    _error(
        http.post("/v1/completions", json=_body(truncate_prompt_tokens=-2)),
        "truncate_prompt_tokens",
        "greater than or equal to -1",
        "[type=greater_than_equal]",
    )


def test_every_bad_logit_bias_key_is_named(http):
    body = _body(logit_bias={"5": 1.0, "600": 1.0, "9000": -1.0})
    _error(
        http.post("/v1/completions", json=body), "logit_bias", "out of vocabulary", "600", "9000"
    )
    body = _body(logit_bias={"x": 1.0, "5": 1.0, "y": 2.0})
    _error(http.post("/v1/completions", json=body), "logit_bias", "'x'", "'y'")


def test_an_undeclared_field_is_a_400_naming_it(http):
    _error(http.post("/v1/completions", json=_body(frobnicate=1)), "frobnicate", "unknown field")
    _error(http.post("/v1/chat/completions", json=_chat(session_id="s")), "session_id")
    options = {"stream": True, "stream_options": {"include_usage": True, "every_chunk": True}}
    _error(http.post("/v1/completions", json=_body(**options)), "stream_options.every_chunk")
    assert http.post("/v1/completions", json=_body(max_tokens=1)).status_code == 200


# ------------------------------------------------------------------------- use_beam_search
def test_completion_beam_search_returns_the_offline_beams_best_first(http, stories_llm):
    from jaxpaged import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=8, temperature=1.0)
    (offline,) = stories_llm.beam_search([PROMPT], params)
    body = _body(max_tokens=8, n=3, use_beam_search=True, temperature=1.0)
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [beam.text for beam in offline.sequences]
    # Temperature 0 ranks by the model's log-probabilities too (vLLM's beam search does).
    greedy = http.post("/v1/completions", json=body | {"temperature": 0.0}).json()["choices"]
    assert [c["text"] for c in greedy] == [c["text"] for c in choices]
    # Several prompts: each its own beams, indices prompt_index * n + rank.
    two = http.post("/v1/completions", json=body | {"prompt": [PROMPT, PROMPT]}).json()
    assert [c["text"] for c in two["choices"]] == [c["text"] for c in choices] * 2
    _error(http.post("/v1/completions", json=body | {"stream": True}), "stream", "beam search")
    _error(http.post("/v1/completions", json=body | {"top_p": 0.5}), "top_p", "beam search")
    # A structured-output constraint would be ignored by beam search: refused by name.
    constrained = body | {"response_format": {"type": "json_object"}}
    _error(http.post("/v1/completions", json=constrained), "response_format", "beam search")
    _error(http.post("/v1/completions", json=body | {"guided_regex": "a+"}), "guided_regex")
    _error(http.post("/v1/completions", json=_body(length_penalty=0.5)), "length_penalty")
    chat = _chat(max_tokens=2, use_beam_search=True)
    _error(http.post("/v1/chat/completions", json=chat), "use_beam_search")


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_streamed_events_are_written_in_vllms_compact_json(http, route):
    """Both routes write events as vLLM does (pydantic's model_dump_json): no spaces after
    "," and ":", non-ASCII characters as UTF-8. Chat wrote ``json.dumps``' default before."""
    if route == "completions":
        body = _body(prompt="Il était une fois", echo=True, max_tokens=3)
    else:
        messages = [*MESSAGES, {"role": "assistant", "content": "Il était"}]
        body = _chat(messages=messages, max_tokens=3, echo=True, add_generation_prompt=False,
                     continue_final_message=True)  # fmt: skip
    with http.stream("POST", f"/v1/{route}", json=body | {"stream": True}) as response:
        payloads = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: {")
        ]
    assert len(payloads) >= 3
    for payload in payloads:
        compact = json.dumps(json.loads(payload), ensure_ascii=False, separators=(",", ":"))
        assert payload == compact
    assert "était" in payloads[0 if route == "completions" else 1]
