"""Make ``tests/data/quantization/awq_gemm.npz`` with AutoAWQ's own code (run by hand, once).

AutoAWQ (``pip download --no-deps autoawq==0.2.9``; an sdist whose package imports CUDA
extensions and pins old transformers) is not installable in the test environment, so this
script loads just the three pieces the checkpoint format depends on, from an unpacked sdist:

- ``awq/quantize/quantizer.py``, ``AwqQuantizer.pseudo_quantize_tensor``: per-group min/max
  scales and zero points (compiled out of the file on its own, with a stand-in ``self``);
- ``awq/modules/linear/gemm.py``, ``WQLinear_GEMM.from_linear``: the packing into ``qweight`` /
  ``qzeros`` (AWQ's nibble order) exactly as ``AwqQuantizer._apply_quant`` calls it;
- ``awq/utils/packing_utils.py``, ``dequantize_gemm``: the tool's own dequantization.

Usage: ``python tests/models/quantization/make_awq_fixture.py PATH/TO/autoawq-0.2.9``
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys
import types

import numpy as np
import torch

OUT = pathlib.Path(__file__).resolve().parents[2] / "data" / "quantization" / "awq_gemm.npz"
IN_FEATURES, OUT_FEATURES = 128, 32
GROUP_SIZES = (32, 128)


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _awq_modules(root: pathlib.Path):
    for package in ("awq", "awq.utils", "awq.modules", "awq.modules.linear"):
        sys.modules[package] = types.ModuleType(package)
    utils = types.ModuleType("awq.utils.utils")
    utils.get_best_device = lambda: "cpu"  # the real one returns "cpu" without a GPU too
    sys.modules["awq.utils.utils"] = utils
    _load("awq.utils.module", root / "awq/utils/module.py")
    packing = _load("awq.utils.packing_utils", root / "awq/utils/packing_utils.py")
    gemm = _load("awq.modules.linear.gemm", root / "awq/modules/linear/gemm.py")
    # pseudo_quantize_tensor alone, out of the quantizer module (which imports the whole tool).
    source = (root / "awq/quantize/quantizer.py").read_text()
    cls = next(
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.ClassDef) and n.name == "AwqQuantizer"
    )
    fn = next(n for n in cls.body if getattr(n, "name", "") == "pseudo_quantize_tensor")
    namespace = {"torch": torch}
    exec(compile(ast.Module([fn], []), "quantizer.py", "exec"), namespace)  # noqa: S102
    return gemm.WQLinear_GEMM, packing.dequantize_gemm, namespace["pseudo_quantize_tensor"]


def main(root: str) -> None:
    wq_linear, dequantize_gemm, pseudo_quantize = _awq_modules(pathlib.Path(root))
    torch.manual_seed(0)
    arrays = {}
    for group_size in GROUP_SIZES:
        linear = torch.nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False).half()
        quantizer = types.SimpleNamespace(group_size=group_size, zero_point=True, w_bit=4)
        # As AwqQuantizer._apply_quant: fake-quantize, then pack with transposed scales/zeros.
        linear.weight.data, scales, zeros = pseudo_quantize(quantizer, linear.weight.data)
        q = wq_linear.from_linear(
            linear, 4, group_size, scales=scales.t().contiguous(), zeros=zeros.t().contiguous()
        )
        dequant = dequantize_gemm(q.qweight, q.qzeros, q.scales, 4, group_size)
        arrays.update(
            {
                f"g{group_size}_qweight": q.qweight.numpy(),
                f"g{group_size}_qzeros": q.qzeros.numpy(),
                f"g{group_size}_scales": q.scales.numpy(),
                f"g{group_size}_dequant": dequant.numpy(),  # [in, out] float16, the tool's
                f"g{group_size}_fake_quant": linear.weight.data.numpy(),  # [out, in] float16
            }
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
