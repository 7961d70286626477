"""jaxcomm in a sharded multi-process program: every rank a process of
jax.distributed with one CPU device (JAX's own collectives through gloo), a
global Mesh over them, and jaxcomm's operations inside shard_map acting on each
process's block: against JAX's collectives and NumPy, under jit, jaxcomm.jit,
grad and jvp with JAX's varying-axes typing on, and vmap; in program order with
eager and other jitted calls; comm.along on the meshes that this rank count
makes; and what is refused. Runs only with JAXCOMM_TEST_DISTRIBUTED=1 (see
tests/test_mpiexec.py).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import progress
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax_processes import DISTRIBUTED, distributed_only
from mpi4py import MPI

import jaxcomm
from jaxcomm import JaxComm

pytestmark = distributed_only

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.size, WORLD.rank


def devices() -> list:
    """Every process's device, in rank order (each rank is the JAX process of its
    number: tests/mpi/conftest.py)."""
    return sorted(jax.devices(), key=lambda d: d.process_index)


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(devices()).reshape(shape), names)


# Every process's device along one axis (the ranks of the suite's other runs are
# separate JAX programs, each with a device of its own: no such mesh).
MESH = mesh_of((N,), ("x",)) if DISTRIBUTED else None


@pytest.fixture(scope="module")
def line(comm):
    """comm along the one axis of MESH: every rank, ranked as on the mesh."""
    return comm.along(MESH, "x")


def block(rank: int, rows: int = 0) -> np.ndarray:
    """Rank `rank`'s block: (3,), or (rows, 3) with rows distinct across ranks."""
    base = np.arange(3.0) + 10.0 * rank + 1.0
    return base if not rows else base + 100.0 * np.arange(rows)[:, None]


BLOCKS = P("x")  # each rank's block along the mesh's one axis


def sharded(f, *blocks, out_specs=BLOCKS, in_specs=None, jit=jax.jit):
    """f inside shard_map over MESH on global arrays made of every rank's block;
    this rank's block of each result, as NumPy."""
    in_specs = tuple(P("x") for _ in blocks) if in_specs is None else in_specs
    arrays = [
        jax.make_array_from_process_local_data(NamedSharding(MESH, spec), np.asarray(b))
        for b, spec in zip(blocks, in_specs, strict=True)
    ]
    run = jit(jax.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs))
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), run(*arrays))


def ring(comm) -> dict:
    """sendrecv's arguments of a shift by one along the ring of comm's ranks."""
    return {"source": (comm.rank - 1) % comm.size, "dest": (comm.rank + 1) % comm.size}


SHIFT = [(i, (i + 1) % N) for i in range(N)]


# -- values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("along", "jit"),
    [(True, jax.jit), (False, jaxcomm.jit)],
    ids=["along-jax.jit", "comm-jaxcomm.jit"],
)
def test_operations_equal_jax_collectives_and_numpy(comm, line, along, jit):
    c = line if along else comm

    def body(x, rows):
        return (
            (c.allreduce(x), lax.psum(x, "x")),
            (c.allreduce(x, op=MPI.MAX), lax.pmax(x, "x")),
            (c.allgather(x), lax.all_gather(x, "x")),
            (c.sendrecv(x, **ring(c)), lax.ppermute(x, "x", SHIFT)),
            (c.alltoall(rows), lax.all_to_all(rows, "x", 0, 0)),
            (c.reduce_scatter(rows), lax.psum_scatter(rows, "x", scatter_dimension=0)),
        )

    results = sharded(body, block(RANK), block(RANK, rows=N), jit=jit)
    everyone = np.stack([block(r) for r in range(N)])
    rows = np.stack([block(r, rows=N) for r in range(N)])  # [sender, row]
    expected = [
        everyone.sum(0),
        everyone.max(0),
        everyone,
        everyone[(RANK - 1) % N],
        rows[:, RANK],
        rows.sum(0)[RANK],
    ]
    for (ours, theirs), want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(ours, want)
        np.testing.assert_array_equal(theirs, want)


def test_every_family_acts_on_the_block(comm, line):
    """Blocking, non-blocking, variable-size, point-to-point, grid and graph
    exchanges on the per-device block, against NumPy."""
    grid = comm.create_cart([N], periods=[True])
    graph = comm.create_dist_graph([(RANK - 1) % N], [(RANK + 1) % N])
    counts = np.array([(RANK + d) % 2 + 1 for d in range(N)])  # rows to each rank

    def body(x, rows):
        gathered = line.gather(x, root=N - 1)
        request = line.iallreduce(x)
        moved, arrived = line.alltoallv(rows[: counts.sum()], counts, capacity=2 * N)
        return {
            "bcast": line.bcast(x, root=N - 1),
            "gather": gathered if line.rank == N - 1 else jnp.broadcast_to(gathered, (N, 3)),
            "scatter": line.scatter(rows[:N] if line.rank == 0 else x, root=0),
            "reduce": line.reduce(x, root=0),
            "scan": line.scan(x),
            "exscan": line.exscan(x),
            "alltoallv": moved,
            "arrived": arrived,
            "allgatherv": line.allgatherv(x[: 1 + line.rank % 2], capacity=2 * N)[0],
            "grid": grid.neighbor_allgather(x),
            "graph": graph.neighbor_alltoall(x[None]),
            "sendrecv": line.sendrecv(x, jnp.zeros_like(x), **ring(line)),
            "tested": jnp.asarray(line.test(request)).reshape(1),  # done or not yet
            "iallreduce": line.wait(request),
        }

    got = sharded(body, block(RANK), block(RANK, rows=2 * N))
    everyone = np.stack([block(r) for r in range(N)])
    sent = [[(r + d) % 2 + 1 for d in range(N)] for r in range(N)]
    offsets = np.cumsum([[0, *s[:-1]] for s in sent], axis=1)
    mine = np.concatenate(
        [
            block(r, rows=2 * N)[offsets[r][RANK] : offsets[r][RANK] + sent[r][RANK]]
            for r in range(N)
        ]
    )
    gathered_v = np.concatenate([block(r)[: 1 + r % 2] for r in range(N)])
    expected = {
        "bcast": everyone[N - 1],
        "gather": everyone if RANK == N - 1 else np.broadcast_to(block(RANK), (N, 3)),
        "scatter": block(0, rows=N)[RANK],
        "reduce": everyone.sum(0) if RANK == 0 else block(RANK),
        "scan": everyone[: RANK + 1].sum(0),
        "exscan": everyone[:RANK].sum(0),
        "alltoallv": np.concatenate([mine, np.zeros((2 * N - len(mine), 3))]),
        "arrived": np.array([sent[r][RANK] for r in range(N)]),
        "allgatherv": np.concatenate([gathered_v, np.zeros(2 * N - len(gathered_v))]),
        "grid": np.stack([everyone[(RANK - 1) % N], everyone[(RANK + 1) % N]]),
        "graph": everyone[(RANK - 1) % N][None],
        "sendrecv": everyone[(RANK - 1) % N],
        "iallreduce": everyone.sum(0),
    }
    assert got.pop("tested").dtype == np.bool_
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    grid.free()
    graph.free()


# -- derivatives and vmap ------------------------------------------------------------------

# Each pairs a jaxcomm operation on the communicator along "x" with JAX's own.
PAIRS = {
    "allreduce": (lambda c, x: c.allreduce(x), lambda x: lax.psum(x, "x")),
    "allgather": (lambda c, x: c.allgather(x), lambda x: lax.all_gather(x, "x")),
    "sendrecv": (lambda c, x: c.sendrecv(x, **ring(c)), lambda x: lax.ppermute(x, "x", SHIFT)),
    "bcast": (lambda c, x: c.bcast(x, root=N - 1), lambda x: lax.all_gather(x, "x")[N - 1]),
}


def _loss(ops, w, x):
    """A scalar of every device's block through each of `ops` (weighted apart, so
    that no error cancels another), and of an invariant weight w."""
    total = 0.0
    for k, op in enumerate(ops, start=1):
        y = op(jnp.sin(x) * w)
        total = total + jnp.sum(y**2 + y * jnp.cos(k * w)) / k
    return total.reshape(1)


def _total(ops):
    """The sum over devices of _loss, as a function of (w, x)."""

    def total(w, x):
        body = jax.shard_map(
            partial(_loss, ops), mesh=MESH, in_specs=(P(), P("x")), out_specs=P("x")
        )
        return body(w, x).sum()

    return total


def _local(a) -> np.ndarray:
    return np.asarray(a.addressable_data(0))


def test_grad_and_jvp_equal_those_of_jax_collectives(line):
    """check_vma on (JAX's default): gradients with respect to the sharded x and
    an invariant w equal those through JAX's own collectives, and so do jvps."""
    ours = _total([partial(op, line) for op, _ in PAIRS.values()])
    theirs = _total([op for _, op in PAIRS.values()])
    x = block(RANK) / 10.0
    w, dw = jnp.float64(0.7), jnp.float64(0.3)
    xs, dx = (
        jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), a)
        for a in (x, np.cos(x))
    )
    got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(w, xs)
    want = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1)))(w, xs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(_local(a), _local(b), rtol=1e-12)
    jvp = lambda f: jax.jit(lambda w, x, dw, dx: jax.jvp(f, (w, x), (dw, dx)))  # noqa: E731
    got, want = jvp(ours)(w, xs, dw, dx), jvp(theirs)(w, xs, dw, dx)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(_local(a), _local(b), rtol=1e-12)


def _ring_step(c, ours: bool, line):
    """One step of a ring shift by one along the mesh: non-blocking through
    `line`, a receive (from ANY_TAG) into a constant template posted first and
    waited last; or lax.ppermute."""
    if not ours:
        return lax.ppermute(2.0 * c, "x", SHIFT)
    received = line.irecv(jnp.zeros_like(c), source=(line.rank - 1) % line.size)
    sent = line.isend(2.0 * c, dest=(line.rank + 1) % line.size)
    line.wait(sent)
    return line.wait(received)


NONBLOCKING_CONTROL = {
    "scan": lambda step, x: lax.scan(lambda c, _: (step(c), None), x, None, length=2)[0],
    "fori_loop": lambda step, x: lax.fori_loop(0, 2, lambda _, c: step(c), x),
    "checkpoint": lambda step, x: jax.checkpoint(step)(x),
}


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("control", NONBLOCKING_CONTROL)
def test_nonblocking_derivatives_in_control_flow_equal_jax(line, control, check_vma):
    """Posts and waits inside a loop or a checkpoint, in shard_map: the gradient
    and the forward derivative of ppermute's, which is the blocking twin's."""

    def total(ours):
        def per_device(x):
            y = NONBLOCKING_CONTROL[control](partial(_ring_step, ours=ours, line=line), x)
            return (jnp.sin(y) * (lax.axis_index("x") + 1.0)).sum().reshape(1)

        run = jax.shard_map(
            per_device, mesh=MESH, in_specs=P("x"), out_specs=P("x"), check_vma=check_vma
        )
        return lambda x: run(x).sum()

    x, dx = (
        jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), a)
        for a in (block(RANK) / 10.0, np.cos(block(RANK)))
    )
    grad = [jax.jit(jax.value_and_grad(total(ours)))(x) for ours in (True, False)]
    jvp = [jax.jit(partial(jax.jvp, total(ours)))((x,), (dx,)) for ours in (True, False)]
    for got, want in (grad, jvp):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(_local(a), _local(b), rtol=1e-12)


@pytest.mark.parametrize("posted", [False, True], ids=["allgather", "iallgather"])
def test_grad_of_one_row_of_an_invariant_allgather_equals_jax(line, posted):
    """Only row 0 of along()'s allgather (invariant under check_vma) reaches the
    loss: the transpose takes each process's row by lax.axis_index, not by a
    constant rank, so every process compiles the same program and JAX's psum
    in it pairs (with a constant row, one process's compiler dropped the psum
    and the other waited in it forever)."""
    weights = jnp.array([1.0, 2.0, 3.0])

    def total(ours):
        def per_device(b):
            if ours:
                rows = line.wait(line.iallgather(b**2)) if posted else line.allgather(b**2)
            else:
                rows = lax.all_gather(b**2, "x")
            return jnp.sum(rows[0] * (lax.axis_index("x") + 1.0) * weights, keepdims=True)

        run = jax.shard_map(per_device, mesh=MESH, in_specs=P("x"), out_specs=P("x"))
        return lambda x: run(x).sum()

    x = jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), block(RANK))
    got, want = (jax.jit(jax.grad(total(ours)))(x) for ours in (True, False))
    np.testing.assert_allclose(_local(got), _local(want), rtol=1e-12)


@pytest.fixture(scope="module")
def communicators(comm, line):
    """A communicator of every process of each kind: made by along(), COMM_WORLD
    itself, and a split that ranks the processes in reverse (see mesh_index)."""
    reverse = comm.split(0, key=-comm.rank)
    yield {"along": line, "COMM_WORLD": comm, "split": reverse}
    reverse.free()


KINDS = ["COMM_WORLD", "split", "along"]


def mesh_index(kind: str, rank: int) -> int:
    """lax.axis_index("x") of the process that is rank `rank` of communicators[kind]."""
    return N - 1 - rank if kind == "split" else rank


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no check_vma"])
@pytest.mark.parametrize("kind", KINDS)
def test_grad_through_every_communicator_equals_psum(communicators, kind, check_vma):
    """One gradient rule inside shard_map, for every communicator and both
    check_vma settings: the derivative is JAX's. A result that every rank holds
    alike is one value only where JAX's types make it invariant (along() with
    check_vma); elsewhere it is one per device, so the cotangents of rank-
    dependent code are summed. d/dx_r of sum_d (d + 1) * sum(allreduce(x)^2)
    is 2 * allreduce(x) * sum_d (d + 1) on every rank."""
    c = communicators[kind]

    def total(reduce):
        def per_device(x):
            weight = lax.axis_index("x") + 1.0  # rank-dependent: the cotangents differ
            return (jnp.sum(reduce(x) ** 2) * weight).reshape(1)

        body = jax.shard_map(
            per_device, mesh=MESH, in_specs=P("x"), out_specs=P("x"), check_vma=check_vma
        )
        return lambda x: body(x).sum()

    xs = jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), block(RANK))
    ours = _local(jax.jit(jax.grad(total(c.allreduce)))(xs))
    theirs = _local(jax.jit(jax.grad(total(lambda x: lax.psum(x, "x"))))(xs))
    everyone = np.stack([block(r) for r in range(N)]).sum(0)
    np.testing.assert_allclose(ours, 2 * everyone * N * (N + 1) / 2, rtol=1e-12)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_of_an_invariant_weight_alone_equals_jax(communicators, kind):
    """Only an invariant w is differentiated; x, which varies along the mesh,
    reaches jaxcomm's operations as a constant. jaxcomm gives it a zero
    tangent (so that every rank makes the same calls), typed as x: varying,
    as JAX's types want its cotangent to be. The gradient is JAX's and NumPy's,
    for MAX (whose rule counts ties) and PROD (products of the others)."""
    c = communicators[kind]
    pairs = [
        (partial(c.allreduce, op=MPI.MAX), lambda x: lax.pmax(x, "x"), np.max),
        (partial(c.allreduce, op=MPI.PROD), lambda x: jnp.prod(lax.all_gather(x, "x"), 0), np.prod),
    ]

    def total(reduce):
        def per_device(w, x):
            return jnp.sum(reduce(x) * jnp.sin(w) + w * x).reshape(1)

        body = jax.shard_map(per_device, mesh=MESH, in_specs=(P(), P("x")), out_specs=P("x"))
        return lambda w, x: body(w, x).sum()

    x = jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), block(RANK) / 10)
    everyone = np.stack([block(r) / 10 for r in range(N)])
    for ours, theirs, numpy in pairs:
        got, want = (jax.jit(jax.grad(total(f)))(0.7, x) for f in (ours, theirs))
        expected = N * numpy(everyone, axis=0).sum() * np.cos(0.7) + everyone.sum()
        np.testing.assert_allclose(got, want, rtol=1e-12)
        np.testing.assert_allclose(got, expected, rtol=1e-12)


# JAX's collectives and jaxcomm's calls, as a compiled program lists them.
COMMUNICATION = re.compile(
    r"= (.*?) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(|"
    r'custom_call_target="(jaxcomm_\w+)"'
)


def _communication(text: str) -> list[tuple[str, ...]]:
    """The communication of a compiled (scheduled) program, in its order: what
    must be alike on every process for JAX's collectives to pair up."""
    return [m.groups() for m in COMMUNICATION.finditer(text)]


# What may differ between the processes' compiled programs: the attributes of
# jaxcomm's calls (a communicator's key) and source locations; the values of
# constants (a rank, through same_program), and so which of them XLA merged;
# the names, which follow from those; and so where XLA places an instruction
# that does not communicate (seen with JAX 0.12), but not the order of those
# that do.
ALLOWED_TO_DIFFER = [
    (re.compile(r", (?:metadata|backend_config)=(?:\{[^}]*\}|\"[^\"]*\")"), ""),
    (re.compile(r"\bconstant\([^)]*\)"), "constant()"),
    (re.compile(r"%[\w.-]+|\b[A-Za-z_][\w-]*(?:\.\d+|\.clone)+\b"), "%"),
]


def _instructions(text: str) -> Counter:
    """A compiled program's instructions, as every process must compile them alike."""
    for pattern, replacement in ALLOWED_TO_DIFFER:
        text = pattern.sub(replacement, text)
    return Counter(line for line in text.splitlines() if "constant()" not in line)


def same_program_everywhere(jitted, *args) -> str:
    """The program that `jitted` compiles for `args` (as text), once every
    process has seen that all compiled the same one: the same instructions,
    and the same order of communication (JAX's collectives and jaxcomm's
    calls). Else every process fails, showing how rank 0's and another's
    differ."""
    text = jitted.lower(*args).compile().as_text()
    programs = WORLD.allgather((_communication(text), _instructions(text)))
    order, instructions = programs[0]
    for rank, (theirs, their_instructions) in enumerate(programs):
        assert theirs == order, f"communication: rank 0 {order}, rank {rank} {theirs}"
        assert their_instructions == instructions, (
            f"only rank 0 has {list((instructions - their_instructions).elements())}; "
            f"only rank {rank} has {list((their_instructions - instructions).elements())}"
        )
    return text


@pytest.fixture(scope="module")
def watched():
    """jaxcomm's watchdog, unless JAXCOMM_TIMEOUT set it already: a call whose
    peers wait elsewhere (in JAX's collectives) aborts the job, naming the call,
    before the test's own limit (progress.py) reports it without the name."""
    from jaxcomm import _native, _settings

    armed = _settings.TIMEOUT == 0
    if armed:
        _native.cpu.configure(debug=_settings.DEBUG, timeout=progress.TEST_LIMIT / 2)
    yield
    if armed:
        _native.cpu.configure(debug=_settings.DEBUG, timeout=0.0)


# Operations with a root, through a communicator, and their twins written with
# JAX's collectives, given the root's mesh index: bcast as the psum of x masked
# to the root, reduce as the psum on the root and x elsewhere.
ROOTED = {
    "bcast": (
        lambda c, x, root: c.bcast(x, root=root),
        lambda x, at: lax.psum(jnp.where(lax.axis_index("x") == at, x, 0.0), "x"),
    ),
    "reduce": (
        lambda c, x, root: c.reduce(x, root=root),
        lambda x, at: jnp.where(lax.axis_index("x") == at, lax.psum(x, "x"), x),
    ),
}


def _sum_of_blocks(operation, check_vma: bool):
    """x -> the sum over devices of sum(sin(y) * y), y = operation(block): JAX
    sums a loss over the devices, so its gradient holds a psum."""

    def per_device(x):
        y = operation(x)
        return jnp.sum(jnp.sin(y) * y, keepdims=True)

    body = jax.shard_map(
        per_device, mesh=MESH, in_specs=P("x"), out_specs=P("x"), check_vma=check_vma
    )
    return lambda x: body(x).sum()


def _derivatives(total) -> tuple:
    """The gradient, the jvp and the value of `total`, each jitted alone (the
    gradient alone, as the hang needed)."""
    return jax.jit(jax.grad(total)), jax.jit(partial(jax.jvp, total)), jax.jit(total)


@cache
def _rooted_twin(operation: str, at: int, check_vma: bool) -> tuple:
    """_derivatives of the ROOTED twin's sum of blocks."""
    return _derivatives(_sum_of_blocks(partial(ROOTED[operation][1], at=at), check_vma))


def _rooted_expected(operation: str, at: int) -> tuple[float, np.ndarray]:
    """The sum over devices of sum(sin(y) * y), and its gradient on this rank,
    from NumPy."""
    xs = np.stack([block(r) / 10 for r in range(N)])
    slope = lambda v: np.cos(v) * v + np.sin(v)  # noqa: E731 (of sin(v) * v)
    if operation == "bcast":  # every device's y is x at `at`
        ys = np.broadcast_to(xs[at], xs.shape)
        grad = N * slope(xs[at]) if at == RANK else np.zeros(3)
    else:  # reduce: the sum at `at`, x elsewhere
        ys = xs.copy()
        ys[at] = xs.sum(0)
        grad = slope(ys[at]) + (slope(xs[RANK]) if at != RANK else 0.0)
    return float(np.sum(np.sin(ys) * ys)), grad


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("operation", ROOTED)
def test_rooted_operation_on_an_argument_differentiates_as_jax(
    communicators, watched, operation, kind, check_vma
):
    """bcast's root, and reduce's other ranks, have x as their result. Here x is
    an argument of the jitted function, and JAX's gradient of the sum over
    devices holds a psum beside jaxcomm's call: every process must compile the
    same program for the two to run in the same order everywhere. (Where x's
    buffer was the result on those ranks only, XLA copied x first there and
    ran its psum before the call there, after it elsewhere: the root waited in
    gloo's psum, the others in MPI_Bcast, for ever.) The value, gradient and
    jvp equal the twin's with JAX's collectives, and NumPy's."""
    c, root = communicators[kind], 0
    at = mesh_index(kind, root)
    total = _sum_of_blocks(partial(ROOTED[operation][0], c, root=root), check_vma)
    x, dx = (
        jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), a)
        for a in (block(RANK) / 10, np.cos(block(RANK)))
    )
    ours = _derivatives(total)
    same_program_everywhere(ours[0], x)  # the gradient
    same_program_everywhere(ours[1], (x,), (dx,))  # the jvp
    run = lambda grad, jvp, value: [grad(x), jvp((x,), (dx,)), value(x)]  # noqa: E731
    got, want = run(*ours), run(*_rooted_twin(operation, at, check_vma))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(_local(a), _local(b), rtol=1e-12)
    loss, gradient = _rooted_expected(operation, at)
    np.testing.assert_allclose(_local(got[0]), gradient, rtol=1e-12)
    np.testing.assert_allclose(_local(got[2]), loss, rtol=1e-12)


def test_vmap_equals_jax_collectives(line):
    batch = np.stack([block(RANK), -2.0 * block(RANK)], axis=1)  # batch axis 1

    def body(x):
        return {
            name: (jax.vmap(partial(ours, line), 1)(x), jax.vmap(theirs, 1)(x))
            for name, (ours, theirs) in PAIRS.items()
        }

    for name, (got, want) in sharded(body, batch).items():
        np.testing.assert_array_equal(got, want, err_msg=name)


# Operations whose results have the same shape on every rank, each to a (3,) block.
SAME_SHAPES = {
    "allreduce_max": lambda c, x: c.allreduce(x, op=MPI.MAX),
    "allreduce_prod": lambda c, x: c.allreduce(x, op=MPI.PROD),
    "bcast": lambda c, x: c.bcast(x, root=N - 1),
    "reduce": lambda c, x: c.reduce(x, root=0),
    "reduce_max": lambda c, x: c.reduce(x, op=MPI.MAX, root=0),
    "scan_min": lambda c, x: c.scan(x, op=MPI.MIN),
    "exscan_prod": lambda c, x: c.exscan(x, op=MPI.PROD),
    "allgather": lambda c, x: c.allgather(x).sum(0),
    "sendrecv": lambda c, x: c.sendrecv(x, **ring(c)),
    "alltoall": lambda c, x: c.alltoall(jnp.outer(jnp.arange(1.0, N + 1), x)).sum(0),
    "reduce_scatter": lambda c, x: c.reduce_scatter(jnp.outer(jnp.arange(1.0, N + 1), x)),
    "reduce_scatter_max": lambda c, x: c.reduce_scatter(
        jnp.outer(jnp.arange(1.0, N + 1), x), op=MPI.MAX
    ),
    "alltoallv": lambda c, x: c.alltoallv(x, np.full(N, 3 // N), capacity=3)[0],
    "allgatherv": lambda c, x: c.allgatherv(x, capacity=3 * N)[0][:3],
    "iallreduce": lambda c, x: c.wait(c.iallreduce(x)),
    "ibcast": lambda c, x: c.wait(c.ibcast(x, root=0)),
}


@pytest.mark.skipif(N == 1, reason="one process: one program")
@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("kind", ["split", "along"])  # split: as any but along()
def test_every_process_compiles_the_same_program(communicators, kind, check_vma):
    """JAX pairs its own collectives across processes by their place in the
    program: next to jaxcomm's calls (a psum of the program, the psums JAX adds
    to a gradient) they pair up only where every process compiles the same
    program. jaxcomm's rules and lowerings keep every process's program alike
    (but for the values of constants) for the operations whose results have
    the same shape on every rank, each on an argument of the function (where
    bcast's root and reduce's other ranks have x as their result), under grad
    (the forward rules, and their transposes); and the derivative with respect
    to an invariant w equals finite differences."""
    c = communicators[kind]

    def per_device(w, x):
        total = w * jnp.sum(lax.psum(x, "x"))
        for k, op in enumerate(SAME_SHAPES.values(), start=1):
            y = op(c, x)
            total = total + jnp.sum(y**2 + y * jnp.cos(k * w)) / k
        return total.reshape(1)

    body = jax.shard_map(
        per_device, mesh=MESH, in_specs=(P(), P("x")), out_specs=P("x"), check_vma=check_vma
    )
    total = lambda w, x: body(w, x).sum()  # noqa: E731
    x = jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), block(RANK) / 10)
    grad = jax.jit(jax.grad(total, argnums=(0, 1)))
    communication = _communication(same_program_everywhere(grad, 0.7, x))
    ours = {call for _, _, call in communication if call}
    theirs = [kind for _, kind, _ in communication if kind]
    assert len(ours) >= 12 and theirs, communication  # both, side by side
    value = partial(jax.jit(total), x=x)
    step = 1e-6
    difference = (value(0.7 + step) - value(0.7 - step)) / (2 * step)
    np.testing.assert_allclose(grad(0.7, x)[0], difference, rtol=1e-6)


@pytest.mark.skipif(N == 1, reason="one process: one program")
def test_a_graph_padded_to_one_degree_is_one_program_beside_psum(comm):
    """docs/sharded.md: a star's neighbour exchanges are shaped by each rank's
    degree, so the processes' programs differ (a psum beside their gradient hung);
    padded with edges to itself, every rank's blocks have one shape: one program,
    whose gradient counts each block once per edge."""
    neighbours = list(range(1, N)) if RANK == 0 else [0] + [RANK] * (N - 2)
    with comm.create_dist_graph(neighbours, neighbours) as star:

        def per_device(x):
            received = star.neighbor_alltoall(jnp.ones((N - 1, 1)) * x)
            return received.sum(0) + lax.psum(x.sum(), "x")

        body = jax.shard_map(per_device, mesh=MESH, in_specs=P("x"), out_specs=P("x"))
        x = jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), block(RANK))
        grad = jax.jit(jax.grad(lambda x: body(x).sum()))
        same_program_everywhere(grad, x)
        # Each element of x reaches N - 1 destinations, and every process's 3
        # elements of the psum.
        got = np.asarray(grad(x).addressable_data(0))
        np.testing.assert_array_equal(got, np.full(3, 4 * N - 1))


# -- order -----------------------------------------------------------------------------------


def test_program_order_with_eager_and_jitted_calls(comm):
    """Messages from one rank to the next on one communicator keep their order
    (MPI's, per pair and tag) only if jaxcomm sends them in program order:
    eagerly, in shard_map under jax.jit and under jaxcomm.jit, with JAX's psum
    beside them. The receives are posted first, so that one rank sending to
    itself never waits."""
    dest, source = (RANK + 1) % N, (RANK - 1) % N
    x = block(RANK)
    received = [comm.irecv(jnp.zeros(3), source=source) for _ in range(4)]
    comm.send(jnp.asarray(x), dest=dest)

    def body(step, x):
        comm.send(x + step, dest=dest)
        return lax.psum(x, "x")

    summed = [sharded(partial(body, 1), x), sharded(partial(body, 2), x, jit=jaxcomm.jit)]
    comm.send(jnp.asarray(x + 3), dest=dest)
    for step, request in enumerate(received):
        np.testing.assert_array_equal(np.asarray(comm.wait(request)), block(source) + step)
    everyone = np.stack([block(r) for r in range(N)]).sum(0)
    for total in summed:
        np.testing.assert_array_equal(total, everyone)


# -- along -----------------------------------------------------------------------------------

# The meshes of this rank count: N x 1 (2x1 and 3x1 among them), and 2x2 on 4.
MESHES = [((2, 2), ("x", "y"))] if N == 4 else [((N,), ("x",)), ((N, 1), ("x", "y"))]
AXES = [
    (shape, names, axes)
    for shape, names in MESHES
    for axes in [*names, *([names, names[::-1]] if len(names) > 1 else [])]
]


class MyComm(JaxComm):
    """A subclass: along() keeps it."""

    def twice(self, x):
        return 2 * self.allreduce(x)


@pytest.mark.parametrize(("shape", "names", "axes"), AXES, ids=str)
def test_along_ranks_as_axis_index_and_reduces_as_psum(shape, names, axes):
    mesh = mesh_of(shape, names)
    comm = MyComm()
    made = comm.along(mesh, axes)
    assert type(made) is MyComm
    assert comm.along(mesh, axes) is made  # made once
    assert comm.along(mesh, list(axes) if isinstance(axes, tuple) else axes) is made
    assert made.size == int(np.prod([mesh.shape[a] for a in np.atleast_1d(axes)]))
    spec = P(names)

    def body(x, rank):
        return {
            "index": lax.axis_index(axes).reshape(1),
            # Who is on this line, in the order of lax.axis_index(axes): JAX's answer.
            "line": lax.all_gather(rank, axes).reshape(-1),
            "ranks": made.allgather(rank).reshape(-1),
            "ours": made.allreduce(x),
            "theirs": lax.psum(x, axes),
            "twice": made.twice(x),
        }

    arrays = [
        jax.make_array_from_process_local_data(NamedSharding(mesh, spec), a)
        for a in (block(RANK), np.array([RANK]))
    ]
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    got = {k: np.asarray(a.addressable_data(0)) for k, a in run(*arrays).items()}
    assert made.rank == int(got["index"][0])
    line = got["line"]
    assert line[made.rank] == RANK
    np.testing.assert_array_equal(got["ranks"], line)
    total = np.stack([block(r) for r in line]).sum(0)
    np.testing.assert_array_equal(got["ours"], total)
    np.testing.assert_array_equal(got["theirs"], total)
    np.testing.assert_array_equal(got["twice"], 2 * total)
    comm.free()


def test_along_on_some_ranks_only_returns_the_communicator_made_before(comm, line):
    """Once made, along() does not communicate: ranks may call it alone."""
    if RANK % 2 == 0:
        assert comm.along(MESH, "x") is line
        assert comm.along(MESH, ("x",)) is line
    WORLD.Barrier()


# -- refused -------------------------------------------------------------------------------


def test_arrays_of_several_processes_are_refused_outside_shard_map(comm):
    x = jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), block(RANK))
    if N == 1:  # one process's array: no refusal
        np.testing.assert_array_equal(np.asarray(comm.allreduce(x)), block(0))
        return
    for call in (comm.allreduce, jax.jit(comm.allreduce), jaxcomm.jit(comm.allreduce)):
        with pytest.raises(ValueError, match=r"allreduce .*outside shard_map.*jax.shard_map"):
            call(x)


def test_a_communicator_along_another_mesh_is_refused(line):
    x = jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), block(RANK))
    other_names = Mesh(MESH.devices, ("y",))
    body = jax.shard_map(line.allreduce, mesh=other_names, in_specs=P("y"), out_specs=P("y"))
    with pytest.raises(ValueError, match=r"allreduce: the communicator was made along \('x',\)"):
        jax.jit(body)(x)
    if N > 1:  # the same names and shape, other devices
        other = Mesh(MESH.devices[::-1], ("x",))
        body = jax.shard_map(line.allreduce, mesh=other, in_specs=P("x"), out_specs=P("x"))
        x = jax.make_array_from_process_local_data(NamedSharding(other, P("x")), block(RANK))
        with pytest.raises(ValueError, match=r"allreduce: .*another mesh"):
            jax.jit(body)(x)


def test_without_check_vma_values_are_the_same(line):
    got = sharded(lambda x: line.allreduce(x), block(RANK), jit=jax.jit)
    body = jax.shard_map(
        lambda x: (line.allreduce(x), lax.psum(x, "x")),
        mesh=MESH,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
    x = jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), block(RANK))
    ours, theirs = (np.asarray(a.addressable_data(0)) for a in jax.jit(body)(x))
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(got, theirs)


# -- misuse, generated -----------------------------------------------------------------------
#
# As tests/mpi/test_misuse.py: hypothesis derandomised, so that every rank draws
# the same examples; each rank knows what every rank passes and so what it must
# see; outcomes are gathered, so that every rank fails together.

MISUSE_EXAMPLES = int(os.environ.get("JAXCOMM_MISUSE_EXAMPLES", "5"))
MISUSE = settings(
    derandomize=True,
    database=None,
    max_examples=MISUSE_EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
# What a rank passes as mesh: a name, and whether it is wrong in itself (the
# argument it names) on this rank.
MESH_ARGUMENTS = ["mesh", "reversed", "missing last", "abstract", "device list", "rank 0 reversed"]
AXES_ARGUMENTS = ["x", ("x",), ["x"], "z", ("x", "x"), (), 3, "rank 0 z"]


def _mesh_argument(kind: str, rank: int):
    if kind == "reversed" or (kind == "rank 0 reversed" and rank == 0):
        return Mesh(MESH.devices[::-1], ("x",))
    if kind == "missing last":
        return Mesh(MESH.devices[:-1] if N > 1 else MESH.devices, ("x",))
    if kind == "abstract":
        return MESH.abstract_mesh
    if kind == "device list":
        return list(MESH.devices)
    return MESH


def _axes_argument(kind, rank: int):
    return ("z" if rank == 0 else "x") if kind == "rank 0 z" else kind


def _expected(mesh_kind: str, axes_kind) -> tuple[str, str] | int:
    """What this rank must see: (exception name, what its message names), or
    this rank's rank in the communicator made."""

    def own(rank):  # what is wrong in a rank's own arguments, if anything
        if mesh_kind in ("abstract", "device list"):
            return ("TypeError", "mesh")
        axes = _axes_argument(axes_kind, rank)
        if axes == 3:
            return ("TypeError", "axes")
        if axes in ("z", ("x", "x"), ()):
            return ("ValueError", "axes")
        if mesh_kind == "missing last" and N > 1 and rank == N - 1:
            return ("ValueError", "mesh")
        return None

    if own(RANK) is not None:
        return own(RANK)
    for rank in range(N):
        if own(rank) is not None:
            return (own(rank)[0], f"rank {rank} of the communicator refused its arguments")
    if N > 1 and (mesh_kind == "rank 0 reversed"):
        return ("ValueError", "different meshes or axes")
    return N - 1 - RANK if mesh_kind == "reversed" else RANK


@given(mesh_kind=st.sampled_from(MESH_ARGUMENTS), axes_kind=st.sampled_from(AXES_ARGUMENTS))
@MISUSE
def test_along_misuse_raises_on_every_rank_or_gives_the_line(mesh_kind, axes_kind):
    comm = JaxComm()  # a new one: along() on it communicates (nothing made before)
    expected = _expected(mesh_kind, axes_kind)
    try:
        made = comm.along(_mesh_argument(mesh_kind, RANK), _axes_argument(axes_kind, RANK))
    except (TypeError, ValueError) as error:
        outcome = (type(error).__name__, str(error))
    else:
        # The ranks along the mesh, in its order, and their sum: eagerly.
        ranks = np.asarray(made.allgather(jnp.int32(RANK)))
        outcome = (made.rank, ranks.tolist(), int(made.allreduce(jnp.int32(RANK))))
        made.free()
    if isinstance(expected, int):
        order = list(range(N))[:: -1 if mesh_kind == "reversed" else 1]
        ok = outcome == (expected, order, N * (N - 1) // 2)
    else:
        ok = outcome[0] == expected[0] and expected[1] in outcome[1]
    comm.free()
    seen = WORLD.allgather((ok, expected, outcome))
    assert all(ok for ok, _, _ in seen), (mesh_kind, axes_kind, seen)
