"""jvp, grad and higher derivatives of every op, against finite differences of the
GLOBAL function: every rank's input perturbed, the real distributed op evaluated.

A case's loss is replicated (the same function of a replicated result on every
rank: the gradient convention) or per-rank (the global loss is the sum over
ranks of each rank's own loss).

Each case's finite differences are taken once, element by element of every
rank's x (Case.jacobian), and the first-order tests read their expectations from
them: grad, jacrev, jvp and jacfwd each check every element of their result
against every element of every rank's input, as when each test took its own
differences. On 3 ranks that is 36 evaluations of a case instead of 86 (grad's
and jacrev's 36 each, jvp's 2 and jacfwd's 12), and no allreduce per evaluation.
"""

from functools import cached_property, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import assert_values, rank_data
from jax.test_util import check_grads
from mpi4py import MPI

from jaxcomm import JaxComm

EPS = 1e-6


def data(rank, size, phase=0.0):
    """Smooth, positive values, distinct across ranks and positions (no ties)."""
    index = np.arange(2 * size).reshape(size, 2)
    return 0.5 + 0.1 * rank + 0.3 * index + 0.01 * np.sin(index + phase)


def shift_peers(comm, periodic):
    r, n = comm.rank, comm.size
    if periodic:
        return (r - 1) % n, (r + 1) % n
    return (r - 1 if r > 0 else MPI.PROC_NULL), (r + 1 if r < n - 1 else MPI.PROC_NULL)


def send_recv_pairs(comm, x):
    """Even ranks send 2x to the next rank, which multiplies it into its own x."""
    r, n = comm.rank, comm.size
    if r % 2 == 0 and r + 1 < n:
        comm.send(2 * x, dest=r + 1)
        return x
    if r % 2 == 1:
        return comm.recv(x, source=r - 1) * x
    return x


def isend_irecv_ring(comm, x):
    """Each rank posts the receive from the left, sends 3x to the right, computes
    x**2 meanwhile, and multiplies it into what arrives."""
    left, right = shift_peers(comm, True)
    received = comm.irecv(x, source=left, tag=4)
    sent = comm.isend(3 * x, dest=right, tag=4)
    square = x * x
    comm.wait(sent)
    return comm.wait(received) * square


def constant_template_pairs(comm, x):
    """send_recv_pairs receiving into a constant template (only its shape and dtype
    count): its derivatives are those of receiving into x."""
    r, n = comm.rank, comm.size
    if r % 2 == 0 and r + 1 < n:
        comm.send(2 * x, dest=r + 1)
    if r % 2 == 1:
        return comm.recv(jnp.zeros_like(x), source=r - 1) * x
    return x


def constant_template_ring(comm, x):
    """isend_irecv_ring receiving into a constant template."""
    left, right = shift_peers(comm, True)
    received = comm.irecv(jnp.zeros_like(x), source=left, tag=6)
    comm.wait(comm.isend(3 * x, dest=right, tag=6))
    return comm.wait(received) * x


def constant_data_ring(comm, x):
    """Odd ranks send a constant into a ring that receives into x: no derivative
    travels with it, and the messages still pair up."""
    left, right = shift_peers(comm, True)
    data = 3 * x if comm.rank % 2 == 0 else jnp.full_like(x, comm.rank + 2.0)
    received = comm.irecv(x, source=left, tag=7)
    comm.wait(comm.isend(data, dest=right, tag=7))
    return comm.wait(received) * x


def only_some_ranks_vary(x, comm):
    """x on even ranks, a constant on odd ones."""
    return x if comm.rank % 2 == 0 else jnp.ones_like(x)


def scatter_rows(comm, x):
    return comm.scatter(x if comm.rank == 1 % comm.size else x[0], root=1 % comm.size)


def finite(y):
    return jnp.where(jnp.isfinite(y), y, 0.0)


def own_rows(comm):
    """Rows of x a rank contributes to a variable-size gather: 1 or 2."""
    return 1 + comm.rank % 2 if comm.size > 1 else 1


#: name -> (function of (comm, x), replicated result?)
CASES = {
    "allreduce_sum": (lambda c, x: c.allreduce(x), True),
    "allreduce_max": (lambda c, x: c.allreduce(x, op=MPI.MAX), True),
    "allreduce_min": (lambda c, x: c.allreduce(x, op="min"), True),
    "allreduce_prod": (lambda c, x: c.allreduce(x, op=MPI.PROD), True),
    "bcast": (lambda c, x: c.bcast(x, root=c.size - 1), True),
    "allgather": (lambda c, x: c.allgather(x[0]), True),
    "reduce_sum": (lambda c, x: c.reduce(x, root=c.size - 1), False),
    "reduce_max": (lambda c, x: c.reduce(x, op=MPI.MAX, root=0), False),
    "reduce_prod": (lambda c, x: c.reduce(x, op=MPI.PROD, root=0), False),
    "gather": (lambda c, x: c.gather(x[-1], root=0), False),
    "scatter": (scatter_rows, False),
    "alltoall": (lambda c, x: c.alltoall(x), False),
    # Variable-size: x's rows are (size, 2); counts that differ by rank and pair.
    "alltoallv": (
        lambda c, x: c.alltoallv(x, [(c.rank + d) % 2 for d in range(c.size)], capacity=c.size)[0],
        False,
    ),
    "allgatherv": (lambda c, x: c.allgatherv(x, capacity=2 * c.size, count=own_rows(c))[0], True),
    "gatherv": (lambda c, x: c.gatherv(x, 0, capacity=2 * c.size, count=own_rows(c))[0], False),
    "scatterv": (
        lambda c, x: c.scatterv(x, [1] * c.size if c.rank == 0 else None, 0, capacity=2)[0],
        False,
    ),
    "reduce_scatter_sum": (lambda c, x: c.reduce_scatter(x), False),
    "reduce_scatter_max": (lambda c, x: c.reduce_scatter(x, op=MPI.MAX), False),
    "scan_sum": (lambda c, x: c.scan(x), False),
    "scan_max": (lambda c, x: c.scan(x, op=MPI.MAX), False),
    "scan_prod": (lambda c, x: c.scan(x, op=MPI.PROD), False),
    "exscan_sum": (lambda c, x: c.exscan(x), False),
    "exscan_min": (lambda c, x: finite(c.exscan(x, op=MPI.MIN)), False),  # rank 0: inf
    "exscan_prod": (lambda c, x: c.exscan(x, op=MPI.PROD), False),
    "sendrecv_ring": (
        lambda c, x: c.sendrecv(x, source=shift_peers(c, True)[0], dest=shift_peers(c, True)[1]),
        False,
    ),
    "sendrecv_chain": (
        lambda c, x: c.sendrecv(x, source=shift_peers(c, False)[0], dest=shift_peers(c, False)[1]),
        False,
    ),
    "send_recv": (send_recv_pairs, False),
    "pvary": (lambda c, x: c.pvary(c.allreduce(x)) * (c.rank + 1.0), False),
    "barrier": (lambda c, x: c.barrier() and x * x, False),
    # Non-blocking: posted, something computed meanwhile, waited.
    "iallreduce_sum": (lambda c, x: c.wait(c.iallreduce(x)) + x * 0, True),
    "iallreduce_max": (lambda c, x: c.wait(c.iallreduce(x, op=MPI.MAX)), True),
    "iallreduce_prod": (lambda c, x: c.wait(c.iallreduce(x, op=MPI.PROD)), True),
    "ibcast": (lambda c, x: c.wait(c.ibcast(x, root=c.size - 1)), True),
    "iallgather": (lambda c, x: c.wait(c.iallgather(x[0])), True),
    "ialltoall": (lambda c, x: c.wait(c.ialltoall(x)), False),
    "ialltoallv": (
        lambda c, x: c.wait(
            c.ialltoallv(x, [(c.rank + d) % 2 for d in range(c.size)], capacity=c.size)
        )[0],
        False,
    ),
    "ireduce_scatter_sum": (lambda c, x: c.wait(c.ireduce_scatter(x)), False),
    "ireduce_scatter_max": (lambda c, x: c.wait(c.ireduce_scatter(x, op=MPI.MAX)), False),
    "isend_irecv_ring": (lambda c, x: isend_irecv_ring(c, x), False),
    # Operands that depend on x on some ranks only: the messages of derivatives
    # must pair up whatever each rank's operand depends on.
    "recv_constant_template": (constant_template_pairs, False),
    "irecv_constant_template": (constant_template_ring, False),
    "isend_constant_data": (constant_data_ring, False),
    "sendrecv_some_constant": (
        lambda c, x: (
            c.sendrecv(
                only_some_ranks_vary(x, c),
                source=shift_peers(c, True)[0],
                dest=shift_peers(c, True)[1],
            )
            * x
        ),
        False,
    ),
    "allreduce_some_constant": (lambda c, x: c.allreduce(only_some_ranks_vary(x, c)), True),
    "bcast_constant_template": (
        lambda c, x: c.bcast(x if c.rank == c.size - 1 else jnp.zeros_like(x), root=c.size - 1),
        True,
    ),
}

#: Cases whose operand is a constant on some ranks.
SOME_CONSTANT = {name for name in CASES if "constant" in name}

#: Cases whose gradient sends cotangents with standalone sends: reverse over
#: reverse is refused (test_derivatives_of_a_send_recv_gradient_are_refused),
#: for PAIRS where there is more than one rank.
PAIRS = {"send_recv", "recv_constant_template"}
STANDALONE_PAIRS = {
    "isend_irecv_ring",
    "irecv_constant_template",
    "isend_constant_data",
}


def loss_weights(comm, name, shape):
    """A rank's loss is sum(sin(y) * weights): weights that differ by element, and
    by rank where the loss is per-rank, so that no two cotangents are alike."""
    offset = 0.0 if CASES[name][1] else float(comm.rank)
    return 1.0 + offset + 0.25 * np.arange(int(np.prod(shape))).reshape(shape)


def local_loss(comm, name):
    fn = CASES[name][0]

    def loss(x):
        y = fn(comm, x)
        return jnp.sum(jnp.sin(y) * loss_weights(comm, name, y.shape))

    return loss


def local_jacobian(comm, g, x):
    """d(this rank's g(x))/d(element i of rank r's x), shaped g(x).shape + (size,)
    + x.shape: central differences, one element of one rank perturbed at a time,
    every rank evaluating g (2 * size * x.size evaluations; g is best jitted)."""
    columns = []
    for owner in range(comm.size):
        for i in np.ndindex(x.shape):
            values = []
            for sign in (1, -1):
                xp = x.copy()
                if comm.rank == owner:
                    xp[i] += sign * EPS
                values.append(np.asarray(g(xp)))
            columns.append((values[0] - values[1]) / (2 * EPS))
    return np.stack(columns, -1).reshape((*columns[0].shape, comm.size, *x.shape))


def jacobian_of_global(comm, jacobian, replicated, x):
    """From local_jacobian: d(global g)/d(this rank's x), shaped g(x).shape + x.shape.
    The global value of g is g itself if replicated, else the sum over ranks (which
    needs g(x) shaped alike on every rank)."""
    total = jacobian if replicated else comm.mpi.allreduce(jacobian)
    return np.take(total, comm.rank, axis=jacobian.ndim - 1 - x.ndim)


def finite_difference_jacobian(comm, g, replicated, x):
    """d(global g)/d(this rank's x) by finite differences (see local_jacobian)."""
    return jacobian_of_global(comm, local_jacobian(comm, jax.jit(g), x), replicated, x)


class Case:
    """One case of CASES on comm, at x = data(rank, size): its jitted function,
    the jitted gradient of its loss and its Jacobian by finite differences, each
    made when a test first needs it and kept for the module's other tests (the
    differences are most of the first-order tests' evaluations). Every rank runs
    the same tests in the same order, so each makes them at the same test and
    their evaluations pair up."""

    def __init__(self, comm, name):
        self.comm, self.name = comm, name
        self.replicated = CASES[name][1]
        self.x = data(comm.rank, comm.size)

    @cached_property
    def fn(self):
        return jax.jit(partial(CASES[self.name][0], self.comm))

    @cached_property
    def grad(self):
        return jax.jit(jax.grad(local_loss(self.comm, self.name)))

    @cached_property
    def jacobian(self):
        """d(this rank's result)/d(each element of each rank's x): local_jacobian."""
        return local_jacobian(self.comm, self.fn, self.x)

    @cached_property
    def expected_grad(self):
        """d(global loss)/d(this rank's x): the chain rule through the Jacobian, the
        loss's own derivative (cos(y) * weights) taken exactly. Central differences
        of the global loss approximate the same sum; here each rank's part of it is
        taken apart, so a wrong cotangent on any rank, or sent to the wrong rank,
        shows in the element it reaches."""
        y = np.asarray(self.fn(self.x))
        outer = np.cos(y) * loss_weights(self.comm, self.name, y.shape)
        # (size, *x.shape): d(this rank's loss)/d(rank r's x), for every r.
        per_rank = np.tensordot(outer, self.jacobian, axes=y.ndim)
        total = per_rank if self.replicated else self.comm.mpi.allreduce(per_rank)
        return total[self.comm.rank]


@pytest.fixture(scope="module")
def cases(comm):
    made = {}

    def case(name):
        if name not in made:
            made[name] = Case(comm, name)
        return made[name]

    return case


def skip_beyond_three_ranks(comm):
    # Finite differences cost 2 * size * n evaluations; 4 ranks are oversubscribed here.
    if comm.size > 3:
        pytest.skip("finite-difference checks run on 1 to 3 ranks")


@pytest.mark.parametrize("name", CASES)
def test_grad_matches_finite_differences(comm, cases, name):
    """Every element of every rank's gradient, eager and jitted."""
    skip_beyond_three_ranks(comm)
    case = cases(name)
    loss = local_loss(comm, name)
    np.testing.assert_allclose(jax.grad(loss)(case.x), case.expected_grad, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(case.grad(case.x), case.expected_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", CASES)
def test_jacrev_matches_finite_differences(comm, cases, name):
    """The whole Jacobian of the global result: every output against every element
    of this rank's x (the batched transposes, where grad checks one cotangent)."""
    skip_beyond_three_ranks(comm)
    if name in ("gather", "gatherv") and comm.size > 1:
        pytest.skip("jacrev batches over outputs: gather's output size differs by rank")
    if (name in PAIRS and comm.size > 1) or name in STANDALONE_PAIRS:
        pytest.skip("jacrev through send and recv is refused (test_derivatives_of_a_...)")
    case = cases(name)
    expected = jacobian_of_global(comm, case.jacobian, case.replicated, case.x)
    fn = partial(CASES[name][0], comm)
    np.testing.assert_allclose(jax.jit(jax.jacrev(fn))(case.x), expected, rtol=1e-6, atol=1e-7)


def tangents(size):
    """Each rank's tangent of test_jvp_...: every rank's, as every rank knows them."""
    return np.stack([data(r, size, phase=1.0) - 0.5 for r in range(size)])


@pytest.mark.parametrize("name", CASES)
def test_jvp_and_jacfwd_match_finite_differences(comm, cases, name):
    """jvp with every rank moving at once, each in its own direction, and every
    column of jacfwd, against the Jacobian: each output element of this rank."""
    case = cases(name)
    everyone = tangents(comm.size)
    y, dy = jax.jvp(case.fn, (case.x,), (everyone[comm.rank],))
    np.testing.assert_allclose(y, case.fn(case.x))
    # The derivative along every rank's tangent at once: the Jacobian's columns,
    # each weighted by its rank's tangent element (what differences along the
    # tangents approximate).
    expected = np.tensordot(case.jacobian, everyone, axes=1 + case.x.ndim)
    np.testing.assert_allclose(dy, expected, rtol=1e-6, atol=1e-7)
    if name in SOME_CONSTANT:
        return  # jacfwd batches the tangents, not a constant's zero (test_jacfwd_...)
    # Column i of jacfwd: every rank moves its element i at once, the sum of the
    # Jacobian's columns of element i over ranks.
    columns = case.jacobian.sum(axis=case.jacobian.ndim - 1 - case.x.ndim)
    np.testing.assert_allclose(jax.jacfwd(case.fn)(case.x), columns, rtol=1e-6, atol=1e-7)


#: Cases whose second derivatives can be wrong where their first are right: a
#: replicated result (transposing its transpose does not give the op back, under
#: the replicated convention), an op whose tangent is not linear (MAX, MIN,
#: PROD), a message multiplied into x, pvary. The other cases' ops are linear and
#: per-rank: their second derivatives are their first-order rules composed, which
#: the first-order tests check op by op.
SECOND_ORDER = [
    name
    for name, (_, replicated) in CASES.items()
    if replicated
    or any(op in name for op in ("max", "min", "prod", "pvary"))
    or name in PAIRS | STANDALONE_PAIRS | {"sendrecv_some_constant"}
]


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_second_order(comm, cases, name):
    case = cases(name)
    fn = partial(CASES[name][0], comm)
    check_grads(fn, (case.x,), order=2, modes=["fwd"], eps=1e-4)
    if (name in PAIRS and comm.size > 1) or name in STANDALONE_PAIRS:
        return  # refused (test_derivatives_of_a_send_recv_gradient_are_refused)
    # Reverse over reverse: the Hessian-vector product against differences of
    # grads (the gradient test's, compiled once for both).
    v = data(comm.rank, comm.size, phase=2.0) - 0.5
    hvp = jax.grad(lambda x: jnp.vdot(case.grad(x), v))(case.x)
    numeric = (case.grad(case.x + EPS * v) - case.grad(case.x - EPS * v)) / (2 * EPS)
    np.testing.assert_allclose(hvp, numeric, rtol=1e-5, atol=1e-6)


def send_recv_ring(comm, x):
    """A ring of blocking send and recv (even ranks send first): 3x to the right,
    multiplied into x**2 on arrival."""
    left, right = shift_peers(comm, True)
    if comm.rank % 2 == 0:
        comm.send(3 * x, dest=right, tag=5)
    received = comm.recv(x, source=left, tag=5)
    if comm.rank % 2 == 1:
        comm.send(3 * x, dest=right, tag=5)
    return received * x * x


@pytest.mark.parametrize("ring", [send_recv_ring, isend_irecv_ring])
def test_derivatives_of_a_send_recv_gradient_are_refused(comm, ring):
    """Every rank of a ring sends a cotangent back, and refuses, before anything
    runs, what would leave that message without a matching receive (a hang, or a
    later receive taking it); messages afterwards are untouched."""
    loss = lambda x: jnp.sum(jnp.sin(ring(comm, x)))  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    x, v = data(comm.rank, comm.size), jnp.ones((comm.size, 2))
    match = "gradient of a standalone send/recv pair"
    with pytest.raises(NotImplementedError, match=match):
        jax.grad(lambda x: jnp.vdot(grad(x), v))(x)  # reverse over reverse
    with pytest.raises(NotImplementedError, match=match):
        jax.jvp(grad, (x,), (v,))  # forward over reverse
    with pytest.raises(NotImplementedError, match=match):
        jax.jit(jax.jacrev(lambda x: ring(comm, x)))(x)
    with pytest.raises(NotImplementedError, match=match):
        jax.vmap(grad)(jnp.stack([x, 2 * x]))
    left, right = shift_peers(comm, True)
    got = comm.sendrecv(jnp.full(3, comm.rank), source=left, dest=right)
    assert_values(got, np.full(3, left, got.dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_constant_template_differentiates_as_x(comm, dtype):
    """Exact comparison, in each float dtype (bfloat16 is no NumPy float)."""
    x = jnp.asarray(data(comm.rank, comm.size), dtype)
    left, right = shift_peers(comm, True)

    def loss(x, template):
        received = comm.irecv(template(x), source=left, tag=8)
        comm.wait(comm.isend(3 * x, dest=right, tag=8))
        return jnp.sum(comm.wait(received) * x).astype(jnp.float32)

    expected = jax.grad(loss)(x, lambda x: x)
    assert_values(jax.grad(loss)(x, jnp.zeros_like), expected)
    assert_values(jax.jit(jax.grad(loss), static_argnums=1)(x, jnp.zeros_like), expected)


@pytest.mark.parametrize("check", [False, True], ids=["plain", "checking"])
def test_jacfwd_of_a_constant_template_names_the_cause(comm, check):
    """jacfwd is vmap over tangents; a constant template's zero tangent is not
    batched while the tangents sent are: every receiver refuses with the cause
    (documented in docs/autodiff.md), and the ranks stay in step."""
    if not check and comm.size == 1 and "Open MPI" in MPI.Get_library_version():
        pytest.skip("Open MPI cuts a message to the same rank to fit without an error")
    x = data(comm.rank, comm.size)
    ring = JaxComm(MPI.COMM_WORLD, check=True) if check else comm
    cause = "receives into .* but rank" if check else "larger than the receive's template"
    with pytest.raises(jax.errors.JaxRuntimeError, match=cause):
        jax.jacfwd(lambda x: constant_template_ring(ring, x))(x)
    left, right = shift_peers(comm, True)
    got = comm.sendrecv(jnp.full(3, comm.rank), source=left, dest=right)
    assert_values(got, np.full(3, left, got.dtype))
    if check:
        ring.free()


def test_max_ties_split_evenly(comm):
    x = jnp.ones(3)
    t = jnp.full(3, comm.rank + 1.0)
    _, dy = jax.jvp(lambda x: comm.allreduce(x, op=MPI.MAX), (x,), (t,))
    np.testing.assert_allclose(dy, np.full(3, (comm.size + 1) / 2))


def test_jpi_example_gradient(comm):
    """The JPI README program: scatter from 0, double on the last rank, allreduce."""
    x = jnp.arange(2.0 * comm.size) if comm.rank == 0 else jnp.zeros(2 * comm.size)

    def func(x):
        rows = x.reshape(comm.size, 2)
        y = comm.scatter(rows if comm.rank == 0 else rows[0], root=0)
        if comm.rank == comm.size - 1:
            y = y * 2
        return jnp.sum(comm.allreduce(y))

    n = comm.size
    expected = sum(range(2 * n)) + sum(range(2 * n - 2, 2 * n))
    assert float(jax.jit(func)(x)) == expected
    weights = np.ones(2 * n)
    weights[-2:] = 2
    expected_grad = weights if comm.rank == 0 else np.zeros(2 * n)
    np.testing.assert_array_equal(jax.grad(func)(x), expected_grad)


def test_grad_inside_scan_checkpoint_and_custom_vjp(comm):
    @jax.custom_vjp
    def cube(z):
        return z**3

    cube.defvjp(lambda z: (cube(z), z), lambda z, ct: (3 * z**2 * ct,))

    def loss(x):
        def step(carry, _):
            carry = jax.checkpoint(lambda c: comm.sendrecv(jnp.sin(c), **ring(comm)))(carry)
            return carry, comm.allreduce(carry)  # unused: its transpose still runs

        last, _ = jax.lax.scan(step, x, None, length=3)
        return jnp.sum(cube(comm.allreduce(last)))

    def reference(xs):  # row r is rank r's x; the same loss on every rank
        for _ in range(3):
            xs = np.roll(np.sin(xs), 1, axis=0)  # rank r receives from rank r - 1
        return np.sum(xs.sum(0) ** 3)

    xs = np.stack([data(r, comm.size)[0] for r in range(comm.size)])
    value = float(jax.jit(loss)(jnp.asarray(xs[comm.rank])))
    np.testing.assert_allclose(value, reference(xs), rtol=1e-12)
    grad = jax.jit(jax.grad(loss))(jnp.asarray(xs[comm.rank]))
    numeric = np.zeros(xs.shape[1])
    for i in range(xs.shape[1]):
        up, down = xs.copy(), xs.copy()
        up[comm.rank, i] += EPS
        down[comm.rank, i] -= EPS
        numeric[i] = (reference(up) - reference(down)) / (2 * EPS)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6)


def ring(comm):
    return {"source": (comm.rank - 1) % comm.size, "dest": (comm.rank + 1) % comm.size}


@pytest.mark.parametrize("wrap", ["eager", "jax.jit", "jaxcomm.jit"])
def test_checking_mode_catches_unreplicated_cotangent(comm, wrap):
    """The check fails alike on every rank, after the computation's allreduce:
    catching it is safe, and the next calls (the fixed gradient) run."""
    import jaxcomm
    from jaxcomm import JaxComm

    checked = JaxComm(comm, check=True)
    x = jnp.arange(3.0)
    wrapped = {"eager": lambda f: f, "jax.jit": jax.jit, "jaxcomm.jit": jaxcomm.jit}[wrap]

    def rank_dependent(x):  # the allreduce result feeds rank-dependent code
        return jnp.sum(checked.allreduce(x) * (checked.rank + 1.0))

    if comm.size == 1:
        np.testing.assert_array_equal(wrapped(jax.grad(rank_dependent))(x), np.ones(3))
    else:
        with pytest.raises(Exception, match=r"transpose of allreduce .* not identical") as err:
            np.asarray(wrapped(jax.grad(rank_dependent))(x))
        assert "pvary" in str(err.value)
    # With the marker, the same code is right and passes the check.
    fixed = lambda x: jnp.sum(checked.pvary(checked.allreduce(x)) * (checked.rank + 1.0))  # noqa: E731
    total = sum(r + 1.0 for r in range(comm.size))
    np.testing.assert_allclose(wrapped(jax.grad(fixed))(x), np.full(3, total))
    checked.free()


def test_recv_from_any_source_is_not_differentiable(comm):
    if comm.size < 2:
        pytest.skip("needs a partner")
    if comm.rank == 0:
        comm.send(jnp.ones(2), dest=1)
    elif comm.rank == 1:
        with pytest.raises(ValueError, match="explicit source"):
            jax.jvp(lambda t: comm.recv(t), (jnp.zeros(2),), (jnp.ones(2),))
    comm.barrier()


def tags_crossed(comm, x, y, *, send, receive, second_tag):
    """Each rank sends 3x with tag 1, then 5y with tag 2, to its right; it receives
    tag 2 first, then tag 1 (or whatever tag is left: second_tag=ANY_TAG). Each
    template has a tangent where the message has one, as every rank must agree."""
    left, right = shift_peers(comm, True)
    if send == "isend":
        sent = [comm.isend(3 * x, dest=right, tag=1), comm.isend(5 * y, dest=right, tag=2)]
    else:  # small messages, which MPI buffers
        comm.send(3 * x, dest=right, tag=1)
        comm.send(5 * y, dest=right, tag=2)
    if receive == "irecv":
        by_2 = comm.irecv(y, source=left, tag=2)
        by_1 = comm.irecv(x, source=left, tag=second_tag)
        b, a = comm.waitall([by_2, by_1])
    else:
        b = comm.recv(y, source=left, tag=2)
        a = comm.recv(x, source=left, tag=second_tag)
    if send == "isend":
        comm.waitall(sent)
    return jnp.sum(a) * (comm.rank + 1.0) + jnp.sum(b) * 100 * (comm.rank + 1.0)


@pytest.mark.parametrize(
    "send, receive, second_tag",
    [
        ("send", "recv", 1),
        ("send", "recv", MPI.ANY_TAG),
        ("isend", "recv", 1),
        ("isend", "recv", MPI.ANY_TAG),
        ("isend", "irecv", 1),
        ("isend", "irecv", MPI.ANY_TAG),
    ],
)
def test_cotangents_pair_with_messages_by_tag(comm, send, receive, second_tag):
    """The reverse pass must send each cotangent back with its message's tag: paired
    by order alone, x would get y's cotangent and y x's."""
    if send == "send" and comm.size == 1:
        pytest.skip("a blocking send to itself waits for its receive (the isend cases run)")
    loss = partial(tags_crossed, comm, send=send, receive=receive, second_tag=second_tag)
    x, y = jnp.full(2, 1.0 + comm.rank), jnp.full(2, -1.0 - comm.rank)
    right = (comm.rank + 1) % comm.size
    for grad in (jax.grad(loss, (0, 1)), jax.jit(jax.grad(loss, (0, 1)))):
        dx, dy = grad(x, y)
        np.testing.assert_array_equal(dx, np.full(2, 3.0 * (right + 1)))
        np.testing.assert_array_equal(dy, np.full(2, 500.0 * (right + 1)))
    # y's messages are posted outside the trace: constants, without tangents.
    np.testing.assert_array_equal(jax.grad(loss)(x, y), dx)


def test_a_tangent_from_any_tag_that_meets_another_message_is_an_error(comm):
    """The tangent of a receive from ANY_TAG is posted from ANY_TAG, right after
    the receive of its message. Under jax.linearize the tangents travel when the
    linear function runs, and here rank 0 sends another message (tag 2) before
    it, which rank 1 receives after it: the tangent's receive takes that message.
    Its wait sees the tag differ from its message's and says so, rather than
    give that message as the tangent."""
    if comm.size < 2:
        pytest.skip("needs a sender and a receiver")
    x, other = jnp.arange(3.0) + 1.0, jnp.full(3, -7.0)
    if comm.rank == 0:
        _, tangent = jax.linearize(lambda v: comm.wait(comm.isend(v, dest=1, tag=1)) or v, x)
        comm.send(other, dest=1, tag=2)
        tangent(jnp.ones(3))
    elif comm.rank == 1:
        received, tangent = jax.linearize(lambda v: comm.wait(comm.irecv(v, source=0)), x * 0)
        np.testing.assert_array_equal(received, x)
        with pytest.raises(jax.errors.JaxRuntimeError, match="with tag 2, its message with tag 1"):
            tangent(jnp.ones(3))
        # The linear function's wait failed before its end, so the rank is out of
        # step; this test receives what rank 0 sent, and says so.
        from jaxcomm import _native

        assert "tag 2, its message with tag 1" in _native.cpu.out_of_step()
        _native.cpu.resume()
        np.testing.assert_array_equal(comm.recv(x, source=0, tag=1), np.ones(3))
    comm.barrier()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "complex64", "int64", "bool"])
def test_replication_check_names_the_differing_element(comm, dtype):
    from jaxcomm import JaxComm
    from jaxcomm._replicated import replicated_cotangent

    checked = JaxComm(comm, check=True)
    x = rank_data(0, (4, 3), dtype)
    same = replicated_cotangent(jnp.asarray(x), comm=checked._comm, operation="allreduce")
    assert_values(same, x)  # identical everywhere: passes through
    if comm.size > 1:
        if comm.rank == comm.size - 1:
            x[2, 1] = not x[2, 1] if dtype == "bool" else x[2, 1] + 1
        expected = "flat index 7" if comm.rank == comm.size - 1 else "not identical"
        with pytest.raises(Exception, match=expected):
            replicated_cotangent(jnp.asarray(x), comm=checked._comm, operation="allreduce")
    checked.free()
