"""Variable-size exchanges: alltoallv, allgatherv, gatherv and scatterv.

Rows of x (its leading axis) travel, as many as int32 count operands say; the
counts may be traced and change from call to call, and only the result's
capacity (its rows) is static. Each primitive returns the counts received beside
the rows. With `exchange` the call first learns them from the senders (one small
collective); the AD rules pass the counts already known (exchange=False), so a
tangent or cotangent costs one exchange of rows only.

All four are linear in x and the counts carry no tangent. Adjoints: alltoallv's
is an alltoallv back with the counts swapped; gatherv's a scatterv and
scatterv's a gatherv; allgatherv's result is one replicated value, so, as for
allgather, its cotangent is expected to be replicated and each rank takes its own
rows of it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import core
from jax.interpreters import ad

from jaxcomm._collectives import allgather, alltoall, gather, scatter
from jaxcomm._primitive import CommInfo, comm_primitive
from jaxcomm._replicated import pvary, replicated_cotangent
from jaxcomm._rules import define_rules, differentiable, instantiate, move_batch, zero_tangent


def _rows(x, capacity: int):
    return core.ShapedArray((capacity, *x.shape[1:]), x.dtype)


def _per_rank(comm: CommInfo):
    return core.ShapedArray((comm.size,), np.int32)


def _alltoallv_shape(x, send_counts, recv_counts, *, comm, capacity, **_):
    return [_rows(x, capacity), _per_rank(comm)]


def _allgatherv_shape(x, count, counts, *, comm, capacity, **_):
    return [_rows(x, capacity), _per_rank(comm)]


def _gatherv_shape(x, count, counts, *, comm, root, capacity, **_):
    # Only the root receives rows.
    return [_rows(x, capacity if comm.rank == root else 0), _per_rank(comm)]


def _scatterv_shape(x, counts, count, *, comm, root, capacity, **_):
    return [_rows(x, capacity), core.ShapedArray((), np.int32)]


# Operands: x, the counts this rank sends, then the counts it receives (used
# when not `exchange`). Results: the rows received, then their counts.
alltoallv_p = comm_primitive("alltoallv", _alltoallv_shape)
allgatherv_p = comm_primitive("allgatherv", _allgatherv_shape)
gatherv_p = comm_primitive("gatherv", _gatherv_shape)
scatterv_p = comm_primitive("scatterv", _scatterv_shape)


def _rank_rows(counts, rank: int, rows: int):
    """Where rank `rank`'s rows start among those of all ranks, in rank order,
    and which of `rows` rows are its."""
    start = jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < rank, counts, 0))
    return start + jnp.arange(rows), jnp.arange(rows) < counts[rank]


def _masked_rows(ct, index, keep, like):
    """Rows `index` of ct where `keep`, else zeros: an array like `like`."""
    taken = jnp.take(ct, index, axis=0, mode="fill", fill_value=0)
    return jnp.where(keep.reshape(-1, *[1] * (len(like.shape) - 1)), taken, 0).astype(like.dtype)


def rows_of(x) -> int:
    """How many rows x (a primal or an undefined one, in a transpose) has."""
    return (x.aval if ad.is_undefined_primal(x) else x).shape[0]


def received_counts(sent, comm: CommInfo):
    """The counts of an alltoallv's rows each rank received, learnt from what every
    rank sent (one alltoall): for an adjoint transposed as written."""
    return alltoall(sent.reshape(comm.size, 1), comm=comm)[:, 0]


def _alltoallv_transpose(cts, x, send, recv, *, comm, capacity, exchange):
    if exchange:  # transposed as written (jax.linear_transpose): learn what arrived
        recv = received_counts(send, comm)
    back, _ = alltoallv_p.bind(
        instantiate(cts[0]), recv, send, comm=comm, capacity=rows_of(x), exchange=False
    )
    return [back, None, None]


def _allgatherv_transpose(cts, x, count, counts, *, comm, capacity, exchange):
    if exchange:
        counts = allgather(count, comm=comm)
    ct = replicated_cotangent(instantiate(cts[0]), comm=comm, operation="allgatherv")
    ct = pvary(ct, comm=comm)
    index, keep = _rank_rows(counts, comm.rank, rows_of(x))
    return [_masked_rows(ct, index, keep, x.aval), None, None]


def _gatherv_transpose(cts, x, count, counts, *, comm, root, capacity, exchange):
    if exchange:  # every rank takes part; the root learns the counts
        gathered = gather(count, comm=comm, root=root)
        counts = gathered if comm.rank == root else counts
    back, _ = scatterv_p.bind(
        instantiate(cts[0]),
        counts,
        count,
        comm=comm,
        root=root,
        capacity=rows_of(x),
        exchange=False,
    )
    return [back, None, None]


def _scatterv_transpose(cts, x, counts, count, *, comm, root, capacity, exchange):
    if exchange:  # the root's counts; the other ranks pass a template
        count = scatter(counts if comm.rank == root else counts[0], comm=comm, root=root)
    rows = rows_of(x)
    back, _ = gatherv_p.bind(
        instantiate(cts[0]),
        count,
        counts,
        comm=comm,
        root=root,
        capacity=rows if comm.rank == root else 0,
        exchange=False,
    )
    if comm.rank != root:  # x is not read off the root: no cotangent
        back = jnp.zeros((rows, *back.shape[1:]), back.dtype)
    return [back, None, None]


def _rows_travel_as_x(primitive):
    """JVP of a variable-size exchange: the tangent's rows travel as x's did, with
    the counts received (operand 2) now known, so not exchanged again."""

    def jvp(primals, tangents, **params):
        y, got = primitive.bind(*primals, **params)
        if not differentiable(primals[0]):  # x's dtype is the same on every rank
            return [y, got], [zero_tangent(y), zero_tangent(got)]
        sent = primals[1]
        dy, _ = primitive.bind(instantiate(tangents[0]), sent, got, **{**params, "exchange": False})
        return [y, got], [dy, zero_tangent(got)]

    return jvp


def _one_call_per_batch(primitive):
    """vmap: with the same counts for the whole batch, one call whose rows carry
    the batch; with counts that differ across it, one call per member."""

    def rule(args, dims, **params):
        (x, *counts), (dx, *count_dims) = args, dims
        if all(d is None for d in count_dims):
            return primitive.bind(move_batch(x, dx, 1), *counts, **params), [1, None]
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        outs = [
            primitive.bind(
                *(
                    a if d is None else jnp.take(a, b, axis=d)
                    for a, d in zip(args, dims, strict=True)
                ),
                **params,
            )
            for b in range(size)
        ]
        return [jnp.stack([out[i] for out in outs]) for i in range(2)], [0, 0]

    return rule


for _primitive, _transpose in [
    (alltoallv_p, _alltoallv_transpose),
    (allgatherv_p, _allgatherv_transpose),
    (gatherv_p, _gatherv_transpose),
    (scatterv_p, _scatterv_transpose),
]:
    define_rules(
        _primitive,
        jvp=_rows_travel_as_x(_primitive),
        transpose=_transpose,
        batch=_one_call_per_batch(_primitive),
    )
