"""What the op families' AD and batching rules share, and how they attach them.

AD rules must make the same MPI calls on every rank: a transpose rule is called
even when its cotangent is a symbolic zero, and it always communicates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching


def define_rules(
    primitive: Primitive,
    *,
    jvp: Callable[..., tuple[list, list]] | None = None,
    transpose: Callable[..., list] | None = None,
    batch: Callable[..., tuple[list, list]] | None = None,
) -> None:
    """Attach AD and vmap rules to `primitive` (the names follow jax.interpreters)."""
    if jvp is not None:
        ad.primitive_jvps[primitive] = jvp
    if transpose is not None:
        ad.primitive_transposes[primitive] = transpose
    if batch is not None:
        batching.primitive_batchers[primitive] = batch


def differentiable(x: Any) -> bool:
    return jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact)


def zero_tangent(y: Any) -> ad.Zero:
    return ad.Zero(jax.typeof(y).to_tangent_aval())


def instantiate(t: Any) -> jax.Array:
    """A tangent or cotangent as an array: symbolic zeros become real zeros."""
    return ad.instantiate_zeros(t)


def on_rank(keep: bool, x: jax.Array) -> jax.Array:
    """x where `keep`, else zeros; x stays an operand either way, so transposing
    this still sends a cotangent into whatever produced x (keeping ranks in step)."""
    return lax.select(jnp.full(x.shape, keep), x, jnp.zeros_like(x))


def linear_jvp(primitive: Primitive) -> Callable[..., tuple[list, list]]:
    """JVP of an op that is linear in every operand: the op applied to the tangents."""

    def jvp(primals, tangents, **params):
        outs = primitive.bind(*primals, **params)
        if not all(differentiable(x) for x in primals):
            return outs, [zero_tangent(y) for y in outs]
        dots = primitive.bind(*map(instantiate, tangents), **params)
        return outs, [
            d if differentiable(y) else zero_tangent(y) for y, d in zip(outs, dots, strict=False)
        ]

    return jvp


def batch_elementwise(primitive: Primitive) -> Callable[..., tuple[list, list]]:
    """vmap of an op on one array whose layout across ranks does not matter."""

    def rule(args, dims, **params):
        outs = primitive.bind(*args, **params)
        return outs, [dims[0]] * len(outs)

    return rule


def move_batch(x: jax.Array, dim: int | None, to: int) -> jax.Array:
    return x if dim is None else jnp.moveaxis(x, dim, to)
