"""Checking mode: mismatched calls across ranks become exceptions on every rank
involved, naming both sides, and the communicator keeps working afterwards."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import assert_values, rank_data
from mpi4py import MPI

from jaxcomm import JaxComm

F32 = np.float32


@pytest.fixture(scope="module")
def checked():
    comm = JaxComm(MPI.COMM_WORLD, check=True)
    yield comm
    comm.free()


def needs_ranks(comm, n):
    if comm.size < n:
        pytest.skip(f"needs {n} ranks")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "name",
    ["allreduce", "reduce", "scan", "bcast", "gather", "allgather", "reduce_scatter", "alltoall"],
)
def test_matching_calls_give_normal_results(checked, name, jit):
    plain = JaxComm(MPI.COMM_WORLD)
    shape = (checked.size, 2)
    x = jnp.asarray(rank_data(checked.rank, shape))
    fn = getattr(checked, name)
    got = (jax.jit(fn) if jit else fn)(x)
    assert_values(got, np.asarray(getattr(plain, name)(x)))
    plain.free()


def test_shape_mismatch_names_both_ranks(checked):
    needs_ranks(checked, 2)
    x = jnp.ones(3 + (checked.rank == 1), F32)
    pattern = (
        r"rank 1 called allreduce\(float32\[4\], op=sum\) "
        r"while rank 0 called allreduce\(float32\[3\], op=sum\)"
    )
    with pytest.raises(Exception, match=pattern):
        jax.block_until_ready(checked.allreduce(x))
    assert_values(checked.allreduce(jnp.ones(2, F32)), np.full(2, checked.size, F32))


def test_different_operations(checked):
    needs_ranks(checked, 2)
    x = jnp.ones(3, F32)
    call = checked.bcast if checked.rank == 0 else checked.allreduce
    with pytest.raises(
        Exception,
        match=r"rank 1 called allreduce\(.*\) while rank 0 called bcast\(float32\[3\], root=0\)",
    ):
        jax.block_until_ready(jax.jit(call)(x))


# Small leaves of one dtype travel as one message outside checking mode: leaves
# that differ between ranks but add up to the same size must still show.
SPLIT_LEAVES = {
    "allreduce": lambda comm, x: comm.allreduce(x),
    "bcast": lambda comm, x: comm.bcast(x, root=0),
    "iallreduce": lambda comm, x: comm.wait(comm.iallreduce(x)),
    "ibcast": lambda comm, x: comm.wait(comm.ibcast(x, root=0)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", SPLIT_LEAVES)
def test_leaves_that_differ_but_add_up_alike_are_caught(checked, name, jit):
    needs_ranks(checked, 2)
    first, second = (1, 2) if checked.rank == 1 else (2, 1)  # three elements each
    x = (jnp.full(first, 7.0, F32), jnp.full(second, 9.0, F32))
    call = partial(SPLIT_LEAVES[name], checked)
    pattern = (
        rf"rank 1 called {name}\(float32\[1\].*\) "
        rf"while rank 0 called {name}\(float32\[2\].*\)"
    )
    with pytest.raises(Exception, match=pattern):
        jax.block_until_ready((jax.jit(call) if jit else call)(x))
    # Every rank raised at the same call: the communicator goes on in step.
    assert_values(checked.allreduce(jnp.ones(2, F32)), np.full(2, checked.size, F32))


class Ordered:
    """A user's container registered without keys, whose leaves' order is its
    static data's (its dict's insertion order)."""

    def __init__(self, named: dict):
        self.named = named


jax.tree_util.register_pytree_node(
    Ordered,
    lambda o: (list(o.named.values()), tuple(o.named)),
    lambda names, leaves: Ordered(dict(zip(names, leaves, strict=True))),
)

# A pytree's leaves pair across ranks by position: a pytree whose leaves differ in
# number, names or order from its peers' must raise on every rank, also where the
# peers' next call is shaped like its extra leaf. Rank 0's (pytree, what it is
# called in the error) and the others' (the same).
STRUCTURES = {
    "extra_leaf": (
        lambda x: (x, x),
        r"pytree=2 leaves #\w+: \[0\], \[1\]",
        lambda x: (x,),
        r"pytree=1 leaf #\w+: \[0\]",
    ),
    "other_names": (
        lambda x: {"b": x, "w": x},
        r"pytree=2 leaves #\w+: \['b'\], \['w'\]",
        lambda x: {"c": x, "w": x},
        r"pytree=2 leaves #\w+: \['c'\], \['w'\]",
    ),
    "lone_array": (
        lambda x: {"w": x},
        r"pytree=1 leaf #\w+: \['w'\]",
        lambda x: x,
        r"float32\[3\]",
    ),
    "no_leaves": (
        lambda x: (),
        r"pytree=0 leaves #\w+",
        lambda x: (x,),
        r"pytree=1 leaf #\w+: \[0\]",
    ),
    # The paths are positions alike; the static data says the order differs.
    "order_without_keys": (
        lambda x: Ordered({"w": x, "b": 2 * x}),
        r"pytree=2 leaves #\w+: \[0\], \[1\]",
        lambda x: Ordered({"b": 2 * x, "w": x}),
        r"pytree=2 leaves #\w+: \[0\], \[1\]",
    ),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", SPLIT_LEAVES)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_pytrees_whose_structure_differs_are_caught(checked, name, structure, jit):
    needs_ranks(checked, 2)
    first, first_named, other, other_named = STRUCTURES[structure]
    call = partial(SPLIT_LEAVES[name], checked)
    x = jnp.arange(3, dtype=F32)

    def step(x):
        if checked.rank == 0:
            return call(first(x))
        # The peers' next call is alike: without the check, rank 0's extra leaf
        # would pair with it silently.
        return call(other(x)), call(x)

    pattern = (
        rf"rank 1 called {name}\({other_named}.*\) while rank 0 called {name}\({first_named}\)"
    )
    with pytest.raises(Exception, match=pattern):
        jax.block_until_ready((jax.jit(step) if jit else step)(x))
    # Every rank raised at the same call: the communicator goes on in step.
    assert_values(checked.allreduce(jnp.ones(2, F32)), np.full(2, checked.size, F32))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", SPLIT_LEAVES)
def test_pytrees_of_one_structure_give_normal_results(checked, name, jit):
    call = partial(SPLIT_LEAVES[name], checked)
    x = {"b": jnp.full(2, checked.rank + 1.0, F32), "w": [jnp.arange(3, dtype=F32)]}
    got = (jax.jit(call) if jit else call)(x)
    ranks = np.arange(checked.size) + 1.0
    reduced = "allreduce" in name
    assert_values(got["b"], np.full(2, ranks.sum() if reduced else 1.0, F32))
    assert_values(got["w"][0], np.arange(3, dtype=F32) * (checked.size if reduced else 1))


@pytest.mark.parametrize("name", SPLIT_LEAVES)
def test_keys_held_equal_are_one_structure(checked, name):
    """Keys that Python holds equal are one key, however each process writes them."""
    key = [np.int64(1), 1.0, True][min(checked.rank, 2)]
    group = frozenset([1, 9] if checked.rank == 0 else [9, 1])  # its text: {1, 9} or {9, 1}
    x = ({key: jnp.full(2, checked.rank + 1.0, F32)}, {group: jnp.arange(3, dtype=F32)})
    first, second = partial(SPLIT_LEAVES[name], checked)(x)
    ranks = np.arange(checked.size) + 1.0
    reduced = "allreduce" in name
    assert_values(next(iter(first.values())), np.full(2, ranks.sum() if reduced else 1.0, F32))
    assert_values(second[group], np.arange(3, dtype=F32) * (checked.size if reduced else 1))


def test_none_is_refused_on_the_rank_that_passes_it(checked):
    """mpi4py's None off the root holds no array: refused before any call."""
    for call in (checked.bcast, checked.allreduce, checked.ibcast):
        with pytest.raises(ValueError, match=r"(bcast|allreduce): x is None"):
            call(None)
    assert_values(checked.allreduce(jnp.ones(2, F32)), np.full(2, checked.size, F32))


def test_root_and_op_mismatch(checked):
    needs_ranks(checked, 2)
    x = jnp.ones(2, F32)
    with pytest.raises(
        Exception,
        match=r"rank 1 called reduce\(float32\[2\], op=max, root=0\) "
        r"while rank 0 called reduce\(float32\[2\], op=sum, root=0\)",
    ):
        jax.block_until_ready(checked.reduce(x, op=MPI.SUM if checked.rank == 0 else MPI.MAX))
    with pytest.raises(
        Exception, match=r"root=1\) while rank 0 called bcast\(float32\[2\], root=0\)"
    ):
        jax.block_until_ready(checked.bcast(x, root=min(checked.rank, 1)))


def test_dtype_mismatch(checked):
    needs_ranks(checked, 2)
    x = jnp.ones(2, jnp.float32 if checked.rank == 0 else jnp.int32)
    with pytest.raises(
        Exception,
        match=r"rank 1 called allgather\(int32\[2\]\) "
        r"while rank 0 called allgather\(float32\[2\]\)",
    ):
        jax.block_until_ready(checked.allgather(x))


def test_recv_size_mismatch_names_both_sides(checked):
    needs_ranks(checked, 2)
    if checked.rank == 0:
        checked.send(jnp.arange(4.0, dtype=F32), dest=1, tag=7)
    elif checked.rank == 1:
        with pytest.raises(
            Exception,
            match=r"recv on rank 1 receives into float32\[3\] "
            r"but rank 0 sent float32\[4\] \(tag 7\)",
        ):
            jax.block_until_ready(checked.recv(jnp.zeros(3, F32), source=MPI.ANY_SOURCE, tag=7))
    checked.barrier()


def test_recv_dtype_mismatch(checked):
    needs_ranks(checked, 2)
    if checked.rank == 0:
        jax.jit(lambda x: checked.send(x, dest=1) and None)(jnp.arange(4, dtype=jnp.int32))
    elif checked.rank == 1:
        with pytest.raises(
            Exception, match=r"receives into float32\[4\] but rank 0 sent int32\[4\]"
        ):
            jax.block_until_ready(checked.recv(jnp.zeros(4, F32), source=0))
    checked.barrier()


def test_sendrecv_mismatch_raises_on_the_receiving_side(checked):
    needs_ranks(checked, 2)
    right, left = (checked.rank + 1) % checked.size, (checked.rank - 1) % checked.size
    # Rank 0 sends 5 elements where its right neighbour expects 3; everyone else agrees.
    x = jnp.ones(5 if checked.rank == 0 else 3, F32)
    call = lambda: jax.block_until_ready(  # noqa: E731
        checked.sendrecv(x, jnp.zeros(3, F32), source=left, dest=right)
    )
    if checked.rank == 1:
        with pytest.raises(
            Exception,
            match=r"sendrecv on rank 1 receives into float32\[3\] but rank 0 sent float32\[5\]",
        ):
            call()
    else:
        assert_values(call(), np.ones(3, F32))
    checked.barrier()


def test_matching_p2p_still_works(checked):
    needs_ranks(checked, 2)
    right, left = (checked.rank + 1) % checked.size, (checked.rank - 1) % checked.size
    got = jax.jit(lambda x: checked.sendrecv(x, source=left, dest=right))(
        jnp.full(3, checked.rank, F32)
    )
    assert_values(got, np.full(3, left, F32))
    if checked.rank == 0:
        checked.send(jnp.arange(3.0, dtype=F32), dest=1, tag=2)
    elif checked.rank == 1:
        got, status = checked.recv(jnp.zeros(3, F32), return_status=True)
        assert_values(got, np.arange(3.0, dtype=F32))
        assert (int(status.source), int(status.tag)) == (0, 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_isend_posts_its_header_without_waiting(checked, jit):
    """An isend returns before its receive is posted, header included: on 1 rank
    it sends to itself, and a blocking send of the header would wait forever."""
    right, left = (checked.rank + 1) % checked.size, (checked.rank - 1) % checked.size

    def ring(x):
        sent = checked.isend(x, dest=right, tag=4)
        got = checked.recv(jnp.zeros_like(x), source=left, tag=4)
        checked.wait(sent)
        return got

    got = (jax.jit(ring) if jit else ring)(jnp.full(3, checked.rank, F32))
    assert_values(got, np.full(3, left, F32))


def test_gradients_of_messages_received_from_any_tag(checked):
    """The reverse pass's messages go back with the tags read at run time, headers too."""
    from test_autodiff import tags_crossed

    for receive in ("recv", "irecv"):
        loss = partial(tags_crossed, checked, send="isend", receive=receive, second_tag=MPI.ANY_TAG)
        right = (checked.rank + 1) % checked.size
        dx, dy = jax.jit(jax.grad(loss, (0, 1)))(jnp.ones(2), jnp.ones(2))
        assert_values(dx, np.full(2, 3.0 * (right + 1)))
        assert_values(dy, np.full(2, 500.0 * (right + 1)))
