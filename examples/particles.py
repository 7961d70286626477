"""Particles in a periodic 2-d box, split into strips over the ranks: each step
moves them, and those that leave a rank's strip migrate with alltoallv.

The whole time loop is one jitted lax.fori_loop. Each rank keeps its particles in
arrays of fixed capacity, with a (traced) count of how many are live; after the
move, particles are sorted by destination rank and exchanged, so the counts
change from step to step without recompiling. A force field pushes them around;
its mean over all particles is taken out every step (an allreduce), so total
momentum is conserved, which the program checks at the end together with every
particle arriving exactly once.

    mpiexec -n 4 python examples/particles.py --particles 20000 --steps 500 --plot particles.png
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm

BOX = 1.0
# Columns of a particle's row: position (2), velocity (2), identity.
X, V, ID = slice(0, 2), slice(2, 4), 4
COLUMNS = 5


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=4000, help="in total, over all ranks")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dt", type=float, default=2e-3)
    parser.add_argument("--slack", type=float, default=2.0, help="capacity / particles per rank")
    parser.add_argument("--plot", help="save a picture of the final positions to this file")
    parser.add_argument("--save", help="save the final particles (rank 0) to this .npy file")
    return parser.parse_args(argv)


def initial(rank: int, size: int, total: int) -> np.ndarray:
    """This rank's particles: those of a seeded global set that start in its strip."""
    rng = np.random.default_rng(0)
    rows = np.zeros((total, COLUMNS), np.float32)
    rows[:, X] = rng.random((total, 2)) * BOX
    rows[:, V] = rng.normal(0.0, 0.5, (total, 2))
    rows[:, ID] = np.arange(total)
    return rows[owner(rows[:, 0], size) == rank]


def owner(x, size: int):
    """The rank whose strip holds position x (array module agnostic)."""
    return (x * (size / BOX)).astype(np.int32).clip(0, size - 1)


def force(x: jax.Array) -> jax.Array:
    """A steady swirl: (sin 2 pi y, -sin 2 pi x)."""
    return jnp.stack([jnp.sin(2 * jnp.pi * x[:, 1]), -jnp.sin(2 * jnp.pi * x[:, 0])], axis=1)


def make_run(comm: JaxComm, capacity: int, total: int, dt: float, steps: int, progress=None):
    size = comm.size

    def step(i, carry):
        rows, live, migrated = carry
        alive = jnp.arange(capacity) < live
        push = jnp.where(alive[:, None], force(rows[:, X]), 0.0)
        # The mean force over all particles is taken out: momentum is conserved.
        push = push - comm.allreduce(push.sum(axis=0)) / total
        v = rows[:, V] + dt * push
        x = jnp.mod(rows[:, X] + dt * v, BOX)
        rows = jnp.concatenate([x, v, rows[:, ID:]], axis=1)
        # Sort by destination rank (the dead rows last) and send each its share.
        dest = jnp.where(alive, owner(x[:, 0], size), size)
        order = jnp.argsort(dest, stable=True)
        counts = jnp.bincount(dest, length=size + 1)[:size]
        rows, received = comm.alltoallv(rows[order], counts, capacity=capacity)
        if progress is not None:
            jax.debug.callback(progress, i)
        return rows, received.sum(), migrated + live - counts[comm.rank]

    @jax.jit
    def run(rows, live):
        """(rows, live) after the steps, and how many particles left this rank."""
        return jax.lax.fori_loop(0, steps, step, (rows, live, jnp.int32(0)))

    return run


def momentum(comm: JaxComm, rows: jax.Array, live) -> np.ndarray:
    alive = (jnp.arange(rows.shape[0]) < live)[:, None]
    return np.asarray(comm.allreduce(jnp.where(alive, rows[:, V], 0.0).sum(axis=0)))


def gather_particles(comm: JaxComm, rows: jax.Array, live) -> np.ndarray | None:
    """Every rank's live particles on rank 0, sorted by identity (None elsewhere)."""
    stacked = comm.gather(rows)
    counts = comm.gather(jnp.asarray(live))
    if comm.rank != 0:
        return None
    particles = np.concatenate([np.asarray(s[:c]) for s, c in zip(stacked, counts, strict=True)])
    return particles[np.argsort(particles[:, ID])]


def plot(particles: np.ndarray, size: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 5))
    strip = owner(particles[:, 0], size)
    axes.scatter(particles[:, 0], particles[:, 1], c=strip, s=2, cmap="tab10", vmin=0, vmax=9)
    for edge in range(1, size):
        axes.axvline(edge * BOX / size, color="grey", linewidth=0.5)
    axes.set(xlim=(0, BOX), ylim=(0, BOX), aspect="equal", title=f"{len(particles)} particles")
    figure.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    comm = JaxComm(MPI.COMM_WORLD)
    mine = initial(comm.rank, comm.size, args.particles)
    capacity = int(np.ceil(args.slack * args.particles / comm.size))
    if len(mine) > capacity:
        raise SystemExit(f"--slack {args.slack} leaves no room for rank {comm.rank}'s particles")
    rows = np.zeros((capacity, COLUMNS), np.float32)
    rows[: len(mine)] = mine
    rows, live = jnp.asarray(rows), jnp.int32(len(mine))

    progress = None
    if comm.rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, unit="step", desc="particles")
            progress = lambda i: bar.update(1)  # noqa: E731
        except ImportError:
            pass
    run = make_run(comm, capacity, args.particles, args.dt, args.steps, progress)
    before = momentum(comm, rows, live)
    began = time.perf_counter()
    rows, live, migrated = jax.block_until_ready(run(rows, live))
    migrated = int(comm.allreduce(migrated))
    elapsed = comm.mpi.allreduce(time.perf_counter() - began, op=MPI.MAX)
    if progress is not None:
        bar.close()
    after = momentum(comm, rows, live)

    particles = gather_particles(comm, rows, live)
    if comm.rank == 0:
        ids = particles[:, ID].astype(np.int64)
        if not np.array_equal(ids, np.arange(args.particles)):
            raise SystemExit("particles: a particle was lost or duplicated")
        drift = np.abs(after - before).max()
        # Round-off: float32's epsilon per step, on a sum of sqrt(N) size.
        if drift > np.finfo(np.float32).eps * args.steps * np.sqrt(args.particles):
            raise SystemExit(f"particles: momentum drifted by {drift:.3g}")
        print(
            f"{comm.size} ranks, {args.particles} particles, {args.steps} steps: "
            f"{migrated} migrations, none lost, momentum drift {drift:.1e}, "
            f"{args.steps / elapsed:.1f} steps/s"
        )
        if args.save:
            np.save(args.save, particles)
        if args.plot:
            plot(particles, comm.size, args.plot)
            print(f"saved {args.plot}")
    comm.free()


if __name__ == "__main__":
    main()
