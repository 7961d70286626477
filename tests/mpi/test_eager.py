"""The eager shortcut: a JaxComm call on one concrete array, or on a pytree of them,
that repeats an earlier call's signature (op, parameters, structure, shapes,
dtypes, devices) skips the argument checks and goes straight to the host code. It
must give the new call's values, fall back to the full path for anything else, and
never run while a trace is active. Eager pytree calls send the messages a jitted
call sends."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import COLLECTIVES, FLOAT, assert_values, expected_collective, rank_data

from jaxcomm import _checks, _eager
from jaxcomm._fusion import FUSE_BELOW_BYTES

pytestmark = pytest.mark.skipif(not _eager.ENABLED, reason="JAXCOMM_EAGER=jit: no direct path")


@pytest.fixture
def full_path_calls(monkeypatch):
    """How many JaxComm calls have gone through argument handling (not the shortcut),
    starting from an empty cache of prepared calls (whatever tests ran before)."""
    monkeypatch.setattr(_eager, "_prepared_calls", _eager._PreparedCalls(64))
    calls = []
    arrays = _checks.arrays

    def counted(operation, *args, **kwargs):
        calls.append(operation)
        return arrays(operation, *args, **kwargs)

    monkeypatch.setattr(_checks, "arrays", counted)
    return calls


def collective_input(name, rank, size, seed):
    """Rank `rank`'s input to collective `name` (rank 0 is the root), varying with seed."""
    if name in ("alltoall", "reduce_scatter") or (name == "scatter" and rank == 0):
        return rank_data(rank + seed, (size, 2), "int32")
    return rank_data(rank + seed, (2,), "int32")


@pytest.mark.parametrize("name", COLLECTIVES)
def test_repeated_collective_gives_the_new_values(comm, name, full_path_calls):
    fn = getattr(comm, name)
    for seed in (0, 10, 20):
        inputs = [collective_input(name, r, comm.size, seed) for r in range(comm.size)]
        got = fn(jnp.asarray(inputs[comm.rank]))
        assert isinstance(got, jax.Array)
        assert_values(got, expected_collective(name, comm.rank, inputs))
    assert len(full_path_calls) == 1  # the first call only


def collective_tree(name, rank, size, seed):
    """A pytree for collective `name`: two small int32 arrays (fused into one message
    by element-wise ops), a float32 one, and an int32 one too large to fuse."""
    large = (FUSE_BELOW_BYTES // 4 + 1,)
    if name in ("alltoall", "reduce_scatter") or (name == "scatter" and rank == 0):
        large = (size, *large)
    return {
        "a": collective_input(name, rank, size, seed),
        "b": [collective_input(name, rank, size, seed + 1).astype(np.float32)],
        "c": (collective_input(name, rank, size, seed + 2), rank_data(rank + seed, large, "int32")),
    }


def expected_tree(name, rank, trees):
    return jax.tree.map(lambda *inputs: expected_collective(name, rank, list(inputs)), *trees)


@pytest.mark.parametrize("name", COLLECTIVES)
def test_repeated_pytree_collective_gives_the_new_values(comm, name, full_path_calls):
    fn = getattr(comm, name)
    for seed in (0, 10, 20):
        trees = [collective_tree(name, r, comm.size, seed) for r in range(comm.size)]
        got = fn(jax.tree.map(jnp.asarray, trees[comm.rank]))
        assert jax.tree.structure(got) == jax.tree.structure(trees[0])
        jax.tree.map(assert_values, got, expected_tree(name, comm.rank, trees))
    assert len(full_path_calls) == 1  # the first call only


@pytest.mark.parametrize("name", ["allreduce", "bcast", "scan", "allgather"])
def test_eager_and_jitted_pytree_calls_send_the_same_messages(comm, name):
    """Even ranks call eagerly (the full path, then the shortcut), odd ranks through
    jit: different messages on the two would mismatch or hang."""
    fn = getattr(comm, name)
    if comm.rank % 2 == 1:
        fn = jax.jit(fn)
    for seed in (0, 10):
        trees = [collective_tree(name, r, comm.size, seed) for r in range(comm.size)]
        got = fn(jax.tree.map(jnp.asarray, trees[comm.rank]))
        jax.tree.map(assert_values, got, expected_tree(name, comm.rank, trees))


def test_repeated_sendrecv_and_recv_give_new_values_and_status(comm, full_path_calls):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for seed in (0, 10, 20):
        x = jnp.full(3, seed + comm.rank)
        out, status = comm.sendrecv(
            x, source=left, dest=right, sendtag=3, recvtag=3, return_status=True
        )
        assert_values(out, np.full(3, seed + left, out.dtype))
        assert isinstance(status.source, jax.Array) and status.source.dtype == np.int32
        assert (int(status.source), int(status.tag)) == (left, 3)

        if comm.size == 1:
            continue  # a blocking send to oneself could wait for ever
        # A ring of send/recv: even ranks send first, so no cycle of receives forms.
        x = jnp.full(2, float(seed + comm.rank))
        if comm.rank % 2 == 0:
            comm.send(x, dest=right, tag=7)
        got, status = comm.recv(jnp.zeros(2), source=left, tag=7, return_status=True)
        if comm.rank % 2 == 1:
            comm.send(x, dest=right, tag=7)
        assert_values(got, np.full(2, float(seed + left), FLOAT))
        assert (int(status.source), int(status.tag)) == (left, 7)
    assert len(full_path_calls) == (1 if comm.size == 1 else 3)


def test_repeated_pytree_sendrecv_gives_new_values_and_keeps_its_checks(comm, full_path_calls):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for seed in (0, 10, 20):
        tree = {"a": jnp.full(3, float(seed + comm.rank)), "b": [jnp.arange(2) + seed + comm.rank]}
        out, status = comm.sendrecv(
            tree, source=left, dest=right, sendtag=4, recvtag=4, return_status=True
        )
        assert_values(out["a"], np.full(3, float(seed + left), FLOAT))
        assert_values(out["b"][0], np.arange(2, dtype=out["b"][0].dtype) + seed + left)
        assert (int(status.source), int(status.tag)) == (left, 4)
    # Checking the templates (sendrecv's own) flattens the pytree each time; the
    # argument handling of _apply ran for the first call only.
    assert full_path_calls.count("sendrecv") == 3 + 1
    # A recvbuf of another structure is refused, though its leaves are alike.
    with pytest.raises(ValueError, match="recvbuf's structure"):
        comm.sendrecv(tree, recvbuf=[tree["a"], tree["b"][0]], source=left, dest=right)


def test_repeated_posts_give_new_values_and_keep_their_checks(comm, full_path_calls):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for seed in (0, 10, 20):
        x = jnp.full(3, float(seed + comm.rank))
        total = comm.iallreduce(x)
        received = comm.irecv(x, source=left, tag=seed, return_status=True)
        comm.wait(comm.isend(x, dest=right, tag=seed))
        out, status = comm.wait(received)
        assert_values(out, np.full(3, float(seed + left), FLOAT))
        assert (int(status.source), int(status.tag)) == (left, seed)
        expected = sum(seed + r for r in range(comm.size))
        assert_values(comm.wait(total), np.full(3, float(expected), FLOAT))
    # Each tag is a new signature; the iallreduce repeats.
    assert full_path_calls.count("iallreduce") == 1
    assert full_path_calls.count("irecv") == 3
    with pytest.raises(TypeError, match="op=SUM is not defined for dtype bool"):
        comm.iallreduce(jnp.zeros(3, bool))


def test_a_changed_signature_takes_the_full_path_and_its_checks(comm, full_path_calls):
    x = jnp.zeros((comm.size, 2))
    comm.alltoall(x)
    comm.alltoall(x)
    with pytest.raises(ValueError, match="leading axis of length size"):
        comm.alltoall(jnp.zeros((comm.size + 1, 2)))
    with pytest.raises(TypeError, match="op=SUM is not defined for dtype bool"):
        comm.allreduce(jnp.zeros(2, bool))
    comm.allreduce(jnp.ones(2))
    assert_values(comm.allreduce(jnp.ones(2), op="max"), np.ones(2, FLOAT))
    assert len(full_path_calls) == 5


def test_a_changed_pytree_takes_the_full_path(comm, full_path_calls):
    tree = {"a": jnp.ones(2), "b": jnp.ones(3, jnp.int32)}
    comm.allreduce(tree)
    comm.allreduce(tree)
    got = comm.allreduce({"a": jnp.ones(2), "b": jnp.ones(4, jnp.int32)})  # a new shape
    assert_values(got["b"], np.full(4, comm.size, np.int32))
    got = comm.allreduce({"a": jnp.ones(2), "c": jnp.ones(3, jnp.int32)})  # a new key
    assert_values(got["c"], np.full(3, comm.size, np.int32))
    with pytest.raises(TypeError, match="op=SUM is not defined for dtype bool"):
        comm.allreduce({"a": jnp.ones(2), "b": jnp.ones(3, bool)})
    got = comm.allreduce({"a": jnp.ones(2), "b": np.ones(3, np.int32)})  # not a jax.Array
    assert_values(got["b"], np.full(3, comm.size, np.int32))
    assert len(full_path_calls) == 5


def test_no_shortcut_while_tracing(comm):
    """After an eager call, the same call on a captured concrete array inside a
    trace is still staged into the program, not run once at trace time."""
    captured = jnp.full(2, float(comm.rank + 1))
    expected = np.full(2, comm.size * (comm.size + 1) / 2, FLOAT)
    assert_values(comm.allreduce(captured), expected)
    assert_values(comm.allreduce(captured), expected)

    def f():
        return comm.allreduce(captured)

    assert "jaxcomm_allreduce" in str(jax.make_jaxpr(f)())
    assert_values(jax.jit(f)(), expected)

    tree = [captured, captured]
    for _ in range(2):
        jax.tree.map(assert_values, comm.allreduce(tree), [expected, expected])
    assert "jaxcomm_allreduce" in str(jax.make_jaxpr(lambda: comm.allreduce(tree))())


def test_shortcut_refuses_a_freed_communicator_and_a_deleted_array(comm):
    other = comm.dup()
    x = jnp.ones(3)
    other.allreduce(x)
    other.free()
    with pytest.raises(ValueError, match="has been freed"):
        other.allreduce(x)
    y = jnp.ones(3)
    comm.allreduce(y)
    y.delete()
    with pytest.raises(jax.errors.JaxRuntimeError, match="deleted"):
        comm.allreduce(y)
    tree = {"a": jnp.ones(2), "b": jnp.ones(3)}
    comm.allreduce(tree)
    tree["b"].delete()
    with pytest.raises(RuntimeError, match="deleted"):
        comm.allreduce(tree)


def test_prepared_calls_are_bounded_least_recently_used_first():
    cache = _eager._PreparedCalls(2)
    cache.put(("a",), 1)
    cache.put(("b",), 2)
    assert cache.get(("a",)) == 1  # a is now the most recently used
    cache.put(("c",), 3)  # b goes
    assert cache.get(("b",)) is None and cache.get(("a",)) == 1 and cache.get(("c",)) == 3
    assert cache.get_or_make(("d",), lambda: 4) == 4  # a goes
    assert cache.get(("a",)) is None and cache.get_or_make(("c",), lambda: 5) == 3


def test_calls_whose_preparation_was_evicted_give_the_right_values(comm, monkeypatch):
    monkeypatch.setattr(_eager._prepared_calls, "_size", 3)
    for _ in range(2):
        for n in range(1, 8):  # 7 signatures, each several entries, through 3 places
            tree = {"a": jnp.full(n, float(comm.rank)), "b": jnp.ones((n, 2), np.int32)}
            out = comm.allreduce(tree)
            assert_values(out["a"], np.full(n, sum(range(comm.size)), FLOAT))
            assert_values(out["b"], np.full((n, 2), comm.size, np.int32))
            assert len(_eager._prepared_calls._calls) <= 3


# -- the variable-size exchanges ---------------------------------------------------


@pytest.fixture
def counts_checked(monkeypatch):
    """The count operands that have gone through their checks (the full path of a
    variable-size exchange; its shortcut skips them), from an empty cache."""
    monkeypatch.setattr(_eager, "_prepared_calls", _eager._PreparedCalls(64))
    checked = []
    counts = _checks.counts

    def counted(operation, name, *args, **kwargs):
        checked.append((operation, name))
        return counts(operation, name, *args, **kwargs)

    monkeypatch.setattr(_checks, "counts", counted)
    return checked


def ring(comm):
    """comm as a directed ring: one source (the rank before), one destination."""
    return comm.create_dist_graph([(comm.rank - 1) % comm.size], [(comm.rank + 1) % comm.size])


def sent(source, dest, seed):
    """Rows `source` sends `dest` in call `seed`: 0 to 2, changing between calls."""
    return (source + 2 * dest + seed) % 3


def x_of(rank, seed, rows):
    return rank_data(rank + 7 * seed, (rows, 2))


def padded(pieces, capacity):
    out = np.zeros((capacity, 2), np.float32)
    got = np.concatenate(pieces)
    out[: len(got)] = got
    return out


def exchange(on, name, posted):
    """Method `name` of communicator `on`, or with `posted` its non-blocking
    form, posted and waited for."""
    if not posted:
        return getattr(on, name)
    start = getattr(on, "i" + name)
    return lambda *args, **kwargs: on.wait(start(*args, **kwargs))


def v_call(name, comm, graph, seed, as_counts, posted=False):
    """(the call of exchange `name` (`posted`: its non-blocking form) in call
    `seed` on this rank, its expected (y, counts)); as_counts makes this rank's
    counts what the method takes."""
    r, size = comm.rank, comm.size
    left = (r - 1) % size
    on_comm = functools.partial(exchange, comm, posted=posted)
    on_graph = functools.partial(exchange, graph, posted=posted)
    if name == "alltoallv":
        x = x_of(r, seed, 2 * size)
        counts = as_counts([sent(r, d, seed) for d in range(size)])
        pieces = [
            x_of(s, seed, 2 * size)[sum(sent(s, d, seed) for d in range(r)) :][: sent(s, r, seed)]
            for s in range(size)
        ]
        want = padded(pieces, 2 * size), [sent(s, r, seed) for s in range(size)]
        return lambda: on_comm("alltoallv")(jnp.asarray(x), counts, capacity=2 * size), want
    if name in ("allgatherv", "gatherv"):
        x = x_of(r, seed, 2)
        pieces = [x_of(s, seed, 2)[: sent(s, 0, seed)] for s in range(size)]
        want = padded(pieces, 2 * size), [sent(s, 0, seed) for s in range(size)]
        count = as_counts(sent(r, 0, seed))
        if name == "allgatherv":
            return lambda: on_comm("allgatherv")(
                jnp.asarray(x), capacity=2 * size, count=count
            ), want
        root = size - 1
        if r != root:  # rows on the root only; each other rank knows its own count
            mine = np.zeros(size, np.int32)
            mine[r] = sent(r, 0, seed)
            want = np.zeros((0, 2), np.float32), mine
        return lambda: on_comm("gatherv")(
            jnp.asarray(x), root, capacity=2 * size, count=count
        ), want
    if name == "scatterv":
        x = x_of(0, seed, 2 * size) if r == 0 else np.zeros((0, 2), np.float32)
        counts = as_counts([sent(d, 0, seed) for d in range(size)]) if r == 0 else None
        start = sum(sent(d, 0, seed) for d in range(r))
        want = padded([x_of(0, seed, 2 * size)[start:][: sent(r, 0, seed)]], 2), sent(r, 0, seed)
        return lambda: on_comm("scatterv")(jnp.asarray(x), counts, 0, capacity=2), want
    if name == "neighbor_alltoallv":
        x = x_of(r, seed, 2)
        counts = as_counts([sent(r, 0, seed)])
        want = padded([x_of(left, seed, 2)[: sent(left, 0, seed)]], 2), [sent(left, 0, seed)]
        return lambda: on_graph("neighbor_alltoallv")(jnp.asarray(x), counts, capacity=2), want
    x = x_of(r, seed, 2)
    count = as_counts(sent(r, 0, seed))
    want = padded([x_of(left, seed, 2)[: sent(left, 0, seed)]], 2), [sent(left, 0, seed)]
    return lambda: on_graph("neighbor_allgatherv")(jnp.asarray(x), capacity=2, count=count), want


V_FORMS = [
    "alltoallv",
    "allgatherv",
    "gatherv",
    "scatterv",
    "neighbor_alltoallv",
    "neighbor_allgatherv",
]
#: How a caller may pass counts: each a kind the shortcut takes.
COUNT_KINDS = {
    "numpy int32": lambda c: np.array(c, np.int32),
    "numpy uint8": lambda c: np.array(c, np.uint8),
    "jax.Array": lambda c: jnp.asarray(c, jnp.int32),
    "Python ints": lambda c: c,
    "tuple, NumPy scalar": lambda c: np.int16(c) if isinstance(c, int) else tuple(c),
}


@pytest.mark.parametrize("posted", [False, True], ids=["blocking", "posted"])
@pytest.mark.parametrize("kind", COUNT_KINDS)
@pytest.mark.parametrize("name", V_FORMS)
def test_repeated_variable_size_exchange_gives_the_new_values(
    comm, name, kind, posted, counts_checked
):
    graph = ring(comm)
    for seed in range(3):  # the counts change from call to call
        call, (want, want_counts) = v_call(name, comm, graph, seed, COUNT_KINDS[kind], posted)
        y, got = call()
        assert isinstance(y, jax.Array) and isinstance(got, jax.Array)
        assert_values(y, want)
        assert_values(got, np.asarray(want_counts, np.int32))
    # Each count operand was checked in the first call only.
    assert len(counts_checked) == 2
    graph.free()


def test_variable_size_shortcut_validates_every_call(comm, counts_checked):
    """Counts whose values the C++ refuses, after calls like them passed: the same
    errors as on the full path, and the other ranks finish their exchange."""
    size = comm.size
    x = jnp.asarray(x_of(comm.rank, 0, size))
    for _ in range(2):
        comm.alltoallv(x, np.ones(size, np.int32), capacity=size)
    assert len(counts_checked) == 2
    bad = np.ones(size, np.int32)
    bad[-1] = -1 if comm.rank == 0 else 1
    if comm.rank == 0:
        with pytest.raises(Exception, match=r"send_counts=\[.*\] must be counts of rows"):
            jax.block_until_ready(comm.alltoallv(x, bad, capacity=size))
    else:
        _, got = comm.alltoallv(x, bad, capacity=size)
        assert int(got[0]) == 0  # rank 0 sent nothing
    too_many = np.full(size, 2 if comm.rank == size - 1 else 1, np.int32)
    if comm.rank == size - 1:
        with pytest.raises(Exception, match=r"add up to more than x.s \d+ rows"):
            jax.block_until_ready(comm.alltoallv(x, too_many, capacity=2 * size))
    else:
        comm.alltoallv(x, too_many, capacity=2 * size)
    # An overflow of capacity on the rank it happens, with counts like before.
    over = jnp.asarray(x_of(comm.rank, 0, 2 * size))
    comm.alltoallv(over, np.full(size, 2, np.int32), capacity=2 * size)
    capacity = 2 * size - 1 if comm.rank == 0 else 2 * size
    if comm.rank == 0:
        with pytest.raises(Exception, match=r"more than capacity="):
            jax.block_until_ready(
                comm.alltoallv(over, np.full(size, 2, np.int32), capacity=capacity)
            )
    else:
        comm.alltoallv(over, np.full(size, 2, np.int32), capacity=capacity)
    _, got = comm.alltoallv(x, np.ones(size, np.int32), capacity=size)
    assert_values(got, np.ones(size, np.int32))
    comm.barrier()


def test_variable_size_shortcut_keeps_the_checks_of_what_changed(comm, counts_checked):
    """A call that differs from the last in anything but the counts' values takes
    the full path: each of these is refused as it is there."""
    x = jnp.zeros((comm.size, 2))
    comm.alltoallv(x, np.ones(comm.size, np.int32), capacity=comm.size)
    with pytest.raises(TypeError, match=r"alltoallv: send_counts must be integers of shape"):
        comm.alltoallv(x, np.ones(comm.size), capacity=comm.size)  # floats
    with pytest.raises(TypeError, match=r"alltoallv: send_counts must be integers of shape"):
        comm.alltoallv(x, np.ones(comm.size + 1, np.int32), capacity=comm.size)
    with pytest.raises(TypeError, match=r"alltoallv: send_counts must be integers of shape"):
        comm.alltoallv(x, [True] * comm.size, capacity=comm.size)  # not Python ints
    with pytest.raises(
        TypeError, match=r"alltoallv: send_counts must be integers of shape .* bool"
    ):
        comm.alltoallv(x, [True] + [1] * (comm.size - 1), capacity=comm.size)  # True is no 1
    with pytest.raises(ValueError, match=r"alltoallv: capacity=-1 must be at least 0"):
        comm.alltoallv(x, np.ones(comm.size, np.int32), capacity=-1)
    with pytest.raises(TypeError, match=r"alltoallv: capacity must be an int, got bool"):
        comm.alltoallv(jnp.zeros((1, 2)), np.ones(comm.size, np.int32), capacity=True)
    comm.allgatherv(x, capacity=comm.size * comm.size, count=1)
    with pytest.raises(TypeError, match=r"allgatherv: count must be an integer scalar"):
        comm.allgatherv(x, capacity=comm.size * comm.size, count=1.0)
    comm.gatherv(x, 0, capacity=comm.size * comm.size)
    with pytest.raises(ValueError, match=r"gatherv: root=\d+ is out of range"):
        comm.gatherv(x, comm.size, capacity=comm.size * comm.size)
    counts = np.ones(comm.size, np.int32)
    comm.scatterv(x, counts, 0, capacity=1)
    if comm.rank == 0:
        with pytest.raises(ValueError, match=r"the root \(rank 0\) must pass counts, not None"):
            comm.scatterv(x, None, 0, capacity=1)
    # The big-endian and strided counts are read as the full path reads them.
    _, got = comm.alltoallv(x, np.ones(comm.size, ">i4"), capacity=comm.size)
    assert_values(got, np.ones(comm.size, np.int32))
    _, got = comm.alltoallv(x, np.ones(2 * comm.size, np.int32)[::2], capacity=comm.size)
    assert_values(got, np.ones(comm.size, np.int32))
    comm.barrier()


@pytest.mark.parametrize("posted", [False, True], ids=["blocking", "posted"])
def test_a_deleted_operand_of_a_variable_size_exchange_is_named(comm, posted):
    """x or counts deleted (or donated), on the first call or after calls like it
    (the shortcut): an error that names the operation and the argument, raised
    before the exchange on every rank here."""
    alltoallv = functools.partial(exchange, comm, "alltoallv", posted=posted)()
    name = "ialltoallv" if posted else "alltoallv"
    for repeated in (False, True):
        x = jnp.ones((comm.size, 2))
        counts = jnp.ones(comm.size, jnp.int32)
        if repeated:
            alltoallv(x, counts, capacity=comm.size)
        x.delete()
        with pytest.raises(RuntimeError, match=rf"{name}: x has been deleted \(or donated"):
            alltoallv(x, counts, capacity=comm.size)
        x = jnp.ones((comm.size, 2))
        counts.delete()
        with pytest.raises(RuntimeError, match=rf"{name}: send_counts has been deleted"):
            alltoallv(x, counts, capacity=comm.size)
    comm.barrier()


def test_no_variable_size_shortcut_while_tracing(comm):
    x = jnp.asarray(x_of(comm.rank, 0, comm.size))
    counts = np.ones(comm.size, np.int32)
    for _ in range(2):
        y, _ = comm.alltoallv(x, counts, capacity=comm.size)
    jaxpr = str(jax.make_jaxpr(lambda: comm.alltoallv(x, counts, capacity=comm.size))())
    assert "jaxcomm_alltoallv" in jaxpr
    assert_values(jax.jit(lambda: comm.alltoallv(x, counts, capacity=comm.size))()[0], y)
