"""Runs the per-rank suite in tests/mpi under mpiexec, each file in the runs where
it can fail.

RUNS says what each run can find that no other run can; FILES says, per file,
which runs those are for it. That is the whole decision: the runs, their files
and their test selections are derived from it, here and in test_sanitizer.py.
A file is left out of a run that repeats what another run of it already shows:
values on one rank decide nothing about messages, the network module nothing
about shapes, the sanitizer nothing about values.

CI runs the README's command first (the first environment: every run below),
then the suite again where one thing changes, with JAXCOMM_TEST_ENVIRONMENT
naming the change: `another-jax` (another JAX release) runs the files whose
outcome depends on how jaxcomm uses JAX, `another-mpi` (another MPI library)
those whose outcome depends on the MPI library. Runs marked `matrix` are the
extra rank counts and launch settings that `pytest -m "not matrix"` leaves out
for a quicker look.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import early
import pytest
from mpirun import failure_summary, mpiexec, run_tests

HERE = Path(__file__).parent

#: Which environment this is (see above).
ENVIRONMENT = os.environ.get("JAXCOMM_TEST_ENVIRONMENT", "first")

# MPICH sends every message, even between ranks of one machine, through
# libfabric's TCP provider on loopback: the code path of ranks on different nodes.
NETWORK = {
    "MPIR_CVAR_NOLOCAL": "1",
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "lo",
}

# The generated examples per property in the runs that repeat a file under other
# settings: the settings are what those runs test; the plain run of the file
# draws the default number.
FEWER_EXAMPLES = {
    "JAXCOMM_MISUSE_EXAMPLES": "2",
    "JAXCOMM_LOCKSTEP_EXAMPLES": "4",
    "JAXCOMM_ORACLE_EXAMPLES": "2",
}

# A test's limit where none should apply (a day): a finite number, which the
# per-rank timers take.
NO_LIMIT = 24 * 3600

# The ranks are the processes of one jax.distributed program (tests/mpi/conftest.py
# starts it), so test_sharded.py runs alone.
SHARDED = {"JAXCOMM_TEST_DISTRIBUTED": "1"}


@dataclass(frozen=True)
class Run:
    """One mpiexec run of files of tests/mpi."""

    ranks: int
    finds: str  # what it can find that no other run can
    settings: dict[str, str] = field(default_factory=dict)
    environment: str = "first"
    matrix: bool = True  # left out by -m "not matrix"
    marks: str = "not slow"  # the tests/mpi marker expression
    early: bool = False  # started in the background when the session starts (early.py)
    optimised: bool = False  # its programs compiled with LLVM's optimisations (UNOPTIMISED)


RUNS = {
    "1": Run(
        1,
        "a rank that is its own peer: messages to itself, itself as root, source "
        "and every neighbour (a periodic dimension of one rank), and a "
        "communicator of one rank (a failure there leaves no peer out of step)",
        early=True,  # one rank: it runs while tests before it leave a core idle
    ),
    "2": Run(
        2,
        "two ranks that are each other's left and right: two messages at once "
        "between one pair, matched by order and tag; and what is measured on "
        "exactly two ranks (memory per call)",
        matrix=False,
    ),
    "3": Run(
        3,
        "left and right neighbours that differ (a source and destination swapped "
        "shows, as does a graph that is not reversed), a root neither first nor "
        "last, a rank outside a send/recv pair, an odd number of ranks",
        matrix=False,
    ),
    "eager-jax": Run(
        2,
        "eager calls dispatched by JAX (JAXCOMM_EAGER=jit: one jitted function per "
        "signature, requests posted through JAX) instead of the direct path",
        {"JAXCOMM_EAGER": "jit", **FEWER_EXAMPLES},
    ),
    "jaxcomm-jit": Run(
        2,
        "the suites' jitted functions through jaxcomm.jit: order across calls kept "
        "by its marker chain, donated and static arguments numbered past the "
        "marker, an earlier call's error",
        {"JAXCOMM_TEST_JIT": "jaxcomm"},
    ),
    "network": Run(
        3,
        "messages through MPICH's network module (libfabric's TCP on loopback, the "
        "path between nodes): they arrive later and in pieces, so a receive that "
        "is read, matched or cancelled at the wrong moment shows. It is also the "
        "3-rank run of the files about messages and requests, in place of [3]: "
        "what three ranks find does not depend on the transport",
        {**NETWORK, **FEWER_EXAMPLES},
    ),
    "asan": Run(
        2,
        "jaxcomm's C++ reading or writing outside its buffers, or undefined "
        "behaviour, where the values stay right (test_sanitizer.py builds it)",
        {**FEWER_EXAMPLES},
    ),
    "large-2": Run(
        2,
        "messages of more than 2**31 - 1 elements (2 GiB per rank: each test runs "
        "on one rank count only)",
        marks="slow",
        optimised=True,
    ),
    "large-3": Run(
        3, "the same, a message that only one rank of a ring splits", marks="slow", optimised=True
    ),
    "4": Run(4, "MPI's algorithms for a power of two beyond a pair; a 2x2 mesh"),
    "5": Run(5, "MPI's algorithms for an odd count past 3, oversubscribed"),
    "9": Run(9, "the most ranks tested, four times the cores"),
    # The oracle (test_oracle.py) draws other examples in each run, its seed
    # depending on the rank count, JAX and MPI: most where a run is cheapest.
    "sharded-1": Run(
        1,
        "a jax.distributed program of one process: a mesh and lines of one device",
        {**SHARDED, "JAXCOMM_ORACLE_EXAMPLES": "1"},
        early=True,  # one process too
    ),
    # A pair (both neighbours one process) runs in the other environments
    # (jax-sharded-2, mpi-sharded-2); 3 processes find what it finds and more.
    "sharded-3": Run(
        3,
        "jax.distributed, shard_map and JAX's types, with distinct neighbours: "
        "sendrecv against ppermute",
        SHARDED,
        matrix=False,
    ),
    "sharded-4": Run(4, "comm.along on a 2x2 mesh", {**SHARDED, "JAXCOMM_ORACLE_EXAMPLES": "1"}),
    "jax-2": Run(
        2,
        "another JAX release: how jaxcomm traces, lowers, differentiates, batches "
        "and dispatches, on the pair",
        {**FEWER_EXAMPLES},
        environment="another-jax",
        matrix=False,
    ),
    "jax-sharded-2": Run(
        2,
        "another JAX release: shard_map and its types",
        {**SHARDED, **FEWER_EXAMPLES},
        "another-jax",
        False,
    ),
    "mpi-3": Run(
        3,
        "another MPI library: its calls, matching, cancelling, errors and "
        "algorithms, with distinct neighbours",
        {**FEWER_EXAMPLES},
        environment="another-mpi",
        matrix=False,
    ),
    "mpi-2": Run(
        2,
        "another MPI library on the pair: two messages at once between one pair, "
        "matched, cancelled and waited for by its rules (its collectives: mpi-3)",
        {**FEWER_EXAMPLES},
        environment="another-mpi",
        matrix=False,
    ),
    "mpi-sharded-2": Run(
        2,
        "another MPI library under jax.distributed: the oracle's programs",
        {**SHARDED, **FEWER_EXAMPLES},
        "another-mpi",
        False,
    ),
    "mpi-5": Run(
        5, "another MPI library's algorithms on an odd count past 3", {}, "another-mpi", False
    ),
}


# The decision. Per file of tests/mpi, the runs where it can find what no other
# run finds (RUNS[...].finds); "run:a|b" keeps only its tests named with a or b.
# Most files run on 3 ranks, where values are strongest; on 1 and 2 where a rank
# is its own peer or a pair is both neighbours; the settings where they reach
# the code those change (each family's eager tests through JAX, the suites about
# order through jaxcomm.jit, messages and requests over the network module, the
# C++ families under the sanitizers). A file that runs over the network module
# (3 ranks) is not run on 3 ranks again over shared memory.
FILES = {
    "autodiff": "3 asan:replicat jax-2",  # jax-2: the SPEC wants gradients on 2 too
    "checking": "2 network asan jax-2 mpi-3",
    "collectives": "1 2 3 eager-jax:eager asan jax-2 mpi-3",
    "comm": "1 2 3 jax-2 mpi-3",
    "control_flow_derivatives": "3 jaxcomm-jit jax-2 mpi-2",
    "counts": "1 3 asan jax-2",  # validated in jaxcomm, before MPI is called
    "eager": "1 3 jaxcomm-jit jax-2",  # the shortcut differs on 1 rank only
    "errors": "1 2 3 eager-jax:truncated jax-2 mpi-2",  # memory: measured on 2
    "gpu": "1 2 3",
    # 3: a graph not reversed shows; self-loops too. asan: the exchanges on every
    # graph, dtype and block shape (an empty one too), eager and jitted, blocking
    # and posted, a posted one in a loop, checking mode and a freed graph; their
    # derivatives and vmap call the same handlers on the same kinds of blocks.
    "graph": "3 asan:neighbor_exchanges|overlaps|checking_mode|subclass|freed_graph|"
    "one_rank_passes jax-2 mpi-3",
    "in_place": "1 2 3 jax-2 mpi-3",
    "large": "large-2 large-3",
    # asan: each way a computation fails, stops or refuses (every later call's
    # kind after one stop), its abandoned requests, loops that end normally; stops
    # in other places, and results that are x, reach the same C++.
    "lockstep": "1 network asan:stays_paired|dispatched_before|synchronous_failure|"
    "refuses_every_later|receive_left|another_threads|straight|makes_no_communicator|"
    "end_normally|loop_that_a_call jax-2 mpi-3",
    # asan: but the counts under jvp: its tangent's exchange (mirrored counts) and
    # checking mode's errors there run C++ that the other modes and files reach.
    "misuse": "3 asan:-eager]|-jit]|-grad]|-vmap]|neighbor_blocks|root_without|"
    "refused_count|empty_float|roots_ranks jax-2",
    # asan: but finite differences, Python's argument checks, a loop and a
    # comparison with the blocking form (the same handlers and buffers as kept
    # tests), and alltoallv's adjoint (the exchange reversed, as a kept graph is).
    "neighbor_v": "3 asan:graph_values|given_counts|cartesian|"
    "adjoint_identity_and_jvp[allgatherv]|vmap_with_counts|overflow_is_an_error|invalid_counts|"
    "checking_mode|posted_form_matches|posted_form_derivatives|posted_allgatherv_derivatives|"
    "posted_allgatherv_errors jax-2 mpi-3",
    # Before the other files of the sharded runs: after jaxcomm has run inside
    # shard_map over several processes, a rank out of step ends the job.
    "failures_between_calls": "sharded-1 sharded-3 sharded-4 jax-sharded-2 mpi-sharded-2",
    "oracle": "sharded-1 sharded-3 sharded-4 jax-sharded-2 mpi-sharded-2",
    # asan: but vmap, derivatives, cond, pytrees and the module functions (the
    # handlers and buffers of kept tests), and the refusals made in Python.
    "nonblocking": "1 2 eager-jax:eager jaxcomm-jit network asan:collective_values|"
    "logical_reduction|matches_blocking_partner|proc_null|small_leaves|overlapping_computation|"
    "test_says_done|eager_request_dropped|cross_into_another|wrong_receive_size|any_source|"
    "several_in_flight|input_used_after jax-2 mpi-2 mpi-3",
    "ordered_jit": "5 jax-2",
    "ordering": "2 3 jaxcomm-jit jax-2",
    "p2p": "1 2 eager-jax network asan jax-2 mpi-2 mpi-3",
    "properties": "3 jax-2",
    # op x dtype: MPI and C++. asan: each op x dtype's kernel eagerly (its buffers
    # are arrays of their own there); jitted, the same kernels.
    "reductions": "3 eager-jax:eager asan:allreduce[eager|scan|test_reduce|shapes|transposed|"
    "spellings|pytree|bit_for_bit mpi-3",
    "request_safety": "1 2 jaxcomm-jit network asan jax-2 mpi-2 mpi-3",
    "sharded": "sharded-1 sharded-3 sharded-4:along jax-sharded-2 mpi-sharded-2",
    # 3: every mode; the wildcard receive needs a third rank. 4, 5, 9: MPI's
    # algorithms by rank count, given the sizes eagerly and in place (donated:
    # MPI_IN_PLACE); a jitted call passes MPI what an eager one does.
    "sizes": "3 4:eager|donated|wildcard 5:eager|donated|wildcard 9:eager|donated|wildcard mpi-5",
    "topology": "1 2 3 jax-2 mpi-3",
    # asan: every pattern, mode and form, one dtype of each width, batches (vmap,
    # packed), checking mode and the failures; derivatives, loops and Python's
    # checks call the same handlers with the same kinds of buffers.
    "variable_size": "1 3 eager-jax:eager network:nonblocking|ialltoallv asan:values_match|"
    "every_dtype[bool|every_dtype[float16|every_dtype[bfloat16|every_dtype[int32|"
    "every_dtype[complex|given_recv_counts|zero_size|overflow_is_an_error|more_send_counts|"
    "checking_mode|ialltoallv_jvp_and_vmap|linear_transpose|allgatherv_and_gatherv_match|"
    "allgatherv_every_dtype|scatterv_matches|allgatherv_overflow|scatterv_overflow|"
    "family_matches_blocking|iscatterv_vmap|family_errors_at_the_wait jax-2 mpi-3",
    "vmap": "2 jax-2",  # batching rules: the same on any number of ranks
}


def files_of(run: str) -> list[tuple[Path, str]]:
    """The files of tests/mpi in `run`, each with its -k expression ("" for all)."""
    chosen = []
    for name, runs in FILES.items():
        for entry in runs.split():
            where, _, tests = entry.partition(":")
            if where == run:
                chosen.append((HERE / "mpi" / f"test_{name}.py", tests))
    return chosen


def pytest_args(run: str) -> list[str]:
    """pytest's arguments for `run`: its files, its markers, and a -k expression
    that keeps, of a file with one, only the tests it names."""
    chosen = files_of(run)
    args = [str(path) for path, _ in chosen] + ["-m", RUNS[run].marks]
    limits = [
        f"(not {path.name} or ({tests.replace('|', ' or ')}))" for path, tests in chosen if tests
    ]
    return args + (["-k", " and ".join(limits)] if limits else [])


# XLA flags that compile the suite's thousands of small test programs in less
# time, which is most of the suite's time; each is kept where this XLA knows it
# (one it does not know ends the process, hence a probe per flag). They change
# how XLA compiles the tests' own arithmetic, which the tests compare at the
# precision each states, not jaxcomm's operations: calls, which XLA does not
# compile. The examples, docs and benchmarks keep XLA's defaults.
QUICKER_COMPILES = (
    # XLA's older fusion emitter, where this XLA still has it (JAX 0.10): about
    # two thirds of the newer one's compile time.
    "--xla_cpu_use_fusion_emitters=false",
)
# No LLVM optimisation, where a test's program runs once or twice on small arrays
# (a run on 3 ranks takes about a tenth less), but not in the runs whose
# programs go over GiBs (Run.optimised: about twice their time without it).
UNOPTIMISED = "--xla_backend_optimization_level=0"


@functools.cache
def knows_flag(flag: str) -> bool:
    """Whether this XLA accepts `flag` in XLA_FLAGS."""
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = {**os.environ, "XLA_FLAGS": flag}
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


def compile_settings(optimised: bool = False) -> dict[str, str]:
    """How the per-rank suite compiles: XLA_FLAGS (this environment's, and those
    of QUICKER_COMPILES and UNOPTIMISED, unless `optimised`, that this XLA
    knows), and JAXCOMM_TEST_XLA_CACHE, where the runs of this session keep what
    they compiled (tests/mpi/conftest.py)."""
    quicker = [*QUICKER_COMPILES, *([] if optimised else [UNOPTIMISED])]
    flags = " ".join([os.environ.get("XLA_FLAGS", ""), *filter(knows_flag, quicker)]).strip()
    return {"JAXCOMM_TEST_XLA_CACHE": xla_cache(), **({"XLA_FLAGS": flags} if flags else {})}


@functools.cache
def xla_cache() -> str:
    """A folder for this session's compiled programs, removed at its end.

    The runs compile many of the same programs: a file on 3 ranks again over the
    network module, on 2 ranks again under the sanitizers, a mutant's files again
    with one change. XLA compiles an HLO module the same way every time, and JAX's
    cache key holds the module, XLA's flags and the jaxlib, so a program taken
    from the cache is the one the run would have compiled, and it calls the
    handlers of the jaxcomm this run loaded (a custom call is bound by name when
    the program is loaded). Per session, not kept: nothing stale outlives it."""
    folder = tempfile.mkdtemp(prefix="jaxcomm-xla-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def suite_environment(run: str) -> dict[str, str]:
    """The environment of the ranks of `run` (but the launcher's, mpirun.py)."""
    ranks = str(RUNS[run].ranks)
    compiles = compile_settings(RUNS[run].optimised)
    return {"JAXCOMM_TEST_RANKS": ranks, **compiles, **RUNS[run].settings}


def launch(run: str, stop: threading.Event | None = None) -> subprocess.CompletedProcess:
    """`run` under mpiexec, until it ends, or until `stop` is set (early.py)."""
    args = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--color=no", *pytest_args(run)]
    env = {"PYTHONPATH": str(HERE), **suite_environment(run)}
    if stop is None:
        # Ended only when it stops making progress (progress.py), however slow the machine.
        return run_tests(RUNS[run].ranks, args, env=env)
    # In the background it runs only when the tests leave a core free, for
    # minutes on end on a busy machine, so no limit applies: a hang is still
    # running when its test comes, which stops it and runs it again, with limits.
    env["JAXCOMM_TEST_TIMEOUT"] = str(NO_LIMIT)
    return run_tests(RUNS[run].ranks, args, env=env, stall=math.inf, stop=stop)


def early_jobs(chosen: set[str]) -> dict[str, early.Work]:
    """The early runs (Run.early) among the session's `chosen` tests."""
    names = {f"{test_mpi_suite.__name__}[{run}]": run for run in RUNS if RUNS[run].early}
    return {test: functools.partial(launch, run) for test, run in names.items() if test in chosen}


def run_suite(run: str) -> None:
    """`run` under mpiexec (the early job's, if it has finished); asserts that
    every rank passed."""
    ranks = RUNS[run].ranks
    result = early.take(f"{test_mpi_suite.__name__}[{run}]")
    started = "started early, " if result else ""
    result = result or launch(run)
    # One summary per rank; ranks' output may interleave on a line.
    summaries = re.findall(r"\d+ passed[\w ,]* in [\d.]+s", result.stdout)
    print(f"{run} ({started}{ranks} ranks):", summaries)
    # The first line of the message is what pytest's summary shows: the inner test
    # and the rank that failed it or ran out of time.
    first_line = failure_summary(result)
    assert result.returncode == 0, f"{first_line}\n{result.stdout[-20000:]}{result.stderr[-20000:]}"
    assert len(summaries) == ranks, result.stdout[-5000:]
    assert not re.search(r"\d+ (failed|error)", result.stdout), result.stdout[-5000:]


def is_mpich() -> bool:
    version = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout
    return "HYDRA" in version


def params() -> list:
    """This environment's runs (but the sanitizer's, which test_sanitizer.py makes)."""
    chosen = []
    for name, run in RUNS.items():
        if run.environment != ENVIRONMENT or name == "asan" or not files_of(name):
            continue
        marks = [pytest.mark.matrix] if run.matrix else []
        if NETWORK.items() <= run.settings.items():
            marks.append(pytest.mark.skipif(not is_mpich(), reason="the network module is MPICH's"))
        chosen.append(pytest.param(name, marks=marks))
    return chosen


@pytest.mark.parametrize("run", params())
def test_mpi_suite(run):
    run_suite(run)


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
    args = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--color=no"]
    args += [str(HERE / "mpi" / "test_gpu.py"), "-m", "gpu"]
    env = {"JAXCOMM_TEST_RANKS": "2", "PYTHONPATH": str(HERE), "JAXCOMM_CUDA_AWARE": "0"}
    result = run_tests(2, args, env=env)
    assert result.returncode == 0, f"{failure_summary(result)}\n{result.stdout[-20000:]}"


def test_every_file_of_tests_mpi_is_in_the_table():
    """A file of tests/mpi that no run names would never run; a row without its
    file, or naming a run that does not exist, is a slip."""
    on_disk = {path.stem.removeprefix("test_") for path in (HERE / "mpi").glob("test_*.py")}
    assert on_disk == set(FILES), (sorted(on_disk - set(FILES)), sorted(set(FILES) - on_disk))
    named = {entry.partition(":")[0] for runs in FILES.values() for entry in runs.split()}
    assert named <= set(RUNS), sorted(named - set(RUNS))
    assert all(files_of(run) for run in RUNS), [run for run in RUNS if not files_of(run)]
