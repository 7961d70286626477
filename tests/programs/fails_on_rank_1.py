"""A test that fails on rank 1 only: test_faults.py runs it under tests/mpi's
conftest, which reports the failure and aborts the job."""

from mpi4py import MPI


def test_rank_1_fails():
    assert MPI.COMM_WORLD.rank != 1, "rank 1 fails here"
