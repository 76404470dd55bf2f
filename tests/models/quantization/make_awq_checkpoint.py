"""Write ``tests/data/quantization/awq_tiny_llama/`` with AutoAWQ's own code (run by hand, once).

A random tiny Llama (``checkpoints.TINY_LLAMA``, seed 0, float16 as AutoAWQ quantizes) whose
seven layer linears are quantized as ``AwqQuantizer._apply_quant`` does: ``pseudo_quantize_tensor``
(group size 32, zero points) and ``WQLinear_GEMM.from_linear`` (AWQ's packing), loaded from an
unpacked AutoAWQ 0.2.9 sdist exactly as ``make_awq_fixture.py`` loads them (the package itself
needs CUDA extensions and an old transformers). AWQ's activation-aware scale search only changes
which float weights get quantized, not the format, so it is skipped. Embeddings, norms and
``lm_head`` stay float16, as in AutoAWQ's output. About 90 kB.

Usage: ``python tests/models/quantization/make_awq_checkpoint.py PATH/TO/autoawq-0.2.9``
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import types

import torch

from tests.models.quantization.checkpoints import AWQ_DIR, LINEARS, tiny_llama, write_checkpoint
from tests.models.quantization.make_awq_fixture import _awq_modules

GROUP_SIZE = 32


def main(root: str) -> None:
    wq_linear, _, pseudo_quantize = _awq_modules(pathlib.Path(root))
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        source = tiny_llama(tmp, seed=0)
        model = transformers.LlamaForCausalLM.from_pretrained(source).half().eval()
        quantizer = types.SimpleNamespace(group_size=GROUP_SIZE, zero_point=True, w_bit=4)
        tensors = {}
        for name, module in model.named_modules():
            if name.split(".")[-1] not in LINEARS:
                continue
            module.weight.data, scales, zeros = pseudo_quantize(quantizer, module.weight.data)
            q = wq_linear.from_linear(module, 4, GROUP_SIZE, scales=scales.t().contiguous(),
                                      zeros=zeros.t().contiguous())  # fmt: skip
            for suffix in ("qweight", "qzeros", "scales"):
                tensors[f"{name}.{suffix}"] = getattr(q, suffix).numpy()
        for name, param in model.named_parameters():
            if name.split(".")[-2] not in LINEARS:
                tensors[name] = param.detach().numpy()
        config = {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE,
                  "zero_point": True, "version": "gemm"}  # fmt: skip
        write_checkpoint(str(AWQ_DIR), source, tensors, config)
    size = sum(p.stat().st_size for p in AWQ_DIR.iterdir())
    print(f"wrote {AWQ_DIR} ({size} bytes)")


if __name__ == "__main__":
    with torch.no_grad():
        main(sys.argv[1])
