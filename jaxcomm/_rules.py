"""What the op families' AD and batching rules share, and how they attach them.

AD rules must make the same MPI calls on every rank: a transpose rule is called
even when its cotangent is a symbolic zero, and it always communicates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from jaxcomm._jax_internals import in_shard_map, manual_axes, vary, varying


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
        ad.primitive_transposes[primitive] = _typed_as_primals(transpose)
    if batch is not None:
        batching.primitive_batchers[primitive] = batch


def _typed_as_primals(transpose: Callable[..., list]) -> Callable[..., list]:
    """`transpose`, whose cotangents vary inside shard_map as their primals do:
    zeros a rule makes (where no message arrives) are invariant, and JAX
    checks that a cotangent has its primal's type."""

    def rule(cts, *operands, **params):
        results = transpose(cts, *operands, **params)
        if not manual_axes():
            return results
        return [_as_primal(ct, x) for ct, x in zip(results, operands, strict=False)]

    return rule


def _as_primal(ct: Any, x: Any) -> Any:
    if ct is None or type(ct) is ad.Zero or not ad.is_undefined_primal(x):
        return ct
    return vary(ct, varying(x.aval))


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
    return lax.select(jnp.full(x.shape, same_program(keep)), x, jnp.zeros_like(x))


def same_program(flag: Any) -> Any:
    """A rank-dependent scalar (a bool, or a NumPy scalar) as rules use it:
    inside shard_map, a value XLA cannot fold, so that every process compiles
    the same program. JAX pairs its own collectives across processes by their
    place in the program: where a folded constant changed one rank's program,
    XLA could order or combine them differently there (jaxcomm._sharded).
    (A scalar: XLA makes an array whose elements are all alike into another
    kind of constant than one whose elements differ.)"""
    return lax.optimization_barrier(np.asarray(flag)) if in_shard_map() else flag


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
