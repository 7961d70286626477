"""Runs the per-rank suite in tests/mpi under mpiexec: the whole suite on 1 to 3
ranks, every collective at every size on 4 to 9 ranks, and the configurations
that only CI's first environment needs (marked `matrix`): the suite on 1 rank,
eager calls through JAX's dispatch, messages over 2^31 - 1 elements, and MPICH's
traffic through its network module (the suites that exchange messages)."""

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from mpirun import failure_summary, mpiexec, run

HERE = Path(__file__).parent

# MPICH sends every message, even between ranks of one machine, through
# libfabric's TCP provider on loopback: the code path of ranks on different nodes.
NETWORK = {
    "MPIR_CVAR_NOLOCAL": "1",
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "lo",
}


def run_suite(
    nprocs: int,
    tests: str | list[str],
    marks: str,
    env: dict[str, str] | None = None,
    select: str = "",
) -> None:
    """`select`: pytest's -k expression, if any."""
    tests = [tests] if isinstance(tests, str) else tests
    args = ["-m", "pytest", *tests, "-q", "-x", "-p", "no:cacheprovider", "--color=no", "-m", marks]
    args += ["-k", select] if select else []
    result = run(
        nprocs,
        args,
        timeout=900,
        env={"JAXCOMM_TEST_RANKS": str(nprocs), "PYTHONPATH": str(HERE), **(env or {})},
    )
    # One summary per rank; ranks' output may interleave on a line.
    summaries = re.findall(r"\d+ passed[\w ,]* in [\d.]+s", result.stdout)
    print(f"{nprocs} ranks:", summaries)
    # The first line of the message is what pytest's summary shows: the inner test
    # and the rank that failed it or ran out of time.
    first_line = failure_summary(result)
    assert result.returncode == 0, f"{first_line}\n{result.stdout[-20000:]}{result.stderr[-5000:]}"
    assert len(summaries) == nprocs, result.stdout[-5000:]
    assert not re.search(r"\d+ (failed|error)", result.stdout), result.stdout[-5000:]


# One rank makes few messages: the first environment runs it, the others (another
# JAX, another MPI) the suites that exchange.
@pytest.mark.parametrize("nprocs", [pytest.param(1, marks=pytest.mark.matrix), 2, 3])
def test_mpi_suite(nprocs):
    run_suite(nprocs, str(HERE / "mpi"), "not slow")


def files(*names: str) -> list[str]:
    return [str(HERE / "mpi" / f"test_{name}.py") for name in names]


# What a message's way through MPI can change: each family's exchanges at every
# size, point to point and requests, and the generated misuse.
EXCHANGES = files(
    "collectives", "p2p", "reductions", "sizes", "nonblocking", "request_safety",
    "variable_size", "counts", "graph", "neighbor_v", "checking", "misuse",
)  # fmt: skip
# What runs eagerly: every family's eager calls.
EAGER = files(
    "eager", "collectives", "p2p", "reductions", "nonblocking", "variable_size", "counts",
    "graph", "neighbor_v", "in_place", "errors",
)  # fmt: skip


# Sharded programs: the ranks are the processes of one jax.distributed program
# (tests/mpi/conftest.py starts it), so test_sharded.py and test_oracle.py run
# alone; on 4 ranks, comm.along and the oracle on a 2x2 mesh. Two ranks in every
# environment (JAX's types change between releases); the other counts in the
# first. The oracle draws other examples in each run (its seed depends on the
# rank count, JAX and MPI), per property: most where the run is cheapest and
# tells most, unless JAXCOMM_ORACLE_EXAMPLES says.
SHARDED = {"JAXCOMM_TEST_DISTRIBUTED": "1"}
ORACLE_EXAMPLES = {1: "1", 2: "3", 3: "2", 4: "1"}


@pytest.mark.parametrize(
    ("nprocs", "tests"),
    [
        pytest.param(1, "", marks=pytest.mark.matrix),
        (2, ""),
        pytest.param(3, "", marks=pytest.mark.matrix),
        pytest.param(4, "along or test_oracle", marks=pytest.mark.matrix),
    ],
)
def test_sharded_programs(nprocs, tests):
    examples = os.environ.get("JAXCOMM_ORACLE_EXAMPLES", ORACLE_EXAMPLES[nprocs])
    env = {**SHARDED, "JAXCOMM_ORACLE_EXAMPLES": examples}
    run_suite(nprocs, files("sharded", "oracle"), "not slow", env=env, select=tests)


@pytest.mark.parametrize("nprocs", [4, 5, 6, 7, 8, 9])
def test_collectives_on_more_ranks(nprocs):
    # Odd counts and non-powers of two, where MPI libraries pick other algorithms.
    run_suite(nprocs, str(HERE / "mpi" / "test_sizes.py"), "not slow")


@pytest.mark.parametrize("nprocs", [5])
def test_ordered_jit_on_more_ranks(nprocs):
    # Eager calls, jax.jit and jaxcomm.jit mixed, with loops and branches.
    run_suite(nprocs, str(HERE / "mpi" / "test_ordered_jit.py"), "not slow")


@pytest.mark.matrix
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_ordering_suites_through_jaxcomm_jit(nprocs):
    # Every jitted function of the suites about order runs under jaxcomm.jit.
    suites = [
        "test_ordering.py",
        "test_nonblocking.py",
        "test_request_safety.py",
        "test_eager.py",
        "test_control_flow_derivatives.py",
    ]
    run_suite(
        nprocs,
        [str(HERE / "mpi" / suite) for suite in suites],
        "not slow",
        env={"JAXCOMM_TEST_JIT": "jaxcomm"},
    )


# The generated misuse examples per property in the runs that repeat the suite
# under other settings: the settings are what those runs test, and the first
# runs above draw the default number.
FEWER_EXAMPLES = {"JAXCOMM_MISUSE_EXAMPLES": "2"}


@pytest.mark.matrix
def test_mpi_suite_eager_through_jax():
    # JAXCOMM_EAGER=jit sends eager calls through JAX's dispatch, not the direct path.
    run_suite(2, EAGER, "not slow", env={"JAXCOMM_EAGER": "jit", **FEWER_EXAMPLES})


@pytest.mark.matrix
@pytest.mark.parametrize("nprocs", [2, 3])
def test_messages_over_int_max_elements(nprocs):
    # 2 GiB (int8) on each of two ranks, about 4.5 GiB peak each: each test runs
    # on one rank count only.
    run_suite(nprocs, str(HERE / "mpi" / "test_large.py"), "slow")


def is_mpich() -> bool:
    version = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout
    return "HYDRA" in version


@pytest.mark.matrix
@pytest.mark.skipif(not is_mpich(), reason="MPICH's network module is MPICH's")
def test_mpi_suite_over_the_network_module():
    run_suite(3, EXCHANGES, "not slow", env={**NETWORK, **FEWER_EXAMPLES})


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
