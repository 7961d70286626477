"""Reductions: allreduce, reduce, scan, exscan, reduce_scatter.

Each function takes one array and static arguments, checked by the JaxComm layer
against the parameters each primitive declares.

Gradient rule (see docs/autodiff): allreduce's result is the same on every rank;
where it is one replicated value its transpose passes the (replicated)
cotangent through unchanged via pvary, else it sums the cotangents
(jaxcomm._replicated.shared_cotangent). The other reductions have results that
differ between ranks and use their exact adjoints.
"""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
import numpy as np
from jax import core

from jaxcomm import _sharded
from jaxcomm._checks import ROOT, reduce_op
from jaxcomm._collectives import allgather, bcast
from jaxcomm._datatypes import ReduceOp
from jaxcomm._primitive import CommInfo, asked_in_place, comm_primitive, off_root, same_shape
from jaxcomm._replicated import pvary, shared_cotangent
from jaxcomm._rules import (
    batch_elementwise,
    define_rules,
    differentiable,
    instantiate,
    move_batch,
    on_rank,
    same_program,
    zero_tangent,
)


def _row(x, **_):
    return [core.ShapedArray(x.shape[1:], x.dtype)]


# In place (MPI_IN_PLACE in x's buffer) only when asked: see asked_in_place.
_OP = {"op": reduce_op}
_REDUCTION = {"aliases": asked_in_place, "elementwise": True}
allreduce_p = comm_primitive("allreduce", same_shape, params=_OP, vma="replicated", **_REDUCTION)
# reduce's other ranks return x as it is.
reduce_p = comm_primitive(
    "reduce", same_shape, result_is_x=off_root, params=_OP | {"root": ROOT}, **_REDUCTION
)
scan_p = comm_primitive("scan", same_shape, params=_OP, **_REDUCTION)
exscan_p = comm_primitive("exscan", same_shape, params=_OP, **_REDUCTION)
reduce_scatter_p = comm_primitive("reduce_scatter", _row, params=_OP, leading_axis="x")


def allreduce(x, *, comm: CommInfo, op: ReduceOp):
    """Reduction of x over all ranks, on every rank. Shape: x.shape."""
    return allreduce_p.bind(x, comm=comm, op=op)[0]


def reduce(x, *, comm: CommInfo, op: ReduceOp, root: int):
    """Reduction of x over all ranks on root; x unchanged elsewhere. Shape: x.shape."""
    return reduce_p.bind(x, comm=comm, op=op, root=root)[0]


def scan(x, *, comm: CommInfo, op: ReduceOp):
    """Inclusive prefix reduction over ranks 0..rank. Shape: x.shape."""
    return scan_p.bind(x, comm=comm, op=op)[0]


def exscan(x, *, comm: CommInfo, op: ReduceOp):
    """Exclusive prefix reduction over ranks 0..rank-1; op's identity on rank 0."""
    return exscan_p.bind(x, comm=comm, op=op)[0]


def reduce_scatter(x, *, comm: CommInfo, op: ReduceOp):
    """Row `rank` of the reduction of x (shape (size, *s)) over ranks. Shape: s."""
    return reduce_scatter_p.bind(x, comm=comm, op=op)[0]


# -- JVPs of the nonlinear reductions -------------------------------------------------
# The tangent of MAX/MIN flows from the rank(s) holding the extremum, split evenly
# between ties; the tangent of PROD from the product of the other ranks' values.


def _product_of_others(rows):
    """prod(rows without row i) for every i, as an array shaped like rows."""
    ones = jnp.ones_like(rows[:1])
    before = jnp.cumprod(jnp.concatenate([ones, rows[:-1]]), axis=0)
    after = jnp.flip(jnp.cumprod(jnp.concatenate([ones, jnp.flip(rows, 0)[:-1]]), axis=0), 0)
    return before * after


def _gathered(x, comm):
    """Every rank's x, for rank-dependent use (hence pvary: for second derivatives)."""
    return pvary(allgather(x, comm=comm), comm=comm)


def _allreduce_tangent(x, y, t, *, comm, op):
    if op == ReduceOp.SUM:
        return allreduce(t, comm=comm, op=op)
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        hit = x == y
        ties = allreduce(hit.astype(t.dtype), comm=comm, op=ReduceOp.SUM)
        return allreduce(jnp.where(hit, t, 0), comm=comm, op=ReduceOp.SUM) / ties
    others = _sharded.own_row(_product_of_others(_gathered(x, comm)), comm)
    return allreduce(others * t, comm=comm, op=ReduceOp.SUM)


def _on_root(comm, root, value, passed_through):
    # Both stay operands on every rank, so that cotangents (and vmap batch axes)
    # reach the same collectives on every rank.
    return jnp.where(same_program(comm.rank == root), value, passed_through)


def _reduce_tangent(x, y, t, *, comm, op, root):
    if op == ReduceOp.SUM:
        return reduce(t, comm=comm, op=op, root=root)
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        hit = x == bcast(y, comm=comm, root=root)
        ties = reduce(hit.astype(t.dtype), comm=comm, op=ReduceOp.SUM, root=root)
        hits = reduce(jnp.where(hit, t, 0), comm=comm, op=ReduceOp.SUM, root=root)
        return _on_root(comm, root, hits / ties, t)
    others = _sharded.own_row(_product_of_others(_gathered(x, comm)), comm)
    total = reduce(others * t, comm=comm, op=ReduceOp.SUM, root=root)
    return _on_root(comm, root, total, t)


def _prefix_tangent(x, y, t, *, comm, op, inclusive):
    if op == ReduceOp.SUM:
        return (scan if inclusive else exscan)(t, comm=comm, op=op)
    # Rank r's result depends on the values of ranks 0..r (or 0..r-1): gather them
    # all and mask the others (not slice them: every rank's program then has the
    # same shapes, see same_program).
    stop = comm.rank + 1 if inclusive else comm.rank
    mine = (jnp.arange(comm.size) < same_program(np.int32(stop))).reshape(-1, *[1] * t.ndim)
    xs = _gathered(x, comm)
    ts = jnp.where(mine, _gathered(t, comm), 0)
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        hit = mine & (xs == y)
        ties = jnp.maximum(hit.sum(0), 1)  # none on exscan's rank 0: zeros
        return jnp.where(hit, ts, 0).sum(0) / ties.astype(t.dtype)
    return (_product_of_others(jnp.where(mine, xs, 1)) * ts).sum(0)


def _reduce_scatter_tangent(x, y, t, *, comm, op):
    if op == ReduceOp.SUM:
        return reduce_scatter(t, comm=comm, op=op)
    # Row `rank` of the allreduce; pvary because each rank keeps a different row.
    whole = _allreduce_tangent(x, allreduce(x, comm=comm, op=op), t, comm=comm, op=op)
    return _sharded.own_row(pvary(whole, comm=comm), comm)


def _reduction_jvp(primitive, tangent):
    def jvp(primals, tangents, *, comm, op, in_place=False, **params):
        (x,), (t,) = primals, tangents
        (y,) = primitive.bind(x, comm=comm, op=op, in_place=in_place, **params)
        if not differentiable(x) or op not in _DIFFERENTIABLE:
            return [y], [zero_tangent(y)]
        return [y], [tangent(x, y, instantiate(t), comm=comm, op=op, **params)]

    return jvp


_DIFFERENTIABLE = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN)


# -- transposes (linear only for SUM) --------------------------------------------------


def _linear_only(name, transpose):
    def rule(cts, x, *, comm, op, in_place=False, **params):
        if op != ReduceOp.SUM:
            raise NotImplementedError(f"{name}: op={op.name} is not linear; only SUM transposes")
        return [transpose(instantiate(cts[0]), comm=comm, **params)]

    return rule


def _allreduce_transpose(ct, *, comm):
    return shared_cotangent(ct, comm=comm, operation="allreduce")


def _reduce_transpose(ct, *, comm, root):
    from_root = pvary(bcast(ct, comm=comm, root=root), comm=comm)
    return from_root + on_rank(comm.rank != root, ct)


def _scan_transpose(ct, *, comm):
    total = pvary(allreduce(ct, comm=comm, op=ReduceOp.SUM), comm=comm)
    return total - exscan(ct, comm=comm, op=ReduceOp.SUM)


def _exscan_transpose(ct, *, comm):
    total = pvary(allreduce(ct, comm=comm, op=ReduceOp.SUM), comm=comm)
    return total - scan(ct, comm=comm, op=ReduceOp.SUM)


def _reduce_scatter_transpose(ct, *, comm):
    return pvary(allgather(ct, comm=comm), comm=comm)


def _reduce_scatter_batch(args, dims, *, comm, op):
    # The rank axis must stay leading, so each rank's rows are contiguous.
    (x,), (dim,) = args, dims
    return reduce_scatter_p.bind(move_batch(x, dim, 1), comm=comm, op=op), [0]


# One row per reduction: its tangent, its transpose (SUM only) and its batching.
for _primitive, _tangent, _transpose, _batch in [
    (allreduce_p, _allreduce_tangent, _allreduce_transpose, None),
    (reduce_p, _reduce_tangent, _reduce_transpose, None),
    (scan_p, partial(_prefix_tangent, inclusive=True), _scan_transpose, None),
    (exscan_p, partial(_prefix_tangent, inclusive=False), _exscan_transpose, None),
    (reduce_scatter_p, _reduce_scatter_tangent, _reduce_scatter_transpose, _reduce_scatter_batch),
]:
    define_rules(
        _primitive,
        jvp=_reduction_jvp(_primitive, _tangent),
        transpose=_linear_only(_primitive.name.removeprefix("jaxcomm_"), _transpose),
        batch=_batch or batch_elementwise(_primitive),
    )
