"""Compile for an H100 on a machine without a GPU: XLA's GPU compiler (ptxas included, no
autotuning) against a compile-only device, with every GPU-only path of jaxpaged taken.

What it needs: the CUDA PJRT plugin of the installed jax, unpacked beside the project (not
installed into the environment; it only compiles here)::

    pip download --no-deps -d /tmp/wheels jax-cuda13-plugin==$JAX jax-cuda13-pjrt==$JAX
    for w in /tmp/wheels/*.whl; do python -m zipfile -e $w /tmp/cudaplug; done
    export PYTHONPATH=$PWD:/tmp/cudaplug JAX_PLATFORMS=cpu   # and ptxas on the PATH

(``$JAX``: ``python -c "import jax; print(jax.__version__)"``). :func:`h100_device` returns the
compile-only device; :func:`pretend_gpu` makes jaxpaged take its GPU paths while tracing (it
asks ``jax.default_backend()``, and Pallas Triton asks for the GPU's properties), so an engine
built inside it lowers the Pallas kernels to Triton instead of interpreting them. Lower and
compile inside ``jax.default_device(h100_device())``. What comes out is the optimized module
XLA would run, short of the autotuner's choices (it takes each fusion's default tiling): the
custom calls (cuBLASLt FP8 GEMMs, Triton kernels) and fusions are the GPU's.
"""

from __future__ import annotations

import contextlib
from unittest import mock

# An H100 SXM's properties in XLA's ``GpuTargetConfigProto`` text format (the fields XLA's GPU
# compiler reads: sizes, limits, the compute capability 9.0a, the CUDA / cuDNN versions that
# decide which library calls it may emit).
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  device_address_bits: 64
  name: "NVIDIA H100 80GB HBM3"
  driver_version: "13.0.0"
  runtime_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0"
  dnn_version: "9.10.0"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def h100_device():
    """A compile-only H100 (``jax.experimental.topologies``); arrays cannot live on it.

    Raises:
        RuntimeError: the CUDA plugin is not importable (the module docstring says how to
            unpack it).
    """
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            "h100", "cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1"
        )
    except (NotImplementedError, RuntimeError, ValueError) as error:
        raise RuntimeError(
            "compiling for an H100 without a GPU needs the jax CUDA plugin on PYTHONPATH "
            f"(benchmarks/lib/deviceless_gpu.py's docstring): {error}"
        ) from error
    return topology.devices[0]


@contextlib.contextmanager
def pretend_gpu():
    """jaxpaged's GPU paths while tracing: ``jax.default_backend()`` answers ``"gpu"`` and
    Pallas Triton's lowering gets an H100's properties."""
    import jax
    from jax._src.pallas.triton import gpu_info

    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    with (
        mock.patch.object(jax, "default_backend", lambda: "gpu"),
        mock.patch.object(gpu_info, "get_gpu_info", lambda: info),
    ):
        yield
