"""``jaxpaged serve``: flag parsing, the API key from the environment, and a real start-up."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from jaxpaged.entrypoints.cli import _build_parser
from jaxpaged.entrypoints.cli_args import serve_config


def _serve_args(*argv):
    return _build_parser().parse_args(["serve", *argv])


def test_serve_flags_map_to_engine_args_and_a_frozen_serve_config():
    engine_args, config = serve_config(
        _serve_args(
            "/models/m",
            "--host",
            "127.0.0.1",
            "--port",
            "9000",
            "--served-model-name",
            "a",
            "b",
            "--max-num-queued-requests",
            "5",
            "--max-model-len",
            "64",
            "--no-enforce-eager",
            "--chat-template-workers",
            "3",
            "--max-queued-chat-templates",
            "0",
        ),
        environ={},
    )
    assert engine_args.model == "/models/m"
    assert engine_args.max_model_len == 64
    assert engine_args.enforce_eager is False
    assert (config.host, config.port) == ("127.0.0.1", 9000)
    assert config.served_model_names == ("a", "b")
    assert config.max_num_queued_requests == 5
    assert config.api_key is None
    assert (config.chat_template_workers, config.max_queued_chat_templates) == (3, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1


def test_serve_defaults_embedded_model_port_8000_and_env_api_key():
    engine_args, config = serve_config(_serve_args(), environ={"JAXPAGED_API_KEY": "from-env"})
    assert engine_args.model is None
    assert config.served_model_names == ("stories260k",)
    assert (config.host, config.port) == (None, 8000)
    assert config.api_key == "from-env"
    _, flag_wins = serve_config(_serve_args("--api-key", "flag"), environ={"JAXPAGED_API_KEY": "x"})
    assert flag_wins.api_key == "flag"


def test_serve_rejects_conflicting_model_and_negative_bounds():
    with pytest.raises(ValueError, match="disagree"):
        serve_config(_serve_args("/a", "--model", "/b"), environ={})
    with pytest.raises(ValueError, match="--max-num-queued-requests must be at least 0, got -1"):
        serve_config(_serve_args("--max-num-queued-requests", "-1"), environ={})
    with pytest.raises(ValueError, match="--chat-template-workers must be at least 1, got 0"):
        serve_config(_serve_args("--chat-template-workers", "0"), environ={})


def test_api_server_count_defaults_to_one_and_refuses_zero_negative_and_data_parallel():
    assert serve_config(_serve_args(), environ={})[1].api_server_count == 1
    assert serve_config(_serve_args("-asc", "4"), environ={})[1].api_server_count == 4
    for bad in ("0", "-2"):
        with pytest.raises(ValueError, match=f"--api-server-count must be at least 1, got {bad}"):
            serve_config(_serve_args("--api-server-count", bad), environ={})
    with pytest.raises(ValueError, match="--api-server-count 2 needs --data-parallel-size 1"):
        serve_config(_serve_args("--api-server-count", "2", "-dp", "2"), environ={})


def test_dev_endpoints_from_the_flag_or_vllm_server_dev_mode(monkeypatch):
    def dev(*argv, environ=None):
        return serve_config(_serve_args(*argv), environ=environ)[1].enable_dev_endpoints

    assert dev(environ={}) is False
    assert dev("--enable-dev-endpoints", environ={}) is True
    for value, on in (("1", True), ("0", False), ("", False)):
        assert dev(environ={"VLLM_SERVER_DEV_MODE": value}) is on
    # environ=None reads this process's environment (entrypoints/env.py).
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert dev() is True
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    assert dev() is False


def test_dev_endpoints_refused_with_data_parallelism_before_any_core_starts():
    from jaxpaged.entrypoints.openai.serve_config import ServeConfig

    with pytest.raises(ValueError, match="--enable-dev-endpoints needs --data-parallel-size 1"):
        ServeConfig(data_parallel_size=2, enable_dev_endpoints=True)


def test_jaxpaged_serve_without_a_tokenizer_serves_token_ids_and_refuses_text(monkeypatch):
    """``main(["serve", ..., "--skip-tokenizer-init"])`` end to end (engine core process
    included), with uvicorn's blocking ``run`` replaced by a recorder whose app is then served
    on loopback."""
    import uvicorn

    from jaxpaged.entrypoints.cli import main
    from tests.live_server import RunningServer

    served = {}

    def record(app, **kwargs):
        served.update(kwargs, app=app)

    monkeypatch.setattr(uvicorn, "run", record)
    monkeypatch.setenv("JAXPAGED_API_KEY", "k")
    argv = ["serve", "--port", "1234", "--max-model-len", "64", "--skip-tokenizer-init"]
    assert main([*argv, "--dtype", "float32"]) == 0
    assert (served["host"], served["port"]) == ("0.0.0.0", 1234)
    running = RunningServer(served["app"])
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200
        assert httpx.get(f"{running.url}/v1/models").status_code == 401
        models = httpx.get(f"{running.url}/v1/models", headers={"Authorization": "Bearer k"})
        assert [m["id"] for m in models.json()["data"]] == ["stories260k"]
        assert models.json()["data"][0]["max_model_len"] == 64
        auth = {"Authorization": "Bearer k"}
        body = {"prompt": [1, 403, 407], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        ids = httpx.post(f"{running.url}/v1/completions", json=body, headers=auth, timeout=60)
        assert ids.status_code == 200, ids.text
        assert ids.json()["choices"][0]["text"] == ""  # no tokenizer, no text
        assert ids.json()["usage"]["completion_tokens"] == 3
        text = httpx.post(
            f"{running.url}/v1/completions", json=body | {"prompt": "Once"}, headers=auth
        )
        assert text.status_code == 400 and "--skip-tokenizer-init" in text.text
        tokenize = httpx.post(f"{running.url}/tokenize", json={"prompt": "Once"})
        assert tokenize.status_code == 400 and "--skip-tokenizer-init" in tokenize.text
    finally:
        running.stop()


def test_bench_dispatches_to_the_benchmark_modules(capsys):
    from jaxpaged.entrypoints.cli import main

    for kind, flag in (("serve", "--request-rate"), ("latency", "--batch-size")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", kind, "--help"])
        assert exit_info.value.code == 0
        assert flag in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])


def test_api_server_module_runs_the_serve_command():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "jaxpaged.entrypoints.openai.api_server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--served-model-name" in result.stdout and "--skip-tokenizer-init" in result.stdout


def test_serve_refuses_bad_lora_modules_before_loading_the_model(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 16}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    _, ok = serve_config(
        _serve_args("--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"a={adapter}"),
        environ={},
    )
    assert [m.name for m in ok.lora_modules] == ["a"]
    bad = {
        "rank 16 is greater than max_lora_rank 8": (
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"a={adapter}",
        ),
        "is not a directory": ("--enable-lora", "--lora-modules", f"a={tmp_path / 'none'}"),
        "has no adapter_config.json": ("--enable-lora", "--lora-modules", f"a={tmp_path}"),
        "needs --enable-lora": ("--lora-modules", f"a={adapter}"),
        "'stories260k' is used twice": (
            "--enable-lora",
            "--lora-modules",
            f"stories260k={adapter}",
        ),
        "'a' is used twice": ("--enable-lora", "--lora-modules", f"a={adapter}", f"a={adapter}"),
    }
    for message, argv in bad.items():
        with pytest.raises(ValueError, match=message):
            serve_config(_serve_args(*argv), environ={})


def test_tool_and_reasoning_parser_flags_reach_the_serve_config():
    _, config = serve_config(
        _serve_args(
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
        ),
        environ={},
    )
    assert config.enable_auto_tool_choice is True
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "qwen3")


def test_structured_outputs_configs_reasoning_parser_is_the_servers_as_in_vllm():
    """vLLM serves with ``structured_outputs_config.reasoning_parser`` (which --reasoning-parser
    sets); before, the server ignored it there and split no reasoning."""
    nested = '{"reasoning_parser": "deepseek_r1", "backend": "guidance"}'
    _, config = serve_config(_serve_args("--structured-outputs-config", nested), environ={})
    assert config.reasoning_parser == "deepseek_r1"
    both = ("--reasoning-parser", "deepseek_r1", "--structured-outputs-config", nested)
    assert serve_config(_serve_args(*both), environ={})[1].reasoning_parser == "deepseek_r1"
    empty = '{"reasoning_parser": ""}'  # vLLM's default: none
    _, config = serve_config(_serve_args("--structured-outputs-config", empty), environ={})
    assert config.reasoning_parser is None
    with pytest.raises(ValueError, match="--reasoning-parser 'qwen3' and --structured-outputs"):
        serve_config(_serve_args("--reasoning-parser", "qwen3", *both[2:]), environ={})
    with pytest.raises(ValueError, match="reasoning_parser 'r2' is not a known reasoning"):
        serve_config(
            _serve_args("--structured-outputs-config", '{"reasoning_parser": "r2"}'), environ={}
        )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tool-call-parser", "nope"], "--tool-call-parser 'nope' is not a known tool parser"),
        (["--reasoning-parser", "r2"], "--reasoning-parser 'r2' is not a known reasoning parser"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    ],
)
def test_unknown_parser_names_fail_at_startup_before_the_engine(argv, message, capsys):
    from jaxpaged.entrypoints.cli import main

    # serve_config checks the flags before any engine is built: main returns at once.
    assert main(["serve", *argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith("jaxpaged: error: ") and message in error
    if "parser '" in message:
        assert "hermes" in error or "deepseek_r1" in error  # the known names are listed


def test_vllm_serving_switches_are_off_by_default_and_reach_the_serve_config():
    _, off = serve_config(_serve_args(), environ={})
    switches = (
        "return_tokens_as_token_ids",
        "enable_prompt_tokens_details",
        "enable_tokenizer_info_endpoint",
        "enable_server_load_tracking",
    )
    assert [getattr(off, name) for name in switches] == [False] * 4
    _, on = serve_config(
        _serve_args("--return-tokens-as-token-ids", "--enable-server-load-tracking"), environ={}
    )
    assert [getattr(on, name) for name in switches] == [True, False, False, True]
