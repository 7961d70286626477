"""Data-movement collectives: bcast, gather, allgather, scatter, alltoall."""

from __future__ import annotations

from jax import core

from jaxcomm._primitive import CommInfo, comm_primitive, in_place, same_shape


def _stacked(x, *, comm: CommInfo, **_):
    return [core.ShapedArray((comm.size, *x.shape), x.dtype)]


def _gather_shape(x, *, comm: CommInfo, root: int):
    return _stacked(x, comm=comm) if comm.rank == root else same_shape(x)


def _scatter_shape(x, *, comm: CommInfo, root: int):
    return [core.ShapedArray(x.shape[1:] if comm.rank == root else x.shape, x.dtype)]


bcast_p = comm_primitive("bcast", same_shape, attrs=("root",), aliases=in_place)
gather_p = comm_primitive("gather", _gather_shape, attrs=("root",))
allgather_p = comm_primitive("allgather", _stacked)
scatter_p = comm_primitive("scatter", _scatter_shape, attrs=("root",))
alltoall_p = comm_primitive("alltoall", same_shape)


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


def alltoall(x, *, comm: CommInfo):
    """Row i of the result is rank i's row `rank`. x: (size, *s), result (size, *s)."""
    return alltoall_p.bind(x, comm=comm)[0]
