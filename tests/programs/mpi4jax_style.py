"""A program written against mpi4jax 0.9's API, run with jaxcomm in its place:
module-level functions with comm=, status=MPI.Status() eagerly and inside jit."""

import jax
import jax.numpy as jnp
from mpi4py import MPI

import jaxcomm as mpi4jax

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert size == 2, "run on 2 ranks"
other = 1 - rank


@jax.jit
def total(x):
    return mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)


print("allreduce", total(jnp.full(3, rank + 1.0)).tolist())
print("bcast", mpi4jax.bcast(jnp.arange(3.0) + 10 * rank, root=1, comm=comm).tolist())

# Eager send/recv with a status to fill.
status = MPI.Status()
if rank == 0:
    mpi4jax.send(jnp.arange(4.0), dest=1, tag=7, comm=comm)
else:
    got = mpi4jax.recv(jnp.zeros(4), source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, comm=comm,
                       status=status)  # fmt: skip
    print("recv", got.tolist(), status.Get_source(), status.Get_tag())


# The same inside jit: the status is set when the compiled function runs.
@jax.jit
def exchange(x):
    return mpi4jax.sendrecv(x, x, source=other, dest=other, sendtag=3 + rank, comm=comm,
                            status=status)  # fmt: skip


out = exchange(jnp.full(2, 100.0 * rank))
jax.block_until_ready(out)
print("sendrecv", out.tolist(), status.Get_source(), status.Get_tag())
print("support", mpi4jax.has_cuda_support(), mpi4jax.has_sycl_support())
