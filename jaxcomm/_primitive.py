"""How a jaxcomm operation becomes a JAX primitive, and the helpers its rules share.

Every operation of the C++ table (cpp/ops.h) is a multiple-results primitive
carrying COMM_EFFECT, lowered to the FFI target ``jaxcomm_<name>`` with the effect
token threaded through it and the table's attributes, and run eagerly on host
arrays by jaxcomm._eager (else by compiling the single primitive). The op
families (_reductions, _collectives, _p2p, _replicated, _nonblocking) declare
their primitives with `comm_primitive` and attach JVP, transpose and batching
rules with `define_rules`.

AD rules must make the same MPI calls on every rank: a transpose rule is called
even when its cotangent is a symbolic zero, and it always communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core, lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxcomm import _eager
from jaxcomm._jax_internals import COMM_EFFECT, apply_primitive, lower_with_token
from jaxcomm._native import PLATFORMS, cpu


class CommInfo(NamedTuple):
    """What a primitive needs to know about its communicator (static, hashable)."""

    key: int  # the communicator's key in the handlers' registry (_native.register_comm)
    handle: int  # mpi4py's integer handle of the MPI_Comm, for user kernels
    rank: int
    size: int
    check: bool = False  # checking mode: verify cross-rank assumptions at run time


AbstractEval = Callable[..., Sequence[Any]]

# Each C++ operation's own attributes, from its one declaration (cpp/ops.h).
_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    name: tuple(attributes) for name, attributes in cpu.attributes().items()
}
#: Every operation's primitive, by name: one for each operation in cpp/ops.h.
PRIMITIVES: dict[str, CommPrimitive] = {}


def same_shape(x, **_):
    """Abstract eval of ops whose one result is shaped like their input."""
    return [core.ShapedArray(x.shape, x.dtype)]


def in_place(x, **_):
    """Aliases of ops whose result may reuse their input's buffer."""
    return {0: 0}


class CommPrimitive(Primitive):
    """A jaxcomm operation. Outside any trace, on concrete host arrays, bind runs
    its host code at once (jaxcomm._eager) rather than through JAX's dispatch."""

    multiple_results = True

    def __init__(self, name: str, abstract_eval: AbstractEval):
        super().__init__(f"jaxcomm_{name}")
        self.op_name = name
        self.result_types = abstract_eval  # not abstract_eval: Primitive has its own
        # The params passed to the FFI handler after the communicator and checking
        # flag, by name inside jit and in this order eagerly: the C++ table's.
        self.attrs: tuple[str, ...] = _ATTRIBUTES[name]
        self.eager = _eager.EagerOp(name, abstract_eval, self.attrs)
        # Reached only through Primitive.bind, that is when the direct path cannot run.
        self.def_impl(partial(apply_primitive, self))

    direct_bind = True  # False: bind always goes through JAX (the starts of _nonblocking)

    def bind(self, *args: Any, **params: Any) -> Sequence[Any]:
        if self.direct_bind and _eager.can_run(args):
            return self.eager(args, **params)
        return super().bind(*args, **params)


def comm_primitive(
    name: str,
    abstract_eval: AbstractEval,
    *,
    aliases: Callable[..., dict[int, int] | None] | None = None,
    before_lowering: Callable[..., None] | None = None,
) -> Primitive:
    """Define the primitive for operation `name`.

    `name` is an operation of cpp/ops.h, whose attributes (ints as int32, strings
    as string attributes) the primitive's params must include.
    abstract_eval(*avals, comm, **params) returns the output avals.
    `aliases(*avals, **params)` says which outputs may reuse which inputs.
    `before_lowering(**params)` may refuse to lower a call.
    """
    if name not in _ATTRIBUTES:
        raise ValueError(f"no operation {name!r} in the C++ table (cpp/ops.h)")
    if name in PRIMITIVES:
        raise ValueError(f"operation {name!r} is declared twice")
    primitive = PRIMITIVES[name] = CommPrimitive(name, abstract_eval)
    primitive.def_effectful_abstract_eval(
        lambda *avals, **params: (abstract_eval(*avals, **params), {COMM_EFFECT})
    )

    def lowering(ctx: mlir.LoweringRuleContext, *operands: Any, comm: CommInfo, **params: Any):
        if before_lowering is not None:
            before_lowering(**params)
        alias = aliases(*ctx.avals_in, comm=comm, **params) if aliases else None
        rule = lower_with_token(f"jaxcomm_{name}", aliases=alias)
        ffi_attrs: dict[str, Any] = {"comm": np.int64(comm.key), "check": np.bool_(comm.check)}
        for key in primitive.attrs:
            value = params[key]
            ffi_attrs[key] = value if isinstance(value, str) else np.int32(value)
        return rule(ctx, *operands, **ffi_attrs)

    for platform in PLATFORMS:  # the same FFI target name on every platform
        mlir.register_lowering(primitive, lowering, platform=platform)
    return primitive


def define_rules(
    primitive: Primitive,
    *,
    jvp: Callable[..., tuple[list, list]] | None = None,
    transpose: Callable[..., list] | None = None,
    batch: Callable[..., tuple[list, list]] | None = None,
) -> None:
    """Attach AD and vmap rules to `primitive` (the names follow jax.interpreters)."""
    if jvp is not None:
        ad.primitive_jvps[primitive] = jvp
    if transpose is not None:
        ad.primitive_transposes[primitive] = transpose
    if batch is not None:
        batching.primitive_batchers[primitive] = batch


# -- AD helpers ---------------------------------------------------------------------


def differentiable(x: Any) -> bool:
    return jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact)


def zero_tangent(y: Any) -> ad.Zero:
    return ad.Zero(jax.typeof(y).to_tangent_aval())


def instantiate(t: Any) -> jax.Array:
    """A tangent or cotangent as an array: symbolic zeros become real zeros."""
    return ad.instantiate_zeros(t)


def on_rank(keep: bool, x: jax.Array) -> jax.Array:
    """x where `keep`, else zeros; x stays an operand either way, so transposing
    this still sends a cotangent into whatever produced x (keeping ranks in step)."""
    return lax.select(jnp.full(x.shape, keep), x, jnp.zeros_like(x))


def linear_jvp(primitive: Primitive) -> Callable[..., tuple[list, list]]:
    """JVP of an op that is linear in every operand: the op applied to the tangents."""

    def jvp(primals, tangents, **params):
        outs = primitive.bind(*primals, **params)
        if not all(differentiable(x) for x in primals):
            return outs, [zero_tangent(y) for y in outs]
        dots = primitive.bind(*map(instantiate, tangents), **params)
        return outs, [
            d if differentiable(y) else zero_tangent(y) for y, d in zip(outs, dots, strict=False)
        ]

    return jvp


# -- batching helpers ------------------------------------------------------------------


def batch_elementwise(primitive: Primitive) -> Callable[..., tuple[list, list]]:
    """vmap of an op on one array whose layout across ranks does not matter."""

    def rule(args, dims, **params):
        outs = primitive.bind(*args, **params)
        return outs, [dims[0]] * len(outs)

    return rule


def move_batch(x: jax.Array, dim: int | None, to: int) -> jax.Array:
    return x if dim is None else jnp.moveaxis(x, dim, to)
