"""LoRA adapters through the server: ``model`` picks the adapter, ``/v1/models`` lists them,
adapters load and unload at run time, and answers equal HF transformers + peft's tokens."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from transformers import AutoTokenizer

from jaxpaged.entrypoints.openai.serving_models import LoRAModulePath, parse_lora_modules
from tests.live_server import CHAT_TEMPLATE, MODEL_NAME, start_server
from tests.lora.adapters import GOLDEN, SPECS, write_adapter

GOLDEN_TOKENS = json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory, stories_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-server")
    return {spec.name: write_adapter(stories_dir, root / spec.name, spec) for spec in SPECS}


@pytest.fixture(scope="module")
def lora_server(adapter_paths):
    first, second, _ = SPECS
    modules = [LoRAModulePath(s.name, adapter_paths[s.name]) for s in (first, second)]
    server = start_server(
        lora_modules=modules,
        chat_template=CHAT_TEMPLATE,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    yield server
    server.stop()


def _expected_text(tokenizer, prompt: list[int], tokens: list[int]) -> str:
    # The continuation's text in the context of its prompt (what incremental detokenizing gives).
    full = tokenizer.decode(prompt + tokens, skip_special_tokens=True)
    return full[len(tokenizer.decode(prompt, skip_special_tokens=True)) :]


def _complete(client, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return client.post("/v1/completions", json=body)


def test_models_route_adapters_and_runtime_load_unload(lora_server, adapter_paths, stories_dir):
    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    prompts = GOLDEN_TOKENS["prompts"]
    third = SPECS[2].name
    with httpx.Client(base_url=lora_server.url, timeout=120) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [
            (MODEL_NAME, None), (SPECS[0].name, MODEL_NAME), (SPECS[1].name, MODEL_NAME),
        ]  # fmt: skip
        assert cards[1]["root"] == adapter_paths[SPECS[0].name]
        # Unknown adapter: 404 in vLLM's shape, before and after a load.
        missing = _complete(client, third, prompts[0])
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == f"The model `{third}` does not exist."
        loaded = client.post(
            "/v1/load_lora_adapter",
            json={"lora_name": third, "lora_path": adapter_paths[third]},
        )
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == f"Success: LoRA adapter '{third}' added successfully."
        again = client.post(
            "/v1/load_lora_adapter",
            json={"lora_name": third, "lora_path": adapter_paths[third]},
        )
        assert again.status_code == 400
        assert "has already been loaded" in again.json()["error"]["message"]
        # Base + three adapters, one request each: sequentially (every adapter passes through
        # the 2 slots; this also compiles the shapes used), then all at once.
        cases = [(MODEL_NAME, "base", 0)] + [(s.name, s.name, i) for i, s in enumerate(SPECS)]

        def check(answers):
            for (model, key, i), answer in zip(cases, answers, strict=True):
                assert answer.status_code == 200, answer.text
                expected = _expected_text(tokenizer, prompts[i], GOLDEN_TOKENS[key][i])
                assert answer.json()["choices"][0]["text"] == expected, (key, i)
                assert answer.json()["model"] == model, key

        check([_complete(client, model, prompts[i]) for model, _, i in cases])
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            check(list(pool.map(lambda c: _complete(client, c[0], prompts[c[2]]), cases)))
        assert lora_server.call("list_loras") == [1, 2, 3]
        # Unload and load again while serving, then the same requests: no step compiles (the
        # count is the core process's model runner's).
        compiled = lora_server.call("num_compilations")
        assert compiled > 0
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": SPECS[0].name}).is_success
        reload = {"lora_name": SPECS[0].name, "lora_path": adapter_paths[SPECS[0].name]}
        assert client.post("/v1/load_lora_adapter", json=reload).is_success
        check([_complete(client, model, prompts[i]) for model, _, i in cases])
        assert lora_server.call("num_compilations") == compiled
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": third})
        assert unloaded.text == f"Success: LoRA adapter '{third}' removed successfully."
        assert _complete(client, third, prompts[0]).status_code == 404
        assert third not in [c["id"] for c in client.get("/v1/models").json()["data"]]
        gone = client.post("/v1/unload_lora_adapter", json={"lora_name": third})
        assert gone.status_code == 404
        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
        assert bad.status_code == 400 and "is not a directory" in bad.json()["error"]["message"]
        # Each bad body names its field.
        for body, field in [
            ({"lora_name": "x", "lora_path": "/nope"}, "lora_path"),
            ({"lora_name": "", "lora_path": adapter_paths[third]}, "lora_name"),
            ({"lora_name": "x"}, "lora_path"),
            (
                {"lora_name": "x", "lora_path": adapter_paths[third], "load_inplace": True},
                "load_inplace",
            ),
            ({"lora_name": SPECS[0].name, "lora_int_id": 99}, "lora_int_id"),
        ]:
            route = "unload" if "lora_int_id" in body else "load"
            answer = client.post(f"/v1/{route}_lora_adapter", json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == field, body
        metrics = client.get("/metrics").text
    info = [line for line in metrics.splitlines() if line.startswith("jaxpaged:lora_requests_info")]
    assert len(info) == 1
    assert 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]


def _stream_models(response: httpx.Response) -> list[str]:
    """The ``model`` field of every data chunk of a streamed answer."""
    assert response.status_code == 200, response.text
    lines = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert lines[-1] == "[DONE]"
    return [json.loads(line)["model"] for line in lines[:-1]]


@pytest.mark.parametrize("model", [MODEL_NAME, SPECS[1].name])
def test_responses_name_the_adapter_the_request_picked(lora_server, model):
    # vLLM echoes the adapter's name (not the base model's) in every answer and chunk.
    prompt = GOLDEN_TOKENS["prompts"][0]
    messages = [{"role": "user", "content": "Once upon a time"}]
    common = {"model": model, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=lora_server.url, timeout=120) as client:
        completion = client.post("/v1/completions", json={**common, "prompt": prompt})
        assert completion.status_code == 200, completion.text
        assert completion.json()["model"] == model
        chat = client.post("/v1/chat/completions", json={**common, "messages": messages})
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == model
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        streamed = client.post("/v1/completions", json={**common, "prompt": prompt, **usage})
        chunks = _stream_models(streamed)
        assert len(chunks) >= 2 and set(chunks) == {model}  # text chunks and the usage chunk
        streamed = client.post(
            "/v1/chat/completions", json={**common, "messages": messages, **usage}
        )
        chunks = _stream_models(streamed)
        assert len(chunks) >= 2 and set(chunks) == {model}


def test_lora_modules_flag_takes_name_path_and_vllm_json():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [
        LoRAModulePath("a", "/x"),
        LoRAModulePath("b", "/y", "m"),
    ]
    with pytest.raises(ValueError, match="must be name=path"):
        parse_lora_modules(["just-a-name"])
