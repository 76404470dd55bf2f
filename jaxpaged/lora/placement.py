"""Where one adapter slot's arrays go under tensor parallelism (``models.sharding``).

``jaxpaged.lora.slots.adapter_slot_arrays`` builds a slot in the checkpoint's layout: ``a [in,
C]``, ``b [C, out]``, a fused projection's output columns as ``[part_0 | part_1 | ...]``. The
sharded model's projections differ from the checkpoint's (``models.sharding``): fused columns
are laid out shard by shard (``models.merged_linear``), k/v columns repeat each KV head ``r``
times when ``Hkv < tp``, and gate/up columns and down rows are zero-padded to a multiple of
``tp``. A slot is mapped onto that physical layout with the same per-axis index maps the weight
loader fills the kernels with (``models.sharded_weights.axis_maps``): the rows of ``a`` follow
the kernel's input axis, the columns of ``b`` its output axis (the rank axis never splits).
So a token's update ``x a b`` lands on exactly the columns the base output has for it, and the
zero rows/columns of padding add nothing. ``A`` and ``B`` are then split as
``models.sharding.lora_partition_specs`` says (column-parallel: B along ``out``; row-parallel:
A along ``in``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding

from models.lora import ProjectionSpec
from models.sharded_weights import axis_maps, map_indices
from models.sharding import TP_AXIS, lora_partition_specs
from models.tp_layout import TPLayout


@dataclasses.dataclass(frozen=True)
class SlotPlacement:
    """The physical layout and shardings of the slot arrays on one ``tp`` mesh.

    Build it with :meth:`for_mesh`. ``a_rows[name]`` / ``b_cols[name]``: ``i64[physical size]``,
    for each physical row of ``a`` / column of ``b`` the checkpoint index it takes (``-1``:
    zero), or None where the two layouts agree.
    """

    mesh: Mesh
    physical_specs: dict[str, ProjectionSpec]
    a_rows: dict[str, np.ndarray | None]
    b_cols: dict[str, np.ndarray | None]

    @classmethod
    def for_mesh(
        cls, physical_specs: dict[str, ProjectionSpec], hf_config: Any, mesh: Mesh
    ) -> SlotPlacement:
        """The placement for ``mesh``.

        Args:
            physical_specs: the projections of the sharded model (built from
                ``models.sharding.tp_model_config``: repeated KV heads, padded intermediate).
            hf_config: the checkpoint's HF config (its ``TPLayout``).
            mesh: the ``("tp",)`` mesh the model is sharded over.
        """
        layout = TPLayout.from_hf_config(hf_config, mesh.shape[TP_AXIS])
        a_rows, b_cols = {}, {}
        for name, spec in physical_specs.items():
            shape = (spec.in_features, spec.out_features)
            fused = {(name,): spec.part_sizes} if len(spec.part_sizes) > 1 else None
            rows_map, cols_map = axis_maps((name, "kernel"), shape, layout, fused)
            a_rows[name] = None if rows_map is None else map_indices(rows_map, shape[0])
            b_cols[name] = None if cols_map is None else map_indices(cols_map, shape[1])
        return cls(mesh, dict(physical_specs), a_rows, b_cols)

    def place(self, name: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Projection ``name``'s slot ``(a [in, C], b [C, out])`` in the checkpoint's layout ->
        the physical ``(a [in', C], b [C, out'])`` (host arrays, same dtype)."""
        return _take(a, self.a_rows[name], axis=0), _take(b, self.b_cols[name], axis=1)

    def shardings(self, name: str) -> tuple[NamedSharding, NamedSharding]:
        """Where projection ``name``'s ``(A, B)`` slot arrays live on the mesh."""
        a_spec, b_spec = lora_partition_specs(name)
        return NamedSharding(self.mesh, a_spec), NamedSharding(self.mesh, b_spec)


def _take(x: np.ndarray, index: np.ndarray | None, axis: int) -> np.ndarray:
    """``x`` reindexed along ``axis`` by ``index`` (``-1``: zeros); ``x`` itself for None."""
    if index is None:
        return x
    out = np.take(x, np.maximum(index, 0), axis=axis)
    mask = (index >= 0).reshape([-1 if i == axis else 1 for i in range(x.ndim)])
    return np.where(mask, out, np.zeros((), x.dtype))
