"""Make ``tests/data/quantization/bnb_int8.npz`` with bitsandbytes' own code (run by hand, once).

bitsandbytes ships a 43 MB wheel of CUDA libraries that the test environment does not need; its
8-bit quantization used by transformers' ``Int8Params`` (what a pre-quantized checkpoint stores
as ``weight`` + ``SCB``) runs on CPU from the unpacked wheel:
``bitsandbytes/functional.py``, ``int8_vectorwise_quant`` and ``int8_vectorwise_dequant``.

Usage: ``PYTHONPATH=PATH/TO/unpacked-wheel python tests/models/quantization/make_bnb_fixture.py``
(``pip download --no-deps bitsandbytes==0.50.2`` and unzip it).
"""

from __future__ import annotations

import pathlib

import bitsandbytes
import bitsandbytes.functional as bnb_f
import numpy as np
import torch

OUT = pathlib.Path(__file__).resolve().parents[2] / "data" / "quantization" / "bnb_int8.npz"


def main() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 64, dtype=torch.float16)  # [out, in], as a checkpoint holds it
    weight[3] = 0  # an all-zero row
    cb, scb, _ = bnb_f.int8_vectorwise_quant(weight)
    dequant = bnb_f.int8_vectorwise_dequant(cb, scb)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        OUT,
        weight=weight.numpy(),
        CB=cb.numpy(),
        SCB=scb.numpy(),
        dequant=dequant.numpy(),
        version=np.array(bitsandbytes.__version__),
    )
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes), bitsandbytes {bitsandbytes.__version__}")


if __name__ == "__main__":
    main()
