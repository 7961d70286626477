"""Every use of private JAX internals in jaxcomm, in one place.

JAX has no public API for primitives with ordered side effects, which is what lets
MPI calls run in program order without user-visible tokens. This module registers
jaxcomm's effect with JAX's (private) effect registries and lowers an op with the
effect token threaded through the custom call. A JAX upgrade that moves these
internals should only need changes here; the supported range is pinned in
pyproject.toml and tested in CI.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import config, core, dispatch, effects, sharding_impls, source_info_util
from jax._src.array import ArrayImpl
from jax._src.core import ManualAxisType
from jax._src.interpreters import ad, mlir, pxla
from jax._src.interpreters import partial_eval as pe
from jax._src.lib import xla_client
from jax._src.lib.mlir.dialects import hlo
from jax.extend.core import ClosedJaxpr

from jaxcomm import _lockstep

__all__ = [
    "COMM_EFFECT",
    "ArrayImpl",
    "OrderedPrimitive",
    "apply_primitive",
    "at_top_level",
    "axis_sizes",
    "chain_marker",
    "continue_chain",
    "current_trace",
    "effects_settled",
    "failure_unclaimed",
    "host_arrays",
    "in_shard_map",
    "lower_identity",
    "lower_with_token",
    "lowering_mesh",
    "manual_axes",
    "ordered_call",
    "register_lowering",
    "restart_chain",
    "spans_processes",
    "taking_part",
    "typed",
    "vary",
    "varying",
]


class CommEffect(effects.Effect):
    """The ordered effect shared by all jaxcomm operations (the implicit token chain).

    One chain for every communicator: ranks must issue MPI calls in the same order
    on every communicator they share, and XLA reordering calls on two communicators
    differently on different ranks could deadlock.
    """

    __str__ = lambda self: "jaxcomm"  # noqa: E731


COMM_EFFECT = CommEffect()

# Where the effect may appear. Without these, JAX rejects the op under
# cond/scan/while (control_flow), custom_vjp/custom_jvp (custom_derivatives),
# jax.checkpoint (remat), or silently drops an op whose only output is a tangent
# during partial evaluation (partial_eval_kept).
for _registry in (
    effects.lowerable_effects,
    effects.ordered_effects,
    effects.shardable_ordered_effects,
    effects.control_flow_allowed_effects,
    effects.custom_derivatives_allowed_effects,
    effects.remat_allowed_effects,
    effects.partial_eval_kept_effects,
):
    _registry.add_type(CommEffect)


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


def taking_part(trace: Any, args: Sequence[Any]) -> Sequence[Any]:
    """`args` as values of `trace` with which an operation takes part in its
    transformation whatever its operands depend on.

    Under differentiation each floating-point operand without a tangent gets a
    zero tangent, so the operation's derivative rule runs and makes its tangent
    (and, transposed, its cotangent) calls. Whether an operand depends on the
    differentiated inputs differs between ranks (a receive's template, data sent
    from a constant, a contribution only some ranks differentiate); the messages
    must not. The zero is a linear value (computed from an input of the linear
    function, or a frozen ref, both of which JAX transposes as linear), so the
    transposed call is made too. So is the zero of a forward derivative that JAX
    then splits by what depends on the tangents (jax.checkpoint's body): computed
    from a tangent input of the derivative, it is split with the tangents.
    """
    if isinstance(trace, ad.JVPTrace | ad.LinearizeTrace):
        return [_with_tangent(trace, x) for x in args]
    if isinstance(trace, pe.DynamicJaxprTrace) and not _in_scan_body.depth and _scan_body(trace):
        return [_tied_to_an_input(trace, x) for x in args]
    return args


def _tied_to_an_input(trace: pe.DynamicJaxprTrace, x: Any) -> Any:
    """x, made to depend on an input of the function `trace` traces (x plus zeros
    computed from it, which XLA removes).

    Traced in a loop body, an operation whose operands do not change between
    iterations (a constant sent) may be moved out of the loop by a partial
    evaluation that does not bind it again (jax.checkpoint's, nested in the
    body), on the ranks where they do not change only: tied to an input of the
    body, or of the function nested in it, it stays where it was traced.
    """
    aval = core.typeof(x)
    # jnp's issubdtype: bfloat16 and the float8 types are numbers, not NumPy's.
    if not isinstance(aval, core.ShapedArray) or not jax.numpy.issubdtype(
        aval.dtype, jax.numpy.number
    ):
        return x
    with core.set_current_trace(trace):
        zeros = _zeros_tied_to_an_input(trace, aval, jax.lax.stop_gradient)
        return x if zeros is None else x + zeros


def _with_tangent(trace: Any, x: Any) -> Any:
    primal, tangent = trace.to_primal_tangent_pair(x)
    aval = core.typeof(primal)
    if type(tangent) is not ad.Zero or not _inexact(aval):
        return x
    if isinstance(trace, ad.JVPTrace):
        with core.set_current_trace(trace.parent_trace):
            zeros = _zeros_tied_to_an_input(trace.parent_trace, aval)
            if zeros is None:
                zeros = ad.instantiate_zeros(tangent)
        return ad.JVPTracer(trace, primal, zeros)
    with core.set_current_trace(trace.tangent_trace):
        linear_zeros = _zeros_tied_to_an_input(trace.tangent_trace, aval)
        if linear_zeros is None:
            linear_zeros = jax.freeze(jax.new_ref(ad.instantiate_zeros(tangent)))
    return ad.LinearizeTracer(trace, primal, linear_zeros)


def _zeros_tied_to_an_input(
    trace: Any, aval: core.ShapedArray, through: Callable[[Any], Any] = lambda x: x
) -> Any:
    """Zeros of type `aval`, computed linearly (an empty slice, padded) from the
    last floating-point input of the function `trace` traces, or None if it has none:
    a linear function, whose inputs are all tangents, or a forward derivative,
    whose tangents follow its primals (ad.jvp_jaxpr). Inside shard_map, the last
    such input that varies along no mesh axis that aval does not, if any: the
    zeros are then made to vary as aval does, the type JAX wants of their
    cotangent.

    A linear function is transposed only where it uses its linear inputs: inside a
    jit whose function ignores its differentiated input on this rank (a receive
    into a constant template on every rank but the sender), the operation would
    otherwise be evaluated forward when a derivative is transposed, unlike on the
    other ranks, and the ranks' messages would not pair up. A forward derivative
    that JAX splits into a part it runs now and a linear part (jax.checkpoint's)
    splits by what depends on the tangents: an operation on constant zeros would
    run with the primal computation here and be transposed on the other ranks.
    """
    inputs = getattr(getattr(trace, "frame", None), "invars", ())
    floats = [v for v in inputs if isinstance(v.aval, core.ShapedArray) and _inexact(v.aval)]
    if not floats:
        return None
    typed_alike = [v for v in floats if varying(v.aval) <= varying(aval)]
    chosen = (typed_alike or floats)[-1]
    source = through(pe.DynamicJaxprTracer(trace, chosen.aval, chosen, None))
    empty = jax.lax.slice_in_dim(source.reshape(-1), 0, 0)
    if jax.numpy.iscomplexobj(empty) and not jax.numpy.issubdtype(aval.dtype, np.complexfloating):
        empty = jax.lax.real(empty)
    empty = jax.lax.convert_element_type(empty, aval.dtype)
    zeros = jax.lax.pad(empty, np.zeros((), aval.dtype), [(aval.size, 0, 0)]).reshape(aval.shape)
    return vary(zeros, varying(aval))


def _inexact(aval: core.ShapedArray) -> bool:
    # jnp's issubdtype: bfloat16 and the float8 types are inexact, not NumPy's.
    return jax.numpy.issubdtype(aval.dtype, np.inexact)


def host_arrays(aval: core.ShapedArray, device: Any) -> Callable[[np.ndarray], jax.Array]:
    """A function that makes a jax.Array of type `aval` on the CPU `device` from a
    NumPy array, sharing its memory when it is 64-byte aligned (else copying): what
    jax.device_put does, without its Python layers."""
    sharding, devices = _on(device), [device]
    return lambda value: xla_client.batched_device_put(aval, sharding, [value], devices, True)


@functools.cache
def _on(device: Any) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device)


# Where JAX's reverse mode may move work out of a loop: the body of lax.scan, and
# of lax.fori_loop (a scan when its bounds are static), as JAX names them.
_HOISTING_LOOPS = ("scan", "fori_loop")
# The parameter that marks an equation of a scan body that JAX binds again.
_REPLAYED = "jaxcomm_replayed"


class _InScanBody(dict):
    """The parameters of a jaxcomm equation traced in a scan body."""


class OrderedPrimitive(core.Primitive):
    """A primitive with jaxcomm's ordered effect, which stays in the loop body it
    was traced in.

    Reverse-mode differentiation of lax.scan moves the equations of its body
    whose operands do not change between iterations out of the loop, to run
    once; JAX does that to its own effects too (JAX issue 16637). It finds them
    by binding the body's equations again (core.eval_jaxpr, which asks
    `get_bind_params` for their parameters) in a partial evaluation whose known
    operands are the loop's constants, and evaluates those it knows at once,
    outside the loop. An operation whose operands do not change (a receive into
    zeros_like, a constant sent) would run once, before the loop, on the ranks
    where they do not change and in every iteration on the others, and the
    ranks' messages would not pair up. So a jaxcomm equation traced in a scan
    body, or in a cond branch, jit or checkpoint nested in one, is staged when a
    partial evaluation binds it again: it stays in the loop, where it was
    traced, and runs as often. JAX splits a scan body by
    evaluating it this way too when it linearizes a custom_jvp rule or a
    while_loop that calls one, and then fails with "Linearization failed": the
    primal operations could not run first. Under JAX's direct linearization
    (its default) nothing else does; without it, every derivative of a scan is
    computed so, and jaxcomm keeps JAX's behaviour there.
    """

    def get_bind_params(self, params: dict[str, Any]) -> dict[str, Any]:
        if isinstance(params, _InScanBody):
            return _InScanBody(params, **{_REPLAYED: True})
        return super().get_bind_params(params)

    def bind_with_trace(self, trace, args, avals, params, /):
        if _REPLAYED in params:
            params = _InScanBody({k: v for k, v in params.items() if k != _REPLAYED})
            if isinstance(trace, pe.JaxprTrace) and config.use_direct_linearize.value:
                return _staged(trace, self, args, params)
        elif _in_scan_body.depth or _scan_body(trace):
            params = _InScanBody(params)
        if not isinstance(params, _InScanBody):
            return super().bind_with_trace(trace, args, avals, params)
        # A transformation's rule binds the operations it makes with a copy of
        # the parameters (**params): they are in the loop body too.
        _in_scan_body.depth += 1
        try:
            return super().bind_with_trace(trace, args, avals, params)
        finally:
            _in_scan_body.depth -= 1


class _InScanBodyDepth(threading.local):
    depth = 0


_in_scan_body = _InScanBodyDepth()


def _scan_body(trace: Any) -> bool:
    """Whether `trace` traces the body of a loop that JAX's reverse mode may hoist
    work out of, or a function traced inside one (a cond branch, a nested jit)."""
    while trace is not None:
        debug_info = getattr(getattr(trace, "frame", None), "debug_info", None)
        if getattr(debug_info, "traced_for", None) in _HOISTING_LOOPS:
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def _staged(trace: pe.JaxprTrace, primitive: core.Primitive, args: Sequence[Any], params):
    """`primitive` staged into the jaxpr that `trace` builds, known operands or not."""
    with core.set_current_trace(trace.parent_trace):
        tracers = [trace.instantiate_const(trace.to_jaxpr_tracer(x)) for x in args]
        return trace.default_process_primitive(primitive, tracers, params)


def register_lowering(primitive: core.Primitive, rule: Callable, platform: str | None = None):
    """mlir.register_lowering for a primitive that emits jaxcomm custom calls.
    Its lowering is never cached: JAX would emit a cached lowering once and
    copy it to each place it is used, and each custom call must carry its own
    place's attribute ``last`` (jaxcomm._lockstep)."""
    mlir.register_lowering(primitive, rule, platform=platform, cacheable=False)


def lower_with_token(
    target: str,
    *,
    aliases: dict[int, int] | None = None,
    templates: int = 0,
    marked: bool = True,
    awaited: int | None = None,
    owes: bool = False,
) -> Callable[..., Sequence[Any]]:
    """A lowering rule that calls FFI `target` as (token, *operands) -> (token, *results).

    `aliases` maps operand index to result index (both without the token) for
    outputs that may reuse an input buffer. The first `templates` operands are
    not passed (they gave only the results' types). `marked`: the target takes
    the attributes of jaxcomm._lockstep (``last``...), as jaxcomm's own handlers
    do; `awaited`: the key of the communicator on which a peer may wait for the
    call, None if none may; `owes`: the call owes whatever follows (the three as
    jaxcomm._lockstep.emitted says).
    """
    shifted = None if not aliases else {i + 1: o + 1 for i, o in aliases.items()}
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True, operand_output_aliases=shifted)
    lockstep = _lockstep.attributes() if marked else {}

    def lowering(ctx: mlir.LoweringRuleContext, *operands: Any, **attrs: Any) -> Sequence[Any]:
        if (refusal := _placement_refusal(ctx)) is not None:
            raise ValueError(f"jaxcomm: {target.removeprefix('jaxcomm_')} {refusal}")
        token = ctx.tokens_in.get(COMM_EFFECT)
        inner = ctx.replace(
            avals_in=[core.abstract_token, *ctx.avals_in[templates:]],
            avals_out=[core.abstract_token, *ctx.avals_out],
        )
        token_out, *results = rule(inner, token, *operands[templates:], **attrs, **lockstep)
        sharded = spans_processes(ctx)
        _lockstep.emitted(
            ctx, token_out.owner, marked=marked, awaited=awaited, sharded=sharded, owes=owes
        )
        _set_comm_token(ctx, token_out)
        return results

    return lowering


# jaxcomm._lockstep's calls around a loop, a conditional or a nested function,
# on a token alone: token -> token.
_enter = lower_with_token(_lockstep.ENTERED, owes=True)
_settle = lower_with_token(_lockstep.SETTLED)


# Loops, conditionals and nested functions that hold jaxcomm calls: JAX lowers
# every equation through mlir._uncached_lowering: in place where its primitive
# is not cacheable, else into a function that it lowers once and then copies
# (inlines) or calls at each place the same equation appears. jaxcomm gives each
# call attributes that depend on its place and that later calls change
# (jaxcomm._lockstep), so an equation with jaxcomm's effect is lowered in place,
# as an uncacheable one is; and the outermost such equation of the entry
# function that holds functions (a loop, a conditional, a nested jit,
# jax.checkpoint, a custom derivative) is bracketed by jaxcomm._lockstep's
# jaxcomm_entered and jaxcomm_settled calls. shard_map's body counts as the
# entry function. Other equations are lowered as JAX does.

_in_place = object()  # what _cached_lowering_miss returns for an equation lowered in place


def _lowered_in_place(uncached: Callable[..., Any]) -> Callable[..., Any]:
    """mlir._uncached_lowering, bracketing the outermost equation that holds
    functions with jaxcomm calls."""

    def lower(primitive, eqn_ctx, effects_, platform_rules, default_rule, ctx, *args, **params):
        if COMM_EFFECT not in effects_ or next(core.jaxprs_in_params(params), None) is None:
            return uncached(
                primitive, eqn_ctx, effects_, platform_rules, default_rule, ctx, *args, **params
            )
        how = _lockstep.region(
            ctx,
            shard_map=primitive.name == "shard_map",
            placeable=_placement_refusal(ctx) is None,
        )
        if how != _lockstep.BRACKETED:
            with _lockstep.within(ctx, how):
                return uncached(
                    primitive,
                    eqn_ctx,
                    effects_,
                    platform_rules,
                    default_rule,
                    ctx,
                    *args,
                    **params,
                )
        before = ctx.replace(avals_in=[], avals_out=[], tokens_out=None)
        _enter(before)
        inner = ctx.replace(tokens_in=before.tokens_out, tokens_out=None)
        with _lockstep.within(ctx, how):
            results = uncached(
                primitive, eqn_ctx, effects_, platform_rules, default_rule, inner, *args, **params
            )
        after = inner.replace(
            avals_in=[], avals_out=[], tokens_in=inner.tokens_out, tokens_out=None
        )
        _settle(after)
        ctx.set_tokens_out(after.tokens_out)
        return results

    return lower


def _cached_unless_ours(miss: Callable[..., Any]) -> Callable[..., Any]:
    """mlir._cached_lowering_miss, but for an equation with jaxcomm's effect, which
    is lowered in place (`_emitted_in_place`) and not cached."""

    def lower(ctx, eqn, cache_key, avals_in, **params):
        if COMM_EFFECT in eqn.effects:
            return _in_place
        return miss(ctx, eqn, cache_key, avals_in, **params)

    return lower


def _emitted_in_place(emit: Callable[..., Any]) -> Callable[..., Any]:
    """mlir._emit_cached_call, lowering in place an equation that
    `_cached_unless_ours` did not cache, as JAX lowers an uncacheable one."""

    def lower(ctx, eqn, tokens_in, dim_var_values, const_lowering, cache_entry, *args):
        if cache_entry is not _in_place:
            return emit(ctx, eqn, tokens_in, dim_var_values, const_lowering, cache_entry, *args)
        rule_ctx = mlir.LoweringRuleContext(
            module_context=ctx,
            primitive=eqn.primitive,
            name_stack=source_info_util.new_name_stack() + eqn.source_info.name_stack,
            traceback=eqn.source_info.traceback,
            avals_in=tuple(v.aval for v in eqn.invars),
            avals_out=tuple(v.aval for v in eqn.outvars),
            # The tokens of its own ordered effects, as a cached lowering gets them.
            tokens_in=tokens_in.subset(list(effects.ordered_effects.filter_in(eqn.effects))),
            tokens_out=None,
            jaxpr_eqn_ctx=eqn.ctx,
            dim_var_values=dim_var_values,
            const_lowering=const_lowering,
        )
        platform_rules, default_rule, _ = mlir._get_lowering_rules(ctx, eqn.primitive, eqn.ctx)
        with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
            results = mlir._uncached_lowering(
                eqn.primitive,
                eqn.ctx,
                eqn.effects,
                platform_rules,
                default_rule,
                rule_ctx,
                *args,
                **eqn.params,
            )
        return results, tokens_in.update_tokens(rule_ctx.tokens_out)

    return lower


# jaxpr_subcomp looks each of these up in mlir's namespace when it lowers an
# equation (JAX 0.10 to 0.12 do; CI tests the oldest and the newest).
mlir._uncached_lowering = _lowered_in_place(mlir._uncached_lowering)
mlir._cached_lowering_miss = _cached_unless_ours(mlir._cached_lowering_miss)
mlir._emit_cached_call = _emitted_in_place(mlir._emit_cached_call)


def _placement_refusal(ctx: mlir.LoweringRuleContext) -> str | None:
    """Why an operation cannot run where the computation being lowered runs, or None.

    jaxcomm makes one MPI call per process. It may run in a computation on one
    device, or in the per-device body of shard_map over a mesh with one device
    per process. A global computation over several processes' devices is
    partitioned by XLA, which cannot place an MPI call (it fails with an
    internal error); several devices of one process would each make the call.
    """
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        mesh = axis_context.mesh
        automatic = [a for a in mesh.axis_names if a not in axis_context.manual_axes]
        if any(mesh.shape[a] > 1 for a in automatic):
            return (
                f"inside shard_map over mesh axes {sorted(axis_context.manual_axes)} of a "
                f"mesh that also has axes {automatic}, which XLA partitions: run shard_map "
                "over every axis of the mesh (leave its axis_names out)"
            )
        devices = getattr(mesh, "devices", None)
        if devices is None:  # an abstract mesh: at most this process's devices
            mine = min(mesh.size, jax.local_device_count())
        else:
            mine = sum(d.process_index == jax.process_index() for d in devices.flat)
        return _several_devices(mine) if mine > 1 else None
    if isinstance(axis_context, sharding_impls.ShardingContext):
        count = axis_context.num_devices
        if count <= 1:
            return None
        # JAX names the devices only to some lowerings; where it does not, more
        # devices than this process has are others' too.
        devices = axis_context.device_assignment
        if devices is not None:
            spans = len({d.process_index for d in devices}) > 1
        else:
            spans = count > jax.local_device_count()
        if not spans:
            return _several_devices(count)
        return (
            f"on arrays that span several processes ({count} devices), outside "
            "shard_map: XLA would partition the computation and cannot place an MPI "
            "call. Call it inside jax.shard_map over the mesh (one device per "
            "process), where it acts on this process's block, or pass it this "
            "process's block (x.addressable_data(0))"
        )
    mine = getattr(getattr(axis_context, "axis_env", None), "nreps", 1)
    return _several_devices(mine) if mine > 1 else None


def spans_processes(ctx: mlir.LoweringRuleContext) -> bool:
    """Whether the computation being lowered is the body of shard_map over a mesh
    of several processes' devices (where JAX's own collectives may run)."""
    axis_context = ctx.module_context.axis_context
    if not isinstance(axis_context, sharding_impls.SPMDAxisContext):
        return False
    devices = getattr(axis_context.mesh, "devices", None)
    if devices is None:  # an abstract mesh
        return jax.process_count() > 1
    return len({d.process_index for d in devices.flat}) > 1


def _several_devices(count: int) -> str:
    return (
        f"in a computation over {count} devices of one process. jaxcomm makes one MPI "
        "call per process, and each device would make its own on the same communicator. "
        "Give each process one device (one rank per device), or combine a process's "
        "devices with JAX's own collectives (lax.psum inside shard_map) and call jaxcomm "
        "outside shard_map."
    )


def lower_identity(ctx: mlir.LoweringRuleContext, *operands: Any, **_: Any) -> Sequence[Any]:
    """Lowering of an effectful op that only passes its operands (and the token) on."""
    _set_comm_token(ctx, ctx.tokens_in.get(COMM_EFFECT))
    return list(operands)


def _set_comm_token(ctx: mlir.LoweringRuleContext, token: Any) -> None:
    """Set jaxcomm's token out of `ctx` to `token`, passing on the others: an
    uncached lowering (register_lowering) gets the tokens of every ordered effect
    of the computation, not only its primitive's."""
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({COMM_EFFECT: token})))


# ---------------------------------------------------------------------------
# Ordered calls: jaxcomm.jit's way to JAX's C++ dispatch path.
#
# JAX dispatches a computation whose jaxpr has any effect on its Python path,
# and one with an ordered effect also waits there for the previous one to
# finish (dispatch.RuntimeTokenSet.get_token_input). An ordered call hides
# COMM_EFFECT from the top-level jaxpr: inside, the function is lowered with
# the effect as usual (every token JAX threads through loops, branches and
# calls is unchanged), but its first token comes from an array argument, the
# *marker*, and its last token comes back as a new marker. The marker is JAX's
# own runtime token of COMM_EFFECT, so ordered calls, jitted calls with the
# effect and eager calls (which wait for that token) form one chain.


def _ordered_call_abstract_eval(marker: Any, *args: Any, jaxpr: ClosedJaxpr):
    others = {e for e in jaxpr.effects if e != COMM_EFFECT}
    if any(isinstance(e, effects.JaxprInputEffect) for e in others):
        raise ValueError(
            "jaxcomm.jit: the function uses mutable references (a state effect on its "
            "inputs); use jax.jit for it."
        )
    return [marker, *jaxpr.out_avals], others


def _ordered_call_lowering(ctx: mlir.LoweringRuleContext, marker: Any, *args: Any, jaxpr):
    platforms = ctx.module_context.platforms
    if any(platform != "cpu" for platform in platforms):
        raise ValueError(
            f"jaxcomm.jit runs on CPU devices only (this computation is for "
            f"{', '.join(platforms)}); use jax.jit for it"
        )
    # The first token depends on the marker: nothing of jaxcomm in this call runs
    # before the call that made the marker has finished.
    first = hlo.OptimizationBarrierOp([hlo.create_token(), marker]).results[0]
    tokens = dict(ctx.tokens_in.items())
    inner = ctx.replace(
        avals_in=ctx.avals_in[1:],
        avals_out=ctx.avals_out[1:],
        tokens_in=mlir.TokenSet({**tokens, COMM_EFFECT: first}),
    )
    results = mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(inner, *args)
    last = inner.tokens_out.get(COMM_EFFECT)
    # The new marker is the old one, after the last token: an output of this call,
    # so it is ready only when the call has finished.
    done = hlo.OptimizationBarrierOp([last, marker]).results[1]
    ctx.set_tokens_out(inner.tokens_out.subset(list(tokens)))
    return [done, *results]


_ordered_call_p = OrderedPrimitive("jaxcomm_ordered_call")
_ordered_call_p.multiple_results = True
_ordered_call_p.def_effectful_abstract_eval(_ordered_call_abstract_eval)
register_lowering(_ordered_call_p, _ordered_call_lowering)


def ordered_call(fun: Callable[..., Any], marker: Any, args: Sequence[Any]) -> tuple[Any, Any]:
    """fun(*args) inside a jit being traced, as one ordered call after `marker`:
    returns (the next marker, fun's results)."""
    closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    consts = closed.consts
    jaxpr = ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ())
    marker, *results = _ordered_call_p.bind(marker, *consts, *args, jaxpr=jaxpr)
    return marker, jax.tree.unflatten(jax.tree.structure(shape), results)


@functools.cache
def _fresh_marker() -> jax.Array:
    return jax.numpy.zeros((0,), bool)


class _Chain(threading.local):
    """This thread's token for ordered calls: one core.Token whose buffer is the
    last ordered call's marker, kept among JAX's runtime tokens (which are per
    thread too) while no other call with COMM_EFFECT came after it."""

    token: core.Token | None = None


_chain = _Chain()


def chain_marker() -> jax.Array:
    """The array the next ordered call waits for: the last ordered call's marker,
    if nothing else with COMM_EFFECT was dispatched since; else a ready array
    once that was (JAX's own token cannot be passed as an array: the first
    ordered call after a jitted call with the effect waits for that call to
    finish, as JAX's dispatch would)."""
    tokens = dispatch.runtime_tokens.current_tokens
    token = tokens.get(COMM_EFFECT)
    ours = _chain.token
    if token is not ours or token is None:
        if token is not None:
            token.block_until_ready()
        ours = _chain.token = core.Token(_fresh_marker())
        tokens[COMM_EFFECT] = ours
    return ours._buf


def failure_unclaimed() -> bool:
    """Whether JAX's token of jaxcomm's effect on this thread holds the error of
    a computation that failed after its call had returned, and no call with the
    effect (which a peer may run) has been refused for it since. JAX 0.12
    refuses the next such call of the thread and takes the error from the
    token; older JAX keeps it there and refuses every later call, which
    `_note_refusals` sees."""
    token = dispatch.runtime_tokens.current_tokens.get(COMM_EFFECT)
    return token is not None and token is not _refused.token and _holds_error(token)


class _Refused(threading.local):
    """This thread's token of jaxcomm's effect when JAX last refused a call for
    its error (JAX before 0.12, which leaves the token as it was)."""

    token: core.Token | None = None


_refused = _Refused()


def _note_refusals(shard_tokens: Callable[..., Any]) -> Callable[..., Any]:
    """JAX's handler that puts an ordered effect's token on the devices of the
    computation being dispatched, noting each refusal of a call with jaxcomm's
    effect: before 0.12 JAX refuses a call there, raising the error of the
    computation that returned the token. Another effect's token may raise
    before jaxcomm's is reached: a refusal while jaxcomm's token holds an error
    counts as a refusal for that error."""

    def shard(tokens: Sequence[Any], *args: Any) -> Any:
        try:
            return shard_tokens(tokens, *args)
        except jax.errors.JaxRuntimeError:
            ours = dispatch.runtime_tokens.current_tokens.get(COMM_EFFECT)
            if ours is not None and (any(t is ours for t in tokens) or _holds_error(ours)):
                _refused.token = ours
            raise

    return shard


def _holds_error(token: core.Token) -> bool:
    """Whether the computation that returned `token` failed (once it has ended)."""
    try:
        token.block_until_ready()
    except jax.errors.JaxRuntimeError:
        return True
    return False


# Before 0.12 nothing of JAX's state tells a refused call from none at exit
# (failure_unclaimed): both leave the same token. The handler, as wrapped, does
# what JAX's does; JAX 0.10 and 0.11 are released, so the handler stays as read.
if jax.__version_info__ < (0, 12):
    pxla.shard_arg_handlers[core.Token] = _note_refusals(pxla.shard_arg_handlers[core.Token])


def effects_settled() -> None:
    """Wait for every computation with an ordered effect to end. A failed one's
    error is left to JAX and to jaxcomm._lockstep (which ends the job if the
    failure put the rank out of step): at exit it was either seen by the
    program already or, as JAX itself does, not reported."""
    with contextlib.suppress(jax.errors.JaxRuntimeError):
        jax.effects_barrier()


def restart_chain() -> jax.Array:
    """A ready marker on no device in particular, once the last call is done."""
    _chain.token.block_until_ready()
    _chain.token._buf = _fresh_marker()
    return _chain.token._buf


def continue_chain(marker: jax.Array) -> None:
    """Make `marker`, the last ordered call's, what the next call with COMM_EFFECT
    waits for: JAX's Python dispatch and jax.effects_barrier wait for it."""
    _chain.token._buf = marker


# ---------------------------------------------------------------------------
# Varying manual axes: shard_map's types (check_vma, on by default).
#
# Inside shard_map with check_vma, each value's type says along which mesh
# axes it may differ between devices ("varying"); elsewhere those sets are
# empty. JAX checks that derivative rules keep them: a cotangent must have its
# primal's type.


def manual_axes() -> tuple[str, ...]:
    """The mesh axes along which the function being traced is a per-device body
    whose values carry varying-axes types (shard_map with check_vma); else ()."""
    if not config._check_vma.value:
        return ()
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def in_shard_map() -> bool:
    """Whether the function being traced is shard_map's per-device body."""
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def axis_sizes() -> dict[str, int]:
    """Each axis of the mesh of the function being traced: its number of devices."""
    return dict(jax.sharding.get_abstract_mesh().shape)


def varying(aval: Any) -> frozenset[str]:
    """The axes along which values of type `aval` may differ between devices."""
    mat = getattr(aval, "mat", None)
    return mat.varying if mat is not None else frozenset()


def typed(aval: core.ShapedArray, names: frozenset[str]) -> core.ShapedArray:
    """`aval`'s shape and dtype, varying along `names` in the current mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = jax.sharding.PartitionSpec(*(None,) * len(aval.shape))
    return core.ShapedArray(
        aval.shape,
        aval.dtype,
        aval.weak_type,
        sharding=jax.sharding.NamedSharding(mesh, spec),
        manual_axis_type=ManualAxisType(varying=frozenset(names)),
    )


def vary(x: Any, names: frozenset[str]) -> Any:
    """x typed as varying along `names` too (JAX's pcast to varying: the identity,
    whose transpose sums the cotangent over those axes with JAX's collectives)."""
    missing = tuple(a for a in jax.sharding.get_abstract_mesh().axis_names if a in names)
    missing = tuple(a for a in missing if a not in varying(core.typeof(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def lowering_mesh(ctx: mlir.LoweringRuleContext) -> jax.sharding.Mesh | None:
    """The mesh (with devices) of the shard_map whose body is being lowered, if any."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        mesh = axis_context.mesh
        return mesh if isinstance(mesh, jax.sharding.Mesh) else None
    return None
