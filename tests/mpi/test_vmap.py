"""vmap of every op: the same values as a Python loop, in ONE MPI call per op."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from jaxcomm._native import cpu

BATCH = 3


def ring(comm):
    return {"source": (comm.rank - 1) % comm.size, "dest": (comm.rank + 1) % comm.size}


def send_recv_pairs(comm, x):
    r, n = comm.rank, comm.size
    if r % 2 == 0 and r + 1 < n:
        comm.send(x, dest=r + 1)
        return x
    if r % 2 == 1:
        return comm.recv(x, source=r - 1) + x
    return x


#: name -> function of (comm, x) with x of shape (size, 2) per batch element.
CASES = {
    "allreduce": lambda c, x: c.allreduce(x),
    "allreduce_max": lambda c, x: c.allreduce(x, op=MPI.MAX),
    "reduce": lambda c, x: c.reduce(x, root=c.size - 1),
    "scan": lambda c, x: c.scan(x),
    "exscan": lambda c, x: c.exscan(x, op=MPI.PROD),
    "reduce_scatter": lambda c, x: c.reduce_scatter(x),
    "bcast": lambda c, x: c.bcast(x, root=c.size - 1),
    "gather": lambda c, x: c.gather(x, root=0),
    "allgather": lambda c, x: c.allgather(x),
    "scatter": lambda c, x: c.scatter(x if c.rank == 0 else x[0], root=0),
    "alltoall": lambda c, x: c.alltoall(x),
    "alltoallv": lambda c, x: c.alltoallv(
        x, [(c.rank + d) % 2 for d in range(c.size)], capacity=c.size
    )[0],
    "ialltoallv": lambda c, x: c.wait(
        c.ialltoallv(x, [(c.rank + d) % 2 for d in range(c.size)], capacity=c.size)
    )[0],
    "allgatherv": lambda c, x: c.allgatherv(x, capacity=2 * c.size, count=1)[0],
    "gatherv": lambda c, x: c.gatherv(x, 0, capacity=c.size * c.size)[0],
    "scatterv": lambda c, x: c.scatterv(x, [1] * c.size if c.rank == 0 else None, 0, capacity=2)[0],
    "sendrecv": lambda c, x: c.sendrecv(x, **ring(c)),
    "send_recv": send_recv_pairs,
    "pvary": lambda c, x: c.pvary(x),
}


def batch_data(comm):
    """BATCH examples of shape (size, 2), different on every rank and example."""
    shape = (BATCH, comm.size, 2)
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 100.0 * comm.rank


def mpi_calls(fn, *args):
    """The result of fn(*args) and how many MPI calls it made on this rank."""
    jax.block_until_ready(fn(*args))  # compile outside the count
    before = cpu.call_count()
    result = jax.block_until_ready(fn(*args))
    return result, cpu.call_count() - before


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("name", CASES)
def test_vmap_matches_loop_in_one_call(comm, name, axis):
    fn = jax.jit(lambda x: CASES[name](comm, x))
    xs = batch_data(comm)
    loop = np.stack([fn(x) for x in xs])
    _, unbatched_calls = mpi_calls(fn, xs[0])
    batched = jax.jit(jax.vmap(lambda x: CASES[name](comm, x), in_axes=axis))
    result, calls = mpi_calls(batched, np.moveaxis(xs, 0, axis))
    np.testing.assert_array_equal(result, loop)
    assert calls == unbatched_calls


@pytest.mark.parametrize("name", ["allreduce", "alltoall", "gather", "sendrecv", "scatter"])
def test_nested_vmap(comm, name):
    xs = np.stack([batch_data(comm) + 1000 * i for i in range(2)], axis=1)  # (3, 2, size, 2)
    nested = jax.jit(jax.vmap(jax.vmap(lambda x: CASES[name](comm, x)), in_axes=1))
    fn = jax.jit(lambda x: CASES[name](comm, x))
    loop = np.stack([np.stack([fn(xs[i, j]) for i in range(3)]) for j in range(2)])
    result, calls = mpi_calls(nested, xs)
    np.testing.assert_array_equal(result, loop)
    assert calls == mpi_calls(fn, xs[0, 0])[1]


def test_vmap_of_grad_and_grad_of_vmap(comm):
    def loss(x):
        y = comm.sendrecv(jnp.sin(x), **ring(comm))
        return jnp.sum(comm.alltoall(y) ** 2)

    xs = batch_data(comm) / 100.0
    per_example = np.stack([jax.grad(loss)(x) for x in xs])
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(loss)))(xs), per_example)
    total = jax.grad(lambda xs: jnp.sum(jax.vmap(loss)(xs)))(xs)
    np.testing.assert_allclose(total, per_example)


def test_sendrecv_batched_buffer_unbatched_template(comm):
    xs = batch_data(comm)
    template = jnp.zeros((comm.size, 2))

    def shift(x, t):
        return comm.sendrecv(x, t, **ring(comm))

    result = jax.vmap(shift, in_axes=(0, None))(xs, template)
    np.testing.assert_array_equal(
        result, batch_data(comm) - 100.0 * comm.rank + 100.0 * ring(comm)["source"]
    )
    # A batched template with an unbatched buffer: the message is unbatched too.
    result = jax.vmap(shift, in_axes=(None, 0))(xs[0], jnp.zeros((BATCH, comm.size, 2)))
    np.testing.assert_array_equal(result, np.broadcast_to(shift(xs[0], template), result.shape))


def test_recv_template_smaller_than_message_raises(comm):
    if comm.size < 2:
        pytest.skip("needs a partner")
    xs = batch_data(comm)
    if comm.rank == 0:
        jax.vmap(lambda x: comm.send(x, dest=1) and x)(xs)  # BATCH arrays in one message
    elif comm.rank == 1:
        with pytest.raises(Exception, match="recv"):
            comm.recv(jnp.zeros((comm.size, 2)), source=0)  # room for one
    comm.barrier()


def test_recv_template_larger_than_message_raises(comm):
    if comm.size < 2:
        pytest.skip("needs a partner")
    xs = batch_data(comm)
    if comm.rank == 0:
        comm.send(xs[0], dest=1)
    elif comm.rank == 1:
        message = f"received {2 * comm.size} elements from rank 0 but the receive buffer holds"
        with pytest.raises(Exception, match=f"{message} {4 * comm.size}"):
            jax.vmap(lambda t: comm.recv(t, source=0))(jnp.zeros((2, comm.size, 2)))
    comm.barrier()


def test_small_leaves_of_a_pytree_travel_together(comm):
    from jaxcomm._fusion import FUSE_BELOW_BYTES

    tree = {
        "small": [jnp.full((i + 1, 2), comm.rank + i, jnp.float32) for i in range(8)],
        "ints": (jnp.arange(3, dtype=jnp.int32), jnp.ones((2, 2), jnp.int32) * comm.rank),
        "large": jnp.ones(FUSE_BELOW_BYTES // 4, jnp.float32),
    }
    result, calls = mpi_calls(jax.jit(comm.allreduce), tree)
    assert calls == 3  # the float32 group, the int32 group, the large leaf
    ranks = sum(range(comm.size))
    for i, leaf in enumerate(result["small"]):
        np.testing.assert_array_equal(leaf, np.full((i + 1, 2), ranks + comm.size * i, np.float32))
    np.testing.assert_array_equal(result["ints"][0], comm.size * np.arange(3, dtype=np.int32))
    np.testing.assert_array_equal(result["ints"][1], np.full((2, 2), ranks, np.int32))
    np.testing.assert_array_equal(result["large"], np.full(FUSE_BELOW_BYTES // 4, comm.size))
    # Gradients flow through the fused message (replicated-cotangent convention).
    loss = lambda t: sum(jnp.sum(v * v) for v in jax.tree.leaves(comm.allreduce(t)))  # noqa: E731
    for i, g in enumerate(jax.grad(loss)(tree["small"])):
        np.testing.assert_allclose(g, np.full((i + 1, 2), 2 * (ranks + comm.size * i), np.float32))
    # Eager calls send the same messages, on the direct path (the full one, then the
    # shortcut) and through jit alike.
    for _ in range(2):
        eager, calls = mpi_calls(comm.allreduce, tree)
        assert calls == 3
        jax.tree.map(np.testing.assert_array_equal, eager, result)
