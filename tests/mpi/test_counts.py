"""Count operands of the variable-size exchanges: accepted in any integer dtype
and memory layout where their values fit, refused otherwise with an error that
names the argument and the value, on the rank that passed them, while the other
ranks get their rows. Also where a transformation adds an exchange (AD, vmap,
checking mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import assert_values, rank_data
from jax import lax
from mpi4py import MPI
from test_variable_size import capacity_for, expected, rows_of, skewed, uniform

from jaxcomm import JaxComm

INTEGER_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
MODES = ["eager", "jit"]


def run(mode, fn, *args):
    return jax.block_until_ready(jax.jit(fn)(*args) if mode == "jit" else fn(*args))


def ialltoallv(comm):
    return lambda x, counts, **kw: comm.wait(comm.ialltoallv(x, counts, **kw))


def iallgatherv(comm):
    return lambda x, **kw: comm.wait(comm.iallgatherv(x, **kw))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
def test_counts_of_every_integer_dtype(comm, dtype, mode):
    counts = np.array(skewed(comm.rank, comm.size), dtype)
    capacity = capacity_for(comm.size, skewed)
    want, want_counts = expected(comm.rank, comm.size, skewed, capacity)
    x = jnp.asarray(rows_of(comm.rank, skewed(comm.rank, comm.size)))
    fn = lambda x, c: comm.alltoallv(x, c, capacity=capacity, recv_counts=want_counts.astype(dtype))  # noqa: E731
    y, got = run(mode, fn, x, counts)
    assert_values(y, want)
    assert_values(got, want_counts)


@pytest.mark.parametrize("mode", MODES)
def test_counts_that_are_a_column_of_a_table(comm, mode):
    table = np.array([skewed(source, comm.size) for source in range(comm.size)], np.int64)
    capacity = capacity_for(comm.size, skewed)
    want, want_counts = expected(comm.rank, comm.size, skewed, capacity)
    x = jnp.asarray(rows_of(comm.rank, skewed(comm.rank, comm.size)))
    received = table[:, comm.rank]  # not contiguous
    assert comm.size == 1 or not received.flags.c_contiguous
    fn = lambda x: comm.alltoallv(x, table[comm.rank], capacity=capacity, recv_counts=received)  # noqa: E731
    y, got = run(mode, fn, x)
    assert_values(y, want)
    assert_values(got, want_counts)
    # scatterv: only the root passes counts, a view of the table.
    counts = table[:, 0] if comm.rank == 0 else None
    rows = rows_of(0, skewed(0, comm.size)) if comm.rank == 0 else np.zeros((1, 2), np.float32)
    y, got = run(mode, lambda x: comm.scatterv(x, counts, 0, capacity=capacity), jnp.asarray(rows))
    mine = table[comm.rank, 0]
    start = sum(table[: comm.rank, 0])
    assert int(got) == mine
    want = np.zeros((capacity, 2), np.float32)
    want[:mine] = rows_of(0, skewed(0, comm.size))[start : start + mine]
    assert_values(y, want)


BAD_RECV_COUNTS = {
    "negative": lambda size: np.array([-1000] + [1] * (size - 1), np.int32),
    "too large for int32": lambda size: np.array([2**32 + 1] + [0] * (size - 1), np.int64),
    "2**31": lambda size: np.array([2**31] + [0] * (size - 1), np.int64),
}


@pytest.mark.parametrize("form", ["alltoallv", "ialltoallv"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", BAD_RECV_COUNTS)
def test_invalid_recv_counts_are_refused(comm, form, mode, bad):
    """Given counts are trusted, but none can be negative or beyond int32: a rank
    refuses them before the exchange (as it does a bad root), alone here. In
    checking mode every rank compares them with what is sent, and all refuse."""
    solo = JaxComm(MPI.COMM_SELF)
    given = BAD_RECV_COUNTS[bad](1)
    shown = f"recv_counts={given.tolist()}".replace("[", r"\[").replace("]", r"\]")
    exchange = solo.alltoallv if form == "alltoallv" else ialltoallv(solo)
    fn = lambda x: exchange(x, np.array([1]), capacity=2, recv_counts=given)  # noqa: E731
    with pytest.raises(Exception, match=shown):
        run(mode, fn, jnp.ones((1, 2)))
    solo.free()
    checked = JaxComm(comm, check=True)
    counts = uniform(comm.rank, comm.size)
    capacity = capacity_for(comm.size, uniform)
    _, want_counts = expected(comm.rank, comm.size, uniform, capacity)
    culprit = comm.size - 1
    given = BAD_RECV_COUNTS[bad](comm.size) if comm.rank == culprit else want_counts
    exchange = checked.alltoallv if form == "alltoallv" else ialltoallv(checked)
    fn = lambda x: exchange(x, np.array(counts), capacity=capacity, recv_counts=given)  # noqa: E731
    with pytest.raises(Exception, match=r"jaxcomm check: i?alltoallv"):
        run(mode, fn, jnp.asarray(rows_of(comm.rank, counts)))
    checked.free()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value", [2**31, 2**32, 2**32 + 1])
def test_counts_beyond_int32_are_refused_not_wrapped(comm, mode, value):
    x = jnp.asarray(rank_data(comm.rank, (2, 2)))
    culprit = comm.size - 1
    count = np.int64(value) if comm.rank == culprit else 2
    fn = lambda x: comm.allgatherv(x, capacity=2 * comm.size, count=count)  # noqa: E731
    # allgatherv's result lacks the culprit's rows everywhere: every rank raises.
    refused = (
        rf"count=\[{value}\] must be counts of rows"
        if comm.rank == culprit
        else (f"rank {culprit}.s count was refused")
    )
    with pytest.raises(Exception, match=refused):
        run(mode, fn, x)
    comm.barrier()
    send = np.zeros(comm.size, np.int64)
    send[0] = value
    if comm.rank == culprit:
        with pytest.raises(Exception, match=rf"send_counts=\[{value}(, |\])"):
            run(mode, lambda x: comm.alltoallv(x, send, capacity=2), x)
    else:
        zeros = np.zeros(comm.size, np.int32)
        y, got = run(mode, lambda x: comm.alltoallv(x, zeros, capacity=2), x)
        assert_values(got, zeros)
        assert_values(y, np.zeros((2, 2), np.float32))
    comm.barrier()


DERIVATIVES = ["jvp", "grad", "jit(grad)", "vjp", "jit(vjp)", "linearize", "grad in a loop"]
FORMS = ["alltoallv", "ialltoallv", "gatherv", "scatterv", "allgatherv", "iallgatherv"]


@pytest.mark.parametrize("derivative", DERIVATIVES)
@pytest.mark.parametrize("form", FORMS)
def test_derivative_of_an_overflow_on_one_rank(comm, derivative, form):
    """Under a derivative every rank raises at the primal exchange: the rank that
    overflows with its counts and capacity, the others naming it. Its tangent's or
    cotangent's exchange may run in another computation, or never (a vjp function
    not called), so no rank may keep a result meanwhile. A non-blocking form
    raises at its post: ranks may reach its wait at different points (in a loop
    here). The ranks stay in step."""
    if comm.size < 2:
        pytest.skip("needs a rank that does not overflow")
    culprit = 0 if form == "gatherv" else comm.size - 1  # gatherv: only the root receives
    short = comm.rank == culprit
    if form in ("alltoallv", "ialltoallv"):
        counts = uniform(comm.rank, comm.size)
        capacity = capacity_for(comm.size, uniform) - (3 if short else 0)
        x = jnp.asarray(rows_of(comm.rank, counts))
        exchange = comm.alltoallv if form == "alltoallv" else ialltoallv(comm)
        fn = lambda x: exchange(x, np.array(counts), capacity=capacity)[0]  # noqa: E731
    elif form in ("allgatherv", "iallgatherv"):
        capacity = 2 * comm.size - (1 if short else 0)
        x = jnp.asarray(rank_data(comm.rank, (2, 2)))
        exchange = comm.allgatherv if form == "allgatherv" else iallgatherv(comm)
        fn = lambda x: exchange(x, capacity=capacity)[0]  # noqa: E731
    elif form == "gatherv":
        capacity = 2 * comm.size - 1
        x = jnp.asarray(rank_data(comm.rank, (2, 2)))
        fn = lambda x: comm.gatherv(x, 0, capacity=capacity)[0]  # noqa: E731
    else:
        counts = np.full(comm.size, 2, np.int32) if comm.rank == 0 else None
        capacity = 1 if short else 2
        rows = rank_data(0, (2 * comm.size, 2)) if comm.rank == 0 else np.zeros((2, 2), np.float32)
        x = jnp.asarray(rows)
        fn = lambda x: comm.scatterv(x, counts, 0, capacity=capacity)[0]  # noqa: E731
    loss = lambda x: jnp.sum(fn(x) ** 2)  # noqa: E731
    calls = {
        "jvp": lambda: jax.jvp(fn, (x,), (jnp.ones_like(x),)),
        "grad": lambda: jax.grad(loss)(x),
        "jit(grad)": lambda: jax.jit(jax.grad(loss))(x),
        # The primal result alone: the function of the derivative is never called.
        "vjp": lambda: jax.vjp(fn, x)[0],
        "jit(vjp)": lambda: jax.jit(lambda x: jax.vjp(fn, x)[0])(x),
        "linearize": lambda: jax.linearize(fn, x)[0],
        "grad in a loop": lambda: jax.grad(
            lambda x: lax.fori_loop(0, 2, lambda i, total: total + loss(x * (i + 1)), 0.0)
        )(x),
    }
    if short:
        mine = r"capacity=|add up to more than x"
    elif form in ("allgatherv", "iallgatherv"):
        mine = f"rank {culprit}.s capacity="
    else:
        mine = f"rank {culprit} received more rows than its capacity; under a derivative every"
    with pytest.raises(Exception, match=mine):
        jax.block_until_ready(calls[derivative]())
    assert float(comm.allreduce(jnp.ones(()))) == comm.size  # still in step


@pytest.mark.parametrize("derivative", ["grad", "vjp"])
def test_derivative_of_a_refused_count_on_one_rank(comm, derivative):
    """Under a derivative the others name the rank whose counts were refused."""
    if comm.size < 2:
        pytest.skip("needs a rank whose counts are valid")
    culprit = comm.size - 1
    counts = np.ones(comm.size, np.int32)
    if comm.rank == culprit:
        counts[0] = -1
    x = jnp.asarray(rank_data(comm.rank, (comm.size, 2)))
    fn = lambda x: comm.alltoallv(x, counts, capacity=comm.size)[0]  # noqa: E731
    run = {
        "grad": lambda: jax.grad(lambda x: jnp.sum(fn(x) ** 2))(x),
        "vjp": lambda: jax.vjp(fn, x)[0],
    }[derivative]
    if comm.rank == culprit:
        wanted = r"alltoallv: send_counts=\[-1, .*must be counts of rows"
    else:
        wanted = rf"alltoallv: rank {culprit}.s counts were refused; under a derivative"
    with pytest.raises(Exception, match=wanted):
        jax.block_until_ready(run())
    assert float(comm.allreduce(jnp.ones(()))) == comm.size  # still in step


def test_checking_mode_when_ranks_disagree_on_giving_counts(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    checked = JaxComm(comm, check=True)
    counts = uniform(comm.rank, comm.size)
    capacity = capacity_for(comm.size, uniform)
    _, want_counts = expected(comm.rank, comm.size, uniform, capacity)
    x = jnp.asarray(rows_of(comm.rank, counts))
    given = want_counts if comm.rank == 0 else None
    with pytest.raises(Exception, match=r"jaxcomm check: .*recv_counts=(given|exchanged)"):
        jax.block_until_ready(
            checked.alltoallv(x, np.array(counts), capacity=capacity, recv_counts=given)
        )
    checked.free()


def test_checking_message_names_dtypes(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    checked = JaxComm(comm, check=True)
    dtype = np.float32 if comm.rank == 0 else np.int32
    x = jnp.asarray(np.zeros((comm.size, 1), dtype))
    ones = np.ones(comm.size, np.int32)
    with pytest.raises(Exception, match=r"alltoallv\(dtype=(float32|int32), row=1"):
        jax.block_until_ready(checked.alltoallv(x, ones, capacity=comm.size))
    checked.free()


def test_a_pytree_as_x_is_refused(comm):
    x = {"a": jnp.zeros((comm.size, 1))}
    with pytest.raises(TypeError, match="alltoallv: x must be one array of rows, not a dict"):
        comm.alltoallv(x, np.ones(comm.size, np.int32), capacity=comm.size)


def test_vmap_with_counts_batched_on_some_ranks_only(comm):
    """Whichever ranks batch their counts, every rank gets each member's rows."""
    batch = 3
    size = comm.size
    # scatterv: only the root passes counts, batched there (equal values, as in use).
    rows = np.stack([rank_data(0, (2 * size, 2)) + 100 * b for b in range(batch)])
    if comm.rank == 0:
        counts = np.tile(np.full(size, 2, np.int32), (batch, 1))
        scatter = lambda x, c: comm.scatterv(x, c, 0, capacity=2)  # noqa: E731
        got = jax.jit(jax.vmap(scatter))(rows, counts)
    else:
        scatter = lambda x: comm.scatterv(x, None, 0, capacity=2)  # noqa: E731
        got = jax.jit(jax.vmap(scatter))(np.zeros((batch, 1, 2), rows.dtype))
    assert_values(got[0], rows[:, 2 * comm.rank : 2 * comm.rank + 2])
    assert_values(got[1], np.full(batch, 2, np.int32))
    # gatherv: the root counts all its rows, the others pass a batched count.
    data = np.stack([rank_data(comm.rank, (3, 2)) + 10 * b for b in range(batch)])
    own = np.array([1, 2, 3][:batch], np.int32)
    if comm.rank == 0:
        fn = lambda x: comm.gatherv(x, 0, capacity=3 * size)  # noqa: E731
        got = jax.jit(jax.vmap(fn))(data)
        for b in range(batch):
            want = [data[b]] + [(rank_data(r, (3, 2)) + 10 * b)[: own[b]] for r in range(1, size)]
            want = np.concatenate(want)
            assert_values(got[0][b][: len(want)], want)
            assert not np.asarray(got[0][b][len(want) :]).any()
            assert_values(got[1][b], np.array([3] + [int(own[b])] * (size - 1), np.int32))
    else:
        fn = lambda x, c: comm.gatherv(x, 0, capacity=3 * size, count=c)  # noqa: E731
        got = jax.jit(jax.vmap(fn))(data, own)
        assert got[0].shape == (batch, 0, 2)
    # alltoallv: counts batched on rank 0 only, different per member.
    counts = np.array(uniform(comm.rank, comm.size), np.int32)
    capacity = capacity_for(comm.size, uniform) + 2
    x = np.stack([rows_of(comm.rank, list(counts)) + 100 * b for b in range(batch)])
    member_counts = [np.roll(counts, b) if comm.rank == 0 else counts for b in range(batch)]
    fn = lambda x, c: comm.alltoallv(x, c, capacity=capacity)  # noqa: E731
    if comm.rank == 0:
        got = jax.jit(jax.vmap(fn))(x, np.stack(member_counts))
    else:
        got = jax.jit(jax.vmap(fn, in_axes=(0, None)))(x, counts)
    for b in range(batch):  # the same exchange, one member at a time
        want = fn(x[b], member_counts[b])
        assert_values(got[0][b], want[0])
        assert_values(got[1][b], want[1])
    comm.barrier()
