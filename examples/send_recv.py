"""Exchange arrays between two ranks with send and recv inside jit, no tokens.

mpiexec -n 2 python examples/send_recv.py
"""

import jax
import jax.numpy as jnp
from mpi4py import MPI

from jaxcomm import JaxComm

comm = JaxComm(MPI.COMM_WORLD)
assert comm.size == 2, "run on 2 processes"


@jax.jit
def foo(arr):
    arr = arr + comm.rank
    # comm.sendrecv would do this in one call; the order below is kept as written.
    if comm.rank == 0:
        comm.send(arr, dest=1)
        other_arr = comm.recv(arr, source=1)
    else:
        other_arr = comm.recv(arr, source=0)
        comm.send(arr, dest=0)
    return other_arr


result = foo(jnp.zeros((3, 3)))
print(f"r{comm.rank} | {result}")
