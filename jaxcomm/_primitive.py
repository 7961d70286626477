"""How a jaxcomm operation becomes a JAX primitive, and the helpers its rules share.

Every operation of the C++ table (cpp/operations.h) is a multiple-results primitive
carrying COMM_EFFECT, lowered to the FFI target ``jaxcomm_<name>`` with the effect
token threaded through it and the table's attributes, and run eagerly on host
arrays by jaxcomm._eager, from the declaration (else by compiling the single
primitive). The op
families (_reductions, _collectives, _p2p, _replicated, _nonblocking) declare
their primitives with `comm_primitive` and attach JVP, transpose and batching
rules with jaxcomm._rules.define_rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from jax import core
from jax.interpreters import mlir
from mpi4py import MPI

from jaxcomm import _checks, _sharded
from jaxcomm._checks import Check
from jaxcomm._jax_internals import (
    COMM_EFFECT,
    OrderedPrimitive,
    apply_primitive,
    lower_with_token,
    register_lowering,
    spans_processes,
    taking_part,
)
from jaxcomm._native import PLATFORMS, cpu


class CommInfo(NamedTuple):
    """What a primitive needs to know about its communicator (static, hashable)."""

    key: int  # the communicator's key in the handlers' registry (_native.register_comm)
    handle: int  # mpi4py's integer handle of the MPI_Comm, for user kernels
    rank: int
    size: int
    check: bool = False  # checking mode: verify cross-rank assumptions at run time
    # For a communicator made by comm.along(mesh, axes): the mesh line it spans,
    # which types its results inside shard_map (jaxcomm._sharded).
    span: _sharded.Span | None = None


AbstractEval = Callable[..., Sequence[Any]]
# What must have a leading axis of length size (its name in the error), if
# anything; or a function of (comm, **params) that says so.
LeadingAxis = str | Callable[..., str | None] | None

# Each C++ operation's own attributes and how many buffers it takes, from its
# family's table (cpp/operations.h).
_OPERATIONS: dict[str, tuple[tuple[str, ...], int]] = {
    name: (tuple(attributes), inputs) for name, (attributes, inputs) in cpu.operations().items()
}
#: Every operation's primitive, by name: one for each operation in cpp/operations.h.
PRIMITIVES: dict[str, CommPrimitive] = {}


def same_shape(x, **_):
    """Abstract eval of ops whose one result is shaped like their input."""
    return [core.ShapedArray(x.shape, x.dtype)]


def in_place(x, **_):
    """Aliases of ops whose result may reuse their input's buffer."""
    return {0: 0}


def asked_in_place(x, *, in_place: bool = False, **_):
    """Aliases of ops that run in x's buffer only when the caller asks
    (``in_place=True``): XLA copies an aliased x that is still needed afterwards,
    so aliasing costs a copy in some programs, while MPI's out-of-place call
    costs its own time in all. A caller short of memory asks, for a donated x."""
    return {0: 0} if in_place else None


def on_root(*, comm: CommInfo, root: int, **_) -> bool:
    """result_is_x of ops whose root keeps its x (bcast)."""
    return comm.rank == root


def off_root(*, comm: CommInfo, root: int, **_) -> bool:
    """result_is_x of ops whose other ranks keep their x (reduce, gather)."""
    return comm.rank != root


class CommPrimitive(OrderedPrimitive):
    """A jaxcomm operation, as declared by `comm_primitive`. Binding it outside a
    trace compiles it; jaxcomm._eager runs it on concrete host arrays without
    JAX's dispatch, from the same declaration."""

    multiple_results = True

    def __init__(
        self,
        name: str,
        abstract_eval: AbstractEval,
        params: Mapping[str, Check],
        elementwise: bool,
        leading_axis: LeadingAxis,
        vma: str,
    ):
        super().__init__(f"jaxcomm_{name}")
        self.operation = name
        self.result_types = abstract_eval  # not abstract_eval: Primitive has its own
        self.params = dict(params)
        self.elementwise = elementwise
        self.leading_axis = leading_axis
        self.vma = vma
        # The params passed to the FFI handler after the communicator and checking
        # flag, by name inside jit and in this order eagerly: the C++ table's; and
        # how many of the last operands it takes (the others, a receive's template,
        # give only the results' shape and dtype).
        self.attrs, self.inputs = _OPERATIONS[name]
        self.def_impl(partial(apply_primitive, self))

    def bind(self, *args, **params):
        # Inside shard_map, operands of one type, varying along the axes the
        # communicator spans (jaxcomm._sharded): as JAX's collectives take them.
        if self.vma != "same":
            args = _sharded.vary_operands(args, params["comm"], self.operation)
        return super().bind(*args, **params)

    def bind_with_trace(self, trace, args, avals, params, /):
        # Every rank's messages must be the same whatever its operands depend on:
        # see taking_part.
        return super().bind_with_trace(trace, taking_part(trace, args), avals, params)

    def check_params(self, params: dict[str, Any], comm: CommInfo) -> None:
        """Check a caller's `params` as declared, in place: each becomes the value
        to use, or raises."""
        for name, check in self.params.items():
            if name in params:
                params[name] = check(self.operation, name, params[name], comm.size)

    def check_operands(self, leaves: list[Any], params: dict[str, Any], comm: CommInfo) -> list:
        """The leaves of x as arrays, checked for a call with (checked) `params`:
        dtypes and platform (jaxcomm._checks.arrays) and, where declared, a leading
        axis of length size; a receive from MPI.ANY_SOURCE takes one array."""
        operation = self.operation
        leaves = _checks.arrays(operation, leaves, params.get("op"))
        if len(leaves) > 1 and params.get("source") == MPI.ANY_SOURCE:
            raise ValueError(
                f"{operation}: a pytree of several arrays needs an explicit source, "
                "not MPI.ANY_SOURCE"
            )
        what = self.leading_axis
        if callable(what):
            what = what(comm, **params)
        if what is None:
            return leaves
        for leaf in leaves:
            if leaf.ndim == 0 or leaf.shape[0] != comm.size:
                raise ValueError(
                    f"{operation}: {what} must have a leading axis of length size={comm.size}, "
                    f"got shape {leaf.shape}"
                )
        return leaves


def comm_primitive(
    name: str,
    abstract_eval: AbstractEval,
    *,
    aliases: Callable[..., dict[int, int] | None] | None = None,
    result_is_x: Callable[..., bool] | None = None,
    before_lowering: Callable[..., None] | None = None,
    params: Mapping[str, Check] | None = None,
    elementwise: bool = False,
    leading_axis: LeadingAxis = None,
    vma: str = "varying",
) -> CommPrimitive:
    """Define the primitive for operation `name`.

    `name` is an operation of cpp/operations.h, whose attributes (ints as int32, strings
    as string attributes) the primitive's params must include.
    abstract_eval(*avals, comm, **params) returns the output avals.
    `aliases(*avals, **params)` says which outputs may reuse which inputs.
    `result_is_x(comm, **params)`: on this rank the first result is x, unchanged
    (bcast's root, reduce's and gather's other ranks). The compiled call then
    returns x in x's own buffer: XLA copies x only where x is still needed
    afterwards. Still a result of the call, not x itself: what reads it runs
    after the call, on this rank as on the others (jaxcomm._lockstep needs it).
    `before_lowering(**params)` may refuse to lower a call.
    `params`: how each parameter a caller passes is checked (jaxcomm._checks).
    `elementwise`: each element of the result depends only on the same element of
    x on every rank, so the small arrays of a pytree may travel as one message.
    `leading_axis`: what must have a leading axis of length size (its name in the
    error), if anything; or a function of (comm, **params) that says so.
    `vma`: how its results are typed inside shard_map (jaxcomm._sharded.type_results):
    "varying" (they may differ between ranks), "replicated" (the first result is
    the same on every rank: allreduce, bcast, allgather), "same" (an identity,
    typed as its operand).
    A primitive may have operands before those the C++ function takes (its
    buffers, in the table): a receive's template, which gives only the results'
    shape and dtype, so neither the compiled call (where a template made for the
    call would cost a kernel that fills it) nor the eager call passes it.
    """
    if name not in _OPERATIONS:
        raise ValueError(f"no operation {name!r} in the C++ table (cpp/operations.h)")
    if name in PRIMITIVES:
        raise ValueError(f"operation {name!r} is declared twice")
    primitive = CommPrimitive(name, abstract_eval, params or {}, elementwise, leading_axis, vma)
    PRIMITIVES[name] = primitive

    def typed_abstract_eval(*avals, comm: CommInfo, **params):
        results = abstract_eval(*avals, comm=comm, **params)
        return _sharded.type_results(results, avals, comm, name, vma), {COMM_EFFECT}

    primitive.def_effectful_abstract_eval(typed_abstract_eval)

    def lowering(ctx: mlir.LoweringRuleContext, *operands: Any, comm: CommInfo, **params: Any):
        if before_lowering is not None:
            before_lowering(**params)
        _sharded.refuse_other_mesh(ctx, comm, name)
        templates = len(operands) - primitive.inputs
        ffi_attrs: dict[str, Any] = {"comm": np.int64(comm.key), "check": np.bool_(comm.check)}
        for key in primitive.attrs:
            value = params[key]
            ffi_attrs[key] = value if isinstance(value, str) else np.int32(value)
        # Where the result is x, it comes back from the call in x's buffer rather
        # than as x itself: so what reads it waits for the call on every rank
        # alike. Otherwise XLA may run it first here (a host callback, JAX's
        # collectives in shard_map): one that fails would stop this rank's
        # computation before a call that its peers make, where jaxcomm may not
        # have seen any call of the computation run (jaxcomm._lockstep).
        # Inside shard_map over several processes, the result has a buffer of its
        # own on every rank instead, which the call fills (with x where the result
        # is x): every process must compile the same program there (see
        # jaxcomm._sharded), and an alias on some ranks only makes XLA copy x
        # first there and may order the call after a JAX collective there and
        # before it elsewhere, where both wait for each other.
        if (
            result_is_x is not None
            and result_is_x(comm=comm, **params)
            and not spans_processes(ctx)
        ):
            alias = {0: 0}
        else:
            alias = aliases(*ctx.avals_in, comm=comm, **params) if aliases else None
        rule = lower_with_token(
            f"jaxcomm_{name}",
            aliases=alias,
            templates=templates,
            awaited=comm.key if comm.size > 1 else None,
        )
        return rule(ctx, *operands, **ffi_attrs)

    for platform in PLATFORMS:  # the same FFI target name on every platform
        register_lowering(primitive, lowering, platform=platform)
    return primitive
