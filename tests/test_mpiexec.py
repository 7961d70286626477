"""Runs the per-rank suite in tests/mpi under mpiexec with 1 to 4 ranks."""

import os
import re
from pathlib import Path

import pytest
from mpirun import run

HERE = Path(__file__).parent


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_mpi_suite(nprocs):
    # The >2**31-element test is opt-in (JAXCOMM_TEST_MARKS=slow): on this 2-core,
    # 24 GiB machine it was killed for memory.
    marks = os.environ.get("JAXCOMM_TEST_MARKS", "not slow")
    args = ["-m", "pytest", str(HERE / "mpi"), "-q", "-x", "-p", "no:cacheprovider", "--color=no"]
    if marks:
        args += ["-m", marks]
    result = run(
        nprocs,
        args,
        timeout=900,
        env={"JAXCOMM_TEST_RANKS": str(nprocs), "PYTHONPATH": str(HERE)},
    )
    # One summary per rank; ranks' output may interleave on a line.
    summaries = re.findall(r"\d+ passed[\w ,]* in [\d.]+s", result.stdout)
    print(f"{nprocs} ranks:", summaries)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert len(summaries) == nprocs, result.stdout[-5000:]
    assert not re.search(r"\d+ (failed|error)", result.stdout), result.stdout[-5000:]
