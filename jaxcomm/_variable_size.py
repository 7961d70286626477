"""Variable-size exchanges: alltoallv, allgatherv, gatherv and scatterv, and the
neighbour exchanges; their non-blocking forms are jaxcomm._nonblocking's.

Rows of x (its leading axis) travel, as many as int32 count operands say; the
counts may be traced and change from call to call, and only the result's
capacity (its rows) is static. Each primitive returns the counts received beside
the rows. With `exchange` the call first learns them from the senders (one small
collective); the AD rules pass the counts already known (exchange=MIRRORED), so a
tangent or cotangent costs one exchange of rows only.

All four are linear in x and the counts carry no tangent. Adjoints: alltoallv's
is an alltoallv back with the counts swapped; gatherv's a scatterv and
scatterv's a gatherv; allgatherv's result is the same on every rank, so, as for
allgather, each rank takes its own rows of its cotangent, which is expected to
be replicated where the result is one value, else summed over ranks
(jaxcomm._replicated.shared_cotangent).

neighbor_alltoallv and neighbor_allgatherv exchange rows with the sources and
destinations of a graph or Cartesian grid (MPI_Neighbor_*). Their adjoints go
back over the reversed graph (Neighborhood.reversed), with the counts swapped:
neighbor_allgatherv's results differ per rank, so each copy of x's rows sends its
cotangent back to x's rank, where they add up.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.interpreters import ad

from jaxcomm._collectives import (
    Neighborhood,
    allgather,
    alltoall,
    gather,
    neighbor_allgather,
    neighbor_alltoall,
    scatter,
)
from jaxcomm._primitive import CommInfo, comm_primitive
from jaxcomm._replicated import shared_cotangent
from jaxcomm._rules import (
    define_rules,
    differentiable,
    instantiate,
    same_program,
    zero_tangent,
)


def batch_of(counts, unbatched: int) -> tuple[int, ...]:
    """The batch axis (vmap's, all of its members in one call) that a count
    operand of `unbatched` dimensions carries ahead of them: () or (members,)."""
    shape = (counts.aval if ad.is_undefined_primal(counts) else counts).shape
    return tuple(shape[: len(shape) - unbatched])


def rows_of(x, counts, unbatched: int) -> int:
    """How many rows x (a primal or an undefined one, in a transpose) has, past the
    batch axis that its count operand `counts` carries."""
    shape = (x.aval if ad.is_undefined_primal(x) else x).shape
    return shape[len(batch_of(counts, unbatched))]


def _result_shapes(unbatched: tuple[int, int], rows_on_root_only: bool):
    """Abstract evaluation of a variable-size exchange whose count operands (sent,
    received) have `unbatched` dimensions past any batch axis (batch_of): the
    rows received, `capacity` of them (none off the root where only the root
    receives), and the counts received, shaped as their operand is: one per rank,
    or per source over a neighbourhood, or one."""
    sent_dims, received_dims = unbatched

    def shapes(x, sent, received, *, comm, capacity, root=None, neighborhood=None, **_):
        batch = batch_of(sent, sent_dims)
        if rows_on_root_only and comm.rank != root:
            capacity = 0
        rows = core.ShapedArray((*batch, capacity, *x.shape[len(batch) + 1 :]), x.dtype)
        peers = comm.size if neighborhood is None else neighborhood.sources
        counts = core.ShapedArray((*batch, peers) if received_dims else batch, np.int32)
        return [rows, counts]

    return shapes


@functools.cache
def no_counts(size: int) -> np.ndarray:
    """The received-counts operand of a call that exchanges them (its values unused)."""
    return np.zeros(size, np.int32)


#: `exchange`: the counts received are the caller's (trusted), learnt from the
#: senders first, or the AD rules', from an exchange made before: the same
#: exchange again (a tangent's) or back (an adjoint's; REGATHERED: a
#: neighbor_allgatherv's, given its one count). See cpp/variable_size.cc.
GIVEN, EXCHANGED, MIRRORED, REVERSED, REGATHERED = 0, 1, 2, 3, 4


def _rank_rows(counts, rank: int, rows: int):
    """Where rank `rank`'s rows start among those of all ranks, in rank order,
    and which of `rows` rows are its."""
    rank = same_program(np.int32(rank))  # one program on every rank (same_program)
    start = jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < rank, counts, 0))
    return start + jnp.arange(rows), jnp.arange(rows) < counts[rank]


def _own_rows(ct, counts, *, rank: int, like):
    """Rank `rank`'s rows of ct (its rows from every rank, `counts` of each), where
    it has them, else zeros: an array like `like` (x)."""
    index, keep = _rank_rows(counts, rank, like.shape[0])
    if ct.shape[0] == 0:  # no rows arrived (capacity 0): none are x's
        return jnp.zeros(like.shape, like.dtype)
    taken = jnp.take(ct, index, axis=0, mode="fill", fill_value=0)
    return jnp.where(keep.reshape(-1, *[1] * (len(like.shape) - 1)), taken, 0).astype(like.dtype)


def _to_ranks(counts):
    """Counts with their rank axis (last) first, as the collectives move rows."""
    return jnp.moveaxis(counts, -1, 0)


def received_counts(sent, comm: CommInfo):
    """The counts of an alltoallv's rows each rank received, learnt from what every
    rank sent (one alltoall): for an adjoint transposed as written."""
    return jnp.moveaxis(alltoall(_to_ranks(sent), comm=comm), 0, -1)


def learnt_counts(operation: str, sent, received, *, comm: CommInfo, **params):
    """The counts that exchange `operation` (made with exchange=EXCHANGED) received,
    learnt again from the counts `sent` (one small collective): for an adjoint
    transposed as written (jax.linear_transpose), where what arrived is not known.
    `received` is the operand in its place, which ranks that learn nothing keep."""
    if operation == "alltoallv":
        return received_counts(sent, comm)
    if operation == "neighbor_alltoallv":
        return neighbor_received_counts(sent, comm, params["neighborhood"])
    if operation == "allgatherv":
        return jnp.moveaxis(allgather(sent, comm=comm), 0, -1)
    if operation == "neighbor_allgatherv":
        gathered = neighbor_allgather(sent, comm=comm, neighborhood=params["neighborhood"])
        return jnp.moveaxis(gathered, 0, -1)
    root = params["root"]
    if operation == "gatherv":  # every rank takes part; the root learns the counts
        gathered = jnp.moveaxis(gather(sent, comm=comm, root=root), 0, -1)
        return gathered if comm.rank == root else received
    # scatterv: the root's counts; the other ranks pass a template
    mine = _to_ranks(sent) if comm.rank == root else sent[..., 0]
    return scatter(mine, comm=comm, root=root)


def _alltoallv_transpose(cts, x, send, recv, *, comm, capacity, exchange, agree):
    if exchange == EXCHANGED:  # transposed as written (jax.linear_transpose): learn what arrived
        recv = learnt_counts("alltoallv", send, recv, comm=comm)
    back, _ = alltoallv_p.bind(
        instantiate(cts[0]),
        recv,
        send,
        comm=comm,
        capacity=rows_of(x, send, 1),
        exchange=REVERSED,
        agree=False,
    )
    return [back, None, None]


def _allgatherv_transpose(cts, x, count, counts, *, comm, capacity, exchange, agree):
    if exchange == EXCHANGED:
        counts = learnt_counts("allgatherv", count, counts, comm=comm)
    ct = shared_cotangent(instantiate(cts[0]), comm=comm, operation="allgatherv")
    batch = batch_of(count, 0)
    like = core.ShapedArray(x.aval.shape[len(batch) :], x.aval.dtype)
    own = partial(_own_rows, rank=comm.rank, like=like)
    for _ in batch:  # each batch member takes its own rows
        own = jax.vmap(own)
    return [own(ct, counts), None, None]


def _gatherv_transpose(cts, x, count, counts, *, comm, root, capacity, exchange, agree):
    if exchange == EXCHANGED:
        counts = learnt_counts("gatherv", count, counts, comm=comm, root=root)
    back, _ = scatterv_p.bind(
        instantiate(cts[0]),
        counts,
        count,
        comm=comm,
        root=root,
        capacity=rows_of(x, count, 0),
        exchange=REVERSED,
        agree=False,
    )
    return [back, None, None]


def _scatterv_transpose(cts, x, counts, count, *, comm, root, capacity, exchange, agree):
    if exchange == EXCHANGED:
        count = learnt_counts("scatterv", counts, count, comm=comm, root=root)
    rows = rows_of(x, counts, 1)
    back, _ = gatherv_p.bind(
        instantiate(cts[0]),
        count,
        counts,
        comm=comm,
        root=root,
        capacity=rows if comm.rank == root else 0,
        exchange=REVERSED,
        agree=False,
    )
    if comm.rank != root:  # x is not read off the root: no cotangent
        back = jnp.zeros(x.aval.shape, back.dtype)
    return [back, None, None]


def neighbor_received_counts(sent, comm: CommInfo, neighborhood: Neighborhood):
    """The counts of a neighbor_alltoallv's rows this rank received, learnt from
    what its sources sent (one neighbor_alltoall)."""
    moved = neighbor_alltoall(_to_ranks(sent), comm=comm, neighborhood=neighborhood)
    return jnp.moveaxis(moved, 0, -1)


def _neighbor_alltoallv_transpose(
    cts, x, send, recv, *, comm, neighborhood, capacity, exchange, agree
):
    # Each source's rows go back to it over the reversed graph (on a grid, the
    # grid itself), with the counts swapped.
    if exchange == EXCHANGED:
        recv = learnt_counts("neighbor_alltoallv", send, recv, comm=comm, neighborhood=neighborhood)
    if exchange == REGATHERED:  # one count, from every source
        recv = jnp.broadcast_to(jnp.expand_dims(recv, -1), (*recv.shape, neighborhood.sources))
    reverse, back = neighborhood.reversed(comm)
    rows, _ = neighbor_alltoallv_p.bind(
        instantiate(cts[0]),
        recv,
        send,
        comm=reverse,
        neighborhood=back,
        capacity=rows_of(x, send, 1),
        exchange=REVERSED,
        agree=False,
    )
    return [rows, None, None]


def _summed_blocks(y, count, *, blocks: int, like):
    """The sum of `blocks` blocks of `count` rows each, packed in y one after the
    other, as an array like `like` (x): its first `count` rows, then zeros."""
    rows = like.shape[0]
    if blocks == 0 or rows == 0:
        return jnp.zeros(like.shape, like.dtype)
    # An index, whatever the count's dtype (a NumPy uint64 does not mix with
    # JAX's): a count refused (beyond int32, or x's rows) brought no rows back, so
    # y is zeros wherever it points.
    count = jnp.clip(jnp.asarray(count).astype(jnp.int32), 0, rows)
    index = jnp.arange(rows)
    total = sum(
        jnp.take(y, j * count + index, axis=0, mode="fill", fill_value=0) for j in range(blocks)
    )
    keep = (index < count).reshape(-1, *[1] * (len(like.shape) - 1))
    return jnp.where(keep, total, 0).astype(like.dtype)


def _neighbor_allgatherv_transpose(
    cts, x, count, counts, *, comm, neighborhood, capacity, exchange, agree
):
    # x's rows went to every destination: each sends back the cotangent of the
    # copy it holds (a neighbor_alltoallv over the reversed graph, count rows from
    # each), and they add up. Each rank's own: no replicated-value convention.
    # The count goes as it is (REGATHERED), checked there as here: a rank without
    # destinations, to which nothing comes back, still reports an invalid one.
    if exchange == EXCHANGED:
        counts = learnt_counts(
            "neighbor_allgatherv", count, counts, comm=comm, neighborhood=neighborhood
        )
    reverse, back = neighborhood.reversed(comm)
    batch = batch_of(count, 0)
    rows = rows_of(x, count, 0)
    blocks = neighborhood.destinations
    y, _ = neighbor_alltoallv_p.bind(
        instantiate(cts[0]),
        counts,
        count,
        comm=reverse,
        neighborhood=back,
        capacity=max(blocks, 1) * rows,  # (the unused block of no destinations: x's rows)
        exchange=REGATHERED,
        agree=False,
    )
    like = core.ShapedArray(x.aval.shape[len(batch) :], x.aval.dtype)
    summed = partial(_summed_blocks, blocks=blocks, like=like)
    for _ in batch:  # each batch member sums its own blocks
        summed = jax.vmap(summed)
    return [summed(y, count), None, None]


def _rows_travel_as_x(primitive, agree: bool):
    """JVP of a variable-size exchange: the tangent's rows travel as x's did, with
    the counts received (operand 2) now known, so not exchanged again. With
    `agree`, the primal exchange makes a rank's error (an invalid count, an
    overflow) every rank's before any row moves: the tangent's exchange, or the
    cotangent's it becomes, may run in another computation (jax.vjp,
    jax.linearize), or never, and the failed rank must not keep a wrong result
    meanwhile, nor its peers wait for it there."""

    def jvp(primals, tangents, **params):
        if not differentiable(primals[0]):  # x's dtype is the same on every rank
            y, got = primitive.bind(*primals, **params)
            return [y, got], [zero_tangent(y), zero_tangent(got)]
        y, got = primitive.bind(*primals, **{**params, "agree": agree})
        sent = primals[1]
        dy, _ = primitive.bind(
            instantiate(tangents[0]), sent, got, **{**params, "exchange": MIRRORED}
        )
        return [y, got], [dy, zero_tangent(got)]

    return jvp


def batch_first(args, dims, unbatched: tuple[int, ...]):
    """vmap of a variable-size exchange, as one call for the whole batch whatever
    is batched: x (args[0]) and every count operand (of `unbatched` dimensions
    each) with the batch axis first, broadcast where they do not vary across it,
    so that every rank of a batched call makes the same MPI calls, whichever of its
    operands vary. An operation batched already (a nested vmap) takes the new axis
    into its batch. Returns the operands and `restore`, which gives a result of
    the call back the nested batch's axes."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    x, *counts = (batch_first_or_broadcast(a, d, size) for a, d in zip(args, dims, strict=True))
    inner = counts[0].shape[1 : counts[0].ndim - unbatched[0]]  # a nested vmap's batch
    if not inner:
        return [x, *counts], lambda out: out
    operands = [a.reshape(-1, *a.shape[2:]) for a in (x, *counts)]
    return operands, lambda out: out.reshape(size, *inner, *out.shape[1:])


def _one_call_per_batch(primitive, unbatched: tuple[int, int]):
    """vmap: one call for the whole batch (batch_first)."""

    def rule(args, dims, **params):
        operands, restore = batch_first(args, dims, unbatched)
        return [restore(out) for out in primitive.bind(*operands, **params)], [0, 0]

    return rule


def batch_first_or_broadcast(a, dim, size: int):
    """a with the vmap batch axis first: moved there, or, where a does not vary
    across the batch (dim None), broadcast."""
    if dim is not None:
        return jnp.moveaxis(a, dim, 0)
    return jnp.broadcast_to(a, (size, *a.shape))


class Exchange(NamedTuple):
    """A variable-size exchange, declared once (_declare): its primitive and what
    drives its rules, and its non-blocking form's (jaxcomm._nonblocking)."""

    primitive: Any
    transpose: Any
    unbatched: tuple[int, int]  # the dimensions of its count operands, unbatched
    # Whether an error of its can be one rank's alone: under a derivative its
    # primal exchange then agrees on it (`agree`). allgatherv's is every rank's
    # already: its exchange of counts carries every rank's capacity.
    errors_alone: bool


def _declare(
    operation: str,
    transpose,
    unbatched: tuple[int, int],
    errors_alone: bool,
    rows_on_root_only=False,
    vma="varying",
) -> Exchange:
    """Exchange `operation`, with its primitive, whose results' shapes follow from
    its count operands' dimensions (_result_shapes)."""
    shapes = _result_shapes(unbatched, rows_on_root_only)
    primitive = comm_primitive(operation, shapes, vma=vma)
    return Exchange(primitive, transpose, unbatched, errors_alone)


# Operands: x, the counts this rank sends, then the counts it receives (used
# when not `exchange`). Results: the rows received, then their counts. Under
# vmap, each has a leading batch axis (batch_of): one call for the whole batch.
EXCHANGES: dict[str, Exchange] = {
    e.primitive.operation: e
    for e in [
        _declare("alltoallv", _alltoallv_transpose, (1, 1), True),
        # Every rank receives the same rows.
        _declare("allgatherv", _allgatherv_transpose, (0, 1), False, vma="replicated"),
        _declare("gatherv", _gatherv_transpose, (0, 1), True, rows_on_root_only=True),
        _declare("scatterv", _scatterv_transpose, (1, 0), True),
        # The same over a graph's or grid's neighbours (param `neighborhood`): counts
        # one per destination sent, one per source received, in their order.
        _declare("neighbor_alltoallv", _neighbor_alltoallv_transpose, (1, 1), True),
        _declare("neighbor_allgatherv", _neighbor_allgatherv_transpose, (0, 1), True),
    ]
}
alltoallv_p = EXCHANGES["alltoallv"].primitive
allgatherv_p = EXCHANGES["allgatherv"].primitive
gatherv_p = EXCHANGES["gatherv"].primitive
scatterv_p = EXCHANGES["scatterv"].primitive
neighbor_alltoallv_p = EXCHANGES["neighbor_alltoallv"].primitive
neighbor_allgatherv_p = EXCHANGES["neighbor_allgatherv"].primitive

for _e in EXCHANGES.values():
    define_rules(
        _e.primitive,
        jvp=_rows_travel_as_x(_e.primitive, _e.errors_alone),
        transpose=_e.transpose,
        batch=_one_call_per_batch(_e.primitive, _e.unbatched),
    )
