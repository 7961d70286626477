"""MPI errors become Python exceptions naming the op, the rank and MPI's message."""

import gc
import os
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import FLOAT, assert_values

import jaxcomm
from jaxcomm import _native


def test_truncated_message_is_an_exception(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    if comm.rank == 0:
        comm.send(jnp.arange(8.0), dest=1, tag=4)
    elif comm.rank == 1:
        with pytest.raises(Exception, match=r"jaxcomm: MPI error in recv on rank 1: .*[Tt]runcat"):
            jax.block_until_ready(jax.jit(lambda t: comm.recv(t, source=0, tag=4))(jnp.zeros(2)))
    # The communicator still works afterwards.
    comm.barrier()
    assert_values(comm.allreduce(jnp.ones(1)), np.full(1, comm.size, FLOAT))


def test_truncated_sendrecv_is_an_exception(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    if comm.rank < 2:
        peer = 1 - comm.rank
        # Rank 1 sends 8 elements to rank 0, which expects 2; rank 0 sends 2 as expected.
        x = jnp.arange(8.0 if comm.rank == 1 else 2.0)
        exchange = jax.jit(lambda x, t: comm.sendrecv(x, t, source=peer, dest=peer))
        if comm.rank == 0:
            with pytest.raises(Exception, match=r"MPI error in sendrecv on rank 0: .*[Tt]runcat"):
                jax.block_until_ready(exchange(x, jnp.zeros(2)))
        else:
            assert_values(exchange(x, jnp.zeros(2)), np.arange(2.0))
    comm.barrier()
    assert_values(comm.allreduce(jnp.ones(1)), np.full(1, comm.size, FLOAT))


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_ten_thousand_small_ops_do_not_grow_memory(comm):
    # What a call keeps is per process and the same whatever the number of ranks:
    # two ranks exchange real messages, more would only lengthen the run.
    if comm.size != 2:
        pytest.skip("measured on 2 ranks")
    step = jax.jit(lambda x: comm.allreduce(x) / comm.size)
    x = jnp.ones(4)
    for _ in range(500):  # warm-up: compilation, allocator pools
        x = step(x)
    x.block_until_ready()
    gc.collect()
    before = resident_bytes()
    for _ in range(10_000):
        x = step(x)
    x.block_until_ready()
    gc.collect()
    assert_values(x, np.ones(4, FLOAT))
    assert resident_bytes() - before < 16 << 20


@pytest.mark.parametrize("blocking", [True, False], ids=["recv", "irecv"])
def test_ctrl_c_interrupts_an_eager_wait(comm, blocking):
    """A receive that nothing matches gives way to KeyboardInterrupt, and is
    cancelled: the next message with its tag goes to the next receive. A message
    sent for the cancelled receive would too, so the rank is out of step
    (jaxcomm._lockstep) until the test, which sent none, says otherwise."""
    if not jaxcomm._eager.ENABLED:
        pytest.skip("JAXCOMM_EAGER=jit: eager calls run on XLA's threads, not interruptible")
    alarm = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    alarm.start()
    with pytest.raises(KeyboardInterrupt):
        if blocking:
            comm.recv(jnp.zeros(3), source=comm.rank, tag=77)
        else:
            comm.wait(comm.irecv(jnp.zeros(3), source=comm.rank, tag=77))
    alarm.join()
    assert "was cancelled before its message came" in _native.cpu.out_of_step()
    _native.cpu.resume()
    receive = comm.irecv(jnp.zeros(3), source=comm.rank, tag=77)
    comm.send(jnp.full(3, 5.0), dest=comm.rank, tag=77)
    np.testing.assert_array_equal(comm.wait(receive), 5.0)


@pytest.mark.parametrize("blocking", [True, False], ids=["send", "isend"])
def test_ctrl_c_interrupts_an_eager_wait_for_a_large_send(comm, blocking):
    """A large send that nothing receives yet gives way to KeyboardInterrupt; its
    message still leaves whole when a receive comes (jaxcomm keeps its buffer)."""
    if not jaxcomm._eager.ENABLED:
        pytest.skip("JAXCOMM_EAGER=jit: eager calls run on XLA's threads, not interruptible")
    data = jnp.arange(4 << 20, dtype=jnp.float32)  # 16 MiB: MPI's rendezvous protocol
    alarm = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    alarm.start()
    with pytest.raises(KeyboardInterrupt):
        if blocking:
            comm.send(data, dest=comm.rank, tag=78)
        else:
            comm.wait(comm.isend(data, dest=comm.rank, tag=78))
    alarm.join()
    received = comm.recv(jnp.zeros_like(data), source=comm.rank, tag=78)
    np.testing.assert_array_equal(received, data)
