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
