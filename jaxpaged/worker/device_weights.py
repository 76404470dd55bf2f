"""The model parameters a ``ModelRunner``'s steps run on: one flat list of device arrays.

The model is split once into its graph and a flat list of arrays (``nnx.split`` then
``jax.tree.flatten``): the jitted steps take the list as an argument, so each dispatch flattens
it in C++ with no Python callback per NNX variable (hundreds per step on 8B models), and the HLO
has no weights baked in. Index ``i`` of every method is the ``i``-th array of that list; its
parameter path (``nnx.to_flat_state``'s) is ``paths[i]``.

The steps were compiled for each array's shape, dtype and (with a mesh) sharding, the *specs*:
``set`` keeps an array to them, so replacing weights (``update_weights``) never recompiles.
``release`` drops the reference to an array (sleep mode, or one by one during an update, so
that peak memory stays near one copy of the weights).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from models.memory_weights import flatten_own_layout


def array_specs(tree, mesh: Mesh | None):
    """``tree``'s arrays as ``jax.ShapeDtypeStruct`` s; with a mesh they keep their shardings
    (without one, everything is on the one device and lowers to the same module whether its
    loader committed the arrays to the device or not)."""

    def spec(x):
        sharding = getattr(x, "sharding", None) if mesh is not None else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(spec, tree)


class DeviceWeights:
    """A model's parameters as a flat list of device arrays, with the specs steps compile for.

    Args:
        model: the NNX model; split once here (the module itself is not kept).
        mesh: tensor parallelism's mesh, or None for one device.
    """

    def __init__(self, model: nnx.Module, mesh: Mesh | None = None):
        self._graphdef, state = nnx.split(model)
        self._arrays, self._treedef = jax.tree.flatten(state)
        self.paths: list[tuple] = list(flatten_own_layout(state))
        self.specs: list[jax.ShapeDtypeStruct] = array_specs(self._arrays, mesh)
        self._shardings = [array.sharding for array in self._arrays]

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def arrays(self) -> list:
        """The list the steps take as their weights argument (None where released)."""
        return self._arrays

    @property
    def complete(self) -> bool:
        """Whether every array is there (False after ``release``, e.g. in sleep)."""
        return all(array is not None for array in self._arrays)

    def get(self, index: int) -> jax.Array | None:
        """Array ``index``; None once released."""
        return self._arrays[index]

    def sharding(self, index: int):
        """Where array ``index`` lives (its sharding when the model was split)."""
        return self._shardings[index]

    def release(self, index: int) -> None:
        """Drop the reference to array ``index`` (its memory is freed unless someone else holds
        it); no step may run until ``set`` fills it again."""
        self._arrays[index] = None

    def release_all(self) -> None:
        """``release`` every array (``sleep(level=2)``)."""
        self._arrays[:] = [None] * len(self._arrays)

    def set(self, index: int, value: jax.Array) -> None:
        """Run the steps on ``value`` for array ``index`` from now on.

        Raises:
            ValueError: a shape, dtype or (tensor parallelism) sharding other than the one the
                steps were compiled for, naming the parameter; the array is then unchanged.
        """
        spec, name = self.specs[index], ".".join(map(str, self.paths[index]))
        if value.shape != spec.shape or value.dtype != spec.dtype:
            raise ValueError(
                f"weight {name} must be {spec.dtype}{list(spec.shape)}, got "
                f"{value.dtype}{list(value.shape)}"
            )
        if spec.sharding is not None and not value.sharding.is_equivalent_to(
            spec.sharding, value.ndim
        ):
            raise ValueError(
                f"weight {name} must have sharding {spec.sharding}, got {value.sharding}"
            )
        self._arrays[index] = value

    def model(self, arrays: list | None = None) -> nnx.Module:
        """The model merged from its graph and ``arrays`` (default: the current ones; inside a
        jitted step, the step's traced weights)."""
        arrays = self._arrays if arrays is None else arrays
        return nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, arrays))

    def abstract_model(self) -> nnx.Module:
        """The model with shapes and dtypes only (``jax.ShapeDtypeStruct`` parameters)."""
        return self.model([jax.ShapeDtypeStruct(s.shape, s.dtype) for s in self.specs])

    def state(self) -> nnx.State:
        """The parameters as an NNX state (the arrays the steps run on, not copies)."""
        return jax.tree.unflatten(self._treedef, self._arrays)

    def nested(self) -> dict:
        """The arrays in the model's own nested layout, as a pure dict (``get_weights``; built
        directly: ``nnx.to_pure_dict``'s State objects sit in reference cycles, which would keep
        the arrays alive past an update until the next cyclic collection)."""
        nested: dict = {}
        for path, array in zip(self.paths, self._arrays, strict=True):
            node = nested
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = array
        return nested
