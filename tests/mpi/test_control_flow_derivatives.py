"""Non-blocking posts and waits inside control flow, differentiated: the same
values, gradients and forward derivatives as their blocking twins, inside
lax.scan, lax.fori_loop, jax.checkpoint, nested jits and lax.cond, and (forward
mode, as JAX allows) lax.while_loop.

The bodies are those where what an operation's operands depend on differs
between ranks or between iterations: a receive into a constant template, data
sent from a constant on some ranks only, a collective of a constant on some
ranks only. JAX splits a differentiated loop body or checkpoint by what depends
on the tangents and by what changes between iterations; every rank must still
make the same calls in the same order (jaxcomm._jax_internals.tangents and
.primitive's OrderedPrimitive). Without that, these deadlock or pair the wrong messages.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

ROWS = 2  # columns of each rank's block; its rows are one per rank (alltoall)


def peers(comm) -> tuple[int, int]:
    """(left, right) on the ring of ranks."""
    return (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size


def constant_template(comm, c, blocking):
    """The ring of the issue: a receive into zeros_like (ANY_TAG), then a send,
    waited first. Every rank waits for its send (and its tangent's) before it
    waits for its receive, so each tangent and cotangent must be posted before
    that wait, as the messages are, though the receive learns its message's tag
    only when the message comes: else no rank gets past its first wait."""
    left, right = peers(comm)
    if blocking:
        return comm.sendrecv(2 * c, jnp.zeros_like(c), source=left, dest=right)
    received = comm.irecv(jnp.zeros_like(c), source=left)
    sent = comm.isend(2 * c, dest=right)
    comm.wait(sent)
    return comm.wait(received)


def constant_data(comm, c, blocking):
    """A tagged ring whose odd ranks send a constant, received into c."""
    left, right = peers(comm)
    data = jnp.sin(c) if comm.rank % 2 == 0 else jnp.full_like(c, comm.rank + 2.0)
    if blocking:
        return comm.sendrecv(data, c, source=left, dest=right, sendtag=3, recvtag=3) * jnp.cos(c)
    received = comm.irecv(c, source=left, tag=3)
    sent = comm.isend(data, dest=right, tag=3)
    cosine = jnp.cos(c)  # computed while the messages travel
    comm.wait(sent)
    return comm.wait(received) * cosine


def collectives_apart(comm, c, blocking):
    """An allreduce of a constant on odd ranks and an alltoall, posted together
    and waited apart, with computation between."""
    summed = c if comm.rank % 2 == 0 else jnp.ones_like(c)
    if blocking:
        return comm.allreduce(summed) * jnp.cos(c) + comm.alltoall(c)
    total = comm.iallreduce(summed)
    swapped = comm.ialltoall(c)
    cosine = jnp.cos(c)
    return comm.wait(total) * cosine + comm.wait(swapped)


def body(comm, c, blocking):
    """All three, one after the other: each can break differently (a hang, a
    message paired with the wrong call, a wrong derivative)."""
    for part in (constant_template, constant_data, collectives_apart):
        c = part(comm, c, blocking)
    return c


def scan(body, x):
    return lax.scan(lambda c, _: (body(c), None), x, None, length=2)[0]


def fori_loop(body, x):
    return lax.fori_loop(0, 2, lambda _, c: body(c), x)


def cond(body, x):
    # The same branch everywhere; both make the same calls.
    return lax.cond(jnp.sum(x) > -1e300, body, lambda c: body(c) * 1.0, x)


def while_loop(body, x):
    return lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, body(s[1])), (0, x))[1]


CONTROL: dict[str, Callable] = {
    "direct": lambda body, x: body(x),
    "scan": scan,
    "fori_loop": fori_loop,
    "checkpoint": lambda body, x: jax.checkpoint(body)(x),
    "nested_jit": lambda body, x: jax.jit(body)(x),
    "cond": cond,
    "scan_of_checkpoint": lambda body, x: scan(jax.checkpoint(body), x),
    "checkpoint_of_scan": lambda body, x: jax.checkpoint(lambda c: scan(body, c))(x),
    "while_loop": while_loop,  # forward mode only: JAX has no reverse mode for it
}
REVERSE = [name for name in CONTROL if name != "while_loop"]


def loss(comm, control, blocking, body=body):
    """x -> a scalar that weighs each rank's result differently, so that the
    cotangents differ between ranks."""

    def f(x):
        y = CONTROL[control](lambda c: body(comm, c, blocking), x)
        return jnp.sum(jnp.sin(y) * (comm.rank + 1.0))

    return f


def block(comm) -> jax.Array:
    return jnp.asarray(np.arange(comm.size * ROWS).reshape(comm.size, ROWS) / 7.0 + comm.rank)


def assert_close(got, want, what):
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12, err_msg=what
    )


@pytest.mark.parametrize("control", CONTROL)
def test_derivatives_equal_the_blocking_twins(comm, control):
    ours = loss(comm, control, blocking=False)
    twin = loss(comm, control, blocking=True)
    x = block(comm)
    dx = jnp.cos(x) + 0.5
    assert_close(jax.jit(ours)(x), jax.jit(twin)(x), "value")
    got = jax.jit(lambda x, dx: jax.jvp(ours, (x,), (dx,)))(x, dx)
    want = jax.jit(lambda x, dx: jax.jvp(twin, (x,), (dx,)))(x, dx)
    assert_close(got[1], want[1], "jvp")
    if control in REVERSE:
        assert_close(jax.jit(jax.grad(ours))(x), jax.jit(jax.grad(twin))(x), "grad")


@pytest.mark.parametrize("control", ["scan", "checkpoint"])
def test_eager_gradients_equal_the_blocking_twins(comm, control):
    """Differentiated outside jit: JAX then evaluates what it splits off a loop
    body at once, operation by operation."""
    ours = loss(comm, control, blocking=False, body=constant_template)
    twin = loss(comm, control, blocking=True, body=constant_template)
    x = block(comm)
    assert_close(jax.grad(ours)(x), jax.grad(twin)(x), "grad")


# Elements (float64) of the ring's messages below: 256 KiB, more than MPI sends
# before its receiver has posted a receive for it (MPICH's shared memory waited
# from 64 KiB on), so that a send waits for its receive as a large one does.
LARGE = 2**15


@pytest.mark.parametrize("eager", [False, True], ids=["jit", "eager"])
@pytest.mark.parametrize(
    "control", ["direct", "scan", "fori_loop", "checkpoint", "scan_of_checkpoint", "while_loop"]
)
def test_a_send_waited_before_a_receive_from_any_tag(comm, control, eager):
    """The issue's ring, its send waited first, on messages too large for MPI to
    send before their receive is posted: the tangent and the cotangent of the
    receive from ANY_TAG travel non-blocking as the messages do, so no rank
    waits for a receive that its peer posts only after its own wait."""
    if eager and control not in ("direct", "scan", "checkpoint"):
        pytest.skip("eagerly: once directly, and where JAX evaluates a split body at once")
    ours = loss(comm, control, blocking=False, body=constant_template)
    twin = loss(comm, control, blocking=True, body=constant_template)
    x = jnp.linspace(0.0, 1.0, LARGE) + comm.rank
    dx = jnp.cos(3.0 * x)
    wrap = (lambda f: f) if eager else jax.jit

    def tangent(f):
        return wrap(lambda x, dx: jax.jvp(f, (x,), (dx,))[1])(x, dx)

    assert_close(tangent(ours), tangent(twin), "jvp")
    if control in REVERSE:
        assert_close(wrap(jax.grad(ours))(x), wrap(jax.grad(twin))(x), "grad")


def sends_what_varies(comm, c):
    """A ring step whose message depends on the loop's carry."""
    left, right = peers(comm)
    return comm.sendrecv(jnp.sin(c), jnp.zeros_like(c), source=left, dest=right) * c


def sends_a_constant(comm, c):
    """The same ring step sending a constant: each of its operands is the same in
    every iteration, what JAX's reverse mode moves out of a loop."""
    left, right = peers(comm)
    return comm.sendrecv(jnp.ones_like(c), jnp.zeros_like(c), source=left, dest=right) * c


def _branches(comm):
    return [lambda c: sends_what_varies(comm, c), lambda c: sends_a_constant(comm, c)]


# A step whose branch each rank chooses (even ranks send what varies, odd ranks
# a constant), nested in a loop body as a user may write it: in a cond (traced
# apart from the body), in a jit (whose rules rebind the operation), both, and in
# a checkpoint with the loop under another (remat'd layers in a remat'd step,
# whose partial evaluation does not bind the operation again).
CHOSEN: dict[str, Callable] = {
    "cond": lambda comm: lambda c: lax.cond(comm.rank % 2 == 0, *_branches(comm), c),
    "jit": lambda comm: jax.jit(_branches(comm)[comm.rank % 2]),
    "cond_of_jits": lambda comm: (
        lambda c: lax.cond(comm.rank % 2 == 0, *map(jax.jit, _branches(comm)), c)
    ),
    "checkpoint_in_checkpoint": lambda comm: jax.checkpoint(_branches(comm)[comm.rank % 2]),
}


@pytest.mark.parametrize("chosen", CHOSEN)
def test_branches_chosen_by_rank_inside_loops(comm, chosen):
    """Each rank takes its own branch inside a scan body (fori_loop's is one),
    nested in a cond or a jit: the gradient is that of the loop written out in
    Python with the branch chosen in Python, where nothing can move out of a loop."""
    step = CHOSEN[chosen](comm)
    unrolled_step = _branches(comm)[comm.rank % 2]

    outer = jax.checkpoint if chosen.endswith("in_checkpoint") else lambda f: f

    @outer
    def ours(x):
        return jnp.sum(jnp.sin(scan(step, x)) * (comm.rank + 1.0))

    def unrolled(x):
        for _ in range(2):
            x = unrolled_step(x)
        return jnp.sum(jnp.sin(x) * (comm.rank + 1.0))

    x = block(comm)
    assert_close(jax.jit(ours)(x), jax.jit(unrolled)(x), "value")
    assert_close(jax.jit(jax.grad(ours))(x), jax.jit(jax.grad(unrolled))(x), "grad")
