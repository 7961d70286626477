"""A test that outlives tests/mpi/conftest.py's per-test limit: test_faults.py runs
it under that conftest with JAXCOMM_TEST_TIMEOUT=2. Rank 0 sleeps; the other
ranks pass and wait for it at exit, outside any test, so that only rank 0 writes
its stacks (two ranks' stacks written at once interleave on mpiexec's stderr)."""

import time

from mpi4py import MPI


def test_rank_0_sleeps_past_the_limit():
    if MPI.COMM_WORLD.rank == 0:
        time.sleep(120)
