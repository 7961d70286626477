"""Property-based tests of argument handling: random ops, shapes, dtypes, roots
and reduction ops either give the right values or raise a clean Python exception
before any MPI call. Hypothesis runs derandomized, so every rank draws the same
examples and makes the same calls."""

import jax
import jax.numpy as jnp
import pytest
from data import COLLECTIVES, assert_values, expected_collective, rank_data
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxcomm import DTYPES, ReduceOp

SETTINGS = settings(
    derandomize=True,
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
OPS = COLLECTIVES
CLEAN = (ValueError, TypeError)


@SETTINGS
@given(
    name=st.sampled_from(OPS),
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 3), max_size=3).map(tuple),
    leading=st.sampled_from(["size", "other", "none"]),
    root=st.integers(-2, 4),
    op=st.sampled_from(list(ReduceOp)),
    jit=st.booleans(),
)
def test_random_arguments(comm, name, dtype, shape, leading, root, op, jit):
    size = comm.size
    if leading == "size":
        shape = (size, *shape)
    elif leading == "other":
        shape = (size + 1, *shape)
    inputs = [rank_data(r, shape, dtype) for r in range(size)]
    x = jnp.asarray(inputs[comm.rank])
    kwargs = {}
    if name in ("reduce", "bcast", "gather", "scatter"):
        kwargs["root"] = root
    if name in ("allreduce", "reduce", "scan", "exscan", "reduce_scatter"):
        kwargs["op"] = op
    if name == "scatter" and 0 <= root < size:
        # Only the root can see a bad leading axis; with it, the other ranks would
        # wait in MPI_Scatter for a root that raised. Not a case to draw.
        assume(leading == "size")
        if comm.rank != root:
            x = x[0]  # non-root ranks pass one row
    fn = getattr(comm, name)
    try:
        got = (jax.jit(lambda v: fn(v, **kwargs)) if jit else lambda v: fn(v, **kwargs))(x)
    except CLEAN:
        # Invalid everywhere alike (arguments are the same on every rank): no rank
        # made the MPI call, so the communicator still works.
        comm.barrier()
        return
    want = expected_collective(name, comm.rank, inputs, root=root, op=op)
    assert_values(got, want)


@pytest.mark.parametrize("value", [1.5, "0", None, 2**40, -5])
def test_bad_root_values_raise_value_or_type_error(comm, value):
    with pytest.raises(CLEAN, match="root"):
        comm.bcast(jnp.zeros(2), root=value)
