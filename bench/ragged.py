"""Does jax.lax.ragged_all_to_all run in a multi-process JAX on CPU?

The benchmark would compare it with jaxcomm's alltoallv; this runs the smallest
exchange (one row to every peer) on `--processes` CPU processes (gloo
collectives over loopback) and prints each process's result or error.

    python bench/ragged.py --processes 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys

PORT = 12355  # on 127.0.0.1 only


def exchange(process: int, processes: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=processes, process_id=process)
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(jax.devices(), ("x",))

    def one_row_each(x):
        peers = jnp.arange(processes, dtype=jnp.int32)
        ones = jnp.ones(processes, jnp.int32)
        at = jnp.full(processes, lax.axis_index("x"), jnp.int32)
        return lax.ragged_all_to_all(x, jnp.zeros_like(x), peers, ones, at, ones, axis_name="x")

    run = jax.jit(jax.shard_map(one_row_each, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    rows = jnp.arange(processes, dtype=jnp.float32) + 10 * process
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), rows)
    try:
        print(process, "ok", run(x).addressable_shards[0].data, flush=True)
    except Exception as error:  # the point is to report it
        print(process, f"{type(error).__name__}: {error}".splitlines()[0], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--process", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process is not None:
        return exchange(args.process, args.processes)
    command = [sys.executable, __file__, "--processes", str(args.processes), "--process"]
    children = [subprocess.Popen([*command, str(p)]) for p in range(args.processes)]
    sys.exit(max(child.wait(timeout=300) for child in children))


if __name__ == "__main__":
    main()
