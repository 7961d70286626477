"""create_dist_graph and its neighbour collectives, against NumPy on every rank.

The graphs are graph_edges.py's: lists of edges (source, destination) that every
rank knows, in one global order, which is MPI's pairing of a rank's edges."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import rank_data
from graph_edges import GRAPHS, last_isolated, lists
from mpi4py import MPI

import jaxcomm
from jaxcomm import GraphComm, JaxComm
from jaxcomm._native import cpu


def block(rank, j, shape, dtype):
    """Block j of rank's x: different for every rank and block."""
    return rank_data(7 * rank + j, shape, dtype)


def expected(edges, rank, shape, dtype):
    """(neighbor_allgather, neighbor_alltoall) of the blocks above, on `rank`."""
    sources, _ = lists(edges, rank)
    gathered = [block(s, 0, shape, dtype) for s in sources]
    swapped = []
    for k, (s, d) in enumerate(edges):
        if d == rank:  # which of s's destinations this edge is: its block
            swapped.append(block(s, sum(1 for e in edges[:k] if e[0] == s), shape, dtype))
    return stacked(gathered, shape, dtype), stacked(swapped, shape, dtype)


def stacked(blocks, shape, dtype):
    """The blocks as one array (sources or destinations, *shape), also of none."""
    return np.stack(blocks) if blocks else np.zeros((0, *shape), dtype)


def as_form(graph, name, form):
    if form == "blocking":
        return getattr(graph, name)
    post = getattr(graph, "i" + name)
    return lambda x: graph.wait(post(x))


FORMS = ["blocking", "posted"]
CASES = [("float32", (3,)), ("float64", (2, 3)), ("int32", ()), ("complex64", (0,))]


@pytest.mark.parametrize("name", GRAPHS)
def test_the_graph_keeps_its_lists_in_order(comm, graphs, name):
    graph, edges = graphs[name]
    assert isinstance(graph, GraphComm) and isinstance(graph, JaxComm)
    sources, destinations = lists(edges, comm.rank)
    assert graph.sources == tuple(sources) and graph.destinations == tuple(destinations)
    assert all(type(r) is int for r in graph.sources + graph.destinations)
    assert graph.rank == comm.rank and graph.size == comm.size


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("dtype,shape", CASES)
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("form", FORMS)
def test_neighbor_exchanges_match_numpy(comm, graphs, name, dtype, shape, mode, form):
    graph, edges = graphs[name]
    run = jax.jit if mode == "jit" else (lambda f: f)
    x = block(comm.rank, 0, shape, dtype)
    mine = [block(comm.rank, j, shape, dtype) for j in range(len(graph.destinations))]
    blocks = stacked(mine, shape, dtype)
    gathered, swapped = expected(edges, comm.rank, shape, dtype)
    got = run(as_form(graph, "neighbor_allgather", form))(jnp.asarray(x))
    assert got.shape == gathered.shape and got.dtype == gathered.dtype
    np.testing.assert_array_equal(got, gathered)
    got = run(as_form(graph, "neighbor_alltoall", form))(jnp.asarray(blocks))
    assert got.shape == swapped.shape and got.dtype == swapped.dtype
    np.testing.assert_array_equal(got, swapped)


@pytest.mark.parametrize("form", FORMS)
def test_a_pytree_exchanges_each_leaf(comm, graphs, form):
    graph, edges = graphs["random_graph"]
    k = range(len(graph.destinations))
    types = {"a": ((2,), "float32"), "b": ((), "int64")}
    tree = {
        key: jnp.asarray(stacked([block(comm.rank, j, *t) for j in k], *t))
        for key, t in types.items()
    }
    got = jax.jit(as_form(graph, "neighbor_alltoall", form))(tree)
    for key, t in types.items():
        np.testing.assert_array_equal(got[key], expected(edges, comm.rank, *t)[1])


def global_sum(comm, value):
    return comm.mpi.allreduce(float(value))


OPERATIONS = ["neighbor_allgather", "neighbor_alltoall"]


def operand(graph, name, rank, shift=0.0):
    """A float64 x for operation `name` on `rank` of graph."""
    rows = () if name == "neighbor_allgather" else (len(graph.destinations),)
    n = int(np.prod((*rows, 3)))
    return (np.arange(n, dtype=np.float64).reshape((*rows, 3)) * 0.1) + rank + shift


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("form", FORMS)
def test_adjoint_identity_and_jvp(comm, graphs, name, operation, form):
    """<A x, y> summed over ranks equals <x, A^T y> summed: the transpose runs
    over the reversed graph. jvp is the same exchange on the tangent."""
    graph, _ = graphs[name]
    exchange = as_form(graph, operation, form)
    x = jnp.asarray(operand(graph, operation, comm.rank))
    y_shape = jax.eval_shape(graph.__getattribute__(operation), x).shape
    y = jnp.asarray(np.cos(np.arange(int(np.prod(y_shape))) + 3.0 * comm.rank).reshape(y_shape))
    ax, pullback = jax.vjp(exchange, x)
    (aty,) = pullback(y)
    assert aty.shape == x.shape
    left = global_sum(comm, jnp.vdot(ax, y))
    right = global_sum(comm, jnp.vdot(x, aty))
    np.testing.assert_allclose(left, right, rtol=1e-12)
    (jit_aty,) = jax.jit(lambda y: jax.vjp(exchange, x)[1](y))(y)
    np.testing.assert_allclose(jit_aty, aty, rtol=1e-12)
    y0, dy = jax.jit(lambda x, t: jax.jvp(exchange, (x,), (t,)))(x, 3 * x + 1)
    np.testing.assert_allclose(dy, getattr(graph, operation)(3 * x + 1), rtol=1e-12)
    np.testing.assert_allclose(y0, ax)


EPS = 1e-6


def finite_difference_gradient(comm, loss, shapes, x):
    """d(sum over ranks of loss)/d(this rank's x), perturbing one element of one
    rank at a time; shapes[r] is rank r's x's shape."""
    loss = jax.jit(loss)
    grad = np.zeros(x.shape)
    for owner, shape in enumerate(shapes):
        for i in np.ndindex(shape):
            values = []
            for sign in (1, -1):
                xp = x.copy()
                if comm.rank == owner:
                    xp[i] += sign * EPS
                values.append(global_sum(comm, loss(xp)))
            if comm.rank == owner:
                grad[i] = (values[0] - values[1]) / (2 * EPS)
    return grad


@pytest.mark.parametrize("name", ["ring_and_self", "random_graph", "into_zero"])
@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("form", FORMS)
def test_grad_matches_finite_differences(comm, graphs, name, operation, form):
    """Each rank's loss weighs what it received its own way: the gradient flows
    back to each source, with no replicated-value convention."""
    if comm.size > 3:
        pytest.skip("finite differences run on 1 to 3 ranks")
    graph, edges = graphs[name]
    exchange = as_form(graph, operation, form)

    def loss(x):
        y = exchange(x)
        w = 1.0 + jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) * (graph.rank + 1)
        return jnp.sum(jnp.sin(y) * w)

    x = operand(graph, operation, comm.rank, shift=0.3)
    out_degrees = [len(lists(edges, r)[1]) for r in range(comm.size)]
    shapes = [(3,) if operation == "neighbor_allgather" else (k, 3) for k in out_degrees]
    want = finite_difference_gradient(comm, loss, shapes, x)
    np.testing.assert_allclose(jax.grad(loss)(x), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), want, rtol=1e-6, atol=1e-7)


def mpi_calls(fn, *args):
    """The result of fn(*args) and how many MPI calls it made on this rank."""
    jax.block_until_ready(fn(*args))  # compile outside the count
    before = cpu.call_count()
    result = jax.block_until_ready(fn(*args))
    return result, cpu.call_count() - before


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("form", FORMS)
def test_vmap_makes_one_call_per_batch(comm, graphs, name, operation, form):
    graph, _ = graphs[name]
    exchange = as_form(graph, operation, form)
    xs = np.stack([operand(graph, operation, comm.rank, shift=10.0 * b) for b in range(3)])
    loop = np.stack([getattr(graph, operation)(x) for x in xs])
    _, single = mpi_calls(jax.jit(exchange), xs[0])
    for axis in (0, -1):
        batched, calls = mpi_calls(
            jax.jit(jax.vmap(exchange, in_axes=axis)), np.moveaxis(xs, 0, axis)
        )
        np.testing.assert_array_equal(batched, loop)
        assert calls == single


def test_posted_exchange_overlaps_a_jitted_loop(comm, graphs):
    """ineighbor_alltoall posted, computation that needs none of it, then the wait,
    in each step of a jitted fori_loop: the blocking form's values. A graph whose
    ranks send as many blocks as they receive keeps the carry's shape."""
    graph, _ = graphs["ring_and_self"]

    def run(blocking):
        def body(i, b):
            if blocking:
                return graph.neighbor_alltoall(b) + jnp.sin(b)
            request = graph.ineighbor_alltoall(b)
            local = jnp.sin(b)
            return graph.wait(request) + local

        return jax.jit(lambda b: jax.lax.fori_loop(0, 5, body, b))

    blocks = jnp.stack([jnp.arange(3.0), -jnp.arange(3.0)]) + graph.rank
    np.testing.assert_allclose(run(False)(blocks), run(True)(blocks), rtol=1e-12)
    # and its gradient through the loop
    loss = lambda blocking: lambda b: jnp.sum(run(blocking)(b) ** 2)  # noqa: E731
    np.testing.assert_allclose(
        jax.grad(loss(False))(blocks), jax.grad(loss(True))(blocks), rtol=1e-10
    )


@pytest.mark.parametrize("name", ["neighbor_alltoall", "ineighbor_alltoall"])
def test_a_wrong_number_of_blocks_names_the_operation(comm, graphs, name):
    graph, _ = graphs["ring_and_self"]
    message = rf"^{name}: x must have a leading axis of len\(destinations\)=2"
    for x in (jnp.zeros((3, 2)), jnp.zeros(())):
        with pytest.raises(ValueError, match=message):
            getattr(graph, name)(x)


def test_checking_mode_lets_ranks_send_different_numbers_of_blocks(comm):
    """Checking mode compares one block's shape and dtype, which ranks share."""
    edges = last_isolated(comm.size)
    checked = JaxComm(comm, check=True)
    with checked, checked.create_dist_graph(*lists(edges, comm.rank)) as graph:
        assert graph.check
        blocks = jnp.ones((len(graph.destinations), 2))
        want = np.ones((len(graph.sources), 2))
        np.testing.assert_array_equal(graph.neighbor_alltoall(blocks), want)
        np.testing.assert_array_equal(graph.wait(graph.ineighbor_alltoall(blocks)), want)
        np.testing.assert_array_equal(
            jax.grad(lambda b: graph.neighbor_alltoall(b).sum())(blocks),
            np.ones((len(graph.destinations), 2)),
        )


class Subclass(JaxComm):
    def twice(self, x):
        return 2 * self.allreduce(x)


def test_a_subclass_keeps_its_methods_on_a_graph(comm):
    r, n = comm.rank, comm.size
    with Subclass(comm) as mine, mine.create_dist_graph([(r - 1) % n], [(r + 1) % n]) as graph:
        assert isinstance(graph, Subclass) and isinstance(graph, GraphComm)
        np.testing.assert_array_equal(graph.twice(jnp.ones(2)), np.full(2, 2.0 * n))
        with graph.dup() as again:
            assert type(again) is type(graph) and again.sources == graph.sources
        with graph.create_cart([n]) as cart:  # a grid keeps the subclass, not the graph
            assert isinstance(cart, Subclass) and not isinstance(cart, GraphComm)
            with cart.create_dist_graph([r], [r]) as back:
                assert isinstance(back, Subclass) and back.sources == (r,)
    assert jaxcomm.GraphComm is GraphComm and "GraphComm" in jaxcomm.__all__


def test_reorder_keeps_the_graph(comm):
    """With reorder=True each process may take another rank's part: its sources
    are that rank's, and the exchange follows them."""
    r, n = comm.rank, comm.size
    with comm.create_dist_graph([(r - 1) % n, r], [(r + 1) % n, r], reorder=True) as graph:
        g = graph.rank
        assert graph.sources == ((g - 1) % n, g) and graph.destinations == ((g + 1) % n, g)
        got = graph.neighbor_allgather(jnp.asarray(float(g)))
        np.testing.assert_array_equal(got, np.asarray(graph.sources, float))


def test_many_graphs_are_freed(comm):
    # Each graph holds two MPI communicators; MPICH has 2046 context ids left to
    # give, so one graph's leaked per call runs out before the loop ends.
    r, n = comm.rank, comm.size
    for _ in range(1050):
        comm.create_dist_graph([(r - 1) % n], [(r + 1) % n]).free()


def test_a_freed_graph_raises(comm):
    r, n = comm.rank, comm.size
    graph = comm.create_dist_graph([(r - 1) % n], [(r + 1) % n])
    f = jax.jit(jax.grad(lambda x: graph.neighbor_allgather(x).sum()))
    np.testing.assert_array_equal(f(jnp.ones(2)), np.ones(2))
    graph.free()
    with pytest.raises(Exception, match="freed"):
        jax.block_until_ready(f(jnp.ones(2)))


@pytest.mark.parametrize(
    "sources,error,message",
    [
        (5, TypeError, r"sources must be a sequence of ranks, got 5"),
        ("01", TypeError, r"sources must be a sequence of ranks"),
        ({0}, TypeError, r"sources must be a sequence of ranks"),
        ([0.0], TypeError, r"sources\[0\] must be an integer rank, got 0.0"),
        ([True], TypeError, r"sources\[0\] must be an integer rank, got True"),
        ([-1], ValueError, r"sources\[0\]=-1 is not a rank of this communicator"),
        ([0, 99], ValueError, r"sources\[1\]=99 is not a rank of this communicator"),
        ([MPI.PROC_NULL], ValueError, r"sources\[0\]=-?\d+ is not a rank of this communicator"),
    ],
)
def test_create_dist_graph_checks_its_arguments(comm, sources, error, message):
    with pytest.raises(error, match=rf"^create_dist_graph: {message}"):
        comm.create_dist_graph(sources, [])
    with pytest.raises(
        error, match=rf"^create_dist_graph: {message.replace('sources', 'destinations')}"
    ):
        comm.create_dist_graph([], sources)


def test_every_rank_raises_when_one_rank_passes_a_bad_list(comm):
    bad = comm.size - 1
    sources = [comm.size] if comm.rank == bad else []
    expected = (
        r"sources\[0\]"
        if comm.rank == bad
        else rf"invalid sources or destinations on rank\(s\) \[{bad}\]"
    )
    with pytest.raises((ValueError, TypeError), match=expected):
        comm.create_dist_graph(sources, [])
    # the communicator is still usable: every rank left at the same point
    np.testing.assert_array_equal(comm.allreduce(jnp.ones(1)), [comm.size])


def test_an_inconsistent_graph_raises_on_every_rank(comm):
    """Rank 0 sends to the last rank, which does not list it as a source."""
    last = comm.size - 1
    destinations = [last] if comm.rank == 0 else []
    with pytest.raises(ValueError, match=r"create_dist_graph: .*inconsistent"):
        comm.create_dist_graph([], destinations)
    np.testing.assert_array_equal(comm.allreduce(jnp.ones(1)), [comm.size])
