"""Diffusion on an unstructured triangular mesh, split over the ranks by recursive
coordinate bisection; ghost cells travel over a distributed-graph communicator.

    mpiexec -n 4 python examples/unstructured_mesh.py --plot mesh.png

Each rank builds the same mesh (a jittered grid whose squares are cut along a
random diagonal), keeps the triangles of its part and learns which of its cells
each neighbouring part needs. Every time step sends those cells' values to the
neighbours with one `neighbor_alltoallv` over `comm.create_dist_graph` (the
counts never change, so they are given and not exchanged), then updates each
cell from its three edge neighbours: a finite-volume scheme with no flux across
the domain's boundary. All steps run in one jitted `lax.fori_loop`.

The run is then checked against the same scheme on one rank without MPI, first
the final field, then the gradient with respect to the diffusion coefficient of
a misfit to that field (`jax.grad` through the whole loop, exchanges included).
Last, a few Gauss-Newton steps on the misfit recover the coefficient.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm

D_TRUE, D_START, D_MAX = 1.0, 0.4, 2.0  # diffusion coefficients: sought, first guess, bound


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32, help="grid squares per side (2 n^2 cells)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fits", type=int, default=4, help="Gauss-Newton steps on D")
    parser.add_argument("--plot", metavar="PNG", help="save the parts and the final field")
    return parser.parse_args(argv)


def make_mesh(n: int):
    """Points (P, 2), triangles (T, 3), each triangle's neighbour across its edge k
    (T, 3; -1 on the boundary) and that edge's weight length / centroid distance."""
    rng = np.random.default_rng(0)
    g = np.linspace(0.0, 1.0, n + 1)
    points = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    inner = np.all((points > 0) & (points < 1), axis=1)
    points[inner] += rng.uniform(-0.3, 0.3, (inner.sum(), 2)) / n
    i, j = (a.ravel() for a in np.meshgrid(np.arange(n), np.arange(n), indexing="ij"))
    a, b, c, d = (
        i * (n + 1) + j,
        (i + 1) * (n + 1) + j,
        i * (n + 1) + j + 1,
        (i + 1) * (n + 1) + j + 1,
    )
    flip = rng.random(n * n) < 0.5  # which diagonal cuts each square
    triangles = np.concatenate(
        [np.where(flip[:, None], np.stack([a, b, d], 1), np.stack([a, b, c], 1)),
         np.where(flip[:, None], np.stack([a, d, c], 1), np.stack([b, d, c], 1))]
    )  # fmt: skip
    edges = np.sort(triangles[:, [[0, 1], [1, 2], [2, 0]]].reshape(-1, 2), axis=1)
    _, edge_id = np.unique(edges, axis=0, return_inverse=True)
    order = np.argsort(edge_id.ravel(), kind="stable")  # an inner edge's two halves side by side
    pair = np.flatnonzero(edge_id.ravel()[order][1:] == edge_id.ravel()[order][:-1])
    neighbour = np.full(3 * len(triangles), -1)
    neighbour[order[pair]], neighbour[order[pair + 1]] = order[pair + 1] // 3, order[pair] // 3
    neighbour = neighbour.reshape(-1, 3)
    centroid = points[triangles].mean(axis=1)
    length = np.linalg.norm(np.diff(points[edges], axis=1)[:, 0], axis=1).reshape(-1, 3)
    distance = np.linalg.norm(centroid[:, None] - centroid[neighbour], axis=2)
    weight = np.where(neighbour >= 0, length / np.where(neighbour >= 0, distance, 1.0), 0.0)
    return points, triangles, neighbour, weight


def bisect(centroid: np.ndarray, cells: np.ndarray, first: int, parts: int, owner: np.ndarray):
    """Recursive coordinate bisection: owner[cells] in first .. first + parts - 1, the
    cells cut across their longer extent in proportion to the parts on each side."""
    if parts == 1:
        owner[cells] = first
        return
    axis = np.argmax(np.ptp(centroid[cells], axis=0))
    cells = cells[np.argsort(centroid[cells, axis], kind="stable")]
    cut = round(len(cells) * (parts // 2) / parts)
    bisect(centroid, cells[:cut], first, parts // 2, owner)
    bisect(centroid, cells[cut:], first + parts // 2, parts - parts // 2, owner)


@dataclass
class Part:
    """One rank's cells (local index: owned first, then ghosts) and its traffic."""

    cells: np.ndarray  # (own,) global ids of the owned cells
    neighbours: list[int]  # the ranks sharing a mesh edge, sorted
    send: np.ndarray  # local ids of the cells sent, grouped by neighbour
    send_counts: np.ndarray  # (len(neighbours),)
    recv_counts: np.ndarray  # (len(neighbours),): ghosts from each, in order
    near: np.ndarray  # (own, 3) local id across each edge (the cell itself on the boundary)
    weight: np.ndarray  # (own, 3)


def make_part(neighbour: np.ndarray, weight: np.ndarray, owner: np.ndarray, rank: int) -> Part:
    cells = np.flatnonzero(owner == rank)
    across = neighbour[cells]
    foreign = (across >= 0) & (owner[across] != rank)
    ghosts = np.unique(across[foreign])
    ghosts = ghosts[np.argsort(owner[ghosts], kind="stable")]  # by owner, then global id
    ranks, recv_counts = np.unique(owner[ghosts], return_counts=True)
    local = np.full(len(owner), -1)
    local[cells], local[ghosts] = np.arange(len(cells)), len(cells) + np.arange(len(ghosts))
    # What rank q needs of ours: our cells next to one of q's, in global order, as q sorts them.
    send = [np.unique(cells[(foreign & (owner[across] == q)).any(axis=1)]) for q in ranks]
    near = np.where(across >= 0, local[across], np.arange(len(cells))[:, None])
    return Part(
        cells=cells,
        neighbours=[int(q) for q in ranks],
        send=local[np.concatenate([np.zeros(0, int), *send])],
        send_counts=np.array([len(s) for s in send], np.int32),
        recv_counts=recv_counts.astype(np.int32),
        near=near,
        weight=weight[cells].astype(np.float32),
    )


def make_run(part: Part, area, u0, dt: float, steps: int, graph=None, progress=None):
    """u(D) after the steps on this part's cells; graph is None on one rank without MPI."""
    near, weight = jnp.asarray(part.near), jnp.asarray(part.weight)
    scale = jnp.asarray(dt / area[part.cells], jnp.float32)
    ghosts = int(part.recv_counts.sum())

    def step(i, u, D):
        if graph is not None:
            received, _ = graph.neighbor_alltoallv(
                u[part.send], part.send_counts, capacity=ghosts, recv_counts=part.recv_counts
            )
            u_all = jnp.concatenate([u, received])
        else:
            u_all = u
        if progress is not None:
            jax.debug.callback(progress, i)
        # Edges in a fixed order, so each cell's arithmetic is the same on any number of ranks.
        flux = [weight[:, k] * (u_all[near[:, k]] - u) for k in range(3)]
        return u + D * scale * ((flux[0] + flux[1]) + flux[2])

    def run(D):
        return jax.lax.fori_loop(0, steps, lambda i, u: step(i, u, D), jnp.asarray(u0[part.cells]))

    return run


def misfit(u: jax.Array, observed: jax.Array, area: jax.Array) -> jax.Array:
    """Area-weighted squared distance between two fields on the same cells."""
    return jnp.sum(area * (u - observed) ** 2)


def main(argv=None) -> None:
    args = parse_args(argv)
    comm = JaxComm(MPI.COMM_WORLD)
    points, triangles, neighbour, weight = make_mesh(args.n)
    centroid = points[triangles].mean(axis=1)
    (x0, y0), (x1, y1), (x2, y2) = (points[triangles[:, k]].T for k in range(3))
    area = 0.5 * np.abs((x1 - x0) * (y2 - y0) - (x2 - x0) * (y1 - y0))
    u0 = np.exp(-np.sum((centroid - [0.3, 0.6]) ** 2, axis=1) / 0.01).astype(np.float32)
    # The explicit step is stable while D dt sum(weights) / area < 1, for any D <= D_MAX.
    dt = 0.9 * np.min(area / weight.sum(axis=1)) / D_MAX
    owner = np.zeros(len(triangles), int)
    bisect(centroid, np.arange(len(triangles)), 0, comm.size, owner)
    part = make_part(neighbour, weight, owner, comm.rank)
    graph = comm.create_dist_graph(part.neighbours, part.neighbours)

    bar = progress = None
    if comm.rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, unit="step", desc="diffusion")
            progress = lambda i: bar.update(1)  # noqa: E731
        except ImportError:
            pass
    run = jax.jit(make_run(part, area, u0, dt, args.steps, graph, progress))
    observed = run(jnp.float32(D_TRUE))
    if bar is not None:
        bar.close()

    # The misfit is summed over the ranks; D is one number shared by all, so its
    # cotangent adds up over the ranks too (pvary).
    quiet = jax.jit(make_run(part, area, u0, dt, args.steps, graph))
    mine = jnp.asarray(area[part.cells], jnp.float32)
    loss = jax.jit(
        jax.value_and_grad(lambda D: comm.allreduce(misfit(quiet(comm.pvary(D)), observed, mine)))
    )
    value, gradient = loss(jnp.float32(D_START))

    fields = comm.mpi.gather((part.cells, np.asarray(observed)), root=0)
    if comm.rank == 0:
        field = np.zeros(len(triangles), np.float32)
        for cells, values in fields:
            field[cells] = values
        # The same scheme on one rank, without MPI: the reference.
        alone = make_part(neighbour, weight, np.zeros(len(triangles), int), 0)
        serial = jax.jit(make_run(alone, area, u0, dt, args.steps))
        reference = np.asarray(serial(jnp.float32(D_TRUE)))
        whole = jnp.asarray(area, jnp.float32)
        serial_gradient = jax.grad(lambda D: misfit(serial(D), reference, whole))(
            jnp.float32(D_START)
        )
        error = float(np.max(np.abs(field - reference)))
        gradient_error = abs(float(gradient - serial_gradient)) / abs(float(serial_gradient))
        # float32 rounding, at most a unit (eps) per step of each value's history.
        tolerance = args.steps * np.finfo(np.float32).eps
        ok = error <= tolerance * np.max(np.abs(reference)) and gradient_error <= tolerance
        print(
            f"{comm.size} ranks, {len(triangles)} triangles, {args.steps} steps: "
            f"max |u - u_1rank| {error:.1e}, dmisfit/dD {float(gradient):.6g} "
            f"vs 1 rank {float(serial_gradient):.6g} (relative {gradient_error:.1e}), "
            f"tolerance {tolerance:.1e}: {'ok' if ok else 'FAILED'}",
            flush=True,
        )
        if not ok:
            raise SystemExit("unstructured_mesh: the run differs from the 1-rank run")
    path = [D_START]
    for _ in range(args.fits):
        # Gauss-Newton on the residual norm: the misfit is ~ a (D - D_TRUE)^2 near its zero.
        step = 2.0 * float(value) / float(gradient) if gradient != 0 else 0.0  # 0: an exact fit
        path.append(float(np.clip(path[-1] - step, 0.1, D_MAX)))
        value, gradient = loss(jnp.float32(path[-1]))
    if comm.rank == 0:
        print(f"fitted D: {' -> '.join(f'{D:.5f}' for D in path)} (true {D_TRUE})")
        if args.plot:
            plot(points, triangles, owner, field, args.plot)
            print(f"saved {args.plot}")
    graph.free()


def plot(points, triangles, owner, field, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 4.2))
    lines = dict(edgecolors="w", linewidth=0.1)
    left.tripcolor(*points.T, triangles, facecolors=owner, cmap="tab10", vmin=0, vmax=9, **lines)
    shown = right.tripcolor(*points.T, triangles, facecolors=field, cmap="viridis", **lines)
    figure.colorbar(shown, ax=right, shrink=0.8, label="u")
    left.set(aspect="equal", title="parts (recursive coordinate bisection)")
    right.set(aspect="equal", title="u after the steps")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
