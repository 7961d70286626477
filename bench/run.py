"""jaxcomm's benchmark suite: per-call latency of each op against raw C MPI,
mpi4py, mpi4jax (when installed) and jaxcomm itself, side by side in one job.

    mpiexec -n 2 python bench/run.py            # full suite: table, JSON lines, PNG
    mpiexec -n 2 python bench/run.py --quick    # small sizes, few repetitions

Backends that run only when --backends names them: jaxcomm-jit-check,
jaxcomm-jax.jit and jaxcomm-jaxcomm.jit (one jitted step per Python call), and
gloo-jit and gloo-jax.jit, JAX's own collectives through shard_map (the ranks
become one jax.distributed job first; end a stuck run with timeout -s KILL).

Each (op, size) is checked against NumPy on every backend before it is timed; a
wrong result stops the run. For each repetition the backends run in turn
(interleaved), each timing a loop long enough to last --min-time; the time per
call of a repetition is the slowest rank's. The table shows the median over
repetitions (and the minimum in the JSON) with the ratio to C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

# Every backend communicates from memory of the same kind. NumPy asks the kernel
# for transparent huge pages on its large arrays and XLA does not; where THP is
# "madvise" (the usual default), that alone made jaxcomm's bcast 1.5-2x C at
# 4-16 MiB on the development machine. Set before NumPy is imported,
# which reads it then.
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent))
import backends as B
from sizes import human

HERE = Path(__file__).parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(B.OPS), help="comma-separated ops")
    parser.add_argument("--min-bytes", type=int, default=4)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--reps", type=int, default=9, help="repetitions (at least 9 for reports)")
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per timed loop")
    parser.add_argument(
        "--backends",
        default="",
        help=f"comma-separated subset (default: all but {', '.join(ON_REQUEST)})",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output folder")
    parser.add_argument("--quick", action="store_true", help="4 B to 4 KiB, 3 repetitions")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--device",
        choices=["cpu", "gpu"],
        default="cpu",
        help="where the JAX backends' arrays live; gpu leaves out the host-only C and mpi4py",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.max_bytes, args.reps = min(args.max_bytes, 4096), min(args.reps, 3)
        args.min_time = min(args.min_time, 0.002)
    return args


#: Backends that run only when --backends names them: checking mode's cost, one
#: jitted step per Python call, and JAX's own collectives (which make the ranks
#: one jax.distributed job first).
ON_REQUEST = (
    "jaxcomm-jit-check",
    "jaxcomm-jax.jit",
    "jaxcomm-jaxcomm.jit",
    "gloo-jit",
    "gloo-jax.jit",
)


def make_backends(comm: MPI.Intracomm, wanted: set[str], build_dir: Path) -> list[B.Backend]:
    library = B.build_raw_mpi(build_dir) if comm.rank == 0 else None
    comm.Barrier()  # rank 0 compiled the C library; the others find it built
    found: list[B.Backend] = [B.RawMPI(comm, library or B.build_raw_mpi(build_dir)), B.Mpi4py(comm)]
    if B.mpi4jax_available():
        found += [B.Mpi4jaxBackend(comm, mode="jit"), B.Mpi4jaxBackend(comm, mode="eager")]
        found.append(B.Mpi4jaxBackend(comm, mode="jit", live=True))
    found += [B.JaxcommBackend(comm, mode="jit"), B.JaxcommBackend(comm, mode="eager")]
    found.append(B.JaxcommBackend(comm, mode="jit", live=True))
    if "jaxcomm-jit-check" in wanted:
        found.append(B.JaxcommBackend(comm, mode="jit", check=True))
    found += [
        B.JaxcommBackend(comm, mode=m)
        for m in ("jax.jit", "jaxcomm.jit")
        if f"jaxcomm-{m}" in wanted
    ]
    found += [B.JaxCollectives(comm, mode=m) for m in ("jit", "jax.jit") if f"gloo-{m}" in wanted]
    if B.DEVICE is not None and B.DEVICE.platform != "cpu":
        found = [b for b in found if not isinstance(b, (B.RawMPI, B.Mpi4py))]
    return [b for b in found if b.name in wanted or (not wanted and b.name not in ON_REQUEST)]


def slowest_per_call(comm: MPI.Intracomm, case: B.Case, iters: int, name: str) -> float:
    """Seconds per call on the slowest rank. A JAX loop's time is a difference
    between two executions, which noise can make negative when the machine is
    busy: all ranks then measure again, a few times at most."""
    for _ in range(5):
        comm.Barrier()
        per_call = comm.allreduce(case.time(iters) / iters, op=MPI.MAX)
        if per_call > 0:
            return per_call
    raise SystemExit(f"bench: {name}: no positive time in 5 tries; raise --min-time")


def calibrate(comm: MPI.Intracomm, case: B.Case, min_time: float) -> int:
    """Iterations for one timed loop to last about min_time (the same on all ranks)."""
    case.time(2)  # compile and warm up
    iters = 1
    while True:
        # The shorter of two: one noisy measurement must not stop the search early.
        elapsed = min(comm.allreduce(case.time(iters), op=MPI.MAX) for _ in range(2))
        if elapsed >= min_time / 4 or iters >= 1 << 20:
            break
        iters *= 4
    return max(1, math.ceil(iters * min_time / max(elapsed, 1e-9)))


def measure(comm, args, out_file) -> list[dict]:
    backends = make_backends(comm, set(filter(None, args.backends.split(","))), args.out)
    records = []
    nbytes = args.min_bytes
    sizes = []
    while nbytes <= args.max_bytes:
        sizes.append(nbytes)
        nbytes *= 4
    for op in args.ops.split(","):
        for nbytes in sizes:
            count = max(1, nbytes // 4)
            want = B.expected(op, count, comm.rank, comm.size)
            cases = {}
            for backend in backends:
                case = backend.case(op, count)
                if case is None:
                    continue
                got = case.result()
                if got.shape != want.shape or not np.array_equal(got, want):
                    raise SystemExit(f"bench: {backend.name} {op} {nbytes} B gave a wrong result")
                cases[backend.name] = (case, calibrate(comm, case, args.min_time))
            times = {name: [] for name in cases}
            for _ in range(args.reps):
                for name, (case, iters) in cases.items():
                    times[name].append(slowest_per_call(comm, case, iters, name))
            reference = "C" if "C" in times else next(iter(times))  # GPU runs: the first backend
            c_median = statistics.median(times[reference])
            for name, samples in times.items():
                record = {
                    "op": op,
                    "bytes": nbytes,
                    "backend": name,
                    "median_us": statistics.median(samples) * 1e6,
                    "min_us": min(samples) * 1e6,
                    "ratio_to_c": statistics.median(samples) / c_median,
                    "reference": reference,
                    "iters": cases[name][1],
                    "reps": args.reps,
                    "ranks": comm.size,
                }
                records.append(record)
                if out_file:
                    out_file.write(json.dumps(record) + "\n")
                    out_file.flush()
            if comm.rank == 0:
                print_row(op, nbytes, records[-len(times) :], [b.name for b in backends])
    return records


def print_row(op, nbytes, records, names):
    if not hasattr(print_row, "header"):
        print_row.header = True
        print(f"{'op':<15}{'size':>9}" + "".join(f"{n:>22}" for n in names))
        print(" " * 24 + "".join(f"{'us (x C)':>22}" for _ in names))
    by_name = {r["backend"]: r for r in records}
    cells = []
    for name in names:
        r = by_name.get(name)
        cells.append(f"{r['median_us']:>12.2f} ({r['ratio_to_c']:5.2f}x)" if r else f"{'n/a':>22}")
    print(f"{op:<15}{human(nbytes):>9}" + "".join(f"{c:>22}" for c in cells), flush=True)


# The targets in docs/performance.md: inside jit, at most C + SMALL_US below 1 KiB
# and LARGE_RATIO x C from 64 KiB; eager calls of small messages at most EAGER_US
# each (a non-blocking cell times its post and its wait: B.python_calls).
SMALL_US, LARGE_RATIO, EAGER_US = 1.0, 1.05, 30.0


def summarize(records: list[dict]) -> list[str]:
    """The targets, checked on the medians of this run (those it measured)."""
    lines = []
    median = {(r["op"], r["bytes"], r["backend"]): r["median_us"] for r in records}
    ops = sorted({r["op"] for r in records}, key=B.OPS.index)
    for op in ops:
        sizes = sorted({r["bytes"] for r in records if r["op"] == op})
        ratios, near_c, eager = [], [], []
        for nbytes in sizes:
            ours, c = median.get((op, nbytes, "jaxcomm-jit")), median.get((op, nbytes, "C"))
            theirs = median.get((op, nbytes, "mpi4jax-jit"))
            if ours and theirs:
                ratios.append(ours / theirs)
            if ours and c and nbytes >= 64 << 10:
                near_c.append(ours <= LARGE_RATIO * c)
            elif ours and c and nbytes < 1024:
                near_c.append(ours <= c + SMALL_US)
            if nbytes < 1024 and (op, nbytes, "jaxcomm-eager") in median:
                eager.append(median[op, nbytes, "jaxcomm-eager"] / B.python_calls(op))
        parts = []
        if ratios:
            geo = math.exp(statistics.fmean(map(math.log, ratios)))
            parts.append(f"jaxcomm-jit / mpi4jax-jit geometric mean {geo:5.2f}x")
        if near_c:
            verdict = "yes" if all(near_c) else "NO"
            bounds = f"{LARGE_RATIO}x C from 64 KiB and C + {SMALL_US:g} us below 1 KiB"
            parts.append(f"within {bounds}: {verdict}")
        if eager:
            verdict = "yes" if max(eager) <= EAGER_US else "NO"
            per = f" per call ({B.python_calls(op)} calls)" if B.python_calls(op) > 1 else ""
            parts.append(
                f"jaxcomm-eager below 1 KiB at most {max(eager):.1f} us{per} "
                f"(<= {EAGER_US:g} us: {verdict})"
            )
        if parts:
            lines.append(f"{op:<15} " + "; ".join(parts))
    return lines


#: Each way jaxcomm runs an op, and the way of JAX's collectives it is held
#: against: per op inside a jitted loop, and per call from Python.
AGAINST_JAX = (
    ("jaxcomm-jit", "gloo-jit"),
    ("jaxcomm-jaxcomm.jit", "gloo-jax.jit"),
    ("jaxcomm-jax.jit", "gloo-jax.jit"),
    ("jaxcomm-eager", "gloo-jax.jit"),
)


def against_jax(records: list[dict]) -> list[str]:
    """For each pair of AGAINST_JAX measured, the range of jaxcomm / JAX's time per
    call (medians of this run) and every cell where jaxcomm was slower."""
    median = {(r["op"], r["bytes"], r["backend"]): r["median_us"] for r in records}
    lines = []
    for ours, theirs in AGAINST_JAX:
        ratios = sorted(
            (median[op, nbytes, ours] / them, op, nbytes)
            for (op, nbytes, name), them in median.items()
            if name == theirs and (op, nbytes, ours) in median
        )
        if not ratios:
            continue
        slower = [f"{op} {human(n)} {r:.2f}x" for r, op, n in reversed(ratios) if r > 1]
        lines.append(
            f"{ours} / {theirs}: {ratios[0][0]:.2f}x to {ratios[-1][0]:.2f}x over "
            f"{len(ratios)} cells; slower in {', '.join(slower) if slower else 'none'}"
        )
    return lines


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in records}, key=B.OPS.index)
    cols = min(4, len(ops))
    rows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    backends = list(dict.fromkeys(r["backend"] for r in records))
    # One colour per backend in every panel, also where a backend has no op.
    colours = dict(zip(backends, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, op in zip(axes.flat, ops, strict=False):
        for name in backends:
            points = sorted(
                (r["bytes"], r["median_us"])
                for r in records
                if r["op"] == op and r["backend"] == name
            )
            if points:
                ax.loglog(*zip(*points, strict=True), marker=".", label=name, color=colours[name])
        ax.set_title(op)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("time per call (us)")
        ax.grid(True, which="major", alpha=0.3)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(
        f"jaxcomm benchmark, {records[0]['ranks']} ranks, "
        f"{MPI.Get_library_version().splitlines()[0][:60]}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def memory_pages() -> str:
    """How large host buffers get their pages, which decides MPI's copy speed from 1 MiB up."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1]
        mode = mode.split("]")[0]
    except (OSError, IndexError):
        mode = "unknown"
    parts = [
        f"transparent huge pages {mode}",
        f"NUMPY_MADVISE_HUGEPAGE={os.environ.get('NUMPY_MADVISE_HUGEPAGE')}",
    ]
    if "GLIBC_TUNABLES" in os.environ:
        parts.append(f"GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}")
    return ", ".join(parts)


def main(argv=None) -> None:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD.Dup()
    args.out.mkdir(parents=True, exist_ok=True)
    # Rank 0 writes the records as they come, so an interrupted run keeps them.
    out_file = open(args.out / "latency.jsonl", "w") if comm.rank == 0 else None  # noqa: SIM115
    if comm.rank == 0:
        print(
            f"# {comm.size} ranks; {MPI.Get_library_version().splitlines()[0].strip()}; "
            f"Python {platform.python_version()}; min-time {args.min_time}s; reps {args.reps}"
        )
    wanted = set(filter(None, args.backends.split(",")))
    if any(name.startswith("gloo-") for name in wanted):
        B.start_jax_distributed(comm, "gloo")
    where = B.use_device(args.device, comm)
    if comm.rank == 0:
        print(f"# JAX arrays on {where}; host memory: {memory_pages()}")
    records = measure(comm, args, out_file)
    if comm.rank == 0:
        out_file.close()
        print("\n".join(summarize(records) + against_jax(records)))
        print(f"# wrote {args.out / 'latency.jsonl'}")
        if not args.no_plot:
            plot(records, args.out / "latency.png")
            print(f"# wrote {args.out / 'latency.png'}")
    if any(name.startswith("gloo-") for name in wanted):
        import jax

        jax.distributed.shutdown()  # every process together, before MPI finalises
    comm.Free()


if __name__ == "__main__":
    main()
