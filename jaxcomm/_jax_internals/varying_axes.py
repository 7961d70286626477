"""Varying manual axes: shard_map's types (check_vma, on by default).

Inside shard_map with check_vma, each value's type says along which mesh
axes it may differ between devices ("varying"); elsewhere those sets are
empty. JAX checks that derivative rules keep them: a cotangent must have its
primal's type.
"""

from __future__ import annotations

from typing import Any

import jax
from jax._src import config, core, sharding_impls
from jax._src.core import ManualAxisType
from jax._src.interpreters import mlir


def manual_axes() -> tuple[str, ...]:
    """The mesh axes along which the function being traced is a per-device body
    whose values carry varying-axes types (shard_map with check_vma); else ()."""
    if not config._check_vma.value:
        return ()
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def in_shard_map() -> bool:
    """Whether the function being traced is shard_map's per-device body."""
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def axis_sizes() -> dict[str, int]:
    """Each axis of the mesh of the function being traced: its number of devices."""
    return dict(jax.sharding.get_abstract_mesh().shape)


def varying(aval: Any) -> frozenset[str]:
    """The axes along which values of type `aval` may differ between devices."""
    mat = getattr(aval, "mat", None)
    return mat.varying if mat is not None else frozenset()


def typed(aval: core.ShapedArray, names: frozenset[str]) -> core.ShapedArray:
    """`aval`'s shape and dtype, varying along `names` in the current mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = jax.sharding.PartitionSpec(*(None,) * len(aval.shape))
    return core.ShapedArray(
        aval.shape,
        aval.dtype,
        aval.weak_type,
        sharding=jax.sharding.NamedSharding(mesh, spec),
        manual_axis_type=ManualAxisType(varying=frozenset(names)),
    )


def vary(x: Any, names: frozenset[str]) -> Any:
    """x typed as varying along `names` too (JAX's pcast to varying: the identity,
    whose transpose sums the cotangent over those axes with JAX's collectives)."""
    missing = tuple(a for a in jax.sharding.get_abstract_mesh().axis_names if a in names)
    missing = tuple(a for a in missing if a not in varying(core.typeof(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def lowering_mesh(ctx: mlir.LoweringRuleContext) -> jax.sharding.Mesh | None:
    """The mesh (with devices) of the shard_map whose body is being lowered, if any."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        mesh = axis_context.mesh
        return mesh if isinstance(mesh, jax.sharding.Mesh) else None
    return None
