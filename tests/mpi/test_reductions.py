"""allreduce, reduce, scan, exscan, reduce_scatter: values for every (op, dtype)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import (
    INVALID_CASES,
    REDUCTION_CASES,
    assert_values,
    expected_reduction,
    identity,
    rank_data,
)
from mpi4py import MPI

from jaxcomm import ReduceOp

MODES = ["eager", "jit"]


def run(mode, fn, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


def all_data(comm, shape, dtype):
    return [rank_data(r, shape, dtype) for r in range(comm.size)]


@pytest.mark.parametrize(("op", "dtype"), REDUCTION_CASES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_allreduce(comm, op, dtype, mode):
    data = all_data(comm, (3, 2), dtype)
    result = run(mode, lambda x: comm.allreduce(x, op=op), data[comm.rank])
    assert_values(result, expected_reduction(op, data))


@pytest.mark.parametrize(("op", "dtype"), REDUCTION_CASES, ids=str)
def test_scan_and_exscan(comm, op, dtype):
    data = all_data(comm, (4,), dtype)
    scanned = jax.jit(lambda x: comm.scan(x, op=op))(data[comm.rank])
    assert_values(scanned, expected_reduction(op, data[: comm.rank + 1]))
    excl = comm.exscan(data[comm.rank], op=op)
    if comm.rank == 0:
        assert_values(excl, np.broadcast_to(identity(op, dtype), (4,)))
    else:
        assert_values(excl, expected_reduction(op, data[: comm.rank]))


@pytest.mark.parametrize("root", ["first", "last"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["int32", "float64", "bfloat16", "complex64"])
def test_reduce(comm, root, mode, dtype):
    root = 0 if root == "first" else comm.size - 1
    data = all_data(comm, (2, 3), dtype)
    result = run(mode, lambda x: comm.reduce(x, op=MPI.SUM, root=root), data[comm.rank])
    expected = expected_reduction(ReduceOp.SUM, data) if comm.rank == root else data[comm.rank]
    assert_values(result, expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("op", "dtype"), [("sum", "float32"), ("max", "int16"), ("prod", "float16")]
)
def test_reduce_scatter(comm, mode, op, dtype):
    data = all_data(comm, (comm.size, 3), dtype)
    result = run(mode, lambda x: comm.reduce_scatter(x, op=op), data[comm.rank])
    assert_values(result, expected_reduction(ReduceOp[op.upper()], data)[comm.rank])


@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (5, 1)])
def test_shapes(comm, shape):
    data = all_data(comm, shape, "float32")
    assert_values(comm.allreduce(data[comm.rank]), expected_reduction(ReduceOp.SUM, data))
    assert_values(
        jax.jit(comm.exscan)(data[comm.rank]), sum(data[: comm.rank], np.zeros(shape, np.float32))
    )


def test_transposed_input(comm):
    x = jnp.asarray(rank_data(comm.rank, (3, 4), "float32")).T
    expected = expected_reduction(ReduceOp.SUM, [rank_data(r, (3, 4)).T for r in range(comm.size)])
    assert_values(jax.jit(comm.allreduce)(x), expected)
    assert_values(jax.jit(lambda a: comm.allreduce(a.T))(x.T), expected.T.T)


def test_op_spellings(comm):
    x = jnp.asarray(rank_data(comm.rank, (3,), "int32"))
    results = [comm.allreduce(x, op=o) for o in (MPI.MAX, "max", "MAX", ReduceOp.MAX)]
    for r in results[1:]:
        assert_values(r, results[0])


def test_pytree(comm):
    tree = {"a": rank_data(comm.rank, (2,), "float32"), "b": [rank_data(comm.rank, (3,), "int8")]}
    out = jax.jit(comm.allreduce)(tree)
    assert_values(out["a"], expected_reduction(ReduceOp.SUM, all_data(comm, (2,), "float32")))
    assert_values(out["b"][0], expected_reduction(ReduceOp.SUM, all_data(comm, (3,), "int8")))


@pytest.mark.parametrize(("op", "dtype"), INVALID_CASES, ids=str)
def test_invalid_op_for_dtype(comm, op, dtype):
    x = jnp.zeros(2, dtype)
    with pytest.raises(
        TypeError, match=rf"allreduce: op={op.name} is not defined for dtype {dtype}"
    ):
        jax.jit(lambda a: comm.allreduce(a, op=op))(x)


def test_bad_op(comm):
    with pytest.raises(ValueError, match="op='mean' is not a supported reduction"):
        comm.allreduce(jnp.zeros(2), op="mean")
    with pytest.raises(ValueError, match="not a supported reduction"):
        comm.allreduce(jnp.zeros(2), op=MPI.MAXLOC)


def test_reduce_scatter_wrong_leading_axis(comm):
    with pytest.raises(
        ValueError, match=r"reduce_scatter: x must have a leading axis of length size"
    ):
        comm.reduce_scatter(jnp.zeros((comm.size + 1, 2)))


@pytest.mark.parametrize("count", [3, 1003, (1 << 18) + 11])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX])
def test_allreduce_results_agree_bit_for_bit(comm, op, count):
    """Every rank gets the same bits, rounding included. (MPI's MAX and MIN of a
    NaN and a number depend on the order of the operands, so with NaNs the ranks
    may disagree: docs/autodiff.md, "What every rank must agree on".)"""
    x = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
    got = np.asarray(comm.allreduce(jnp.asarray(x), op=op))
    first = np.asarray(comm.bcast(jnp.asarray(got), root=0))
    np.testing.assert_array_equal(got.view(np.uint32), first.view(np.uint32))
