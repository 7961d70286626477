"""The eager fast path: an operation on arrays that are already computed runs its
host code directly, outside XLA.

Dispatching a primitive with an ordered effect through JAX costs a few hundred
microseconds per call (any effect takes a call off jit's C++ fast path, and an
ordered one also threads a runtime token). Outside any trace, jaxcomm instead
waits for earlier jaxcomm work to finish (`jax.effects_barrier()`: that keeps
program order with jitted calls still running), and hands the arrays' CPU buffers
to the same C++ function the FFI handler calls. Results are fresh arrays, never
aliased with inputs. Set ``JAXCOMM_EAGER=jit`` to send eager calls through JAX's
dispatch instead.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jaxcomm._jax_internals import host_array
from jaxcomm._native import cpu

ENABLED = os.environ.get("JAXCOMM_EAGER", "direct") != "jit"
_CODES: dict[np.dtype, int] = {jnp.dtype(name): code for name, code in cpu.dtype_codes.items()}
_ALIGN = 64  # bytes: XLA's own alignment, and what lets host_array share the memory


def can_run(arrays: Sequence[Any]) -> bool:
    """Whether `arrays` can take the fast path: concrete arrays on the host."""
    if not ENABLED:
        return False
    for a in arrays:
        if not isinstance(a, jax.Array) or isinstance(a, core.Tracer):
            return False
        if not _on_one_host_device(a.sharding):
            return False
    return True


@functools.cache
def platforms(sharding: jax.sharding.Sharding) -> frozenset[str]:
    """The platforms ("cpu", "gpu", ...) of the devices an array is on."""
    return frozenset(device.platform for device in sharding.device_set)


@functools.cache
def _on_one_host_device(sharding: jax.sharding.Sharding) -> bool:
    return len(sharding.device_set) == 1 and platforms(sharding) == {"cpu"}


def _empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < 4096:  # copying a small result costs less than aligning it
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def run(
    name: str,
    abstract_eval: Callable[..., Sequence[core.ShapedArray]],
    attr_names: Sequence[str],
    args: Sequence[jax.Array],
    comm: Any,
    params: dict[str, Any],
) -> list[jax.Array]:
    """Operation `name` on `args` now; returns its results as new arrays."""
    jax.effects_barrier()
    inputs = []
    for a in args:
        a.block_until_ready()
        inputs.append((a.unsafe_buffer_pointer() if a.size else 0, _CODES[a.dtype], a.shape))
    avals = abstract_eval(*(a.aval for a in args), comm=comm, **params)
    outputs = [_empty(aval.shape, aval.dtype) for aval in avals]
    own = (params[k] if isinstance(params[k], str) else int(params[k]) for k in attr_names)
    attrs = (comm.handle, comm.check, *own)
    raw_outputs = [(o.ctypes.data, _CODES[o.dtype], o.shape) for o in outputs]
    failure = cpu.eager[name](inputs, raw_outputs, attrs)
    if failure is not None:
        code, message = failure
        raise jax.errors.JaxRuntimeError(f"{code}: {message}")
    if not outputs:
        return []
    device = next(iter(args[0].sharding.device_set))  # every operation with results has an input
    return [host_array(o, aval, device) for o, aval in zip(outputs, avals, strict=True)]
