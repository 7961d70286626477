"""JAX's own collectives as the oracle of jaxcomm's values and derivatives.

Generated: programs of one to three operations (allreduce with SUM, MAX or MIN,
allgather, bcast, sendrecv shifts, alltoall, reduce_scatter, and non-blocking
forms whose waits come after other operations: iallreduce, iallgather,
ibcast, ialltoall, ireduce_scatter and an irecv/isend ring), on a communicator
made by along(), JaxComm(COMM_WORLD), split(), a Cartesian grid or a graph.
Each operation's result goes through rank-dependent code (where a replicated
value's cotangent stops being one value), and is sometimes marked with
comm.pvary. The program is wrapped in a stack of vmap, lax.scan,
lax.fori_loop, lax.cond, jax.checkpoint, a nested jax.jit, and grad, jvp, vjp
or linearize of it, sometimes followed by a replicated operation whose result
is the output as it is (one value where JAX's types make it invariant:
out_specs without the communicator's axes); then run inside shard_map over
every process (check_vma on or off) or outside it on each process's block;
then differentiated as a whole (grad, jvp, vjp, linearize, or not at all) and
run eagerly, under jax.jit or under jaxcomm.jit.

The oracle is the same program written with JAX's collectives (psum,
all_gather, all_to_all, ppermute, psum_scatter) inside shard_map, each typed as
jaxcomm types its operation: a result that is one value in JAX's types
(invariant) where jaxcomm's is, varying (pcast) where jaxcomm's is. A
non-blocking operation's twin is its blocking twin's, at the post. MAX and MIN,
which JAX does not differentiate (pmax), are the maximum of an all_gather,
whose derivative JAX has (ties split evenly, as jaxcomm's). Outside shard_map
every replicated result is marked with pvary (jaxcomm's convention then gives
the exact derivative of the sum of every rank's function) and the oracle is
the program inside shard_map with varying types. What is not drawn, and why:
`excluded`.

Hypothesis is seeded alike on every rank and does not shrink, so every rank
draws the same examples and compiles the same programs (JAX pairs its
collectives by their place in the program); the seed changes with the rank
count, JAX and the MPI library, so that CI's runs draw different examples.
Each example's outcome is gathered from every rank, so that all fail
together, saying which rank saw what. A few examples that reach every
transpose run first, always. JAXCOMM_ORACLE_EXAMPLES sets the generated
examples per property, JAXCOMM_ORACLE_SEED the seed (a failure names it).
Runs only with JAXCOMM_TEST_DISTRIBUTED=1 (tests/test_mpiexec.py).
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable
from functools import partial

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
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
EXAMPLES = int(os.environ.get("JAXCOMM_ORACLE_EXAMPLES", "3"))
SEED = int(
    os.environ.get("JAXCOMM_ORACLE_SEED")
    or zlib.crc32(f"{N} {jax.__version__} {MPI.Get_library_version()}".encode())
)
SETTINGS = settings(
    derandomize=False,
    database=None,
    max_examples=max(EXAMPLES, 1),
    deadline=None,
    # No shrinking: one failing example, everywhere. 0 examples: the explicit ones.
    phases=[Phase.explicit, Phase.generate][: 1 + (EXAMPLES > 0)],
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)

# Every process's device, in rank order (each rank is the JAX process of its
# number: tests/mpi/conftest.py): one axis, or a 2x2 grid on 4.
NAMES = ("x", "y") if N == 4 else ("x",)
SHAPE = (2, 2) if N == 4 else (N,)
EVERY = P(NAMES)  # each process's block of a global array
ROWS = 2  # rows per rank of a block: a block has size * ROWS elements


def _mesh() -> Mesh:
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    return Mesh(np.array(devices).reshape(SHAPE), NAMES)


MESH = _mesh() if DISTRIBUTED else None


# -- communicators and how JAX's collectives see them ---------------------------------------


@dataclasses.dataclass(frozen=True)
class Group:
    """A communicator of the examples, as JAX's collectives reach its processes:
    the mesh axes they vary along, and each rank's index along them."""

    name: str
    axes: tuple[str, ...]  # the mesh axes its processes lie along, in lax.axis_index's order
    along: bool  # made by along(): its results are typed as JAX's collectives'
    members: tuple[int, ...]  # world ranks of the processes of this rank's communicator, by rank


def _coordinates(world_rank: int) -> dict[str, int]:
    return dict(zip(NAMES, np.unravel_index(world_rank, SHAPE), strict=True))


def _index(world_rank: int, axes: tuple[str, ...]) -> int:
    """A process's index along `axes`, row-major in the order given."""
    where = _coordinates(world_rank)
    sizes = dict(zip(NAMES, SHAPE, strict=True))
    return int(np.ravel_multi_index([where[a] for a in axes], [sizes[a] for a in axes]))


def _line(axes: tuple[str, ...]) -> list[int]:
    """The world ranks on this rank's line along `axes`, by index along them."""
    here = _coordinates(RANK)
    line = [
        r for r in range(N) if all(_coordinates(r)[a] == here[a] for a in NAMES if a not in axes)
    ]
    return sorted(line, key=lambda r: _index(r, axes))


def _groups() -> dict[str, tuple[Group, Callable[[JaxComm], JaxComm]]]:
    """Each communicator of this rank count: how to make it, and its Group."""
    along = [(a,) for a in NAMES] + ([NAMES, NAMES[::-1]] if len(NAMES) > 1 else [])
    made: dict[str, tuple[Group, Callable[[JaxComm], JaxComm]]] = {}
    for axes in along:
        name = "along " + ",".join(axes)
        made[name] = (
            Group(name, axes, True, tuple(_line(axes))),
            partial(lambda comm, axes: comm.along(MESH, axes), axes=axes),
        )
    made["world"] = (Group("world", NAMES, False, tuple(range(N))), lambda comm: comm)
    # A grid and a ring graph over every process, in its order.
    made["grid"] = (
        Group("grid", NAMES, False, tuple(range(N))),
        lambda comm: comm.create_cart(list(SHAPE), periods=[True] * len(SHAPE)),
    )
    made["graph"] = (
        Group("graph", NAMES, False, tuple(range(N))),
        lambda comm: comm.create_dist_graph([(comm.rank - 1) % N], [(comm.rank + 1) % N]),
    )
    # split: the processes along the last axis, ranked in reverse (a grouping and an
    # order that JAX's types do not know).
    last = (NAMES[-1],)
    color = _index(RANK, NAMES[:-1]) if len(NAMES) > 1 else 0
    members = tuple(reversed(_line(last)))
    made["split"] = (
        Group("split", last, False, members),
        partial(lambda comm, color: comm.split(color, key=-comm.rank), color=color),
    )
    return made


GROUPS = _groups() if DISTRIBUTED else {}


@pytest.fixture(scope="module")
def comms():
    """Each communicator, made in the same order on every rank."""
    world = JaxComm(WORLD)
    made = {name: make(world) for name, (_, make) in GROUPS.items()}
    for name, comm in made.items():
        group = GROUPS[name][0]
        assert comm.size == len(group.members), name
        assert group.members[comm.rank] == RANK, name
    yield made
    for name, comm in made.items():
        if not name.startswith("along") and name != "world":
            comm.free()
    world.free()


# -- programs ----------------------------------------------------------------------------------

REPLICATED = {"allreduce", "allgather", "bcast"}  # a result every rank holds alike
POSTED = ["allreduce", "allgather", "bcast", "alltoall", "reduce_scatter", "ring"]


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of a program, the same on every rank."""

    name: str  # allreduce, allgather, bcast, sendrecv, alltoall, reduce_scatter; ring posted
    posted: bool = False  # its non-blocking form: a post, and later its wait
    reduction: str = "SUM"  # allreduce's
    root: int = 0  # bcast's, modulo the size
    shift: int = 1  # sendrecv's and ring's, modulo the size
    tagged: bool = False  # sendrecv: a recvtag given (else MPI.ANY_TAG, the default)
    gap: int = 0  # posted: operations between the post and the wait
    send_first: bool = False  # ring: the isend's wait first
    template: str = "zeros"  # ring: what irecv receives into, zeros or x

    def __repr__(self) -> str:  # what differs from the defaults: failures stay readable
        values = [(f.name, getattr(self, f.name), f.default) for f in dataclasses.fields(self)]
        changed = [f"{name}={value!r}" for name, value, default in values[1:] if value != default]
        return f"Op({', '.join([repr(self.name), *changed])})"


class Ours:
    """A program's operations through jaxcomm."""

    def __init__(self, comm: JaxComm):
        self.comm, self.n = comm, comm.size

    def run(self, op: Op, x):
        c = self.comm
        if op.name == "allreduce":
            return c.allreduce(x, op=getattr(MPI, op.reduction))
        if op.name == "allgather":
            return c.allgather(x)
        if op.name == "bcast":
            return c.bcast(x, root=op.root % self.n)
        if op.name == "sendrecv":
            tags = {"sendtag": 7, "recvtag": 7} if op.tagged else {}
            return c.sendrecv(x, **self._shift(op), **tags)
        if op.name == "alltoall":
            return c.alltoall(x)
        return c.reduce_scatter(x)

    def post(self, op: Op, x):
        c = self.comm
        if op.name == "ring":  # the ring: a receive into a constant template
            shift = self._shift(op)
            template = jnp.zeros_like(x) if op.template == "zeros" else x
            received = c.irecv(template, source=shift["source"])
            sent = c.isend(2 * x, dest=shift["dest"])
            return received, sent
        if op.name == "allreduce":
            return c.iallreduce(x, op=getattr(MPI, op.reduction))
        if op.name == "bcast":
            return c.ibcast(x, root=op.root % self.n)
        return getattr(c, "i" + op.name)(x)

    def wait(self, op: Op, request):
        if op.name != "ring":
            return self.comm.wait(request)
        received, sent = request
        if op.send_first:
            self.comm.wait(sent)
            return self.comm.wait(received)
        out = self.comm.wait(received)
        self.comm.wait(sent)
        return out

    def mark(self, y):
        return self.comm.pvary(y)

    def _shift(self, op: Op) -> dict:
        k, c = op.shift % self.n, self.comm
        return {"source": (c.rank - k) % self.n, "dest": (c.rank + k) % self.n}


class Theirs:
    """A program's operations through JAX's collectives inside shard_map, typed as
    jaxcomm types them: `invariant`, jaxcomm's result that every rank holds alike
    is one value (invariant along the group's axes), else it varies."""

    def __init__(self, group: Group, invariant: bool, check_vma: bool):
        self.axes, self.invariant, self.check_vma = group.axes, invariant, check_vma
        self.n = len(group.members)
        # order[j]: the comm rank of the process at index j along the axes, as
        # lax.axis_index counts; at[c]: the index of comm rank c.
        line = sorted(group.members, key=lambda r: _index(r, group.axes))
        self.order = np.array([group.members.index(r) for r in line])
        self.at = np.argsort(self.order)
        # ppermute is given the axes in the mesh's order, where every JAX
        # release numbers devices alike (docs/sharded.md; JAX 0.12 refuses
        # them in another order): numbered[c], comm rank c's number there.
        self.in_mesh_order = tuple(a for a in NAMES if a in group.axes)
        self.numbered = [_index(r, self.in_mesh_order) for r in group.members]

    def run(self, op: Op, x):
        a = self.axes
        if op.name == "allreduce":
            if op.reduction == "SUM":
                return self._typed(lax.psum(x, a))
            rows = self._gathered(x)
            return rows.max(0) if op.reduction == "MAX" else rows.min(0)
        if op.name == "allgather":
            return self._gathered(x)
        if op.name == "bcast":
            return self._gathered(x)[op.root % self.n]
        if op.name in ("sendrecv", "ring"):
            k = op.shift % self.n
            pairs = [(self.numbered[c], self.numbered[(c + k) % self.n]) for c in range(self.n)]
            moved = lax.ppermute(self._varying(x), self.in_mesh_order, pairs)
            return moved if op.name == "sendrecv" else 2 * moved
        if op.name == "alltoall":
            return lax.all_to_all(self._varying(x)[self.order], a, 0, 0)[self.at]
        return lax.psum_scatter(self._varying(x)[self.order], a, scatter_dimension=0)

    def post(self, op: Op, x):
        return self.run(op, x)  # the blocking twin, at the post

    def wait(self, op: Op, request):
        return request

    def mark(self, y):
        return self._varying(y)

    def _gathered(self, x):
        """Every rank's x by comm rank, typed as jaxcomm's allgather: one value
        (a psum of each rank's x in its row) or varying (all_gather)."""
        if not self.invariant:
            return lax.all_gather(self._varying(x), self.axes)[self.at]
        mine = jnp.asarray(self.order)[lax.axis_index(self.axes)]
        rows = (jnp.arange(self.n) == mine).reshape(-1, *[1] * x.ndim) * x[None]
        return lax.psum(self._varying(rows), self.axes)

    def _typed(self, y):
        return y if self.invariant else self._varying(y)

    def _varying(self, x):
        if not self.check_vma:
            return x
        missing = tuple(a for a in self.axes if a not in _varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x


def _varying_axes(x) -> frozenset[str]:
    aval = jax.typeof(x)  # JAX 0.10 calls its varying axes aval.mat.varying
    return aval.vma if hasattr(aval, "vma") else aval.mat.varying


class Local:
    """Rank-dependent values of a program: inside shard_map from lax.axis_index
    (every process compiles the same program), else this rank's constants."""

    def __init__(self, sharded: bool):
        self.sharded = sharded

    def rank(self):
        if self.sharded:
            return lax.axis_index(NAMES).astype(jnp.float64)
        return jnp.float64(RANK)


def _prepare(op: Op, n: int, x):
    """x (n * ROWS,) as the operation takes it."""
    if op.name == "alltoall":
        return x.reshape(n, ROWS)
    if op.name == "reduce_scatter":
        return jnp.outer(jnp.arange(1.0, n + 1), x)
    return x


def _finish(op: Op, n: int, y):
    """The operation's result as a block (n * ROWS,): rows in different roles."""
    if op.name == "allgather":
        return (y * jnp.arange(1.0, n + 1)[:, None]).sum(0) / n
    return y.reshape(-1)


def _mix(y, k: int, rank):
    """Rank-dependent code: where a replicated value's cotangent stops being one."""
    return jnp.sin((1.0 + 0.25 * rank) * y + 0.1 * (k + 1))


def _fail(x):
    raise RuntimeError("the test's failure between two jaxcomm calls of one computation")


def failure(x):
    """x, after a host callback that raises on every rank: the computation stops
    there, before the operations that depend on x run (a constant for AD)."""
    like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out = jax.pure_callback(_fail, like, lax.stop_gradient(x), vmap_method="sequential")
    return x + 0 * out


def program(
    ops: tuple[Op, ...], backend, local: Local, mark: bool, n: int, x, fail: int | None = None
):
    """The example's program: a block (n * ROWS,) to a block; with `fail`, it
    fails after that operation."""
    pending: list[list] = []  # [operations left before the wait, op, request, position]

    def arrive(y, op: Op, k: int, x):
        y = _finish(op, n, y)
        if mark and op.name in REPLICATED:
            y = backend.mark(y)
        return _mix(y, k, local.rank()) if x is None else _mix(x + y, k, local.rank())

    for k, op in enumerate(ops):
        if op.posted:
            pending.append([op.gap, op, backend.post(op, _prepare(op, n, x)), k])
            x = jnp.cos(x)  # computed while the message travels
        else:
            x = arrive(backend.run(op, _prepare(op, n, x)), op, k, None)
        for entry in pending:
            entry[0] -= 1
        for entry in [e for e in pending if e[0] < 0]:
            pending.remove(entry)
            _, posted, request, at = entry
            x = arrive(backend.wait(posted, request), posted, at, x)
        if k == fail:
            x = failure(x)
    for _, posted, request, at in pending:
        x = arrive(backend.wait(posted, request), posted, at, x)
    return x


# -- stacks of transformations ---------------------------------------------------------------

BODY = ["vmap", "scan", "fori_loop", "cond", "checkpoint", "jit", "grad", "jvp", "vjp", "linearize"]
REVERSE = {"grad", "vjp"}
DERIVATIVES = {"grad", "jvp", "vjp", "linearize"}
OUTER = ["value", "grad", "jvp", "vjp", "linearize"]
MODES = ["eager", "jax.jit", "jaxcomm.jit"]
PLACES = ["check_vma", "no check_vma", "outside"]  # shard_map with or without types, or none


def _weights(local: Local, size: int):
    return 1.0 + 0.1 * jnp.arange(size) + 0.2 * local.rank()


def wrap(name: str, f: Callable, local: Local, branch: bool) -> Callable:
    """f, a block to a block, under one transformation: again a block to a block."""
    if name == "vmap":
        return lambda x: (jax.vmap(f)(jnp.stack([x, -0.5 * x])) * jnp.array([[1.0], [0.3]])).sum(0)
    if name == "scan":
        return lambda x: lax.scan(lambda c, _: (f(c), None), x, length=2)[0]
    if name == "fori_loop":
        return lambda x: lax.fori_loop(0, 2, lambda i, c: f(c), x)
    if name == "cond":  # a branch every rank takes alike, chosen at run time
        return lambda x: lax.cond(jnp.sum(x) * 0 + branch > 0, f, lambda x: f(0.5 * x) + 1.0, x)
    if name == "checkpoint":
        return jax.checkpoint(f)
    if name == "jit":
        return jax.jit(f)
    if name == "grad":
        return jax.grad(lambda x: jnp.sum(f(x) * _weights(local, x.size)))
    if name == "jvp":
        return lambda x: sum(jax.jvp(f, (x,), (jnp.cos(x),)))
    if name == "vjp":
        return lambda x: jax.vjp(f, x)[1](jnp.cos(x) * _weights(local, x.size))[0]
    return lambda x: jax.linearize(f, x)[1](jnp.cos(x))


@dataclasses.dataclass(frozen=True)
class Example:
    group: str
    ops: tuple[Op, ...]
    body: tuple[str, ...]  # transformations of the program, innermost first
    place: str  # one of PLACES
    outer: str  # one of OUTER
    mode: str  # one of MODES
    mark: bool  # comm.pvary after each replicated result (always outside shard_map)
    branch: bool  # which branch a cond takes
    # A replicated operation after the transformed program, whose result is the
    # output as it is: where it is one value in JAX's types (invariant), so is the
    # output (out_specs without the communicator's axes), and so its cotangent.
    end: Op | None = None
    fail: int | None = None  # every rank fails after this operation (outside shard_map)


def _out_spec(example: Example) -> P:
    """The output's spec: without the communicator's axes where it is invariant
    along them (the end of a communicator made by along(), with check_vma)."""
    group = GROUPS[example.group][0]
    if example.end is None or not group.along or example.place != "check_vma":
        return EVERY
    return P(tuple(a for a in NAMES if a not in group.axes) or None)


def _block_function(example: Example, backend, local: Local, n: int) -> Callable:
    mark = example.mark or example.place == "outside"
    f = partial(program, example.ops, backend, local, mark, n, fail=example.fail)
    for name in example.body:
        f = wrap(name, f, local, example.branch)
    if example.end is None:
        return f
    end = example.end

    def ended(x):  # marked only outside shard_map, where the convention needs it
        y = _finish(end, n, backend.run(end, _prepare(end, n, f(x))))
        return backend.mark(y) if example.place == "outside" else y

    return ended


def _blocks(n: int, out: P) -> dict[str, np.ndarray]:
    """This rank's block of each input of the outer transformation: x and a
    tangent t like the program's input, a cotangent c like its output (alike on
    the processes that `out` does not tell apart)."""
    i = np.arange(n * ROWS, dtype=np.float64)
    axes = [a for a in NAMES if a in jax.tree.leaves(tuple(out))]
    apart = _index(RANK, tuple(axes)) if axes else 0
    return {
        "x": np.sin(1.3 * i + 0.7 * RANK) + 0.1 * RANK,
        "t": np.cos(0.9 * i - 0.4 * RANK),
        "c": np.cos(0.37 * i + 0.5 * apart) + 0.2,
    }


def _outer(name: str, g: Callable) -> Callable:
    """(x, t, c) -> what `name` of g gives, for x, a tangent t and a cotangent c."""
    if name == "value":
        return lambda x, t, c: g(x)
    if name == "grad":
        return lambda x, t, c: jax.grad(lambda x: jnp.sum(g(x) * c))(x)
    if name == "jvp":
        return lambda x, t, c: jax.jvp(g, (x,), (t,))
    if name == "vjp":
        return lambda x, t, c: jax.vjp(g, x)[1](c)[0]
    return lambda x, t, c: jax.linearize(g, x)[1](t)


def _run(function: Callable, mode: str, blocks: dict[str, np.ndarray], out: P | None) -> list:
    """function(x, t, c) run in `mode`, on global arrays of every rank's blocks
    (c's as `out`), or with out None on this rank's; this rank's block of each
    result, as NumPy."""
    if out is not None:
        specs = {"x": EVERY, "t": EVERY, "c": out}
        args = [
            jax.make_array_from_process_local_data(NamedSharding(MESH, specs[k]), b)
            for k, b in blocks.items()
        ]
    else:
        args = [jnp.asarray(b) for b in blocks.values()]
    run = {"eager": function, "jax.jit": jax.jit(function), "jaxcomm.jit": jaxcomm.jit(function)}
    results = jax.tree.leaves(run[mode](*args))
    local = (lambda a: a) if out is None else (lambda a: a.addressable_data(0))
    return [np.asarray(local(a)) for a in results]


def ours(example: Example, comm: JaxComm) -> list:
    """This rank's blocks of what the example gives through jaxcomm."""
    sharded = example.place != "outside"
    f = _block_function(example, Ours(comm), Local(sharded), comm.size)
    out = _out_spec(example)
    if sharded:
        check_vma = example.place == "check_vma"
        f = jax.shard_map(f, mesh=MESH, in_specs=EVERY, out_specs=out, check_vma=check_vma)
    blocks = _blocks(comm.size, out)
    return _run(_outer(example.outer, f), example.mode, blocks, out if sharded else None)


def theirs(example: Example) -> list:
    """This rank's blocks of what the example gives through JAX's collectives."""
    group = GROUPS[example.group][0]
    check_vma = example.place != "no check_vma"
    invariant = group.along and example.place == "check_vma"
    n = len(group.members)
    f = _block_function(example, Theirs(group, invariant, check_vma), Local(True), n)
    out = _out_spec(example)
    f = jax.shard_map(f, mesh=MESH, in_specs=EVERY, out_specs=out, check_vma=check_vma)
    return _run(_outer(example.outer, f), "jax.jit", _blocks(n, out), out)


def check(example: Example, comm: JaxComm) -> None:
    """Ours against theirs on every rank; every rank fails together."""
    want = [a.tolist() for a in theirs(example)]
    try:
        got, error = ours(example, comm), None
    except Exception as e:  # reported with every rank's outcome below
        got, error = None, f"{type(e).__name__}: {e}"[:2000]
    if error is None:
        ok = len(got) == len(want) and all(
            a.shape == np.shape(b) and np.allclose(a, b, rtol=1e-9, atol=1e-11)
            for a, b in zip(got, want, strict=True)
        )
        seen = None if ok else {"jaxcomm": [a.tolist() for a in got], "JAX": want}
    else:
        ok, seen = False, error
    outcomes = WORLD.allgather((ok, seen))
    failed = [(rank, seen) for rank, (ok, seen) in enumerate(outcomes) if not ok]
    assert not failed, (f"JAXCOMM_ORACLE_SEED={SEED}", example, failed)


# -- what is drawn -------------------------------------------------------------------------

ROOTS = st.integers(0, 3)
SHIFTS = st.integers(1, 3)


def _blocking_ops():
    return st.one_of(
        st.builds(Op, st.just("allreduce"), reduction=st.sampled_from(["SUM", "MAX", "MIN"])),
        st.builds(Op, st.sampled_from(["allgather", "alltoall", "reduce_scatter"])),
        st.builds(Op, st.just("bcast"), root=ROOTS),
        st.builds(Op, st.just("sendrecv"), shift=SHIFTS, tagged=st.booleans()),
    )


def _end_ops():
    return st.one_of(
        st.builds(Op, st.just("allreduce"), reduction=st.sampled_from(["SUM", "MAX"])),
        st.builds(Op, st.just("allgather")),
        st.builds(Op, st.just("bcast"), root=ROOTS),
    )


def _posted_ops():
    return st.builds(
        Op,
        st.sampled_from(POSTED),
        posted=st.just(True),
        root=ROOTS,
        shift=SHIFTS,
        gap=st.integers(0, 2),
        send_first=st.booleans(),
        template=st.sampled_from(["zeros", "x"]),
    )


def excluded(example: Example) -> str | None:
    """Why an example is not drawn, if it is not: what jaxcomm documents as not
    supported, and what takes too long."""
    posted = [op for op in example.ops if op.posted]
    ring = [op for op in posted if op.name == "ring"]
    stack = (*example.body, example.outer)
    derivatives = [s for s in stack if s in DERIVATIVES]
    sharded = example.place != "outside"
    if ring and any(d in REVERSE for d in derivatives[:-1]):
        return "a derivative of the gradient of isend/irecv (docs/autodiff.md)"
    if any(op.template == "zeros" for op in ring) and "vmap" in example.body:
        return "vmap of a receive into a constant template (docs/autodiff.md)"
    if example.mode == "eager" and sharded and posted:
        return "posts inside shard_map run eagerly: each start is compiled alone, and refused"
    if example.mode == "eager" and sharded and (example.outer != "value" or len(example.body) > 1):
        return "derivatives inside shard_map run eagerly: tens of seconds each"
    return None


@st.composite
def examples(draw, posted: bool) -> Example:
    ops = draw(st.lists(_blocking_ops(), min_size=0 if posted else 1, max_size=3))
    if posted:
        ops.insert(draw(st.integers(0, len(ops))), draw(_posted_ops()))
    return Example(
        group=draw(st.sampled_from(sorted(GROUPS))),
        ops=tuple(ops),
        body=tuple(draw(st.lists(st.sampled_from(BODY), max_size=2))),
        place=draw(st.sampled_from(PLACES)),
        outer=draw(st.sampled_from(OUTER)),
        mode=draw(st.sampled_from(MODES)),
        mark=draw(st.booleans()),
        branch=draw(st.booleans()),
        end=draw(st.none() | _end_ops()),
    )


# Run first, always: every blocking operation's transpose where a result that
# every rank holds alike is one value per device (typed varying, or without
# types), and where it is one value (typed invariant, also at the output).
EVERY_OP = (
    Op("allreduce"),
    Op("allgather"),
    Op("bcast", root=1),
    Op("sendrecv"),
    Op("sendrecv", tagged=True),  # a known tag: another derivative rule
    Op("alltoall"),
    Op("reduce_scatter"),
    Op("allreduce", reduction="MAX"),
)
SHARED = (Op("allreduce"), Op("allgather"), Op("bcast", root=1))
ALONG_EVERY = "along " + ",".join(NAMES)  # every process: on 4, the 2x2 mesh of issue 58
NO = (False, False)  # an explicit example's mark and branch


@given(example=examples(posted=False).filter(lambda e: excluded(e) is None))
@hypothesis.example(example=Example("world", EVERY_OP, (), "check_vma", "grad", "jax.jit", *NO))
@hypothesis.example(example=Example(ALONG_EVERY, SHARED, (), "no check_vma", "vjp", "jax.jit", *NO))
@hypothesis.example(
    example=Example(
        "along x", SHARED[::2], ("grad",), "check_vma", "vjp", "jaxcomm.jit", *NO, Op("allgather")
    )
)
@SETTINGS
@seed(SEED)
def test_blocking_programs_equal_jax_collectives(comms, example):
    check(example, comms[example.group])


# Every non-blocking operation's transpose, its wait after others, in a loop; and
# the ring of issue 58 in a checkpoint (both hung under jit(grad)).
EVERY_POST = (
    Op("allreduce", posted=True, gap=2),
    Op("allgather", posted=True),
    Op("ring", posted=True, shift=2),  # into zeros_like: the same in every iteration
    Op("bcast", posted=True, root=1, gap=1),
    Op("alltoall", posted=True),
    Op("reduce_scatter", posted=True),
)


@given(example=examples(posted=True).filter(lambda e: excluded(e) is None))
@hypothesis.example(
    example=Example("world", EVERY_POST, ("scan",), "check_vma", "grad", "jax.jit", *NO)
)
@hypothesis.example(
    example=Example(
        "world", (Op("ring", posted=True),), ("checkpoint",), "outside", "grad", "jax.jit", *NO
    )
)
@SETTINGS
@seed(SEED)
def test_posted_programs_equal_jax_collectives(comms, example):
    check(example, comms[example.group])
