"""``check_config_shapes``: impossible sizes are refused by file and field, real ones pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from models.config_checks import check_config_shapes

LLAMA = dict(
    vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=5,
    num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=512,
)  # fmt: skip


def test_a_real_config_passes():
    check_config_shapes(SimpleNamespace(**LLAMA), "m/config.json")
    check_config_shapes(SimpleNamespace(**(LLAMA | {"head_dim": None})), "m/config.json")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a positive integer, got 2.5"),
        ({"head_dim": True}, "head_dim must be a positive integer, got True"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(8\) must be a multiple of"),
        ({"num_attention_heads": 7, "num_key_value_heads": 7, "head_dim": None}, "must divide"),
    ],
)
def test_impossible_shapes_are_refused_naming_file_and_field(change, message):
    with pytest.raises(ValueError, match=message) as info:
        check_config_shapes(SimpleNamespace(**(LLAMA | change)), "m/config.json")
    assert str(info.value).startswith("m/config.json: ")


def test_a_nested_text_config_is_checked_too():
    outer = SimpleNamespace(text_config=SimpleNamespace(**(LLAMA | {"hidden_size": 0})))
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        check_config_shapes(outer, "m/config.json")
