"""MPI errors become Python exceptions naming the op, the rank and MPI's message."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import FLOAT, assert_values


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
