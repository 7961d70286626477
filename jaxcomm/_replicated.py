"""The gradient convention for replicated values (see docs/autodiff).

A result that every rank holds identically (allreduce, bcast, allgather) is one
replicated value: its cotangent is taken to be replicated too (checked in checking
mode by check_replicated), and flows back through pvary. pvary marks a
replicated value that flows into rank-dependent code: the identity on values,
whose transpose, an allreduce, is attached in _reductions.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.interpreters import mlir

from jaxcomm import _sharded
from jaxcomm._jax_internals import (
    COMM_EFFECT,
    OrderedPrimitive,
    apply_primitive,
    lower_identity,
    typed,
    vary,
    varying,
)
from jaxcomm._primitive import CommInfo, comm_primitive, in_place, same_shape
from jaxcomm._rules import batch_elementwise, define_rules, linear_jvp

# Identity on the data; it exists for its transpose. It carries the effect so that
# it is never dropped: its transpose is a collective every rank must join.
pvary_p = OrderedPrimitive("jaxcomm_pvary")
pvary_p.multiple_results = True
pvary_p.def_impl(partial(apply_primitive, pvary_p))


def _pvary_abstract_eval(x, *, comm: CommInfo):
    # Inside shard_map: varying along the axes comm spans too (its input is
    # invariant along them where along() made comm: a replicated result).
    axes = _sharded.spanned(comm, "pvary")
    return [typed(x, varying(x) | axes) if axes else x], {COMM_EFFECT}


pvary_p.def_effectful_abstract_eval(_pvary_abstract_eval)
mlir.register_lowering(pvary_p, lower_identity)

check_replicated_p = comm_primitive("check_replicated", same_shape, aliases=in_place, vma="same")


def pvary(x, *, comm: CommInfo):
    """x unchanged; its cotangent is summed over ranks (the dual of allreduce)."""
    return pvary_p.bind(x, comm=comm)[0]


def mark(x, *, comm: CommInfo):
    """comm.pvary(x) for one array: pvary, or inside shard_map what its types
    allow. There an x invariant along the axes comm spans is one value for JAX:
    along() made comm, pvary makes it varying, its cotangent summed over comm;
    any other communicator spans every axis, and JAX's own pcast to varying
    sums its cotangent over the mesh. An x already varying along every axis
    of another communicator passes through pvary (jaxcomm's convention)."""
    axes = _sharded.spanned(comm, "pvary")
    if not axes:
        return pvary(x, comm=comm)
    have = varying(jax.typeof(x)) & axes
    if not have:
        return pvary(x, comm=comm) if comm.span is not None else vary(x, axes)
    if comm.span is None and have == axes:
        return pvary(x, comm=comm)
    raise ValueError(
        f"pvary: x varies along the mesh axes {sorted(have)} (its type: {jax.typeof(x)}), "
        f"so it is not one replicated value over a communicator that spans {sorted(axes)}"
    )


def replicated_cotangent(ct, *, comm: CommInfo, operation: str):
    """The cotangent of a replicated result, as an array; in checking mode, first
    verify that it is identical on every rank."""
    if comm.check:
        return check_replicated_p.bind(ct, comm=comm, operation=operation)[0]
    return ct


define_rules(pvary_p, jvp=linear_jvp(pvary_p), batch=batch_elementwise(pvary_p))
define_rules(
    check_replicated_p,
    # An identity on values: tangents and cotangents pass through unchecked.
    jvp=lambda primals, tangents, **params: (
        check_replicated_p.bind(*primals, **params),
        list(tangents),
    ),
    transpose=lambda cts, x, **_: [cts[0]],
    batch=batch_elementwise(check_replicated_p),
)
