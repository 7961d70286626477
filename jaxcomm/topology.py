"""Communicators whose topology MPI knows: Cartesian process grids (coordinates,
neighbours and halo exchange) and distributed graphs; the neighbour collectives
of both.

`Cartesian` and `Graph` hold their methods; jaxcomm.comm combines each with JaxComm
into CartComm and GraphComm (and into such a form of each JaxComm subclass)."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mpi4py import MPI

from jaxcomm import _collectives, _native, _requests, _variable_size
from jaxcomm._collectives import Neighborhood
from jaxcomm._primitive import CommInfo

PyTree = Any


class NeighborExchanges:
    """The neighbour collectives (MPI_Neighbor_*) of a communicator whose topology
    MPI knows, for a class that also derives from JaxComm (whose _apply and _comm
    they use). Each rank's blocks go to its destinations and come from its
    sources, in the order MPI keeps for the topology (`_neighborhood`)."""

    _apply: Any
    _variable_size: Any
    _post_rows: Any
    _Rows: Any
    _comm: CommInfo
    _blocks_name: str  # how errors name the number of blocks x must have
    _neighborhood: Neighborhood  # set by the topology's __init__

    def neighbor_allgather(self, x: PyTree) -> PyTree:
        """Every source's x: ``(sources, *x.shape)``, block i from source i
        (``MPI_Neighbor_allgather``).

        On a graph the sources are ``sources``; on a grid, the ``2 * len(dims)``
        neighbours in MPI's order (block ``2 d`` from the lower neighbour along grid
        dimension d, block ``2 d + 1`` from the upper one), with zeros from beyond a
        non-periodic edge.
        """
        return self._apply(_collectives.neighbor_allgather_p, x, neighborhood=self._neighborhood)[0]

    def neighbor_alltoall(self, x: PyTree) -> PyTree:
        """x: ``(destinations, *s)``; block j goes to destination j. Returns
        ``(sources, *s)``, block i from source i (``MPI_Neighbor_alltoall``).

        On a grid both are the neighbours in neighbor_allgather's order, with
        zeros from beyond a non-periodic edge.
        """
        self._check_blocks("neighbor_alltoall", x)
        return self._apply(_collectives.neighbor_alltoall_p, x, neighborhood=self._neighborhood)[0]

    def neighbor_alltoallv(
        self,
        x: jax.Array,
        send_counts: Any,
        *,
        capacity: int,
        recv_counts: Any = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Rows of x to each destination, how many given per call (traceable;
        ``MPI_Neighbor_alltoallv``).

        x: ``(n, *s)``, its rows grouped by destination: the first
        ``send_counts[0]`` go to destination 0, the next ``send_counts[1]`` to
        destination 1, and so on. send_counts: integers, ``(destinations,)``.

        Returns ``(y, recv_counts)``: y ``(capacity, *s)`` holds the rows received,
        grouped by source in source order, then zeros; recv_counts, int32
        ``(sources,)``, how many came from each. Without ``recv_counts`` one
        ``MPI_Neighbor_alltoall`` exchanges the counts first; a given one is
        trusted (checking mode verifies it). On a grid, nothing arrives from
        beyond a non-periodic edge (count 0), and rows sent there go nowhere. More
        rows than ``capacity`` arriving is an error on that rank, which keeps none
        of them; the other ranks get their rows.
        """
        rows = self._neighbor_alltoallv_rows(
            send_counts, capacity=capacity, recv_counts=recv_counts
        )
        return self._variable_size(x, rows)

    def neighbor_allgatherv(
        self, x: jax.Array, *, capacity: int, count: Any = None
    ) -> tuple[jax.Array, jax.Array]:
        """This rank's first ``count`` rows of x (default all) to every
        destination (``MPI_Neighbor_allgatherv``).

        x: ``(n, *s)``; count: an integer (traceable), at most n. Returns
        ``(y, counts)``: y ``(capacity, *s)`` holds the rows of each source in
        source order, then zeros; counts, int32 ``(sources,)``, how many came
        from each (one ``MPI_Neighbor_allgather`` learns them). On a grid,
        nothing arrives from beyond a non-periodic edge (count 0). More rows than
        ``capacity`` is an error on that rank, which keeps none of them.
        """
        return self._variable_size(
            x, self._neighbor_allgatherv_rows(capacity=capacity, count=count)
        )

    def ineighbor_alltoallv(
        self, x: jax.Array, send_counts: Any, *, capacity: int, recv_counts: Any = None
    ) -> _requests.Request:
        """Post neighbor_alltoallv (``MPI_Ineighbor_alltoallv``); ``wait`` returns
        ``(y, recv_counts)``. The counts are known at the post: without
        ``recv_counts`` the post first exchanges them (one blocking
        ``MPI_Neighbor_alltoall`` of one integer per neighbour), so give them to
        overlap the whole exchange. An overflow of ``capacity`` or invalid
        ``send_counts`` are the wait's error, on that rank."""
        rows = self._neighbor_alltoallv_rows(
            send_counts, capacity=capacity, recv_counts=recv_counts
        )
        return self._post_rows("ineighbor_alltoallv", x, rows)

    def ineighbor_allgatherv(
        self, x: jax.Array, *, capacity: int, count: Any = None
    ) -> _requests.Request:
        """Post neighbor_allgatherv (``MPI_Ineighbor_allgatherv``); ``wait`` returns
        ``(y, counts)``. The post exchanges the counts (one blocking
        ``MPI_Neighbor_allgather`` of one integer); an overflow of ``capacity`` is
        that rank's error at the wait, an invalid ``count`` that rank's."""
        rows = self._neighbor_allgatherv_rows(capacity=capacity, count=count)
        return self._post_rows("ineighbor_allgatherv", x, rows)

    def _neighbor_alltoallv_rows(self, send_counts: Any, *, capacity: int, recv_counts: Any = None):
        """neighbor_alltoallv's count operands, how many each holds, its params
        (exchanged unless recv_counts is given)."""
        hood = self._neighborhood
        exchange = recv_counts is None
        recv = _variable_size.no_counts(hood.sources) if exchange else recv_counts
        return self._Rows(
            _variable_size.neighbor_alltoallv_p,
            {"send_counts": send_counts, "recv_counts": recv},
            {
                "send_counts": (hood.destinations, "destination"),
                "recv_counts": (hood.sources, "source"),
            },
            {"capacity": capacity, "exchange": exchange, "neighborhood": hood},
        )

    def _neighbor_allgatherv_rows(self, *, capacity: int, count: Any = None):
        hood = self._neighborhood
        return self._Rows(
            _variable_size.neighbor_allgatherv_p,
            {"count": count, "counts": _variable_size.no_counts(hood.sources)},
            {"count": (None, ""), "counts": (hood.sources, "source")},
            {"capacity": capacity, "exchange": True, "neighborhood": hood},
        )

    def ineighbor_allgather(self, x: PyTree) -> _requests.Request:
        """Post neighbor_allgather (``MPI_Ineighbor_allgather``); ``wait`` returns
        ``(sources, *x.shape)``."""
        params = {"neighborhood": self._neighborhood}
        return _requests.post("ineighbor_allgather", x, self._comm, params)

    def ineighbor_alltoall(self, x: PyTree) -> _requests.Request:
        """Post neighbor_alltoall (``MPI_Ineighbor_alltoall``; x:
        ``(destinations, *s)``); ``wait`` returns ``(sources, *s)``."""
        self._check_blocks("ineighbor_alltoall", x)
        params = {"neighborhood": self._neighborhood}
        return _requests.post("ineighbor_alltoall", x, self._comm, params)

    def _check_blocks(self, operation: str, x: PyTree) -> None:
        """x's leaves must hold one block per destination."""
        blocks = self._neighborhood.destinations
        for leaf in jax.tree.leaves(x):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != blocks:
                raise ValueError(
                    f"{operation}: x must have a leading axis of {self._blocks_name}={blocks} "
                    f"(one block per destination), got shape {jnp.shape(leaf)}"
                )


class Cartesian(NeighborExchanges):
    """The methods of a communicator over an MPI Cartesian topology, for a class
    that also derives from JaxComm (whose mpi, rank, sendrecv and _apply they use)."""

    mpi: MPI.Cartcomm
    rank: int
    sendrecv: Any
    _blocks_name = "2 * len(dims)"

    def __init__(self, comm: Any = None, *, check: bool | None = None):
        super().__init__(comm, check=check)  # JaxComm's
        if self.mpi.Get_topology() != MPI.CART:
            self.free()  # the duplicate just made
            raise TypeError(f"{type(self).__name__}: comm must have a Cartesian topology")
        self._dims = tuple(self.mpi.dims)
        self._periods = tuple(bool(p) for p in self.mpi.periods)
        self._coords = tuple(self.mpi.Get_coords(self.rank))
        # Each neighbour is a source and a destination, in places that pair up:
        # an exchange is its own transpose.
        self._neighborhood = Neighborhood(2 * len(self._dims), 2 * len(self._dims))

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


class Graph(NeighborExchanges):
    """The methods of a communicator over an MPI distributed graph, for a class
    that also derives from JaxComm (whose mpi, check and free they use).

    It holds a second communicator, over the reversed graph (each edge turned
    round), whose exchanges are the transposes of this one's. Made here, with
    the graph (a collective call): never while tracing, which each rank does at
    its own time. free() frees both."""

    mpi: MPI.Distgraphcomm
    check: bool
    _blocks_name = "len(destinations)"
    _reverse: MPI.Comm = MPI.COMM_NULL  # until made: free() may come first

    def __init__(self, comm: Any = None, *, check: bool | None = None):
        super().__init__(comm, check=check)  # JaxComm's
        if self.mpi.Get_topology() != MPI.DIST_GRAPH:
            self.free()  # the duplicate just made
            raise TypeError(f"{type(self).__name__}: comm must have a distributed-graph topology")
        # As MPI keeps them: with reorder, those of the rank this process became.
        sources, destinations, _ = self.mpi.Get_dist_neighbors()
        self._sources = tuple(int(r) for r in sources)
        self._destinations = tuple(int(r) for r in destinations)
        jax.effects_barrier()  # no jaxcomm call may be running on XLA's threads meanwhile
        self._reverse = self.mpi.Create_dist_graph_adjacent(
            self._destinations, self._sources, reorder=False
        )
        self._reverse.Set_errhandler(MPI.ERRORS_RETURN)
        handle = _native.handle_of(self._reverse)
        info = self._comm
        reverse = CommInfo(_native.register_comm(handle), handle, info.rank, info.size, info.check)
        self._neighborhood = Neighborhood(len(self._sources), len(self._destinations), reverse)

    @property
    def sources(self) -> tuple[int, ...]:
        """The ranks this rank receives a block from, in order (its in-neighbours)."""
        return self._sources

    @property
    def destinations(self) -> tuple[int, ...]:
        """The ranks this rank sends a block to, in order (its out-neighbours)."""
        return self._destinations

    def free(self) -> None:
        """Free the MPI communicator and its reversed graph (collective)."""
        jax.effects_barrier()
        if self._reverse != MPI.COMM_NULL:
            _requests.settle(self._neighborhood.reverse.key)
            _native.unregister_comm(self._neighborhood.reverse.key)
            self._reverse.Free()
        super().free()  # JaxComm's


def _rank_list(argument: str, value: Any, size: int) -> list[int]:
    """`value` as a list of ranks of a communicator of `size`, or an error naming
    create_dist_graph's `argument`."""
    if isinstance(value, (str, bytes)) or not (
        isinstance(value, Sequence) or (np.ndim(value) == 1 and hasattr(value, "__array__"))
    ):
        raise TypeError(f"create_dist_graph: {argument} must be a sequence of ranks, got {value!r}")
    ranks = []
    for i, rank in enumerate(value):
        try:
            if isinstance(rank, (bool, np.bool_)):
                raise TypeError
            rank = operator.index(rank)
        except TypeError:
            raise TypeError(
                f"create_dist_graph: {argument}[{i}] must be an integer rank, got {rank!r}"
            ) from None
        if not 0 <= rank < size:
            raise ValueError(
                f"create_dist_graph: {argument}[{i}]={rank} is not a rank of this "
                f"communicator (size {size})"
            )
        ranks.append(rank)
    return ranks


def _agree(
    comm: MPI.Intracomm, error: Exception | None, operation: str, what: str, value: Any = None
) -> list[Any]:
    """Raise `error` on the ranks that have one and an error naming them on the
    others, if any rank has one: so that no rank enters a collective call that
    the others have left. Else every rank's `value`, in rank order (one
    allgather for both)."""
    gathered = comm.allgather((error is not None, value))
    if error is not None:
        raise error
    failed = [rank for rank, (bad, _) in enumerate(gathered) if bad]
    if failed:
        raise ValueError(f"{operation}: {what} on rank(s) {failed} (see their errors)")
    return [value for _, value in gathered]


def _edge_error(comm: MPI.Intracomm, sources: list[int], destinations: list[int]):
    """An error naming the ranks whose edges to this rank disagree with its
    `sources`, if any: each edge must be in its source's destinations and its
    destination's sources, as often."""
    size = comm.Get_size()
    sent = np.bincount(np.asarray(destinations, np.int64), minlength=size).astype(np.int32)
    named = np.empty_like(sent)  # how often each rank's destinations name this one
    comm.Alltoall(sent, named)
    expected = np.bincount(np.asarray(sources, np.int64), minlength=size)
    wrong = [
        f"rank {r} names it {named[r]} time(s), its sources {expected[r]}"
        for r in np.flatnonzero(named != expected)
    ]
    if not wrong:
        return None
    return ValueError(
        f"create_dist_graph: the graph is inconsistent at rank {comm.Get_rank()}: in their "
        f"destinations {'; '.join(wrong)} (every edge must be in its source's "
        "destinations and its destination's sources)"
    )


def dist_graph_mpi_comm(
    comm: MPI.Intracomm, sources: Any, destinations: Any, reorder: bool = False
) -> MPI.Distgraphcomm:
    """A new MPI distributed-graph communicator over comm's ranks, with this rank's
    in- and out-neighbours (see JaxComm.create_dist_graph). Every rank checks its
    lists and the edges they share with the other ranks' before any creates it."""
    jax.effects_barrier()  # no jaxcomm call may be running on XLA's threads meanwhile
    size = comm.Get_size()
    error = None
    try:
        sources = _rank_list("sources", sources, size)
        destinations = _rank_list("destinations", destinations, size)
    except (TypeError, ValueError) as raised:
        error = raised
    _agree(comm, error, "create_dist_graph", "invalid sources or destinations")
    error = _edge_error(comm, sources, destinations)
    _agree(comm, error, "create_dist_graph", "an inconsistent graph")
    return comm.Create_dist_graph_adjacent(sources, destinations, reorder=bool(reorder))


def cartesian_mpi_comm(
    comm: MPI.Intracomm,
    dims: Sequence[int],
    periods: Sequence[bool] | None = None,
    reorder: bool = False,
) -> MPI.Cartcomm:
    """A new MPI Cartesian communicator over comm's ranks (see JaxComm.create_cart).
    Every rank checks its arguments, and that they are every other rank's, before
    any creates it: MPI makes a grid of another shape on a rank that asks for
    one, whose neighbour exchanges then wait for ever."""
    jax.effects_barrier()  # no jaxcomm call may be running on XLA's threads meanwhile
    grid, error = None, None
    try:
        grid = (*_grid(comm.Get_size(), dims, periods), bool(reorder))
    except (TypeError, ValueError) as raised:
        error = raised
    asked = _agree(comm, error, "create_cart", "invalid dims or periods", grid)
    for rank, other in enumerate(asked):
        if other != asked[0]:
            raise ValueError(
                f"create_cart: rank {rank} asks for dims {list(other[0])}, periods "
                f"{list(other[1])}, reorder={other[2]} and rank 0 for dims {list(asked[0][0])}, "
                f"periods {list(asked[0][1])}, reorder={asked[0][2]}: every rank must ask for "
                "the same grid"
            )
    dims, periods, reorder = grid
    return comm.Create_cart(list(dims), periods=list(periods), reorder=reorder)


def _grid(size: int, dims: Sequence[int], periods: Sequence[bool] | None) -> tuple:
    """(dims, periods) of a grid of `size` ranks, as tuples, zeros in dims filled
    as MPI_Dims_create does; or an error naming what does not fit."""
    dims = [operator.index(d) for d in dims]
    periods = [False] * len(dims) if periods is None else [bool(p) for p in periods]
    if len(periods) != len(dims):
        raise ValueError(f"create_cart: periods {periods} and dims {dims} differ in length")
    fixed = math.prod(d for d in dims if d > 0)
    if any(d < 0 for d in dims) or size % fixed:
        raise ValueError(f"create_cart: dims {dims} do not fit size={size}")
    dims = MPI.Compute_dims(size, dims)  # fills zeros, like MPI_Dims_create
    if math.prod(dims) != size:
        raise ValueError(f"create_cart: dims {dims} do not multiply to size={size}")
    return tuple(dims), tuple(periods)
