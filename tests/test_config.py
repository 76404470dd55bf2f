"""EngineArgs validation of the memory-management fields and their CLI flags."""

import pytest

from jaxpaged.config import EngineArgs
from jaxpaged.entrypoints import cli


def test_memory_management_defaults_follow_vllm():
    config = EngineArgs().create_engine_config()
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.swap_space_bytes == 4 * 1024**3
    assert config.scheduler_config.preemption_mode is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(preemption_mode="evict"), "preemption_mode must be one of"),
        (dict(swap_space=-1), "swap_space must be a non-negative number of GiB, got -1"),
    ],
)
def test_bad_memory_management_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_engine_config()


def test_cli_flags_set_prefix_caching_swap_space_and_preemption_mode():
    parser = cli._build_parser()
    args = parser.parse_args(
        [
            "generate",
            "hi",
            "--no-enable-prefix-caching",
            "--swap-space",
            "0.5",
            "--preemption-mode",
            "swap",
        ]
    )
    engine_args = cli.engine_args_from(args)
    assert engine_args.enable_prefix_caching is False
    assert engine_args.swap_space == 0.5 and engine_args.preemption_mode == "swap"


def test_a_broken_config_json_is_a_value_error_naming_the_file(tmp_path):
    """It was a bare JSONDecodeError, naming neither the file nor what to fix."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON: Expecting") as info:
        EngineArgs(model=str(tmp_path), load_format="dummy").create_engine_config()
    assert str(tmp_path) in str(info.value)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        EngineArgs(model=str(tmp_path), load_format="dummy").create_engine_config()
