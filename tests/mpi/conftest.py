import faulthandler
import os
import sys

import jax
import pytest
from mpi4py import MPI

# A hung rank dumps its stack before mpiexec's timeout kills it.
faulthandler.dump_traceback_later(600, exit=True)

# The tests cover 64-bit dtypes; this is test configuration, jaxcomm never sets it.
jax.config.update("jax_enable_x64", True)

if os.environ.get("JAXCOMM_TEST_JIT") == "jaxcomm":
    # Run the suite's jitted functions through jaxcomm.jit (its C++ dispatch
    # path and marker chain) instead of jax.jit: test configuration only.
    import jaxcomm

    jax.jit = jaxcomm.jit


@pytest.fixture(scope="session")
def comm():
    from jaxcomm import JaxComm

    return JaxComm(MPI.COMM_WORLD)


def pytest_runtest_logreport(report):
    # A failure on one rank would leave the others waiting in a collective: abort.
    if report.failed:
        sys.stdout.flush()
        sys.stderr.write(
            f"rank {MPI.COMM_WORLD.rank}: {report.nodeid} failed\n{report.longreprtext}\n"
        )
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
