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


def test_more_layers_than_any_numbered_stack_of_the_checkpoint_is_refused():
    from models.config_checks import check_layer_count

    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(5)]
    names += [f"model.layers.0.mlp.experts.{e}.w1.weight" for e in range(8)] + ["lm_head.weight"]
    check_layer_count(names, SimpleNamespace(**LLAMA), "m")  # 5 layers: as held
    check_layer_count(names, SimpleNamespace(**(LLAMA | {"num_hidden_layers": 3})), "m")
    # Experts are numbered inside a layer: the stack is the first numbered component.
    with pytest.raises(ValueError, match="num_hidden_layers is 8"):
        check_layer_count(names, SimpleNamespace(**(LLAMA | {"num_hidden_layers": 8})), "m")
    with pytest.raises(
        ValueError, match=r"m/config.json: num_hidden_layers is 100000, but"
    ) as info:
        check_layer_count(names, SimpleNamespace(**(LLAMA | {"num_hidden_layers": 100000})), "m")
    assert "at most 5 (model.layers.0 to model.layers.4)" in str(info.value)
    nested = SimpleNamespace(text_config=SimpleNamespace(**(LLAMA | {"num_hidden_layers": 9})))
    with pytest.raises(ValueError, match="num_hidden_layers is 9"):
        check_layer_count(names, nested, "m")
