"""Messages of more than 2**31 - 1 elements (int counts) are not truncated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm import _native

N = 2**31 + 3


@pytest.mark.slow
def test_allreduce_over_int_max_elements(comm):
    if comm.size != 2:
        pytest.skip("run on 2 ranks only: 2 GiB per rank")
    x = jnp.full((N,), comm.rank + 1, jnp.int8)
    total = jax.jit(comm.allreduce, donate_argnums=0)(x)
    del x
    head, tail = np.asarray(total[:4]), np.asarray(total[-4:])
    assert head.tolist() == tail.tolist() == [3] * 4
    assert bool(jnp.all(total == 3))  # a fused reduction: no second 2 GiB array


@pytest.mark.slow
def test_sendrecv_over_int_max_elements_around_a_ring(comm):
    """Only rank 1 sends a message of more than 2**31 - 1 elements, to rank 2: the
    others' messages are one element, so each rank must split only its own
    message (its partners cannot know how the others are split)."""
    if comm.size != 3:
        pytest.skip("run on 3 ranks only: 2 GiB on two of them")
    counts = [1, N, 1]  # what each rank sends to the next
    left = (comm.rank - 1) % 3
    x = jnp.full((counts[comm.rank],), comm.rank + 1, jnp.int8)
    like = jax.ShapeDtypeStruct((counts[left],), jnp.int8)
    got, status = comm.sendrecv(
        x, jnp.zeros(like.shape, like.dtype), source=left, dest=(comm.rank + 1) % 3,
        sendtag=comm.rank, return_status=True,
    )  # fmt: skip
    del x
    assert (int(status.source), int(status.tag)) == (left, left)
    assert got.shape == (counts[left],)
    assert np.asarray(got[-4:]).tolist() == [left + 1] * min(4, counts[left])
    assert bool(jnp.all(got == left + 1))


@pytest.mark.slow
def test_alltoallv_over_int_max_elements(comm):
    """Two rows of 2**30 + 3 elements each way: the elements received overflow an
    int, so the counts are rows of a row datatype."""
    if comm.size != 2:
        pytest.skip("run on 2 ranks only: 2 GiB per rank")
    row = 2**30 + 3
    other = 1 - comm.rank
    counts = [2 if dest == other else 0 for dest in range(2)]
    x = jnp.full((2, row), comm.rank + 1, jnp.int8)
    y, got = jax.jit(lambda x: comm.alltoallv(x, counts, capacity=2), donate_argnums=0)(x)
    del x
    assert np.asarray(got).tolist() == counts
    assert np.asarray(y[:, :4]).tolist() == np.asarray(y[:, -4:]).tolist() == [[other + 1] * 4] * 2
    assert bool(jnp.all(y == other + 1))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["alltoallv", "ialltoallv"])
def test_alltoallv_over_int_max_rows(comm, form):
    """Rank 0 receives 2**31 + 8 one-byte rows, half from each rank: more rows
    than an int counts, so MPI 4's large-count MPI_Alltoallv_c (or
    MPI_Ialltoallv_c) carries them."""
    if comm.size != 2:
        pytest.skip("run on 2 ranks only: 3 GiB on rank 0")
    if _native.cpu.MPI_VERSION < 4:
        pytest.skip("the MPI library has no large-count functions (MPI 4)")
    half = 2**30 + 4
    counts = [half, 0]
    x = jnp.full((half,), comm.rank + 1, jnp.int8)
    capacity = 2 * half if comm.rank == 0 else 0
    if form == "alltoallv":
        call = lambda x: comm.alltoallv(x, counts, capacity=capacity)  # noqa: E731
    else:
        call = lambda x: comm.wait(comm.ialltoallv(x, counts, capacity=capacity))  # noqa: E731
    y, got = jax.jit(call, donate_argnums=0)(x)
    del x
    if comm.rank == 0:
        assert np.asarray(got).tolist() == [half, half]
        assert np.asarray(y[half - 2 : half + 2]).tolist() == [1, 1, 2, 2]
        halves = jax.jit(lambda y: (jnp.all(y[:half] == 1), jnp.all(y[half:] == 2)))(y)
        assert all(map(bool, halves))  # fused: no second 2 GiB array
    else:
        assert np.asarray(got).tolist() == [0, 0] and y.shape == (0,)
