"""neighbor_alltoallv and neighbor_allgatherv on graphs and Cartesian grids,
against NumPy on every rank: each rank's counts and rows derive from its rank, so
every rank computes what each of its sources sends it. The graphs are
graph_edges.py's (edges every rank knows, in one global order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import rank_data
from graph_edges import GRAPHS, lists
from mpi4py import MPI

from jaxcomm import JaxComm


def send_counts(rank, destinations):
    """What `rank` sends each of its destinations: 0 to 3 rows, zeros included."""
    return [(3 * rank + 2 * j + 1) % 4 for j in range(destinations)]


def rows(rank, count, dtype="float32", row=(2,)):
    """x of `rank`, with one spare row that is never sent."""
    return rank_data(rank, (count + 1, *row), dtype)


def gathered_count(rank):
    return [2, 0, 3, 1][rank % 4]


def padded(pieces, capacity, dtype, row):
    got = np.concatenate(pieces) if pieces else np.zeros((0, *row), dtype)
    out = np.zeros((capacity, *row), dtype)
    out[: len(got)] = got
    return out


def expected_graph(edges, rank, capacity, dtype="float32", row=(2,)):
    """(alltoallv's y and counts, allgatherv's y and counts) on `rank`."""
    pieces, counts, gathered, gathered_counts = [], [], [], []
    for k, (s, d) in enumerate(edges):
        if d != rank:
            continue
        _, out = lists(edges, s)
        sent = send_counts(s, len(out))
        j = sum(1 for e in edges[:k] if e[0] == s)  # which of s's destinations
        start = sum(sent[:j])
        pieces.append(rows(s, sum(sent), dtype, row)[start : start + sent[j]])
        counts.append(sent[j])
        c = gathered_count(s)
        gathered.append(rows(s, c, dtype, row)[:c])
        gathered_counts.append(c)
    return (
        padded(pieces, capacity, dtype, row),
        np.array(counts, np.int32),
        padded(gathered, capacity, dtype, row),
        np.array(gathered_counts, np.int32),
    )


CAPACITY = 40
CASES = [("float32", (2,)), ("float64", (2, 3)), ("int32", ()), ("complex64", (0,))]


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("dtype,row", CASES)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_graph_values_match_numpy(comm, graphs, name, dtype, row, mode):
    graph, edges = graphs[name]
    run = jax.jit if mode == "jit" else (lambda f: f)
    sent = send_counts(comm.rank, len(graph.destinations))
    x = rows(comm.rank, sum(sent), dtype, row)
    y, counts, gy, gcounts = expected_graph(edges, comm.rank, CAPACITY, dtype, row)

    got, got_counts = run(lambda x, s: graph.neighbor_alltoallv(x, s, capacity=CAPACITY))(
        jnp.asarray(x), np.array(sent, np.int32)
    )
    assert got.shape == y.shape and got.dtype == y.dtype and got_counts.dtype == np.int32
    np.testing.assert_array_equal(got, y)
    np.testing.assert_array_equal(got_counts, counts)

    c = gathered_count(comm.rank)
    mine = rows(comm.rank, c, dtype, row)
    got, got_counts = run(lambda x, c: graph.neighbor_allgatherv(x, capacity=CAPACITY, count=c))(
        jnp.asarray(mine), np.int32(c)
    )
    np.testing.assert_array_equal(got, gy)
    np.testing.assert_array_equal(got_counts, gcounts)


@pytest.mark.parametrize("name", ["random_graph", "repeated_edges"])
def test_given_counts_and_all_rows_by_default(comm, graphs, name):
    graph, edges = graphs[name]
    sent = send_counts(comm.rank, len(graph.destinations))
    x = jnp.asarray(rows(comm.rank, sum(sent)))
    y, counts, _, _ = expected_graph(edges, comm.rank, CAPACITY)
    got, got_counts = graph.neighbor_alltoallv(x, sent, capacity=CAPACITY, recv_counts=counts)
    np.testing.assert_array_equal(got, y)
    np.testing.assert_array_equal(got_counts, counts)
    # int64 and uint8 counts are read as they are.
    got, _ = graph.neighbor_alltoallv(x, np.array(sent, np.uint8), capacity=CAPACITY)
    np.testing.assert_array_equal(got, y)
    # neighbor_allgatherv sends all of x's rows unless told otherwise.
    got, got_counts = graph.neighbor_allgatherv(x, capacity=5 * CAPACITY)
    sources, _ = lists(edges, comm.rank)
    expected_counts = [sum(send_counts(s, len(lists(edges, s)[1]))) + 1 for s in sources]
    np.testing.assert_array_equal(got_counts, expected_counts)


def cart_expected(cart, capacity, row=(2,)):
    """(alltoallv's y and counts, allgatherv's y and counts) on this rank of a
    grid: slot k's neighbour sent it its block k ^ 1 (the lower neighbour's upper
    block, and so on), and nothing from beyond an edge."""
    ndims = len(cart.dims)
    pieces, counts, gathered, gathered_counts = [], [], [], []
    for k in range(2 * ndims):
        lower, upper = cart.shift(k // 2, 1)
        q = lower if k % 2 == 0 else upper
        if q == MPI.PROC_NULL:
            counts.append(0)
            gathered_counts.append(0)
            continue
        sent = send_counts(q, 2 * ndims)
        j = k ^ 1
        start = sum(sent[:j])
        pieces.append(rows(q, sum(sent), "float32", row)[start : start + sent[j]])
        counts.append(sent[j])
        c = gathered_count(q)
        gathered.append(rows(q, c, "float32", row)[:c])
        gathered_counts.append(c)
    return (
        padded(pieces, capacity, "float32", row),
        np.array(counts, np.int32),
        padded(gathered, capacity, "float32", row),
        np.array(gathered_counts, np.int32),
    )


# Periodic dimensions of 1 or 2 ranks (the second dimension of the last grid,
# and the first one's on 1 or 2 ranks) have one rank as both neighbours.
GRIDS = [([0], [False]), ([0], [True]), ([0, 1], [True, False]), ([0, 1], [False, True])]


@pytest.mark.parametrize("dims,periods", GRIDS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_cartesian_values_match_numpy(comm, dims, periods, mode):
    run = jax.jit if mode == "jit" else (lambda f: f)
    with comm.create_cart(dims, periods) as cart:
        sent = send_counts(cart.rank, 2 * len(cart.dims))
        x = jnp.asarray(rows(cart.rank, sum(sent)))
        y, counts, gy, gcounts = cart_expected(cart, CAPACITY)
        got, got_counts = run(lambda x, s: cart.neighbor_alltoallv(x, s, capacity=CAPACITY))(
            x, np.array(sent, np.int32)
        )
        np.testing.assert_array_equal(got, y)
        np.testing.assert_array_equal(got_counts, counts)
        c = gathered_count(cart.rank)
        got, got_counts = run(lambda x, c: cart.neighbor_allgatherv(x, capacity=CAPACITY, count=c))(
            jnp.asarray(rows(cart.rank, c)), np.int32(c)
        )
        np.testing.assert_array_equal(got, gy)
        np.testing.assert_array_equal(got_counts, gcounts)


def total(value) -> float:
    """The sum over all ranks of a rank's float."""
    return MPI.COMM_WORLD.allreduce(float(value))


def operations(comm_like, rank):
    """name -> (f(x) -> y, x) of each operation on `comm_like`, with float64 rows."""
    n_dest = comm_like._neighborhood.destinations
    sent = np.array(send_counts(rank, n_dest), np.int32)
    x = jnp.asarray(rows(rank, sum(sent), "float64"))
    c = np.int32(gathered_count(rank))
    return {
        "alltoallv": (lambda x: comm_like.neighbor_alltoallv(x, sent, capacity=CAPACITY)[0], x),
        "allgatherv": (
            lambda x: comm_like.neighbor_allgatherv(x, capacity=CAPACITY, count=c)[0],
            jnp.asarray(rows(rank, int(c), "float64")),
        ),
    }


def communicators(comm, graphs):
    yield from (graph for graph, _ in graphs.values())
    for dims, periods in GRIDS:
        yield comm.create_cart(dims, periods)


@pytest.mark.parametrize("operation", ["alltoallv", "allgatherv"])
def test_adjoint_identity_and_jvp(comm, graphs, operation):
    """<ct, A x> = <A^T ct, x> summed over ranks, on every graph and grid; jvp is
    the same exchange on the tangent."""
    rng = np.random.default_rng(comm.rank)
    for on in communicators(comm, graphs):
        f, x = operations(on, comm.rank)[operation]
        ct = jnp.asarray(rng.normal(size=(CAPACITY, *x.shape[1:])))
        y, pullback = jax.vjp(f, x)
        (back,) = pullback(ct)
        assert back.shape == x.shape
        left, right = total(jnp.vdot(ct, y)), total(jnp.vdot(back, x))
        np.testing.assert_allclose(left, right, rtol=1e-12)
        t = jnp.asarray(rng.normal(size=x.shape))
        y2, dy = jax.jvp(f, (x,), (t,))
        np.testing.assert_array_equal(y2, y)
        np.testing.assert_allclose(dy, f(t), rtol=1e-12)
        if not hasattr(on, "destinations"):
            on.free()


@pytest.mark.parametrize("operation", ["alltoallv", "allgatherv"])
def test_grad_matches_finite_differences(comm, graphs, operation):
    """d/dx of the sum over ranks of sum(sin(y)), against central differences of
    the same function, in one direction common to all ranks' x."""
    graph, _ = graphs["random_graph"]
    f, x = operations(graph, comm.rank)[operation]
    loss = jax.jit(lambda x: jnp.sum(jnp.sin(f(x))))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))(x)
    direction = jnp.asarray(np.random.default_rng(comm.rank + 5).normal(size=x.shape))
    eps = 1e-6
    numeric = (total(loss(x + eps * direction)) - total(loss(x - eps * direction))) / (2 * eps)
    np.testing.assert_allclose(total(jnp.vdot(grad, direction)), numeric, rtol=1e-6)


def test_vmap_with_counts_batched_on_some_ranks_only(comm, graphs):
    """One exchange for the batch on every rank whichever operands vary; values
    per member as the member alone gives."""
    graph, edges = graphs["random_graph"]
    sent = np.array(send_counts(comm.rank, len(graph.destinations)), np.int32)
    x = jnp.asarray(rows(comm.rank, sum(sent)))
    xs = jnp.stack([x, 2 * x, 3 * x])
    if comm.rank % 2 == 0:  # batched counts here, the same for every member
        got, got_counts = jax.vmap(lambda x, s: graph.neighbor_alltoallv(x, s, capacity=CAPACITY))(
            xs, np.stack([sent] * 3)
        )
    else:
        got, got_counts = jax.vmap(lambda x: graph.neighbor_alltoallv(x, sent, capacity=CAPACITY))(
            xs
        )
    y, counts, _, _ = expected_graph(edges, comm.rank, CAPACITY)
    for b in range(3):
        np.testing.assert_array_equal(got[b], (b + 1) * y)
        np.testing.assert_array_equal(got_counts[b], counts)
    # Counts that differ per member: member b sends fewer rows (counts // (b+1)).
    batched = np.stack([sent // (b + 1) for b in range(3)])
    got, got_counts = jax.jit(
        jax.vmap(lambda x, s: graph.neighbor_alltoallv(x, s, capacity=CAPACITY))
    )(xs, batched)
    for b in range(3):
        alone, alone_counts = graph.neighbor_alltoallv(xs[b], batched[b], capacity=CAPACITY)
        np.testing.assert_array_equal(got[b], alone)
        np.testing.assert_array_equal(got_counts[b], alone_counts)
    c = gathered_count(comm.rank)
    mine = jnp.asarray(rows(comm.rank, c))
    counts = np.array([c, 0, 1], np.int32) if comm.rank % 2 else np.int32(c)
    axis = 0 if comm.rank % 2 else None
    got, _ = jax.vmap(
        lambda x, c: graph.neighbor_allgatherv(x, capacity=CAPACITY, count=c), in_axes=(0, axis)
    )(jnp.stack([mine] * 3), counts)
    for b in range(3):
        alone, _ = graph.neighbor_allgatherv(
            mine, capacity=CAPACITY, count=counts[b] if comm.rank % 2 else counts
        )
        np.testing.assert_array_equal(got[b], alone)


@pytest.mark.parametrize("how", ["plain", "jvp", "grad", "vjp"])
def test_overflow_is_an_error_on_that_rank_only(comm, graphs, how):
    """Rank 0 (a source of every rank in ring_and_self) sends too many rows to rank
    1 only: rank 1 raises, naming its counts; the others get their rows. Under a
    derivative every rank raises, the others naming rank 1 (docs/variable-size.md)."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    graph, _ = graphs["ring_and_self"]  # destinations: next rank, itself
    big = 5 if comm.rank == 0 else 1
    sent = np.array([big, 1], np.int32)
    x = jnp.asarray(rows(comm.rank, big + 1, "float64"))
    capacity = 3
    whole, _ = graph.neighbor_alltoallv(x, sent, capacity=10)  # nobody overflows
    f = lambda x: graph.neighbor_alltoallv(x, sent, capacity=capacity)[0]  # noqa: E731
    run = {
        "plain": f,
        "jvp": lambda x: jax.jvp(f, (x,), (x,))[1],
        "grad": jax.grad(lambda x: jnp.sum(f(x) ** 2)),
        "vjp": lambda x: jax.vjp(f, x)[0],  # its function never called
    }[how]
    if comm.rank == 1:
        with pytest.raises(Exception, match=r"neighbor_alltoallv.*\[5, 1\].*capacity=3"):
            jax.block_until_ready(run(x))
    elif how != "plain":
        with pytest.raises(
            Exception, match=r"neighbor_alltoallv: rank 1 received more rows than its capacity"
        ):
            jax.block_until_ready(run(x))
    else:
        out = jax.block_until_ready(run(x))
        np.testing.assert_array_equal(out, whole[:capacity])
    assert float(comm.allreduce(jnp.ones(()))) == comm.size  # still in step


@pytest.mark.parametrize(
    "counts,message",
    [([-1, 0], r"send_counts.*-1"), ([2**31, 0], r"send_counts.*2147483648")],
)
def test_invalid_counts_are_named_and_others_finish(comm, graphs, counts, message):
    graph, edges = graphs["ring_and_self"]
    sent = np.array(counts if comm.rank == 0 else [1, 1], np.int64)
    x = jnp.asarray(rows(comm.rank, 3))
    if comm.rank == 0:
        with pytest.raises(Exception, match=message):
            graph.neighbor_alltoallv(x, sent, capacity=CAPACITY)
    else:
        _, got = graph.neighbor_alltoallv(x, sent, capacity=CAPACITY)
        sources, _ = lists(edges, comm.rank)
        # Rank 0 refused its counts and sent nothing.
        assert [int(c) for s, c in zip(sources, got, strict=True) if s == 0] == [0] * sum(
            1 for s in sources if s == 0
        )
    bad = np.int64(-3 if comm.rank == 0 else 1)
    if comm.rank == 0:
        with pytest.raises(Exception, match=r"neighbor_allgatherv.*count.*-3"):
            graph.neighbor_allgatherv(x, capacity=CAPACITY, count=bad)
    else:
        graph.neighbor_allgatherv(x, capacity=CAPACITY, count=bad)


def test_bad_arguments_are_named(comm, graphs):
    graph, _ = graphs["ring_and_self"]
    x = jnp.zeros((4, 2))
    with pytest.raises(TypeError, match=r"neighbor_alltoallv: send_counts .* one per destination"):
        graph.neighbor_alltoallv(x, [1, 1, 1], capacity=4)
    with pytest.raises(TypeError, match=r"neighbor_alltoallv: recv_counts .* one per source"):
        graph.neighbor_alltoallv(x, [1, 1], capacity=4, recv_counts=[1])
    with pytest.raises(ValueError, match=r"neighbor_allgatherv: capacity=-1"):
        graph.neighbor_allgatherv(x, capacity=-1)
    assert not hasattr(JaxComm(), "neighbor_alltoallv")


def test_checking_mode_names_recv_counts_that_do_not_match(comm):
    """Every rank raises the checking error; the rank whose given counts differ
    names them."""
    size = comm.size
    with JaxComm(comm, check=True) as checked:
        graph = checked.create_dist_graph([(comm.rank - 1) % size], [(comm.rank + 1) % size])
        x = jnp.asarray(rows(comm.rank, 4))
        wrong = [2] if comm.rank == 0 else [1]
        with pytest.raises(Exception, match="jaxcomm check: neighbor_alltoallv"):
            graph.neighbor_alltoallv(x, [1], capacity=4, recv_counts=wrong)
        _, counts = graph.neighbor_alltoallv(x, [1], capacity=4, recv_counts=[1])
        np.testing.assert_array_equal(counts, [1])
        graph.free()


# Along a periodic dimension of 1 or 2 ranks one rank is both neighbours: MPI's
# standard delivers the block sent up as the block from below. Open MPI's
# non-blocking neighbour collectives (5.0.11) deliver it as the block from above,
# unlike its blocking ones; jaxcomm sends the two blocks' counts swapped there
# (cpp/pairing.h), so the posted forms below match NumPy and the blocking forms
# on both libraries. A graph's repeated edges pair in order in both forms.


def posted(on):
    """on.neighbor_alltoallv as its non-blocking form, posted and waited."""
    return lambda x, s, **kw: on.wait(on.ineighbor_alltoallv(x, s, **kw))


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_posted_form_matches_numpy(comm, graphs, name, mode):
    graph, edges = graphs[name]
    run = jax.jit if mode == "jit" else (lambda f: f)
    sent = np.array(send_counts(comm.rank, len(graph.destinations)), np.int32)
    x = jnp.asarray(rows(comm.rank, int(sent.sum()), "float64", (3,)))
    y, counts, _, _ = expected_graph(edges, comm.rank, CAPACITY, "float64", (3,))
    for given in (None, counts):
        got, got_counts = run(
            lambda x, s, given=given: posted(graph)(x, s, capacity=CAPACITY, recv_counts=given)
        )(x, sent)
        np.testing.assert_array_equal(got, y)
        np.testing.assert_array_equal(got_counts, counts)
    for dims, periods in GRIDS:
        with comm.create_cart(dims, periods) as cart:
            sent = send_counts(cart.rank, 2 * len(cart.dims))
            y, counts, _, _ = cart_expected(cart, CAPACITY)
            got, got_counts = run(lambda x, s: posted(cart)(x, s, capacity=CAPACITY))(
                jnp.asarray(rows(cart.rank, sum(sent))), np.array(sent, np.int32)
            )
            np.testing.assert_array_equal(got, y)
            np.testing.assert_array_equal(got_counts, counts)


def posted_matches_blocking(on):
    """on's posted neighbor_alltoallv gives the blocking form's values, tangents
    and gradients (its adjoint is a posted exchange too), and a batch's (packed)."""
    sent = np.array(send_counts(on.rank, on._neighborhood.destinations), np.int32)
    x = jnp.asarray(rows(on.rank, int(sent.sum()), "float64"))
    blocking = lambda x: on.neighbor_alltoallv(x, sent, capacity=CAPACITY)[0]  # noqa: E731
    post = lambda x: posted(on)(x, sent, capacity=CAPACITY)[0]  # noqa: E731
    t = jnp.asarray(np.random.default_rng(on.rank).normal(size=x.shape))
    np.testing.assert_array_equal(jax.jvp(post, (x,), (t,))[1], jax.jvp(blocking, (x,), (t,))[1])
    loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))  # noqa: E731
    np.testing.assert_array_equal(jax.jit(jax.grad(loss(post)))(x), jax.grad(loss(blocking))(x))
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_array_equal(jax.vmap(post)(xs), jax.vmap(blocking)(xs))


def test_posted_form_derivatives_and_vmap(comm, graphs):
    """On a graph and on every grid (one rank as both neighbours on some)."""
    for on in communicators(comm, {"random_graph": graphs["random_graph"]}):
        posted_matches_blocking(on)
        if not hasattr(on, "destinations"):
            on.free()


def test_posted_exchange_overlaps_a_jitted_loop(comm, graphs):
    """Each step posts the exchange, computes, then waits: values as the blocking
    exchange gives, step after step."""
    graph, _ = graphs["ring_and_self"]
    sent = np.array(send_counts(comm.rank, len(graph.destinations)), np.int32)
    rows_needed = int(sent.sum())
    x = jnp.asarray(rows(comm.rank, rows_needed))

    def step(with_posted):
        def body(_, carry):
            x, acc = carry
            if with_posted:
                request = graph.ineighbor_alltoallv(x, sent, capacity=CAPACITY)
                acc = acc + jnp.sum(jnp.cos(acc))  # computation meanwhile
                y, _ = graph.wait(request)
            else:
                y, _ = graph.neighbor_alltoallv(x, sent, capacity=CAPACITY)
                acc = acc + jnp.sum(jnp.cos(acc))
            return 0.5 * x + y[: x.shape[0]], acc

        return jax.jit(lambda x: jax.lax.fori_loop(0, 4, body, (x, jnp.float32(0))))

    got, acc = step(True)(x)
    want, want_acc = step(False)(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(acc, want_acc)


def posted_gather(on):
    """on.neighbor_allgatherv as its non-blocking form, posted and waited."""
    return lambda x, **kw: on.wait(on.ineighbor_allgatherv(x, **kw))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_posted_allgatherv_matches_blocking(comm, graphs, mode):
    run = jax.jit if mode == "jit" else (lambda f: f)
    count = gathered_count(comm.rank)
    x = jnp.asarray(rows(comm.rank, count, "float64", (3,)))
    for on in communicators(comm, graphs):
        got = run(lambda x, on=on: posted_gather(on)(x, capacity=CAPACITY, count=count))(x)
        want = on.neighbor_allgatherv(x, capacity=CAPACITY, count=count)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        if not hasattr(on, "destinations"):
            on.free()


def test_posted_allgatherv_derivatives_vmap_and_loop(comm, graphs):
    graph, _ = graphs["random_graph"]
    count = gathered_count(comm.rank)
    x = jnp.asarray(rows(comm.rank, count, "float64"))
    blocking = lambda x: graph.neighbor_allgatherv(x, capacity=CAPACITY, count=count)[0]  # noqa: E731
    post = lambda x: posted_gather(graph)(x, capacity=CAPACITY, count=count)[0]  # noqa: E731
    t = jnp.asarray(np.random.default_rng(comm.rank).normal(size=x.shape))
    np.testing.assert_array_equal(jax.jvp(post, (x,), (t,))[1], jax.jvp(blocking, (x,), (t,))[1])
    loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))  # noqa: E731
    np.testing.assert_array_equal(jax.jit(jax.grad(loss(post)))(x), jax.grad(loss(blocking))(x))
    # counts batched on the odd ranks only
    xs = jnp.stack([x, 2 * x, 3 * x])
    counts = np.array([count, 0, 1][:3] if comm.rank % 2 else [count] * 3, np.int32)
    counts = np.minimum(counts, count)
    got = jax.jit(jax.vmap(lambda x, c: posted_gather(graph)(x, capacity=CAPACITY, count=c)))(
        xs, counts
    )
    want = jax.vmap(lambda x, c: graph.neighbor_allgatherv(x, capacity=CAPACITY, count=c))(
        xs, counts
    )
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])

    def body(i, acc):
        request = graph.ineighbor_allgatherv(x, capacity=CAPACITY, count=count)
        busy = jnp.sum(jnp.cos(acc))  # computation meanwhile
        y, _ = graph.wait(request)
        return acc + y + 0 * busy

    total = jax.jit(lambda: jax.lax.fori_loop(0, 3, body, jnp.zeros((CAPACITY, 2))))()
    np.testing.assert_array_equal(total, 3 * blocking(x))


def test_posted_allgatherv_errors_on_that_rank_at_the_wait(comm, graphs):
    """Rank 0's invalid count, rank 1's overflow: each raises at its wait; the
    others get their rows."""
    graph, _ = graphs["ring_and_self"]  # sources: previous rank, itself
    x = jnp.asarray(rows(comm.rank, 3))
    whole, _ = graph.neighbor_allgatherv(x, capacity=CAPACITY, count=3)
    bad = np.int64(-3 if comm.rank == 0 else 3)
    request = graph.ineighbor_allgatherv(x, capacity=CAPACITY, count=bad)
    if comm.rank == 0:
        with pytest.raises(Exception, match=r"ineighbor_allgatherv.*count.*-3"):
            graph.wait(request)
    else:
        graph.wait(request)
    capacity = 5 if comm.rank == comm.size - 1 else 6  # two sources of 3 rows
    request = graph.ineighbor_allgatherv(x, capacity=capacity, count=3)
    if comm.rank == comm.size - 1:
        with pytest.raises(Exception, match=r"more than capacity=5"):
            jax.block_until_ready(graph.wait(request))
    else:
        np.testing.assert_array_equal(graph.wait(request)[0], whole[:6])
