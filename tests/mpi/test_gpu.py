"""The operations on GPU arrays: the same values as on CPU, under jit, grad and
vmap. Runs only where jaxcomm has its CUDA handlers and JAX sees a GPU; skipped
otherwise (the development machine has none)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import COLLECTIVES, assert_values, rank_data
from mpi4py import MPI

import jaxcomm


def gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not jaxcomm.has_cuda_support(), reason="jaxcomm built without CUDA"),
    pytest.mark.skipif(not gpus(), reason="no GPU visible to JAX"),
]

OPS = COLLECTIVES
DTYPES = ["float32", "float64", "int32", "bfloat16", "complex64", "bool"]


def on_gpu(x):
    return jax.device_put(x, gpus()[0])


def arguments(comm, name, dtype):
    shape = (comm.size, 3)
    x = rank_data(comm.rank, shape, dtype)
    if name == "scatter" and comm.rank != 0:
        x = x[0]
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_same_values_as_cpu(comm, name, dtype, jit):
    if name in ("allreduce", "reduce", "scan", "exscan", "reduce_scatter") and dtype == "bool":
        pytest.skip("SUM is not defined for bool")
    x = arguments(comm, name, dtype)
    fn = getattr(comm, name)
    fn = jax.jit(fn) if jit else fn
    expected = np.asarray(fn(jnp.asarray(x)))  # CPU
    got = fn(on_gpu(x))
    assert got.devices() == {gpus()[0]}
    assert_values(np.asarray(got), expected)


# Results that jaxcomm's host code writes itself, not MPI: on the device in
# CUDA-aware mode, in the staging buffers otherwise.
WRITTEN_BY_JAXCOMM = {
    "exscan max (identity on rank 0)": lambda comm: lambda x: comm.exscan(x, op=MPI.MAX),
    "exscan prod float64": lambda comm: lambda x: comm.exscan(x.astype(jnp.float64), op=MPI.PROD),
    "allreduce land on int32 (0/1)": lambda comm: lambda x: comm.allreduce(x, op=MPI.LAND),
    "bcast (root's copy)": lambda comm: lambda x: comm.bcast(x, root=comm.size - 1),
    "reduce (other ranks' copy)": lambda comm: lambda x: comm.reduce(x, root=0),
    "sendrecv from PROC_NULL (zeros)": lambda comm: (
        lambda x: comm.sendrecv(x, source=MPI.PROC_NULL, dest=MPI.PROC_NULL)
    ),
}


@pytest.mark.parametrize("name", list(WRITTEN_BY_JAXCOMM))
def test_values_written_by_jaxcomm_on_gpu(comm, name):
    fn = jax.jit(WRITTEN_BY_JAXCOMM[name](comm))
    x = rank_data(comm.rank, (comm.size, 5), "int32")
    expected = np.asarray(fn(jnp.asarray(x)))  # CPU
    assert_values(np.asarray(fn(on_gpu(x))), expected)


def test_point_to_point_on_gpu(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    x = on_gpu(jnp.full((4,), comm.rank, jnp.float32))
    got = jax.jit(lambda v: comm.sendrecv(v, source=left, dest=right))(x)
    assert_values(np.asarray(got), np.full(4, left, np.float32))
    donated = jax.jit(lambda v: comm.sendrecv(v, source=left, dest=right), donate_argnums=0)
    assert_values(
        np.asarray(donated(on_gpu(np.full(4, comm.rank, np.float32)))), np.full(4, left, np.float32)
    )


def test_grad_and_vmap_on_gpu(comm):
    x = on_gpu(jnp.arange(3.0) + comm.rank)
    grad = jax.grad(lambda v: comm.allreduce(v * v).sum())(x)
    assert_values(np.asarray(grad), 2 * np.asarray(x))  # replicated cotangent convention
    batched = jax.vmap(comm.allreduce)(on_gpu(jnp.ones((5, 3)) * comm.rank))
    assert_values(np.asarray(batched), np.full((5, 3), sum(range(comm.size)), np.float32))


def test_mixed_cpu_and_gpu_arrays_are_an_error(comm):
    with pytest.raises(ValueError, match="allreduce: the arrays are on different platforms"):
        comm.allreduce({"a": jnp.ones(2), "b": on_gpu(jnp.ones(2))})
