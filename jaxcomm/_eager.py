"""The eager fast path: outside any trace, an operation on concrete host arrays
runs its host code directly, outside XLA.

Dispatching a primitive with an ordered effect through JAX costs a few hundred
microseconds per call (any effect takes a call off jit's C++ fast path, and an
ordered one also threads a runtime token); even `Primitive.bind` costs several,
so jaxcomm's primitives look for this case before binding (CommPrimitive).
jaxcomm instead waits for earlier jaxcomm work to finish (`jax.effects_barrier()`:
that keeps program order with jitted calls still running) and hands the arrays
to the same C++ function the FFI handler calls, which takes their buffers through
the buffer protocol (waiting for inputs that XLA is still computing). Results
are fresh arrays, never aliased with inputs. Set ``JAXCOMM_EAGER=jit`` to send
eager calls through JAX's dispatch instead.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jaxcomm._jax_internals import ArrayImpl, at_top_level, host_array
from jaxcomm._native import cpu

ENABLED = os.environ.get("JAXCOMM_EAGER", "direct") != "jit"
_CODES: dict[np.dtype, int] = {jnp.dtype(name): code for name, code in cpu.dtype_codes.items()}
_ALIGN = 64  # bytes: XLA's own alignment, and what lets host_array share the memory


def can_run(arrays: Sequence[Any]) -> bool:
    """Whether an operation on `arrays` can take the fast path: called outside
    any trace, on concrete arrays that each live on one CPU device."""
    if not ENABLED or not at_top_level():
        return False
    for a in arrays:
        if type(a) is not ArrayImpl or not _on_one_host_device(a.sharding):
            return False
    return True


@functools.cache
def platforms(sharding: jax.sharding.Sharding) -> frozenset[str]:
    """The platforms ("cpu", "gpu", ...) of the devices an array is on."""
    return frozenset(device.platform for device in sharding.device_set)


@functools.cache
def _on_one_host_device(sharding: jax.sharding.Sharding) -> bool:
    return len(sharding.device_set) == 1 and platforms(sharding) == {"cpu"}


@functools.cache
def _device(sharding: jax.sharding.Sharding) -> Any:
    return next(iter(sharding.device_set))


def _empty(shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> np.ndarray:
    if nbytes < 4096:  # copying a small result costs less than aligning it
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class _Result(NamedTuple):
    aval: core.ShapedArray
    code: int  # the dtype's XLA FFI code
    nbytes: int


class _Plan(NamedTuple):
    """What a call needs beyond its inputs' buffers: fixed by their types and the params."""

    results: tuple[_Result, ...]
    attrs: tuple[int | str, ...]  # the host function's attributes


class EagerOp:
    """Runs operation `name` now, on the buffers of concrete host arrays.

    abstract_eval(*avals, comm, **params) gives the result types; `attr_names`
    are the params the host function takes after the communicator and check flag.
    """

    def __init__(
        self,
        name: str,
        abstract_eval: Callable[..., Sequence[core.ShapedArray]],
        attr_names: Sequence[str],
    ):
        self._host_function = cpu.eager[name]
        self._abstract_eval = abstract_eval
        self._attr_names = tuple(attr_names)

    def __call__(self, args: Sequence[jax.Array], comm: Any, **params: Any) -> list[jax.Array]:
        """The operation's results, as new arrays (never aliased with `args`)."""
        jax.effects_barrier()
        inputs, in_types = [], []
        for a in args:
            shape, dtype = a.shape, a.dtype
            inputs.append((a, _CODES[dtype]))
            in_types.append((shape, dtype))
        plan = _plan(self, tuple(in_types), comm, tuple(params.items()))
        outputs = [_empty(r.aval.shape, r.aval.dtype, r.nbytes) for r in plan.results]
        raw_outputs = [(o, r.code) for o, r in zip(outputs, plan.results, strict=True)]
        failure = self._host_function(inputs, raw_outputs, plan.attrs)
        if failure is not None:
            code, message = failure
            raise jax.errors.JaxRuntimeError(f"{code}: {message}")
        if not outputs:
            return []
        device = _device(args[0].sharding)  # every operation with results has an input
        return [host_array(o, r.aval, device) for o, r in zip(outputs, plan.results, strict=True)]

    def plan(self, in_types, comm, params) -> _Plan:
        """The plan of a call on arrays of `in_types`, worked out afresh (see _plan)."""
        avals = [core.ShapedArray(shape, dtype) for shape, dtype in in_types]
        params = dict(params)
        results = tuple(
            _Result(aval, _CODES[aval.dtype], aval.size * aval.dtype.itemsize)
            for aval in self._abstract_eval(*avals, comm=comm, **params)
        )
        own = (v if isinstance(v, str) else int(v) for v in map(params.get, self._attr_names))
        return _Plan(results, (comm.handle, comm.check, *own))


# Calls mostly repeat a signature, and working out a plan costs more than looking it up.
@functools.lru_cache(maxsize=1024)
def _plan(op: EagerOp, in_types, comm, params) -> _Plan:
    return op.plan(in_types, comm, params)
