"""A JaxComm subclass with two custom operations, used under mpiexec:

cmake -S examples/custom_op -B build/custom_op $(python -m jaxcomm --cmake-args)
cmake --build build/custom_op
mpiexec -n 2 python examples/custom_op/my_comm.py build/custom_op/liballreduce_scale.so
"""

import ctypes
import sys

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxcomm
from jaxcomm import JaxComm


class MyComm(JaxComm):
    def allmean(self, x):
        """(a) Composed from built-in operations: the mean over ranks. Same shape as x."""
        return jax.tree.map(lambda s: s / self.size, self.allreduce(x, op=MPI.SUM))

    def allreduce_scaled(self, x, scale: float):
        """(b) Backed by our own C++ kernel: scale * sum over ranks, float64."""
        x = jnp.asarray(x, jnp.float64)
        (out,) = self.call_kernel(
            "allreduce_scale",
            x,
            results=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
            aliases={0: 0},
            scale=float(scale),
        )
        return out


def load_kernel(path: str) -> None:
    library = ctypes.CDLL(path)
    jaxcomm.register_kernel("allreduce_scale", library.allreduce_scale)


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)  # the kernel is float64 only
    load_kernel(sys.argv[1])
    comm = MyComm()
    derived = comm.dup()  # derived communicators keep the subclass
    assert type(derived) is MyComm and type(comm.split(0)) is MyComm

    @jax.jit
    def step(x):
        # Ordered with the built-in ops around it, in one jitted function.
        y = comm.allreduce_scaled(x + comm.rank, 0.5)
        return comm.bcast(y, root=0), comm.allmean(x * comm.rank)

    x = jnp.arange(3.0)
    scaled, mean = step(x)
    n = comm.size
    np.testing.assert_allclose(scaled, 0.5 * (n * np.arange(3.0) + n * (n - 1) / 2))
    np.testing.assert_allclose(mean, np.arange(3.0) * (n - 1) / 2)
    batched = jax.vmap(lambda v: derived.allreduce_scaled(v, 2.0))(jnp.ones((4, 2)))
    np.testing.assert_allclose(batched, np.full((4, 2), 2.0 * n))
    print(f"rank {comm.rank}: allreduce_scaled {scaled} allmean {mean}")
