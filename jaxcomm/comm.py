"""JaxComm: an MPI communicator whose operations are JAX primitives."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from mpi4py import MPI

from jaxcomm import (
    _checks,
    _collectives,
    _dispatch,
    _eager,
    _kernels,
    _lockstep,
    _native,
    _nonblocking,
    _p2p,
    _reductions,
    _replicated,
    _requests,
    _settings,
    _sharded,
    _variable_size,
    topology,
)
from jaxcomm._primitive import CommInfo, CommPrimitive
from jaxcomm._requests import Request

PyTree = Any
Self = TypeVar("Self", bound="JaxComm")
T = TypeVar("T", bound="JaxComm")
P = ParamSpec("P")


class Status(NamedTuple):
    """Source rank and tag of a received message (int32 scalars, traceable)."""

    source: jax.Array
    tag: jax.Array


def _status(status: Any, like: Any) -> Status:
    """A Status from a receive's (source, tag) array; a NumPy one (from the eager
    path) is made into arrays on the device of jax.Array `like`."""
    if isinstance(status, np.ndarray):
        return Status(*_eager.scalars(status, like))
    return Status(status[0], status[1])


def _received(result: PyTree, rest: Sequence[Any], source: int, tag: int) -> tuple:
    """(result, Status) of a receive whose last message's other results are `rest`."""
    if not rest:  # an empty pytree: nothing arrived
        return result, Status(jnp.int32(source), jnp.int32(tag))
    return result, _status(rest[0], jax.tree.leaves(result)[-1])


_no_counts = _variable_size.no_counts


def _alltoallv_counts(size: int, send_counts: Any, recv_counts: Any) -> tuple[dict, bool]:
    """alltoallv's count operands by name, and whether the call exchanges them."""
    exchange = recv_counts is None
    recv = _no_counts(size) if exchange else recv_counts
    return {"send_counts": send_counts, "recv_counts": recv}, exchange


class _Rows(NamedTuple):
    """A variable-size exchange as a method passes it (JaxComm._variable_size,
    _post_rows): its primitive, its count operands by name in order, how many
    each holds and of whom where not one per rank (_rows_operands), its params."""

    primitive: CommPrimitive
    counts: dict[str, Any]
    peers: dict[str, tuple[int, str]] | None
    params: dict[str, Any]


#: Parameters of blocking methods that their non-blocking forms do not take.
_BLOCKING_ONLY = ("in_place",)


def _nonblocking_method(
    blocking: Callable[Concatenate[Any, PyTree, P], Any], doc: str
) -> Callable[Concatenate[Any, PyTree, P], Request]:
    """The non-blocking form of JaxComm method `blocking`: the same parameters,
    checked as the same operation declares them, posted (jaxcomm._requests)
    instead of run. `doc` is its docstring."""
    operation = "i" + blocking.__name__
    # A variable-size exchange posts x's rows with the count operands its blocking
    # form would pass (its `_<name>_rows`).
    rows = _nonblocking.OPERATIONS[operation].kind.counts
    rows_of = f"_{blocking.__name__}_rows"
    signature = inspect.signature(blocking)
    # Non-blocking operations always work in buffers jaxcomm owns.
    signature = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name not in _BLOCKING_ONLY]
    )
    defaults = {
        name: p.default for name, p in signature.parameters.items() if p.default is not p.empty
    }

    @functools.cache
    def positional(count: int, keywords: tuple[str, ...]) -> tuple[str, ...]:
        # Signature.bind checks the call as Python would; it costs more than a
        # post, so it runs once per way of calling.
        try:
            signature.bind(*range(count), **dict.fromkeys(keywords))
        except TypeError as error:
            raise TypeError(f"{operation}: {error}") from None
        return tuple(signature.parameters)[:count]

    def post(*args: Any, **kwargs: Any) -> Request:
        params = defaults | dict(zip(positional(len(args), tuple(kwargs)), args, strict=True))
        params.update(kwargs)
        self, x = params.pop("self"), params.pop("x")
        if rows:
            return self._post_rows(operation, x, getattr(self, rows_of)(**params))
        return_status = params.pop("return_status", False)
        return _requests.post(operation, x, self._comm, params, return_status)

    post.__name__ = operation
    post.__qualname__ = f"JaxComm.{operation}"
    post.__module__ = blocking.__module__
    post.__doc__ = doc
    post.__signature__ = signature.replace(return_annotation="Request")  # type: ignore[attr-defined]
    return post


def _before_making(method: str, key: int | None) -> None:
    """Before `method` makes a communicator with a collective call of MPI's,
    outside any computation. Pending jaxcomm calls finish first: XLA may run
    them on its threads, and under MPI_THREAD_SERIALIZED they must finish
    before this thread calls MPI. And a rank out of step refuses it, as it
    refuses every jaxcomm call: the MPI collective inside (the new context id's
    allreduce, MPI_Comm_split's exchange) would pair with an operation that its
    peers wait in. `key`: the jaxcomm communicator it is made from, on which a
    stopped computation may owe such an operation (None: a plain mpi4py one)."""
    jax.effects_barrier()
    if (refused := _lockstep.refusal_on(method, [] if key is None else [key])) is not None:
        raise jax.errors.JaxRuntimeError(refused)


class JaxComm:
    """An MPI intracommunicator whose methods are JAX operations.

    ``JaxComm(comm)`` duplicates ``comm`` (default ``MPI.COMM_WORLD``; a collective
    call), so jaxcomm traffic never matches messages sent with mpi4py on ``comm``.
    Every method is ordered with every other jaxcomm call in program order, inside
    and across jitted functions and eager code, without tokens.

    ``check=True`` (default: the environment variable ``JAXCOMM_CHECK=1``) turns on
    checking mode: run-time verification of what ranks must agree on, such as the
    replicated cotangent that the gradient convention assumes. It checks the calls
    that every rank makes: an argument that one rank alone rejects (a bad ``op``,
    ``capacity`` or ``root``) raises there before its call, while the peers make
    theirs, and the ranks' calls no longer match (docs/troubleshooting.md, "An
    exception on one rank").
    """

    _Rows = _Rows  # for the topologies' variable-size methods

    def __init__(self, comm: MPI.Comm | JaxComm | None = None, *, check: bool | None = None):
        base = MPI.COMM_WORLD if comm is None else comm
        if isinstance(base, JaxComm):
            base = base.mpi
        if not isinstance(base, MPI.Comm) or base == MPI.COMM_NULL:
            raise TypeError(f"JaxComm: comm must be an mpi4py communicator, got {base!r}")
        if base.Is_inter():
            raise TypeError("JaxComm: comm must be an intracommunicator, got an intercommunicator")
        _before_making("JaxComm", comm._info.key if isinstance(comm, JaxComm) else None)
        self._mpi = base.Dup()
        # Errors come back as codes that the FFI handlers turn into exceptions,
        # instead of aborting the job.
        self._mpi.Set_errhandler(MPI.ERRORS_RETURN)
        if check is None:
            check = comm.check if isinstance(comm, JaxComm) else _settings.CHECK
        handle = _native.handle_of(self._mpi)
        self._info = CommInfo(
            _native.register_comm(handle),
            handle,
            self._mpi.Get_rank(),
            self._mpi.Get_size(),
            bool(check),
            # A duplicate spans the mesh line its original spans (along()).
            comm._info.span if isinstance(comm, JaxComm) else None,
        )
        self._along: dict[tuple[Any, Any], JaxComm] = {}  # along()'s, made once each

    @property
    def mpi(self) -> MPI.Intracomm:
        """The wrapped (duplicated) mpi4py communicator."""
        return self._mpi

    @property
    def rank(self) -> int:
        return self._info.rank

    @property
    def size(self) -> int:
        return self._info.size

    @property
    def check(self) -> bool:
        """Whether checking mode is on for this communicator."""
        return self._info.check

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._info == self._info

    def __hash__(self) -> int:
        return hash((type(self), self._info))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"

    def dup(self: Self) -> Self:
        """A new communicator of the same type and group (collective)."""
        _before_making("dup", self._comm.key)  # refused under its own name
        return type(self)(self)

    def split(self, color: int, key: int = 0) -> JaxComm | None:
        """Like MPI_Comm_split; None on ranks that pass color=MPI.UNDEFINED.

        The parts have no topology: split on a grid or graph gives communicators
        of the class without its methods (a subclass of JaxComm keeps its own)."""
        _before_making("split", self._comm.key)
        part = self._mpi.Split(color, key)
        if part == MPI.COMM_NULL:
            return None
        try:
            return getattr(type(self), "_plain", type(self))(part, check=self.check)
        finally:
            part.Free()

    def along(self: Self, mesh: jax.sharding.Mesh, axes: str | Sequence[str]) -> Self:
        """The processes of this communicator whose devices lie on this process's
        line of ``mesh`` along ``axes`` (a mesh axis name, or a tuple of them), as a
        communicator of this one's type.

        Its rank is this process's index along ``axes``, row-major in the order
        given, as ``lax.axis_index(axes)``; inside ``jax.shard_map`` over ``mesh``,
        ``comm.along(mesh, "x").allreduce(v)`` equals ``lax.psum(v, "x")``, and its
        results are typed as JAX's collectives over ``axes`` are. Every process of
        this communicator needs one device in ``mesh`` (``jax.distributed`` first).

        Collective over this communicator, like ``MPI_Comm_split``: every rank calls
        it with the same mesh and axes (a rank that finds its arguments wrong
        raises, and so does every other). Made once per (mesh, axes): later calls
        return the same communicator without communicating.
        """
        try:
            key = (mesh, (axes,) if isinstance(axes, str) else tuple(axes))
            made = self._along.get(key)
        except TypeError:  # not hashable: along_split says what is wrong
            key, made = None, None
        if made is not None and made.mpi != MPI.COMM_NULL:
            return made
        _before_making("along", self._comm.key)
        part, span = _sharded.along_split(self._mpi, mesh, axes)
        try:
            made = type(self)(part, check=self.check)
        finally:
            part.Free()
        made._info = made._info._replace(span=span)
        if key is not None:
            self._along[key] = made
        return made

    def create_cart(
        self, dims: Sequence[int], periods: Sequence[bool] | None = None, reorder: bool = False
    ) -> CartComm:
        """A Cartesian grid over this communicator's ranks (collective).

        dims: ranks per grid dimension (0 = let MPI choose); periods: whether each
        dimension wraps (default: none). Returns a CartComm that is also of this
        communicator's type, with coords, shift and halo_exchange.
        """
        _before_making("create_cart", self._comm.key)
        cart = topology.cartesian_mpi_comm(self._mpi, dims, periods, reorder)
        try:
            return _with_topology(type(self), CartComm)(cart, check=self.check)
        finally:
            cart.Free()

    def create_dist_graph(
        self, sources: Sequence[int], destinations: Sequence[int], *, reorder: bool = False
    ) -> GraphComm:
        """A distributed graph over this communicator's ranks (collective;
        ``MPI_Dist_graph_create_adjacent``).

        sources and destinations: the ranks this rank receives from and sends
        to, in the order its neighbour exchanges use; possibly empty, possibly
        this rank itself. Every edge must be in its source's destinations and
        its destination's sources (checked: every rank raises otherwise). Returns
        a GraphComm that is also of this communicator's type, with
        ``sources``, ``destinations`` and the neighbour collectives.

        ``reorder=True`` lets MPI give each process another rank in the graph,
        to place neighbours close. The graph stays the one given in this
        communicator's ranks, but a process then takes the part of rank
        ``g.rank``: its ``g.sources`` and ``g.destinations`` are the lists that
        rank passed, not necessarily its own arguments.
        """
        _before_making("create_dist_graph", self._comm.key)
        graph = topology.dist_graph_mpi_comm(self._mpi, sources, destinations, reorder)
        try:
            return _with_topology(type(self), GraphComm)(graph, check=self.check)
        finally:
            graph.Free()

    def free(self) -> None:
        """Free the MPI communicator (collective), once the operations posted on it
        have completed: a request not yet waited keeps its result for its wait.
        The JaxComm is unusable after."""
        jax.effects_barrier()
        if self._mpi != MPI.COMM_NULL:
            _requests.settle(self._info.key)
            _native.unregister_comm(self._info.key)
            self._mpi.Free()

    def __enter__(self: Self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    @property
    def _comm(self) -> CommInfo:
        if self._mpi == MPI.COMM_NULL:
            raise ValueError(f"{self!r} has been freed")
        return self._info

    def _apply(self, primitive: CommPrimitive, x: PyTree, **params: Any) -> tuple[PyTree, Any]:
        """`primitive` on x's leaves (jaxcomm._dispatch): the results in x's structure,
        and the other results of the last message (a receive's status)."""
        return _dispatch.apply(primitive, x, self._comm, params)

    def allreduce(self, x: PyTree, op: MPI.Op | str = MPI.SUM, *, in_place: bool = False) -> PyTree:
        """Element-wise reduction over all ranks, on every rank. Same shapes as x.

        ``in_place=True`` reduces in x's buffer (``MPI_IN_PLACE``) where x is
        donated, so no second array is needed; XLA copies an x still used after
        the call first. The reductions below take it too.
        """
        return self._apply(_reductions.allreduce_p, x, op=op, in_place=in_place)[0]

    def reduce(
        self, x: PyTree, op: MPI.Op | str = MPI.SUM, root: int = 0, *, in_place: bool = False
    ) -> PyTree:
        """The reduction on root; other ranks get x back unchanged. Same shapes as x."""
        return self._apply(_reductions.reduce_p, x, op=op, root=root, in_place=in_place)[0]

    def scan(self, x: PyTree, op: MPI.Op | str = MPI.SUM, *, in_place: bool = False) -> PyTree:
        """Inclusive prefix reduction: rank r gets op(x_0, ..., x_r). Same shapes as x."""
        return self._apply(_reductions.scan_p, x, op=op, in_place=in_place)[0]

    def exscan(self, x: PyTree, op: MPI.Op | str = MPI.SUM, *, in_place: bool = False) -> PyTree:
        """Exclusive prefix reduction: rank r gets op(x_0, ..., x_{r-1}).

        Rank 0 gets the identity of op (0 for SUM, 1 for PROD, the dtype's lowest
        value for MAX, ...) where MPI would leave it undefined. Same shapes as x.
        """
        return self._apply(_reductions.exscan_p, x, op=op, in_place=in_place)[0]

    def reduce_scatter(self, x: PyTree, op: MPI.Op | str = MPI.SUM) -> PyTree:
        """x: ``(size, *s)`` on every rank; rank r gets row r of the reduction, shape s."""
        return self._apply(_reductions.reduce_scatter_p, x, op=op)[0]

    def bcast(self, x: PyTree, root: int = 0) -> PyTree:
        """Root's x on every rank. Non-root ranks pass an array of the same shape."""
        return self._apply(_collectives.bcast_p, x, root=root)[0]

    def gather(self, x: PyTree, root: int = 0) -> PyTree:
        """On root, ``(size, *x.shape)`` with rank i's x in row i; other ranks get x back."""
        return self._apply(_collectives.gather_p, x, root=root)[0]

    def allgather(self, x: PyTree) -> PyTree:
        """``(size, *x.shape)`` on every rank, with rank i's x in row i."""
        return self._apply(_collectives.allgather_p, x)[0]

    def scatter(self, x: PyTree, root: int = 0) -> PyTree:
        """Root passes ``(size, *s)``; every rank gets its row, shape s.

        Non-root ranks pass an array of shape s (its values are not read).
        """
        return self._apply(_collectives.scatter_p, x, root=root)[0]

    def alltoall(self, x: PyTree, *, in_place: bool = False) -> PyTree:
        """x: ``(size, *s)``. Row i of the result is rank i's row `rank`.

        ``in_place=True`` writes the result into x's buffer where x is donated (no
        second array of x's size) at the cost of MPI's slower in-place exchange,
        and of a copy where x is still used afterwards."""
        return self._apply(_collectives.alltoall_p, x, in_place=in_place)[0]

    def _variable_size(self, x: Any, rows: _Rows) -> tuple[jax.Array, jax.Array]:
        """A variable-size exchange of x's `rows` (jaxcomm._variable_size): all
        checked (_rows_operands), then run. An eager call that repeats an earlier
        one in all but the values of its counts skips the checks of its count
        operands' types (jaxcomm._eager.repeat_rows); C++ validates their values
        on every call (cpp/counts.h), and x's and the params' checks always run."""
        # Only the JVP rules agree on errors (_variable_size).
        params = {**rows.params, "agree": False}
        operation, comm = rows.primitive.operation, self._comm
        x = _checks.rows(operation, x)
        self._rows_params(operation, x, rows.counts, params)
        key, given = _eager.rows_key(rows.primitive, x, rows.counts.values(), comm, params)
        done = _eager.repeat_rows(key, x, given)
        if done is not None:  # an earlier call like this one passed the checks below
            return done
        operands = [x, *self._rows_counts(operation, rows.counts, rows.peers)]
        y, received = _dispatch.apply_to_arrays(rows.primitive, operands, comm, params, key)
        return y, received

    def _rows_operands(
        self,
        operation: str,
        x: Any,
        counts: dict[str, Any],
        params: dict[str, Any],
        peers: dict[str, tuple[int, str]] | None = None,
    ) -> list[Any]:
        """x and the count operands of a variable-size exchange, checked, and its
        `params` checked in place. `peers`: how many counts each operand holds and
        of whom (a neighbour exchange's: destinations, sources), if not one per
        rank ("count" is one integer)."""
        x = _checks.rows(operation, x)
        self._rows_params(operation, x, counts, params)
        return [x, *self._rows_counts(operation, counts, peers)]

    def _rows_params(
        self, operation: str, x: jax.Array, counts: dict[str, Any], params: dict[str, Any]
    ) -> None:
        """A variable-size exchange's `params`, and which count operands it passes
        where the caller left them to jaxcomm, checked in place."""
        comm = self._comm
        if "count" in counts and counts["count"] is None:  # default: all of x's rows
            counts["count"] = np.int32(x.shape[0])
        params["capacity"] = _checks.capacity(operation, "capacity", params["capacity"], 0)
        if "root" in params:
            params["root"] = _checks.ROOT(operation, "root", params["root"], comm.size)
        if counts.get("counts", 0) is None:  # scatterv's, passed by the root only
            if comm.rank == params["root"]:
                raise ValueError(
                    f"{operation}: the root (rank {params['root']}) must pass counts, not None"
                )
            counts["counts"] = _no_counts(comm.size)

    def _rows_counts(
        self, operation: str, counts: dict[str, Any], peers: dict[str, tuple[int, str]] | None
    ) -> list[Any]:
        """A variable-size exchange's count operands, their types checked
        (jaxcomm._checks.counts; C++ validates their values)."""
        # "count" is one integer; the others one per rank, or as `peers` says.
        default = {"count": (None, "")}
        size = self._comm.size
        return [
            _checks.counts(operation, name, value, *(peers or default).get(name, (size, "rank")))
            for name, value in counts.items()
        ]

    def alltoallv(
        self,
        x: jax.Array,
        send_counts: ArrayLike,
        *,
        capacity: int,
        recv_counts: ArrayLike | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Rows of x to every rank, how many to each given per call (traceable).

        x: ``(n, *s)``, its rows grouped by destination: the first
        ``send_counts[0]`` go to rank 0, the next ``send_counts[1]`` to rank 1, and
        so on (rows past their sum are not sent). send_counts: integers, ``(size,)``.

        Returns ``(y, recv_counts)``: y ``(capacity, *s)`` holds the rows received,
        grouped by source in rank order, then zeros; recv_counts, int32
        ``(size,)``, how many came from each rank. Without ``recv_counts`` one
        ``MPI_Alltoall`` exchanges the counts first; a given ``recv_counts`` is
        trusted (checking mode verifies it). More rows than ``capacity`` arriving
        is an error on that rank, which keeps none of them; the other ranks get
        their rows.
        """
        rows = self._alltoallv_rows(send_counts, capacity=capacity, recv_counts=recv_counts)
        return self._variable_size(x, rows)

    def _alltoallv_rows(self, send_counts, *, capacity, recv_counts=None) -> _Rows:
        send_and_recv, exchange = _alltoallv_counts(self.size, send_counts, recv_counts)
        return _Rows(
            _variable_size.alltoallv_p,
            send_and_recv,
            None,
            {"capacity": capacity, "exchange": exchange},
        )

    def _post_rows(self, operation: str, x: Any, rows: _Rows) -> Request:
        """Post the non-blocking form of a variable-size exchange on x's `rows`,
        checked as its blocking twin; an eager post that repeats an earlier one
        skips the same checks as it does (_variable_size)."""
        params = {**rows.params, "agree": False}
        x = _checks.rows(operation, x)
        self._rows_params(operation, x, rows.counts, params)
        start = _nonblocking.OPERATIONS[operation].start
        key, given = _eager.rows_key(start, x, rows.counts.values(), self._comm, params)
        done = _requests.repost_rows(operation, x, given, self._comm, params, key)
        if done is not None:  # an earlier post like this one passed the checks below
            return done
        operands = self._rows_counts(operation, rows.counts, rows.peers)
        return _requests.post_rows(operation, x, operands, self._comm, params, key)

    def allgatherv(
        self, x: jax.Array, *, capacity: int, count: ArrayLike | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Every rank's first ``count`` rows of x (default all), on every rank.

        x: ``(n, *s)``; count: an integer (traceable), at most n. Returns
        ``(y, counts)``: y ``(capacity, *s)`` holds the rows of rank 0, then rank
        1's, ..., then zeros; counts, int32 ``(size,)``, how many came from each
        rank (one ``MPI_Allgather`` learns them). More rows than ``capacity`` is
        an error on every rank.
        """
        return self._variable_size(x, self._allgatherv_rows(capacity=capacity, count=count))

    def _allgatherv_rows(self, *, capacity, count=None) -> _Rows:
        counts = {"count": count, "counts": _no_counts(self.size)}
        return _Rows(
            _variable_size.allgatherv_p, counts, None, {"capacity": capacity, "exchange": True}
        )

    def gatherv(
        self, x: jax.Array, root: int = 0, *, capacity: int, count: ArrayLike | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Every rank's first ``count`` rows of x (default all), on root.

        x: ``(n, *s)``; count: an integer (traceable), at most n. Returns
        ``(y, counts)``: on root, y ``(capacity, *s)`` holds the rows of rank 0,
        then rank 1's, ..., then zeros, and counts (int32 ``(size,)``) how many
        came from each rank; on the other ranks y is ``(0, *s)`` and counts holds
        only their own count. More rows than ``capacity`` is an error on root.
        """
        return self._variable_size(x, self._gatherv_rows(root, capacity=capacity, count=count))

    def _gatherv_rows(self, root=0, *, capacity, count=None) -> _Rows:
        counts = {"count": count, "counts": _no_counts(self.size)}
        params = {"root": root, "capacity": capacity, "exchange": True}
        return _Rows(_variable_size.gatherv_p, counts, None, params)

    def scatterv(
        self, x: jax.Array, counts: ArrayLike | None, root: int = 0, *, capacity: int
    ) -> tuple[jax.Array, jax.Array]:
        """Root's rows of x, ``counts[i]`` of them to rank i (traceable).

        On root, x ``(n, *s)`` holds the rows grouped by destination and counts
        is integers ``(size,)``; the other ranks pass an x with rows of shape s
        (its values are not read) and counts None. Returns ``(y, count)``: y
        ``(capacity, *s)`` holds this rank's rows, then zeros; count (int32) how
        many. More rows than ``capacity`` is an error on that rank.
        """
        return self._variable_size(x, self._scatterv_rows(counts, root, capacity=capacity))

    def _scatterv_rows(self, counts, root=0, *, capacity) -> _Rows:
        # counts None (off the root) is checked with the root (_rows_operands).
        params = {"root": root, "capacity": capacity, "exchange": True}
        return _Rows(
            _variable_size.scatterv_p, {"counts": counts, "count": np.int32(0)}, None, params
        )

    def send(self: Self, x: PyTree, dest: int, tag: int = 0) -> Self:
        """Send x to rank dest (blocking until MPI may reuse the buffer). Returns self."""
        self._apply(_p2p.send_p, x, dest=dest, tag=tag)
        return self

    def recv(
        self,
        x: PyTree,
        source: int = MPI.ANY_SOURCE,
        tag: int = MPI.ANY_TAG,
        *,
        return_status: bool = False,
    ) -> PyTree | tuple[PyTree, Status]:
        """Receive arrays shaped like x (a template: only its shapes and dtypes are
        used, so inside jit `jnp.empty_like(y)` costs nothing).

        From MPI.PROC_NULL the result is zeros. With return_status=True, returns
        (result, Status(source, tag)) of the (last) message received.
        """
        result, rest = self._apply(_p2p.recv_p, x, source=source, tag=tag)
        return _received(result, rest, source, tag) if return_status else result

    def sendrecv(
        self,
        sendbuf: PyTree,
        recvbuf: PyTree | None = None,
        source: int = MPI.ANY_SOURCE,
        dest: int = MPI.PROC_NULL,
        sendtag: int = 0,
        recvtag: int = MPI.ANY_TAG,
        *,
        return_status: bool = False,
    ) -> PyTree | tuple[PyTree, Status]:
        """Send sendbuf to dest and receive from source in one deadlock-free call.

        recvbuf is a shape/dtype template for the result (default: like sendbuf).
        From MPI.PROC_NULL the result is zeros.
        """
        shape, dtype = _checks.receive_templates(sendbuf, recvbuf)
        result, rest = self._apply(
            _p2p.sendrecv_p,
            sendbuf,
            shape=shape,
            dtype=dtype,
            source=source,
            dest=dest,
            sendtag=sendtag,
            recvtag=recvtag,
        )
        return _received(result, rest, source, recvtag) if return_status else result

    iallreduce = _nonblocking_method(
        allreduce, "Post allreduce; ``wait`` returns its result. Like MPI_Iallreduce."
    )
    ireduce_scatter = _nonblocking_method(
        reduce_scatter,
        "Post reduce_scatter (x: ``(size, *s)``); ``wait`` returns row `rank`, shape s.",
    )
    ibcast = _nonblocking_method(bcast, "Post bcast; ``wait`` returns root's x.")
    iallgather = _nonblocking_method(
        allgather, "Post allgather; ``wait`` returns ``(size, *x.shape)``."
    )
    ialltoall = _nonblocking_method(
        alltoall, "Post alltoall (x: ``(size, *s)``); ``wait`` returns ``(size, *s)``."
    )
    ialltoallv = _nonblocking_method(
        alltoallv,
        "Post alltoallv (MPI_Ialltoallv); ``wait`` returns ``(y, recv_counts)``. The counts "
        "are known at the post: without ``recv_counts`` the post first exchanges them (one "
        "blocking ``MPI_Alltoall`` of ``size`` integers), so give them to overlap the whole "
        "exchange. An overflow of ``capacity`` or invalid ``send_counts`` are the wait's "
        "error, on that rank.",
    )
    iallgatherv = _nonblocking_method(
        allgatherv,
        "Post allgatherv (MPI_Iallgatherv); ``wait`` returns ``(y, counts)``. The post "
        "exchanges the counts (one blocking ``MPI_Allgather``) and returns; more rows than "
        "any rank's ``capacity``, or an invalid ``count`` on any rank, is every rank's error "
        "at the wait.",
    )
    igatherv = _nonblocking_method(
        gatherv,
        "Post gatherv (MPI_Igatherv); ``wait`` returns ``(y, counts)``. The post exchanges "
        "the counts (one blocking ``MPI_Gather``); an overflow of root's ``capacity`` is root's "
        "error at the wait, an invalid ``count`` that rank's.",
    )
    iscatterv = _nonblocking_method(
        scatterv,
        "Post scatterv (MPI_Iscatterv); ``wait`` returns ``(y, count)``. The post exchanges "
        "the counts (one blocking ``MPI_Scatter``); an overflow of ``capacity`` is that rank's "
        "error at the wait, root's invalid ``counts`` root's.",
    )
    isend = _nonblocking_method(
        send,
        "Post a send of x to dest; ``wait`` returns None. MPI sends a copy of x that "
        "jaxcomm keeps until the message has left.",
    )

    irecv = _nonblocking_method(
        recv,
        "Post a receive into arrays shaped like x (a template); ``wait`` returns the "
        "result, or (result, Status) with return_status=True.",
    )

    def wait(self, request: Request) -> Any:
        """Complete a non-blocking operation and return its result (None for isend).

        Wait exactly once for every request, in the function (and loop iteration
        or branch) that posted it.
        """
        if not isinstance(request, Request):
            raise TypeError(f"wait: expected a jaxcomm Request, got {type(request).__name__}")
        result, status = request.wait()
        if status is None:
            return result
        leaves = jax.tree.leaves(result)
        return result, _status(status, leaves[0] if leaves else None)

    def test(self, request: Request) -> bool | jax.Array:
        """Whether a non-blocking operation has completed, without waiting: a bool, or
        inside a traced function a traced bool scalar. Its result is read only by
        ``wait``, which must still follow; calling ``test`` while computing also lets
        MPI progress the message.
        """
        if not isinstance(request, Request):
            raise TypeError(f"test: expected a jaxcomm Request, got {type(request).__name__}")
        return request.test()

    def waitall(self, requests: Sequence[Request]) -> list[Any]:
        """wait for each request in order; returns their results."""
        return [self.wait(request) for request in requests]

    def call_kernel(
        self,
        target: str,
        *args: jax.Array,
        results: Sequence[jax.ShapeDtypeStruct],
        aliases: dict[int, int] | None = None,
        vmap_method: str = "sequential",
        **attrs: Any,
    ) -> list[jax.Array]:
        """Call the FFI kernel `target` (see jaxcomm.register_kernel) on this communicator.

        The kernel runs in program order with every other jaxcomm operation. It gets
        the attributes ``comm`` (int64 MPI_Comm handle; decode it with
        ``jaxcomm::comm_from_handle``), ``rank`` and ``size`` (int32), then `attrs`.
        `results` declares the output shapes and dtypes; `aliases` maps an operand
        index to the result index that may reuse its buffer. Under vmap,
        "sequential" calls the kernel once per batch element; "expand_dims" calls it
        once with a leading batch axis on every operand and result. Returns a list.
        For gradients, wrap the method in jax.custom_jvp or jax.custom_vjp.
        """
        return _kernels.call_kernel(
            target,
            *(jnp.asarray(a) for a in args),
            comm=self._comm,
            results=results,
            aliases=aliases,
            vmap_method=vmap_method,
            attrs=attrs,
        )

    def pvary(self, x: PyTree) -> PyTree:
        """Mark a replicated value that flows into rank-dependent code. Same shapes as x.

        The identity on values. Under the gradient convention, the cotangent of a
        replicated value (an allreduce, bcast or allgather result) is assumed to be
        identical on every rank; where each rank uses the value differently, pass it
        through pvary so that its cotangent is summed over ranks instead. Inside
        ``shard_map`` JAX's types decide (docs/sharded.md): a value invariant along
        the axes of a communicator made by ``along`` is marked varying; elsewhere
        results are one value per device already, and x is left as it is (made
        varying along the communicator's axes with ``jax.lax.pcast`` where JAX
        holds it as one value).
        """
        leaves, tree = jax.tree.flatten(x)
        leaves = _checks.arrays("pvary", leaves)
        comm = self._comm
        return jax.tree.unflatten(tree, [_replicated.mark(leaf, comm=comm) for leaf in leaves])

    def barrier(self: Self) -> Self:
        """Block until every rank has reached the barrier. Returns self."""
        _dispatch.run_alone(_collectives.barrier_p, self._comm)
        return self


class CartComm(topology.Cartesian, JaxComm):
    """A JaxComm over an MPI Cartesian topology (made by JaxComm.create_cart)."""

    _plain: type[JaxComm] = JaxComm  # the class without the topology's methods


class GraphComm(topology.Graph, JaxComm):
    """A JaxComm over an MPI distributed graph (made by JaxComm.create_dist_graph)."""

    _plain: type[JaxComm] = JaxComm


_PREFIX = {CartComm: "Cart", GraphComm: "Graph"}


@functools.cache
def _with_topology(cls: type[JaxComm], form: type[T]) -> type[T]:
    """`cls` with the methods of `form` (CartComm or GraphComm): a subclass keeps
    its own methods on a grid or graph; another topology's are not kept."""
    if issubclass(cls, form):
        return cls
    plain = getattr(cls, "_plain", cls)
    if plain is JaxComm:
        return form
    name = f"{_PREFIX[form]}{plain.__name__}"
    return type(name, (form, plain), {"__module__": plain.__module__, "_plain": plain})
