"""How long a multi-rank test run may go without progress, and how its ranks show
their progress to the launcher (mpirun.run_tests) and their stacks when stuck.

Nothing here is a guess of how fast the machine is: a run is ended only when it
has stopped making progress, whether it takes one minute or two hours.

Every rank of a run of tests/mpi (tests/mpi/conftest.py) keeps a journal, the
file `rank-R` in the folder that JAXCOMM_TEST_PROGRESS names: its process id,
then one line per test it finishes (a failed test's report in `rank-R.failure`);
its watchdog also touches it whenever the rank has started an MPI call since
the last look. The launcher watches the
folder's files: while any of them changes, the run goes on. A process that gets
STACKS_SIGNAL writes every thread's stack to `rank-R.stacks` and ends, so that a
report shows where each rank was, under its rank's name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

#: Names the journal folder for the ranks (set by the launcher).
FOLDER = "JAXCOMM_TEST_PROGRESS"

#: Seconds a test may run on a rank without finishing and without the rank
#: starting an MPI call before the rank reports it with every rank's stacks and
#: ends the run. A test that still makes calls is never cut, however slow the
#: machine; one that stops making them for five minutes (its single longest
#: step, a compilation or a message of 2 GiB, takes seconds) is hung.
TEST_LIMIT = float(os.environ.get("JAXCOMM_TEST_TIMEOUT", "300"))

#: Extra seconds for a rank outside any test (collecting, or at exit after its
#: last test): there it may wait for peers still in a test, whose own limit
#: names that test; the extra minute lets theirs speak first.
BETWEEN_TESTS = 60.0

#: faulthandler's own timer fires this long after the watchdog should have. The
#: watchdog is a Python thread and needs the GIL; a hang in C code that holds
#: it still gets every thread's stack written, without the test's name.
BACKSTOP = 60.0

#: Seconds without a change in any rank's journal after which the launcher asks
#: every rank for its stacks and ends the run: past every limit a rank enforces
#: itself (a test's, outside a test, and faulthandler's backstop), so that it
#: catches only what no rank can report (a hang before the journal is open, as in
#: jax.distributed's start, or in a process that no longer runs Python).
STALL_LIMIT = TEST_LIMIT + BETWEEN_TESTS + BACKSTOP + 60.0

#: The signal that makes a rank write its stacks and end (faulthandler.register
#: with chain=True, then the default action). SIGUSR2: neither MPI library, JAX
#: nor Python handles it.
STACKS_SIGNAL = signal.SIGUSR2


def journal_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}"


def stacks_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.stacks"


def failure_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.failure"


class Journal:
    """A rank's side: its journal, if the launcher gave a folder."""

    def __init__(self, rank: int):
        folder = os.environ.get(FOLDER)
        self.rank = rank
        self.path = journal_path(folder, rank) if folder else None
        self.stacks = stacks_path(folder, rank) if folder else None
        if self.path:
            self.path.write_text(f"pid {os.getpid()}\n")

    def finished(self, nodeid: str, outcome: str, report: str = "") -> None:
        """A test (its teardown) finished; a failed one's `report` goes beside the
        journal, where the launcher reads it even if the job is aborted before
        mpiexec has forwarded the rank's stderr."""
        if self.path:
            if report:
                failure_path(self.path.parent, self.rank).write_text(report)
            with self.path.open("a") as journal:
                journal.write(f"{outcome} {nodeid}\n")

    def beat(self) -> None:
        """The rank made progress inside a test."""
        if self.path:
            os.utime(self.path)


def ask_for_stacks(pids: list[int], wait: float = 30.0) -> None:
    """Send STACKS_SIGNAL to each process and wait until they have ended (they
    end once their stacks are written), or `wait` seconds: the limit of a
    report that is already late, should a process ignore the signal."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACKS_SIGNAL)
    deadline = time.monotonic() + wait
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:  # no /proc here
        return True
    return state != "Z"


def this_host() -> str:
    return socket.gethostname()
