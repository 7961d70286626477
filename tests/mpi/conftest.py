import faulthandler
import os
import sys
import threading
import time

import jax
import progress
import pytest
import shared_compiles
from graph_edges import GRAPHS, lists
from jax_processes import DISTRIBUTED, start_jax_distributed
from mpi4py import MPI

# The tests cover 64-bit dtypes; this is test configuration, jaxcomm never sets it.
jax.config.update("jax_enable_x64", True)


# What this run's ranks and the session's earlier runs compiled
# (test_mpiexec.py's xla_cache; shared_compiles.py). Not in a jax.distributed
# program: JAX 0.10's XLA crashes (SIGSEGV) serialising a program compiled for
# several processes.
if (cache := os.environ.get("JAXCOMM_TEST_XLA_CACHE")) and not DISTRIBUTED:
    shared_compiles.start(cache, MPI.COMM_WORLD.rank)

# A multi-process JAX program (jax_processes.DISTRIBUTED): started before anything
# asks JAX for its devices.
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


class Watchdog:
    """Ends a rank whose current phase (a test with its setup and teardown,
    collection, or exit) makes no progress for its limit (progress.py says
    which and why): it writes "rank R: <phase> timed out after N s" and every
    thread's stack to `fd`, asks the other ranks on this machine for theirs, and
    exits. Progress inside a phase: this rank started an MPI call.

    A Python thread, since only Python knows which test runs; it gets the GIL
    while the test waits in MPI (jaxcomm releases it there) or runs Python. If
    C code hangs holding the GIL, faulthandler's own timer, armed BACKSTOP
    later, still writes the stacks (without the test's name) and exits."""

    #: Seconds between looks at the rank's MPI calls: a small share of the limit.
    LOOK_EVERY = 10.0

    def __init__(self, fd: int, rank: int, peers: list[int], journal: progress.Journal):
        self.fd, self.rank, self.peers, self.journal = fd, rank, peers, journal
        self.cond = threading.Condition()
        self.phase: str | None = None
        self.limit = self.since = 0.0
        self.calls = 0
        threading.Thread(target=self.watch, name="test watchdog", daemon=True).start()

    def arm(self, phase: str, limit: float) -> None:
        with self.cond:
            self.phase, self.limit = phase, limit
            self.since, self.calls = time.monotonic(), mpi_calls()
            self.cond.notify()
        faulthandler.dump_traceback_later(limit + progress.BACKSTOP, exit=True, file=self.fd)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        with self.cond:
            self.phase = None
            self.cond.notify()

    def watch(self) -> None:
        with self.cond:
            while True:
                if self.phase is None:
                    self.cond.wait()
                    continue
                if (calls := mpi_calls()) != self.calls:
                    self.since, self.calls = time.monotonic(), calls
                    self.journal.beat()
                    faulthandler.dump_traceback_later(
                        self.limit + progress.BACKSTOP, exit=True, file=self.fd
                    )
                left = self.since + self.limit - time.monotonic()
                if left > 0:
                    self.cond.wait(min(left, self.LOOK_EVERY))
                    continue
                self.report()

    def report(self) -> None:
        message = f"rank {self.rank}: {self.phase} timed out after {self.limit:g} s"
        others = f"; asking ranks on this machine (process ids {self.peers}) for their stacks"
        os.write(self.fd, f"{message}{others if self.peers else ''}\n".encode())
        faulthandler.dump_traceback(file=self.fd, all_threads=True)
        progress.ask_for_stacks(self.peers)
        # Not MPI_Abort: MPI may be what hangs. mpiexec ends the other ranks.
        os._exit(1)


def mpi_calls() -> int:
    """How many MPI calls jaxcomm's handlers have started in this process (0 until
    a test imports jaxcomm: importing it here would initialise it early)."""
    native = sys.modules.get("jaxcomm._native")
    return native.cpu.call_count() if native is not None else 0


watchdog: Watchdog | None = None
journal: progress.Journal | None = None


def pytest_configure(config):
    # pytest captures fd 2 while tests run; the watchdog writes to a copy of the
    # real one, taken with capture off, so that mpiexec's stderr carries it.
    global watchdog, journal
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        stderr = os.dup(2)
    else:
        with capture.global_and_fixture_disabled():
            stderr = os.dup(2)
    world = MPI.COMM_WORLD
    journal = progress.Journal(world.rank)
    # Where this rank writes its stacks when a peer or the launcher asks: its
    # file beside the journal, which the launcher shows under the rank's name.
    stacks = os.open(journal.stacks, os.O_WRONLY | os.O_CREAT) if journal.stacks else stderr
    faulthandler.register(progress.STACKS_SIGNAL, file=stacks, all_threads=True, chain=True)
    here = (progress.this_host(), os.getpid())
    peers = [pid for host, pid in world.allgather(here) if host == here[0] and pid != here[1]]
    watchdog = Watchdog(stderr, world.rank, peers, journal)
    watchdog.arm("<collection>", progress.TEST_LIMIT + progress.BETWEEN_TESTS)


def pytest_unconfigure(config):
    # Until the process ends: MPI_Finalize runs at exit.
    if watchdog is not None:
        watchdog.arm("<exit>", progress.TEST_LIMIT + progress.BETWEEN_TESTS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    watchdog.arm(item.nodeid, progress.TEST_LIMIT)
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
    if report.when == "teardown" and not report.failed:
        journal.finished(report.nodeid, "done")
    # A failure on one rank would leave the others waiting in a collective: abort.
    if report.failed:
        failure = f"rank {MPI.COMM_WORLD.rank}: {report.nodeid} failed\n{report.longreprtext}\n"
        journal.finished(report.nodeid, "failed", failure)
        sys.stdout.flush()
        sys.stderr.write(failure)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
