"""send, recv, sendrecv, barrier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import FLOAT, assert_values, rank_data
from mpi4py import MPI


def ring(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "complex128", "bool"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_sendrecv_ring(comm, dtype, mode):
    right, left = ring(comm)

    def shift(x):
        return comm.sendrecv(x, source=left, dest=right, sendtag=7, return_status=True)

    fn = jax.jit(shift) if mode == "jit" else shift
    out, status = fn(rank_data(comm.rank, (2, 3), dtype))
    assert_values(out, rank_data(left, (2, 3), dtype))
    assert (int(status.source), int(status.tag)) == (left, 7)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_sendrecv_sends_with_sendtag_and_receives_with_recvtag(comm, mode):
    # Each rank tags its message with its own rank: past one rank, the tag it
    # sends with is not the one it receives with.
    right, left = ring(comm)

    def shift(x):
        return comm.sendrecv(
            x, source=left, dest=right, sendtag=10 + comm.rank, recvtag=10 + left,
            return_status=True,
        )  # fmt: skip

    fn = jax.jit(shift) if mode == "jit" else shift
    out, status = fn(rank_data(comm.rank, (4,), "float32"))
    assert_values(out, rank_data(left, (4,), "float32"))
    assert (int(status.source), int(status.tag)) == (left, 10 + left)


def test_sendrecv_different_recv_shape(comm):
    right, left = ring(comm)
    x = jnp.full((comm.rank + 1,), comm.rank, jnp.int32)
    template = jnp.zeros((left + 1,), jnp.int32)
    out = jax.jit(lambda a, t: comm.sendrecv(a, t, source=left, dest=right))(x, template)
    assert_values(out, np.full((left + 1,), left, np.int32))


def test_sendrecv_proc_null_gives_zeros(comm):
    # An open chain: rank 0 receives from nobody, the last rank sends to nobody.
    left = comm.rank - 1 if comm.rank > 0 else MPI.PROC_NULL
    right = comm.rank + 1 if comm.rank < comm.size - 1 else MPI.PROC_NULL
    x = jnp.full((3,), comm.rank + 1.0)
    out = jax.jit(lambda a: comm.sendrecv(a, source=left, dest=right))(x)
    assert_values(out, np.full((3,), float(comm.rank), FLOAT))  # rank 0: zeros


def test_send_recv_jit_both_orders(comm):
    """The mpi4jax send/recv example, with rank pairs (0,1), (2,3)."""
    if comm.size % 2:
        partner = comm.rank ^ 1 if comm.rank < comm.size - 1 else MPI.PROC_NULL
    else:
        partner = comm.rank ^ 1

    @jax.jit
    def exchange(arr):
        arr = arr + comm.rank
        if comm.rank % 2 == 0:
            comm.send(arr, dest=partner)
            return comm.recv(arr, source=partner)
        other = comm.recv(arr, source=partner)
        comm.send(arr, dest=partner)
        return other

    out = exchange(jnp.zeros((3, 3)))
    expected = (
        np.zeros((3, 3), FLOAT) if partner == MPI.PROC_NULL else np.full((3, 3), partner, FLOAT)
    )
    assert_values(out, expected)


def test_send_in_one_jit_recv_in_another(comm):
    """Ordered effects keep separately compiled send and recv in program order."""
    if comm.size == 1:
        pytest.skip("a blocking send needs a peer")
    right, left = ring(comm)
    send = jax.jit(lambda x: comm.send(x, dest=right, tag=3) and None)
    recv = jax.jit(lambda t: comm.recv(t, source=left, tag=3))
    x = jnp.arange(4.0) + comm.rank
    for _ in range(3):
        if comm.rank % 2 == 0:
            send(x)
            out = recv(x)
        else:
            out = recv(x)
            send(x)
        assert_values(out, np.arange(4.0, dtype=FLOAT) + left)


def test_recv_any_source_status(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    if comm.rank == 0:
        got = {}
        for _ in range(comm.size - 1):
            out, status = comm.recv(jnp.zeros(2), return_status=True)
            got[int(status.source)] = (np.asarray(out), int(status.tag))
        for r in range(1, comm.size):
            assert_values(got[r][0], np.full(2, r, FLOAT))
            assert got[r][1] == 10 + r
    else:
        comm.send(jnp.full(2, float(comm.rank)), dest=0, tag=10 + comm.rank)


def test_send_returns_comm_and_chains(comm):
    assert comm.barrier() is comm
    assert comm.send(jnp.zeros(1), dest=MPI.PROC_NULL).barrier() is comm


def test_pytree_sendrecv(comm):
    right, left = ring(comm)
    tree = (rank_data(comm.rank, (2,), "float32"), {"k": rank_data(comm.rank, (), "int32")})
    out = jax.jit(lambda t: comm.sendrecv(t, source=left, dest=right))(tree)
    assert_values(out[0], rank_data(left, (2,), "float32"))
    assert_values(out[1]["k"], rank_data(left, (), "int32"))


def test_bad_p2p_arguments(comm):
    with pytest.raises(ValueError, match=rf"send: dest={comm.size} is out of range"):
        comm.send(jnp.zeros(1), dest=comm.size)
    with pytest.raises(ValueError, match="recv: source=-7 is out of range"):
        comm.recv(jnp.zeros(1), source=-7)
    with pytest.raises(ValueError, match="send: tag=-3 must be between 0 and"):
        comm.send(jnp.zeros(1), dest=0, tag=-3)
    largest = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    with pytest.raises(
        ValueError, match=rf"send: tag={largest + 1} must be between 0 and {largest}"
    ):
        comm.send(jnp.zeros(1), dest=0, tag=largest + 1)
    with pytest.raises(TypeError, match="sendrecv: dest must be a Python int fixed at trace time"):
        jax.jit(lambda x, d: comm.sendrecv(x, source=0, dest=d))(jnp.zeros(1), 0)
    with pytest.raises(TypeError, match="send: tag must be a Python int fixed at trace time"):
        jax.jit(lambda x, t: comm.send(x, dest=0, tag=t))(jnp.zeros(1), 1)


def test_largest_tag(comm):
    """Every tag MPI allows is the program's, MPI.TAG_UB included (jaxcomm's own
    messages travel on a communicator of their own)."""
    largest = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    right, left = ring(comm)
    x = jnp.asarray(rank_data(comm.rank, (3,), "float32"))
    out, status = comm.sendrecv(x, source=left, dest=right, sendtag=largest, return_status=True)
    assert (int(status.source), int(status.tag)) == (left, largest)
    assert_values(out, rank_data(left, (3,), "float32"))
