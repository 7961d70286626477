"""Reductions: allreduce, reduce, scan, exscan, reduce_scatter.

Each function takes one array and static arguments, checked by the JaxComm layer.
"""

from __future__ import annotations

from jax import core

from jaxcomm._ops import ReduceOp
from jaxcomm._primitive import CommInfo, comm_primitive, in_place, same_shape


def _row(x, **_):
    return [core.ShapedArray(x.shape[1:], x.dtype)]


allreduce_p = comm_primitive("allreduce", same_shape, attrs=("op",), aliases=in_place)
reduce_p = comm_primitive("reduce", same_shape, attrs=("op", "root"), aliases=in_place)
scan_p = comm_primitive("scan", same_shape, attrs=("op",), aliases=in_place)
exscan_p = comm_primitive("exscan", same_shape, attrs=("op",), aliases=in_place)
reduce_scatter_p = comm_primitive("reduce_scatter", _row, attrs=("op",))


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
