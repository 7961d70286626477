"""Hooks on three private functions of JAX's lowering, applied at import.

An equation with jaxcomm's effect is lowered in place, never from JAX's
lowering cache, and the outermost loop, conditional or nested function with
jaxcomm calls is bracketed by jaxcomm._lockstep's calls: each call's
attributes depend on its place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax._src import core, effects, source_info_util
from jax._src.interpreters import mlir

from jaxcomm import _lockstep
from jaxcomm._jax_internals.effect import COMM_EFFECT
from jaxcomm._jax_internals.lowering import _placement_refusal, lower_with_token

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
