"""Launching programs under the mpiexec of the MPI that mpi4py uses."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import progress


def mpiexec() -> str:
    """The mpiexec next to this interpreter (an MPI wheel in the venv), else PATH's."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found: install an MPI (pip install mpich)")
    return found


def is_open_mpi(launcher: str) -> bool:
    out = subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout
    return "Open MPI" in out or "OpenRTE" in out or "prte" in out.lower()


#: MPICH's waits sleeping now and then (docs/performance.md: oversubscription):
#: otherwise a waiting rank polls on, and with more ranks than cores it takes
#: the time slices of the rank it waits for. Not on fewer ranks: it slows a
#: message between ranks on different cores.
MPICH_SHARING_CORES = {
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
    "MPIR_CVAR_POLLS_BEFORE_YIELD": "100",
    "MPIR_CVAR_POSIX_POLL_FREQUENCY": "100",
}


def launch_environment(env: dict[str, str] | None = None, nprocs: int = 1) -> dict[str, str]:
    """The environment for mpiexec: oversubscription is allowed and idle ranks
    yield the CPU, so more ranks than cores neither fails nor stalls."""
    full_env = dict(os.environ)
    if is_open_mpi(mpiexec()):
        full_env.update(
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            OMPI_MCA_mpi_yield_when_idle="1",
            OMPI_MCA_rmaps_base_oversubscribe="1",
        )
    elif nprocs > len(os.sched_getaffinity(0)):
        full_env.update(MPICH_SHARING_CORES)
    full_env.update(env or {})
    # `python -m` would put the working directory (the repository root, holding the
    # uncompiled source tree) first on sys.path; import the installed jaxcomm.
    full_env["PYTHONSAFEPATH"] = "1"
    return full_env


def launch_command(nprocs: int, args: list[str]) -> list[str]:
    """mpiexec running `python args...` on nprocs ranks."""
    launcher = mpiexec()
    command = [launcher, "-n", str(nprocs)]
    if is_open_mpi(launcher):
        command.append("--oversubscribe")
    return [*command, sys.executable, *args]


def run(nprocs: int, args: list[str], timeout: float, env: dict[str, str] | None = None):
    """Run `python args...` on nprocs ranks under launch_environment(env): a
    program of a few steps, which tells no one of its progress.

    Past `timeout` seconds the job is killed with SIGKILL, launcher and ranks
    (coreutils `timeout` signals its process group): a process of
    jax.distributed may ignore SIGTERM, and a launcher killed alone can leave
    its ranks running. Callers set `timeout` to catch a hang, many times what
    the program takes on a loaded machine; a run of tests uses run_tests."""
    command = launch_command(nprocs, args)
    full_env = launch_environment(env, nprocs)
    if shutil.which("timeout"):
        command = ["timeout", "-s", "KILL", f"{timeout:g}", *command]
        timeout += 60  # subprocess's own limit, should `timeout` itself hang
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)


def run_tests(
    nprocs: int,
    args: list[str],
    env: dict[str, str] | None = None,
    stall: float = progress.STALL_LIMIT,
    stop: threading.Event | None = None,
) -> subprocess.CompletedProcess:
    """Run pytest (`args` after `python`) in tests/mpi's conftest on nprocs ranks,
    for as long as it makes progress: ended only when no rank's journal
    (progress.py) has changed for `stall` seconds, after every rank has written
    its stacks, or when `stop` is set. Each rank's stacks, if it wrote any,
    follow stderr under its rank's name, as does a failed test's report that
    mpiexec did not forward."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**(env or {}), progress.FOLDER: folder}
        command, full_env = launch_command(nprocs, args), launch_environment(env, nprocs)
        result = run_watched(command, Path(folder), stall, full_env, stop)
        for rank in range(nprocs):
            failure = progress.failure_path(folder, rank)
            text = failure.read_text(errors="replace") if failure.exists() else ""
            if text and text not in result.stderr:  # mpiexec did not forward it
                result.stderr += f"\n{text}"
            stacks = progress.stacks_path(folder, rank)
            text = stacks.read_text(errors="replace") if stacks.exists() else ""
            if text:
                result.stderr += f"\n--- rank {rank}'s stacks:\n{text}"
        return result


def run_watched(
    command: list[str],
    watched: Path,
    stall: float,
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
) -> subprocess.CompletedProcess:
    """Run `command` in environment `env` (None: this one) until it ends, or until
    nothing in `watched` (or below it) has changed for `stall` seconds: then the
    processes that wrote their ids there (a journal's "pid N" line) are asked for
    their stacks, and the command's process group is killed. Killed at once
    when `stop` is set (early.py). The result's `stalled` says why it was
    ended, else it is empty."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        job = subprocess.Popen(
            command, stdout=out, stderr=err, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        last, newest, stalled = time.monotonic(), newest_change(watched), ""
        while job.poll() is None:
            if stop is not None and stop.is_set():
                stalled = "stopped"
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
                break
            if (changed := newest_change(watched)) != newest:
                last, newest = time.monotonic(), changed
            elif time.monotonic() - last > stall:
                stalled = f"no progress for {stall:g} s (nothing in {watched} changed): ended"
                progress.ask_for_stacks(journal_pids(watched))
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(timeout=min(1.0, stall / 10))
        out.seek(0), err.seek(0)
        result = subprocess.CompletedProcess(command, job.returncode, out.read(), err.read())
    result.stalled = stalled
    return result


def newest_change(folder: Path) -> float | None:
    """The latest modification time of a file in `folder` or below, or None."""
    times = []
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):  # gone meanwhile (a build's temporary file)
            times.append(path.stat().st_mtime)
    return max(times, default=None)


def journal_pids(folder: Path) -> list[int]:
    """The process ids that journals in `folder` start with."""
    pids = []
    for journal in folder.glob("rank-*"):
        first = journal.read_text().partition("\n")[0] if journal.suffix == "" else ""
        if first.startswith("pid "):
            pids.append(int(first.split()[1]))
    return pids


def rank_outputs(
    nprocs: int,
    script: str,
    *args: str,
    timeout: float = 300,  # the examples and snippets take seconds; past 5 min, hung
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run `python script args...` on nprocs ranks; each rank's stdout, in rank order
    (through rank_output.py: mpiexec may interleave ranks' output even in a line)."""
    with tempfile.TemporaryDirectory() as out:
        wrapper = str(Path(__file__).with_name("rank_output.py"))
        result = run(nprocs, [wrapper, out, script, *args], timeout=timeout, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        return [(Path(out) / f"rank-{r}.txt").read_text() for r in range(nprocs)]


def failure_summary(result: subprocess.CompletedProcess) -> str:
    """One line naming what ended a run of tests/mpi: each rank's failed or timed-out
    test (tests/mpi/conftest.py prints them to stderr), else mpiexec's exit status."""
    found = re.findall(r"rank \d+: \S+ (?:failed|timed out after [\d.]+ s)", result.stderr)
    if getattr(result, "stalled", ""):
        found.append(result.stalled)
    killed = " (killed past its time limit)" if result.returncode in (-9, 137) else ""
    return "; ".join(sorted(set(found))) or f"mpiexec exited with {result.returncode}{killed}"
