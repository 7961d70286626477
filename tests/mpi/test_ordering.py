"""Ordered effects: program order inside and across jit, control flow, DCE, remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import FLOAT, assert_values


def test_unused_results_still_run(comm):
    """A jitted function whose only MPI effect is an unused send still sends: if it
    were removed, the recv below would never complete (the suite times out)."""
    if comm.size == 1:
        pytest.skip("a blocking send needs a peer")
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    @jax.jit
    def f(x):
        comm.send(x * 2, dest=right, tag=5)
        return x + 1

    x = jnp.full(2, float(comm.rank))
    if comm.rank % 2 == 0:
        assert_values(f(x), np.full(2, comm.rank + 1.0, FLOAT))
    received = comm.recv(jnp.zeros(2), source=left, tag=5)
    if comm.rank % 2 == 1:
        f(x)
    assert_values(received, np.full(2, 2.0 * left, FLOAT))
    comm.barrier()


def test_control_flow(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    @jax.jit
    def loops(x):
        x = jax.lax.fori_loop(0, 3, lambda i, v: comm.sendrecv(v, source=left, dest=right), x)
        x, _ = jax.lax.scan(lambda c, _: (comm.allreduce(c) / comm.size, None), x, None, length=2)
        x = jax.lax.cond(x.sum() > -1, lambda v: comm.bcast(v, root=0), lambda v: v, x)
        return jax.lax.while_loop(
            lambda c: c[1] < 2, lambda c: (comm.allreduce(c[0]) / comm.size, c[1] + 1), (x, 0)
        )[0]

    # After the ring shifts every rank holds some rank's number; then all average.
    mean = sum(range(comm.size)) / comm.size
    assert_values(loops(jnp.full(2, float(comm.rank))), np.full(2, mean, FLOAT))


def test_nested_jit_checkpoint_and_custom_vjp(comm):
    @jax.custom_vjp
    def f(x):
        return comm.allreduce(x)

    f.defvjp(lambda x: (comm.allreduce(x), None), lambda _, g: (g,))

    @jax.jit
    def outer(x):
        y = jax.jit(lambda v: comm.allreduce(v))(x)
        z = jax.checkpoint(lambda v: comm.allreduce(v) * 2)(y)
        return f(z)

    size = comm.size
    assert_values(outer(jnp.ones(2)), np.full(2, 2 * size**3, FLOAT))


def test_many_ops_one_jit_keep_order(comm):
    """Alternating collectives on two communicators: any reordering would deadlock or mix."""
    other = comm.dup()

    @jax.jit
    def f(x):
        for i in range(10):
            x = (comm if i % 2 else other).allreduce(x) / comm.size + 1
        return x

    assert_values(f(jnp.zeros(3)), np.full(3, 10.0, FLOAT))
    other.free()


def assert_not_overtaken(comm, slow_under, quick_under, *, rounds):
    """Rank 0 calls a slow send (a computation, then a send with tag 1) under
    `slow_under`, a jit, so that the call returns while XLA still computes; then
    a quick send (tag 2) under `quick_under`. Rank 1 must receive the two in that
    order, in each of `rounds` rounds."""
    ready = jnp.arange(4.0).block_until_ready()  # nothing to wait for on its own

    def slow_send(x):
        for _ in range(20):  # keep XLA busy while Python moves on
            x = jnp.tanh(x @ x)
        comm.send(x[0, :4], dest=1, tag=1)
        return x[0, 0]

    def quick_send(x):
        comm.send(x, dest=1, tag=2)
        return x

    slow, quick = slow_under(slow_send), quick_under(quick_send)
    for _ in range(rounds):
        if comm.rank == 0:
            slow(jnp.eye(400) * 0.5)  # returns before it has run
            quick(ready)
        elif comm.rank == 1:
            tags = []
            for _ in range(2):
                _, status = comm.recv(jnp.zeros(4), return_status=True)
                tags.append(int(status.tag))
            assert tags == [1, 2]
        comm.barrier()


def test_eager_call_waits_for_pending_jitted_calls(comm):
    """An eager call (the direct path, and in the second round its shortcut) must
    not overtake a jitted call dispatched before it that is still running."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    assert_not_overtaken(comm, jax.jit, lambda send: send, rounds=2)


def test_eager_call_waits_for_its_input(comm):
    """The direct path reads an input that XLA is still computing only once it is
    ready (A = full(1/n) is idempotent: A @ A = A); the second round repeats the
    call's signature, so it takes the eager shortcut."""
    n = 384
    a = jnp.full((n, n), 1.0 / n)
    total = comm.size / n + sum(range(comm.size))
    for _ in range(2):
        y = jax.jit(lambda a: jnp.linalg.matrix_power(a, 16) + comm.rank)(a)  # still running
        assert_values(comm.allreduce(y), np.full((n, n), total, FLOAT))


def test_captured_array_is_communicated_when_the_function_runs(comm):
    """A concrete array closed over by a traced function is staged into the program,
    not communicated once at trace time by the direct path."""
    captured = jnp.full(2, float(comm.rank + 1))

    def f():
        return comm.allreduce(captured)

    assert "jaxcomm_allreduce" in str(jax.make_jaxpr(f)())
    expected = np.full(2, comm.size * (comm.size + 1) / 2, FLOAT)
    jitted = jax.jit(f)
    assert_values(jitted(), expected)
    assert_values(jitted(), expected)


@pytest.mark.parametrize("jit", ["jax.jit", "jaxcomm.jit"])
def test_beside_other_ordered_effects(comm, jit):
    """jaxcomm's calls in a computation that also has another ordered effect (an
    ordered io_callback, as jaxcomm's mpi4jax-style status uses): both run, each
    in its own program order."""
    import jaxcomm

    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    seen = []

    def record(value):
        seen.append(float(value))

    def f(x):
        jax.experimental.io_callback(record, None, x[0], ordered=True)
        total = comm.allreduce(x)
        jax.experimental.io_callback(record, None, total[0], ordered=True)
        shifted = comm.sendrecv(total + comm.rank, source=left, dest=right)
        request = comm.isend(shifted, dest=right, tag=4)
        received = comm.recv(jnp.zeros_like(x), source=left, tag=4)
        comm.wait(request)
        jax.experimental.io_callback(record, None, received[0], ordered=True)
        return received

    compiled = jax.jit(f) if jit == "jax.jit" else jaxcomm.jit(f)
    total = sum(range(comm.size))
    two_left = (comm.rank - 2) % comm.size
    expected = np.full(2, total + two_left, FLOAT)
    assert_values(compiled(jnp.full(2, float(comm.rank))), expected)
    assert seen == [float(comm.rank), float(total), float(total + two_left)]
