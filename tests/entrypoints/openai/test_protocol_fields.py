"""Every field of vLLM's completion and chat requests is honoured or refused by name, against the
live server; the honoured ones are checked against ``LLM.generate`` on the same engine."""

from __future__ import annotations

import json

import httpx
import pytest

from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxpaged.entrypoints.openai.serving_engine import UNSUPPORTED_FIELDS
from tests.live_server import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]

# vLLM's request fields (vllm/entrypoints/openai/protocol.py at 0052bed3), sampling and extra.
VLLM_COMMON = {
    "model", "best_of", "frequency_penalty", "logit_bias", "n", "presence_penalty", "seed",
    "stop", "stream", "stream_options", "temperature", "top_p", "user", "use_beam_search",
    "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
    "prompt_logprobs", "add_special_tokens", "response_format", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "max_tokens", "logprobs", "echo",
}  # fmt: skip
VLLM_COMPLETION = VLLM_COMMON | {"prompt", "prompt_embeds", "suffix"}
VLLM_CHAT = VLLM_COMMON | {
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
    "reasoning_effort", "include_reasoning", "parallel_tool_calls", "bad_words",
    "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "structural_tag",
}  # fmt: skip


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    "model, fields", [(CompletionRequest, VLLM_COMPLETION), (ChatCompletionRequest, VLLM_CHAT)]
)
def test_every_vllm_request_field_is_declared(model, fields):
    """Declared fields are honoured or in UNSUPPORTED_FIELDS; none is an undeclared extra."""
    assert fields <= set(model.model_fields), sorted(fields - set(model.model_fields))
    assert set(UNSUPPORTED_FIELDS) <= set(CompletionRequest.model_fields) | set(
        ChatCompletionRequest.model_fields
    )


@pytest.mark.parametrize(
    "route, field, value",
    [
        ("chat/completions", "use_beam_search", True),
        ("completions", "length_penalty", 0.5),
        ("completions", "priority", 1),
        ("completions", "logits_processors", ["my.Processor"]),
        ("completions", "cache_salt", "salt"),
        ("completions", "prompt_embeds", "AAAA"),
        ("completions", "suffix", "end"),
        ("chat/completions", "reasoning_effort", "low"),
        ("chat/completions", "vllm_xargs", {"k": 1}),
    ],
)
def test_unsupported_fields_are_a_400_naming_them(http, route, field, value):
    body = {"model": MODEL_NAME, "max_tokens": 2, field: value}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    response = http.post(f"/v1/{route}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(http):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0}
    body |= {"use_beam_search": False, "priority": 0, "length_penalty": 1.0}
    assert http.post("/v1/completions", json=body).status_code == 200


def _token_ids(choice) -> list[int]:
    """Output ids from logprobs written with return_tokens_as_token_ids ("token_id:<id>")."""
    return [int(token.removeprefix("token_id:")) for token in choice["logprobs"]["tokens"]]


def test_allowed_token_ids_restrict_sampling(http):
    allowed = [300, 301]
    body = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3,
        "allowed_token_ids": allowed, "logprobs": 0, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    ids = _token_ids(choice)
    assert len(ids) == 8 and set(ids) <= set(allowed)


def test_bad_words_are_never_generated_and_multi_token_words_are_refused(
    http, greedy_reference, stories_llm
):
    (reference,) = greedy_reference([PROMPT], 8)
    tokenizer = stories_llm.get_tokenizer()
    # A word of the greedy continuation that is one token: the greedy output holds its id.
    word = next(
        w
        for w in reference.outputs[0].text.split()
        if len(tokenizer.encode(w, add_special_tokens=False)) == 1
    )
    (banned,) = tokenizer.encode(word, add_special_tokens=False)
    assert banned in reference.outputs[0].token_ids
    body = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
        "logprobs": 0, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    greedy = http.post("/v1/completions", json=body).json()["choices"][0]
    assert _token_ids(greedy) == reference.outputs[0].token_ids
    choice = http.post("/v1/completions", json=body | {"bad_words": [word]}).json()["choices"][0]
    assert banned not in _token_ids(choice) and len(_token_ids(choice)) == 8
    chat = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0.0}
    chat |= {"logprobs": True, "return_tokens_as_token_ids": True, "bad_words": [word]}
    content = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]
    assert banned not in [int(c["token"].removeprefix("token_id:")) for c in content["content"]]

    response = http.post("/v1/completions", json=body | {"bad_words": ["Once upon a time"]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "bad_words"


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, greedy_reference, stories_llm):
    ids = stories_llm.get_tokenizer().encode("Lily and Ben went to the park to play with a ball")
    body = {
        "model": MODEL_NAME, "prompt": ids, "max_tokens": 6, "temperature": 0.0,
        "truncate_prompt_tokens": 5,
    }  # fmt: skip
    response = http.post("/v1/completions", json=body).json()
    (reference,) = greedy_reference([{"prompt_token_ids": ids[-5:]}], 6)
    assert response["usage"]["prompt_tokens"] == 5
    assert response["choices"][0]["text"] == reference.outputs[0].text


def test_add_special_tokens_false_leaves_out_bos(http, stories_llm):
    tokenizer = stories_llm.get_tokenizer()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}
    with_bos = http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"]
    without = http.post("/v1/completions", json=body | {"add_special_tokens": False}).json()
    assert with_bos == len(tokenizer.encode(PROMPT))
    assert without["usage"]["prompt_tokens"] == len(
        tokenizer.encode(PROMPT, add_special_tokens=False)
    )
    assert without["usage"]["prompt_tokens"] == with_bos - 1


def test_prompt_logprobs_appear_in_responses_and_match_the_engine(http, greedy_reference):
    (reference,) = greedy_reference([PROMPT], 2, prompt_logprobs=2)
    body = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0,
        "prompt_logprobs": 2,
    }  # fmt: skip
    served = http.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    offline = reference.prompt_logprobs
    assert len(served) == len(offline) == len(reference.prompt_token_ids)
    assert served[0] is None
    for step, expected in zip(served[1:], offline[1:], strict=True):
        assert {int(k) for k in step} == set(expected)
        for token_id, entry in step.items():
            assert entry["logprob"] == pytest.approx(expected[int(token_id)].logprob, abs=1e-5)
            assert entry["rank"] == expected[int(token_id)].rank
    chat = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 1}
    chat_served = http.post("/v1/chat/completions", json=chat).json()["prompt_logprobs"]
    assert chat_served[0] is None and all(len(step) >= 1 for step in chat_served[1:])
    streamed = http.post("/v1/completions", json=body | {"stream": True})
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.json()["error"]["message"]


@pytest.mark.parametrize("route", ["completions", "tokenize"])
def test_a_lone_surrogate_in_the_body_is_a_400_and_the_server_keeps_serving(http, route):
    raw = '{"model": "%s", "prompt": "Once \\ud800 upon", "max_tokens": 2}' % MODEL_NAME
    path = "/tokenize" if route == "tokenize" else f"/v1/{route}"
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "U+D800" in error["message"] and error["param"] == "prompt"
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_a_body_nested_a_thousand_deep_is_a_400_and_surrogates_are_found_in_order(http):
    """The Unicode check walked the body recursively: 990 levels of valid JSON raised
    RecursionError (a 500). The first lone surrogate in the body's order is the one named."""
    deep = "[" * 990 + "1" + "]" * 990
    raw = '{"model": "%s", "prompt": %s, "max_tokens": 2}' % (MODEL_NAME, deep)
    response = http.post(
        "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    nested = {"model": "m", "prompt": ["ok", [["\ud800"]]], "stop": ["\udc00"]}
    with pytest.raises(ValueError, match=r"prompt\[1\]\[0\]\[0\] holds a lone surrogate U\+D800"):
        CompletionRequest.model_validate(nested)


def _sse_events(response) -> list[dict]:
    return [
        json.loads(line[len("data: ") :])
        for line in response.iter_lines()
        if line.startswith("data: {")
    ]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_each_streamed_choice_sends_its_finish_reason_once(http, route):
    """n=4 samples stopping at the first "." finish at different steps; each choice's
    finish_reason is sent once, and nothing of a choice follows it."""
    body = {
        "model": MODEL_NAME, "n": 4, "max_tokens": 24, "temperature": 1.0, "seed": 7,
        "stop": ["."], "stream": True,
    }  # fmt: skip
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    with http.stream("POST", f"/v1/{route}", json=body) as response:
        events = _sse_events(response)
    finishes, finished_at = {}, {}
    for position, event in enumerate(events):
        for choice in event["choices"]:
            assert choice["index"] not in finished_at, "a chunk after the choice's finish"
            if choice["finish_reason"] is not None:
                finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
                finished_at[choice["index"]] = position
    assert finishes == {i: 1 for i in range(4)}
    assert len(set(finished_at.values())) > 1  # some choice stopped before another


def test_request_id_names_the_response_and_chat_echo_continues_the_last_message(http):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "request_id": "abc-1"}
    assert http.post("/v1/completions", json=body).json()["id"] == "cmpl-abc-1"
    messages = [*MESSAGES, {"role": "assistant", "content": "Once there was"}]
    chat = {
        "model": MODEL_NAME, "messages": messages, "max_tokens": 3, "temperature": 0.0,
        "echo": True, "add_generation_prompt": False, "continue_final_message": True,
    }  # fmt: skip
    content = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
    plain = http.post("/v1/chat/completions", json=chat | {"echo": False}).json()
    assert content["content"] == "Once there was" + plain["choices"][0]["message"]["content"]
