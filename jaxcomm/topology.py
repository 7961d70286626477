"""Cartesian process grids: coordinates, neighbours and halo exchange.

`Cartesian` holds the grid's methods; jaxcomm.comm combines it with JaxComm into
CartComm (and into a Cartesian form of each JaxComm subclass)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from mpi4py import MPI

from jaxcomm import _collectives, _requests
from jaxcomm._primitive import CommInfo

PyTree = Any


class Cartesian:
    """The methods of a communicator over an MPI Cartesian topology, for a class
    that also derives from JaxComm (whose mpi, rank, sendrecv and _apply they use)."""

    mpi: MPI.Cartcomm
    rank: int
    sendrecv: Any
    _apply: Any
    _comm: CommInfo

    def __init__(self, comm: Any = None, *, check: bool | None = None):
        super().__init__(comm, check=check)  # JaxComm's
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

    def neighbor_allgather(self, x: PyTree) -> PyTree:
        """Every neighbour's x: ``(2 * len(dims), *x.shape)``.

        Block ``2 d`` comes from the lower neighbour along grid dimension d and
        block ``2 d + 1`` from the upper one (``MPI_Neighbor_allgather``); blocks
        from beyond a non-periodic edge are zeros.
        """
        return self._apply(_collectives.neighbor_allgather_p, x, neighbors=self._neighbors)[0]

    def neighbor_alltoall(self, x: PyTree) -> PyTree:
        """x: ``(2 * len(dims), *s)``; block k goes to neighbour k and block k of
        the result comes from it, in neighbor_allgather's order
        (``MPI_Neighbor_alltoall``). Zeros from beyond a non-periodic edge.
        """
        self._check_blocks("neighbor_alltoall", x)
        return self._apply(_collectives.neighbor_alltoall_p, x)[0]

    def ineighbor_allgather(self, x: PyTree) -> _requests.Request:
        """Post neighbor_allgather (``MPI_Ineighbor_allgather``); ``wait`` returns
        ``(2 * len(dims), *x.shape)``."""
        return _requests.post("ineighbor_allgather", x, self._comm, {"neighbors": self._neighbors})

    def ineighbor_alltoall(self, x: PyTree) -> _requests.Request:
        """Post neighbor_alltoall (``MPI_Ineighbor_alltoall``; x:
        ``(2 * len(dims), *s)``); ``wait`` returns ``(2 * len(dims), *s)``."""
        self._check_blocks("ineighbor_alltoall", x)
        return _requests.post("ineighbor_alltoall", x, self._comm, {})

    @property
    def _neighbors(self) -> int:
        return 2 * len(self.dims)

    def _check_blocks(self, operation: str, x: PyTree) -> None:
        """x's leaves must hold one block per neighbour."""
        for leaf in jax.tree.leaves(x):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != self._neighbors:
                raise ValueError(
                    f"{operation}: x must have a leading axis of 2 * len(dims)={self._neighbors} "
                    f"(one block per neighbour), got shape {jnp.shape(leaf)}"
                )

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


def cartesian_mpi_comm(
    comm: MPI.Intracomm,
    dims: Sequence[int],
    periods: Sequence[bool] | None = None,
    reorder: bool = False,
) -> MPI.Cartcomm:
    """A new MPI Cartesian communicator over comm's ranks (see JaxComm.create_cart)."""
    size = comm.Get_size()
    dims = [int(d) for d in dims]
    periods = [False] * len(dims) if periods is None else [bool(p) for p in periods]
    if len(periods) != len(dims):
        raise ValueError(f"create_cart: periods {periods} and dims {dims} differ in length")
    fixed = math.prod(d for d in dims if d > 0)
    if any(d < 0 for d in dims) or size % fixed:
        raise ValueError(f"create_cart: dims {dims} do not fit size={size}")
    dims = MPI.Compute_dims(size, dims)  # fills zeros, like MPI_Dims_create
    if math.prod(dims) != size:
        raise ValueError(f"create_cart: dims {dims} do not multiply to size={size}")
    jax.effects_barrier()  # no jaxcomm call may be running on XLA's threads meanwhile
    return comm.Create_cart(dims, periods=periods, reorder=reorder)
