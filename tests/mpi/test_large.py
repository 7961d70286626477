"""Messages of more than 2**31 - 1 elements (int counts) are not truncated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
