"""How a JaxComm method runs its operation on a pytree, the one way every
blocking call takes: check the arguments as the operation declares them
(jaxcomm._checks), choose a path, run. The paths: the eager path
(jaxcomm._eager) for concrete host arrays, which also repeats a call that
passed the checks without making them again; binding while tracing; one jitted
call for arrays off the host. The leaves travel as the message plan of
jaxcomm._fusion says, on every path."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _checks, _eager, _fusion, _structure
from jaxcomm._eager import ONE_ARRAY
from jaxcomm._fusion import Params
from jaxcomm._jax_internals import ArrayImpl, at_top_level
from jaxcomm._primitive import CommInfo, CommPrimitive


def flatten(x: Any) -> tuple[list[Any], Any]:
    """x's leaves and structure; a lone jax.Array without the pytree machinery."""
    return ([x], ONE_ARRAY) if type(x) is ArrayImpl else jax.tree.flatten(x)


def unflatten(tree: Any, results: list[Any]) -> Any:
    return results[0] if tree is ONE_ARRAY else tree.unflatten(results)


def apply(
    primitive: CommPrimitive, x: Any, comm: CommInfo, params: dict[str, Any]
) -> tuple[Any, Sequence[Any]]:
    """`primitive` (an op on one array) on each leaf of x, with `params` checked as
    it declares them; small leaves together where it is element-wise. Returns the
    results in x's structure, and the other results of the last message (a
    receive's status)."""
    _checks.given(primitive.operation, x)
    primitive.check_params(params, comm)
    items = tuple(params.items())
    leaves, tree = flatten(x)
    agree_on_structure(primitive, x, tree, comm)
    done = _eager.repeat(primitive, leaves, tree, comm, items)
    if done is not None:  # an earlier call like this one passed the checks below
        return done
    leaves = primitive.check_operands(leaves, params, comm)
    fuse = _fusion.fuses(primitive.elementwise, comm.check)
    if _eager.can_run(leaves):
        results, rest = _eager.run(primitive, leaves, tree, comm, items, fuse)
    elif not at_top_level() or any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        # Bound in the active trace even on constants: under grad the operation
        # must take part (jaxcomm._jax_internals.tangents), which a jitted
        # call of constants would hide from it.
        results, rest = _traced(primitive, leaves, comm, items, fuse)
    else:
        # One jitted function per signature: JAX dispatches that faster than the
        # primitives one by one.
        results, rest = _jitted(primitive, comm, items, fuse, leaves)
    return unflatten(tree, results), rest


def _traced(primitive, leaves, comm, params: Params, fuse: bool) -> tuple[list, tuple]:
    """`primitive` bound on every leaf; with `fuse`, small leaves of one dtype as
    one array, in one MPI call. Returns each leaf's first result (None where the
    op has none) and the other results of the last message."""
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


def apply_to_arrays(
    primitive: CommPrimitive,
    arrays: Sequence[jax.Array],
    comm: CommInfo,
    params: dict[str, Any],
    key: tuple | None = None,
) -> list[Any]:
    """`primitive` on its operands as they are (an operation on several arrays, not
    a pytree): eagerly where it can be, else bound. NumPy operands (counts) are
    read where they are. An eager call is remembered under `key`
    (_eager.rows_key), for a later call that repeats it."""
    if _eager.can_run([a for a in arrays if not isinstance(a, np.ndarray)]):
        return _eager.run_arrays(primitive, arrays, comm, tuple(params.items()), key)
    return primitive.bind(*arrays, comm=comm, **params)


def agree_on_structure(primitive: CommPrimitive, x: Any, tree: Any, comm: CommInfo) -> None:
    """In checking mode, before a collective on pytree x (of structure `tree`):
    every rank's x must have the same leaves' paths and nodes' static data, or
    every rank raises (jaxcomm._structure)."""
    if comm.check and _structure.compared(primitive, tree):
        structure = _structure.describe(x, tree)
        run_alone(
            _structure.check_structure_p, comm, operation=primitive.operation, structure=structure
        )


def run_alone(primitive, comm, **params: Any) -> None:
    """An operation on no arrays (barrier): one call, eagerly where it can be."""
    if _eager.can_run(()):
        _eager.call(primitive, (), comm, tuple(params.items()))
    else:
        primitive.bind(comm=comm, **params)
