"""The eager shortcut: a JaxComm call on one concrete array, or on a pytree of them,
that repeats an earlier call's signature (op, parameters, structure, shapes,
dtypes, devices) skips the argument checks and goes straight to the host code. It
must give the new call's values, fall back to the full path for anything else, and
never run while a trace is active. Eager pytree calls send the messages a jitted
call sends."""

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
