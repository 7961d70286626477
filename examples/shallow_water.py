"""Nonlinear shallow-water model on a rotating plane, decomposed over MPI ranks.

    mpiexec -n 2 python examples/shallow_water.py --days 1 --plot water.png
    mpiexec -n 2 python examples/shallow_water.py --benchmark
    mpiexec -n 2 python examples/shallow_water.py --overlap
    mpiexec -n 2 python examples/shallow_water.py --benchmark --no-messages

The domain is periodic in x and closed by walls in y. Ranks split it into strips
along x on a periodic Cartesian grid (`comm.create_cart`); each time step fills
the strips' halos with `halo_exchange` (two `sendrecv`s) inside one jitted
function. With --overlap, a step instead posts the halo messages (`irecv`,
`isend`), updates the cells that need no halo while they travel, then waits and
updates the two edge columns: the same arithmetic per cell, so the same solution
to the bit. With --no-messages each strip fills its halos from its own edges
instead (periodic within the strip): the same arithmetic without communication,
to time what the halo exchange costs. The scheme is a finite-volume Rusanov
(local Lax-Friedrichs) flux with forward Euler steps; the time step is fixed from
the initial state so every decomposition takes the same steps and gives the same
result.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm

G = 9.81  # m/s^2
CORIOLIS = 1e-4  # 1/s
DEPTH = 100.0  # mean water depth, m
LENGTH = 2.0e6  # domain size in x, m
DAY = 86400.0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nx", type=int, default=120, help="cells in x (a multiple of ranks)")
    parser.add_argument("--ny", type=int, default=120, help="cells in y")
    parser.add_argument("--days", type=float, default=0.5, help="simulated time")
    parser.add_argument("--benchmark", action="store_true", help="time it; no plot")
    parser.add_argument("--plot", metavar="PNG", help="save surface height and velocity")
    parser.add_argument("--save", metavar="NPY", help="save the final state (rank 0)")
    parser.add_argument(
        "--overlap", action="store_true", help="update the interior while halos travel"
    )
    parser.add_argument(
        "--no-messages",
        action="store_true",
        help="fill halos from the strip's own edges: the time without communication",
    )
    return parser.parse_args(argv)


def initial_state(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(3, nx, ny) conserved variables h, hu, hv: a Gaussian hill of water at rest."""
    X, Y = np.meshgrid(x, y, indexing="ij")
    r2 = (X - 0.5 * LENGTH) ** 2 + (Y - 0.5 * y[-1]) ** 2
    h = DEPTH + 10.0 * np.exp(-r2 / (0.1 * LENGTH) ** 2)
    return np.stack([h, np.zeros_like(h), np.zeros_like(h)]).astype(np.float32)


def flux(q: jax.Array, axis: int) -> jax.Array:
    """Physical flux of q = (h, hu, hv) across faces normal to x (axis 1) or y (axis 2)."""
    h, hu, hv = q
    normal = hu if axis == 1 else hv
    velocity = normal / h
    pressure = 0.5 * G * h * h
    return jnp.stack(
        [
            normal,
            hu * velocity + (pressure if axis == 1 else 0.0),
            hv * velocity + (pressure if axis == 2 else 0.0),
        ]
    )


def rusanov(q: jax.Array, axis: int) -> jax.Array:
    """Numerical fluxes on the faces between neighbouring cells along `axis`."""
    n = q.shape[axis]
    left = jax.lax.slice_in_dim(q, 0, n - 1, axis=axis)
    right = jax.lax.slice_in_dim(q, 1, n, axis=axis)

    def speed(s):
        return jnp.abs(s[axis] / s[0]) + jnp.sqrt(G * s[0])

    a = jnp.maximum(speed(left), speed(right))
    return 0.5 * (flux(left, axis) + flux(right, axis)) - 0.5 * a * (right - left)


def walls(q: jax.Array) -> jax.Array:
    """Reflecting walls at both ends of y: mirror the edge cells, flip hv."""
    flip = jnp.array([1.0, 1.0, -1.0], q.dtype)[:, None, None]
    q = q.at[:, :, :1].set(q[:, :, 1:2] * flip)
    return q.at[:, :, -1:].set(q[:, :, -2:-1] * flip)


def tendency(q: jax.Array, dx: float, dy: float) -> jax.Array:
    """dq/dt of the cells of q (3, m + 2, ny + 2) inside its halo: (3, m, ny)."""
    fx = rusanov(q[:, :, 1:-1], axis=1)  # (3, m + 1, ny)
    fy = rusanov(q[:, 1:-1, :], axis=2)  # (3, m, ny + 1)
    h, hu, hv = q[:, 1:-1, 1:-1]
    source = jnp.stack([jnp.zeros_like(h), CORIOLIS * hv, -CORIOLIS * hu])
    return -(fx[:, 1:] - fx[:, :-1]) / dx - (fy[:, :, 1:] - fy[:, :, :-1]) / dy + source


def own_halos(q: jax.Array) -> jax.Array:
    """q's x halos filled from its own edges, as if the strip were the whole domain."""
    return q.at[:, :1].set(q[:, -2:-1]).at[:, -1:].set(q[:, 1:2])


def make_step(comm, dx: float, dy: float, dt: float, overlap: bool = False, messages: bool = True):
    left, right = comm.shift(0, 1)

    def step(q):
        """q: (3, nx_local + 2, ny + 2) with one halo cell on every side."""
        q = comm.halo_exchange(q, axis=1, direction=0) if messages else own_halos(q)
        q = walls(q)
        return q.at[:, 1:-1, 1:-1].add(dt * tendency(q, dx, dy))

    def overlapped_step(q):
        from_left = comm.irecv(q[:, :1], source=left, tag=0)
        from_right = comm.irecv(q[:, -1:], source=right, tag=1)
        sends = [
            comm.isend(q[:, -2:-1], dest=right, tag=0),
            comm.isend(q[:, 1:2], dest=left, tag=1),
        ]
        # Columns 2 .. nx_local - 1 need no halo: update them while the halos travel.
        inner = tendency(walls(q)[:, 1:-1], dx, dy)
        q = q.at[:, :1].set(comm.wait(from_left)).at[:, -1:].set(comm.wait(from_right))
        comm.waitall(sends)
        q = walls(q)
        edges = tendency(q[:, :3], dx, dy), tendency(q[:, -3:], dx, dy)
        return q.at[:, 1:-1, 1:-1].add(dt * jnp.concatenate([edges[0], inner, edges[1]], axis=1))

    body = overlapped_step if overlap else step

    @jax.jit
    def advance(q, steps):
        return jax.lax.fori_loop(0, steps, lambda i, q: body(q), q)

    return advance


def gather_state(comm, q) -> np.ndarray | None:
    """The full (3, nx, ny) state on rank 0 (strips in rank order along x)."""
    strips = comm.gather(q[:, 1:-1, 1:-1], root=0)
    return np.concatenate(list(np.asarray(strips)), axis=1) if comm.rank == 0 else None


def plot(state: np.ndarray, path: str, days: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, hu, hv = state
    u, v = hu / h, hv / h
    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(
        (h - DEPTH).T,
        origin="lower",
        cmap="RdBu_r",
        extent=(0, LENGTH / 1e3, 0, LENGTH / 1e3 * h.shape[1] / h.shape[0]),
    )
    fig.colorbar(image, label="surface height (m)")
    every = max(1, h.shape[0] // 20)
    xs = (np.arange(h.shape[0]) + 0.5) * LENGTH / 1e3 / h.shape[0]
    ys = (np.arange(h.shape[1]) + 0.5) * LENGTH / 1e3 / h.shape[0]
    ax.quiver(xs[::every], ys[::every], u[::every, ::every].T, v[::every, ::every].T)
    ax.set(xlabel="x (km)", ylabel="y (km)", title=f"shallow water after {days:g} days")
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    args = parse_args(argv)
    world = JaxComm(MPI.COMM_WORLD)
    comm = world.create_cart([world.size], periods=[True])
    if args.nx % comm.size:
        raise SystemExit(f"--nx {args.nx} must be a multiple of the number of ranks ({comm.size})")
    dx = LENGTH / args.nx
    dy = dx
    x = (np.arange(args.nx) + 0.5) * dx
    y = (np.arange(args.ny) + 0.5) * dy
    local = args.nx // comm.size
    start = comm.coords[0] * local
    interior = initial_state(x[start : start + local], y)
    q = jnp.asarray(np.pad(interior, ((0, 0), (1, 1), (1, 1)), mode="edge"))

    # A fixed time step from the initial state's fastest wave (CFL number 0.4).
    h, hu, hv = interior
    fastest = np.max(np.maximum(np.abs(hu / h), np.abs(hv / h)) + np.sqrt(G * h))
    fastest = float(comm.allreduce(jnp.float32(fastest), op=MPI.MAX))
    dt = 0.4 * dx / fastest
    steps = max(1, round(args.days * DAY / dt))
    if args.overlap and local < 3:
        raise SystemExit("--overlap needs at least 3 cells in x per rank")
    if args.overlap and args.no_messages:
        raise SystemExit("--overlap and --no-messages exclude each other")
    advance = make_step(comm, dx, dy, dt, args.overlap, messages=not args.no_messages)

    chunk = 20
    bar = None
    if comm.rank == 0 and not args.benchmark:
        try:
            from tqdm import tqdm

            bar = tqdm(total=steps, unit="step", desc="shallow water")
        except ImportError:
            pass
    advance(q, 0).block_until_ready()  # compile before timing
    began = time.perf_counter()
    done = 0
    while done < steps:
        n = min(chunk, steps - done)
        q = advance(q, n)
        done += n
        if bar is not None:
            q.block_until_ready()
            bar.update(n)
    q.block_until_ready()
    elapsed = comm.mpi.allreduce(time.perf_counter() - began, op=MPI.MAX)
    if bar is not None:
        bar.close()

    state = gather_state(comm, q)
    if comm.rank == 0:
        if not np.all(np.isfinite(state)):
            raise SystemExit("shallow water: the solution blew up")
        print(
            f"{comm.size} ranks, {args.nx}x{args.ny} cells, {steps} steps of {dt:.1f} s: "
            f"{steps / elapsed:.1f} steps/s"
        )
        if args.save:
            np.save(args.save, state)
        if args.plot and not args.benchmark:
            plot(state, args.plot, args.days)
            print(f"saved {args.plot}")
    comm.free()


if __name__ == "__main__":
    main()
