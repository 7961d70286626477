"""How much communication a non-blocking operation hides behind computation.

    mpiexec -n 2 python bench/overlap.py
    MPIR_CVAR_ASYNC_PROGRESS=1 mpiexec -n 2 python bench/overlap.py   # MPICH's progress thread

For each message size, five jitted functions run side by side, interleaved, on
every rank: the allreduce alone, blocking and non-blocking (posted and waited); a
computation C alone (a chain of element-wise updates sized to take about as long
as the allreduce); and C next to each form of the allreduce, independent of it:
the blocking allreduce and C in one function, and the iallreduce posted, C, then
the wait. Each function makes CALLS such rounds, one after the other. The time
per round is the slowest rank's median over repetitions. "hidden" is the share of
the shorter of communication and C that running them together saved:
(comm + C - together) / min(comm, C), where comm is that form's time alone; 0
means nothing overlapped, 1 that the shorter one was hidden completely.

XLA's CPU runtime may run C on another thread while a blocking call waits, so the
blocking form can overlap too; the non-blocking form lets MPI move the message
between the start and the wait, if its progress engine runs then (without a
progress thread, MPICH and Open MPI progress a message mostly inside MPI calls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="4096,65536,1048576,8388608", help="message bytes, comma-separated"
    )
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per timed loop")
    parser.add_argument("--json", help="append the results to this file as JSON lines")
    return parser.parse_args(argv)


def compute(y: jax.Array, rounds: int) -> jax.Array:
    """C: `rounds` dependent element-wise updates of y (no communication)."""
    return jax.lax.fori_loop(0, rounds, lambda _, v: jnp.sin(v) * 0.5 + v, y)


# Calls per jitted function: enough that JAX's dispatch of a function with an
# ordered effect (hundreds of microseconds) does not dominate small messages.
CALLS = 16


def variants(comm: JaxComm, rounds: int):
    def posted_alone(x, y):
        return comm.wait(comm.iallreduce(x)), y

    def blocking_alone(x, y):
        return comm.allreduce(x), y

    def computing(x, y):
        return x, compute(y, rounds)

    def blocking_and_compute(x, y):
        return comm.allreduce(x), compute(y, rounds)

    def posted_and_compute(x, y):
        request = comm.iallreduce(x)
        z = compute(y, rounds)
        return comm.wait(request), z

    def repeated(body):
        # Each round's input depends on the previous result: rounds do not overlap.
        def run(x, y):
            return jax.lax.fori_loop(0, CALLS, lambda _, xy: body(xy[0] * 0.5, xy[1]), (x, y))

        return jax.jit(run)

    return {
        "allreduce": repeated(blocking_alone),
        "iallreduce": repeated(posted_alone),
        "C": repeated(computing),
        "allreduce+C": repeated(blocking_and_compute),
        "iallreduce+C": repeated(posted_and_compute),
    }


def per_call(comm: JaxComm, fn, x, y, iters: int) -> float:
    jax.block_until_ready(fn(x, y))
    comm.mpi.Barrier()
    began = time.perf_counter()
    for _ in range(iters):
        out = fn(x, y)
    jax.block_until_ready(out)
    return comm.mpi.allreduce((time.perf_counter() - began) / iters / CALLS, op=MPI.MAX)


def iterations(comm: JaxComm, fn, x, y, min_time: float) -> int:
    iters = 1
    while per_call(comm, fn, x, y, iters) * iters < min_time and iters < 1 << 16:
        iters *= 2
    return iters


def rounds_matching(comm: JaxComm, x, y, min_time: float) -> int:
    """Rounds of C that take about as long as the allreduce of x."""
    target = per_call(comm, variants(comm, 1)["allreduce"], x, y, 4)
    one = per_call(comm, variants(comm, 8)["C"], x, y, 4) / 8
    return max(1, round(target / one))


def hidden(us: dict[str, float], form: str) -> float:
    """The share of the shorter of `form` and C that running them together saved."""
    return (us[form] + us["C"] - us[form + "+C"]) / min(us[form], us["C"])


def main(argv=None) -> None:
    args = parse_args(argv)
    comm = JaxComm(MPI.COMM_WORLD)
    progress = os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0")
    if comm.rank == 0:
        print(MPI.Get_library_version().splitlines()[0])
        print(f"{comm.size} ranks, MPIR_CVAR_ASYNC_PROGRESS={progress}; us per round")
        print(
            f"{'bytes':>9} {'allreduce':>9} {'C':>7} {'both':>7} {'hidden':>6} "
            f"{'iallreduce':>10} {'both':>7} {'hidden':>6}"
        )
    for nbytes in map(int, args.sizes.split(",")):
        x = jnp.ones(nbytes // 4, jnp.float32) * (comm.rank + 1)
        y = jnp.linspace(0.0, 1.0, max(256, nbytes // 64), dtype=jnp.float32)
        rounds = rounds_matching(comm, x, y, args.min_time)
        fns = variants(comm, rounds)
        for name in ("allreduce+C", "iallreduce+C"):
            # Each of the CALLS rounds halves x and sums it over the ranks.
            expected = (comm.size * (comm.size + 1) / 2) * (comm.size / 2) ** (CALLS - 1) / 2
            assert np.allclose(fns[name](x, y)[0], expected), f"wrong result from {name}"
        iters = {name: iterations(comm, fn, x, y, args.min_time) for name, fn in fns.items()}
        times = {name: [] for name in fns}
        for _ in range(args.reps):
            for name, fn in fns.items():
                times[name].append(per_call(comm, fn, x, y, iters[name]))
        us = {name: 1e6 * statistics.median(t) for name, t in times.items()}

        if comm.rank == 0:
            print(
                f"{nbytes:>9} {us['allreduce']:>9.1f} {us['C']:>7.1f} {us['allreduce+C']:>7.1f} "
                f"{hidden(us, 'allreduce'):>6.2f} {us['iallreduce']:>10.1f} "
                f"{us['iallreduce+C']:>7.1f} {hidden(us, 'iallreduce'):>6.2f}",
                flush=True,
            )
            if args.json:
                record = {"bytes": nbytes, "ranks": comm.size, "progress": progress, **us}
                with open(args.json, "a") as out:
                    out.write(json.dumps(record) + "\n")
    comm.free()


if __name__ == "__main__":
    main()
