"""The eager shortcut: a JaxComm call on one concrete array that repeats an earlier
call's signature (op, parameters, shape, dtype, device) skips the argument checks
and goes straight to the host code. It must give the new call's values, fall back
to the full path for anything else, and never run while a trace is active."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import COLLECTIVES, FLOAT, assert_values, expected_collective, rank_data

from jaxcomm import JaxComm, _eager

pytestmark = pytest.mark.skipif(not _eager.ENABLED, reason="JAXCOMM_EAGER=jit: no direct path")


@pytest.fixture
def full_path_calls(monkeypatch):
    """How many JaxComm calls have gone through argument handling (not the shortcut)."""
    calls = []
    leaves = JaxComm._leaves

    def counted(self, *args, **kwargs):
        calls.append(args[0])
        return leaves(self, *args, **kwargs)

    monkeypatch.setattr(JaxComm, "_leaves", counted)
    return calls


def collective_input(name, rank, size, seed):
    """Rank `rank`'s input to collective `name` (rank 0 is the root), varying with seed."""
    if name in ("alltoall", "reduce_scatter") or (name == "scatter" and rank == 0):
        return rank_data(rank + seed, (size, 2), "int32")
    return rank_data(rank + seed, (2,), "int32")


@pytest.mark.parametrize("name", COLLECTIVES)
def test_repeated_collective_gives_the_new_values(comm, name, full_path_calls):
    fn = getattr(comm, name)
    for seed in (0, 10, 20):
        inputs = [collective_input(name, r, comm.size, seed) for r in range(comm.size)]
        got = fn(jnp.asarray(inputs[comm.rank]))
        assert isinstance(got, jax.Array)
        assert_values(got, expected_collective(name, comm.rank, inputs))
    assert len(full_path_calls) == 1  # the first call only


def test_repeated_sendrecv_and_recv_give_new_values_and_status(comm, full_path_calls):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for seed in (0, 10, 20):
        x = jnp.full(3, seed + comm.rank)
        out, status = comm.sendrecv(
            x, source=left, dest=right, sendtag=3, recvtag=3, return_status=True
        )
        assert_values(out, np.full(3, seed + left, out.dtype))
        assert isinstance(status.source, jax.Array) and status.source.dtype == np.int32
        assert (int(status.source), int(status.tag)) == (left, 3)

        if comm.size == 1:
            continue  # a blocking send to oneself could wait for ever
        # A ring of send/recv: even ranks send first, so no cycle of receives forms.
        x = jnp.full(2, float(seed + comm.rank))
        if comm.rank % 2 == 0:
            comm.send(x, dest=right, tag=7)
        got, status = comm.recv(jnp.zeros(2), source=left, tag=7, return_status=True)
        if comm.rank % 2 == 1:
            comm.send(x, dest=right, tag=7)
        assert_values(got, np.full(2, float(seed + left), FLOAT))
        assert (int(status.source), int(status.tag)) == (left, 7)
    assert len(full_path_calls) == (1 if comm.size == 1 else 3)


def test_a_changed_signature_takes_the_full_path_and_its_checks(comm, full_path_calls):
    x = jnp.zeros((comm.size, 2))
    comm.alltoall(x)
    comm.alltoall(x)
    with pytest.raises(ValueError, match="leading axis of length size"):
        comm.alltoall(jnp.zeros((comm.size + 1, 2)))
    with pytest.raises(TypeError, match="op=SUM is not defined for dtype bool"):
        comm.allreduce(jnp.zeros(2, bool))
    comm.allreduce(jnp.ones(2))
    assert_values(comm.allreduce(jnp.ones(2), op="max"), np.ones(2, FLOAT))
    assert len(full_path_calls) == 5


def test_no_shortcut_while_tracing(comm):
    """After an eager call, the same call on a captured concrete array inside a
    trace is still staged into the program, not run once at trace time."""
    captured = jnp.full(2, float(comm.rank + 1))
    expected = np.full(2, comm.size * (comm.size + 1) / 2, FLOAT)
    assert_values(comm.allreduce(captured), expected)
    assert_values(comm.allreduce(captured), expected)

    def f():
        return comm.allreduce(captured)

    assert "jaxcomm_allreduce" in str(jax.make_jaxpr(f)())
    assert_values(jax.jit(f)(), expected)


def test_shortcut_refuses_a_freed_communicator_and_a_deleted_array(comm):
    other = comm.dup()
    x = jnp.ones(3)
    other.allreduce(x)
    other.free()
    with pytest.raises(ValueError, match="has been freed"):
        other.allreduce(x)
    y = jnp.ones(3)
    comm.allreduce(y)
    y.delete()
    with pytest.raises(jax.errors.JaxRuntimeError, match="deleted"):
        comm.allreduce(y)
