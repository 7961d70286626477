"""How a jaxcomm operation becomes a JAX primitive.

Every operation is a multiple-results primitive carrying COMM_EFFECT, lowered to
the FFI target ``jaxcomm_<name>`` with the effect token threaded through it, and
evaluated eagerly by compiling the single primitive (cached per signature).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from jax import core
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxcomm._jax_internals import COMM_EFFECT, apply_primitive, lower_with_token


class CommInfo(NamedTuple):
    """What a primitive needs to know about its communicator (static, hashable)."""

    handle: int  # mpi4py's integer handle of the MPI_Comm
    rank: int
    size: int


AbstractEval = Callable[..., Sequence[Any]]


def same_shape(x, **_):
    """Abstract eval of ops whose one result is shaped like their input."""
    return [core.ShapedArray(x.shape, x.dtype)]


def in_place(x, **_):
    """Aliases of ops whose result may reuse their input's buffer."""
    return {0: 0}


def comm_primitive(
    name: str,
    abstract_eval: AbstractEval,
    *,
    attrs: Sequence[str] = (),
    aliases: Callable[..., dict[int, int] | None] | None = None,
) -> Primitive:
    """Define the primitive for operation `name`.

    abstract_eval(*avals, comm, **params) returns the output avals. `attrs` names
    the int params passed to the FFI handler (besides the communicator).
    `aliases(*avals, **params)` says which outputs may reuse which inputs.
    """
    primitive = Primitive(f"jaxcomm_{name}")
    primitive.multiple_results = True
    primitive.def_impl(partial(apply_primitive, primitive))
    primitive.def_effectful_abstract_eval(
        lambda *avals, **params: (abstract_eval(*avals, **params), {COMM_EFFECT})
    )

    def lowering(ctx: mlir.LoweringRuleContext, *operands: Any, comm: CommInfo, **params: Any):
        alias = aliases(*ctx.avals_in, comm=comm, **params) if aliases else None
        rule = lower_with_token(f"jaxcomm_{name}", aliases=alias)
        ffi_attrs = {"comm": np.int64(comm.handle)}
        ffi_attrs.update((key, np.int32(params[key])) for key in attrs)
        return rule(ctx, *operands, **ffi_attrs)

    mlir.register_lowering(primitive, lowering, platform="cpu")
    return primitive
