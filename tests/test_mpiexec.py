"""Runs the per-rank suite in tests/mpi under mpiexec with 1 to 4 ranks."""

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
from mpirun import run

HERE = Path(__file__).parent


def run_suite(nprocs: int, tests: str, marks: str, env: dict[str, str] | None = None) -> None:
    args = ["-m", "pytest", tests, "-q", "-x", "-p", "no:cacheprovider", "--color=no", "-m", marks]
    result = run(
        nprocs,
        args,
        timeout=900,
        env={"JAXCOMM_TEST_RANKS": str(nprocs), "PYTHONPATH": str(HERE), **(env or {})},
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


def test_mpi_suite_eager_through_jax():
    # JAXCOMM_EAGER=jit sends eager calls through JAX's dispatch, not the direct path.
    run_suite(2, str(HERE / "mpi"), "not slow", env={"JAXCOMM_EAGER": "jit"})


def test_messages_over_int_max_elements():
    # 2 GiB per rank (int8), about 4.5 GiB peak each: run once, on 2 ranks.
    run_suite(2, str(HERE / "mpi" / "test_large.py"), "slow")


def has_cuda_module() -> bool:
    # Looked up without importing jaxcomm: that would initialise MPI in this process.
    package = importlib.util.find_spec("jaxcomm")
    folders = package.submodule_search_locations if package else []
    return any(Path(folder).glob("_jaxcomm_cuda*") for folder in folders)


@pytest.mark.skipif(
    not (has_cuda_module() and shutil.which("nvidia-smi")), reason="no CUDA module or no GPU"
)
def test_gpu_suite_staged():
    # The per-rank suite runs the GPU tests in the MPI's own mode (CUDA-aware where
    # it can be); this run forces staging, so both paths are covered.
    run_suite(2, str(HERE / "mpi" / "test_gpu.py"), "gpu", env={"JAXCOMM_CUDA_AWARE": "0"})
