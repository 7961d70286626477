"""Rank-derived test data and the values every op must produce from it."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (numpy arithmetic on bfloat16)
import numpy as np

from jaxcomm._datatypes import DTYPES, VALID_DTYPES, ReduceOp


def rank_data(rank: int, shape=(3, 2), dtype="float32") -> np.ndarray:
    """Small, exactly representable values that differ by rank and position."""
    n = int(np.prod(shape))
    index = np.arange(n).reshape(shape)
    dtype = jnp.dtype(dtype)
    if dtype == np.bool_:
        return (index + rank) % 3 != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return ((index % 4) + rank + 1 + 1j * (rank - index % 3)).astype(dtype)
    return ((index + 2 * rank) % 5 + 1).astype(dtype)


def expected_reduction(op: ReduceOp, arrays: list[np.ndarray]) -> np.ndarray:
    stack = np.stack(arrays)
    dtype = stack.dtype
    if dtype == np.bool_ or op in (ReduceOp.LAND, ReduceOp.LOR, ReduceOp.LXOR):
        if dtype == np.bool_ and op in (ReduceOp.BAND, ReduceOp.MIN):
            op = ReduceOp.LAND
        if dtype == np.bool_ and op in (ReduceOp.BOR, ReduceOp.MAX):
            op = ReduceOp.LOR
        if dtype == np.bool_ and op == ReduceOp.BXOR:
            op = ReduceOp.LXOR
        truth = stack != 0
        ufunc = {
            ReduceOp.LAND: np.logical_and,
            ReduceOp.LOR: np.logical_or,
            ReduceOp.LXOR: np.logical_xor,
        }[op]
        return ufunc.reduce(truth, axis=0).astype(dtype)
    ufunc = {
        ReduceOp.SUM: np.add,
        ReduceOp.PROD: np.multiply,
        ReduceOp.MAX: np.maximum,
        ReduceOp.MIN: np.minimum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    }[op]
    return ufunc.reduce(stack, axis=0).astype(dtype)


def identity(op: ReduceOp, dtype) -> np.ndarray:
    """What exscan gives on rank 0."""
    dtype = jnp.dtype(dtype)
    if dtype == np.bool_:
        return np.array(op in (ReduceOp.LAND, ReduceOp.BAND, ReduceOp.MIN))
    if op in (ReduceOp.PROD, ReduceOp.LAND):
        return np.array(1, dtype)
    if op == ReduceOp.BAND:
        return (
            np.array(-1).astype(dtype)
            if jnp.issubdtype(dtype, jnp.signedinteger)
            else np.array(np.iinfo(dtype).max, dtype)
        )
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        info = jnp.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype)
        if jnp.issubdtype(dtype, jnp.floating):
            return np.array(-np.inf if op == ReduceOp.MAX else np.inf, dtype)
        return np.array(info.min if op == ReduceOp.MAX else info.max, dtype)
    return np.array(0, dtype)


def expected_collective(
    name: str, rank: int, inputs: list[np.ndarray], *, root: int = 0, op: ReduceOp = ReduceOp.SUM
) -> np.ndarray:
    """What collective `name` gives on `rank` when rank r passes inputs[r]."""
    size = len(inputs)
    if name == "allreduce":
        return expected_reduction(op, inputs)
    if name == "reduce":
        return expected_reduction(op, inputs) if rank == root else inputs[rank]
    if name == "scan":
        return expected_reduction(op, inputs[: rank + 1])
    if name == "exscan":
        if rank == 0:
            return np.broadcast_to(identity(op, inputs[0].dtype), inputs[0].shape)
        return expected_reduction(op, inputs[:rank])
    if name == "bcast":
        return inputs[root]
    if name == "gather":
        return np.stack(inputs) if rank == root else inputs[rank]
    if name == "allgather":
        return np.stack(inputs)
    if name == "scatter":
        return inputs[root][rank]
    if name == "alltoall":
        return np.stack([inputs[r][rank] for r in range(size)])
    if name == "reduce_scatter":
        return expected_reduction(op, inputs)[rank]
    raise AssertionError(name)


def assert_values(actual, expected) -> None:
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if jnp.issubdtype(actual.dtype, jnp.inexact):
        # By the precision of the real part: complex64 rounds like float32. MPI
        # may combine ranks' values in another order than NumPy does.
        tol = {16: 1e-2, 32: 1e-5, 64: 1e-12}[jnp.finfo(actual.dtype).bits]
        np.testing.assert_allclose(
            actual.astype(np.complex128), expected.astype(np.complex128), rtol=tol
        )
    else:
        np.testing.assert_array_equal(actual, expected)


#: (op, dtype) pairs that must work, derived from the op table.
REDUCTION_CASES = [(op, dtype) for op in ReduceOp for dtype in VALID_DTYPES[op]]
#: (op, dtype) pairs that must be rejected at trace time.
INVALID_CASES = [
    (op, dtype) for op in ReduceOp for dtype in DTYPES if dtype not in VALID_DTYPES[op]
]

#: The collective operations with an array in and an array out.
COLLECTIVES = ("allreduce", "reduce", "scan", "exscan", "bcast", "gather", "allgather", "scatter",
               "alltoall", "reduce_scatter")  # fmt: skip

#: The default float dtype of jnp.zeros/jnp.ones in the test session.
FLOAT = jnp.zeros(()).dtype
