"""Large host arrays: allreduce, scan, allgather and alltoall run as jaxcomm's own
exchanges from 64 KiB on (a block for allgather and alltoall, the array for the
reductions), in messages of at most 1 MiB, with the data partners read written
by plain or streaming stores (JAXCOMM_COPY; by default chosen by timing per
process: see cpp/mpi_cpu.cc). The sizes below are odd on purpose: chunks that
differ between ranks, partial last messages, blocks at unaligned offsets."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import assert_values, expected_reduction, rank_data
from mpi4py import MPI

from jaxcomm import ReduceOp

COPIES = ["plain", "streaming", "auto"]
MODES = ["eager", "jit", "donated"]
# In auto mode the copy can change from one call to the next.
CALLS = {"plain": 1, "streaming": 1, "auto": 5}


@pytest.fixture(params=COPIES)
def copy(request, monkeypatch):
    if request.param == "auto":
        monkeypatch.delenv("JAXCOMM_COPY", raising=False)
    else:
        monkeypatch.setenv("JAXCOMM_COPY", request.param)
    return request.param


def compiled(fn, mode):
    if mode == "eager":
        return fn
    return jax.jit(fn, donate_argnums=0 if mode == "donated" else ())


REDUCTIONS = [
    (ReduceOp.SUM, "float32", (1 << 19) + 7),  # 2 MiB + 28 B: two messages per chunk
    (ReduceOp.SUM, "float16", (1 << 15) + 1),  # jaxcomm's own MPI op
    (ReduceOp.MAX, "int8", (1 << 16) + 5),
    (ReduceOp.LOR, "int16", (1 << 15) + 3),  # results normalised to 0 or 1
    (ReduceOp.SUM, "complex128", (1 << 12) + 9),
]


@pytest.mark.parametrize(("op", "dtype", "count"), REDUCTIONS, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["allreduce", "scan"])
def test_reduction(comm, copy, name, op, dtype, count, mode):
    data = [rank_data(r, (count,), dtype) for r in range(comm.size)]
    reduced = data if name == "allreduce" else data[: comm.rank + 1]
    fn = compiled(lambda x: getattr(comm, name)(x, op=op), mode)
    for _ in range(CALLS[copy]):
        assert_values(fn(jnp.asarray(data[comm.rank])), expected_reduction(op, reduced))


@pytest.mark.parametrize("mode", ["eager", "donated"])
def test_allreduce_chunk_with_a_piece_more(comm, copy, mode):
    """The ring's chunks differ by up to one element; here the last has one
    float32 more than 1 MiB (a second, one-element message) and the others
    exactly 1 MiB."""
    count = comm.size * (1 << 18) + 1
    data = [rank_data(r, (count,), "float32") for r in range(comm.size)]
    fn = compiled(comm.allreduce, mode)
    for _ in range(CALLS[copy]):
        assert_values(fn(jnp.asarray(data[comm.rank])), expected_reduction(ReduceOp.SUM, data))


@pytest.mark.parametrize(("dtype", "count"), [("float64", (1 << 17) + 3), ("uint8", (1 << 16) + 1)])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_allgather(comm, copy, dtype, count, mode):
    data = [rank_data(r, (count,), dtype) for r in range(comm.size)]
    fn = compiled(comm.allgather, mode)
    for _ in range(CALLS[copy]):
        assert_values(fn(jnp.asarray(data[comm.rank])), np.stack(data))


def alltoall_block(count, src, dst, dtype):
    return (np.arange(count) % 97 + 3 * src + dst).astype(dtype)


@pytest.mark.parametrize(("dtype", "count"), [("float64", (1 << 17) + 5), ("int8", (1 << 16) + 1)])
@pytest.mark.parametrize("mode", MODES)
def test_alltoall(comm, copy, dtype, count, mode):
    rows = [np.stack([alltoall_block(count, src, dst, dtype) for dst in range(comm.size)])
            for src in range(comm.size)]  # fmt: skip
    mine, received = rows[comm.rank], np.stack([row[comm.rank] for row in rows])
    fn = compiled(comm.alltoall, mode)
    x = jnp.asarray(mine)
    for call in range(CALLS[copy]):
        # in place, the result alternates between the two
        x = fn(x) if mode == "donated" else fn(jnp.asarray(mine))
        assert_values(x, received if mode != "donated" or call % 2 == 0 else mine)


EXCHANGES = ["allgather", "alltoall", "allreduce", "reduce_scatter", "scan", "bcast"]


@pytest.mark.parametrize("block", [3, 1 << 16], ids=["small", "large"])
@pytest.mark.parametrize("name", EXCHANGES)
def test_wildcard_receive_before_an_exchange(comm, name, block):
    """A recv from any source with any tag, on a rank whose partners are already
    in an exchange, gets the message sent to it: jaxcomm's own exchanges (small
    ones below 64 KiB, large ones from 64 KiB on: float32 blocks of 12 B and
    256 KiB here) send their messages apart from the program's."""
    if comm.size < 3:
        pytest.skip("needs a rank outside the send/recv pair")
    rows = (comm.size, block)
    shape = {"alltoall": rows, "reduce_scatter": rows}.get(name, (block,))
    data = [rank_data(r, shape, "float32") for r in range(comm.size)]
    message = rank_data(100, (block,), "float32")
    if comm.rank == 0:
        time.sleep(0.5)  # the other ranks' exchange messages go out first
        comm.send(jnp.asarray(message), dest=1, tag=5)
    elif comm.rank == 1:
        got, status = comm.recv(
            jnp.zeros(block, jnp.float32), source=MPI.ANY_SOURCE, return_status=True
        )
        assert (int(status.source), int(status.tag)) == (0, 5)
        assert_values(got, message)
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


def test_exchanges_on_communicators_that_come_and_go(comm):
    """Each communicator's exchanges get their own duplicate, freed with it."""
    block = 1 << 16
    for round_ in range(3):
        part = comm.split(color=comm.rank % 2, key=comm.rank)
        members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
        data = [rank_data(r + round_, (block,), "float32") for r in members]
        assert_values(part.allgather(jnp.asarray(data[part.rank])), np.stack(data))
        part.free()
