"""Sum an array over all ranks (the mpi4jax README example, with JaxComm).

mpiexec -n 4 python examples/global_sum.py
"""

import jax
import jax.numpy as jnp
from mpi4py import MPI

from jaxcomm import JaxComm

comm = JaxComm(MPI.COMM_WORLD)


@jax.jit
def foo(arr):
    arr = arr + comm.rank
    return comm.allreduce(arr, op=MPI.SUM)


result = foo(jnp.zeros((3, 3)))

if comm.rank == 0:
    print(result)
