"""bcast, gather, allgather, scatter, alltoall: values and shapes on every rank."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import FLOAT, assert_values, rank_data

from jaxcomm._datatypes import DTYPES

MODES = ["eager", "jit"]


def run(mode, fn, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


def roots(comm):
    return sorted({0, comm.size - 1})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_bcast(comm, dtype, mode):
    for root in roots(comm):
        out = run(
            mode, lambda x, root=root: comm.bcast(x, root=root), rank_data(comm.rank, (2, 3), dtype)
        )
        assert_values(out, rank_data(root, (2, 3), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_gather(comm, dtype, mode):
    for root in roots(comm):
        mine = rank_data(comm.rank, (3,), dtype)
        out = run(mode, lambda x, root=root: comm.gather(x, root=root), mine)
        if comm.rank == root:
            assert_values(out, np.stack([rank_data(r, (3,), dtype) for r in range(comm.size)]))
        else:
            assert_values(out, mine)


@pytest.mark.parametrize("dtype", ["bool", "uint8", "float32", "bfloat16", "complex128"])
@pytest.mark.parametrize("mode", MODES)
def test_allgather(comm, dtype, mode):
    out = run(mode, comm.allgather, rank_data(comm.rank, (2, 2), dtype))
    assert_values(out, np.stack([rank_data(r, (2, 2), dtype) for r in range(comm.size)]))


@pytest.mark.parametrize("dtype", ["int64", "float32", "float16"])
@pytest.mark.parametrize("mode", MODES)
def test_scatter(comm, dtype, mode):
    for root in roots(comm):
        full = np.stack([rank_data(10 + r, (2,), dtype) for r in range(comm.size)])
        x = full if comm.rank == root else np.zeros((2,), dtype)
        out = run(mode, lambda a, root=root: comm.scatter(a, root=root), x)
        assert_values(out, full[comm.rank])


@pytest.mark.parametrize("dtype", ["int32", "float64", "bool"])
@pytest.mark.parametrize("mode", MODES)
def test_alltoall(comm, dtype, mode):
    def block(src, dst):  # what rank src sends to rank dst
        return rank_data(100 * src + dst, (2,), dtype)

    x = np.stack([block(comm.rank, d) for d in range(comm.size)])
    out = run(mode, comm.alltoall, x)
    assert_values(out, np.stack([block(s, comm.rank) for s in range(comm.size)]))


def test_zero_size_and_scalar(comm):
    assert_values(comm.bcast(jnp.zeros((0, 3)), root=0), np.zeros((0, 3), FLOAT))
    assert_values(
        jax.jit(comm.allgather)(jnp.float32(comm.rank)), np.arange(comm.size, dtype=np.float32)
    )


@pytest.mark.parametrize("name", ["bcast", "gather", "scatter", "reduce"])
def test_root_out_of_range(comm, name):
    with pytest.raises(ValueError, match=rf"{name}: root={comm.size} is out of range"):
        getattr(comm, name)(jnp.zeros(2), root=comm.size)
    with pytest.raises(ValueError, match=rf"{name}: root=-1 is out of range"):
        getattr(comm, name)(jnp.zeros(2), root=-1)


def test_traced_root(comm):
    with pytest.raises(TypeError, match="bcast: root must be a Python int fixed at trace time"):
        jax.jit(lambda x, r: comm.bcast(x, root=r))(jnp.zeros(2), 0)
    with pytest.raises(TypeError, match="bcast: root must be an int, got float"):
        comm.bcast(jnp.zeros(2), root=0.0)


def test_wrong_leading_axis(comm):
    with pytest.raises(ValueError, match="alltoall: x must have a leading axis of length size"):
        comm.alltoall(jnp.zeros((comm.size + 1,)))
    with pytest.raises(ValueError, match="alltoall: x must have a leading axis"):
        comm.alltoall(jnp.float32(1))
    if comm.rank == 0:  # only the root's input is checked; no collective starts
        with pytest.raises(
            ValueError, match="scatter: x on the root rank must have a leading axis"
        ):
            comm.scatter(jnp.zeros((comm.size + 2, 2)), root=0)


def test_unsupported_dtype(comm):
    with pytest.raises(TypeError, match="bcast: dtype float8_e4m3fn is not supported"):
        comm.bcast(jnp.zeros(2, jnp.float8_e4m3fn))
