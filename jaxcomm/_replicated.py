"""The gradient rule for results that every rank holds alike (see docs/autodiff).

A result that every rank of a communicator holds identically (allreduce, bcast,
allgather, allgatherv) is, where it is one value (jaxcomm._sharded.one_value:
outside shard_map, or invariant in JAX's types inside it), one replicated
value: its cotangent is taken to be replicated too (checked in checking mode by
check_replicated), and flows back through pvary. pvary marks a replicated value
that flows into rank-dependent code: the identity on values, whose transpose is
an allreduce. Elsewhere inside shard_map such a result is one value per device,
and its transpose is the exact adjoint: every device's cotangent, summed.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.interpreters import mlir

from jaxcomm import _sharded
from jaxcomm._datatypes import ReduceOp
from jaxcomm._jax_internals import (
    COMM_EFFECT,
    OrderedPrimitive,
    apply_primitive,
    lower_identity,
    typed,
    vary,
    varying,
)
from jaxcomm._primitive import PRIMITIVES, CommInfo, comm_primitive, in_place, same_shape
from jaxcomm._rules import batch_elementwise, define_rules, instantiate, linear_jvp

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
    """x unchanged; where a result that every rank holds alike is one value
    (jaxcomm._sharded.one_value), its cotangent is summed over ranks (the dual
    of allreduce). Elsewhere nothing is one value: x, whose cotangent is its own."""
    if not _sharded.one_value(comm, "pvary"):
        return x
    return pvary_p.bind(x, comm=comm)[0]


def mark(x, *, comm: CommInfo):
    """comm.pvary(x) for one array: pvary where comm's results that every rank
    holds alike are one value; inside shard_map there x must be invariant along
    the axes comm spans (it is one value for JAX: along() made comm). Elsewhere
    inside shard_map comm's results are one value per device already, and x is
    made varying along the axes comm spans with JAX's own pcast, which sums
    the cotangent of an x that JAX holds as one value over them."""
    axes = _sharded.spanned(comm, "pvary")
    if not _sharded.one_value(comm, "pvary"):
        return vary(x, axes)
    have = varying(jax.typeof(x)) & axes
    if have:
        raise ValueError(
            f"pvary: x varies along the mesh axes {sorted(have)} (its type: {jax.typeof(x)}), "
            f"so it is not one replicated value over a communicator that spans {sorted(axes)}"
        )
    return pvary(x, comm=comm)


def shared_cotangent(ct, *, comm: CommInfo, operation: str):
    """From the cotangent of a result y that every rank of comm holds alike,
    what each rank's transpose takes its own part of (shaped like y): where y
    is one value (jaxcomm._sharded.one_value), its cotangent, checked in
    checking mode and through pvary (so that a second derivative sums it over
    ranks); where y is one value per device, every device's cotangent summed,
    the exact adjoint (one allreduce the size of y)."""
    if _sharded.one_value(comm, operation):
        return pvary(replicated_cotangent(ct, comm=comm, operation=operation), comm=comm)
    return _summed(ct, comm=comm)


def _summed(ct, *, comm: CommInfo):
    # allreduce's primitive, by name: jaxcomm._reductions declares it and imports
    # this module.
    return PRIMITIVES["allreduce"].bind(ct, comm=comm, op=ReduceOp.SUM)[0]


def replicated_cotangent(ct, *, comm: CommInfo, operation: str):
    """The cotangent of a replicated result, as an array; in checking mode, first
    verify that it is identical on every rank."""
    if comm.check:
        return check_replicated_p.bind(ct, comm=comm, operation=operation)[0]
    return ct


define_rules(
    pvary_p,
    jvp=linear_jvp(pvary_p),
    transpose=lambda cts, x, *, comm: [_summed(instantiate(cts[0]), comm=comm)],
    batch=batch_elementwise(pvary_p),
)
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
