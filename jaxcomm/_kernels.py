"""User kernels: a subclass's own XLA FFI handler, called like a built-in op.

One primitive per FFI target. The call threads the communicator's ordered-effect
token (so it runs in program order with every other jaxcomm op) and passes the
communicator as the attributes ``comm`` (int64 MPI_Comm handle), ``rank`` and
``size`` (int32), before the caller's own attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.extend.core import Primitive

from jaxcomm import _sharded
from jaxcomm._jax_internals import (
    COMM_EFFECT,
    OrderedPrimitive,
    apply_primitive,
    lower_with_token,
    register_lowering,
)
from jaxcomm._lockstep import SETTLED
from jaxcomm._primitive import CommInfo
from jaxcomm._rules import define_rules, move_batch

VMAP_METHODS = ("sequential", "expand_dims")

_primitives: dict[str, Primitive] = {}


def register_kernel(target: str, handler: Any, platform: str = "cpu") -> None:
    """Register an FFI handler (a PyCapsule, or a ctypes function pointer) as `target`."""
    if hasattr(handler, "argtypes"):  # a ctypes function
        handler = jax.ffi.pycapsule(handler)
    jax.ffi.register_ffi_target(target, handler, platform=platform)


def _abstract_eval(*avals, results, comm, target, **_):
    shaped = [core.ShapedArray(shape, dtype) for shape, dtype in results]
    # Inside shard_map, varying along every axis comm spans (jaxcomm._sharded).
    return _sharded.type_results(shaped, avals, comm, target, "varying"), {COMM_EFFECT}


# Runs before each kernel: the kernel does not run while this rank is out of step
# (jaxcomm._lockstep), when it could pair with the wrong call of a peer; it owes
# the kernel to the peers. The settling call after it then says what the
# computation owes once the kernel has run: a user's handler takes none of
# jaxcomm's attributes, and a failure of it stops the computation before that
# call (docs/troubleshooting.md, "After an error on one rank").
_in_step = lower_with_token("jaxcomm_in_step")
_settled = lower_with_token(SETTLED)


def _lowering(ctx, *operands, target, comm: CommInfo, results, aliases, attrs, vmap_method):
    guard = ctx.replace(avals_in=[], avals_out=[])
    _in_step(guard, kernel=target)
    rule = lower_with_token(
        target,
        aliases=dict(aliases) or None,
        marked=False,
        awaited=comm.key if comm.size > 1 else None,
    )
    ffi_attrs = {"comm": np.int64(comm.handle), "rank": np.int32(comm.rank)}
    ffi_attrs["size"] = np.int32(comm.size)
    ffi_attrs.update(attrs)
    kernel = ctx.replace(tokens_in=guard.tokens_out)
    outputs = rule(kernel, *operands, **ffi_attrs)
    after = kernel.replace(avals_in=[], avals_out=[], tokens_in=kernel.tokens_out, tokens_out=None)
    _settled(after)
    ctx.set_tokens_out(after.tokens_out)
    return outputs


def _batch(args, dims, *, results, vmap_method, **params):
    (size,) = {x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None}
    primitive = _primitives[params["target"]]
    if vmap_method == "expand_dims":
        # The kernel sees a leading batch axis on every operand and result.
        args = [
            move_batch(x, d, 0) if d is not None else jnp.broadcast_to(x, (size, *x.shape))
            for x, d in zip(args, dims, strict=True)
        ]
        batched = tuple(((size, *shape), dtype) for shape, dtype in results)
        outs = primitive.bind(*args, results=batched, vmap_method=vmap_method, **params)
        return outs, [0] * len(outs)
    # sequential: one call per batch element, in order.
    calls = []
    for i in range(size):
        element = [
            x if d is None else jnp.take(x, i, axis=d) for x, d in zip(args, dims, strict=True)
        ]
        calls.append(primitive.bind(*element, results=results, vmap_method=vmap_method, **params))
    return [jnp.stack(outs) for outs in zip(*calls, strict=True)], [0] * len(results)


def kernel_primitive(target: str) -> Primitive:
    if target not in _primitives:
        primitive = OrderedPrimitive(target)
        primitive.multiple_results = True
        primitive.def_impl(partial(apply_primitive, primitive))
        primitive.def_effectful_abstract_eval(_abstract_eval)
        register_lowering(primitive, _lowering)
        define_rules(primitive, batch=_batch)
        _primitives[target] = primitive
    return _primitives[target]


def call_kernel(
    target: str,
    *args: jax.Array,
    comm: CommInfo,
    results: Sequence[jax.ShapeDtypeStruct],
    aliases: dict[int, int] | None = None,
    vmap_method: str = "sequential",
    attrs: dict[str, Any] | None = None,
) -> list[jax.Array]:
    if vmap_method not in VMAP_METHODS:
        raise ValueError(
            f"call_kernel: vmap_method must be one of {VMAP_METHODS}, got {vmap_method!r}"
        )
    return kernel_primitive(target).bind(
        *args,
        target=target,
        comm=comm,
        results=tuple((tuple(r.shape), np.dtype(r.dtype)) for r in results),
        aliases=tuple(sorted((aliases or {}).items())),
        attrs=tuple(sorted((attrs or {}).items())),
        vmap_method=vmap_method,
    )


def build_flags() -> dict[str, list[str]]:
    """Include directories and the MPI library for compiling a kernel against jaxcomm.

    {"include_dirs": [jaxcomm's header dir, XLA FFI headers, mpi.h's dir],
     "libraries": [the libmpi that mpi4py loaded, to which jaxcomm is bound]}.
    """
    from jaxcomm import _diagnosis, _native

    return _diagnosis.flags(_native.library)
