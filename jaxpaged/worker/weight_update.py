"""Replace the weights a ``ModelRunner`` steps on (its ``DeviceWeights``) with a pytree from
memory, leaf by leaf.

Checking comes first and is complete (``models.memory_weights``): nothing is replaced unless
every parameter is there with its shape and a float dtype. Then, parameter by parameter, the
engine drops its reference to the old array (freed at once unless the caller holds it too),
makes the new value (cast, transposed, fused as the loaders do) and places it where the old one
lived. Peak device memory stays within one parameter of one copy of the weights, and usually at
it: an array already in the engine's dtype and placement is used as it is (no copy; JAX arrays
are immutable, so sharing it with the trainer is safe as long as the trainer does not delete or
donate it). The step executables take the weights as arguments of fixed shapes, dtypes and
shardings, so nothing is recompiled.

Nothing is ever ``delete()`` d: an old array the caller still holds (a reference policy, the
previous parameters) stays valid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from models.memory_weights import is_hf_names, plan_hf_update, plan_own_update
from models.weights import assemble_param

# One fused computation per parameter shape: a fused parameter's transposes and concatenation
# make no intermediate device copies (compiled on the first update, reused after).
_ASSEMBLE = jax.jit(assemble_param, static_argnames=("transposed", "expert", "dtype"))


def update_device_weights(
    weights,
    params: Any,
    *,
    hf_config: Any,
    dtype: Any,
    view: Callable | None = None,
    tensor_parallel_size: int = 1,
    on_leaf: Callable[[int], None] | None = None,
) -> int:
    """Check ``params`` against ``weights``, then place them; returns the number of weights
    replaced.

    Args:
        weights: the ``DeviceWeights`` the engine's steps run on.
        params: ``{HF name: array}`` or the engine's own layout (``models.memory_weights``).
        hf_config: the model's HF config (tied embeddings).
        dtype: the engine's parameter dtype; float inputs are cast to it.
        view: the family's checkpoint view (``models.registry.checkpoint_view``).
        tensor_parallel_size: HF names are mapped for one device only (above 1: refused).
        on_leaf: called with each weight's index after it is placed (tests measure memory).

    Raises:
        ValueError: a missing, extra or misshapen parameter or a non-float dtype (named),
            HF names with tensor parallelism; nothing is replaced then.
    """
    if is_hf_names(params):
        if tensor_parallel_size > 1:
            raise ValueError(
                "update_weights with HF names is supported on one device; with "
                f"tensor_parallel_size {tensor_parallel_size} pass the engine's own layout "
                "(LLM.get_weights())"
            )
        plan = plan_hf_update(
            weights.abstract_model(), hf_config, params, dtype, view, assemble=_ASSEMBLE
        )
    else:
        current = [(path, _current(weights, i)) for i, path in enumerate(weights.paths)]
        plan = plan_own_update(current, params, dtype)
        del current  # holds every old array: they must be freed one by one below
    # Arrays the caller passed are never dropped early: a new value may be one of them.
    passed = {id(leaf) for leaf in jax.tree.leaves(params)}
    replaced = 0
    for index, path in enumerate(weights.paths):
        make = plan.makers.get(path)
        if make is None:  # not a parameter of the map, or the engine's own array passed back
            continue
        if id(weights.get(index)) not in passed:
            weights.release(index)  # frees it now unless someone else holds it
        new = make()
        sharding = weights.sharding(index)
        if not new.sharding.is_equivalent_to(sharding, new.ndim):
            new = jax.device_put(new, sharding)
        weights.set(index, new)
        replaced += 1
        if on_leaf is not None:
            on_leaf(index)
    return replaced


def _current(weights, index: int):
    array = weights.get(index)
    return weights.specs[index] if array is None else array


def device_bytes_in_use(device: jax.Device) -> int:
    """Bytes of live arrays on ``device``: the allocator's ``bytes_in_use`` where the device
    reports memory statistics (GPU), else the bytes of the live arrays' shards on it (CPU,
    whose device reports none); one buffer seen through several arrays (a sharded array's
    ``shard.data``) counts once."""
    stats = device.memory_stats()
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    total, seen = 0, set()
    for array in jax.live_arrays():
        if array.is_deleted() or device not in array.sharding.device_set:
            continue
        if len(array.sharding.device_set) == 1:
            buffer = array.unsafe_buffer_pointer()
            if buffer not in seen:
                seen.add(buffer)
                total += array.nbytes
        else:  # its shard on this device (not through addressable_shards, which caches arrays)
            shard_shape = array.sharding.shard_shape(array.shape)
            total += math.prod(shard_shape) * array.dtype.itemsize
    return total


__all__ = ["device_bytes_in_use", "update_device_weights"]
