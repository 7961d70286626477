"""A test that outlives tests/mpi/conftest.py's per-test limit: test_faults.py runs
it under that conftest with JAXCOMM_TEST_TIMEOUT=2. Rank 0 is stuck without
making MPI calls; rank 1 goes on making them, which is progress, so only rank 0
reports, and rank 1's stacks come when rank 0 asks for them."""

import threading

import jax.numpy as jnp
from mpi4py import MPI

from jaxcomm import JaxComm


def test_rank_0_is_stuck_past_the_limit():
    alone = JaxComm(MPI.COMM_SELF)
    if MPI.COMM_WORLD.rank == 0:
        threading.Event().wait()
    while True:
        alone.allreduce(jnp.ones(1))
