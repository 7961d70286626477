"""Cartesian process grids: coordinates, neighbours and halo exchange."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from mpi4py import MPI

from jaxcomm.comm import JaxComm

PyTree = Any


class CartComm(JaxComm):
    """A JaxComm over an MPI Cartesian topology (made by JaxComm.create_cart)."""

    def __init__(self, comm: MPI.Cartcomm | JaxComm | None = None, *, check: bool | None = None):
        super().__init__(comm, check=check)
        if self.mpi.Get_topology() != MPI.CART:
            raise TypeError(f"{type(self).__name__}: comm must have a Cartesian topology")
        self._dims = tuple(self.mpi.dims)
        self._periods = tuple(bool(p) for p in self.mpi.periods)
        self._coords = tuple(self.mpi.Get_coords(self.rank))

    @property
    def dims(self) -> tuple[int, ...]:
        """Number of ranks along each grid dimension."""
        return self._dims

    @property
    def periods(self) -> tuple[bool, ...]:
        """Whether each grid dimension wraps around."""
        return self._periods

    @property
    def coords(self) -> tuple[int, ...]:
        """This rank's position in the grid."""
        return self._coords

    def shift(self, direction: int, disp: int = 1) -> tuple[int, int]:
        """(source, dest) ranks `disp` steps down and up along grid dimension `direction`.

        Beyond a non-periodic edge the rank is MPI.PROC_NULL (like MPI_Cart_shift).
        """
        if not 0 <= direction < len(self.dims):
            raise ValueError(f"shift: direction={direction} is not a dimension of {self.dims}")
        return self.mpi.Shift(direction, disp)

    def halo_exchange(
        self, x: PyTree, axis: int, width: int = 1, direction: int | None = None
    ) -> PyTree:
        """Fill the halos of x along array `axis` from the neighbours along grid
        dimension `direction` (default: `axis`). Same shapes as x.

        x holds `width` halo cells at each end of `axis` around its interior. The
        lower halo receives the lower neighbour's last interior cells and the upper
        halo the upper neighbour's first ones. At a non-periodic edge the halo keeps
        its values (set boundary conditions there). Works under jit, grad and vmap.
        """
        direction = axis if direction is None else direction
        lower, upper = self.shift(direction, 1)

        def exchange(a: jax.Array) -> jax.Array:
            n = a.shape[axis]
            if not 0 < 2 * width <= n - width:  # the interior must cover both halos
                raise ValueError(
                    f"halo_exchange: width={width} halos do not fit axis {axis} of shape {a.shape}"
                )
            take = lambda start: lax.slice_in_dim(a, start, start + width, axis=axis)  # noqa: E731
            # Upward: my top interior cells become the upper neighbour's lower halo.
            from_lower = self.sendrecv(take(n - 2 * width), source=lower, dest=upper)
            from_upper = self.sendrecv(take(width), source=upper, dest=lower)
            if lower != MPI.PROC_NULL:
                a = lax.dynamic_update_slice_in_dim(a, from_lower, 0, axis)
            if upper != MPI.PROC_NULL:
                a = lax.dynamic_update_slice_in_dim(a, from_upper, n - width, axis)
            return a

        return jax.tree.map(lambda leaf: exchange(jnp.asarray(leaf)), x)


@cache
def cartesian_type(cls: type[JaxComm]) -> type[CartComm]:
    """`cls` with the Cartesian methods: a subclass keeps its own methods on grids."""
    if issubclass(cls, CartComm):
        return cls
    if cls is JaxComm:
        return CartComm
    return type(f"Cart{cls.__name__}", (CartComm, cls), {"__module__": cls.__module__})


def create_cart(
    comm: JaxComm, dims: Sequence[int], periods: Sequence[bool] | None = None, reorder: bool = False
) -> CartComm:
    dims = [int(d) for d in dims]
    periods = [False] * len(dims) if periods is None else [bool(p) for p in periods]
    if len(periods) != len(dims):
        raise ValueError(f"create_cart: periods {periods} and dims {dims} differ in length")
    fixed = math.prod(d for d in dims if d > 0)
    if any(d < 0 for d in dims) or comm.size % fixed:
        raise ValueError(f"create_cart: dims {dims} do not fit size={comm.size}")
    dims = MPI.Compute_dims(comm.size, dims)  # fills zeros, like MPI_Dims_create
    if math.prod(dims) != comm.size:
        raise ValueError(f"create_cart: dims {dims} do not multiply to size={comm.size}")
    jax.effects_barrier()  # no jaxcomm call may be running on XLA's threads meanwhile
    cart = comm.mpi.Create_cart(dims, periods=periods, reorder=reorder)
    try:
        return cartesian_type(type(comm))(cart, check=comm.check)
    finally:
        cart.Free()
