"""mpi4jax code runs unchanged with `import jaxcomm as mpi4jax` (docs/migrating.md)."""

from pathlib import Path

from mpirun import rank_outputs

PROGRAM = Path(__file__).parent / "programs" / "mpi4jax_style.py"


def test_a_program_written_for_mpi4jax():
    rank0, rank1 = (out.splitlines() for out in rank_outputs(2, str(PROGRAM)))
    assert rank0[:2] == ["allreduce [3.0, 3.0, 3.0]", "bcast [10.0, 11.0, 12.0]"]
    assert rank1[:2] == rank0[:2]
    assert rank1[2] == "recv [0.0, 1.0, 2.0, 3.0] 0 7"
    # Each rank's status names the other rank and the tag it sent with.
    assert rank0[2] == "sendrecv [100.0, 100.0] 1 4"
    assert rank1[3] == "sendrecv [0.0, 0.0] 0 3"
    assert rank0[3] == rank1[4] == "support False False"
