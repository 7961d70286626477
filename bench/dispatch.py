"""What calling a jitted step that communicates costs, against the same step without.

    mpiexec -n 2 python bench/dispatch.py              # the table, bench/results/dispatch.jsonl
    mpiexec -n 1 python bench/dispatch.py --attribute  # where jax.jit's extra time goes

The step is the smallest there is: x -> allreduce(x) / size on a float32 array of
one element (4 bytes), called from Python in a loop, each call taking the previous
result. Each backend runs it its way:

- ``no-communication``: ``jax.jit`` of x -> x / size (the baseline);
- ``jaxcomm``: ``jax.jit`` of the step with jaxcomm's allreduce;
- ``jaxcomm.jit``: the same step under ``jaxcomm.jit``;
- ``mpi4jax``: ``jax.jit`` of the step with mpi4jax's allreduce (when installed);
- ``mpi4py``: the message alone, mpi4py's ``Allreduce`` on NumPy arrays, in the
  same loop (what any of them pays for the allreduce itself);
- ``jaxcomm.jit no-communication``: x -> x / size under ``jaxcomm.jit`` (what its
  marker and Python wrapper add to the baseline);
- ``jax.jit + mpi4py``: the baseline's jitted step, then mpi4py's ``Allreduce`` of
  its result as a NumPy array (the least any library can pay for the step with
  its message: the work between two messages, then the message);
- ``busy + mpi4py``: a Python loop that keeps the core busy for --busy-us
  microseconds, about the baseline's time per call, then mpi4py's ``Allreduce``
  (the same, with no JAX at all).

In each of --reps repetitions the backends run in turn, each timing a loop long
enough to last --min-time; a repetition's time per call is the slowest rank's.
The table gives the median over repetitions, the spread (lowest and highest) and
the ratio of medians to no-communication.

--attribute times what JAX does on its Python dispatch path for the ``jaxcomm``
step, by wrapping the functions named in the table (JAX internals, read here for
measurement only) with a clock; a name that this JAX lacks is left out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

HERE = Path(__file__).parent


def steps(comm: MPI.Intracomm) -> dict[str, Callable]:
    """Each backend's step, jitted (those whose library is installed)."""
    import jaxcomm

    scale = 1.0 / comm.size
    jc = jaxcomm.JaxComm(comm)
    found = {
        "no-communication": jax.jit(lambda x: x * scale),
        "jaxcomm": jax.jit(lambda x: jc.allreduce(x, op=MPI.SUM) * scale),
        "jaxcomm.jit": jaxcomm.jit(lambda x: jc.allreduce(x, op=MPI.SUM) * scale),
        "jaxcomm.jit no-communication": jaxcomm.jit(lambda x: x * scale),
    }
    try:
        import mpi4jax
    except Exception:  # an mpi4jax built for another jax fails in many ways
        return found
    found["mpi4jax"] = jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm) * scale)
    return found


def mpi4py_step(comm: MPI.Intracomm) -> Callable:
    """The message alone: mpi4py's Allreduce of the 4 bytes, on NumPy arrays."""
    other = comm.Dup()  # its own: a rank may still be in the loop when another times
    scale = np.float32(1.0 / comm.size)

    def step(x):
        out = np.empty_like(x)
        other.Allreduce(x, out, op=MPI.SUM)
        return out * scale

    step.numpy = True  # takes and gives NumPy arrays
    return step


def jit_then_mpi4py_step(comm: MPI.Intracomm, jitted: Callable) -> Callable:
    """The jitted step without communication, then mpi4py's Allreduce of its result."""
    other = comm.Dup()

    def step(x):
        y = np.asarray(jitted(x))
        out = np.empty_like(y)
        other.Allreduce(y, out, op=MPI.SUM)
        return out

    step.numpy = True
    return step


def busy_then_mpi4py_step(comm: MPI.Intracomm, seconds: float) -> Callable:
    """A busy loop of `seconds`, then mpi4py's step."""
    message = mpi4py_step(comm)

    def step(x):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return message(x)

    step.numpy = True
    return step


def time_loop(comm: MPI.Intracomm, step: Callable, calls: int) -> float:
    """Seconds per call of `calls` calls in a row, on the slowest rank."""
    x = np.ones((1,), np.float32) if getattr(step, "numpy", False) else jnp.ones((1,), jnp.float32)
    x = jax.block_until_ready(step(x))
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        x = step(x)
    jax.block_until_ready(x)
    return comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


def calibrate(comm: MPI.Intracomm, step: Callable, min_time: float) -> int:
    """Calls for one timed loop to last about min_time (the same on all ranks)."""
    calls = 16
    while (per_call := time_loop(comm, step, calls)) * calls < min_time / 4 and calls < 1 << 20:
        calls *= 4
    return max(16, int(min_time / per_call))


def measure(comm: MPI.Intracomm, args) -> list[dict]:
    found = {**steps(comm), "mpi4py": mpi4py_step(comm)}
    found["jax.jit + mpi4py"] = jit_then_mpi4py_step(comm, found["no-communication"])
    found["busy + mpi4py"] = busy_then_mpi4py_step(comm, args.busy_us * 1e-6)
    wanted = [name for name in args.backends.split(",") if name] or list(found)
    x = jnp.arange(1, dtype=jnp.float32) + comm.rank
    calls = {}
    for name in wanted:
        given = np.asarray(x) if getattr(found[name], "numpy", False) else x
        got = float(found[name](given)[0])  # also compiles
        alone = name in ("no-communication", "jaxcomm.jit no-communication")
        want = (comm.rank if alone else sum(range(comm.size))) / comm.size
        if comm.allreduce(got != want, op=MPI.LOR):  # every rank stops, not only one
            raise SystemExit(f"bench: {name} gave {got} on rank {comm.rank}, not {want}")
        calls[name] = calibrate(comm, found[name], args.min_time)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.reps):
        for name in calls:
            times[name].append(time_loop(comm, found[name], calls[name]))
    base = statistics.median(times.get("no-communication", times[wanted[0]]))
    return [
        {
            "backend": name,
            "median_us": statistics.median(samples) * 1e6,
            "min_us": min(samples) * 1e6,
            "max_us": max(samples) * 1e6,
            "ratio": statistics.median(samples) / base,
            "calls": calls[name],
            "reps": args.reps,
            "ranks": comm.size,
            "jax": jax.__version__,
            "python": platform.python_version(),
        }
        for name, samples in times.items()
    ]


# JAX's Python dispatch path for a jitted call with an ordered effect, outermost
# first: (module, attribute path) of each function --attribute wraps with a clock.
ATTRIBUTED = (
    ("jax._src.pjit", "_run_python_pjit"),
    ("jax._src.pjit", "_pjit_call_impl_python"),
    ("jax._src.interpreters.pxla", "ExecuteReplicated.__call__"),
    ("jax._src.dispatch", "RuntimeTokenSet.get_token_input"),
    ("jax._src.api", "device_put"),  # of the token, inside get_token_input
    ("jax._src.interpreters.pxla", "ExecuteReplicated._handle_token_bufs"),
    ("jax._src.pjit", "_get_fastpath_data"),
)


def attribute(comm: MPI.Intracomm, args) -> list[dict]:
    """Microseconds per call spent in each ATTRIBUTED function (inclusive), for the
    `jaxcomm` step; the total is the loop's time per call."""
    import importlib

    step = steps(comm)["jaxcomm"]
    spent: dict[str, float] = {}
    originals = []
    for module_name, path in ATTRIBUTED:
        owner = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name):
            continue
        original = getattr(owner, name)

        def clocked(*a, _original=original, _path=path, **k):
            start = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                spent[_path] = spent.get(_path, 0.0) + time.perf_counter() - start

        setattr(owner, name, clocked)
        originals.append((owner, name, original))
    try:
        calls = calibrate(comm, step, args.min_time)
        samples: dict[str, list[float]] = {}
        for _ in range(args.reps):
            spent.clear()
            total = time_loop(comm, step, calls)
            samples.setdefault("total", []).append(total * 1e6)
            for path, seconds in spent.items():
                samples.setdefault(path, []).append(seconds / (calls + 1) * 1e6)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return [
        {"function": path, "median_us": statistics.median(values), "jax": jax.__version__}
        for path, values in samples.items()
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--min-time", type=float, default=0.1, help="seconds per timed loop")
    parser.add_argument("--busy-us", type=float, default=10.0, help="busy + mpi4py's loop")
    parser.add_argument("--backends", default="", help="comma-separated subset")
    parser.add_argument("--attribute", action="store_true", help="time JAX's dispatch path")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD.Dup()
    if args.attribute:
        records = attribute(comm, args)
        lines = [f"{r['function']:<45}{r['median_us']:>10.1f} us" for r in records]
    else:
        records = measure(comm, args)
        lines = [
            f"{r['backend']:<30}{r['median_us']:>9.1f} us ({r['min_us']:.1f}-{r['max_us']:.1f})"
            f"{r['ratio']:>8.2f}x"
            for r in records
        ]
    if comm.rank == 0:
        print(
            f"# {comm.size} ranks; jax {jax.__version__}; Python {platform.python_version()}; "
            f"{MPI.Get_library_version().splitlines()[0].strip()}; reps {args.reps}"
        )
        print("\n".join(lines))
        args.out.mkdir(parents=True, exist_ok=True)
        name = "dispatch-attribution.jsonl" if args.attribute else "dispatch.jsonl"
        with open(args.out / name, "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in records)
    comm.Free()


if __name__ == "__main__":
    main()
