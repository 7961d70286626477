"""Every collective on arrays from a few bytes to a few MiB: MPI libraries switch
algorithms by message size and rank count, and jaxcomm fuses pytree leaves below
_fusion.FUSE_BELOW_BYTES. Odd element counts on purpose (blocks at unaligned
offsets, pieces that do not divide evenly); eager, jitted and donated (in place,
MPI_IN_PLACE) calls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import assert_values, expected_reduction, rank_data
from mpi4py import MPI

from jaxcomm import ReduceOp
from jaxcomm._fusion import FUSE_BELOW_BYTES

MODES = ["eager", "jit", "donated"]
# float32 elements: 12 B; just under and over the fusion threshold; 2 MiB + 28 B.
COUNTS = [3, FUSE_BELOW_BYTES // 4 - 1, FUSE_BELOW_BYTES // 4 + 1, (1 << 19) + 7]


def compiled(fn, mode):
    if mode == "eager":
        return fn
    return jax.jit(fn, donate_argnums=0 if mode == "donated" else ())


def data_of(comm, shape, dtype="float32", offset=0):
    return [rank_data(r + offset, shape, dtype) for r in range(comm.size)]


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["allreduce", "scan", "exscan"])
def test_reductions(comm, name, count, mode):
    data = data_of(comm, (count,))
    fn = compiled(lambda x: getattr(comm, name)(x, op=ReduceOp.SUM), mode)
    out = fn(jnp.asarray(data[comm.rank]))
    if name == "exscan" and comm.rank == 0:
        assert_values(out, np.zeros(count, np.float32))
        return
    reduced = {"allreduce": data, "scan": data[: comm.rank + 1], "exscan": data[: comm.rank]}
    assert_values(out, expected_reduction(ReduceOp.SUM, reduced[name]))


OTHER_DTYPES = [
    (ReduceOp.SUM, "float16"),  # jaxcomm's own MPI operator
    (ReduceOp.MAX, "int8"),
    (ReduceOp.LOR, "int16"),  # results normalised to 0 or 1
    (ReduceOp.PROD, "complex128"),
]


@pytest.mark.parametrize(("op", "dtype"), OTHER_DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["eager", "donated"])
def test_large_reductions_of_other_dtypes(comm, op, dtype, mode):
    count = (1 << 16) + 5
    data = data_of(comm, (count,), dtype)
    fn = compiled(lambda x: comm.allreduce(x, op=op), mode)
    assert_values(fn(jnp.asarray(data[comm.rank])), expected_reduction(op, data))


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("mode", MODES)
def test_reduce_and_bcast(comm, count, mode):
    root = comm.size - 1
    data = data_of(comm, (count,))
    reduced = compiled(lambda x: comm.reduce(x, op=ReduceOp.MAX, root=root), mode)
    expected = expected_reduction(ReduceOp.MAX, data) if comm.rank == root else data[comm.rank]
    assert_values(reduced(jnp.asarray(data[comm.rank])), expected)
    sent = compiled(lambda x: comm.bcast(x, root=root), mode)
    assert_values(sent(jnp.asarray(data[comm.rank])), data[root])


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_gathers_and_scatter(comm, count, mode):
    root = comm.size // 2
    data = data_of(comm, (count,))
    assert_values(compiled(comm.allgather, mode)(jnp.asarray(data[comm.rank])), np.stack(data))
    gathered = compiled(lambda x: comm.gather(x, root=root), mode)(jnp.asarray(data[comm.rank]))
    assert_values(gathered, np.stack(data) if comm.rank == root else data[comm.rank])
    full = np.stack(data_of(comm, (count,), offset=7))
    x = full if comm.rank == root else np.zeros(count, np.float32)
    scattered = compiled(lambda a: comm.scatter(a, root=root), mode)(jnp.asarray(x))
    assert_values(scattered, full[comm.rank])


def alltoall_rows(comm, count, dtype):
    """rows[src][dst]: what rank src sends to rank dst."""
    block = lambda src, dst: (np.arange(count) % 97 + 3 * src + dst).astype(dtype)  # noqa: E731
    return [np.stack([block(src, dst) for dst in range(comm.size)]) for src in range(comm.size)]


@pytest.mark.parametrize("count", [1, 5, (1 << 14) + 1, (1 << 17) + 5])
@pytest.mark.parametrize("mode", MODES)
def test_alltoall(comm, count, mode):
    rows = alltoall_rows(comm, count, "float64")
    mine, received = rows[comm.rank], np.stack([row[comm.rank] for row in rows])
    fn = compiled(comm.alltoall, mode)
    out = fn(jnp.asarray(mine))
    assert_values(out, received)
    if mode == "donated":  # in place again: the exchange undoes itself
        assert_values(fn(out), mine)


@pytest.mark.parametrize("count", [3, (1 << 16) + 3])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_reduce_scatter(comm, count, mode):
    data = data_of(comm, (comm.size, count))
    out = compiled(lambda x: comm.reduce_scatter(x, op=ReduceOp.SUM), mode)(
        jnp.asarray(data[comm.rank])
    )
    assert_values(out, expected_reduction(ReduceOp.SUM, data)[comm.rank])


COLLECTIVES = ["allgather", "alltoall", "allreduce", "reduce_scatter", "scan", "bcast"]


@pytest.mark.parametrize("block", [3, 1 << 16], ids=["small", "large"])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collectives_never_take_a_wildcard_receive(comm, name, block):
    """A recv from any source with any tag, on a rank whose peers are already in a
    collective, gets the message sent to it, not one of the collective's."""
    if comm.size < 3:
        pytest.skip("needs a rank outside the send/recv pair")
    rows = (comm.size, block)
    shape = {"alltoall": rows, "reduce_scatter": rows}.get(name, (block,))
    data = data_of(comm, shape)
    message = rank_data(100, (block,), "float32")
    world = MPI.COMM_WORLD
    if comm.rank == 0:
        # Sent once every rank outside the pair has entered the collective (its
        # word comes just before), so its messages may reach rank 1 first.
        for rank in range(2, comm.size):
            world.recv(source=rank, tag=77)
        comm.send(jnp.asarray(message), dest=1, tag=5)
    elif comm.rank == 1:
        got, status = comm.recv(
            jnp.zeros(block, jnp.float32), source=MPI.ANY_SOURCE, return_status=True
        )
        assert (int(status.source), int(status.tag)) == (0, 5)
        assert_values(got, message)
    else:
        world.send(None, dest=0, tag=77)
    out = getattr(comm, name)(jnp.asarray(data[comm.rank]))
    expected = {
        "allgather": lambda: np.stack(data),
        "alltoall": lambda: np.stack([d[comm.rank] for d in data]),
        "allreduce": lambda: expected_reduction(ReduceOp.SUM, data),
        "reduce_scatter": lambda: expected_reduction(ReduceOp.SUM, data)[comm.rank],
        "scan": lambda: expected_reduction(ReduceOp.SUM, data[: comm.rank + 1]),
        "bcast": lambda: data[0],
    }[name]()
    assert_values(out, expected)


@pytest.mark.parametrize("row", [3, (1 << 16) + 7])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_alltoallv(comm, row, mode):
    """Skewed counts (some pairs exchange nothing) with small and 256 KiB rows."""

    def sent_by(source):
        return [(source + dest) % 3 for dest in range(comm.size)]

    counts = sent_by(comm.rank)
    capacity = 2 * comm.size
    call = lambda x: comm.alltoallv(x, counts, capacity=capacity)  # noqa: E731
    y, got = compiled(call, mode)(jnp.asarray(rank_data(comm.rank, (sum(counts), row))))
    pieces = []
    for source in range(comm.size):
        theirs = sent_by(source)
        start = sum(theirs[: comm.rank])
        pieces.append(rank_data(source, (sum(theirs), row))[start : start + theirs[comm.rank]])
    want = np.zeros((capacity, row), np.float32)
    rows = np.concatenate(pieces)
    want[: len(rows)] = rows
    assert_values(y, want)
    assert_values(got, np.array([sent_by(s)[comm.rank] for s in range(comm.size)], np.int32))


@pytest.mark.parametrize("row", [3, (1 << 16) + 7])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_allgatherv_gatherv_scatterv(comm, row, mode):
    """Rank r contributes r % 3 rows; the root scatters them back."""
    root = comm.size // 2
    counts = np.array([r % 3 for r in range(comm.size)], np.int32)
    capacity = int(counts.sum())
    mine = rank_data(comm.rank, (int(counts[comm.rank]), row))

    def exchanges(x):
        everyone, _ = comm.allgatherv(x, capacity=capacity)
        at_root, _ = comm.gatherv(x, root, capacity=capacity)
        sent = counts if comm.rank == root else None
        back, _ = comm.scatterv(at_root if comm.rank == root else x, sent, root, capacity=2)
        return everyone, back

    everyone, back = compiled(exchanges, mode)(jnp.asarray(mine))
    all_rows = np.concatenate([rank_data(r, (int(counts[r]), row)) for r in range(comm.size)])
    assert_values(everyone, all_rows.reshape(capacity, row))
    want = np.zeros((2, row), np.float32)
    want[: len(mine)] = mine
    assert_values(back, want)
