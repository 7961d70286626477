"""Seeded mutations of jaxcomm, each run against the tests that
tests/test_mpiexec.py's table (FILES) gives the file of tests/mpi that tests the
mutated code: the evidence that the table keeps every mutation caught.

    .venv/bin/python tests/mutations/run.py               # every mutation
    .venv/bin/python tests/mutations/run.py skipped-cancel wrong-tag
    .venv/bin/python tests/mutations/run.py --old NAME    # the runs before the cut
    .venv/bin/python tests/mutations/run.py --asan        # the sanitizer's mutations

A mutation is applied to a copy of the installed jaxcomm in build/mutants/, never
to the source tree or the venv; a C++ one is compiled from a copy of the sources
into its own build folder (incremental: one file recompiles). The copy goes first
on PYTHONPATH, as the sanitizer's run does. The runs of the mutation's files are
tried in the table's order, each as test_mpiexec.py launches it (-x), until one
fails; a mutation no run catches is "MISSED" and the script exits 1. CI's
later environments are left out: a catch here is a catch in the README's command.

The sanitizer's run needs its own build, so it has its own mutations: memory
errors whose values stay right (a read one past a buffer, of its rows or counts),
which only it can see. `--asan` builds each of them with the sanitizers, as
test_sanitizer.py does (in build/mutants/asan-build), and runs the asan entries
of its files' rows, in that test's environment; a sanitizer's report, or a
failed test, is a catch. Without `--asan` a sanitizer's mutation named on the
command line runs in the other runs, where it should pass (values stay right).

A mutant that hangs is caught by the per-test limit (progress.py), lowered here
to JAXCOMM_TEST_TIMEOUT=120 s unless set.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("JAXCOMM_TEST_TIMEOUT", "120")  # before progress.py reads it

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

from mpirun import failure_summary, run_tests  # noqa: E402
from test_mpiexec import FILES, NETWORK, RUNS, compile_settings, is_mpich  # noqa: E402
from test_sanitizer import reports, sanitizer_environment  # noqa: E402

WORK = ROOT / "build" / "mutants"


@dataclass(frozen=True)
class Mutation:
    """`old` (once in `path`) replaced by `new`; `files`: the files of tests/mpi
    that test that code (their rows of FILES are the runs tried)."""

    name: str
    path: str
    old: str
    new: str
    files: tuple[str, ...]
    bug: str
    sanitizer: bool = False  # a memory error only the sanitizer's run sees (--asan)


# Left out: a posted alltoallv that leaves MPI its counts in arrays freed when the
# start returns (Transfer::keep in cpp/variable_size.cc) passes every run, before
# the cut as after it: MPICH reads the counts during the start.
MUTATIONS = [
    Mutation(
        "skipped-cancel",
        "cpp/requests.cc",
        "    MPI_Cancel(&request);\n    unmatched = true;",
        "    unmatched = true;",
        ("request_safety",),
        "a dropped receive is not cancelled: it takes a later message",
    ),
    Mutation(
        "missing-wait",
        "cpp/requests.cc",
        "  MPI_Status* statuses = statuses_of(pending);\n  if (!pending.done) {",
        "  MPI_Status* statuses = statuses_of(pending);\n"
        "  if (!pending.done && pending.requests.size() > 1) {",
        ("nonblocking",),
        "wait() of a request of one MPI request copies the result out without MPI_Wait",
    ),
    Mutation(
        "tangent-tag-unchecked",
        "cpp/requests.cc",
        "  if (tangent_of != nullptr && status != nullptr && status[1] != tangent_of[1])",
        "  if (false && tangent_of != nullptr && status != nullptr && status[1] != tangent_of[1])",
        ("autodiff",),
        "the tangent of a receive from ANY_TAG is taken from another message, silently",
    ),
    Mutation(
        "wrong-root-bcast",
        "cpp/collectives.cc",
        "  const bool is_root = comm_rank(comm) == root;\n  if (is_root) copy_if_distinct",
        "  const bool is_root = comm_rank(comm) == 0;\n  if (is_root) copy_if_distinct",
        ("collectives",),
        "bcast takes rank 0 for the root",
    ),
    Mutation(
        "wrong-root-reduce",
        "cpp/reductions.cc",
        "  if (comm_rank(comm) != root) {",
        "  if (comm_rank(comm) != 0) {",
        ("reductions",),
        "reduce's in-place/result handling takes rank 0 for the root",
    ),
    Mutation(
        "displacement-off-by-one",
        "cpp/variable_size.cc",
        "      out.starts[i] = start;",
        "      out.starts[i] = i > 0 ? start - 1 : start;",
        ("variable_size", "neighbor_v"),
        "alltoallv's displacements after the first peer one element early",
    ),
    Mutation(
        "wrong-datatype-size",
        "cpp/p2p.cc",
        "pending.own_copy(data, static_cast<size_t>(n) * static_cast<size_t>(width));",
        "pending.own_copy(data, static_cast<size_t>(n) * sizeof(float));",
        ("p2p",),
        "an eager send copies 4 bytes per element, whatever the dtype's width",
    ),
    Mutation(
        "wrong-tag",
        "cpp/p2p.cc",
        "MPI_Irecv(recv_data, recv_n, recv_type, source, recv_tag, comm, &requests[0]);",
        "MPI_Irecv(recv_data, recv_n, recv_type, source, send_tag, comm, &requests[0]);",
        ("p2p",),
        "an eager sendrecv receives with its sendtag",
    ),
    Mutation(
        "in-place-aliased",
        "cpp/collectives.cc",
        "const void* in = bytes(out) == bytes(x) ? MPI_IN_PLACE : x.untyped_data();",
        "const void* in = x.untyped_data();",
        ("in_place",),
        "a donated alltoall passes one buffer as MPI's input and output, not MPI_IN_PLACE",
    ),
    Mutation(
        "transpose-sign",
        "jaxcomm/_reductions.py",
        "    return total - exscan(ct, comm=comm, op=ReduceOp.SUM)",
        "    return total + exscan(ct, comm=comm, op=ReduceOp.SUM)",
        ("autodiff",),
        "scan's transpose adds the exclusive prefix instead of subtracting it",
    ),
    Mutation(
        "gather-transpose-sign",
        "jaxcomm/_collectives.py",
        "    return [rows if comm.rank == root else rows + ct]",
        "    return [rows if comm.rank == root else rows - ct]",
        ("autodiff",),
        "gather's transpose subtracts, off the root, the cotangent of the x it returns there",
    ),
    Mutation(
        "cotangent-scaled-on-one-rank",
        "jaxcomm/_collectives.py",
        "    return [_sharded.own_row(ct, comm)]",
        "    return [_sharded.own_row(ct, comm) * (2.0 if comm.rank == 1 else 1.0)]",
        ("autodiff",),
        "allgather's cotangent is doubled on rank 1 only (the ranks' sum moves too)",
    ),
    Mutation(
        "max-tangent-wrong-element",
        "jaxcomm/_reductions.py",
        "return allreduce(jnp.where(hit, t, 0), comm=comm, op=ReduceOp.SUM) / ties",
        "return allreduce(jnp.where(hit, jnp.roll(t, 1), 0), comm=comm, op=ReduceOp.SUM) / ties",
        ("autodiff",),
        "allreduce's MAX/MIN tangent takes, on the rank holding the extremum, another element's",
    ),
    Mutation(
        "transpose-wrong-root",
        "jaxcomm/_reductions.py",
        "from_root = pvary(bcast(ct, comm=comm, root=root), comm=comm)",
        "from_root = pvary(bcast(ct, comm=comm, root=0), comm=comm)",
        ("autodiff",),
        "reduce's transpose broadcasts the cotangent from rank 0, not the root",
    ),
    Mutation(
        "transpose-not-reversed",
        "jaxcomm/_p2p.py",
        "        source=dest,\n        dest=source,\n        sendtag=known_tag",
        "        source=source,\n        dest=dest,\n        sendtag=known_tag",
        ("autodiff", "p2p"),
        "sendrecv's cotangent goes on to dest instead of back to source",
    ),
    Mutation(
        "graph-not-reversed",
        "jaxcomm/_collectives.py",
        "        return self.reverse, Neighborhood(self.destinations, self.sources, comm)",
        "        return comm, self",
        ("graph",),
        "a neighbour exchange's transpose goes over the graph itself, not the reversed one",
    ),
    Mutation(
        "rows-start-off-by-one",
        "jaxcomm/_variable_size.py",
        "jnp.where(jnp.arange(counts.shape[0]) < rank, counts, 0)",
        "jnp.where(jnp.arange(counts.shape[0]) <= rank, counts, 0)",
        ("variable_size", "autodiff"),
        "a rank's rows in allgatherv's cotangent start after its own count",
    ),
    Mutation(
        "result-is-x-in-shard-map",
        "jaxcomm/_primitive.py",
        "            and not spans_processes(ctx)\n        ):",
        "        ):",
        ("sharded",),
        "inside shard_map over processes, bcast's root (reduce's other ranks) returns x in "
        "x's buffer, the others a buffer of their own: the programs differ, and XLA runs "
        "JAX's psum before the call on some processes only (a hang)",
    ),
    Mutation(
        "row-by-constant-rank",
        "jaxcomm/_sharded.py",
        "        index = same_program(np.int32(comm.rank))",
        "        return x[comm.rank]",
        ("sharded",),
        "inside shard_map, a transpose takes its own row of a communicator not made by "
        "along() at a constant index: each process compiles another program",
    ),
    Mutation(
        "invariant-zero-tangent",
        "jaxcomm/_jax_internals/tangents.py",
        "    return vary(zeros, varying(aval))",
        "    return zeros",
        ("sharded",),
        "the zero tangent of a varying operand without one is typed invariant inside "
        "shard_map: grad with respect to an invariant weight alone fails to trace",
    ),
    Mutation(
        "eager-jit-fuse-traced",
        "jaxcomm/_dispatch.py",
        "@partial(jax.jit, static_argnums=(0, 1, 2, 3))",
        "@partial(jax.jit, static_argnums=(0, 1, 2))",
        ("collectives",),
        "eager calls through JAX (JAXCOMM_EAGER=jit) trace the fusion switch",
    ),
    Mutation(
        "making-comms-unrefused",
        "jaxcomm/comm.py",
        "[] if key is None else [key])) is not None:",
        "[])) is not None and False:",
        ("lockstep",),
        "a rank that owes an operation, or is out of step, makes a communicator: MPI's "
        "collective inside pairs with the operation its peers wait in",
    ),
    Mutation(
        "loop-constant-untied",
        "jaxcomm/_jax_internals/tangents.py",
        "        return [_tied_to_an_input(trace, x) for x in args]",
        "        return args",
        ("control_flow_derivatives",),
        "a call of constants traced in a loop body is not tied to the body's inputs: "
        "jax.checkpoint nested in the body moves it out of the loop on some ranks only",
    ),
    Mutation(
        "loop-owes-nothing",
        "jaxcomm/_lockstep.py",
        "    return BRACKETED if placeable else _UNTRACKED",
        "    return _UNTRACKED",
        ("lockstep",),
        "under jax.jit, a loop, conditional or nested jit with jaxcomm calls is not bracketed: "
        "a computation stopped in it leaves the rank in step, and its next call pairs with a "
        "later call of its peers",
    ),
    Mutation(
        "loop-lowered-once",
        "jaxcomm/_jax_internals/lowering_hooks.py",
        "        if COMM_EFFECT in eqn.effects:\n            return _in_place",
        "        if False:\n            return _in_place",
        ("lockstep",),
        "JAX's lowering cache copies a loop with jaxcomm calls: its settling call keeps the "
        "attributes it had when copied, and settles though a later call follows the loop",
    ),
    Mutation(
        "cond-not-settled",
        "jaxcomm/_jax_internals/lowering_hooks.py",
        "        _settle(after)\n",
        '        _settle(after) if primitive.name != "cond" else '
        "after.set_tokens_out(inner.tokens_out)\n",
        ("lockstep",),
        "no settling call after a lax.cond with jaxcomm calls: a computation that ended "
        "normally still owes them, and the next call is refused",
    ),
    Mutation(
        "entered-owes-nothing",
        "cpp/lockstep.cc",
        "  if (may_run(run.run_id, comms)) ran(run.run_id, comms, /*last=*/false, kRegion);",
        "  may_run(run.run_id, comms);",
        ("lockstep",),
        "jaxcomm_entered records nothing owed: a computation stopped inside a loop leaves the "
        "rank in step",
    ),
    Mutation(
        "jit-argnums-unshifted",
        "jaxcomm/_jit.py",
        "return tuple(n + 1 if n >= 0 else n for n in numbers)",
        "return tuple(numbers)",
        ("ordered_jit", "request_safety", "ordering", "eager", "nonblocking"),
        "jaxcomm.jit's static/donated argument numbers not shifted past its marker",
    ),
    Mutation(
        "checking-fuses-leaves",
        "jaxcomm/_fusion.py",
        "return elementwise and not checking",
        "return elementwise",
        ("checking",),
        "in checking mode small leaves still travel as one message: leaves that differ between "
        "ranks but add up alike pair silently",
    ),
    Mutation(
        "structure-unchecked",
        "jaxcomm/_dispatch.py",
        "if comm.check and _structure.compared(primitive, tree):",
        "if False:",
        ("checking",),
        "in checking mode pytrees whose leaves differ in number or names between ranks pair "
        "leaf by leaf, silently where the shapes agree",
    ),
    Mutation(
        "posted-structure-unchecked",
        "jaxcomm/_requests.py",
        "    agree_on_structure(start_p, x, tree, comm)\n",
        "",
        ("checking",),
        "the same for non-blocking posts",
    ),
    Mutation(
        "structure-without-static-data",
        "jaxcomm/_structure.py",
        "            found.append(_plain(data[1]))\n",
        "",
        ("checking",),
        "only the leaves' paths are compared: a custom node without keys whose leaves' order "
        "differs between ranks pairs them silently",
    ),
    Mutation(
        "structure-keys-as-written",
        "jaxcomm/_structure.py",
        'return f"[{_plain(key.key)}]"',
        'return f"[{key.key!r}]"',
        ("checking",),
        "dict keys compared as each process writes them: keys Python holds equal (1, 1.0, "
        "np.int64(1)) raise a false mismatch",
    ),
    # Counts and capacities that do not fit, refused by one comparison each: only
    # an example on the boundary (one row too many) shows an off-by-one, and
    # test_misuse.py draws such examples per operation and mode (its EXAMPLES).
    Mutation(
        "excess-count-unrefused",
        "cpp/counts.cc",
        "if (!valid() || most_ <= rows) return;",
        "if (!valid() || most_ <= rows + 1) return;",
        ("misuse", "variable_size"),
        "send counts that add up to one row more than x has pass: MPI reads a row past x",
    ),
    Mutation(
        "overflow-by-one-unrefused",
        "cpp/variable_size.cc",
        "return received.valid() && received.most() <= capacity_;",
        "return received.valid() && received.most() <= capacity_ + 1;",
        ("misuse", "variable_size"),
        "one row more than capacity arriving is not an overflow: the result silently lacks it",
    ),
    Mutation(
        "negative-capacity-unrefused",
        "jaxcomm/_checks.py",
        "    if rows < 0:\n",
        "    if rows < -1:\n",
        ("misuse", "variable_size"),
        "capacity=-1 is taken as a number of rows",
    ),
    Mutation(
        "rank-past-size-unrefused",
        "jaxcomm/_checks.py",
        "if 0 <= rank < size or rank in wildcards:",
        "if 0 <= rank <= size or rank in wildcards:",
        ("misuse",),
        "a root, source or destination equal to the communicator's size reaches MPI",
    ),
    # The sanitizer's (--asan): each reaches code, or a kind of buffer, that only
    # some of its files' tests reach, so an asan entry that drops them shows.
    Mutation(
        "posted-rows-overread",
        "cpp/variable_size.cc",
        "? pending_.own_copy(x.untyped_data(), x.size_bytes())",
        "? pending_.own_copy(x.untyped_data(), x.size_bytes() ? x.size_bytes() + 1 : 0)",
        ("variable_size", "neighbor_v", "misuse"),
        "a posted variable-size exchange copies one byte past x into its request",
        sanitizer=True,
    ),
    Mutation(
        "packed-rows-overread",
        "cpp/variable_size.cc",
        ": pending_.own_copy(from.packed.data(), from.packed.size());",
        ": pending_.own_copy(from.packed.data(), from.packed.size() + 1);",
        ("variable_size", "neighbor_v", "misuse"),
        "a posted variable-size exchange under vmap copies one byte past the rows it packed",
        sanitizer=True,
    ),
    # Where a count operand is an array of its own (an eager call's), not a slice
    # of a computation's buffers: reading past it may find anything, and a
    # negative value sends the counts down the slower path, to the same values.
    Mutation(
        "counts-overread",
        "cpp/counts.cc",
        "std::all_of(values_.begin(), values_.end(), [](int c)",
        "std::all_of(values_.begin(), values_.end() + 1, [](int c)",
        ("variable_size", "neighbor_v", "misuse"),
        "int32 counts are checked for negatives reading one count past the count operand",
        sanitizer=True,
    ),
]


def installed_package() -> Path:
    spec = importlib.util.find_spec("jaxcomm")  # located, not imported (no MPI_Init)
    if spec is None or spec.origin is None:
        sys.exit("jaxcomm is not installed in this interpreter's environment")
    return Path(spec.origin).parent


def tracked_sources() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if not line.startswith("tests/")]


def sync(source: Path) -> None:
    """source/ holds the tracked files as they are in the worktree; unchanged files
    keep their times, so the build recompiles only what differs."""
    for name in tracked_sources():
        original, copy = ROOT / name, source / name
        if not original.is_file():
            continue
        data = original.read_bytes()
        if not copy.exists() or copy.read_bytes() != data:
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(data)


def mutated(text: str, m: Mutation) -> str:
    if text.count(m.old) != 1:
        sys.exit(f"{m.name}: its text occurs {text.count(m.old)} times in {m.path}, not once")
    return text.replace(m.old, m.new)


def build_mutant(m: Mutation, sanitize: bool = False) -> Path:
    """A folder holding jaxcomm with `m` applied, to go first on PYTHONPATH; its C++
    built with the sanitizers if `sanitize` (as test_sanitizer.py builds it)."""
    package = WORK / "package"
    shutil.rmtree(package, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(installed_package(), package / "jaxcomm", ignore=ignore)
    if m.path.startswith("jaxcomm/") and not sanitize:
        target = package / m.path
        target.write_text(mutated(target.read_text(), m))
        return package
    if m.path.startswith("jaxcomm/"):
        sys.exit(f"{m.name}: --asan takes C++ mutations only")
    kind = "asan-" if sanitize else ""
    source, built = WORK / "source", WORK / f"{kind}cpp-package"
    sync(source)
    (source / m.path).write_text(mutated((ROOT / m.path).read_text(), m))
    shutil.rmtree(built, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    command += ["--target", str(built), f"-Cbuild-dir={WORK / f'{kind}cpp-build'}", str(source)]
    if sanitize:  # test_sanitizer.py's options: symbols and line tables kept
        command += ["-Ccmake.define.JAXCOMM_SANITIZE=ON", "-Cinstall.strip=false"]
    cores = str(len(os.sched_getaffinity(0)))
    env = {"CMAKE_BUILD_PARALLEL_LEVEL": cores, **os.environ}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"{m.name}: the build failed\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    for module in (package / "jaxcomm").glob("_jaxcomm_cpu*"):
        module.unlink()
    for module in (built / "jaxcomm").glob("_jaxcomm_cpu*"):
        shutil.copy2(module, package / "jaxcomm" / module.name)
    return package


@dataclass(frozen=True)
class Launch:
    """One run of one file: its ranks, settings and -k expression."""

    label: str
    file: str
    ranks: int
    settings: dict
    tests: str = ""
    marks: str = "not slow"


def new_launches(m: Mutation, asan: bool = False) -> list[Launch]:
    """The table's runs of m's files in the README's command (first environment):
    the sanitizer's run if `asan`, else the others."""
    launches = []
    for stem in m.files:
        for entry in FILES[stem].split():
            run, _, tests = entry.partition(":")
            if RUNS[run].environment != "first" or (run == "asan") != asan:
                continue
            r, tests = RUNS[run], tests.replace("|", " or ")
            launches.append(Launch(run, stem, r.ranks, r.settings, tests, r.marks))
    return launches


# Before the cut (86049c8^): every file on 1, 2 and 3 ranks; eagerly through JAX,
# over the network module and through jaxcomm.jit (1-3 ranks), these files.
OLD_EAGER = (
    "eager", "collectives", "p2p", "reductions", "nonblocking", "variable_size", "counts",
    "graph", "neighbor_v", "in_place", "errors",
)  # fmt: skip
OLD_NETWORK = (
    "collectives", "p2p", "reductions", "sizes", "nonblocking", "request_safety",
    "variable_size", "counts", "graph", "neighbor_v", "checking", "misuse",
)  # fmt: skip
OLD_JIT = ("ordering", "nonblocking", "request_safety", "eager")


def old_launches(m: Mutation, asan: bool = False) -> list[Launch]:
    if asan:  # before the sanitizer's -k expressions: every test of each file
        return [Launch("asan", stem, 2, RUNS["asan"].settings) for stem in m.files]
    launches = []
    for stem in m.files:
        launches += [Launch(str(n), stem, n, {}) for n in (1, 2, 3)]
        if stem in OLD_EAGER:
            launches.append(Launch("eager-jax", stem, 2, RUNS["eager-jax"].settings))
        if stem in OLD_JIT:
            jit = RUNS["jaxcomm-jit"].settings
            launches += [Launch(f"jaxcomm-jit-{n}", stem, n, jit) for n in (1, 2, 3)]
        if stem in OLD_NETWORK:
            launches.append(Launch("network", stem, 3, RUNS["network"].settings))
        if stem == "sizes":
            launches += [Launch(str(n), stem, n, {}) for n in (4, 5, 6, 7, 8, 9)]
        if stem == "ordered_jit":
            launches.append(Launch("5", stem, 5, {}))
    return launches


def launch(package: Path, run: Launch):
    """The run's result, and the sanitizers' summary lines where it is the
    sanitizer's (test_sanitizer.py's environment: their logs in WORK/logs)."""
    args = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--color=no"]
    args += [str(TESTS / "mpi" / f"test_{run.file}.py"), "-m", run.marks]
    args += ["-k", run.tests] if run.tests else []
    env = {
        "JAXCOMM_TEST_RANKS": str(run.ranks),
        "PYTHONPATH": f"{package}{os.pathsep}{TESTS}",
        "JAXCOMM_TEST_TIMEOUT": os.environ["JAXCOMM_TEST_TIMEOUT"],
        **compile_settings(),
        **run.settings,
    }
    if run.label != "asan":
        return run_tests(run.ranks, args, env=env), ""
    logs = WORK / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    env = {"PYTHONUNBUFFERED": "1", **env, **sanitizer_environment(package, logs)}
    result = run_tests(run.ranks, args, env=env)
    summary, found = reports(logs)  # a summary line per rank that saw it: the first
    return result, summary.split("; ")[0] or ("sanitizer report" if found else "")


def failed_test(result) -> str:
    """The inner test that failed or hung, and on which rank (tests/mpi/conftest.py
    prints it), else how the run ended."""
    return failure_summary(result).replace(str(TESTS) + "/", "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--old", action="store_true", help="the runs before the cut")
    parser.add_argument("--list", action="store_true", help="list the mutations")
    parser.add_argument(
        "--asan", action="store_true", help="the sanitizer's run, and by default its mutations"
    )
    options = parser.parse_args()
    named = [m for m in MUTATIONS if m.name in options.names]
    chosen = named or [m for m in MUTATIONS if m.sanitizer == options.asan and not options.names]
    if options.list or not chosen:
        for m in MUTATIONS:
            asan = " (--asan)" if m.sanitizer else ""
            print(f"{m.name:26} {m.path:40} {' '.join(m.files):20} {m.bug}{asan}")
        return 0
    missed = []
    rows = ["| mutation | code | tests/mpi file | run | caught by | s |", "|---" * 6 + "|"]
    for m in chosen:
        started = time.monotonic()
        package = build_mutant(m, sanitize=options.asan)
        print(f"{m.name}: built in {time.monotonic() - started:.0f} s", flush=True)
        found = None
        launches = (old_launches if options.old else new_launches)(m, options.asan)
        for run in launches:
            if NETWORK.items() <= run.settings.items() and not is_mpich():
                continue
            started = time.monotonic()
            result, reported = launch(package, run)
            seconds = time.monotonic() - started
            failed = re.search(r"\d+ (failed|error)", result.stdout)
            caught = reported or result.returncode != 0 or failed
            outcome = f"CAUGHT {reported or failed_test(result)}" if caught else "passed"
            where = f"{run.label} ({run.file}, {run.ranks} ranks)"
            print(f"  {where}: {outcome} in {seconds:.0f} s", flush=True)
            if caught:
                found = (run, reported or failed_test(result), seconds)
                break
        if found is None:
            missed.append(m.name)
            rows.append(f"| {m.name} | {m.path} | {' '.join(m.files)} | - | MISSED | - |")
        else:
            run, test, seconds = found
            cells = [m.name, m.path, run.file, run.label, test, f"{seconds:.0f}"]
            rows.append("| " + " | ".join(cells) + " |")
    shutil.rmtree(WORK / "package", ignore_errors=True)
    print("\n".join(rows))
    if missed:
        print("MISSED:", " ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
