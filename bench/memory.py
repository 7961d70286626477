"""Peak memory of an allreduce of a large donated array.

    python bench/memory.py [--gib 1] [--ranks 2]

Runs one `mpiexec -n RANKS` job per variant (peak RSS only grows, so each needs
its own processes) and prints, for the slowest rank, how much the process's peak
resident memory grew beyond what it held before the array existed, as a multiple
of the array's size. An op that works in place needs about 1x (the array itself);
one that allocates a fresh output needs 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).parent
VARIANTS = {
    "mpi4py-in-place": "MPI alone: mpi4py Allreduce(IN_PLACE, x)",
    "jaxcomm-jit-donated": "jaxcomm in_place=True, jit with donate_argnums=0",
    "jaxcomm-jit-donated-default": "jaxcomm (out of place), jit with donate_argnums=0",
    "jaxcomm-jit": "jaxcomm in_place=True, jit without donation",
    "mpi4jax-jit-donated": "mpi4jax, jit with donate_argnums=0",
}


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(variant: str, nbytes: int) -> None:
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if variant == "mpi4py-in-place":
        import numpy as np

        x = np.ones(nbytes // 4, np.float32)
        before = current_rss() - nbytes
        comm.Allreduce(MPI.IN_PLACE, x)
        ok = x[0] == comm.size and x[-1] == comm.size
        return report(comm, variant, nbytes, before, ok)
    if variant.startswith("jaxcomm"):
        from jaxcomm import JaxComm

        in_place = not variant.endswith("default")
        allreduce = partial(JaxComm(comm).allreduce, in_place=in_place)
    else:
        import mpi4jax

        def allreduce(x):
            return mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)

    spec = jax.ShapeDtypeStruct((nbytes // 4,), jnp.float32)
    donate = (0,) if "donated" in variant else ()
    compiled = jax.jit(allreduce, donate_argnums=donate).lower(spec).compile()
    x = jnp.ones(spec.shape, spec.dtype).block_until_ready()
    before = current_rss() - nbytes  # what the process held before the array
    y = compiled(x).block_until_ready()
    ok = bool(y[0] == comm.size) and bool(y[-1] == comm.size)
    report(comm, variant, nbytes, before, ok)


def report(comm, variant: str, nbytes: int, before: int, ok: bool) -> None:
    from mpi4py import MPI

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    growth = comm.allreduce((peak - before) / nbytes, op=MPI.MAX)
    if comm.rank == 0:
        print(
            json.dumps(
                {"variant": variant, "bytes": nbytes, "peak_over_array": growth, "ok": bool(ok)}
            )
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    nbytes = int(args.gib * (1 << 30)) // 4 * 4
    if args.child:
        return child(args.child, nbytes)

    sys.path.insert(0, str(HERE))
    from backends import mpi4jax_available

    mpiexec = Path(sys.executable).with_name("mpiexec")
    records = []
    for variant, what in VARIANTS.items():
        if variant.startswith("mpi4jax") and not mpi4jax_available():
            continue
        command = [
            str(mpiexec if mpiexec.exists() else "mpiexec"),
            "-n",
            str(args.ranks),
            sys.executable,
            __file__,
            "--child",
            variant,
            "--gib",
            str(args.gib),
        ]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        record = json.loads(output.strip().splitlines()[-1])
        records.append(record)
        print(
            f"{what:<40} peak memory {record['peak_over_array']:.2f}x the array"
            + ("" if record["ok"] else "  (WRONG RESULT)")
        )
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "memory.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
