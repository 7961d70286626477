"""alltoallv and ialltoallv against a NumPy reference: every rank's counts and
rows are derived from its rank, so each rank computes what every other rank
sends it."""

from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import DTYPES, assert_values, rank_data
from mpi4py import MPI

from jaxcomm import JaxComm


def uniform(source: int, size: int) -> list[int]:
    return [2] * size


def skewed(source: int, size: int) -> list[int]:
    """Rank 0 sends ten times as many rows; some pairs exchange nothing."""
    return [(10 if source == 0 else 1) * ((source + dest) % 3) for dest in range(size)]


def nothing_from_one(source: int, size: int) -> list[int]:
    """The last rank sends nothing and nobody sends to rank 0."""
    return [0 if source == size - 1 or dest == 0 else 1 + dest for dest in range(size)]


PATTERNS = {"uniform": uniform, "skewed": skewed, "zeros": nothing_from_one}
FORMS = ["alltoallv", "ialltoallv"]


def alltoallv_as(form: str, comm: JaxComm):
    """comm.alltoallv, or its non-blocking form posted and waited."""
    if form == "alltoallv":
        return comm.alltoallv
    return lambda x, counts, **kw: comm.wait(comm.ialltoallv(x, counts, **kw))


def rows_of(source: int, counts: list[int], dtype="float32", row=(2,)) -> np.ndarray:
    """The rows rank `source` sends, with one spare row that is never sent."""
    return rank_data(source, (sum(counts) + 1, *row), dtype)


def expected(rank, size, pattern, capacity, dtype="float32", row=(2,)):
    """(rows rank `rank` receives, padded to capacity; the counts from each rank)."""
    pieces, counts = [], []
    for source in range(size):
        sent = pattern(source, size)
        start = sum(sent[:rank])
        pieces.append(rows_of(source, sent, dtype, row)[start : start + sent[rank]])
        counts.append(sent[rank])
    got = np.concatenate(pieces)
    padded = np.zeros((capacity, *row), got.dtype)
    padded[: len(got)] = got
    return padded, np.array(counts, np.int32)


def capacity_for(size: int, pattern) -> int:
    return max(sum(pattern(s, size)[r] for s in range(size)) for r in range(size)) + 1


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_values_match_numpy(comm, form, pattern, mode):
    alltoallv = alltoallv_as(form, comm)
    counts = PATTERNS[pattern](comm.rank, comm.size)
    capacity = capacity_for(comm.size, PATTERNS[pattern])
    call = lambda x, c: alltoallv(x, c, capacity=capacity)  # noqa: E731
    fn = jax.jit(call) if mode == "jit" else call
    y, got = fn(jnp.asarray(rows_of(comm.rank, counts)), np.array(counts))
    want, want_counts = expected(comm.rank, comm.size, PATTERNS[pattern], capacity)
    assert_values(y, want)
    assert_values(got, want_counts)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype(comm, form, dtype):
    alltoallv = alltoallv_as(form, comm)
    counts = skewed(comm.rank, comm.size)
    capacity = capacity_for(comm.size, skewed)
    x = jnp.asarray(rows_of(comm.rank, counts, dtype, row=(3, 2)))
    y, _ = jax.jit(lambda x: alltoallv(x, np.array(counts), capacity=capacity))(x)
    assert_values(y, expected(comm.rank, comm.size, skewed, capacity, dtype, (3, 2))[0])


@pytest.mark.parametrize("form", FORMS)
def test_given_recv_counts_skip_the_exchange(comm, form):
    alltoallv = alltoallv_as(form, comm)
    counts = skewed(comm.rank, comm.size)
    capacity = capacity_for(comm.size, skewed)
    want, want_counts = expected(comm.rank, comm.size, skewed, capacity)
    x = jnp.asarray(rows_of(comm.rank, counts))
    y, got = alltoallv(x, counts, capacity=capacity, recv_counts=want_counts)
    assert_values(y, want)
    assert_values(got, want_counts)


@pytest.mark.parametrize("form", FORMS)
def test_traced_counts_change_without_recompiling(comm, form):
    alltoallv = alltoallv_as(form, comm)
    traces = []

    @jax.jit
    def step(x, shift):
        traces.append(1)
        counts = (jnp.arange(comm.size) + comm.rank + shift) % 3
        return alltoallv(x, counts, capacity=3 * comm.size)

    x = jnp.asarray(rank_data(comm.rank, (2 * comm.size, 2)))
    for shift in range(3):
        y, got = step(x, shift)
        sent = [(d + comm.rank + shift) % 3 for d in range(comm.size)]
        assert sum(sent) <= 2 * comm.size
        want_counts = [(comm.rank + s + shift) % 3 for s in range(comm.size)]
        assert_values(got, np.array(want_counts, np.int32))
        pieces = []
        for source in range(comm.size):
            theirs = [(d + source + shift) % 3 for d in range(comm.size)]
            start = sum(theirs[: comm.rank])
            pieces.append(rank_data(source, (2 * comm.size, 2))[start : start + theirs[comm.rank]])
        got_rows = np.concatenate(pieces)
        assert_values(y[: len(got_rows)], got_rows)
        assert not np.asarray(y[len(got_rows) :]).any()
    assert len(traces) == 1


@pytest.mark.parametrize("form", FORMS)
def test_zero_size_rows_and_no_rows(comm, form):
    alltoallv = alltoallv_as(form, comm)
    counts = [1] * comm.size
    y, got = alltoallv(jnp.zeros((comm.size, 0)), counts, capacity=comm.size)
    assert y.shape == (comm.size, 0)
    assert_values(got, np.ones(comm.size, np.int32))
    y, got = jax.jit(lambda x: alltoallv(x, [0] * comm.size, capacity=0))(jnp.zeros((0, 2)))
    assert y.shape == (0, 2)
    assert_values(got, np.zeros(comm.size, np.int32))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_overflow_is_an_error_on_the_rank_that_overflows_only(comm, form, mode):
    """Rank 0 gets one more row than its capacity; the others still get theirs,
    and the next call on every rank works."""
    alltoallv = alltoallv_as(form, comm)
    counts = [1] * comm.size
    capacity = comm.size - 1 if comm.rank == 0 else comm.size
    call = lambda x: alltoallv(x, counts, capacity=capacity)  # noqa: E731
    fn = jax.jit(call) if mode == "jit" else call
    x = jnp.asarray(rank_data(comm.rank, (comm.size, 2)))
    if comm.rank == 0:
        with pytest.raises(Exception, match=r"add up to \d+ rows, more than capacity="):
            jax.block_until_ready(fn(x))
    else:
        y, _ = fn(x)
        want = np.stack([rank_data(s, (comm.size, 2))[comm.rank] for s in range(comm.size)])
        assert_values(y, want)
    y, _ = alltoallv(x, counts, capacity=comm.size)
    assert_values(y[0], rank_data(0, (comm.size, 2))[comm.rank])


@pytest.mark.parametrize("form", FORMS)
def test_more_send_counts_than_rows_is_an_error_on_that_rank(comm, form):
    alltoallv = alltoallv_as(form, comm)
    counts = [1] * comm.size
    rows = comm.size - 1 if comm.rank == comm.size - 1 else comm.size
    x = jnp.asarray(rank_data(comm.rank, (rows, 2)))
    if comm.rank == comm.size - 1:
        with pytest.raises(Exception, match=r"send_counts=\[.*\] add up to more than x.s \d+ rows"):
            jax.block_until_ready(alltoallv(x, counts, capacity=comm.size))
    else:
        _, got = alltoallv(x, counts, capacity=comm.size)
        # The failing rank sent nothing.
        assert int(got[comm.size - 1]) == 0
    comm.barrier()


@pytest.mark.parametrize("form", FORMS)
def test_checking_mode_names_recv_counts_that_do_not_match(comm, form):
    checking = JaxComm(comm.mpi, check=True)
    counts = [1] * comm.size
    wrong = np.ones(comm.size, np.int32)
    wrong[0] += comm.rank == 0  # rank 0 expects one row too many from rank 0
    x = jnp.asarray(rank_data(comm.rank, (comm.size, 2)))
    message = r"recv_counts=\[.*\] but the ranks send" if comm.rank == 0 else "another rank"
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(
            alltoallv_as(form, checking)(x, counts, capacity=comm.size, recv_counts=wrong)
        )
    checking.free()


def test_bad_arguments_are_named(comm):
    x = jnp.zeros((comm.size, 2))
    with pytest.raises(TypeError, match=r"alltoallv: send_counts must be integers of shape"):
        comm.alltoallv(x, np.ones(comm.size + 1, np.int32), capacity=2)
    with pytest.raises(TypeError, match=r"alltoallv: send_counts must be integers of shape"):
        comm.alltoallv(x, np.ones(comm.size), capacity=2)
    with pytest.raises(ValueError, match=r"alltoallv: capacity=-1 must be at least 0"):
        comm.alltoallv(x, [1] * comm.size, capacity=-1)
    with pytest.raises(TypeError, match=r"alltoallv: capacity must be a Python int"):
        jax.jit(lambda c: comm.alltoallv(x, [1] * comm.size, capacity=c))(3)
    with pytest.raises(ValueError, match=r"alltoallv: x must have a leading axis"):
        comm.alltoallv(jnp.float32(1), [1] * comm.size, capacity=2)


def loss_weights(capacity):
    return 1.0 + jnp.arange(capacity * 2, dtype=jnp.float32).reshape(capacity, 2) / 7


@pytest.mark.parametrize("form", FORMS)
def test_grad_sends_each_row_back_where_it_came_from(comm, form):
    """d/dx sum(y * w): each row of x gets the weights of the row it became."""
    alltoallv = alltoallv_as(form, comm)
    counts = skewed(comm.rank, comm.size)
    capacity = capacity_for(comm.size, skewed)
    x = jnp.asarray(rows_of(comm.rank, counts))
    w = loss_weights(capacity) * (comm.rank + 1)

    def loss(x):
        return jnp.sum(alltoallv(x, counts, capacity=capacity)[0] * w)

    grad = jax.jit(jax.grad(loss))(x)
    want = np.zeros(x.shape, np.float32)
    for dest in range(comm.size):
        theirs = [skewed(s, comm.size)[dest] for s in range(comm.size)]
        where = sum(theirs[: comm.rank])  # where my rows land on dest
        start = sum(counts[:dest])
        w_dest = np.asarray(loss_weights(capacity)) * (dest + 1)
        want[start : start + counts[dest]] = w_dest[where : where + counts[dest]]
    assert_values(grad, want)
    assert_values(jax.grad(loss)(x), want)


def test_jvp_and_vmap(comm):
    counts = uniform(comm.rank, comm.size)
    capacity = capacity_for(comm.size, uniform)
    fn = lambda x: comm.alltoallv(x, counts, capacity=capacity)[0]  # noqa: E731
    x = jnp.asarray(rows_of(comm.rank, counts))
    t = jnp.asarray(rows_of(comm.rank + 7, counts))
    y, dy = jax.jvp(fn, (x,), (t,))
    assert_values(y, fn(x))
    assert_values(dy, fn(t))  # linear: the tangent moves as x does
    batch = jnp.stack([x, 2 * x, t])
    assert_values(jax.vmap(fn)(batch), jnp.stack([fn(x), fn(2 * x), fn(t)]))
    # Counts that differ across the batch.
    others = np.array([counts, [1] * comm.size, [0] * comm.size], np.int32)
    batched = jax.vmap(lambda x, c: comm.alltoallv(x, c, capacity=capacity))(batch, others)
    for b in range(3):
        want = comm.alltoallv(batch[b], others[b], capacity=capacity)
        assert_values(batched[0][b], want[0])
        assert_values(batched[1][b], want[1])


def test_ialltoallv_jvp_and_vmap(comm):
    counts = uniform(comm.rank, comm.size)
    capacity = capacity_for(comm.size, uniform)
    posted = lambda x: comm.wait(comm.ialltoallv(x, counts, capacity=capacity))[0]  # noqa: E731
    blocking = lambda x: comm.alltoallv(x, counts, capacity=capacity)[0]  # noqa: E731
    x = jnp.asarray(rows_of(comm.rank, counts))
    t = jnp.asarray(rows_of(comm.rank + 7, counts))
    y, dy = jax.jit(lambda x, t: jax.jvp(posted, (x,), (t,)))(x, t)
    assert_values(y, blocking(x))
    assert_values(dy, blocking(t))
    batch = jnp.stack([x, 2 * x, t])
    assert_values(jax.jit(jax.vmap(posted))(batch), jax.vmap(blocking)(batch))
    # Counts that differ across the batch: still one exchange, each member's own.
    others = np.array([counts, [1] * comm.size, [0] * comm.size], np.int32)
    posted_with = lambda x, c: comm.wait(comm.ialltoallv(x, c, capacity=capacity))  # noqa: E731
    blocking_with = lambda x, c: comm.alltoallv(x, c, capacity=capacity)  # noqa: E731
    got = jax.jit(jax.vmap(posted_with))(batch, others)
    for member in range(3):
        want = blocking_with(batch[member], others[member])
        assert_values(got[0][member], want[0])
        assert_values(got[1][member], want[1])


def test_ialltoallv_overlaps_computation_in_a_loop(comm):
    """Post with known counts, compute, wait: every step of a jitted loop."""
    counts = np.array(skewed(comm.rank, comm.size), np.int32)
    capacity = capacity_for(comm.size, skewed)
    want, want_counts = expected(comm.rank, comm.size, skewed, capacity)
    x = jnp.asarray(rows_of(comm.rank, list(counts)))

    def step(i, total):
        request = comm.ialltoallv(x, counts, capacity=capacity, recv_counts=want_counts)
        busy = jnp.sum(jnp.sin(x + i))  # meanwhile
        y, got = comm.wait(request)
        return total + y + 0 * busy + 0 * jnp.sum(got)

    total = jax.jit(lambda: jax.lax.fori_loop(0, 3, step, jnp.zeros_like(want)))()
    assert_values(total, 3 * want)


@pytest.mark.parametrize("form", FORMS)
def test_linear_transpose_learns_the_counts(comm, form):
    alltoallv = alltoallv_as(form, comm)
    counts = skewed(comm.rank, comm.size)
    capacity = capacity_for(comm.size, skewed)
    x = jnp.asarray(rows_of(comm.rank, counts))
    fn = lambda x: alltoallv(x, counts, capacity=capacity)[0]  # noqa: E731
    (back,) = jax.linear_transpose(fn, x)(fn(x))
    want = np.asarray(x).copy()
    want[sum(counts) :] = 0  # the spare row was not sent
    assert_values(back, want)


def test_module_function_and_mpi4py_comm(comm):
    import jaxcomm

    counts = uniform(comm.rank, comm.size)
    y, _ = jaxcomm.alltoallv(
        jnp.asarray(rows_of(comm.rank, counts)), counts, capacity=2 * comm.size, comm=MPI.COMM_WORLD
    )
    assert_values(y, expected(comm.rank, comm.size, uniform, 2 * comm.size)[0])


# -- allgatherv, gatherv, scatterv -----------------------------------------------------


def own_count(rank: int) -> int:
    """Rows rank `rank` contributes: 0 on rank 1, a few elsewhere."""
    return 0 if rank == 1 else rank + 2


def own_rows(rank: int, dtype="float32") -> np.ndarray:
    """Its rows, with one spare row that is never sent."""
    return rank_data(rank, (own_count(rank) + 1, 2), dtype)


def stacked(size: int, capacity: int, dtype="float32") -> np.ndarray:
    """Every rank's rows in rank order, padded to capacity."""
    rows = np.concatenate([own_rows(r, dtype)[: own_count(r)] for r in range(size)])
    padded = np.zeros((capacity, 2), rows.dtype)
    padded[: len(rows)] = rows
    return padded


def all_counts(size: int) -> np.ndarray:
    return np.array([own_count(r) for r in range(size)], np.int32)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_allgatherv_and_gatherv_match_numpy(comm, mode):
    capacity = int(all_counts(comm.size).sum()) + 2
    root = comm.size - 1

    def both(x, count):
        return (
            comm.allgatherv(x, capacity=capacity, count=count),
            comm.gatherv(x, root, capacity=capacity, count=count),
        )

    fn = jax.jit(both) if mode == "jit" else both
    (y, counts), (g, g_counts) = fn(jnp.asarray(own_rows(comm.rank)), own_count(comm.rank))
    assert_values(y, stacked(comm.size, capacity))
    assert_values(counts, all_counts(comm.size))
    if comm.rank == root:
        assert_values(g, stacked(comm.size, capacity))
        assert_values(g_counts, all_counts(comm.size))
    else:
        assert g.shape == (0, 2)
        mine = np.zeros(comm.size, np.int32)
        mine[comm.rank] = own_count(comm.rank)
        assert_values(g_counts, mine)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgatherv_every_dtype_and_all_rows_by_default(comm, dtype):
    x = jnp.asarray(own_rows(comm.rank, dtype)[: own_count(comm.rank)])
    capacity = int(all_counts(comm.size).sum())
    y, _ = comm.allgatherv(x, capacity=capacity)
    assert_values(y, stacked(comm.size, capacity, dtype))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_scatterv_matches_numpy(comm, mode):
    root = 0
    counts = all_counts(comm.size)
    capacity = int(counts.max()) + 1
    rows = stacked(comm.size, int(counts.sum()))
    x = jnp.asarray(rows) if comm.rank == root else jnp.zeros((0, 2), jnp.float32)
    call = lambda x, c: comm.scatterv(x, c, root, capacity=capacity)  # noqa: E731
    fn = jax.jit(call) if mode == "jit" else call
    y, count = fn(x, counts if comm.rank == root else np.zeros(comm.size, np.int32))
    start = int(counts[: comm.rank].sum())
    want = np.zeros((capacity, 2), np.float32)
    want[: counts[comm.rank]] = rows[start : start + counts[comm.rank]]
    assert_values(y, want)
    assert int(count) == counts[comm.rank]
    y, count = comm.scatterv(x, counts if comm.rank == root else None, root, capacity=capacity)
    assert_values(y, want)


def test_gatherv_then_scatterv_round_trips_traced_counts(comm):
    """Counts computed inside jit: each rank keeps its rows with positive values."""

    @jax.jit
    def round_trip(x):
        keep = x[:, 0] > 2
        rows = x[jnp.argsort(~keep, stable=True)]
        count = keep.sum().astype(jnp.int32)
        gathered, counts = comm.gatherv(rows, 0, capacity=x.shape[0] * comm.size, count=count)
        back, got = comm.scatterv(gathered, counts, 0, capacity=x.shape[0])
        return back, got, count

    x = jnp.asarray(rank_data(comm.rank, (5, 2)))
    back, got, count = round_trip(x)
    kept = np.asarray(x)[np.asarray(x)[:, 0] > 2]
    assert int(got) == int(count) == len(kept)
    assert_values(back[: len(kept)], kept)
    assert not np.asarray(back[len(kept) :]).any()


def test_allgatherv_overflow_and_bad_count(comm):
    x = jnp.asarray(rank_data(comm.rank, (2, 2)))
    with pytest.raises(Exception, match=r"add up to \d+ rows, more than capacity="):
        jax.block_until_ready(comm.allgatherv(x, capacity=2 * comm.size - 1))
    bad = 3 if comm.rank == 0 else 1
    if comm.rank == 0:
        with pytest.raises(Exception, match=r"count=\[3\] add up to more than x.s \d+ rows"):
            jax.block_until_ready(comm.allgatherv(x, capacity=2 * comm.size, count=bad))
    else:  # the result lacks rank 0's rows on every rank
        with pytest.raises(Exception, match=r"rank 0.s count was refused"):
            jax.block_until_ready(comm.allgatherv(x, capacity=2 * comm.size, count=bad))
    comm.barrier()


def test_scatterv_overflow_on_one_rank(comm):
    counts = np.full(comm.size, 2, np.int32)
    x = jnp.asarray(rank_data(0, (2 * comm.size, 2)))
    capacity = 1 if comm.rank == comm.size - 1 else 2
    if comm.rank == comm.size - 1:
        with pytest.raises(Exception, match=r"more than capacity=1"):
            jax.block_until_ready(comm.scatterv(x, counts, 0, capacity=capacity))
    else:
        y, _ = comm.scatterv(x, counts, 0, capacity=capacity)
        assert_values(y, np.asarray(x)[2 * comm.rank : 2 * comm.rank + 2])


def test_variable_size_bad_arguments(comm):
    x = jnp.zeros((2, 2))
    with pytest.raises(TypeError, match=r"allgatherv: count must be an integer scalar, got float"):
        comm.allgatherv(x, capacity=4, count=1.0)
    with pytest.raises(ValueError, match=r"gatherv: root=\d+ is out of range"):
        comm.gatherv(x, comm.size, capacity=4)
    with pytest.raises(TypeError, match=r"scatterv: counts must be integers of shape"):
        comm.scatterv(x, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], capacity=4)


def test_allgatherv_and_gatherv_grad(comm):
    """allgatherv's result is replicated: the loss is the same on every rank and
    each rank's gradient is the weights of its own rows. gatherv's cotangent on
    root goes back to each rank's rows."""
    capacity = int(all_counts(comm.size).sum()) + 1
    w = 1.0 + jnp.arange(capacity * 2, dtype=jnp.float32).reshape(capacity, 2)
    x = jnp.asarray(own_rows(comm.rank))
    count = own_count(comm.rank)
    start = int(all_counts(comm.size)[: comm.rank].sum())
    want = np.zeros(x.shape, np.float32)
    want[:count] = np.asarray(w)[start : start + count]

    def replicated(x):
        return jnp.sum(comm.allgatherv(x, capacity=capacity, count=count)[0] * w)

    assert_values(jax.jit(jax.grad(replicated))(x), want)

    def at_root(x):
        return jnp.sum(
            comm.gatherv(x, 0, capacity=capacity if comm.rank == 0 else 0, count=count)[0]
            * (w if comm.rank == 0 else 0)
        )

    assert_values(jax.grad(at_root)(x), want)


def test_scatterv_grad_jvp_and_vmap(comm):
    counts = all_counts(comm.size)
    capacity = int(counts.max())
    x = stacked(comm.size, int(counts.sum())) if comm.rank == 0 else np.zeros((1, 2), np.float32)
    x = jnp.asarray(x)
    sent = counts if comm.rank == 0 else None
    w = (comm.rank + 1.0) * jnp.ones((capacity, 2))

    def loss(x):
        return jnp.sum(comm.scatterv(x, sent, 0, capacity=capacity)[0] * w)

    grad = jax.grad(loss)(x)
    if comm.rank == 0:
        want = np.concatenate([np.full((c, 2), r + 1.0) for r, c in enumerate(counts)])
        assert_values(grad, want.astype(np.float32))
    else:
        assert_values(grad, np.zeros((1, 2), np.float32))
    fn = lambda x: comm.scatterv(x, sent, 0, capacity=capacity)[0]  # noqa: E731
    y, dy = jax.jvp(fn, (x,), (2 * x,))
    assert_values(dy, 2 * y)
    assert_values(jax.vmap(fn)(jnp.stack([x, 3 * x])), jnp.stack([fn(x), fn(3 * x)]))


def test_derivatives_in_checking_mode_verify_the_known_counts(comm):
    """The AD rules pass the counts they know (no second exchange); checking mode
    verifies them against what is sent, and the gradients are unchanged."""
    checking = JaxComm(comm.mpi, check=True)
    capacity = int(all_counts(comm.size).sum()) + 1
    x = jnp.asarray(own_rows(comm.rank))
    count = own_count(comm.rank)

    def loss(c):
        def of(x):
            everyone, _ = c.allgatherv(x, capacity=capacity, count=count)
            at_root, counts = c.gatherv(x, 0, capacity=capacity, count=count)
            back, _ = c.scatterv(at_root, counts if c.rank == 0 else None, 0, capacity=x.shape[0])
            moved, _ = c.alltoallv(
                x, [count if d == 0 else 0 for d in range(c.size)], capacity=capacity
            )
            return jnp.sum(everyone * 2) + jnp.sum(back * 3) + jnp.sum(moved * 5)

        return of

    np.testing.assert_allclose(jax.grad(loss(checking))(x), jax.grad(loss(comm))(x))
    checking.free()


# -- iallgatherv, igatherv, iscatterv: each against its blocking form ------------------


def gather_family(comm, count, root=0):
    """(name, blocking, posted and waited) of allgatherv, gatherv and scatterv, each
    x -> (y, counts) with this rank's `count` (scatterv: root's counts of all)."""
    capacity = int(all_counts(comm.size).sum()) + 1
    at_root = capacity if comm.rank == root else 0
    counts = all_counts(comm.size) if comm.rank == root else None
    mine = int(all_counts(comm.size).max())
    return [
        (
            "allgatherv",
            lambda x: comm.allgatherv(x, capacity=capacity, count=count),
            lambda x: comm.wait(comm.iallgatherv(x, capacity=capacity, count=count)),
        ),
        (
            "gatherv",
            lambda x: comm.gatherv(x, root, capacity=at_root, count=count),
            lambda x: comm.wait(comm.igatherv(x, root, capacity=at_root, count=count)),
        ),
        (
            "scatterv",
            lambda x: comm.scatterv(stacked_or(comm, x, root), counts, root, capacity=mine),
            lambda x: comm.wait(
                comm.iscatterv(stacked_or(comm, x, root), counts, root, capacity=mine)
            ),
        ),
    ]


def stacked_or(comm, x, root):
    """scatterv's x from a rank's rows: root's rows of every rank (x scaled, so
    that derivatives flow through), a template elsewhere."""
    if comm.rank != root:
        return x
    rows = int(all_counts(comm.size).sum())
    return jnp.concatenate([jnp.asarray(stacked(comm.size, rows)), x]) * x[0, 0]


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_nonblocking_gather_family_matches_blocking(comm, mode):
    x = jnp.asarray(own_rows(comm.rank))
    for name, blocking, posted in gather_family(comm, own_count(comm.rank)):
        fn = jax.jit(posted) if mode == "jit" else posted
        (y, got), (want, want_counts) = fn(x), blocking(x)
        assert_values(y, want), name
        assert_values(got, want_counts), name


def test_nonblocking_gather_family_jvp_grad_and_vmap(comm):
    """jvp and grad equal the blocking form's; vmap with counts that vary across
    the batch on some ranks only is one call, each member's own."""
    x = jnp.asarray(own_rows(comm.rank))
    t = 3 * x + 1
    count = own_count(comm.rank)
    for name, blocking, posted in gather_family(comm, count):
        y, dy = jax.jit(lambda x, t, f=posted: jax.jvp(lambda x: f(x)[0], (x,), (t,)))(x, t)
        want, want_dy = jax.jvp(lambda x, f=blocking: f(x)[0], (x,), (t,))
        assert_values(y, want), name
        assert_values(dy, want_dy), name
        w = 1.0 + jnp.arange(want.size, dtype=jnp.float32).reshape(want.shape)
        loss = lambda x, f=posted, w=w: jnp.sum(f(x)[0] * w)  # noqa: E731
        want_grad = jax.grad(lambda x, f=blocking, w=w: jnp.sum(f(x)[0] * w))(x)
        assert_values(jax.grad(loss)(x), want_grad), name
        assert_values(jax.jit(jax.grad(loss))(x), want_grad), name
    # count batched on the odd ranks only
    batch = jnp.stack([x, 2 * x, 3 * x])
    counts = np.array([count, 1, 0] if comm.rank % 2 else [count] * 3, np.int32)
    capacity = int(all_counts(comm.size).sum()) + 1
    at_root = capacity if comm.rank == 0 else 0
    for blocking, posted in [
        (
            lambda x, c: comm.allgatherv(x, capacity=capacity, count=c),
            lambda x, c: comm.wait(comm.iallgatherv(x, capacity=capacity, count=c)),
        ),
        (
            lambda x, c: comm.gatherv(x, 0, capacity=at_root, count=c),
            lambda x, c: comm.wait(comm.igatherv(x, 0, capacity=at_root, count=c)),
        ),
    ]:
        got = jax.jit(jax.vmap(posted))(batch, counts)
        want = jax.vmap(blocking)(batch, counts)
        assert_values(got[0], want[0])
        assert_values(got[1], want[1])


def test_iscatterv_vmap_with_root_counts_batched(comm):
    sent = all_counts(comm.size)
    root_counts = np.stack([sent, sent[::-1], np.zeros_like(sent)])
    xs = jnp.asarray(stacked(comm.size, int(sent.sum())))
    mine = int(sent.max())
    if comm.rank == 0:
        got = jax.jit(jax.vmap(lambda x, c: comm.wait(comm.iscatterv(x, c, 0, capacity=mine))))(
            jnp.stack([xs, 2 * xs, xs]), root_counts
        )
        want = jax.vmap(lambda x, c: comm.scatterv(x, c, 0, capacity=mine))(
            jnp.stack([xs, 2 * xs, xs]), root_counts
        )
    else:
        template = jnp.zeros((3, 1, 2), xs.dtype)
        got = jax.jit(jax.vmap(lambda x: comm.wait(comm.iscatterv(x, None, 0, capacity=mine))))(
            template
        )
        want = jax.vmap(lambda x: comm.scatterv(x, None, 0, capacity=mine))(template)
    assert_values(got[0], want[0])
    assert_values(got[1], want[1])


def test_nonblocking_gather_family_overlaps_computation_in_a_loop(comm):
    x = jnp.asarray(own_rows(comm.rank))
    count = own_count(comm.rank)
    for name, blocking, posted in gather_family(comm, count):
        want = blocking(x)[0]

        def step(i, total, posted=posted):
            y, _ = posted(x)  # post, compute meanwhile, wait
            return total + y + 0 * jnp.sum(jnp.sin(x + i))

        total = jax.jit(lambda p=step, w=want: jax.lax.fori_loop(0, 3, p, jnp.zeros_like(w)))()
        assert_values(total, 3 * want), name


def _posted_in_a_step(comm, post):
    """post() and its wait with computation between them, in a jitted fori_loop."""

    def step(i, total):
        request = post()
        busy = jnp.float32(i) * 0
        y, _ = comm.wait(request)
        return total + jnp.sum(y) + busy

    return jax.jit(lambda: jax.lax.fori_loop(0, 2, step, jnp.float32(0)))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_nonblocking_gather_family_errors_at_the_wait(comm, mode):
    """Overflow and invalid counts on one rank: that rank's wait raises, the others
    get their rows; iallgatherv's every rank raises. The next call works."""
    x = jnp.asarray(rank_data(comm.rank, (2, 2)))
    run = (lambda f: jax.block_until_ready(jax.jit(f)())) if mode == "jit" else (lambda f: f())
    last = comm.size - 1
    # iallgatherv: rank `last` has too small a capacity, or rank 0 a bad count
    short = 2 * comm.size - (1 if comm.rank == last else 0)
    with pytest.raises(Exception, match=r"capacity=|add up to \d+ rows"):
        run(lambda: comm.wait(comm.iallgatherv(x, capacity=short)))
    bad = 3 if comm.rank == 0 else 1
    with pytest.raises(Exception, match=r"count=\[3\]|rank 0.s count was refused"):
        run(lambda: comm.wait(comm.iallgatherv(x, capacity=2 * comm.size, count=bad)))
    # igatherv: root overflows; rank `last`'s count is invalid
    if comm.size > 1:
        count = 3 if comm.rank == last else 2
        fn = lambda: comm.wait(comm.igatherv(x, 0, capacity=2 * comm.size, count=count))  # noqa: E731
        if comm.rank == last:
            with pytest.raises(Exception, match=r"count=\[3\] add up to more than x.s 2 rows"):
                run(fn)
        else:
            y, got = run(fn)
            if comm.rank == 0:
                assert list(np.asarray(got)) == [2] * last + [0]
    overflow = comm.rank == 0  # root's capacity is one row short
    short = 2 * comm.size - 1 if overflow else 0
    with pytest.raises(Exception, match="more than capacity=") if overflow else nullcontext():
        run(lambda: comm.wait(comm.igatherv(x, 0, capacity=short)))
    # iscatterv: rank `last` overflows; root's bad counts
    counts = np.full(comm.size, 2, np.int32)
    xs = jnp.asarray(rank_data(0, (2 * comm.size, 2)))
    capacity = 1 if comm.rank == last else 2
    sent = counts if comm.rank == 0 else None
    fn = lambda: comm.wait(comm.iscatterv(xs, sent, 0, capacity=capacity))  # noqa: E731
    if comm.rank == last:
        with pytest.raises(Exception, match=r"more than capacity=1"):
            run(fn)
    else:
        y, _ = run(fn)
        assert_values(y, np.asarray(xs)[2 * comm.rank : 2 * comm.rank + 2])
    bad_counts = np.full(comm.size, -1, np.int32) if comm.rank == 0 else None
    fn = lambda: comm.wait(comm.iscatterv(xs, bad_counts, 0, capacity=2))  # noqa: E731
    if comm.rank == 0:
        with pytest.raises(Exception, match=r"counts=\[-1"):
            run(fn)
    else:
        y, got = run(fn)
        assert int(got) == 0
    y, _ = comm.wait(comm.iallgatherv(x, capacity=2 * comm.size))
    assert_values(y[:2], rank_data(0, (2, 2)))
