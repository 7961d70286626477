"""examples/particles.py as a sharded program: the processes form one JAX program
(jax.distributed), the particles are one global array over a Mesh with one device
per process, and each step runs inside jax.shard_map on this process's block. JAX's
own psum takes the global sums; jaxcomm's alltoallv migrates the particles, which
JAX's collectives cannot do on CPU (a variable number of rows to each process).

Particles in a periodic 2-d box, split into strips over the processes: each step
moves them, and those that leave a strip migrate. Each block holds its particles
in rows of fixed capacity, with a count of how many are live. The mean force is
taken out every step, so total momentum is conserved, which the program checks at
the end together with every particle arriving exactly once.

    mpiexec -n 4 python examples/sharded_particles.py --particles 20000 --steps 500
"""

from __future__ import annotations

import argparse
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

from jaxcomm import JaxComm

BOX = 1.0
# Columns of a particle's row: position (2), velocity (2), identity.
X, V, ID = slice(0, 2), slice(2, 4), 4
COLUMNS = 5
AXIS = "strips"  # the mesh's one axis: one strip of the box per process


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=4000, help="in total, over all ranks")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dt", type=float, default=2e-3)
    parser.add_argument("--slack", type=float, default=2.0, help="capacity / particles per rank")
    parser.add_argument("--save", help="save the final particles (rank 0) to this .npy file")
    return parser.parse_args(argv)


def start_jax_distributed(world: MPI.Comm) -> None:
    """Make every MPI process a process of one JAX program. The coordinator is
    rank 0, at a port it finds free (on one machine at 127.0.0.1, so that
    programs run side by side do not collide); JAX's process i is MPI's rank i."""
    address = None
    if world.rank == 0:
        one_host = world.Split_type(MPI.COMM_TYPE_SHARED).size == world.size
        host = "127.0.0.1" if one_host else socket.gethostname()
        with socket.socket() as probe:
            probe.bind((host, 0))
            address = f"{host}:{probe.getsockname()[1]}"
    else:
        world.Split_type(MPI.COMM_TYPE_SHARED)  # collective: every rank takes part
    address = world.bcast(address)
    jax.distributed.initialize(address, num_processes=world.size, process_id=world.rank)


def initial(rank: int, size: int, total: int) -> np.ndarray:
    """This process's particles: those of a seeded global set that start in its strip."""
    rng = np.random.default_rng(0)
    rows = np.zeros((total, COLUMNS), np.float32)
    rows[:, X] = rng.random((total, 2)) * BOX
    rows[:, V] = rng.normal(0.0, 0.5, (total, 2))
    rows[:, ID] = np.arange(total)
    return rows[owner(rows[:, 0], size) == rank]


def owner(x, size: int):
    """The strip (the process's index along the mesh) holding position x."""
    return (x * (size / BOX)).astype(np.int32).clip(0, size - 1)


def force(x: jax.Array) -> jax.Array:
    """A steady swirl: (sin 2 pi y, -sin 2 pi x)."""
    return jnp.stack([jnp.sin(2 * jnp.pi * x[:, 1]), -jnp.sin(2 * jnp.pi * x[:, 0])], axis=1)


def make_run(mesh: Mesh, strips: JaxComm, capacity: int, total: int, dt: float, steps: int, tick):
    """The time loop on global arrays: rows (size * capacity, COLUMNS) and live
    counts (size,), both split over the mesh; also returns how many particles left
    each strip. `strips` is the communicator along the mesh's axis."""
    size = strips.size

    def step(i, carry):  # on this process's block: rows (capacity, COLUMNS), live ()
        rows, live, migrated = carry
        alive = jnp.arange(capacity) < live
        push = jnp.where(alive[:, None], force(rows[:, X]), 0.0)
        # The mean force over all particles is taken out: momentum is conserved.
        push = push - lax.psum(push.sum(axis=0), AXIS) / total
        v = rows[:, V] + dt * push
        x = jnp.mod(rows[:, X] + dt * v, BOX)
        rows = jnp.concatenate([x, v, rows[:, ID:]], axis=1)
        # Sort by destination strip (the dead rows last) and send each its share.
        dest = jnp.where(alive, owner(x[:, 0], size), size)
        order = jnp.argsort(dest, stable=True)
        counts = jnp.bincount(dest, length=size + 1)[:size]
        rows, received = strips.alltoallv(rows[order], counts, capacity=capacity)
        # Every process's program is the same (the callback only does nothing off
        # rank 0): JAX pairs its collectives across processes by their place.
        jax.debug.callback(tick, i)
        return rows, received.sum(), migrated + live - counts[strips.rank]

    def block(rows, live):
        start = (rows, live[0], jnp.zeros_like(live[0]))  # each varies along the mesh
        rows, live, migrated = lax.fori_loop(0, steps, step, start)
        return rows, live.reshape(1), migrated.reshape(1)

    split = P(AXIS)
    return jax.jit(jax.shard_map(block, mesh=mesh, in_specs=(split, split), out_specs=split))


def main(argv=None) -> None:
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    start_jax_distributed(world)
    # One device per process, in rank order: strip i is rank i's.
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), (AXIS,))
    comm = JaxComm(world)
    strips = comm.along(mesh, AXIS)
    mine = initial(strips.rank, strips.size, args.particles)
    capacity = int(np.ceil(args.slack * args.particles / strips.size))
    if len(mine) > capacity:
        raise SystemExit(f"--slack {args.slack} leaves no room for rank {comm.rank}'s particles")
    block = np.zeros((capacity, COLUMNS), np.float32)
    block[: len(mine)] = mine
    split = NamedSharding(mesh, P(AXIS))
    rows = jax.make_array_from_process_local_data(split, block)
    live = jax.make_array_from_process_local_data(split, np.array([len(mine)], np.int32))

    bar = None
    if comm.rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, unit="step", desc="sharded particles")
        except ImportError:
            pass

    def tick(i):
        if bar is not None:
            bar.update(1)

    run = make_run(mesh, strips, capacity, args.particles, args.dt, args.steps, tick)
    momentum = jax.jit(
        jax.shard_map(
            lambda rows, live: lax.psum(
                jnp.where((jnp.arange(capacity) < live[0])[:, None], rows[:, V], 0.0).sum(0),
                AXIS,
            ),
            mesh=mesh,
            in_specs=(P(AXIS), P(AXIS)),
            out_specs=P(),
        )
    )
    before = np.asarray(momentum(rows, live).addressable_data(0))
    began = time.perf_counter()
    rows, live, migrated = jax.block_until_ready(run(rows, live))
    elapsed = comm.mpi.allreduce(time.perf_counter() - began, op=MPI.MAX)
    if bar is not None:
        bar.close()
    after = np.asarray(momentum(rows, live).addressable_data(0))

    # This process's block, and every block on rank 0 (jaxcomm, eagerly).
    mine, count = rows.addressable_data(0), live.addressable_data(0)[0]
    migrated = int(comm.allreduce(migrated.addressable_data(0))[0])
    stacked, counts = comm.gather(mine), comm.gather(count)
    if comm.rank == 0:
        parts = [np.asarray(s[:c]) for s, c in zip(stacked, counts, strict=True)]
        particles = np.concatenate(parts)
        particles = particles[np.argsort(particles[:, ID])]
        if not np.array_equal(particles[:, ID].astype(np.int64), np.arange(args.particles)):
            raise SystemExit("sharded_particles: a particle was lost or duplicated")
        drift = np.abs(after - before).max()
        # Round-off: float32's epsilon per step, on a sum of sqrt(N) size.
        if drift > np.finfo(np.float32).eps * args.steps * np.sqrt(args.particles):
            raise SystemExit(f"sharded_particles: momentum drifted by {drift:.3g}")
        print(
            f"{comm.size} processes, {args.particles} particles, {args.steps} steps: "
            f"{migrated} migrations, none lost, momentum drift {drift:.1e}, "
            f"{args.steps / elapsed:.1f} steps/s"
        )
        if args.save:
            np.save(args.save, particles)
    strips.free()
    comm.free()


if __name__ == "__main__":
    main()
