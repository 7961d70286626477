"""Data-parallel training of a small MLP: each rank holds its own shard of a
synthetic regression dataset, and the gradients are averaged across ranks with
one pytree allreduce per step, so every rank applies the same update.

    mpiexec -n 2 python examples/data_parallel_mlp.py --steps 200
    mpiexec -n 2 python examples/data_parallel_mlp.py --steps 200 --buckets

With --buckets the backward pass runs layer by layer (jax.vjp), and each layer's
gradients (a bucket) are posted with `iallreduce` as soon as they are computed,
so that their messages travel while the earlier layers' gradients are computed;
the update waits for all of them.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import jax
import jax.numpy as jnp
from mpi4py import MPI

from jaxcomm import JaxComm

SIZES = (8, 64, 64, 1)  # input features, hidden layers, output


def init_params(key: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    params = []
    for fan_in, fan_out in itertools.pairwise(SIZES):
        key, sub = jax.random.split(key)
        params.append((jax.random.normal(sub, (fan_in, fan_out)) / fan_in**0.5, jnp.zeros(fan_out)))
    return params


def layer(weights, x: jax.Array, last: bool) -> jax.Array:
    w, b = weights
    return (x @ w + b)[:, 0] if last else jnp.tanh(x @ w + b)


def predict(params, x: jax.Array) -> jax.Array:
    for i, weights in enumerate(params):
        x = layer(weights, x, last=i == len(params) - 1)
    return x


def loss(params, x, y) -> jax.Array:
    return jnp.mean((predict(params, x) - y) ** 2)


def shard(rank: int, samples: int) -> tuple[jax.Array, jax.Array]:
    """This rank's share of the data: y = sin(sum of x) + noise."""
    kx, kn = jax.random.split(jax.random.fold_in(jax.random.key(1), rank))
    x = jax.random.normal(kx, (samples, SIZES[0]))
    y = jnp.sin(x.sum(axis=1)) + 0.05 * jax.random.normal(kn, (samples,))
    return x, y


def make_train_step(comm: JaxComm, learning_rate: float):
    @jax.jit
    def train_step(params, x, y):
        local_loss, grads = jax.value_and_grad(loss)(params, x, y)
        # One allreduce for the whole pytree of gradients (and one for the loss),
        # in the gradients' own buffers: they are not needed afterwards.
        grads = jax.tree.map(lambda g: g / comm.size, comm.allreduce(grads, in_place=True))
        params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
        return params, comm.allreduce(local_loss) / comm.size

    return train_step


def make_bucketed_train_step(comm: JaxComm, learning_rate: float):
    @jax.jit
    def train_step(params, x, y):
        backward = []
        for i, weights in enumerate(params):
            x, vjp = jax.vjp(partial(layer, last=i == len(params) - 1), weights, x)
            backward.append(vjp)
        local_loss, dloss = jax.value_and_grad(lambda p: jnp.mean((p - y) ** 2))(x)
        buckets = []
        for vjp in reversed(backward):  # last layer first, as the gradients appear
            grads, dloss = vjp(dloss)
            buckets.append(comm.iallreduce(grads))
        mean_loss = comm.iallreduce(local_loss)
        grads = [comm.wait(bucket) for bucket in reversed(buckets)]
        params = jax.tree.map(lambda p, g: p - learning_rate * g / comm.size, params, grads)
        return params, comm.wait(mean_loss) / comm.size

    return train_step


def identical_on_all_ranks(comm: JaxComm, params) -> bool:
    """Bitwise: the elementwise max over ranks equals the min over ranks."""
    highest = comm.allreduce(params, op=MPI.MAX)
    lowest = comm.allreduce(params, op=MPI.MIN)
    return all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(jax.tree.leaves(highest), jax.tree.leaves(lowest), strict=True)
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--samples", type=int, default=256, help="samples per rank")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument(
        "--check", action="store_true", help="verify identical parameters after every step"
    )
    parser.add_argument(
        "--buckets", action="store_true", help="allreduce each layer's gradients as they appear"
    )
    args = parser.parse_args(argv)

    comm = JaxComm(MPI.COMM_WORLD)
    # Different initial parameters per rank on purpose: one bcast makes them agree.
    params = comm.bcast(init_params(jax.random.key(comm.rank)), root=0)
    x, y = shard(comm.rank, args.samples)
    make = make_bucketed_train_step if args.buckets else make_train_step
    train_step = make(comm, args.learning_rate)

    for step in range(1, args.steps + 1):
        params, mean_loss = train_step(params, x, y)
        if args.check and not identical_on_all_ranks(comm, params):
            raise SystemExit(f"rank {comm.rank}: parameters differ between ranks after step {step}")
        if comm.rank == 0 and (step == 1 or step % 50 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {float(mean_loss):.4f}", flush=True)
    if identical_on_all_ranks(comm, params) and comm.rank == 0:
        print(f"parameters identical on all {comm.size} ranks")


if __name__ == "__main__":
    main()
