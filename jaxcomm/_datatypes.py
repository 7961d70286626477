"""The dtypes jaxcomm moves and the reduction operators, with the dtypes each
one accepts (cpp/datatypes.h maps both to MPI's).

This table drives argument checking (jaxcomm._checks), the C++ operator number (ReduceOp's value,
mirrored by jaxcomm::ReduceOp in jaxcomm.h) and the tests.
"""

from __future__ import annotations

import enum

from mpi4py import MPI


class ReduceOp(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    LAND = 4
    LOR = 5
    LXOR = 6
    BAND = 7
    BOR = 8
    BXOR = 9


BOOL = ("bool",)
INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
FLOATS = ("float16", "bfloat16", "float32", "float64")
COMPLEX = ("complex64", "complex128")
#: Every dtype jaxcomm moves; each op accepts the kinds listed in VALID_DTYPES.
DTYPES = BOOL + INTEGERS + FLOATS + COMPLEX

_ARITHMETIC = INTEGERS + FLOATS + COMPLEX
_LOGICAL = BOOL + INTEGERS
VALID_DTYPES: dict[ReduceOp, tuple[str, ...]] = {
    ReduceOp.SUM: _ARITHMETIC,
    ReduceOp.PROD: _ARITHMETIC,
    ReduceOp.MAX: BOOL + INTEGERS + FLOATS,
    ReduceOp.MIN: BOOL + INTEGERS + FLOATS,
    ReduceOp.LAND: _LOGICAL,
    ReduceOp.LOR: _LOGICAL,
    ReduceOp.LXOR: _LOGICAL,
    ReduceOp.BAND: _LOGICAL,
    ReduceOp.BOR: _LOGICAL,
    ReduceOp.BXOR: _LOGICAL,
}

_FROM_MPI = [(getattr(MPI, op.name), op) for op in ReduceOp]  # MPI.Op is unhashable


def as_reduce_op(op: MPI.Op | str | ReduceOp) -> ReduceOp:
    """Accept MPI.SUM, "sum", "SUM" or ReduceOp.SUM."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    elif isinstance(op, MPI.Op):
        for mpi_op, ours in _FROM_MPI:
            if op == mpi_op:
                return ours
    names = ", ".join(o.name.lower() for o in ReduceOp)
    raise ValueError(f"op={op!r} is not a supported reduction; use an MPI.Op or one of: {names}")
