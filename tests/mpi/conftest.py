import faulthandler
import os
import sys
import threading
import time

import jax
import pytest
from graph_edges import GRAPHS, lists
from jax_processes import start_jax_distributed
from mpi4py import MPI

# The tests cover 64-bit dtypes; this is test configuration, jaxcomm never sets it.
jax.config.update("jax_enable_x64", True)


# JAXCOMM_TEST_DISTRIBUTED=1: the ranks are one multi-process JAX program
# (test_sharded.py); before anything asks JAX for its devices.
DISTRIBUTED = os.environ.get("JAXCOMM_TEST_DISTRIBUTED") == "1"
if DISTRIBUTED:
    start_jax_distributed()

# The suite's arrays live on the host unless JAXCOMM_TEST_DEVICE=gpu puts them on
# JAX's GPU (test_gpu.py places its own). On a GPU machine JAX's default device
# is the GPU, where the non-blocking operations refuse arrays and the host-only
# checks (the eager shortcut's call counts) do not apply. This process's own:
# under jax.distributed the first of jax.devices() is process 0's.
if os.environ.get("JAXCOMM_TEST_DEVICE", "cpu") == "cpu":
    jax.config.update("jax_default_device", jax.local_devices(backend="cpu")[0])

if os.environ.get("JAXCOMM_TEST_JIT") == "jaxcomm":
    # Run the suite's jitted functions through jaxcomm.jit (its C++ dispatch
    # path and marker chain) instead of jax.jit: test configuration only.
    import jaxcomm

    jax.jit = jaxcomm.jit

# Seconds one test (setup, call and teardown) may take before its rank prints the
# test's name and every thread's stack and exits. Tests take seconds, the 2 GiB
# messages of test_large.py longer; 300 s leaves a slow, busy machine room and
# still fires well before test_mpiexec.py's 900 s limit on the whole run, which
# kills mpiexec without a word.
TEST_TIMEOUT = float(os.environ.get("JAXCOMM_TEST_TIMEOUT", "300"))


class Watchdog:
    """Ends a rank whose current test runs past TEST_TIMEOUT, after writing
    "rank R: <test> timed out after N s" and all threads' stacks to `fd`.

    A Python thread, since only Python knows which test runs; it gets the GIL
    while the test waits in MPI (jaxcomm releases it there) or runs Python. If
    C code hangs holding the GIL, faulthandler's own timer, armed a minute
    later, still writes the stacks (without the test's name) and exits."""

    def __init__(self, fd: int, rank: int, limit: float):
        self.fd, self.rank, self.limit = fd, rank, limit
        self.cond = threading.Condition()
        self.test: str | None = None
        self.deadline = 0.0
        threading.Thread(target=self.watch, name="test watchdog", daemon=True).start()

    def arm(self, nodeid: str) -> None:
        with self.cond:
            self.test, self.deadline = nodeid, time.monotonic() + self.limit
            self.cond.notify()
        faulthandler.dump_traceback_later(self.limit + 60, exit=True, file=self.fd)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        with self.cond:
            self.test = None
            self.cond.notify()

    def watch(self) -> None:
        with self.cond:
            while True:
                left = self.deadline - time.monotonic()
                if self.test is None or left > 0:
                    self.cond.wait(None if self.test is None else left)
                    continue
                message = f"rank {self.rank}: {self.test} timed out after {self.limit:g} s\n"
                os.write(self.fd, message.encode())
                faulthandler.dump_traceback(file=self.fd, all_threads=True)
                # Not MPI_Abort: MPI may be what hangs. mpiexec ends the other ranks.
                os._exit(1)


watchdog: Watchdog | None = None


def pytest_configure(config):
    # pytest captures fd 2 while tests run; the watchdog writes to a copy of the
    # real one, taken with capture off, so that mpiexec's stderr carries it.
    global watchdog
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        stderr = os.dup(2)
    else:
        with capture.global_and_fixture_disabled():
            stderr = os.dup(2)
    watchdog = Watchdog(stderr, MPI.COMM_WORLD.rank, TEST_TIMEOUT)
    watchdog.arm("<collection>")


def pytest_unconfigure(config):
    # Until the process ends: MPI_Finalize runs at exit.
    if watchdog is not None:
        watchdog.arm("<exit>")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    watchdog.arm(item.nodeid)
    try:
        return (yield)
    finally:
        watchdog.disarm()


@pytest.fixture(autouse=True)
def in_step():
    """Every test leaves its rank in step with its peers (jaxcomm._lockstep): a
    test that puts it out of step on purpose makes the calls its peers waited
    for and says so with jaxcomm._native.cpu.resume()."""
    yield
    from jaxcomm import _lockstep

    assert _lockstep.out_of_step() is None, f"out of step: {_lockstep.out_of_step()}"


@pytest.fixture(scope="session")
def comm():
    from jaxcomm import JaxComm

    return JaxComm(MPI.COMM_WORLD)


@pytest.fixture(scope="module")
def graphs(comm):
    """{name: (graph, its edges)} for each of graph_edges.GRAPHS, made on comm
    and freed after the module's tests."""
    made = {}
    for name, edges in GRAPHS.items():
        edges = edges(comm.size)
        made[name] = (comm.create_dist_graph(*lists(edges, comm.rank)), edges)
    yield made
    for graph, _ in made.values():
        graph.free()


def pytest_runtest_logreport(report):
    # A failure on one rank would leave the others waiting in a collective: abort.
    if report.failed:
        sys.stdout.flush()
        sys.stderr.write(
            f"rank {MPI.COMM_WORLD.rank}: {report.nodeid} failed\n{report.longreprtext}\n"
        )
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
