"""Workload benchmark: one data-parallel training step of a small MLP.

    mpiexec -n 2 python bench/mlp.py

The model has 10 arrays (5 dense layers of width 512, about 1.05 M float32
parameters). Each rank computes gradients on its own batch; the gradients are
averaged across ranks with jaxcomm (one pytree allreduce), with mpi4jax (one
allreduce per array; when installed), or not at all (the no-communication
baseline). Each is timed with one step per jitted call and with several steps
per call (a fori_loop): JAX waits for the previous call with an ordered effect
to finish before it dispatches the next, so the two differ by the per-call cost.
Prints the median time per step of the slowest rank and writes JSON lines to
bench/results/mlp.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent))
import backends as B

WIDTH, DEPTH, BATCH = 512, 5, 64


def init(key):
    params = []
    for _ in range(DEPTH):
        key, sub = jax.random.split(key)
        params.append((jax.random.normal(sub, (WIDTH, WIDTH)) / WIDTH**0.5, jnp.zeros(WIDTH)))
    return params


def loss(params, x, y):
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return jnp.mean((x @ w + b - y) ** 2)


def train_step(average, steps_per_call=1):
    """A jitted function that runs `steps_per_call` training steps."""

    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        grads = average(grads)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    if steps_per_call == 1:
        return jax.jit(step)
    return jax.jit(
        lambda params, x, y: jax.lax.fori_loop(
            0, steps_per_call, lambda _, p: step(p, x, y), params
        )
    )


def averagers(comm: MPI.Intracomm) -> dict:
    from jaxcomm import JaxComm

    jcomm = JaxComm(comm)
    size = comm.size
    found = {
        "no-communication": lambda g: g,
        "jaxcomm": lambda g: jax.tree.map(lambda a: a / size, jcomm.allreduce(g)),
    }
    if B.mpi4jax_available():
        import mpi4jax

        found["mpi4jax"] = lambda g: jax.tree.map(
            lambda a: mpi4jax.allreduce(a, op=MPI.SUM, comm=comm) / size, g
        )
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48, help="steps per timed loop")
    parser.add_argument(
        "--steps-per-call", type=int, default=8, help="steps per jitted call, besides one"
    )
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD.Dup()
    params = init(jax.random.key(0))
    n_params = sum(a.size for a in jax.tree.leaves(params))
    x = jax.random.normal(jax.random.key(1 + comm.rank), (BATCH, WIDTH))
    y = jnp.sin(x)

    per_call = sorted({1, args.steps_per_call})
    steps = {
        (name, k): train_step(avg, k) for name, avg in averagers(comm).items() for k in per_call
    }
    for (name, _), step in steps.items():
        p = step(params, x, y)  # compile; check that averaged parameters agree across ranks
        if name != "no-communication":
            flat = jnp.concatenate([a.ravel() for a in jax.tree.leaves(p)])
            assert comm.allreduce(float(jnp.abs(flat).sum()), op=MPI.MAX) == float(
                jnp.abs(flat).sum()
            ), f"{name}: parameters differ between ranks"

    times = {key: [] for key in steps}
    for _ in range(args.reps):
        for (name, k), step in steps.items():
            calls = max(1, args.steps // k)
            p = params
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                p = step(p, x, y)
            jax.block_until_ready(p)
            elapsed = (time.perf_counter() - start) / (calls * k)
            times[(name, k)].append(comm.allreduce(elapsed, op=MPI.MAX))

    if comm.rank == 0:
        print(
            f"# MLP: {len(jax.tree.leaves(params))} arrays, {n_params} parameters, "
            f"batch {BATCH} per rank, {comm.size} ranks"
        )
        print(f"{'averaging':<18}{'steps/call':>11}{'ms/step':>10}{'x no-comm':>11}")
        args.out.mkdir(parents=True, exist_ok=True)
        medians = {key: statistics.median(samples) for key, samples in times.items()}
        with open(args.out / "mlp.jsonl", "w") as f:
            for (name, k), median in sorted(medians.items(), key=lambda item: item[0][1]):
                base = medians[("no-communication", k)]
                print(f"{name:<18}{k:>11}{median * 1e3:>10.3f}{median / base:>11.2f}")
                record = {
                    "workload": "mlp",
                    "backend": name,
                    "steps_per_call": k,
                    "median_ms": median * 1e3,
                    "min_ms": min(times[(name, k)]) * 1e3,
                    "ranks": comm.size,
                    "params": n_params,
                }
                f.write(json.dumps(record) + "\n")
        for k in per_call:
            if ("mpi4jax", k) in medians:
                ratio = medians[("jaxcomm", k)] / medians[("mpi4jax", k)]
                print(f"# jaxcomm / mpi4jax with {k} step(s) per call: {ratio:.2f}")
    comm.Free()


if __name__ == "__main__":
    main()
