"""Non-blocking operations: values, ordering with blocking calls, control flow,
vmap and misuse. Their derivatives are checked with the others' in test_autodiff."""

import gc
import inspect
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import FLOAT, assert_values, expected_collective, rank_data
from mpi4py import MPI

import jaxcomm
from jaxcomm import JaxComm, _nonblocking
from jaxcomm import comm as comm_module

MODES = ["eager", "jit"]


def run(mode, fn, *args):
    return (jax.jit(fn) if mode == "jit" else fn)(*args)


def inputs(comm, shape, dtype):
    return [rank_data(r, shape, dtype) for r in range(comm.size)]


#: name -> (post(comm, x), blocking name, input shape given size, params)
COLLECTIVES = {
    "iallreduce": (lambda c, x: c.iallreduce(x), "allreduce", lambda n: (3, 2)),
    "iallreduce_max": (lambda c, x: c.iallreduce(x, op=MPI.MAX), "allreduce", lambda n: (5,)),
    "ireduce_scatter": (lambda c, x: c.ireduce_scatter(x), "reduce_scatter", lambda n: (n, 3)),
    "ibcast": (lambda c, x: c.ibcast(x, root=c.size - 1), "bcast", lambda n: (4, 2)),
    "iallgather": (lambda c, x: c.iallgather(x), "allgather", lambda n: (3,)),
    "ialltoall": (lambda c, x: c.ialltoall(x), "alltoall", lambda n: (n, 2)),
}


@pytest.mark.parametrize("dtype", ["float32", "int16", "bfloat16", "complex64", "bool"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_values(comm, name, mode, dtype):
    post, _, shape = COLLECTIVES[name]
    if dtype == "bool" and name in ("iallreduce", "ireduce_scatter"):
        pytest.skip("SUM is not defined for bool")
    if dtype == "complex64" and name == "iallreduce_max":
        pytest.skip("MAX is not defined for complex")
    xs = inputs(comm, shape(comm.size), dtype)
    out = run(mode, lambda x: comm.wait(post(comm, x)), xs[comm.rank])
    assert_values(out, expected(comm, name, xs))


def expected(comm, name, xs):
    """What COLLECTIVES[name] gives on this rank when rank r passes xs[r]."""
    blocking = COLLECTIVES[name][1]
    kwargs = {"root": comm.size - 1} if blocking == "bcast" else {}
    if blocking in ("allreduce", "reduce_scatter"):
        kwargs["op"] = jaxcomm.ReduceOp.MAX if name.endswith("_max") else jaxcomm.ReduceOp.SUM
    return expected_collective(blocking, comm.rank, xs, **kwargs)


def test_logical_reduction_gives_zero_or_one(comm):
    x = jnp.full((3,), 4 + comm.rank, jnp.int32)
    out = jax.jit(lambda x: comm.wait(comm.iallreduce(x, op=MPI.LOR)))(x)
    assert_values(out, np.ones(3, np.int32))


@pytest.mark.parametrize("mode", MODES)
def test_ring_isend_irecv(comm, mode):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def shift(x):
        received = comm.irecv(x, source=left, tag=5, return_status=True)
        sent = comm.isend(x, dest=right, tag=5)
        assert comm.wait(sent) is None
        return comm.wait(received)

    out, status = run(mode, shift, rank_data(comm.rank, (2, 3), "float64"))
    assert_values(out, rank_data(left, (2, 3), "float64"))
    assert (int(status.source), int(status.tag)) == (left, 5)


@pytest.mark.parametrize("mode", MODES)
def test_nonblocking_matches_blocking_partner(comm, mode):
    """isend is received by recv, and send by irecv, on both sides of a ring."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def exchange(x):
        received = comm.irecv(x, source=left, tag=1)
        comm.send(x, dest=right, tag=1)
        first = comm.wait(received)
        sent = comm.isend(2 * x, dest=right, tag=2)
        second = comm.recv(x, source=left, tag=2)
        comm.wait(sent)
        return first + second

    out = run(mode, exchange, rank_data(comm.rank, (4,), "float32"))
    assert_values(out, 3 * rank_data(left, (4,), "float32"))


def test_proc_null_partners(comm):
    def edge(x):
        received = comm.irecv(x, source=MPI.PROC_NULL)
        comm.wait(comm.isend(x, dest=MPI.PROC_NULL))
        return comm.wait(received)

    assert_values(jax.jit(edge)(jnp.ones(3)), np.zeros(3, FLOAT))


@pytest.mark.parametrize("mode", MODES)
def test_several_in_flight_waited_in_any_order(comm, mode):
    def many(x):
        sums = [comm.iallreduce(x * k) for k in range(1, 4)]
        gathered = comm.iallgather(x)
        total = sum(comm.wait(r) for r in reversed(sums))
        return total, comm.wait(gathered)

    xs = inputs(comm, (3,), "float32")
    total, gathered = run(mode, many, xs[comm.rank])
    assert_values(total, 6 * sum(xs))
    assert_values(gathered, np.stack(xs))


def test_pytrees_and_waitall(comm):
    tree = {"a": jnp.ones(3) * comm.rank, "b": (jnp.arange(4), jnp.zeros((2, 2)))}

    def both(tree):
        requests = [comm.iallreduce(tree), comm.ibcast(tree, root=0)]
        return comm.waitall(requests)

    total, root = jax.jit(both)(tree)
    n = comm.size
    assert_values(total["a"], np.full(3, n * (n - 1) / 2, FLOAT))
    assert_values(total["b"][0], n * np.arange(4))
    assert_values(root["a"], np.zeros(3, FLOAT))


@pytest.mark.parametrize("mode", MODES)
def test_small_leaves_of_a_pytree_travel_as_one_message(comm, mode):
    """As allreduce and bcast send them: the float32 leaves a and b together, n
    (int32) and big (128 KiB) alone."""
    r = comm.rank
    tree = {
        "a": jnp.arange(3.0) + r,
        "b": jnp.full((2, 2), 2.0 * r),
        "big": jnp.full(1 << 15, 3.0 * r),
        "n": jnp.arange(4) + r,
    }
    both = lambda t: comm.waitall([comm.iallreduce(t), comm.ibcast(t, root=0)])  # noqa: E731
    before = jaxcomm._native.cpu.call_count()
    total, root = run(mode, both, tree)
    assert jaxcomm._native.cpu.call_count() - before == 2 * 3 * 2  # 3 starts and waits each
    ranks = sum(range(comm.size))
    assert_values(total["a"], comm.size * np.arange(3, dtype=FLOAT) + ranks)
    assert_values(total["b"], np.full((2, 2), 2.0 * ranks, FLOAT))
    assert_values(total["big"], np.full(1 << 15, 3.0 * ranks, FLOAT))
    assert_values(total["n"], comm.size * np.arange(4, dtype=total["n"].dtype) + ranks)
    assert_values(root["a"], np.arange(3, dtype=FLOAT))  # rank 0's leaves
    assert_values(root["b"], np.zeros((2, 2), FLOAT))
    assert_values(root["big"], np.zeros(1 << 15, FLOAT))
    assert_values(root["n"], np.arange(4, dtype=root["n"].dtype))


def test_overlapping_computation_in_a_loop(comm):
    """Post, compute what does not depend on the message, wait: in every iteration."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def step(_, x):
        received = comm.irecv(x[:1], source=left)
        sent = comm.isend(x[-1:], dest=right)
        interior = jnp.sin(x) + 1
        comm.wait(sent)
        return interior.at[0].add(comm.wait(received)[0])

    def blocking_step(_, x):
        got = comm.sendrecv(x[-1:], x[:1], source=left, dest=right)
        return (jnp.sin(x) + 1).at[0].add(got[0])

    x = jnp.linspace(0, 1, 8) + comm.rank
    out = jax.jit(lambda x: jax.lax.fori_loop(0, 5, step, x))(x)
    expected = jax.jit(lambda x: jax.lax.fori_loop(0, 5, blocking_step, x))(x)
    np.testing.assert_array_equal(out, expected)


def test_in_both_branches_of_cond(comm):
    def branch(flag, x):
        return jax.lax.cond(
            flag,
            lambda x: comm.wait(comm.iallreduce(x)),
            lambda x: comm.wait(comm.iallreduce(-x)),
            x,
        )

    x = jnp.ones(2) * (comm.rank + 1)
    out = jax.jit(branch)(True, x), jax.jit(branch)(False, x)
    total = comm.size * (comm.size + 1) / 2
    assert_values(out[0], np.full(2, total, FLOAT))
    assert_values(out[1], np.full(2, -total, FLOAT))


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_vmap_is_one_message(comm, name):
    post, _, shape = COLLECTIVES[name]
    batch = [inputs(comm, shape(comm.size), "float32") for _ in range(3)]
    batch = [[x + 10 * b for x in xs] for b, xs in enumerate(batch)]
    stacked = jnp.stack([xs[comm.rank] for xs in batch])
    before = jaxcomm._native.cpu.call_count()
    out = jax.vmap(lambda x: comm.wait(post(comm, x)))(stacked)
    assert jaxcomm._native.cpu.call_count() - before == 2  # one start and one wait
    for b, xs in enumerate(batch):
        assert_values(out[b], expected(comm, name, xs))


def test_vmap_of_a_ring_shift(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def shift(x):
        received = comm.irecv(x, source=left, tag=2)
        comm.wait(comm.isend(x, dest=right, tag=2))
        return comm.wait(received)

    batch = np.stack([rank_data(comm.rank, (3,), "float32") + b for b in range(4)])
    out = jax.jit(jax.vmap(shift, in_axes=1, out_axes=1))(batch.T)
    assert_values(out.T, np.stack([rank_data(left, (3,), "float32") + b for b in range(4)]))


# -- polling ------------------------------------------------------------------------------


def poll_until_done(mode, comm, request):
    """comm.test until it says done: a Python loop, or inside jit a while_loop."""
    if mode == "eager":
        while not comm.test(request):
            pass
        return True
    return jax.lax.while_loop(lambda done: ~done, lambda _: comm.test(request), comm.test(request))


@pytest.mark.parametrize("mode", MODES)
def test_test_says_done_only_once_the_message_has_come(comm, mode):
    """A receive posted before any rank sends is not done; polled after the sends
    it becomes done, and the wait then gives the message and its status."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def shift(x):
        received = comm.irecv(x, source=left, tag=4, return_status=True)
        early = comm.test(received)
        comm.barrier()  # every rank has tested before any rank sends
        sent = comm.isend(2 * x, dest=right, tag=4)
        done = poll_until_done(mode, comm, received)
        comm.wait(sent)
        return early, done, *comm.wait(received)

    early, done, out, status = run(mode, shift, rank_data(comm.rank, (5,), "float32"))
    assert not bool(early) and bool(done)
    assert_values(out, 2 * rank_data(left, (5,), "float32"))
    assert (int(status.source), int(status.tag)) == (left, 4)


def test_test_changes_no_value_or_derivative(comm):
    def f(x, poll):
        request = comm.iallreduce(jnp.sin(x))
        if poll:
            comm.test(request)
        return jnp.sum(comm.wait(request) ** 2)  # the same cotangent on every rank

    polled, plain = partial(f, poll=True), partial(f, poll=False)
    xs = inputs(comm, (4,), "float32")
    x = xs[comm.rank]
    assert_values(jax.jit(polled)(x), np.sum(np.sum(np.sin(xs), axis=0) ** 2))
    for transform in (jax.grad, lambda g: jax.jit(jax.grad(g)), jax.jacfwd):
        np.testing.assert_array_equal(transform(polled)(x), transform(plain)(x))
    batch = jnp.stack([x, 2 * x])
    np.testing.assert_array_equal(jax.vmap(polled)(batch), jax.vmap(plain)(batch))


def test_test_after_the_wait_or_outside_its_trace_is_an_error(comm):
    with pytest.raises(TypeError, match="test: expected a jaxcomm Request"):
        comm.test(jnp.ones(2))
    request = comm.iallreduce(jnp.ones(2))
    with pytest.raises(ValueError, match=r"test: .*posted outside the traced function"):
        jax.jit(lambda: comm.test(request))()
    comm.wait(request)
    with pytest.raises(ValueError, match=r"test: .*already been waited"):
        comm.test(request)


def test_an_input_used_after_the_start_keeps_its_value(comm):
    """x is also used after the start: the wait's result and x are both right."""
    f = jax.jit(lambda x: comm.wait(comm.iallreduce(x)) + jnp.cos(x))
    x = np.arange(1000.0)
    hlo = f.lower(x).compile().as_text()
    assert "jaxcomm_iallreduce" in hlo and "jaxcomm_wait" in hlo
    assert_values(f(x), comm.size * x + np.cos(x))


# -- misuse -------------------------------------------------------------------------------


def test_waiting_twice_is_an_error(comm):
    request = comm.iallreduce(jnp.ones(2))
    comm.wait(request)
    with pytest.raises(ValueError, match="already been waited"):
        comm.wait(request)


def test_a_request_never_waited_is_refused_before_it_runs(comm):
    with pytest.raises(ValueError, match="never waited"):
        jax.jit(lambda x: (comm.iallreduce(x), x + 1)[1])(jnp.ones(2))
    comm.barrier()  # nothing was posted


def test_an_eager_request_dropped_unwaited_is_completed(comm):
    with pytest.warns(RuntimeWarning, match="never waited"):
        request = comm.iallreduce(jnp.ones(2))
        del request
        gc.collect()
    assert_values(comm.allreduce(jnp.ones(2)), np.full(2, comm.size, FLOAT))


def test_a_request_cannot_leave_its_jitted_function(comm):
    with pytest.raises(TypeError, match="Request"):
        jax.jit(lambda x: comm.iallreduce(x))(jnp.ones(2))
    comm.barrier()  # the traced start never ran


def test_a_request_cannot_cross_into_another_trace(comm):
    request = comm.iallreduce(jnp.ones(2))
    with pytest.raises(ValueError, match="posted outside the traced function"):
        jax.jit(lambda: comm.wait(request))()
    assert_values(comm.wait(request), np.full(2, comm.size, FLOAT))


def test_a_request_cannot_be_carried_through_a_loop(comm):
    def body(_, request):
        return comm.iallreduce(jnp.ones(2))

    with pytest.raises(TypeError):
        jax.jit(lambda: jax.lax.fori_loop(0, 2, body, comm.iallreduce(jnp.ones(2))))()
    comm.barrier()


def test_wrong_receive_size_is_an_error(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    x = jnp.ones(4 if comm.rank == 0 else 3)

    def shift(x):
        received = comm.irecv(jnp.ones(3), source=left, tag=9)
        comm.wait(comm.isend(x, dest=right, tag=9))
        return comm.wait(received)

    if comm.rank == 1:  # receives 4 elements into 3: MPI's truncation, or jaxcomm's count
        with pytest.raises(jax.errors.JaxRuntimeError):
            jax.block_until_ready(jax.jit(shift)(x))
    else:
        jax.block_until_ready(jax.jit(shift)(x))
    comm.barrier()


def test_wait_needs_a_request(comm):
    with pytest.raises(TypeError, match="expected a jaxcomm Request"):
        comm.wait(jnp.ones(2))


# Those of a Cartesian grid (ineighbor_*) take x alone: test_topology.py. AD
# alone posts itagged_send (a cotangent back to a sender, with a tag learnt).
POSTING = sorted(n for n in _nonblocking.OPERATIONS if "neighbor" not in n and n != "itagged_send")


@pytest.mark.parametrize("name", POSTING)
def test_each_posting_method_takes_its_blocking_twins_parameters(comm, name):
    posting, blocking = getattr(JaxComm, name), getattr(JaxComm, name[1:])
    parameters = inspect.signature(blocking).parameters
    expected = [p for p in parameters.values() if p.name not in comm_module._BLOCKING_ONLY]
    assert list(inspect.signature(posting).parameters.values()) == expected
    x = jnp.ones((comm.size, 2))
    required = {n: 0 for n, p in parameters.items() if p.default is p.empty} | {"x": x}
    del required["self"]
    with pytest.raises(TypeError, match=f"{name}: too many positional arguments"):
        getattr(comm, name)(x, 0, 0, 0)
    with pytest.raises(TypeError, match=f"{name}: got an unexpected keyword argument 'colour'"):
        getattr(comm, name)(**required, colour=0)
    with pytest.raises(TypeError, match=f"{name}: missing a required argument: 'x'"):
        getattr(comm, name)()
    if "in_place" in parameters:  # the blocking twin's buffer choice: refused by name
        with pytest.raises(TypeError, match=f"{name}: .*keyword argument 'in_place'"):
            getattr(comm, name)(**required, in_place=True)


def test_posting_methods_check_their_arguments_as_declared(comm):
    x = jnp.ones((comm.size, 2))
    with pytest.raises(ValueError, match=rf"ibcast: root={comm.size} is out of range"):
        comm.ibcast(x, comm.size)
    with pytest.raises(ValueError, match="iallreduce: op='mean' is not a supported reduction"):
        comm.iallreduce(x, "mean")
    with pytest.raises(ValueError, match="isend: tag=-2 must be between 0 and"):
        comm.isend(x, dest=0, tag=-2)
    with pytest.raises(TypeError, match="irecv: source must be a Python int fixed at trace"):
        jax.jit(lambda s: comm.irecv(x, source=s))(0)
    with pytest.raises(ValueError, match="ireduce_scatter: x must have a leading axis"):
        comm.ireduce_scatter(jnp.ones(comm.size + 1))
    # Positional and keyword forms post the same operation.
    for request in (comm.iallreduce(x, MPI.MAX), comm.iallreduce(x=x, op="max")):
        assert_values(comm.wait(request), np.ones((comm.size, 2), FLOAT))


def test_any_source_needs_one_array_and_no_checking(comm):
    with pytest.raises(ValueError, match=r"irecv: a pytree .* not MPI\.ANY_SOURCE"):
        comm.irecv({"a": jnp.ones(2), "b": jnp.ones(2)})
    checked = JaxComm(comm, check=True)
    with pytest.raises(ValueError, match=r"irecv: checking mode .* not MPI\.ANY_SOURCE"):
        checked.irecv(jnp.ones(2))
    checked.free()


def test_module_functions(comm):
    request = jaxcomm.iallreduce(jnp.ones(2), comm=comm.mpi)
    assert_values(jaxcomm.wait(request), np.full(2, comm.size, FLOAT))
    requests = [jaxcomm.ibcast(jnp.full(2, comm.rank), root=0), jaxcomm.iallgather(jnp.ones(1))]
    while not jaxcomm.test(requests[1]):
        pass
    root, gathered = jaxcomm.waitall(requests)
    assert_values(root, np.zeros(2, root.dtype))
    assert gathered.shape == (comm.size, 1)
