"""Data-movement collectives: bcast, gather, allgather, scatter, alltoall, barrier,
and on a Cartesian grid or a distributed graph neighbor_allgather and
neighbor_alltoall.

bcast and allgather give every rank the same result: where it is one replicated
value, its cotangent is expected to be replicated (checked in checking mode),
else the cotangents are summed (jaxcomm._replicated.shared_cotangent). gather,
scatter and alltoall have rank-dependent results and exact adjoints.
"""

from __future__ import annotations

from typing import NamedTuple

from jax import core

from jaxcomm import _sharded
from jaxcomm._checks import ROOT
from jaxcomm._primitive import (
    CommInfo,
    asked_in_place,
    comm_primitive,
    off_root,
    on_root,
    same_shape,
)
from jaxcomm._replicated import shared_cotangent
from jaxcomm._rules import (
    batch_elementwise,
    define_rules,
    instantiate,
    linear_jvp,
    move_batch,
    on_rank,
)


def _stacked(x, *, comm: CommInfo, **_):
    return [core.ShapedArray((comm.size, *x.shape), x.dtype)]


def _gather_shape(x, *, comm: CommInfo, root: int):
    return _stacked(x, comm=comm) if comm.rank == root else same_shape(x)


def _scatter_shape(x, *, comm: CommInfo, root: int):
    return [core.ShapedArray(x.shape[1:] if comm.rank == root else x.shape, x.dtype)]


def _scatter_rows(comm: CommInfo, *, root: int) -> str | None:
    # Only the root's x has a row per rank; the others pass a template.
    return "x on the root rank" if comm.rank == root else None


_ROOT = {"root": ROOT}
# bcast's root and gather's other ranks return x as it is; the others get a
# buffer of their own, which MPI fills (x's would make XLA copy an x still used).
# bcast's and allgather's results are the same on every rank ("replicated").
bcast_p = comm_primitive(
    "bcast", same_shape, result_is_x=on_root, params=_ROOT, elementwise=True, vma="replicated"
)
gather_p = comm_primitive("gather", _gather_shape, result_is_x=off_root, params=_ROOT)
allgather_p = comm_primitive("allgather", _stacked, vma="replicated")
scatter_p = comm_primitive("scatter", _scatter_shape, params=_ROOT, leading_axis=_scatter_rows)
# MPI libraries' in-place alltoall is also slower: it exchanges through a
# temporary buffer, one peer at a time (MPICH's: up to 2x the out-of-place call).
alltoall_p = comm_primitive("alltoall", same_shape, aliases=asked_in_place, leading_axis="x")
barrier_p = comm_primitive("barrier", lambda **_: [])


class Neighborhood(NamedTuple):
    """A neighbour exchange's static facts: how many blocks arrive (one per
    source) and leave (one per destination), and the communicator over the
    reversed graph, whose exchange is the transpose (None: the communicator's
    own, as on a Cartesian grid, where each neighbour is a source and a
    destination in matching places)."""

    sources: int
    destinations: int
    reverse: CommInfo | None = None

    def reversed(self, comm: CommInfo) -> tuple[CommInfo, Neighborhood]:
        """The communicator and neighbourhood of the exchange that transposes one
        over `comm`: blocks go back the way they came."""
        if self.reverse is None:
            return comm, self
        return self.reverse, Neighborhood(self.destinations, self.sources, comm)


def _neighbor_blocks(x, *, neighborhood: Neighborhood, **_):
    return [core.ShapedArray((neighborhood.sources, *x.shape), x.dtype)]


def _neighbor_swap(x, *, neighborhood: Neighborhood, **_):
    return [core.ShapedArray((neighborhood.sources, *x.shape[1:]), x.dtype)]


# A block from each source, to each destination (MPI_Neighbor_*).
neighbor_allgather_p = comm_primitive("neighbor_allgather", _neighbor_blocks)
neighbor_alltoall_p = comm_primitive("neighbor_alltoall", _neighbor_swap)


def bcast(x, *, comm: CommInfo, root: int):
    """Root's x on every rank. Shape: x.shape."""
    return bcast_p.bind(x, comm=comm, root=root)[0]


def gather(x, *, comm: CommInfo, root: int):
    """On root, every rank's x stacked: (size, *x.shape); x unchanged elsewhere."""
    return gather_p.bind(x, comm=comm, root=root)[0]


def allgather(x, *, comm: CommInfo):
    """Every rank's x stacked, on every rank: (size, *x.shape)."""
    return allgather_p.bind(x, comm=comm)[0]


def scatter(x, *, comm: CommInfo, root: int):
    """Row `rank` of root's x (size, *s). Non-root ranks pass any array of shape s."""
    return scatter_p.bind(x, comm=comm, root=root)[0]


def alltoall(x, *, comm: CommInfo, in_place: bool = False):
    """Row i of the result is rank i's row `rank`. x: (size, *s), result (size, *s)."""
    return alltoall_p.bind(x, comm=comm, in_place=in_place)[0]


def neighbor_allgather(x, *, comm: CommInfo, neighborhood: Neighborhood):
    """Every source's x: (sources, *x.shape), block i from source i."""
    return neighbor_allgather_p.bind(x, comm=comm, neighborhood=neighborhood)[0]


def neighbor_alltoall(x, *, comm: CommInfo, neighborhood: Neighborhood):
    """Block j of x (destinations, *s) to destination j; block i of the result
    (sources, *s) from source i."""
    return neighbor_alltoall_p.bind(x, comm=comm, neighborhood=neighborhood)[0]


def neighbor_alltoall_transpose(ct, *, comm: CommInfo, neighborhood: Neighborhood):
    """The cotangent of neighbor_alltoall's x from its result's: each block goes
    back to the source it came from, into the block it left (the reversed graph)."""
    reverse, back = neighborhood.reversed(comm)
    return neighbor_alltoall(ct, comm=reverse, neighborhood=back)


def neighbor_allgather_transpose(ct, *, comm: CommInfo, neighborhood: Neighborhood):
    """The cotangent of neighbor_allgather's x: x went to every destination, each
    of which keeps it where the forward exchange put it; its cotangents come back
    and add up. Each rank's own: no replicated-value convention."""
    return neighbor_alltoall_transpose(ct, comm=comm, neighborhood=neighborhood).sum(axis=0)


# -- transposes ------------------------------------------------------------------------


def _bcast_transpose(cts, x, *, comm, root):
    ct = shared_cotangent(instantiate(cts[0]), comm=comm, operation="bcast")
    return [on_rank(comm.rank == root, ct)]


def _gather_transpose(cts, x, *, comm, root):
    ct = instantiate(cts[0])
    rows = scatter(ct, comm=comm, root=root)
    return [rows if comm.rank == root else rows + ct]


def _allgather_transpose(cts, x, *, comm):
    ct = shared_cotangent(instantiate(cts[0]), comm=comm, operation="allgather")
    return [_sharded.own_row(ct, comm)]


def _scatter_transpose(cts, x, *, comm, root):
    stacked = gather(instantiate(cts[0]), comm=comm, root=root)
    return [on_rank(comm.rank == root, stacked)]


def _alltoall_transpose(cts, x, *, comm, in_place=False):
    return [alltoall(instantiate(cts[0]), comm=comm, in_place=in_place)]


def _neighbor_allgather_transpose(cts, x, *, comm, neighborhood):
    return [neighbor_allgather_transpose(instantiate(cts[0]), comm=comm, neighborhood=neighborhood)]


def _neighbor_alltoall_transpose(cts, x, *, comm, neighborhood):
    return [neighbor_alltoall_transpose(instantiate(cts[0]), comm=comm, neighborhood=neighborhood)]


# -- batching: a rank axis stays leading so each rank's rows are contiguous -------------


def _gather_batch(args, dims, *, comm, root):
    (x,), (dim,) = args, dims
    return gather_p.bind(x, comm=comm, root=root), [dim + 1 if comm.rank == root else dim]


def _allgather_batch(args, dims, *, comm):
    (x,), (dim,) = args, dims
    return allgather_p.bind(x, comm=comm), [dim + 1]


def _scatter_batch(args, dims, *, comm, root):
    (x,), (dim,) = args, dims
    x = move_batch(x, dim, 1 if comm.rank == root else 0)
    return scatter_p.bind(x, comm=comm, root=root), [0]


def _alltoall_batch(args, dims, *, comm, in_place=False):
    (x,), (dim,) = args, dims
    return alltoall_p.bind(move_batch(x, dim, 1), comm=comm, in_place=in_place), [1]


def _neighbor_allgather_batch(args, dims, *, comm, neighborhood):
    (x,), (dim,) = args, dims
    return neighbor_allgather_p.bind(x, comm=comm, neighborhood=neighborhood), [dim + 1]


def _neighbor_alltoall_batch(args, dims, *, comm, neighborhood):
    (x,), (dim,) = args, dims
    x = move_batch(x, dim, 1)
    return neighbor_alltoall_p.bind(x, comm=comm, neighborhood=neighborhood), [1]


for _primitive, _transpose, _batch in [
    (bcast_p, _bcast_transpose, batch_elementwise(bcast_p)),
    (gather_p, _gather_transpose, _gather_batch),
    (allgather_p, _allgather_transpose, _allgather_batch),
    (scatter_p, _scatter_transpose, _scatter_batch),
    (alltoall_p, _alltoall_transpose, _alltoall_batch),
    (neighbor_allgather_p, _neighbor_allgather_transpose, _neighbor_allgather_batch),
    (neighbor_alltoall_p, _neighbor_alltoall_transpose, _neighbor_alltoall_batch),
]:
    define_rules(_primitive, jvp=linear_jvp(_primitive), transpose=_transpose, batch=_batch)
