"""How a JaxComm method runs its operation on a pytree, the one way every
blocking call takes: the arguments are checked as the operation declares them
(jaxcomm._checks), unless the call repeats one that passed (the eager shortcut);
then the leaves run on the eager path (jaxcomm._eager), while tracing, or, for
arrays off the host, as one jitted call. The leaves travel as the message plan
of jaxcomm._fusion says, on every path."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm import _eager, _fusion
from jaxcomm._fusion import Params
from jaxcomm._jax_internals import at_top_level
from jaxcomm._primitive import CommInfo, CommPrimitive


def apply(
    primitive: CommPrimitive, x: Any, comm: CommInfo, params: dict[str, Any]
) -> tuple[Any, Sequence[Any]]:
    """`primitive` (an op on one array) on each leaf of x, with `params` checked as
    it declares them; small leaves together where it is element-wise. Returns the
    results in x's structure, and the other results of the last message (a
    receive's status)."""
    primitive.check_params(params, comm)
    items = tuple(params.items())
    again = _eager.again(primitive.eager, x, comm, items)
    if again is not None:  # an earlier call like this one passed the checks below
        return again
    leaves, tree = primitive.check_operands(x, params, comm)
    fuse = primitive.elementwise
    results, rest = _run(primitive, leaves, comm, items, fuse)
    _eager.remember(primitive.eager, x, comm, items, fuse)
    return tree.unflatten(results), rest


def _run(primitive, leaves: list, comm, params: Params, fuse: bool) -> tuple[list, tuple]:
    """`primitive` on every leaf; with `fuse`, small leaves of one dtype as one
    array, in one MPI call. Returns each leaf's first result (None where the op has
    none) and the other results of the last message."""
    if _eager.can_run(leaves):
        return _eager.map_call(primitive.eager, leaves, comm, params, fuse)(leaves)
    if not at_top_level() or any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        # Bound in the active trace even on constants: under grad the operation
        # must take part (jaxcomm._jax_internals.taking_part), which a jitted
        # call of constants would hide from it.
        return _traced(primitive, leaves, comm, params, fuse)
    # One jitted function per signature: JAX dispatches that faster than the
    # primitives one by one.
    return _jitted(primitive, comm, params, fuse, leaves)


def _traced(primitive, leaves, comm, params, fuse):
    results: list[Any] = [None] * len(leaves)
    rest: tuple = ()
    for message in _fusion.messages([(leaf.shape, leaf.dtype) for leaf in leaves], fuse):
        own = dict(_fusion.message_params(params, message))
        if not message.fused:
            (i,) = message.members
            outputs = primitive.bind(leaves[i], comm=comm, **own)
            if outputs:
                results[i], rest = outputs[0], tuple(outputs[1:])
            continue
        fused = primitive.bind(message.pack(leaves, jnp), comm=comm, **own)[0]
        for i, piece in zip(message.members, message.unpack(fused), strict=True):
            results[i] = piece
    return results, rest


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _jitted(primitive, comm, params, fuse, leaves):
    return _traced(primitive, leaves, comm, params, fuse)


def run_alone(primitive, comm, **params: Any) -> None:
    """An operation on no arrays (barrier): one call, eagerly where it can be."""
    if _eager.can_run(()):
        primitive.eager((), comm, **params)
    else:
        primitive.bind(comm=comm, **params)
