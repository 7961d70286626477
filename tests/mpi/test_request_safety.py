"""Requests used the ways users misuse them: each gives the right values or an
error that names the misuse, never a wrong value, corruption, a crash or a hang.
MPI reads and writes only buffers jaxcomm owns (cpp/requests.h), so the message
of a refused or abandoned request may land at any time, here after the refusal."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import FLOAT, assert_values

from jaxcomm import JaxComm, _native

BIG = 4 * 1024 * 1024  # float32 elements: 16 MiB, past every eager-send threshold


def ring(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


def assert_later_messages_arrive(comm, tag, n=8):
    """Once every rank has refused, dropped or failed its receive of `tag` (the
    barrier, so that the messages leave after that, whatever the machine's
    speed), every rank sends its right neighbour two messages with that tag; the
    next receive from the left neighbour must get the first. A receive left
    posted would have taken it: the receive then gets the second, and fails
    at once rather than hang."""
    right, left = ring(comm)
    comm.barrier()
    sent = [comm.isend(jnp.full(n, comm.rank + k / 2, FLOAT), dest=right, tag=tag) for k in (0, 1)]
    for k in (0, 1):
        received = comm.recv(jnp.zeros(n, FLOAT), source=left, tag=tag)
        assert_values(received, np.full(n, left + k / 2, FLOAT))
    comm.waitall(sent)


def test_a_donated_input_is_sent_as_it_was_at_the_post(comm):
    """Item 1: x is donated to the next step before the wait; the receiver gets x."""
    right, left = ring(comm)
    x = jnp.arange(BIG, dtype=FLOAT) + comm.rank
    received = comm.irecv(jnp.zeros(BIG, FLOAT), source=left, tag=3)
    sent = comm.isend(x, dest=right, tag=3)
    update = jax.jit(lambda v: v * 0 - 1, donate_argnums=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX may say the donation was not usable
        jax.block_until_ready(update(x))
    comm.wait(sent)
    assert_values(comm.wait(received), np.arange(BIG, dtype=FLOAT) + left)


def test_a_donated_input_of_ialltoall_is_sent_as_it_was(comm):
    rows = jnp.arange(comm.size * 1024, dtype=FLOAT).reshape(comm.size, 1024) + 1000 * comm.rank
    expected = np.stack(
        [np.asarray(rows[comm.rank]) - 1000 * comm.rank + 1000 * r for r in range(comm.size)]
    )
    request = comm.ialltoall(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax.block_until_ready(jax.jit(lambda v: v + 7, donate_argnums=0)(rows))
    assert_values(comm.wait(request), expected)


def test_a_deleted_input_is_sent_as_it_was(comm):
    right, left = ring(comm)
    x = jnp.full(1024, comm.rank, FLOAT)
    sent = comm.isend(x, dest=right, tag=4)
    x.delete()
    assert_values(comm.recv(jnp.zeros(1024, FLOAT), source=left, tag=4), np.full(1024, left, FLOAT))
    comm.wait(sent)


def test_a_wait_in_one_branch_is_refused(comm):
    """Item 2: the wait would run only when p is true."""
    _right, left = ring(comm)

    def f(p, x):
        r = comm.irecv(x, source=left, tag=5)
        return jax.lax.cond(p, lambda: comm.wait(r), lambda: x)

    with pytest.raises(ValueError, match=r"wait: .*loop body or branch"):
        jax.jit(f)(False, jnp.zeros(8, FLOAT))
    assert_later_messages_arrive(comm, tag=5)


def test_a_wait_in_a_loop_for_a_request_posted_before_it_is_refused(comm):
    """Item 8."""
    _right, left = ring(comm)

    def f(x):
        r = comm.irecv(x, source=left, tag=6)
        return jax.lax.fori_loop(0, 1, lambda i, y: comm.wait(r), x)

    with pytest.raises(ValueError, match=r"wait: .*loop body or branch"):
        jax.jit(f)(jnp.zeros(8, FLOAT))
    assert_later_messages_arrive(comm, tag=6)
    comm.barrier()


def test_a_wait_inside_checkpoint_for_a_request_posted_outside_is_refused(comm):
    def f(x):
        r = comm.iallreduce(x)
        return jax.checkpoint(lambda y: comm.wait(r) + y)(x)

    with pytest.raises(ValueError, match=r"wait: .*loop body or branch"):
        jax.jit(f)(jnp.ones(4))
    comm.barrier()


def test_post_and_wait_inside_checkpoint_and_scan_work(comm):
    def body(carry, _):
        y = jax.checkpoint(lambda c: comm.wait(comm.iallreduce(c)) / comm.size)(carry)
        return y + 1, y

    def f(x):
        return jax.lax.scan(body, x, None, length=3)[0].sum()

    x = jnp.arange(4.0) * (comm.rank + 1)
    mean = np.arange(4.0) * (comm.size + 1) / 2
    assert_values(jax.jit(f)(x), (mean + 3).sum())
    # Each allreduce's transpose passes the (replicated) cotangent on: docs/autodiff.md.
    assert_values(jax.jit(jax.grad(f))(x), np.full(4, comm.size**-3.0, FLOAT))


@pytest.mark.parametrize("kept", ["list", "object"])
def test_a_request_kept_past_its_function_is_refused(comm, kept):
    """Item 3: appended to a list, or held by a halo object."""
    _right, left = ring(comm)
    store = []

    class Halo:
        def post(self, x):
            self.request = comm.irecv(x, source=left, tag=7)

    halo = Halo()

    def f(x):
        if kept == "list":
            store.append(comm.irecv(x, source=left, tag=7))
        else:
            halo.post(x)
        return x + 1

    with pytest.raises(ValueError, match=r"irecv: its request is never waited"):
        jax.jit(f)(jnp.zeros(8, FLOAT))
    assert_later_messages_arrive(comm, tag=7)


def test_a_request_waited_in_another_jitted_function_is_refused(comm):
    store = []

    def post(x):
        store.append(comm.iallreduce(x))
        return x

    with pytest.raises(ValueError, match="never waited"):
        jax.jit(post)(jnp.ones(2))
    with pytest.raises(ValueError, match=r"posted outside the traced function|wait"):
        jax.jit(lambda: comm.wait(store[0]))()
    comm.barrier()


def test_a_dropped_eager_isend_of_a_large_message_does_not_hang(comm):
    """Item 4: the drop does not wait for a receive that comes later; the message
    still arrives whole, as from MPI_Request_free."""
    right, left = ring(comm)
    with pytest.warns(RuntimeWarning, match="never waited"):
        request = comm.isend(jnp.arange(BIG, dtype=FLOAT) + comm.rank, dest=right, tag=8)
        del request
    if comm.size > 1:
        comm.barrier()  # every rank dropped its send before any receives
    received = comm.recv(jnp.zeros(BIG, FLOAT), source=left, tag=8)
    assert_values(received, np.arange(BIG, dtype=FLOAT) + left)


def test_a_dropped_eager_irecv_takes_no_later_message(comm):
    _right, left = ring(comm)
    with pytest.warns(RuntimeWarning, match="never waited"):
        request = comm.irecv(jnp.zeros(8, FLOAT), source=left, tag=9)
        del request
    assert_later_messages_arrive(comm, tag=9)


def test_a_dropped_eager_request_after_an_exception_is_safe(comm):
    _right, left = ring(comm)
    with pytest.warns(RuntimeWarning, match="never waited"):
        try:
            request = comm.irecv(jnp.zeros(8, FLOAT), source=left, tag=10)
            raise KeyError("between the post and the wait")
        except KeyError:
            del request
    assert_later_messages_arrive(comm, tag=10)


# Posts on a communicator that is freed before their wait, each with the value
# every rank's wait must return.
POSTED_BEFORE_FREE = {
    "iallreduce": (
        lambda c, x: c.iallreduce(x),
        lambda c: np.full(BIG, c.size * (c.size + 1) / 2, FLOAT),
    ),
    "ibcast": (lambda c, x: c.ibcast(x, root=c.size - 1), lambda c: np.full(BIG, c.size, FLOAT)),
    "ineighbor_allgather": (
        lambda c, x: c.ineighbor_allgather(x[:8]),
        lambda c: np.stack([np.full(8, (r % c.size) + 1, FLOAT) for r in ring(c)[::-1]]),
    ),
}


@pytest.mark.parametrize("name", POSTED_BEFORE_FREE)
def test_a_request_waited_after_its_communicator_is_freed(comm, name):
    """free() (here a with block's end) lets what was posted on the communicator
    complete first, as MPI's standard says it does (Open MPI 5 crashed freeing
    one with a non-blocking collective in flight); the wait then returns it."""
    post, expected = POSTED_BEFORE_FREE[name]
    x = jnp.full(BIG, comm.rank + 1.0, FLOAT)
    with comm.create_cart([comm.size], [True]) as ring_comm:
        request = post(ring_comm, x)
    assert_values(comm.wait(request), expected(comm))


def test_a_dropped_request_completes_before_its_communicator_is_freed(comm):
    with pytest.warns(RuntimeWarning, match="never waited"), comm.dup() as dup:
        request = dup.iallreduce(jnp.ones(BIG, FLOAT))
        del request
    assert_values(comm.allreduce(jnp.ones(4, FLOAT)), np.full(4, comm.size, FLOAT))


@pytest.mark.parametrize("name", ["ibcast", "irecv", "isend", "iallreduce", "ialltoall"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_zero_size_requests(comm, name, mode):
    """Item 6: empty arrays give empty results."""
    right, left = ring(comm)
    shape = (comm.size, 0) if name == "ialltoall" else (0, 3)

    def f(x):
        if name == "irecv":
            r = comm.irecv(x, source=left, tag=11)
            comm.wait(comm.isend(x, dest=right, tag=11))
            return comm.wait(r)
        if name == "isend":
            r = comm.isend(x, dest=right, tag=11)
            out = comm.recv(x, source=left, tag=11)
            comm.wait(r)
            return out
        post = {"ibcast": comm.ibcast, "iallreduce": comm.iallreduce, "ialltoall": comm.ialltoall}
        return comm.wait(post[name](x))

    out = (jax.jit(f) if mode == "jit" else f)(jnp.zeros(shape, FLOAT))
    assert out.shape == shape and out.dtype == FLOAT


def test_a_failed_wait_cancels_the_computations_other_requests(comm):
    """An error between a post and its wait ends the computation before the first
    receive's wait: that receive is cancelled, so it takes no later message, which
    a later receive gets whole. A message sent for it would go to a later receive,
    so the rank goes out of step (jaxcomm._lockstep); here no peer sent one."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    right, left = ring(comm)

    def f(x):
        first = comm.irecv(x, source=left, tag=12)
        short = comm.irecv(x[:2], source=left, tag=13)  # 8 elements arrive: too many
        return comm.wait(short), comm.wait(first)

    comm.send(jnp.ones(8, FLOAT), dest=right, tag=13)
    with pytest.raises(jax.errors.JaxRuntimeError, match="irecv"):
        jax.block_until_ready(jax.jit(f)(jnp.zeros(8, FLOAT)))
    assert "irecv was cancelled before its message came" in _native.cpu.out_of_step()
    _native.cpu.resume()
    assert_later_messages_arrive(comm, tag=12)


def test_a_message_too_large_for_irecv_gives_checking_modes_error(comm):
    """Item 7: in checking mode, the sender's header names both sides."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    checked = JaxComm(comm, check=True)
    right, left = ring(checked)
    r = checked.irecv(jnp.zeros(3, FLOAT), source=left, tag=14)
    s = checked.isend(jnp.ones(4, FLOAT), dest=right, tag=14)
    with pytest.raises(
        jax.errors.JaxRuntimeError, match=r"receives into \w+\[3\] but rank \d+ sent \w+\[4\]"
    ):
        checked.wait(r)
    checked.wait(s)
    checked.barrier()
    checked.free()
