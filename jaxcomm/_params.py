"""The parameters of jaxcomm's operations: how each kind is checked.

An operation declares its parameters' kinds (`comm_primitive(params=...)`);
JaxComm checks what a caller passes against that declaration before anything is
traced or sent, so a bad root or tag is a Python exception on the rank that
passed it, never a hang in MPI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from mpi4py import MPI

from jaxcomm._ops import as_reduce_op

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


ROOT = rank()
DEST = rank(MPI.PROC_NULL)
SOURCE = rank(MPI.ANY_SOURCE, MPI.PROC_NULL)
TAG = tag()
RECEIVED_TAG = tag(MPI.ANY_TAG)
