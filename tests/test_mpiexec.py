"""Runs the per-rank suite in tests/mpi under mpiexec with 1 to 4 ranks."""

import re
from pathlib import Path

import pytest
from mpirun import run

HERE = Path(__file__).parent


def run_suite(nprocs: int, tests: str, marks: str) -> None:
    args = ["-m", "pytest", tests, "-q", "-x", "-p", "no:cacheprovider", "--color=no", "-m", marks]
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


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_mpi_suite(nprocs):
    run_suite(nprocs, str(HERE / "mpi"), "not slow")


def test_messages_over_int_max_elements():
    # 2 GiB per rank (int8), about 4.5 GiB peak each: run once, on 2 ranks.
    run_suite(2, str(HERE / "mpi" / "test_large.py"), "slow")
