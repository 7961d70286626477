"""Making the ranks of an MPI job one multi-process JAX program (jax.distributed)."""

import os
import socket

import jax
import pytest
from mpi4py import MPI

# JAXCOMM_TEST_DISTRIBUTED=1: the ranks are one multi-process JAX program
# (tests/test_mpiexec.py's sharded runs; tests/mpi/conftest.py starts it).
DISTRIBUTED = os.environ.get("JAXCOMM_TEST_DISTRIBUTED") == "1"
# The mark of a file that needs it.
distributed_only = pytest.mark.skipif(
    not DISTRIBUTED,
    reason="a jax.distributed program: JAXCOMM_TEST_DISTRIBUTED=1 (tests/test_mpiexec.py)",
)


def start_jax_distributed() -> None:
    """Make every rank a process of jax.distributed, with gloo for JAX's own CPU
    collectives: JAX's coordinator on 127.0.0.1, at a port that rank 0 finds
    free, so that runs side by side do not collide. Test configuration only."""
    world = MPI.COMM_WORLD
    port = None
    if world.rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = world.bcast(port)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world.size, process_id=world.rank)
