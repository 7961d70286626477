"""Donated inputs: the ops that may run in place reuse the input's buffer (no
second array) and give the same values as out of place: the reductions and
alltoall when asked to (in_place=True), and the ranks whose result is x itself
(bcast's root, reduce's and gather's others) always: the call returns x in its
own buffer, so that what reads the result runs after the call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import assert_values, rank_data

IN_PLACE = {
    "allreduce": lambda comm: lambda x: comm.allreduce(x, in_place=True),
    "reduce": lambda comm: lambda x: comm.reduce(x, root=comm.size - 1, in_place=True),
    "scan": lambda comm: lambda x: comm.scan(x, in_place=True),
    "exscan": lambda comm: lambda x: comm.exscan(x, in_place=True),
    "bcast": lambda comm: lambda x: comm.bcast(x, root=comm.size - 1),
    "alltoall": lambda comm: lambda x: comm.alltoall(x, in_place=True),
    "gather": lambda comm: lambda x: comm.gather(x, root=comm.size - 1),
}
# Whether IN_PLACE[name] returns x's own buffer on this rank (else on every rank);
# None where the result has another shape (gather's root).
REUSED = {
    "bcast": lambda comm: comm.rank == comm.size - 1,
    "gather": lambda comm: True if comm.rank != comm.size - 1 else None,
}
# What each op does unless asked: out of place, or x itself where that is the
# result (bcast's root, reduce's and gather's others).
BY_DEFAULT = {
    "allreduce": lambda comm: comm.allreduce,
    "reduce": lambda comm: lambda x: comm.reduce(x, root=0),
    "scan": lambda comm: comm.scan,
    "exscan": lambda comm: comm.exscan,
    "alltoall": lambda comm: comm.alltoall,
    "bcast": lambda comm: lambda x: comm.bcast(x, root=0),
    "gather": lambda comm: lambda x: comm.gather(x, root=0),
}


@pytest.mark.parametrize("dtype", ["float32", "int64", "complex128"])
@pytest.mark.parametrize("name", list(IN_PLACE))
def test_donated_input_is_reused(comm, name, dtype):
    fn = IN_PLACE[name](comm)
    x = rank_data(comm.rank, (comm.size, 16, 3), dtype)
    expected = np.asarray(jax.jit(fn)(jnp.asarray(x)))
    donated = jnp.asarray(x)
    pointer = donated.unsafe_buffer_pointer()
    got = jax.jit(fn, donate_argnums=0)(donated)
    reused = REUSED.get(name, lambda comm: True)(comm)
    if reused is not None:
        # Where the result is x itself, JAX may hand x back instead of consuming it.
        assert donated.is_deleted() or (reused and got.unsafe_buffer_pointer() == pointer)
    if reused:
        assert got.unsafe_buffer_pointer() == pointer
    assert_values(got, expected)


@pytest.mark.parametrize("name", list(BY_DEFAULT))
def test_out_of_place_where_in_place_would_cost(comm, name):
    """By default no op writes into x's buffer: XLA need not copy an x used
    afterwards, which keeps its values. Where the result is x itself, the
    compiled call returns it in x's buffer (XLA copies an x used afterwards):
    what reads the result then runs after the call, as on the other ranks."""
    fn = BY_DEFAULT[name](comm)
    x = rank_data(comm.rank, (comm.size, 8), "float32")
    expected = np.asarray(jax.jit(fn)(jnp.asarray(x)))
    both = jax.jit(lambda v: (fn(v), v * 1))(jnp.asarray(x))
    assert_values(both[0], expected)
    assert_values(both[1], x)
    hlo = jax.jit(fn).lower(jnp.asarray(x)).as_text()
    result_is_x = {"bcast": comm.rank == 0, "reduce": comm.rank != 0, "gather": comm.rank != 0}
    assert ("output_operand_aliases" in hlo) == result_is_x.get(name, False), hlo


def test_sendrecv_in_a_donated_loop(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    step = lambda i, x: comm.sendrecv(x, source=left, dest=right)  # noqa: E731
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, comm.size + 1, step, x), donate_argnums=0)
    got = loop(jnp.full((1000,), comm.rank, jnp.float32))
    assert_values(got, np.full(1000, left, np.float32))  # size + 1 shifts = one shift
