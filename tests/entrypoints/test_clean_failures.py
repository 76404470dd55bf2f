"""Bad checkpoints and bad prompts fail with one message naming the file or field: the CLI prints
one ``jaxpaged: error:`` line and exits 2 (``generate`` and ``serve`` alike), ``LLM(...)`` raises
``ValueError``, ``LLM.generate`` refuses prompts as the server does."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxpaged.config import default_model_path

SMALL = ["--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
# config.json changes -> the field the error must name.
BAD_CONFIGS = {
    "negative hidden size": ({"hidden_size": -64}, "hidden_size must be a positive integer"),
    "zero layers": ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    "heads not dividing hidden": (
        {"num_attention_heads": 7, "head_dim": None},
        "not a multiple of the number of attention heads (7)",
    ),
    "kv heads not dividing heads": (
        {"num_key_value_heads": 3},
        "num_attention_heads (8) must be a multiple of num_key_value_heads (3)",
    ),
    "fractional size": ({"intermediate_size": 17.5}, "intermediate_size"),
}


def _copy_model(tmp_path, name: str) -> str:
    path = tmp_path / name
    shutil.copytree(default_model_path(), path)
    return str(path)


@pytest.fixture
def truncated_model(tmp_path) -> str:
    """stories260k whose safetensors file lost its second half (an interrupted download)."""
    path = _copy_model(tmp_path, "truncated")
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    return path


def _bad_config_model(tmp_path, change: dict) -> str:
    path = _copy_model(tmp_path, "bad-config")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


def _jaxpaged(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.entrypoints.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_cli_generate_and_serve_name_a_bad_checkpoint_and_exit_2(truncated_model, tmp_path):
    """``generate`` builds ``LLM`` (so ``LLM(...)`` raises the ValueError it prints); ``serve``
    reads the config in its own process and the weights in the engine core's, whose
    ValueError reaches it as one (not as "the engine core failed to start")."""
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine_core.core_process import start_core_process

    bad_config = _bad_config_model(tmp_path, {"hidden_size": -64})
    # Started together: each is a fresh interpreter importing JAX (seconds).
    runs = {
        "generate": _jaxpaged(
            "generate", "hi", "--model", truncated_model, "--max-tokens", "2", *SMALL
        ),
        "serve": _jaxpaged("serve", bad_config, "--port", "0", *SMALL),
    }
    expected = {
        "generate": f"{truncated_model}/model.safetensors is not a readable safetensors file",
        "serve": f"{bad_config}/config.json: hidden_size must be a positive integer, got -64",
    }
    args = EngineArgs(model=truncated_model, max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"truncated/model\.safetensors is not a readable"):
        start_core_process(dataclasses.replace(args, max_num_batched_tokens=32))
    for command, process in runs.items():
        _, err = process.communicate(timeout=300)
        assert process.returncode == 2, (command, err[-2000:])
        errors = [line for line in err.splitlines() if line.startswith("jaxpaged: error:")]
        assert len(errors) == 1 and expected[command] in errors[0], (command, err[-2000:])
        assert "Traceback" not in err, (command, err[-2000:])


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_llm_raises_a_value_error_naming_the_impossible_config_field(tmp_path, case):
    from jaxpaged import LLM

    change, message = BAD_CONFIGS[case]
    path = _bad_config_model(tmp_path, change)
    with pytest.raises(ValueError) as info:
        LLM(path, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
    assert f"{path}/config.json" in str(info.value) and message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "prompts, error, message",
    [
        ("Once \ud800 upon", ValueError, r"lone surrogate U\+D800 at character 5"),
        ({"prompt": "x\udfff"}, ValueError, r"lone surrogate U\+DFFF at character 1"),
        (None, TypeError, "prompts must be a string, a prompt dict .* got NoneType"),
        (7, TypeError, "prompts must be a string, a prompt dict .* got int"),
        (["fine", 7], ValueError, "a prompt must be a string.* got int"),
    ],
)
def test_generate_refuses_bad_prompts_as_the_server_does(stories_llm, prompts, error, message):
    from jaxpaged import SamplingParams

    with pytest.raises(error, match=message):
        stories_llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    engine = stories_llm.llm_engine
    assert engine.get_num_unfinished_requests() == 0  # nothing was queued
