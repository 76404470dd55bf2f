"""models.platform: the platform a program is traced for."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.platform import GPU_DEVICE_KINDS, abstract_gpu, lower_for_gpu, target_platform
from models.quantization import w8a8


def test_inside_an_abstract_gpu_the_target_is_the_gpu_and_outside_the_host():
    assert target_platform() == jax.default_backend() == "cpu"
    for kind in GPU_DEVICE_KINDS.values():
        with abstract_gpu(kind):
            assert target_platform() == "gpu"
            assert w8a8.use_w8_gemv(1) == (w8a8.W8_GEMV_MAX_TOKENS >= 1)
        assert target_platform() == "cpu"
    assert not w8a8.use_w8_gemv(1)  # off a GPU the GEMV would only run interpreted


def test_a_plain_program_lowers_for_cuda_on_this_host():
    text = lower_for_gpu(lambda x: x * 2, jax.ShapeDtypeStruct((4,), jnp.float32),
                         device_kind=GPU_DEVICE_KINDS["H200"])  # fmt: skip
    assert "stablehlo.multiply" in text
