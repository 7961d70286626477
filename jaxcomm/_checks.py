"""What a caller passes to an operation, checked as the operation declares it.

An operation declares its parameters' kinds (`comm_primitive(params=...)`: a
rank, a tag, a reduction op) and what its arrays must be (a dtype it can move or
reduce, a leading axis of length size). Every call is checked against that
declaration before anything is traced or sent, so a bad root, tag, dtype or
shape is a Python exception on the rank that passed it, never a hang in MPI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm._datatypes import DTYPES, VALID_DTYPES, ReduceOp, as_reduce_op
from jaxcomm._fusion import PerLeaf
from jaxcomm._jax_internals import ArrayImpl, at_top_level
from jaxcomm._placement import platforms

#: check(operation, name, value, size) -> the value to use, or an exception that
#: names the operation and the parameter.
Check = Callable[[str, str, Any, int], Any]


def _static_int(operation: str, name: str, value: Any) -> int:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{operation}: {name} must be a Python int fixed at trace time, got a traced "
            f"value; mark it static (e.g. jax.jit(..., static_argnames={name!r}))"
        )
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{operation}: {name} must be an int, got {type(value).__name__}")
    return int(value)


def rank(*wildcards: int) -> Check:
    """A rank of the communicator, or one of `wildcards` (MPI.PROC_NULL...)."""

    def check(operation: str, name: str, value: Any, size: int) -> int:
        rank = value if type(value) is int else _static_int(operation, name, value)
        if 0 <= rank < size or rank in wildcards:
            return rank
        raise ValueError(
            f"{operation}: {name}={rank} is out of range for a communicator of size {size}"
        )

    return check


# MPI_TAG_UB is only guaranteed on COMM_WORLD (Open MPI omits it on some derived
# communicators).
_TAG_UB: int = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)


def tag(*wildcards: int) -> Check:
    """A message tag from 0 to MPI_TAG_UB, or one of `wildcards` (MPI.ANY_TAG)."""

    def check(operation: str, name: str, value: Any, size: int) -> int:
        tag = value if type(value) is int else _static_int(operation, name, value)
        if 0 <= tag <= _TAG_UB or tag in wildcards:
            return tag
        raise ValueError(f"{operation}: {name}={tag} must be between 0 and {_TAG_UB}")

    return check


def reduce_op(operation: str, name: str, value: Any, size: int) -> Any:
    """A reduction: MPI.SUM, "sum", ReduceOp.SUM..."""
    try:
        return as_reduce_op(value)
    except ValueError as error:
        raise ValueError(f"{operation}: {error}") from None


def capacity(operation: str, name: str, value: Any, size: int) -> int:
    """A number of rows fixed at trace time (the leading axis of a result)."""
    rows = value if type(value) is int else _static_int(operation, name, value)
    if rows < 0:
        raise ValueError(f"{operation}: {name}={rows} must be at least 0")
    return rows


def _integers(value: Any) -> Any:
    """value as an array: Python ints as int64, or uint64 where they need it (NumPy
    would make [1, 2**64 - 1] floats); a list holding traced values as one."""
    if isinstance(value, list | tuple) and any(isinstance(v, jax.Array) for v in value):
        return jnp.stack([jnp.asarray(v) for v in value])
    array = np.asarray(value)
    # Python ints that NumPy made floats (or objects). Not a NumPy float array,
    # not even an empty one, which holds no int to tell: it stays floats, and is
    # refused as on a rank whose counts are not empty.
    floats = isinstance(value, np.ndarray | np.generic) and array.dtype.kind == "f"
    ints = not floats and all(type(v) is int for v in np.ravel(np.array(value, object)))
    if array.dtype.kind in "fO" and ints:
        for dtype in (np.int64, np.uint64):
            try:
                return np.array(value, dtype)
            except OverflowError:
                continue
    if array.dtype.kind in "iu" and not array.dtype.isnative:  # big-endian: read natively
        array = array.astype(array.dtype.newbyteorder("="))
    return array


def counts(operation: str, name: str, value: Any, size: int | None, per: str = "rank") -> Any:
    """Integer counts of any integer dtype: one per rank (shape (size,); or per
    `per`, a neighbour exchange's "destination" or "source"), or with size None
    one scalar. A jax.Array (it may be traced) stays one; anything else
    becomes a C-contiguous NumPy array, which an eager call reads where it is.
    Their values are validated where they are read, on every path
    (cpp/counts.h), so that a rank that refuses them still takes part."""
    if type(value) is ArrayImpl and value.is_deleted():
        raise _deleted(operation, name)
    what = "an integer scalar" if size is None else f"integers of shape ({size},), one per {per}"
    if isinstance(value, list | tuple) and any(isinstance(v, bool | np.bool_) for v in value):
        # NumPy would read True as 1 among ints.
        raise TypeError(f"{operation}: {name} must be {what}, got a bool among {value!r}")
    counts = value if isinstance(value, jax.Array) else _integers(value)
    if isinstance(counts, np.ndarray) and not counts.flags.c_contiguous:  # a view: copied
        counts = counts.copy(order="C")
    shape = () if size is None else (size,)
    if (
        counts.dtype == np.bool_
        or not jnp.issubdtype(counts.dtype, jnp.integer)
        or (counts.shape != shape)
    ):
        raise TypeError(
            f"{operation}: {name} must be {what}, got {counts.dtype}{list(counts.shape)}"
        )
    if isinstance(counts, np.ndarray) and not at_top_level():
        # A trace holds them in JAX's dtype (int32 without jax_enable_x64), which
        # would wrap values that do not fit.
        held = jax.dtypes.canonicalize_dtype(counts.dtype)
        if held != counts.dtype:
            if not np.array_equal(counts.astype(held), counts):
                raise ValueError(
                    f"{operation}: {name}={counts.tolist()} does not fit {held.name}, the "
                    "dtype a trace holds it in without jax_enable_x64"
                )
            counts = counts.astype(held)
    return counts


ROOT = rank()
DEST = rank(MPI.PROC_NULL)
SOURCE = rank(MPI.ANY_SOURCE, MPI.PROC_NULL)
TAG = tag()
RECEIVED_TAG = tag(MPI.ANY_TAG)


_SUPPORTED = frozenset(jnp.dtype(name) for name in DTYPES)
_REDUCIBLE = {
    op: frozenset(jnp.dtype(name) for name in names) for op, names in VALID_DTYPES.items()
}


def check_dtype(operation: str, dtype: np.dtype) -> None:
    """Raise TypeError if jaxcomm cannot transfer arrays of `dtype`."""
    if dtype not in _SUPPORTED:
        raise TypeError(
            f"{operation}: dtype {jnp.dtype(dtype).name} is not supported; "
            f"supported dtypes: {', '.join(DTYPES)}"
        )


def check_reduction(operation: str, op: ReduceOp, dtype: np.dtype) -> None:
    """Raise TypeError if `op` cannot reduce arrays of `dtype`."""
    if dtype in _REDUCIBLE[op]:
        return
    check_dtype(operation, dtype)
    name = jnp.dtype(dtype).name
    raise TypeError(
        f"{operation}: op={op.name} is not defined for dtype {name}; "
        f"{op.name} accepts {', '.join(VALID_DTYPES[op])}"
    )


def given(operation: str, x: Any) -> None:
    """x is something to send or a template, not None: mpi4py's methods take None
    where only the root's object is read, which as a pytree holds no array, so a
    rank would make no call while its peers wait in theirs."""
    if x is None:
        raise ValueError(
            f"{operation}: x is None; every rank passes an array or a pytree of arrays "
            "(where only the root's values are read, one of the same shape and dtype)"
        )


def arrays(operation: str, leaves: list[Any], op: ReduceOp | None = None) -> list[jax.Array]:
    """A pytree's `leaves` as arrays, if `operation` can move (or, with `op`,
    reduce) each one's dtype and they are on one platform."""
    leaves = [a if isinstance(a, jax.Array) else jnp.asarray(a) for a in leaves]
    for a in leaves:
        if op is None:
            check_dtype(operation, a.dtype)
        else:
            check_reduction(operation, op, a.dtype)
    if len(leaves) < 2:
        return leaves
    kinds = set().union(
        *(platforms(a.sharding) for a in leaves if not isinstance(a, jax.core.Tracer))
    )
    if len(kinds) > 1:
        raise ValueError(
            f"{operation}: the arrays are on different platforms "
            f"({', '.join(sorted(kinds))}); put them on one with jax.device_put"
        )
    return leaves


def _deleted(operation: str, name: str) -> RuntimeError:
    return RuntimeError(
        f"{operation}: {name} has been deleted (or donated to a jitted call): pass a live array"
    )


def rows(operation: str, x: Any) -> jax.Array:
    """x, the rows of a variable-size exchange (one array with a leading axis), as
    an array of a dtype jaxcomm can move."""
    if type(x) is ArrayImpl and x.shape and x.dtype in _SUPPORTED:  # as checked below
        if x.is_deleted():
            raise _deleted(operation, "x")
        return x
    if not isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, list)):
        raise TypeError(f"{operation}: x must be one array of rows, not a {type(x).__name__}")
    (x,) = arrays(operation, [x])
    if x.ndim == 0:
        raise ValueError(f"{operation}: x must have a leading axis of rows, got shape ()")
    return x


def receive_templates(sendbuf: Any, recvbuf: Any) -> tuple[Any, Any]:
    """The shape and dtype that sendrecv receives for each leaf of sendbuf (as
    PerLeaf params, or plain for one array): those of recvbuf's leaves, default
    sendbuf's own."""
    like = sendbuf if recvbuf is None else recvbuf
    if type(like) is ArrayImpl and type(sendbuf) is ArrayImpl:  # without flattening
        return like.shape, like.dtype
    flat, tree = jax.tree.flatten(like)
    flat = arrays("sendrecv", flat)
    if recvbuf is not None and tree != jax.tree.structure(sendbuf):
        raise ValueError(
            f"sendrecv: recvbuf's structure {tree} differs from sendbuf's "
            f"{jax.tree.structure(sendbuf)}"
        )
    return PerLeaf(a.shape for a in flat), PerLeaf(a.dtype for a in flat)
