"""examples/my_llama.py: an out-of-tree model registered by name, served through ``LLM`` and
through the server's engine-core process (``model_impl_module``)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jaxpaged import LLM, ModelRegistry, SamplingParams
from tests.conftest import SMALL_ENGINE

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
ARCH = "MyLlamaForCausalLM"


@pytest.fixture(scope="module")
def my_llama_dir(stories_dir, tmp_path_factory) -> str:
    """stories260k's files under a config naming the example's architecture (an HF Llama
    checkpoint, so its tensor names are the example's parameter names)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # spawned engine cores inherit sys.path
    directory = tmp_path_factory.mktemp("my_llama")
    for name in os.listdir(stories_dir):
        if name != "config.json":
            shutil.copy(os.path.join(stories_dir, name), directory)
    config = json.loads(pathlib.Path(stories_dir, "config.json").read_text())
    config["architectures"] = [ARCH]
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.fixture(scope="module")
def my_llm(my_llama_dir):
    return LLM(my_llama_dir, dtype="float32", model_impl_module="my_llama", **SMALL_ENGINE)


def test_registry_names_the_architecture_and_refuses_bad_entries(my_llm):
    assert ModelRegistry.is_supported(ARCH) and ARCH in ModelRegistry.get_supported_archs()
    assert "LlamaForCausalLM" in ModelRegistry.get_supported_archs()
    with pytest.raises(ValueError, match="model_class"):
        ModelRegistry.register_model("BrokenForCausalLM", "no_colon_here")
    ModelRegistry.register_model("LazyForCausalLM", "no_such_module:Model")
    from models.registry import get_model_class

    with pytest.raises(ValueError, match="no_such_module"):
        get_model_class(type("Config", (), {"architectures": ["LazyForCausalLM"]}))


def test_an_unimportable_model_impl_module_is_named(my_llama_dir):
    with pytest.raises(ValueError, match="model_impl_module 'no_such_plugin'"):
        LLM(my_llama_dir, model_impl_module="no_such_plugin")


def test_greedy_tokens_and_logprobs_equal_its_plain_jax_forward(my_llm, golden):
    """The engine (paged KV, chunked steps, the example's paged_attention calls) against the
    example's dense_logits (one sequence, plain causal softmax) on the same weights; the
    weights are stories260k's, so the tokens are also golden.json's."""
    cases = golden["cases"]
    params = SamplingParams(
        temperature=0, max_tokens=golden["max_new_tokens"], ignore_eos=True, logprobs=0
    )
    outputs = my_llm.generate(
        [{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False
    )
    model = my_llm.llm_engine.worker.model_runner.weights.model()
    for output, case in zip(outputs, cases, strict=True):
        new = list(output.outputs[0].token_ids)
        assert new == case["greedy_new_ids"]
        n = len(case["prompt_ids"])
        logits = model.dense_logits(jnp.asarray(case["prompt_ids"] + new))
        reference = jax.nn.log_softmax(logits, -1)[n - 1 : -1]
        assert np.argmax(reference, -1).tolist() == new
        got = [
            step[token].logprob for step, token in zip(output.outputs[0].logprobs, new, strict=True)
        ]
        want = np.asarray(reference)[np.arange(len(new)), new]
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_update_weights_with_its_hf_names(my_llm, my_llama_dir, golden):
    hf = safetensors.numpy.load_file(os.path.join(my_llama_dir, "model.safetensors"))
    case = golden["cases"][0]
    params = SamplingParams(temperature=0, max_tokens=golden["max_new_tokens"], ignore_eos=True)

    def greedy():
        out = my_llm.generate({"prompt_token_ids": case["prompt_ids"]}, params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    my_llm.update_weights({k: v * 0.5 for k, v in hf.items()})
    assert greedy() != case["greedy_new_ids"]
    my_llm.update_weights(hf)
    assert greedy() == case["greedy_new_ids"]


def test_served_through_the_engine_core_with_dev_sleep_endpoints(my_llama_dir, golden):
    """``jaxpaged serve --model-impl-module my_llama --enable-sleep-mode
    --enable-dev-endpoints``: the core process imports the module, then builds the model."""
    from tests.live_server import start_server

    server = start_server(
        model=my_llama_dir,
        model_impl_module="my_llama",
        enable_sleep_mode=True,
        enable_dev_endpoints=True,
    )
    try:
        case = golden["cases"][0]
        body = {
            "model": "stories",
            "prompt": case["prompt_ids"],
            "max_tokens": golden["max_new_tokens"],
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            assert client.post("/sleep", params={"level": "3"}).status_code == 400
            assert client.post("/sleep", params={"level": "1"}).status_code == 200
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}
            refused = client.post("/v1/completions", json=body)
            # 503 with Retry-After: a load balancer retries it (another replica, or later).
            assert refused.status_code == 503 and "wake_up" in refused.text
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["type"] == "ServiceUnavailableError"
            assert client.post("/wake_up").status_code == 200
            assert client.post("/wake_up").status_code == 200  # not sleeping: a no-op
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            tokens = client.post("/v1/completions", json=body | {"logprobs": 0}).json()
            assert tokens["choices"][0]["logprobs"]["tokens"]
            assert client.post("/reset_prefix_cache").status_code == 200
        server.wait_idle()
    finally:
        server.stop()


def test_dev_endpoints_are_absent_by_default(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.post("/sleep").status_code == 404
        assert client.get("/is_sleeping").status_code == 404
