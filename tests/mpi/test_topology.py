"""create_cart, CartComm.shift and halo_exchange; subclasses keep their type."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI
from test_autodiff import finite_difference_jacobian

from jaxcomm import CartComm, GraphComm, JaxComm


class Subclass(JaxComm):
    def twice(self, x):
        return 2 * self.allreduce(x)


def local_block(comm, interior=3, width=1):
    """Interior cells hold 10 * rank + position; halos start at -1."""
    block = np.full(interior + 2 * width, -1.0)
    block[width:-width] = 10.0 * comm.rank + np.arange(interior)
    return block


@pytest.mark.parametrize("periodic", [True, False])
def test_halo_exchange_1d(comm, periodic):
    with comm.create_cart([comm.size], [periodic]) as cart:
        assert isinstance(cart, CartComm) and cart.coords == (cart.rank,)
        lower, upper = cart.shift(0)
        x = local_block(cart)
        result = np.asarray(jax.jit(lambda x: cart.halo_exchange(x, axis=0))(x))
        expected = x.copy()
        if lower != MPI.PROC_NULL:
            expected[0] = 10.0 * lower + 2
        if upper != MPI.PROC_NULL:
            expected[-1] = 10.0 * upper
        np.testing.assert_array_equal(result, expected)
        if not periodic:
            assert (lower == MPI.PROC_NULL) == (cart.rank == 0)


def test_halo_exchange_2d_grid(comm):
    with comm.create_cart([0, 0], [True, True]) as cart:
        assert np.prod(cart.dims) == comm.size and len(cart.coords) == 2
        x = jnp.full((4, 5), float(cart.rank))
        y = jax.jit(lambda x: cart.halo_exchange(cart.halo_exchange(x, axis=0), axis=1))(x)
        for direction, axis in [(0, 0), (1, 1)]:
            lower, upper = cart.shift(direction)
            lower_halo = np.take(np.asarray(y), 0, axis=axis)[1:-1]
            upper_halo = np.take(np.asarray(y), -1, axis=axis)[1:-1]
            np.testing.assert_array_equal(lower_halo, float(lower))
            np.testing.assert_array_equal(upper_halo, float(upper))


@pytest.mark.parametrize("periodic", [True, False])
def test_halo_exchange_grad_and_vmap(comm, periodic):
    with comm.create_cart([comm.size], [periodic]) as cart:

        def loss(x):
            y = cart.halo_exchange(x, axis=0, width=2)
            return jnp.sum(jnp.sin(y) * (1.0 + cart.rank + jnp.arange(y.size)))

        x = np.linspace(0.1, 1.0, 8) + cart.rank
        expected = finite_difference_jacobian(cart, loss, False, x)
        np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), expected, rtol=1e-6, atol=1e-7)
        xs = np.stack([x, 2 * x, 3 * x])
        exchange = lambda x: cart.halo_exchange(x, axis=0, width=2)  # noqa: E731
        loop = np.stack([exchange(v) for v in xs])
        np.testing.assert_array_equal(jax.jit(jax.vmap(exchange))(xs), loop)


def test_a_grid_that_differs_between_ranks_is_refused_on_every_rank(comm):
    """MPI would make the grid each rank asks for, and their neighbour exchanges
    would then wait for each other for ever: every rank raises instead."""
    if comm.size == 1:
        pytest.skip("needs a second rank to differ from")
    periods = [comm.rank != 1]
    with pytest.raises(ValueError, match=r"rank 1 asks for dims \[\d+\], periods \[False\]"):
        comm.create_cart([comm.size], periods)
    dims = [comm.size + 1] if comm.rank == 1 else [comm.size]  # wrong on rank 1 only
    which = "do not fit" if comm.rank == 1 else r"invalid dims or periods on rank\(s\) \[1\]"
    with pytest.raises(ValueError, match=which):
        comm.create_cart(dims)
    with comm.create_cart([comm.size], [True]) as cart:  # the ranks are still in step
        np.testing.assert_array_equal(cart.allreduce(jnp.ones(2)), np.full(2, comm.size))


def test_halo_too_wide_raises(comm):
    with comm.create_cart([comm.size]) as cart:
        with pytest.raises(ValueError, match="width=2 halos do not fit"):
            cart.halo_exchange(jnp.zeros(5), axis=0, width=2)
        with pytest.raises(ValueError, match="direction=3"):
            cart.shift(3)


def test_create_cart_checks_dims(comm):
    with pytest.raises(ValueError, match="do not fit"):
        comm.create_cart([comm.size + 1])
    with pytest.raises(ValueError, match="differ in length"):
        comm.create_cart([comm.size], [True, False])


def test_derived_communicators_keep_the_subclass(comm):
    with Subclass(comm) as mine:
        with mine.dup() as dup, mine.create_cart([mine.size]) as cart:
            assert type(dup) is Subclass
            assert isinstance(cart, Subclass) and isinstance(cart, CartComm)
            np.testing.assert_array_equal(cart.twice(jnp.ones(2)), np.full(2, 2.0 * comm.size))
            with cart.dup() as again:
                assert type(again) is type(cart)
        part = mine.split(mine.rank % 2)
        assert type(part) is Subclass
        part.free()


def test_split_of_a_grid_or_graph_has_no_topology(comm):
    """MPI_Comm_split's parts have no topology: split on a CartComm or GraphComm
    gives the class without its methods, which works like any communicator."""
    r, n = comm.rank, comm.size
    with Subclass(comm) as mine:
        made = [mine.create_cart([n], [True]), mine.create_dist_graph([(r - 1) % n], [(r + 1) % n])]
        for topo in made:
            part = topo.split(r % 2, key=r)
            assert type(part) is Subclass
            members = [q for q in range(n) if q % 2 == r % 2]
            np.testing.assert_array_equal(part.twice(jnp.ones(2)), np.full(2, 2.0 * len(members)))
            part.free()
            topo.free()


def test_a_communicator_without_the_topology_is_refused_and_freed(comm):
    """CartComm and GraphComm refuse a communicator without their topology, and
    free the duplicate they made of it."""
    freed = []

    class Watched(JaxComm):
        def free(self):
            freed.append(type(self).__name__)
            super().free()

    for form in (CartComm, GraphComm):
        cls = type(f"Watched{form.__name__}", (form, Watched), {})
        with pytest.raises(TypeError, match=rf"Watched{form.__name__}: comm must have a"):
            cls(comm)
    assert freed == ["WatchedCartComm", "WatchedGraphComm"]
    np.testing.assert_array_equal(comm.allreduce(jnp.ones(1)), np.full(1, comm.size))


def test_many_communicators_are_freed(comm):
    # MPICH has 2046 communicator context ids left to give: one leaked per call
    # runs out before the loop ends.
    for _ in range(2100):
        comm.create_cart([comm.size]).free()


def grid_shapes(size):
    """1-d periodic and not; 2-d with a periodic first dimension; 2-d whose
    periodic second dimension of one rank makes each rank its own neighbour."""
    return [([size], [True]), ([size], [False]), ([0, 0], [True, False]), ([size, 1], [True, True])]


def neighbour_list(cart):
    """MPI's order: along each dimension, the lower then the upper neighbour."""
    return [rank for d in range(len(cart.dims)) for rank in cart.shift(d)]


FORMS = ["blocking", "posted"]


def as_form(cart, name, form):
    """cart's operation `name`: blocking, or its non-blocking form posted and waited."""
    if form == "blocking":
        return getattr(cart, name)
    post = getattr(cart, "i" + name)
    return lambda x: cart.wait(post(x))


@pytest.mark.parametrize("shape", range(4))
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("form", FORMS)
def test_neighbor_allgather_and_alltoall_match_numpy(comm, shape, mode, form):
    dims, periods = grid_shapes(comm.size)[shape]
    with comm.create_cart(dims, periods) as cart:
        k = 2 * len(cart.dims)
        x = np.arange(3.0, dtype=np.float32) + 10 * cart.rank
        blocks = np.stack([x + 100 * j for j in range(k)])
        run = jax.jit if mode == "jit" else (lambda f: f)
        got = run(as_form(cart, "neighbor_allgather", form))(jnp.asarray(x))
        swapped = run(as_form(cart, "neighbor_alltoall", form))(jnp.asarray(blocks))
        for j, rank in enumerate(neighbour_list(cart)):
            if rank == MPI.PROC_NULL:
                assert not np.asarray(got[j]).any() and not np.asarray(swapped[j]).any()
                continue
            theirs = np.arange(3.0, dtype=np.float32) + 10 * rank
            np.testing.assert_array_equal(got[j], theirs)
            # Neighbour j sent me its block for the opposite direction: j ^ 1.
            np.testing.assert_array_equal(swapped[j], theirs + 100 * (j ^ 1))


@pytest.mark.parametrize("periodic", [True, False])
@pytest.mark.parametrize("form", FORMS)
def test_neighbor_collectives_grad_jvp_and_vmap(comm, periodic, form):
    with comm.create_cart([comm.size], [periodic]) as cart:
        x = jnp.arange(4.0) + cart.rank
        blocks = jnp.stack([x, 2 * x])
        w = 1.0 + jnp.arange(8.0).reshape(2, 4) * (cart.rank + 1)
        allgather = as_form(cart, "neighbor_allgather", form)
        alltoall = as_form(cart, "neighbor_alltoall", form)

        def gathered(x):
            return jnp.sum(allgather(x) * w)

        def swapped(b):
            return jnp.sum(alltoall(b) * w)

        lower, upper = cart.shift(0)
        # My x sits in slot 1 of my lower neighbour (I am its upper one), slot 0
        # of my upper neighbour; the weights there are theirs.
        weight = lambda rank, slot: 1.0 + (4 * slot + jnp.arange(4.0)) * (rank + 1)  # noqa: E731
        want = sum(
            (weight(r, slot) for r, slot in ((lower, 1), (upper, 0)) if r != MPI.PROC_NULL),
            jnp.zeros(4),
        )
        np.testing.assert_allclose(jax.grad(gathered)(x), want)
        np.testing.assert_allclose(jax.jit(jax.grad(gathered))(x), want)
        pairs = ((lower, 1), (upper, 0))
        want_blocks = jnp.stack(
            [weight(r, slot) if r != MPI.PROC_NULL else jnp.zeros(4) for r, slot in pairs]
        )
        np.testing.assert_allclose(jax.jit(jax.grad(swapped))(blocks), want_blocks)
        y, dy = jax.jvp(alltoall, (blocks,), (3 * blocks,))
        np.testing.assert_allclose(dy, 3 * y)
        y, dy = jax.jvp(allgather, (x,), (3 * x,))
        np.testing.assert_allclose(dy, 3 * y)
        batch = jnp.stack([x, x + 5])
        np.testing.assert_array_equal(
            jax.vmap(allgather)(batch),
            jnp.stack([cart.neighbor_allgather(x), cart.neighbor_allgather(x + 5)]),
        )
        np.testing.assert_array_equal(
            jax.vmap(alltoall)(jnp.stack([blocks, -blocks])),
            jnp.stack([cart.neighbor_alltoall(blocks), cart.neighbor_alltoall(-blocks)]),
        )


@pytest.mark.parametrize("name", ["neighbor_alltoall", "ineighbor_alltoall"])
def test_neighbor_alltoall_checks_its_blocks(comm, name):
    message = rf"^{name}: x must have a leading axis of 2"
    with comm.create_cart([comm.size], [True]) as cart, pytest.raises(ValueError, match=message):
        getattr(cart, name)(jnp.zeros((3, 2)))


def test_posted_neighbor_exchange_overlaps_a_jitted_loop(comm):
    """A halo-like exchange posted, overlapped with computation and waited in each
    step of a jitted fori_loop; the same values as the blocking form."""
    with comm.create_cart([comm.size], [True]) as cart:

        def step(blocking):
            def body(i, b):
                if blocking:
                    return cart.neighbor_alltoall(b) + jnp.sin(b)
                request = cart.ineighbor_alltoall(b)
                local = jnp.sin(b)  # depends on neither the post nor the wait
                return cart.wait(request) + local

            return jax.jit(lambda b: jax.lax.fori_loop(0, 5, body, b))

        blocks = jnp.stack([jnp.arange(3.0), -jnp.arange(3.0)]) + cart.rank
        np.testing.assert_allclose(step(False)(blocks), step(True)(blocks), rtol=1e-6)
