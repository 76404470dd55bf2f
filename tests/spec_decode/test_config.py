"""SpeculativeConfig: vLLM's keys and defaults, checks against the target, engine wiring."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from jaxpaged.config import EngineArgs, EngineConfig, default_model_path
from jaxpaged.entrypoints import cli
from jaxpaged.spec_decode.config import SpeculationTarget, SpeculativeConfig


def _stories_json() -> dict:
    with open(os.path.join(default_model_path(), "config.json")) as f:
        return json.load(f)


def _target(**overrides) -> SpeculationTarget:
    values = dict(hf_config_json=_stories_json(), max_model_len=512, max_num_batched_tokens=2048)
    values.update(overrides)
    return SpeculationTarget(**values)


def _parse(value, **target):
    return SpeculativeConfig.parse(value, _target(**target))


def _write_config(directory, **config) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


def _eagle3_head(tmp_path, name="EAGLE3-tiny", **overrides) -> str:
    """An EAGLE-3 head config for the stories260k target (hidden 64, vocab 512)."""
    config = dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=64,
        intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=512, draft_vocab_size=128, rms_norm_eps=1e-5,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    config.update(overrides)
    return _write_config(tmp_path / name, **config)


# ------------------------------------------------------------------------------------ ngram
def test_ngram_defaults_follow_vllm():
    spec = _parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 4)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    assert spec.max_model_len == 512 and spec.model is None
    assert not spec.uses_aux_hidden_states and not spec.uses_draft_kv_cache


@pytest.mark.parametrize(
    ("given", "expected"),
    [({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 2}, (2, 2)),
     ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4))],
)  # fmt: skip
def test_one_lookup_size_copies_the_other(given, expected):
    spec = _parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == expected


def test_json_text_and_aliases_name_ngram():
    text = '{"method": "ngram_gpu", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    assert _parse(text).method == "ngram"
    assert _parse({"model": "[ngram]", "num_speculative_tokens": 3}).method == "ngram"
    assert _parse({"model": "ngram", "num_speculative_tokens": 3}).model is None


def test_vllm_keys_at_their_defaults_are_accepted():
    spec = _parse(
        {"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "greedy",
         "rejection_sample_method": "standard", "quantization": None, "enforce_eager": None}
    )  # fmt: skip
    assert spec.num_speculative_tokens == 2


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "lookahead", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa' is vLLM's but not supp"),
        ({"method": "deepseek_mtp", "num_speculative_tokens": 2}, "'deepseek_mtp' is vLLM's"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "integer >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": -3}, "integer >= 1, got -3"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "integer >= 1, got 2.5"),
        ({"method": "ngram", "num_speculative_tokens": True}, "integer >= 1, got True"),
        ({"method": "ngram", "num_speculative_tokens": 512}, r"K \+ 1 = 513 .* max_model_len is 512"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 3}, r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(3\)"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead is not a known key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
         "draft_sample_method is not supported .*'greedy'.*'probabilistic'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "tensor_parallel_size": 1},
         "draft_tensor_parallel_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "target_model_config": {}}, "set by the engine"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "some/draft"}, "not used by method 'ngram'"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size must be an integer >= 2"),
        ({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 600}, r"max_model_len \(600\) cannot be larger than the target's max_model_len \(512\)"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "must be the target's tensor_parallel_size"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a dict or its JSON text, got list"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        _parse(value)


def test_k_must_fit_the_token_budget():
    with pytest.raises(ValueError, match="max_num_batched_tokens is 4"):
        _parse({"method": "ngram", "num_speculative_tokens": 4}, max_num_batched_tokens=4)
    assert _parse({"method": "ngram", "num_speculative_tokens": 3}, max_num_batched_tokens=4)


# ----------------------------------------------------------------------- K by batch size
def test_disable_by_batch_size_turns_drafts_off_from_that_batch_size():
    spec = _parse({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8})
    assert [spec.num_tokens_for_batch(b) for b in (1, 7, 8, 256)] == [4, 4, 0, 0]


def test_per_batch_size_schedule_follows_vllm():
    spec = _parse(
        {"method": "ngram", "num_speculative_tokens": 4,
         "num_speculative_tokens_per_batch_size": [[33, 64, 1], [1, 16, 5], [17, 24, 2]]}
    )  # fmt: skip
    # K is capped at num_speculative_tokens; a gap (25-32) and past the end keep the previous K.
    got = [spec.num_tokens_for_batch(b) for b in (1, 16, 17, 24, 25, 32, 33, 64, 500)]
    assert got == [4, 4, 2, 2, 2, 2, 1, 1, 1]


@pytest.mark.parametrize(
    ("schedule", "message"),
    [([], "non-empty list"), ([[2, 4, 1]], "must start at batch size 1"),
     ([[1, 8, 2], [8, 9, 1]], "overlap at batch size 8"), ([[1, 8, -1]], "K >= 0"),
     ([[1, 8]], r"\[first, last, K\] integers")],
)  # fmt: skip
def test_bad_batch_schedules_are_refused(schedule, message):
    with pytest.raises(ValueError, match=message):
        _parse({"method": "ngram", "num_speculative_tokens": 2,
                "num_speculative_tokens_per_batch_size": schedule})  # fmt: skip


def test_both_batch_size_rules_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        _parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4,
                "num_speculative_tokens_per_batch_size": [[1, 4, 2]]})  # fmt: skip


# ---------------------------------------------------------------------------- draft model
def test_draft_model_of_the_same_vocabulary_is_accepted(tmp_path):
    draft = shutil.copytree(default_model_path(), tmp_path / "tiny-draft")
    spec = _parse({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    assert spec.model == str(draft) and spec.uses_draft_kv_cache
    assert spec.draft_hf_config_json["vocab_size"] == 512 and spec.max_model_len == 512
    # No method: a name without "eagle" is a draft model (vLLM's inference).
    assert _parse({"model": str(draft), "num_speculative_tokens": 3}).method == "draft_model"


def test_draft_model_limits_the_speculation_length(tmp_path):
    config = _stories_json() | {"max_position_embeddings": 256}
    draft = _write_config(tmp_path / "short", **config)
    assert _parse({"model": draft, "num_speculative_tokens": 3}).max_model_len == 256
    with pytest.raises(ValueError, match="draft model's max_position_embeddings"):
        _parse({"model": draft, "num_speculative_tokens": 3, "max_model_len": 300})


def test_draft_model_of_another_vocabulary_is_refused(tmp_path):
    draft = _write_config(tmp_path / "other", **(_stories_json() | {"vocab_size": 32000}))
    with pytest.raises(ValueError, match="vocab_size 32000 but the target has 512"):
        _parse({"method": "draft_model", "model": draft, "num_speculative_tokens": 3})


@pytest.mark.parametrize(
    ("value", "message"),
    [({"method": "draft_model", "num_speculative_tokens": 3}, "model is required for method"),
     ({"method": "eagle3", "num_speculative_tokens": 3}, "model is required for method")],
)  # fmt: skip
def test_model_methods_need_a_model(value, message):
    with pytest.raises(ValueError, match=message):
        _parse(value)


def test_draft_directory_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        _parse({"method": "draft_model", "model": str(tmp_path / "empty"),
                "num_speculative_tokens": 2}, load_format="dummy")  # fmt: skip


# ------------------------------------------------------------------------------- eagle(3)
def test_eagle3_head_is_detected_and_reads_the_default_layers(tmp_path):
    head = _eagle3_head(tmp_path)
    spec = _parse({"model": head, "num_speculative_tokens": 3}, load_format="dummy")
    assert spec.method == "eagle3" and spec.uses_aux_hidden_states
    assert spec.aux_hidden_state_layer_ids == (2, 2, 2)  # (2, L // 2, L - 3) for L = 5
    # An explicit list wins; index L (the last layer's output) is allowed.
    head = _eagle3_head(tmp_path, "head2", eagle_aux_hidden_state_layer_ids=[1, 3, 5])
    spec = _parse({"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    assert spec.aux_hidden_state_layer_ids == (1, 3, 5)


def test_eagle3_detected_by_architecture_without_the_name(tmp_path):
    head = _eagle3_head(tmp_path, "my-head")
    assert _parse({"model": head, "num_speculative_tokens": 3}).method == "eagle3"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"vocab_size": 128256}, "vocab_size 128256 but the target has 512"),
     ({"hidden_size": 128}, "hidden states of size 128, but the target's hidden_size is 64"),
     ({"target_hidden_size": 32}, "hidden states of size 32"),
     ({"eagle_aux_hidden_state_layer_ids": [2, 9, 1]}, r"must lie in \[0, 5\]"),
     ({"num_aux_hidden_states": 2}, r"num_aux_hidden_states \(2\) != number of layer ids 3"),
     ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state = false"),
     ({"norm_before_fc": True}, "norm_before_fc = true is not supported")],
)  # fmt: skip
def test_eagle3_heads_that_do_not_fit_the_target_are_refused(tmp_path, overrides, message):
    head = _eagle3_head(tmp_path, **overrides)
    with pytest.raises(ValueError, match=message):
        _parse({"method": "eagle3", "model": head, "num_speculative_tokens": 3})


def test_eagle3_needs_a_target_with_hidden_states(tmp_path):
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 512, "hidden_size": 64,
            "num_hidden_layers": 5}  # fmt: skip
    with pytest.raises(ValueError, match="needs a target that returns its hidden states"):
        _parse({"method": "eagle3", "model": _eagle3_head(tmp_path), "num_speculative_tokens": 3},
               hf_config_json=gpt2)  # fmt: skip


@pytest.mark.parametrize(
    ("target", "message"),
    [({"tensor_parallel_size": 2}, "with tensor_parallel_size 2 is not supported yet"),
     ({"enable_lora": True}, "with enable_lora is not supported yet")],
)  # fmt: skip
def test_draft_methods_refuse_options_they_cannot_run_with(tmp_path, target, message):
    value = {"method": "eagle3", "model": _eagle3_head(tmp_path), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=message):
        _parse(value, **target)
    # n-gram runs with both.
    assert _parse({"method": "ngram", "num_speculative_tokens": 3}, **target)


def test_prompt_lookup_sizes_are_ngram_only(tmp_path):
    with pytest.raises(ValueError, match="applies to method 'ngram' only, not 'eagle3'"):
        _parse({"model": _eagle3_head(tmp_path), "num_speculative_tokens": 3,
                "prompt_lookup_max": 3})  # fmt: skip


def test_a_parsed_config_is_checked_again_against_another_target():
    spec = _parse({"method": "ngram", "num_speculative_tokens": 8})
    assert SpeculativeConfig.parse(spec, _target()) == spec
    with pytest.raises(ValueError, match="max_model_len is 8"):
        SpeculativeConfig.parse(spec, _target(max_model_len=8))


# --------------------------------------------------------------------------- engine wiring
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_engine_config_holds_the_parsed_config():
    config = EngineConfig.from_args(EngineArgs(speculative_config=json.dumps(NGRAM)))
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 4, 3)
    assert EngineConfig.from_args(EngineArgs()).speculative_config is None


def test_engine_args_checks_the_config_before_refusing_it():
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 0}) \
            .create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match="not yet wired into the step"):
        EngineArgs(speculative_config=NGRAM).create_engine_config()


def test_llm_refuses_speculation_until_the_step_runs_it():
    from jaxpaged import LLM

    with pytest.raises(ValueError, match="speculative_config is not yet wired into the step"):
        LLM(speculative_config=NGRAM)


def test_cli_flag_reaches_engine_args_and_the_refusal(capsys):
    parser = cli._build_parser()
    args = parser.parse_args(["serve", "--speculative-config", json.dumps(NGRAM)])
    assert json.loads(cli.engine_args_from(args).speculative_config) == NGRAM
    code = cli.main(["generate", "hi", "--speculative-config", json.dumps(NGRAM)])
    assert code == 2
    assert "not yet wired into the step" in capsys.readouterr().err


def test_the_published_llama3_pairs_are_accepted():
    """Llama-3-8B's config with its EAGLE-3 head and with Llama-3.2-1B as a draft model."""
    configs = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")
    with open(os.path.join(configs, "llama-3-8b", "config.json")) as f:
        llama3 = json.load(f)
    target = dict(hf_config_json=llama3, max_model_len=8192, load_format="dummy")
    head = os.path.join(configs, "eagle3-llama3.1-instruct-8b")
    spec = _parse({"model": head, "num_speculative_tokens": 4}, **target)
    assert spec.method == "eagle3" and spec.aux_hidden_state_layer_ids == (2, 16, 29)
    assert spec.max_model_len == 8192  # a head follows the target's positions (vLLM 0.34)
    draft = os.path.join(configs, "llama-3.2-1b")
    spec = _parse({"model": draft, "num_speculative_tokens": 4}, **target)
    assert spec.method == "draft_model" and spec.max_model_len == 8192
