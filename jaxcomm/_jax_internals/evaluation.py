"""How JAX evaluates now (eagerly, or into a trace) and eager evaluation's calls.

jaxcomm's eager path asks on every call whether JAX is tracing, and runs a
primitive or makes an array from a NumPy buffer through JAX's private dispatch,
without the Python layers of the public functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import core, dispatch
from jax._src.array import ArrayImpl as ArrayImpl  # re-exported: concrete arrays' class
from jax._src.lib import xla_client


def apply_primitive(primitive: core.Primitive, *args: Any, **params: Any) -> Any:
    """Eager evaluation: compile the single primitive once per signature and run it."""
    return dispatch.apply_primitive(primitive, *args, **params)


def _top_level_check() -> Callable[[], bool]:
    """Whether JAX is evaluating eagerly: no trace (jit, grad, vmap...) is active.

    jaxcomm.jit and eager calls ask on every call: where this JAX keeps the two
    values that core.trace_ctx.is_top_level() compares as it did in 0.10 to 0.12,
    they are read directly (the method and its two properties cost three times
    the two reads); elsewhere the method answers."""
    try:
        trace, axis_env = core.trace_state_strong_ref, core.axis_env_state
        eval_trace, top_axis_env = core.eval_trace, core.top_axis_env
    except AttributeError:
        return core.trace_ctx.is_top_level
    return lambda: trace.value is eval_trace and axis_env.value is top_axis_env


at_top_level = _top_level_check()


def current_trace() -> Any:
    """The trace that operations bound now join: a function being traced by jit,
    grad, vmap, or a lax.cond branch or loop body, each its own; at top level,
    JAX's evaluation trace."""
    return core.trace_ctx.trace


def host_arrays(aval: core.ShapedArray, device: Any) -> Callable[[np.ndarray], jax.Array]:
    """A function that makes a jax.Array of type `aval` on the CPU `device` from a
    NumPy array, sharing its memory when it is 64-byte aligned (else copying): what
    jax.device_put does, without its Python layers."""
    sharding, devices = _on(device), [device]
    return lambda value: xla_client.batched_device_put(aval, sharding, [value], devices, True)


@functools.cache
def _on(device: Any) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device)
