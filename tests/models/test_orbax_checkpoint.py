"""``jaxpaged convert`` and orbax restore (``models/orbax_checkpoint.py``)."""

from __future__ import annotations

import json
import pathlib

import pytest

from jaxpaged.entrypoints.cli import main as cli_main
from jaxpaged.entrypoints.convert import convert
from models.orbax_checkpoint import MARKER, is_orbax_checkpoint, read_metadata
from tests.multidevice import run_on_cpu_devices

HERE = pathlib.Path(__file__).resolve().parent


def test_round_trips_at_tp_1_and_2_on_cpu_devices():
    report = run_on_cpu_devices([str(HERE / "orbax_roundtrip_checks.py")], 2)
    for line in (
        "tp=1: 32 parameters restored bit for bit",
        "tp=2: 32 parameters restored bit for bit",
        "tp=1: greedy tokens equal",
        "tp=1: restored as bfloat16 equals loading the safetensors as bfloat16",
        "tp=2: greedy tokens equal",
        "tp=2 checkpoint at tp=1: refused by name",
        "tp=2: chunked shards of split and replicated arrays restored bit for bit",
        "ALL OK",
    ):
        assert line in report, report


def test_quantized_round_trips_at_tp_1_and_2_on_cpu_devices():
    report = run_on_cpu_devices([str(HERE / "orbax_quantized_checks.py")], 2)
    for method in ("fp8", "bitsandbytes"):
        for tp in (1, 2):
            assert f"{method} tp={tp}: 52 tensors" in report, report
            assert f"{method} tp={tp}: greedy tokens equal" in report, report
    assert "fp8 checkpoint with quantization=bitsandbytes: refused by name" in report
    assert "ALL OK" in report, report


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(quantization="awq"),
            "quantization must be one of .*'none', 'fp8', 'bitsandbytes'.*'awq'",
        ),
        (dict(quantization="gptq"), "quantization must be one of .*'gptq'"),
        (
            dict(quantization="fp8", load_format="bitsandbytes"),
            "quantization='bitsandbytes' and load_format='bitsandbytes' go together, got "
            "quantization='fp8'",
        ),
        (dict(load_format="bitsandbytes"), "load_format='bitsandbytes' needs quantization"),
    ],
)
def test_bad_quantization_combinations_are_refused_by_name(stories_dir, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        convert(stories_dir, str(tmp_path / "out"), **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_pre_quantized_checkpoint_keeps_its_method_and_refuses_none(stories_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    config = json.loads((pathlib.Path(stories_dir) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization='none' cannot convert .*'fp8'"):
        convert(str(src), str(tmp_path / "out"), quantization="none")
    with pytest.raises(ValueError, match="quantization must be one of"):
        convert(str(src), str(tmp_path / "out"), quantization="awq")


def test_cli_reports_a_bad_quantization_as_an_error(stories_dir, tmp_path, capsys):
    assert cli_main(["convert", stories_dir, str(tmp_path / "o"), "--quantization", "awq"]) == 2
    assert "quantization" in capsys.readouterr().err


def test_output_directory_must_be_new_or_empty(stories_dir, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not empty"):
        convert(stories_dir, str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        convert(stories_dir, str(tmp_path / "keep.txt"), load_format="dummy")


def test_a_converted_directory_is_recognised_and_its_version_checked(tmp_path):
    assert not is_orbax_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="not a jaxpaged orbax checkpoint"):
        read_metadata(str(tmp_path))
    (tmp_path / MARKER).write_text(json.dumps({"format": "jaxpaged-orbax", "version": 99}))
    assert is_orbax_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="version 99.*convert the model again"):
        read_metadata(str(tmp_path))
    (tmp_path / MARKER).write_text('{"format": "jaxpaged-orbax", ')  # cut short
    with pytest.raises(ValueError, match=f"{MARKER} is not JSON"):
        read_metadata(str(tmp_path))
    (tmp_path / MARKER).write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds no JSON object"):
        read_metadata(str(tmp_path))


def _marker_only_checkpoint(stories_dir, out: pathlib.Path) -> dict:
    """A converted directory's config and MARKER without parameters: the checks that compare
    the MARKER with the model run before orbax reads anything."""
    import jax.numpy as jnp
    from flax import nnx

    from models.orbax_checkpoint import FORMAT, FORMAT_VERSION, param_key
    from models.registry import get_model_class
    from models.weights import load_config

    hf_config = load_config(stories_dir)
    abstract = nnx.eval_shape(
        lambda: get_model_class(hf_config)(
            hf_config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
        )
    )
    params = {
        param_key(path): [list(v.get_value().shape), "float32"]
        for path, v in nnx.to_flat_state(nnx.state(abstract))
    }
    out.mkdir()
    (out / "config.json").write_text((pathlib.Path(stories_dir) / "config.json").read_text())
    meta = dict(format=FORMAT, version=FORMAT_VERSION, tensor_parallel_size=1, params=params)
    (out / MARKER).write_text(json.dumps(meta))
    return meta


def test_a_checkpoint_that_does_not_match_the_model_names_the_parameter(stories_dir, tmp_path):
    from models.orbax_checkpoint import load_orbax_model

    out = tmp_path / "out"
    meta = _marker_only_checkpoint(stories_dir, out)
    good = dict(meta["params"])
    key = "model.layers.0.self_attn.qkv_proj.kernel"
    assert key in good
    meta["params"][key] = [[1, 2], "float32"]
    (out / MARKER).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"parameter {key} of shape .* is of shape \\(1, 2\\)"):
        load_orbax_model(str(out))
    meta["params"] = dict(good, **{"model.extra.kernel": [[1], "float32"]})
    (out / MARKER).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="holds parameter model.extra.kernel"):
        load_orbax_model(str(out))
    with pytest.raises(
        ValueError, match="load_format must be auto for the orbax checkpoint .* got .dummy."
    ):
        load_orbax_model(str(out), load_format="dummy")


def test_a_shard_count_mismatch_is_refused_by_the_config_before_anything_loads(
    stories_dir, tmp_path
):
    """``EngineArgs`` -> ``EngineConfig`` reads the MARKER, so ``jaxpaged serve`` refuses a
    checkpoint converted for another device count before it starts the engine-core process."""
    from jaxpaged.config import EngineArgs

    out = tmp_path / "tp2"
    meta = _marker_only_checkpoint(stories_dir, out)
    (out / MARKER).write_text(json.dumps({**meta, "tensor_parallel_size": 2}))
    with pytest.raises(ValueError, match="converted for tensor_parallel_size=2, got .*=1"):
        EngineArgs(model=str(out)).create_engine_config()


@pytest.mark.parametrize("layout", ["chunked", "compressed", "zarr3"])
def test_restore_arrays_reads_every_orbax_ocdbt_layout_bit_for_bit(tmp_path, layout):
    """``restore_arrays`` reads what orbax wrote: ``write_arrays``'s chunks (256 bytes here, so
    every array has several), zstd and one chunk (earlier converts) and zarr3; a dtype other
    than the stored one is cast while reading."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    from models.orbax_checkpoint import restore_arrays, write_arrays

    rng = np.random.default_rng(0)
    arrays = {
        "a.kernel": jnp.asarray(rng.normal(size=(37, 70)), jnp.bfloat16),
        "b.scale": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
        "c.q": jnp.asarray(rng.integers(-128, 128, size=(3, 4, 9)), jnp.int8),
    }
    path = str(tmp_path / "params")
    if layout == "chunked":
        write_arrays(path, arrays, chunk_bytes=256)
    else:
        handler = ocp.PyTreeCheckpointHandler(use_zarr3=layout == "zarr3")
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(path, arrays)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {
        k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device) for k, a in arrays.items()
    }
    targets["b.scale"] = jax.ShapeDtypeStruct((5,), jnp.bfloat16, sharding=device)
    restored = restore_arrays(path, targets, workers=2)
    for key, array in arrays.items():
        want = np.asarray(array.astype(targets[key].dtype))
        got = restored[key]
        assert got.dtype == targets[key].dtype and got.sharding == device, key
        assert np.array_equal(np.asarray(got), want), key
    with pytest.raises(ValueError, match=r"parameter a.kernel is stored with shape \(37, 70\)"):
        wrong = jax.ShapeDtypeStruct((37, 71), jnp.bfloat16, sharding=device)
        restore_arrays(path, {"a.kernel": wrong})
    with pytest.raises(ValueError, match="parameter d.x has no array"):
        restore_arrays(path, {"d.x": jax.ShapeDtypeStruct((1,), jnp.float32, sharding=device)})
    with pytest.raises(ValueError, match="not an OCDBT orbax checkpoint"):
        restore_arrays(str(tmp_path), targets)
