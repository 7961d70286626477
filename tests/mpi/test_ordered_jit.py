"""jaxcomm.jit: JAX's C++ dispatch path, program order kept with every other call.

The first tests run a program that mixes eager calls, jax.jit and jaxcomm.jit,
with loops and branches; test_mpiexec runs them on 5 ranks too. The rest check
order across calls where it could break: a call still running while Python
dispatches the next one. The whole MPI suite's jitted functions can run through
jaxcomm.jit instead of jax.jit: ``JAXCOMM_TEST_JIT=jaxcomm`` (tests/mpi/conftest.py).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import FLOAT, assert_values
from mpi4py import MPI
from test_ordering import assert_not_overtaken

import jaxcomm
from jaxcomm import _jax_internals

JITS = {"jax.jit": jax.jit, "jaxcomm.jit": jaxcomm.jit}
KINDS = ["eager", "jax.jit", "jaxcomm.jit"]


def as_kind(kind, fn):
    return fn if kind == "eager" else JITS[kind](fn)


def test_top_level_computation_has_no_effect(comm):
    """What takes jaxcomm.jit's calls to JAX's C++ dispatch path: JAX refuses it to
    any computation whose jaxpr has an effect, and the jaxpr of the computation
    jaxcomm.jit dispatches has none (jaxcomm's effect is inside an ordered call)."""
    step = jaxcomm.jit(lambda x: comm.allreduce(x) * 2)
    x = jnp.ones(3)
    assert jax.make_jaxpr(lambda x: comm.allreduce(x) * 2)(x).effects
    marker = _jax_internals.chain_marker()
    assert not jax.make_jaxpr(step.dispatched)(marker, x).effects
    assert_values(step(x), np.full(3, 2.0 * comm.size, FLOAT))


def test_mixed_program(comm):
    """Eager calls, jax.jit and jaxcomm.jit in turn, each step under each, with
    loops, branches, a checkpoint and a send no output depends on: the values say
    every message went where program order sends it."""
    if comm.size == 1:
        pytest.skip("a blocking send needs a peer")
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def ring(x):  # rank r ends with what rank r - 2 had
        return jax.lax.fori_loop(0, 2, lambda i, v: comm.sendrecv(v, source=left, dest=right), x)

    def add_total(x):  # x + the sum over ranks
        total, _ = jax.lax.scan(lambda c, _: (comm.allreduce(c), None), x, None, length=1)
        return x + jax.lax.cond(x.sum() > -1, lambda v: comm.bcast(v, root=0), lambda v: v, total)

    def shift_plus_100(x):  # what rank r - 2 had, plus 100
        comm.send(x + 100, dest=right, tag=7)  # no output depends on the send
        received = comm.recv(jnp.zeros_like(x), source=left, tag=7)
        return jax.checkpoint(lambda v: comm.sendrecv(v, source=left, dest=right))(received)

    def simulated(step, values):
        if step is add_total:
            return values + values.sum()
        return np.roll(values, 2) + (100 if step is shift_plus_100 else 0)

    steps = [ring, add_total, shift_plus_100]
    values = np.array([r * r + 1.0 for r in range(comm.size)])
    x = jnp.full(2, values[comm.rank])
    for i in range(3 * len(steps)):
        step, kind = steps[i % len(steps)], KINDS[(i + i // len(steps)) % len(KINDS)]
        x = as_kind(kind, step)(x)
        values = simulated(step, values)
        assert_values(x, np.full(2, values[comm.rank], FLOAT))


@pytest.mark.parametrize("first", list(JITS))  # only a jitted call can still run
@pytest.mark.parametrize("second", KINDS)
def test_next_call_waits_for_a_running_call(comm, first, second):
    """A call must not overtake one dispatched before it that is still running,
    for every kind of call after every kind of jitted call
    (test_ordering.assert_not_overtaken)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    assert_not_overtaken(comm, JITS[first], partial(as_kind, second), rounds=3)


def test_non_blocking_operations(comm):
    """Receives posted and waited in jaxcomm.jit calls on rank 0, from sends of
    every kind (an isend and its wait in jaxcomm.jit among them)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    receive = jaxcomm.jit(lambda x: comm.wait(comm.irecv(x, source=MPI.ANY_SOURCE, tag=3)))

    def send(x):
        comm.wait(comm.isend(x, dest=0, tag=3))

    if comm.rank == 0:
        got = sorted(float(receive(jnp.zeros(2))[0]) for _ in range(comm.size - 1))
        assert got == [float(r) for r in range(1, comm.size)]
    else:
        as_kind(KINDS[comm.rank % len(KINDS)], send)(jnp.full(2, float(comm.rank)))
    comm.barrier()


def test_options_and_transformations(comm):
    """jax.jit's options pass through (shifted past the marker); under grad and
    vmap, and inside another jit, jaxcomm.jit is jax.jit."""

    def scaled_sum(x, scale, *, extra=0.0):
        return comm.allreduce(x * scale) + extra

    fast = jaxcomm.jit(scaled_sum, static_argnums=1, donate_argnums=0)
    assert_values(fast(jnp.ones(2), 3.0, extra=1.0), np.full(2, 3.0 * comm.size + 1, FLOAT))
    named = jaxcomm.jit(scaled_sum, static_argnames="scale")
    assert_values(named(jnp.ones(2), scale=2.0), np.full(2, 2.0 * comm.size, FLOAT))
    grads = [
        jax.grad(lambda x, j=j: j(scaled_sum)(x, 2.0).sum())(jnp.ones(2)) for j in JITS.values()
    ]
    assert_values(grads[1], np.asarray(grads[0]))  # replicated: 2 (docs/autodiff.md)
    assert_values(grads[1], np.full(2, 2.0, FLOAT))
    batched = jax.vmap(jaxcomm.jit(lambda x: comm.allreduce(x)))(jnp.ones((3, 2)))
    assert_values(batched, np.full((3, 2), float(comm.size), FLOAT))
    inner = jaxcomm.jit(lambda x: comm.allreduce(x))
    assert_values(jax.jit(lambda x: inner(x) + inner(x))(jnp.ones(2)), np.full(2, 2.0 * comm.size))


def test_function_without_communication_or_outputs(comm):
    """An ordered call with nothing of jaxcomm in it, and one that only sends."""
    assert_values(jaxcomm.jit(lambda x: x + 1)(jnp.zeros(2)), np.ones(2, FLOAT))
    if comm.size == 1:
        pytest.skip("a blocking send needs a peer")
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    @jaxcomm.jit
    def send(x):  # no results
        comm.send(x, dest=right, tag=9)

    if comm.rank % 2 == 0:
        send(jnp.full(2, float(comm.rank)))
    received = comm.recv(jnp.zeros(2), source=left, tag=9)
    if comm.rank % 2 == 1:
        send(jnp.full(2, float(comm.rank)))
    assert_values(received, np.full(2, float(left), FLOAT))
    comm.barrier()


def test_top_level_check_agrees_with_jax(comm):
    """jaxcomm.jit and eager calls read JAX's trace state directly on every call
    (_jax_internals.at_top_level); JAX's own answer must be the same, at top level
    and under each transformation, or calls would take the wrong path."""
    from jax._src import core as jax_core

    answers = []

    def probe(x):
        answers.append((_jax_internals.at_top_level(), jax_core.trace_ctx.is_top_level()))
        return comm.allreduce(x)

    x = jnp.ones(2)
    probe(x)
    jax.jit(probe)(x)
    jax.grad(lambda v: probe(v).sum())(x)
    jax.vmap(probe)(jnp.ones((3, 2)))
    jax.vmap(probe, axis_name="batch")(jnp.ones((3, 2)))
    jax.eval_shape(probe, x)
    jax.lax.cond(x.sum() > 0, lambda v: probe(v), lambda v: probe(v) + 1, x)
    assert [ours for ours, _ in answers] == [jaxs for _, jaxs in answers]
    assert answers[0] == (True, True)
    assert len(answers) >= 7 and not any(ours for ours, _ in answers[1:])


def test_under_disable_jit_the_function_runs_as_python(comm):
    """Like jax.jit: values, not tracers, reach the function's Python."""
    seen = []

    @jaxcomm.jit
    def step(x):
        seen.append(type(x))
        return comm.allreduce(x) + 1

    with jax.disable_jit():
        assert_values(step(jnp.ones(2)), np.full(2, comm.size + 1.0, FLOAT))
    assert not issubclass(seen[0], jax.core.Tracer)
    assert_values(step(jnp.ones(2)), np.full(2, comm.size + 1.0, FLOAT))  # and jitted after


def test_errors_name_the_users_function(comm):
    """A request cannot leave the function that posted it: JAX's error names that
    function, as under jax.jit, not jaxcomm's wrapper."""

    @jaxcomm.jit
    def post(x):
        return comm.iallreduce(x)

    with pytest.raises(TypeError, match=r"function post at .*test_ordered_jit.py:\d+ traced"):
        post(jnp.ones(2))
