"""The JPI README program, written with JaxComm: gradients through scatter and allreduce.

Rank 0 scatters x in rows of 2, the last rank doubles its row, everyone sums the
allreduce. Under the gradient convention (docs/autodiff.md) the gradient lands on
rank 0, which owns x:

mpiexec -n 4 python examples/jpi_scatter_grad.py
Rank 0 has result 41.0 and gradient [1. 1. 1. 1. 1. 1. 2. 2.]
Rank 1 has result 41.0 and gradient [0. 0. 0. 0. 0. 0. 0. 0.]
...
"""

import jax
import jax.numpy as jnp
from mpi4py import MPI

from jaxcomm import JaxComm

comm = JaxComm(MPI.COMM_WORLD)
rank, size = comm.rank, comm.size

# Rank 0 holds the data; the others pass zeros of the same shape.
x = jnp.arange(2 * size, dtype=jnp.float32) if rank == 0 else jnp.zeros(2 * size, jnp.float32)


def func(x):
    rows = x.reshape(size, 2)
    # Non-root ranks pass a template of one row's shape; its values are not read.
    mine = comm.scatter(rows if rank == 0 else rows[0], root=0)
    if rank == size - 1:  # each rank can do something different
        mine = mine * 2
    return jnp.sum(comm.allreduce(mine, op=MPI.SUM))


result = jax.jit(func)(x)
gradient = jax.jit(jax.grad(func))(x)
print(f"Rank {rank} has result {result} and gradient {gradient}")
