"""orbax round trips at tensor_parallel_size 1 and 2; run by ``test_orbax_checkpoint.py`` in a
subprocess with two CPU devices (``--xla_force_host_platform_device_count=2``), as
``multidevice_sharding_checks.py`` is.

For each size: ``jaxpaged convert`` (the CLI) writes stories260k's safetensors as the engine
loads them; ``load_orbax_model`` must give back every parameter bit for bit with the sharding
the safetensors loader gives it, and ``LLM(OUT)`` must generate the safetensors ``LLM``'s greedy
tokens (its one-device greedy tokens: the sharded safetensors engine's equal them, checked in
``multidevice_sharding_checks.py``). Prints one line per check; exits non-zero on the first failure.
"""

from __future__ import annotations

import functools
import sys
import tempfile

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import default_model_path
from jaxpaged.entrypoints.cli import main as cli_main
from models.orbax_checkpoint import load_orbax_model, read_metadata, restore_arrays, write_arrays
from models.sharded_weights import load_sharded_model
from models.sharding import TP_AXIS, make_mesh
from models.weights import load_model

PROMPTS = [[1, 317, 269, 274, 287, 263, 377, 267, 265, 282, 295, 433, 426], [1, 403, 407, 261]]
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)


def _greedy(model_dir: str, tp: int) -> list[list[int]]:
    llm = LLM(model_dir, tensor_parallel_size=tp, enable_compilation_cache=False, **ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def check(tp: int, out_root: str, want: list[list[int]]) -> None:
    source = default_model_path()
    out = f"{out_root}/tp{tp}"
    rc = cli_main(["convert", source, out, "--dtype", "float32", "--tensor-parallel-size", str(tp)])
    assert rc == 0, rc
    assert read_metadata(out)["tensor_parallel_size"] == tp
    mesh = None if tp == 1 else make_mesh(tp)
    load = load_model if mesh is None else functools.partial(load_sharded_model, mesh=mesh)
    converted, _ = load(source, dtype="float32")
    restored, _ = load_orbax_model(out, mesh=mesh)
    expected = nnx.to_flat_state(nnx.state(converted))
    got = nnx.to_flat_state(nnx.state(restored))
    assert [p for p, _ in expected] == [p for p, _ in got]
    for (path, a), (_, b) in zip(expected, got, strict=True):
        a, b = a.get_value(), b.get_value()
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (path, a.sharding, b.sharding)
        assert np.array_equal(np.asarray(a), np.asarray(b)), path  # bit for bit (no NaNs here)
    print(f"tp={tp}: {len(got)} parameters restored bit for bit with their shardings", flush=True)
    if tp == 1:  # another dtype than the stored one: orbax casts while reading, as the loader
        cast, _ = load_orbax_model(out, dtype="bfloat16")
        direct, _ = load_model(source, dtype="bfloat16")
        for (path, a), (_, b) in zip(
            nnx.to_flat_state(nnx.state(direct)), nnx.to_flat_state(nnx.state(cast)), strict=True
        ):
            a, b = a.get_value(), b.get_value()
            assert b.dtype == a.dtype and np.array_equal(np.asarray(a), np.asarray(b)), path
        print("tp=1: restored as bfloat16 equals loading the safetensors as bfloat16", flush=True)
    have = _greedy(out, tp)
    assert have == want, (have, want)
    print(f"tp={tp}: greedy tokens equal the safetensors engine's: {have}", flush=True)
    if tp == 2:
        try:
            load_orbax_model(out, mesh=None)
        except ValueError as error:
            assert "tensor_parallel_size=2" in str(error) and "tensor_parallel_size=1" in str(error)
            print("tp=2 checkpoint at tp=1: refused by name", flush=True)
        else:
            raise AssertionError("a tp=2 checkpoint restored at tp=1")


def check_chunked_shards(root: str) -> None:
    """Arrays split by rows, by columns and replicated on the 2-device mesh, written in chunks
    smaller than a shard (``write_arrays``), restore bit for bit with their shardings."""
    mesh = make_mesh(2)
    values = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
    specs = {"rows": P(TP_AXIS, None), "cols": P(None, TP_AXIS), "replicated": P()}
    arrays = {k: jax.device_put(values + i, NamedSharding(mesh, spec))
              for i, (k, spec) in enumerate(specs.items())}  # fmt: skip
    write_arrays(f"{root}/chunked", arrays, chunk_bytes=128)  # a shard: 768 bytes
    targets = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
               for k, a in arrays.items()}  # fmt: skip
    restored = restore_arrays(f"{root}/chunked", targets)
    for key, array in arrays.items():
        assert restored[key].sharding == array.sharding, key
        assert np.array_equal(np.asarray(restored[key]), np.asarray(array)), key
    print("tp=2: chunked shards of split and replicated arrays restored bit for bit", flush=True)


def main() -> int:
    assert jax.device_count() >= 2, "run with --xla_force_host_platform_device_count=2"
    # The reference: the safetensors engine on one device (multidevice_sharding_checks.py shows
    # the sharded safetensors engine generates the same greedy tokens).
    want = _greedy(default_model_path(), 1)
    with tempfile.TemporaryDirectory() as root:
        for tp in (1, 2):
            check(tp, root, want)
        check_chunked_shards(root)
    print("ALL OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
