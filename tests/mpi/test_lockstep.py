"""After a run-time error on one rank, each later jaxcomm call on that rank runs
paired with the same call on its peers, or raises: never a value paired with
another call (docs/troubleshooting.md, "After an error").

Generated: sequences of calls, eager, under jax.jit and under jaxcomm.jit, run
synchronously or, with a matrix product beside them, asynchronously, their
results read at once or only at the end, with one or two operations each. At
one position rank 0's call fails: an alltoallv that overflows its capacity
there only (the other ranks' fits). Each allreduce sums values that name it,
so a value paired with another call shows. The peers never fail; once rank 0
has made its calls, it makes with mpi4py those its peers still wait for, and
goes back in step for the next example.

Hypothesis is derandomised and does not shrink, so every rank draws the same
sequences. JAXCOMM_LOCKSTEP_EXAMPLES sets how many.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax._src import dispatch
from jax.experimental import io_callback
from mpi4py import MPI

import jaxcomm
from jaxcomm import _native

FAILING = 0  # the rank whose call fails
WORK = 256  # a matrix product of this size beside a call: XLA runs it asynchronously
EXAMPLES = int(os.environ.get("JAXCOMM_LOCKSTEP_EXAMPLES", "12"))
MODES = ("eager", "jax.jit", "jaxcomm.jit")


@dataclasses.dataclass(frozen=True)
class Step:
    """One call of a sequence, the same on every rank."""

    mode: str  # eager, jax.jit or jaxcomm.jit
    work: bool  # a matrix product beside it (asynchronous under jit)
    read: bool  # its results read at once, else after the last call
    twice: bool  # two operations: an allreduce after the first


def value(position: int, op: int) -> float:
    """What an operation of a sequence sums over ranks, times (rank + 1)."""
    return float(10 * position + op + 1)


def allreduce_input(comm, position: int, op: int) -> jax.Array:
    return jnp.full(2, value(position, op) * (comm.rank + 1), jnp.float32)


@functools.cache
def computation(comm, mode: str, position: int, failing: bool, work: bool, twice: bool):
    """The call at `position`: f(m) -> its results (the matrix product's last),
    compiled once for every example that has it."""
    size = comm.size
    capacity = size - 1 if failing and comm.rank == FAILING else size

    def step(m):
        if failing:  # overflows capacity on the failing rank only
            x = jnp.ones((size, 2), jnp.float32)
            first, _ = comm.alltoallv(x, [1] * size, capacity=capacity)
        else:
            first = comm.allreduce(allreduce_input(comm, position, 0))
        results = [first]
        if twice:
            results.append(comm.allreduce(allreduce_input(comm, position, 1)))
        if work:
            results.append((m @ m @ m).sum())
        return results

    return {"eager": step, "jax.jit": jax.jit(step), "jaxcomm.jit": jaxcomm.jit(step)}[mode]


def expected(comm, position: int, failing: bool, twice: bool) -> list[np.ndarray]:
    ranks = comm.size * (comm.size + 1) // 2
    first = (
        np.ones((comm.size, 2), np.float32)
        if failing
        else np.full(2, value(position, 0) * ranks, np.float32)
    )
    return [first, np.full(2, value(position, 1) * ranks, np.float32)][: 1 + twice]


def operations(steps: list[Step]) -> list[tuple[int, int]]:
    """(position, op) of every operation the peers make, in order."""
    return [(p, op) for p, step in enumerate(steps) for op in range(1 + step.twice)]


def run_sequence(comm, steps: list[Step], fail_at: int) -> None:
    made = _native.cpu.call_count()
    # Ready before the first call: a computation whose input is still being made
    # runs after its call has returned, and then even a step without work fails
    # asynchronously.
    work = jax.block_until_ready(jnp.ones((WORK, WORK), jnp.float32))
    outcomes: list = [None] * len(steps)
    for p, step in enumerate(steps):
        fn = computation(comm, step.mode, p, p == fail_at, step.work, step.twice)
        try:
            outcomes[p] = fn(work)
            if step.read:
                outcomes[p] = jax.block_until_ready(outcomes[p])
        except jax.errors.JaxRuntimeError as error:
            outcomes[p] = error
    for p, outcome in enumerate(outcomes):
        if not isinstance(outcome, Exception):
            try:
                outcomes[p] = jax.block_until_ready(outcome)
            except jax.errors.JaxRuntimeError as error:
                outcomes[p] = error
    made = _native.cpu.call_count() - made
    if comm.rank == FAILING:
        catch_up(comm, operations(steps)[made:], fail_at)
    for p, (step, outcome) in enumerate(zip(steps, outcomes, strict=True)):
        failing = p == fail_at
        where = f"rank {comm.rank}, call {p} of {steps} failing at {fail_at}"
        if isinstance(outcome, Exception):
            # Only the failing rank raises: at the failing call, and after it.
            assert comm.rank == FAILING and p >= fail_at, f"{where}: {outcome}"
            if failing:
                assert "more than capacity=" in str(outcome), f"{where}: {outcome}"
            continue
        assert not (failing and comm.rank == FAILING), f"{where}: no error"
        for got, want in zip(outcome, expected(comm, p, failing, step.twice), strict=False):
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=where)


def catch_up(comm, missed: list[tuple[int, int]], fail_at: int) -> None:
    """On the failing rank, after its calls: the allreduces that its peers make
    and it did not (it stopped), through mpi4py; then back in step."""
    for position, op in missed:
        assert (position, op) != (fail_at, 0), "the failing operation did not run"
        mine = np.asarray(allreduce_input(comm, position, op))
        comm.mpi.Allreduce(mine, np.empty_like(mine))
    forget_failures()


def forget_failures() -> None:
    """Back in step, JAX's tokens of failed computations forgotten: the test
    has made the calls that the peers waited for."""
    with contextlib.suppress(Exception):  # JAX 0.12 raises a group of them
        jax.effects_barrier()
    dispatch.runtime_tokens.clear()
    _native.cpu.resume()


SETTINGS = settings(
    derandomize=True,  # the same sequences on every rank
    database=None,
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: one failing example, everywhere
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)

steps = st.builds(Step, st.sampled_from(MODES), st.booleans(), st.booleans(), st.booleans())


@SETTINGS
@given(sequence=st.lists(steps, min_size=2, max_size=4), data=st.data())
def test_a_rank_that_failed_stays_paired_or_raises(comm, sequence, data):
    fail_at = data.draw(st.integers(0, len(sequence) - 1), label="fail_at")
    run_sequence(comm, sequence, fail_at)
    check_in_step(comm)


@pytest.mark.parametrize("mode", MODES)
def test_a_call_dispatched_before_the_error_is_read(comm, mode):
    """Rank 0's step fails after its call returned; another step was dispatched
    before rank 0 read the error: that step never runs there, and rank 0's next
    call raises instead of pairing with it."""
    failing = Step("jaxcomm.jit" if mode == "eager" else mode, True, False, False)
    after = [Step(mode, False, False, False), Step("eager", False, True, False)]
    run_sequence(comm, [failing, *after], 0)
    check_in_step(comm)


@pytest.mark.parametrize("mode", MODES)
def test_a_synchronous_failure_needs_no_ceremony(comm, mode):
    """A step whose one operation fails inside its call leaves every rank in step."""
    run_sequence(comm, [Step(mode, False, True, False), Step(mode, False, True, False)], 0)
    assert _native.cpu.out_of_step() is None


def check_in_step(comm) -> None:
    x = jnp.full(2, comm.rank + 1.0, jnp.float32)
    want = comm.size * (comm.size + 1) / 2
    np.testing.assert_array_equal(comm.allreduce(x), np.full(2, want, np.float32))
    np.testing.assert_array_equal(jax.jit(comm.allreduce)(x), np.full(2, want, np.float32))
    np.testing.assert_array_equal(jaxcomm.jit(comm.allreduce)(x), np.full(2, want, np.float32))


def test_out_of_step_refuses_every_later_call(comm):
    """Out of step, a rank refuses eager calls, jitted ones and posts alike, with
    an error that says why; its peers wait for nothing it refused here. The
    error names what it refused: the operation, or the call of a jaxcomm.jit
    function by that function's name, never a function as an operation."""

    def step(y):
        return comm.allreduce(y) * 2

    class Step:
        def __call__(self, y):
            return comm.allreduce(y)

    _native.cpu.diverge("a test said so")
    x = jnp.ones(2, jnp.float32)
    # Each call, and what its error names.
    calls = {
        "eager": (lambda: comm.allreduce(x), "allreduce"),
        "jax.jit": (lambda: jax.jit(comm.allreduce)(x), "allreduce"),
        "jax.jit of a function": (lambda: jax.jit(step)(x), "allreduce"),
        "jaxcomm.jit": (
            lambda: jaxcomm.jit(comm.allreduce)(x),
            "the call of jaxcomm.jit function 'allreduce'",
        ),
        "jaxcomm.jit of a function": (
            lambda: jaxcomm.jit(step)(x),
            "the call of jaxcomm.jit function 'step'",
        ),
        "jaxcomm.jit of a lambda": (
            lambda: jaxcomm.jit(lambda y: comm.allreduce(y))(x),
            "the call of jaxcomm.jit function '<lambda>'",
        ),
        "jaxcomm.jit of a partial": (
            lambda: jaxcomm.jit(functools.partial(comm.allreduce, op=MPI.MAX))(x),
            "the call of jaxcomm.jit function 'allreduce'",
        ),
        "jaxcomm.jit of a callable object": (
            lambda: jaxcomm.jit(Step())(x),
            "the call of jaxcomm.jit function 'Step'",
        ),
        "jaxcomm.jit inside jax.jit": (lambda: jax.jit(jaxcomm.jit(step))(x), "allreduce"),
        "post": (lambda: comm.iallreduce(x), "iallreduce"),
        "barrier": (lambda: comm.barrier(), "barrier"),
    }
    try:
        for how, (call, what) in calls.items():
            with pytest.raises(jax.errors.JaxRuntimeError) as refused:
                jax.block_until_ready(call())
            assert str(refused.value) == (
                f"FAILED_PRECONDITION: jaxcomm: {what} refused: rank {MPI.COMM_WORLD.rank} is "
                "out of step with its peers: a test said so. Its peers may be waiting in a call "
                "that it skipped, so it makes no more calls, rather than pair one with the "
                "wrong call of a peer. End the job (an uncaught exception ends it under "
                "`python -m mpi4py`)."
            ), how
    finally:
        forget_failures()
    check_in_step(comm)


def test_a_receive_left_by_a_failed_computation_puts_the_rank_out_of_step(comm):
    """Rank 0's computation posts a receive, then fails before its wait: the
    receive is cancelled, and a message sent for it later would go to a later
    receive, so rank 0 is out of step. The cancel holds: a later receive takes
    the message whole."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    capacity = comm.size - 1 if comm.rank == FAILING else comm.size

    @jax.jit
    def step(x):
        if comm.rank == FAILING:
            request = comm.irecv(jnp.zeros(2, jnp.float32), source=1, tag=5)
        y, _ = comm.alltoallv(x, [1] * comm.size, capacity=capacity)
        return comm.wait(request) if comm.rank == FAILING else y

    if comm.rank == FAILING:
        with pytest.raises(jax.errors.JaxRuntimeError, match="more than capacity="):
            jax.block_until_ready(step(jnp.ones((comm.size, 2), jnp.float32)))
        assert "irecv was cancelled before its message came" in _native.cpu.out_of_step()
    else:
        jax.block_until_ready(step(jnp.ones((comm.size, 2), jnp.float32)))
    comm.mpi.Barrier()  # the message leaves after the receive was cancelled
    if comm.rank == 1:
        comm.mpi.Send(np.full(2, 7.0, np.float32), dest=FAILING, tag=5)
    if comm.rank == FAILING:
        forget_failures()
        got = comm.recv(jnp.zeros(2, jnp.float32), source=1, tag=5)
        np.testing.assert_array_equal(got, np.full(2, 7.0, np.float32))
    check_in_step(comm)


def test_a_failure_leaves_another_threads_requests_alone(comm):
    """A computation that fails abandons the requests it posted, not those of a
    computation that another thread runs meanwhile, which completes."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    p2p, collective = comm.dup(), comm.dup()
    x = jnp.ones((comm.size, 2), jnp.float32)
    capacity = comm.size - 1 if comm.rank == FAILING else comm.size
    overflowing = jax.jit(lambda x: comm.alltoallv(x, [1] * comm.size, capacity=capacity)[0])

    def worker(out):
        if comm.rank == FAILING:

            def receiving(v):  # the receive stays posted while the allreduce waits
                request = p2p.irecv(jnp.zeros((), jnp.float32), source=1, tag=9)
                total = collective.allreduce(v)
                return p2p.wait(request) + 0 * total

            out.append(jax.jit(receiving)(jnp.float32(1)))
        elif comm.rank == 1:

            def sending(v):
                total = collective.allreduce(v)
                p2p.send(jnp.float32(7.0), dest=FAILING, tag=9)
                return total

            out.append(jax.jit(sending)(jnp.float32(1)))
        else:
            out.append(jax.jit(collective.allreduce)(jnp.float32(1)))

    results: list = []
    thread = threading.Thread(target=worker, args=(results,))
    if comm.rank == FAILING:
        started = _native.cpu.call_count()
        thread.start()
        while _native.cpu.call_count() < started + 2:  # the receive posted, the allreduce entered
            time.sleep(0.001)
        with pytest.raises(jax.errors.JaxRuntimeError, match="more than capacity="):
            jax.block_until_ready(overflowing(x))
    else:
        jax.block_until_ready(overflowing(x))
        thread.start()
    thread.join()
    if comm.rank == FAILING:
        np.testing.assert_array_equal(results[0], np.float32(7.0))
    assert _native.cpu.out_of_step() is None
    p2p.free()
    collective.free()
    check_in_step(comm)


# -- a failure that jaxcomm does not see ------------------------------------------------


def raising_on(rank: int):
    """An ordered host callback that returns its argument, and raises on `rank`."""

    def callback(a):
        if rank == MPI_RANK:
            raise RuntimeError(f"the callback fails on rank {rank}")
        return np.asarray(a)

    return lambda a: io_callback(callback, jax.ShapeDtypeStruct(a.shape, a.dtype), a, ordered=True)


MPI_RANK = MPI.COMM_WORLD.rank
JITS = {"jax.jit": jax.jit, "jaxcomm.jit": jaxcomm.jit}
NEXT_CALLS = {
    "eager": lambda comm, x: comm.allreduce(x),
    "jax.jit": lambda comm, x: jax.jit(comm.allreduce)(x),
    "jaxcomm.jit": lambda comm, x: jaxcomm.jit(comm.allreduce)(x),
}


def stopped_steps(comm):
    """name -> (step, the inputs of the allreduces that rank FAILING still owes
    its peers when it stops, as functions of x and of the sum of x over the
    ranks, in order; the factor of that sum in its result): a step whose
    computation stops on rank FAILING in a host callback, before an allreduce
    that its peers make, with its calls in the jitted function itself, in a
    loop, a conditional or a nested jit, or before and after one."""
    fail = raising_on(FAILING)
    first, then_total = (lambda x, total: x), (lambda x, total: jnp.full_like(x, total))
    thousand = lambda x, total: jnp.full_like(x, total * 1000)  # noqa: E731
    nested = jax.jit(lambda v: fail(comm.allreduce(v)))

    fori = lambda body, x: jax.lax.fori_loop(0, 2, lambda _, c: body(c), x)  # noqa: E731
    scan = lambda body, x: jax.lax.scan(lambda c, _: (body(c), None), x, length=2)[0]  # noqa: E731

    def while_loop(body, x, times=2):
        counted = lambda s: (s[0] + 1, body(s[1]))  # noqa: E731
        return jax.lax.while_loop(lambda s: s[0] < times, counted, (0, x))[1]

    def cond(body, x):
        return jax.lax.cond(x.sum() > 0, body, lambda v: -v, x)

    return {
        # The reproduction.
        "straight": (
            lambda x: comm.allreduce(fail(comm.allreduce(x)) * 1000),
            [thousand],
            1000,
        ),
        # Two iterations: the first one stops after its call.
        "fori_loop": (lambda x: fori(lambda c: fail(comm.allreduce(c)), x), [then_total], 1),
        "scan": (lambda x: scan(lambda c: fail(comm.allreduce(c)), x), [then_total], 1),
        "while_loop": (
            lambda x: while_loop(lambda c: fail(comm.allreduce(c)), x),
            [then_total],
            1,
        ),
        # Two iterations: the first one stops before its call.
        "fori_loop, before its call": (
            lambda x: fori(lambda c: comm.allreduce(fail(c)), x),
            [first, then_total],
            1,
        ),
        "cond": (
            lambda x: cond(lambda v: comm.allreduce(fail(comm.allreduce(v))), x),
            [then_total],
            1,
        ),
        "cond, then a call": (
            lambda x: comm.allreduce(cond(lambda v: fail(comm.allreduce(v)), x)),
            [then_total],
            1,
        ),
        # Stopped between the loop and the call after it.
        "loop, then a call": (
            lambda x: comm.allreduce(fail(while_loop(comm.allreduce, x, times=1)) * 1000),
            [thousand],
            1000,
        ),
        "nested jit, then a call": (
            lambda x: comm.allreduce(nested(x) * 1000),
            [thousand],
            1000,
        ),
    }


# Wherever its calls lie, jaxcomm sees where a computation's calls end (the docs'
# "What jaxcomm sees"), under both.
STOPPED = [
    (jit, steps, then) for jit in JITS for steps in stopped_steps(None) for then in NEXT_CALLS
]


@pytest.mark.parametrize(("jit", "steps", "then"), STOPPED)
def test_a_computation_stopped_after_a_call_puts_the_rank_out_of_step(comm, jit, steps, then):
    """Rank FAILING's step stops after its first allreduce (a host callback
    raises there); the peers make the second and then the next call. On rank
    FAILING the next call raises, whatever runs it, instead of pairing with the
    peers' second allreduce; its peers' calls pair with the ones it then makes
    with mpi4py. On one rank nothing is owed: no peer waits."""
    step, inputs, scale = stopped_steps(comm)[steps]
    x = jnp.full(2, comm.rank + 1.0, jnp.float32)
    total = float(comm.size * (comm.size + 1) // 2)
    following = jnp.full(2, 10.0 * (comm.rank + 1), jnp.float32)
    if comm.size == 1:  # no peer waits for anything: the rank stays in step
        with pytest.raises(jax.errors.JaxRuntimeError, match="the callback fails"):
            jax.block_until_ready(JITS[jit](step)(x))
        np.testing.assert_array_equal(NEXT_CALLS[then](comm, following), following)
        assert _native.cpu.out_of_step() is None
    elif comm.rank == FAILING:
        with pytest.raises(jax.errors.JaxRuntimeError, match="the callback fails"):
            jax.block_until_ready(JITS[jit](step)(x))
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"refused: rank .* out of step"):
            jax.block_until_ready(NEXT_CALLS[then](comm, following))
        stopped = "allreduce" if steps == "straight" else "entry into a loop, conditional"
        assert f"a computation stopped after its {stopped}" in _native.cpu.out_of_step()
        for later in inputs:  # the calls the peers make
            mine = np.asarray(later(x, total), np.float32)
            comm.mpi.Allreduce(mine, np.empty_like(mine))
        comm.mpi.Allreduce(np.asarray(following), np.empty(2, np.float32))
        forget_failures()
    else:
        got = jax.block_until_ready(JITS[jit](step)(x))
        np.testing.assert_array_equal(got, np.full(2, total * comm.size * scale, np.float32))
        got = NEXT_CALLS[then](comm, following)
        np.testing.assert_array_equal(got, np.full(2, 10.0 * total, np.float32))
    check_in_step(comm)


# Operations whose result is x on some ranks: bcast's root, reduce's and
# gather's other ranks. Root 0: the ranks whose result is x are `rooted` ones.
KEEPS_X = {
    "bcast": (lambda comm, x: comm.bcast(x, root=0), lambda rank: rank == 0),
    "reduce": (lambda comm, x: comm.reduce(x, root=0), lambda rank: rank != 0),
    "gather": (lambda comm, x: comm.gather(x, root=0)[0], lambda rank: rank != 0),
}


# Each way to make a communicator from another: MPI's collective inside it (the
# new context id's allreduce, MPI_Comm_split's exchange) would pair with an
# operation that the peers wait in.
MAKE_COMMS = {
    "dup": lambda comm: comm.dup(),
    "JaxComm": lambda comm: jaxcomm.JaxComm(comm),
    "split": lambda comm: comm.split(0),
    "create_cart": lambda comm: comm.create_cart([comm.size]),
    "create_dist_graph": lambda comm: comm.create_dist_graph([], []),
}


@pytest.mark.parametrize("make", MAKE_COMMS)
def test_a_rank_out_of_step_makes_no_communicator(comm, make):
    """Rank FAILING's step stops after its first allreduce; making a
    communicator from `comm` then raises there, once it owes the second
    allreduce and again once out of step, instead of pairing MPI's collective
    inside with the peers' second allreduce. On one rank nothing is owed."""
    step, inputs, scale = stopped_steps(comm)["straight"]
    x = jnp.full(2, comm.rank + 1.0, jnp.float32)
    total = float(comm.size * (comm.size + 1) // 2)
    if comm.size > 1 and comm.rank == FAILING:
        with pytest.raises(jax.errors.JaxRuntimeError, match="the callback fails"):
            jax.block_until_ready(jax.jit(step)(x))
        for _ in range(2):
            with pytest.raises(
                jax.errors.JaxRuntimeError, match=rf"{make} refused: rank .* out of step"
            ):
                MAKE_COMMS[make](comm)
        for later in inputs:  # the calls the peers make
            mine = np.asarray(later(x, total), np.float32)
            comm.mpi.Allreduce(mine, np.empty_like(mine))
        forget_failures()
    elif comm.size > 1:
        got = jax.block_until_ready(jax.jit(step)(x))
        np.testing.assert_array_equal(got, np.full(2, total * comm.size * scale, np.float32))
    else:
        with pytest.raises(jax.errors.JaxRuntimeError, match="the callback fails"):
            jax.block_until_ready(jax.jit(step)(x))
    made = MAKE_COMMS[make](comm)  # in step again: made alike on every rank
    check_in_step(made)
    made.free()


def after_keeping_x(comm, name: str, callback):
    """A step: an allreduce, then `name`, whose result a host callback reads, then
    an allreduce of what the callback returns."""
    operation = KEEPS_X[name][0]

    def step(x):
        first = comm.allreduce(x)
        kept = operation(comm, x)
        like = jax.ShapeDtypeStruct(kept.shape, kept.dtype)
        return comm.allreduce(first + jax.pure_callback(callback, like, kept))

    return step


def late_unless_x(comm, name: str) -> None:
    """The ranks whose result is not x come late to the step: the others' first
    allreduce waits for them, and anything that does not wait for the call
    keeping x runs meanwhile."""
    if not KEEPS_X[name][1](comm.rank):
        time.sleep(0.3)


@pytest.mark.parametrize("name", KEEPS_X)
@pytest.mark.parametrize("jit", JITS)
def test_a_result_that_is_x_is_read_after_its_call(comm, jit, name):
    """Where an operation's result is x, what reads it still runs after the
    operation, as on the ranks where the result comes from the message: a host
    callback that reads it sees both calls started."""
    started = _native.cpu.call_count()
    seen = []

    def callback(kept):
        seen.append(_native.cpu.call_count() - started)
        return np.zeros_like(kept)

    x = jnp.full(2, comm.rank + 1.0, jnp.float32)
    late_unless_x(comm, name)
    got = jax.block_until_ready(JITS[jit](after_keeping_x(comm, name, callback))(x))
    total = comm.size * (comm.size + 1) / 2
    np.testing.assert_array_equal(got, np.full(2, comm.size * total, np.float32))
    assert seen == [2], f"the callback ran after {seen} of the step's calls had started, not 2"
    check_in_step(comm)


@pytest.mark.parametrize("name", KEEPS_X)
@pytest.mark.parametrize("jit", JITS)
def test_a_failure_after_a_result_that_is_x_puts_every_rank_out_of_step(comm, jit, name):
    """Every rank's step stops in a host callback that reads a result that is x
    on some ranks: each has made the same calls (the first allreduce and the
    operation), so each refuses its next call, none waits for a peer, and none
    pairs its next call with a peer's call of the step. On one rank nothing is
    owed."""

    def callback(kept):
        raise RuntimeError("the callback fails on every rank")

    x = jnp.full(2, comm.rank + 1.0, jnp.float32)
    late_unless_x(comm, name)
    with pytest.raises(jax.errors.JaxRuntimeError, match="the callback fails on every rank"):
        jax.block_until_ready(JITS[jit](after_keeping_x(comm, name, callback))(x))
    try:
        if comm.size == 1:
            np.testing.assert_array_equal(comm.allreduce(x), x)
        else:
            with pytest.raises(jax.errors.JaxRuntimeError, match=r"refused: rank .* out of step"):
                jax.block_until_ready(comm.allreduce(x))
    finally:
        forget_failures()
    check_in_step(comm)


def ends_normally(comm):
    """name -> a step whose jaxcomm calls lie where jaxcomm sees, or does not
    see, where they end: it always ends normally."""
    nested = jax.jit(lambda v: comm.allreduce(v) * 0.5)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def posted(x):
        received = comm.irecv(x, source=left, tag=3)
        sent = comm.isend(x, dest=right, tag=3)
        comm.wait(sent)
        return comm.wait(received) + comm.allreduce(x)

    return {
        "straight": lambda x: comm.allreduce(comm.allreduce(x) + 1),
        "posted": posted,
        "fori_loop": lambda x: jax.lax.fori_loop(0, 3, lambda _, c: comm.allreduce(c) / 2, x),
        "while_loop": lambda x: jax.lax.while_loop(
            lambda s: s[0] < 3, lambda s: (s[0] + 1, comm.allreduce(s[1]) / 2), (0, x)
        )[1],
        "cond": lambda x: jax.lax.cond(x.sum() > 0, comm.allreduce, lambda v: -v, x),
        "nested_jit": lambda x: nested(nested(x)),
        "checkpoint": lambda x: jax.checkpoint(comm.allreduce)(x),
        "loop_then_call": lambda x: comm.allreduce(
            jax.lax.fori_loop(0, 2, lambda _, c: comm.allreduce(c) / 2, x)
        ),
    }


@pytest.mark.parametrize("jit", JITS)
def test_computations_that_end_normally_leave_the_rank_in_step(comm, jit):
    """No computation that ran to its end is taken for one that stopped: every
    later call runs, whatever runs it."""
    x = jnp.full(2, comm.rank + 1.0, jnp.float32)
    for name, step in ends_normally(comm).items():
        for _ in range(2):
            jax.block_until_ready(JITS[jit](step)(x))
            assert _native.cpu.out_of_step() is None, name
            check_in_step(comm)


def owing_in_order(text: str) -> list[tuple[str, int]]:
    """(target, owing) of each jaxcomm custom call of the entry function of a
    lowered program's text, in order, but those in its ops' regions (a loop's
    body, which some JAX releases lower in place)."""
    main = text[text.index("func.func public @main") :]
    main = main[: main.index("\n  }\n")]
    top = "\n".join(line for line in main.splitlines() if re.match(r"    %", line))
    return [
        (target, int(owing))
        for target, owing in re.findall(
            r"custom_call @jaxcomm_(\w+)\(.*?mhlo\.backend_config = \{[^}]*owing = (\d+)", top
        )
    ]


def test_a_loop_that_a_call_follows_still_owes_it(comm):
    """Where a call that peers wait for follows a loop, the call that settles
    after the loop owes it instead, in the program that runs (jaxcomm sets that
    when it emits the later call): a host callback that XLA runs after that
    call and before the later one stops a computation that still owes. Which
    of the two runs first is XLA's choice, so a stop there cannot show it
    reliably; the lowered program does. On one rank nothing is owed."""

    def step(x):
        looped = jax.lax.fori_loop(0, 2, lambda _, c: comm.allreduce(c) * 0.5, x)
        return comm.allreduce(looped)

    x = jnp.ones(2, jnp.float32)
    lowered = jax.jit(step).lower(x).as_text()
    owes, settles = (1, 2) if comm.size > 1 else (2, 2)
    # jaxcomm_entered always owes: inside the loop nothing says what is owed.
    want = [("entered", 1), ("settled", owes), ("allreduce", settles)]
    assert owing_in_order(lowered) == want, lowered
    np.testing.assert_array_equal(jax.jit(step)(x), np.full(2, comm.size**3 / 4, np.float32))
    check_in_step(comm)
