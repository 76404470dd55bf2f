"""One model over several processes (hosts): JAX's multi-controller runtime.

With ``nnodes > 1`` every process calls ``jax.distributed.initialize`` with the same coordinator
(``master_addr:master_port``, served by rank 0), after which ``jax.devices()`` lists every
process's devices and a ``("tp",)`` mesh may span them. Each process then runs the *same*
engine: the same requests in the same order, the same schedule, the same jitted steps; XLA's
collectives (NCCL on GPU, gloo on CPU, JAX's default there) carry the tensor-parallel
all-reduces between hosts. Sampled tokens come back replicated, so every process commits the
same tokens and the schedules never diverge. Only process 0 prints.

Launch recipe (two hosts, one model over both)::

    # host A (rank 0, coordinator)         # host B
    jaxpaged generate "Hi" --nnodes 2 \\    jaxpaged generate "Hi" --nnodes 2 \\
      --node-rank 0 --master-addr A \\        --node-rank 1 --master-addr A \\
      --tensor-parallel-size 16 ...           --tensor-parallel-size 16 ...
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpaged.config import ParallelConfig


def initialize_distributed(parallel_config: ParallelConfig) -> None:
    """``jax.distributed.initialize`` for ``nnodes > 1``; nothing for one process.

    Must run before anything touches a JAX device in this process (the engine calls it first).
    A process whose runtime was already initialised (by the caller, with its own arguments) is
    left as it is, but the process count must match ``nnodes``.

    Raises:
        ValueError: an already initialised runtime with a different number of processes.
        RuntimeError: from JAX, if devices were used before this call.
    """
    if parallel_config.nnodes == 1:
        return
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(
            coordinator_address=parallel_config.coordinator_address,
            num_processes=parallel_config.nnodes,
            process_id=parallel_config.node_rank,
        )
    if jax.process_count() != parallel_config.nnodes:
        raise ValueError(
            f"nnodes is {parallel_config.nnodes} but the JAX runtime has "
            f"{jax.process_count()} processes"
        )


def is_driver() -> bool:
    """Whether this process is rank 0, the one that prints (always true for one process)."""
    return jax.process_index() == 0


def agree_on_min(value: int) -> int:
    """The smallest of every process's ``value`` (the KV block count must be the same in all
    processes, or their schedules would diverge); ``value`` itself for one process."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))
