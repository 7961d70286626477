"""Launching programs under the mpiexec of the MPI that mpi4py uses."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


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


def launch_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for mpiexec: oversubscription is allowed and idle ranks
    yield the CPU, so more ranks than cores neither fails nor stalls."""
    full_env = dict(os.environ, **(env or {}))
    if is_open_mpi(mpiexec()):
        full_env.update(
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            OMPI_MCA_mpi_yield_when_idle="1",
            OMPI_MCA_rmaps_base_oversubscribe="1",
        )
    # `python -m` would put the working directory (the repository root, holding the
    # uncompiled source tree) first on sys.path; import the installed jaxcomm.
    full_env["PYTHONSAFEPATH"] = "1"
    return full_env


def run(nprocs: int, args: list[str], timeout: float, env: dict[str, str] | None = None):
    """Run `python args...` on nprocs ranks under launch_environment(env).

    Past `timeout` seconds the job is killed with SIGKILL, launcher and ranks
    (coreutils `timeout` signals its process group): a process of
    jax.distributed may ignore SIGTERM, and a launcher killed alone can leave
    its ranks running."""
    launcher = mpiexec()
    command = [launcher, "-n", str(nprocs)]
    if is_open_mpi(launcher):
        command.append("--oversubscribe")
    full_env = launch_environment(env)
    command += [sys.executable, *args]
    if shutil.which("timeout"):
        command = ["timeout", "-s", "KILL", f"{timeout:g}", *command]
        timeout += 60  # subprocess's own limit, should `timeout` itself hang
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)


def rank_outputs(
    nprocs: int,
    script: str,
    *args: str,
    timeout: float = 300,
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
    killed = " (killed past its time limit)" if result.returncode in (-9, 137) else ""
    return "; ".join(sorted(set(found))) or f"mpiexec exited with {result.returncode}{killed}"
