"""The operations on GPU arrays: the same values as on CPU, under jit, grad and
vmap. Runs only where jaxcomm has its CUDA handlers and JAX sees a GPU; skipped
otherwise (the development machine has none)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import COLLECTIVES, FLOAT, assert_values, rank_data
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


def on_cpu(x):
    """x committed to the host: the reference run (JAX's default device is the GPU)."""
    return jax.device_put(x, jax.devices("cpu")[0])


def assert_same_on_gpu(got, expected):
    """Every leaf of got is on the GPU and equals its leaf of expected."""
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for leaf, reference in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert leaf.devices() == {gpus()[0]}
        assert_values(np.asarray(leaf), np.asarray(reference))


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
    assert_same_on_gpu(fn(on_gpu(x)), fn(on_cpu(x)))


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
    assert_same_on_gpu(fn(on_gpu(x)), fn(on_cpu(x)))


# The variable-size and neighbour exchanges, each a function of x (2 * size + 2, 3).
# Counts are NumPy arrays, which follow x to its device.
EXCHANGES = (
    "alltoallv", "alltoallv with recv_counts", "allgatherv", "gatherv", "scatterv",
    "graph neighbor_allgather", "graph neighbor_alltoall", "graph neighbor_allgatherv",
    "graph neighbor_alltoallv", "grid neighbor_alltoallv", "halo_exchange", "grad of alltoallv",
)  # fmt: skip


@pytest.fixture(scope="module")
def exchanges(comm):
    n, rank = comm.size, comm.rank
    # Two edges out and in per rank: repeated edges and self-loops on 1 and 2 ranks.
    graph = comm.create_dist_graph(
        [(rank - 1) % n, (rank - 2) % n], [(rank + 1) % n, (rank + 2) % n]
    )
    grid = comm.create_cart([n], periods=[False])
    counts = np.array([(rank + r) % 3 for r in range(n)], np.int32)  # at most 2 rows each
    received = np.array([(r + rank) % 3 for r in range(n)], np.int32)
    capacity = 2 * n + 1

    def alltoallv_loss(x):
        return (comm.alltoallv(x, counts, capacity=capacity)[0] ** 2).sum()

    calls = {
        "alltoallv": lambda x: comm.alltoallv(x, counts, capacity=capacity),
        "alltoallv with recv_counts": (
            lambda x: comm.alltoallv(x, counts, capacity=capacity, recv_counts=received)
        ),
        "allgatherv": lambda x: comm.allgatherv(x, capacity=capacity, count=rank % 3),
        "gatherv": lambda x: comm.gatherv(x, n - 1, capacity=capacity, count=rank % 3),
        "scatterv": lambda x: comm.scatterv(x, counts if rank == 0 else None, capacity=capacity),
        "graph neighbor_allgather": graph.neighbor_allgather,
        "graph neighbor_alltoall": lambda x: graph.neighbor_alltoall(x[:2]),
        "graph neighbor_allgatherv": (
            lambda x: graph.neighbor_allgatherv(x, capacity=2 * n, count=n - rank % 2)
        ),
        "graph neighbor_alltoallv": (
            lambda x: graph.neighbor_alltoallv(x, np.array([1, 2]), capacity=4)
        ),
        "grid neighbor_alltoallv": (
            lambda x: grid.neighbor_alltoallv(x, np.array([2, 1]), capacity=4)
        ),
        "halo_exchange": lambda x: grid.halo_exchange(x, axis=0),
        "grad of alltoallv": jax.grad(alltoallv_loss),
    }
    assert tuple(calls) == EXCHANGES
    yield calls
    graph.free()
    grid.free()


@pytest.mark.parametrize("name", EXCHANGES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_exchanges_same_values_as_cpu(comm, exchanges, name, jit):
    fn = jax.jit(exchanges[name]) if jit else exchanges[name]
    x = rank_data(comm.rank, (2 * comm.size + 2, 3), "float32")
    assert_same_on_gpu(fn(on_gpu(x)), fn(on_cpu(x)))


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
    assert_values(np.asarray(batched), np.full((5, 3), sum(range(comm.size)), FLOAT))


def test_mixed_cpu_and_gpu_arrays_are_an_error(comm):
    with pytest.raises(ValueError, match="allreduce: the arrays are on different platforms"):
        comm.allreduce({"a": on_cpu(jnp.ones(2)), "b": on_gpu(jnp.ones(2))})


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_posted_operations_refuse_gpu_arrays(comm, jit):
    def posted(v):
        return comm.wait(comm.iallreduce(v))

    fn = jax.jit(posted) if jit else posted
    # Eagerly and jitted, the error names the operation.
    with pytest.raises(
        NotImplementedError, match=r"^iallreduce: .*non-blocking operations (take|run on) host"
    ):
        fn(on_gpu(jnp.ones(3)))
