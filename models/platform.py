"""The platform a program is built for, and lowering for a GPU that is not there.

Every choice between a compiled Pallas kernel and its interpret mode (or an XLA fallback) asks
:func:`target_platform`, the platform the code being traced will run on: ``jax.default_backend()``
normally, and ``"gpu"`` inside :func:`abstract_gpu`. That context sets an abstract mesh whose
abstract device is a named NVIDIA card (``jax.sharding.use_abstract_mesh`` with
``AbstractDevice(device_kind=..., platform="gpu")``); in it, ``jax.jit(f).trace(*specs)
.lower(lowering_platforms=("cuda",))`` runs on a host without a GPU and carries every Pallas
kernel through its Triton or Mosaic GPU lowering for that card. A kernel or step that cannot be
lowered for the GPU thus fails on the CPU (``tests/gpu_lowering``), not in a GPU session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

# The cards the project runs on, by the device kind their drivers report (``nvidia-smi``, JAX's
# ``device_kind``); both Hopper, 132 SMs in their SXM parts.
GPU_DEVICE_KINDS: dict[str, str] = {"H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200"}
HOPPER_SM_COUNT = 132


def target_platform() -> str:
    """``"gpu"``, ``"cpu"`` or ``"tpu"``: the abstract device's platform inside
    :func:`abstract_gpu` (or any abstract mesh with an abstract device), else
    ``jax.default_backend()``."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


@contextlib.contextmanager
def abstract_gpu(device_kind: str, num_cores: int = HOPPER_SM_COUNT) -> Iterator[None]:
    """Trace and lower inside as for one GPU of ``device_kind`` (a value of
    :data:`GPU_DEVICE_KINDS`, or any kind JAX's Pallas GPU backends know): a one-device abstract
    mesh (axis ``"x"``, ``Auto``) whose abstract device is that card. Lower with
    ``.trace(...).lower(lowering_platforms=("cuda",))``; nothing inside may run on the device."""
    from jax._src.mesh import AbstractDevice  # not exported by jax 0.11.2

    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    # An Auto axis, as one device without a mesh is: an Explicit one (AbstractMesh's default)
    # would ask every op for a sharding rule, which some lack (ragged_dot_general).
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device
    )
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_gpu(fn, *args, device_kind: str, **kwargs) -> str:
    """``jax.jit(fn)`` traced with ``args`` (arrays or ``jax.ShapeDtypeStruct`` s) and lowered
    for CUDA inside :func:`abstract_gpu` ``(device_kind)``: the StableHLO text, each Pallas
    kernel in it as its Triton or Mosaic GPU custom call. Raises whatever the lowering raises."""
    with abstract_gpu(device_kind):
        traced = jax.jit(fn, **kwargs).trace(*args)
        return traced.lower(lowering_platforms=("cuda",)).as_text()
