"""Quantized orbax round trips (``jaxpaged convert --quantization fp8|bitsandbytes``) at
tensor_parallel_size 1 and 2; run by ``test_orbax_checkpoint.py`` in a subprocess with two CPU
devices, as ``orbax_roundtrip_checks.py`` is.

For each method and size: the CLI writes stories260k quantized at load; ``load_orbax_model``
must give back every tensor (float parameters and the quantized layers' int8 / float8 tensors and
scales) bit for bit, in its dtype and with the sharding the safetensors loader gives it, and
``LLM(OUT)`` (quantization recognised from the directory) must generate the greedy tokens of
``LLM(source, quantization=method)`` at the same size. Prints one line per check; exits non-zero
on the first failure.
"""

from __future__ import annotations

import functools
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import default_model_path
from jaxpaged.entrypoints.cli import main as cli_main
from models.orbax_checkpoint import load_orbax_model, read_metadata
from models.quantization.config import resolve_quantization
from models.sharded_weights import load_sharded_model
from models.sharding import make_mesh
from models.weights import load_model

PROMPTS = [[1, 317, 269, 274, 287, 263, 377, 267, 265, 282, 295, 433, 426], [1, 403, 407, 261]]
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
LOAD_FORMAT = {"fp8": "auto", "bitsandbytes": "bitsandbytes"}


def _greedy(model_dir: str, tp: int, **kwargs) -> tuple[list[list[int]], str]:
    llm = LLM(model_dir, tensor_parallel_size=tp, enable_compilation_cache=False,
              **ENGINE, **kwargs)  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    quant = llm.llm_engine.config.model_config.quant_config
    return [list(o.outputs[0].token_ids) for o in outputs], str(quant)


def check(method: str, tp: int, out_root: str) -> None:
    source = default_model_path()
    out = f"{out_root}/{method}-tp{tp}"
    rc = cli_main(["convert", source, out, "--dtype", "float32", "--quantization", method,
                   "--tensor-parallel-size", str(tp)])  # fmt: skip
    assert rc == 0, rc
    meta = read_metadata(out)
    assert meta["quantization"] == method and meta["dtype"] == "float32", meta
    mesh = None if tp == 1 else make_mesh(tp)
    load = load_model if mesh is None else functools.partial(load_sharded_model, mesh=mesh)
    quant_config = resolve_quantization(method, None, LOAD_FORMAT[method])
    direct, _ = load(source, dtype="float32", load_format=LOAD_FORMAT[method],
                     quant_config=quant_config)  # fmt: skip
    restored, _ = load_orbax_model(out, mesh=mesh)
    expected = nnx.to_flat_state(nnx.state(direct))
    got = nnx.to_flat_state(nnx.state(restored))
    assert [p for p, _ in expected] == [p for p, _ in got], ([p for p, _ in expected][:5],
                                                             [p for p, _ in got][:5])  # fmt: skip
    dtypes = set()
    for (path, a), (_, b) in zip(expected, got, strict=True):
        assert type(a) is type(b), (path, type(a), type(b))
        a, b = a.get_value(), b.get_value()
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (path, a.sharding, b.sharding)
        bits = np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
        assert np.array_equal(*bits), path  # bit for bit, float8 included
        dtypes.add(str(a.dtype))
    quantized = "float8_e4m3fn" if method == "fp8" else "int8"
    assert quantized in dtypes, dtypes
    print(f"{method} tp={tp}: {len(got)} tensors ({', '.join(sorted(dtypes))}) restored bit for "
          "bit with their shardings", flush=True)  # fmt: skip
    want, want_quant = _greedy(source, tp, quantization=method,
                               load_format=LOAD_FORMAT[method])  # fmt: skip
    have, have_quant = _greedy(out, tp)
    assert have_quant == want_quant, (have_quant, want_quant)
    assert have == want, (have, want)
    print(f"{method} tp={tp}: greedy tokens equal the quantized safetensors engine's: {have}",
          flush=True)  # fmt: skip
    if method == "fp8" and tp == 1:
        try:
            LLM(out, quantization="bitsandbytes", **ENGINE)
        except ValueError as error:
            assert "quantization='bitsandbytes' does not match" in str(error), error
            print("fp8 checkpoint with quantization=bitsandbytes: refused by name", flush=True)
        else:
            raise AssertionError("an fp8 checkpoint served with quantization=bitsandbytes")


def main() -> int:
    assert jax.device_count() >= 2, "run with --xla_force_host_platform_device_count=2"
    with tempfile.TemporaryDirectory() as root:
        for method in ("fp8", "bitsandbytes"):
            for tp in (1, 2):
                check(method, tp, root)
    print("ALL OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
