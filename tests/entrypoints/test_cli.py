"""The ``jaxpaged`` command as a user runs it."""

from __future__ import annotations

import pytest

from jaxpaged.entrypoints import cli


def test_generate_prints_the_greedy_story_for_each_prompt(capsys, golden):
    case = next(c for c in golden["cases"] if c["prompt"] == "Once upon a time")
    status = cli.main(
        [
            "generate",
            "Once upon a time",
            "The dog",
            "--max-tokens",
            "32",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
        ]
    )
    out, err = capsys.readouterr()
    assert status == 0
    assert case["full_text"] in out
    assert out.count("\n\n") >= 2  # one block per prompt
    assert "tokens/s" in err


def test_generate_reports_bad_arguments_as_an_error_naming_the_limit(capsys):
    status = cli.main(["generate", "hi", "--max-tokens", "0"])
    assert status == 2
    assert "max_tokens must be at least 1, got 0" in capsys.readouterr().err


def test_every_engine_argument_is_a_flag():
    parser = cli._build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    flags = {opt for action in generate._actions for opt in action.option_strings}
    from jaxpaged.config import EngineArgs

    for name in EngineArgs.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in flags


def test_unknown_flag_exits_with_usage_error():
    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--no-such-flag"])
