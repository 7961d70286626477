"""A test that outlives tests/mpi/conftest.py's per-test limit: test_faults.py runs
it under that conftest with JAXCOMM_TEST_TIMEOUT=2. Rank 0 sleeps while the
other ranks wait for it in a barrier."""

import time

from mpi4py import MPI


def test_rank_0_sleeps_past_the_limit():
    if MPI.COMM_WORLD.rank == 0:
        time.sleep(120)
    MPI.COMM_WORLD.Barrier()
