"""The per-rank suite's "asan" run (test_mpiexec.py's table says which files and
tests) with jaxcomm's C++ built with AddressSanitizer and
UndefinedBehaviorSanitizer (CMake option JAXCOMM_SANITIZE, see CONTRIBUTING.md):
a write out of bounds, a use after free or undefined behaviour ends the run with
the sanitizer's report, where a plain build may pass over it or crash elsewhere."""

import os
import re
import subprocess
from pathlib import Path

import early
import pytest
import sanitized_build
from mpirun import failure_summary, run, run_tests
from test_mpiexec import RUNS, pytest_args, suite_environment

HERE = Path(__file__).parent
RUN = "asan"  # its row in test_mpiexec.RUNS


def runtime_library(name: str) -> str:
    """The compiler's copy of a runtime library, as CMake's default compiler sees it."""
    compiler = os.environ.get("CXX", "c++")
    path = subprocess.run(
        [compiler, f"-print-file-name={name}"], capture_output=True, text=True
    ).stdout.strip()
    if not Path(path).is_absolute():
        pytest.fail(f"{compiler} has no {name}: the sanitizer build needs GCC's runtime")
    return path


def sanitizer_environment(package: Path, logs: Path) -> dict[str, str]:
    """What a rank needs to import the sanitized extension (CONTRIBUTING.md says why)."""
    preload = [runtime_library("libasan.so"), runtime_library("libstdc++.so")]
    return {
        "LD_PRELOAD": " ".join(preload),
        "ASAN_OPTIONS": f"detect_leaks=0:malloc_context_size=5:log_path={logs}/asan",
        "UBSAN_OPTIONS": f"halt_on_error=1:print_stacktrace=1:log_path={logs}/ubsan",
        "PYTHONPATH": f"{package}{os.pathsep}{HERE}",
    }


#: The early job (early.py) that builds the sanitized jaxcomm.
BUILD = "sanitized build"


def early_jobs(chosen: set[str]) -> dict[str, early.Work]:
    """The build, if the session's `chosen` tests hold this file's."""
    wanted = test_mpi_suite_under_address_and_undefined_behaviour_sanitizers.__name__ in chosen
    return {BUILD: sanitized_build.build} if wanted else {}


@pytest.fixture(scope="module")
def sanitized() -> Path:
    """A sanitized jaxcomm (sanitized_build.py): the early job's if it has finished."""
    return early.take(BUILD) or sanitized_build.build()


def reports(logs: Path) -> tuple[str, str]:
    """The sanitizers' summary lines, and their reports with C++'s template names
    cut to fit a line."""
    summaries, texts = [], []
    for log in sorted(logs.iterdir()):
        lines = log.read_text(errors="replace").splitlines()
        summaries += [line for line in lines if line.startswith("SUMMARY: ")]
        texts.append(f"--- {log.name}\n" + "\n".join(line[:240] for line in lines[:60]))
    return "; ".join(summaries), "\n".join(texts)


@pytest.mark.matrix
def test_mpi_suite_under_address_and_undefined_behaviour_sanitizers(sanitized, tmp_path):
    env = sanitizer_environment(sanitized, tmp_path)
    # The ranks import the sanitized copy, with the runtime loaded.
    probe = "import jaxcomm._native, pathlib; print(pathlib.Path('/proc/self/maps').read_text())"
    loaded = run(1, ["-c", probe], timeout=300, env=env)
    assert loaded.returncode == 0, loaded.stderr
    assert f"{sanitized}/jaxcomm/_jaxcomm_cpu" in loaded.stdout
    assert "libasan.so" in loaded.stdout

    # The files and tests that test_mpiexec.py's table puts in this run.
    args = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--color=no", *pytest_args(RUN)]
    # Unbuffered: a summary printed before a rank hangs at exit still shows.
    ranks = RUNS[RUN].ranks
    env = {"PYTHONUNBUFFERED": "1", **suite_environment(RUN), **env}
    result = run_tests(ranks, args, env=env)
    summary, found = reports(tmp_path)
    # On one line beside the test's name, where a shortened log keeps it.
    outcome = "" if result.returncode == 0 else f"; {summary or failure_summary(result)}"
    print("sanitized:", re.findall(r"\d+ passed[\w ,]* in [\d.]+s", result.stdout), outcome)
    assert not found, f"{summary or failure_summary(result)}\n{found}"
    assert result.returncode == 0, (
        f"{failure_summary(result)}\n{result.stdout[-20000:]}{result.stderr[-5000:]}"
    )
