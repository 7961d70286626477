"""Ordered calls: jaxcomm.jit's way to JAX's C++ dispatch path.

JAX dispatches a computation whose jaxpr has any effect on its Python path,
and one with an ordered effect also waits there for the previous one to
finish (dispatch.RuntimeTokenSet.get_token_input). An ordered call hides
COMM_EFFECT from the top-level jaxpr: inside, the function is lowered with
the effect as usual (every token JAX threads through loops, branches and
calls is unchanged), but its first token comes from an array argument, the
*marker*, and its last token comes back as a new marker. The marker is JAX's
own runtime token of COMM_EFFECT, so ordered calls, jitted calls with the
effect and eager calls (which wait for that token) form one chain.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core, dispatch, effects
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir.dialects import hlo
from jax.extend.core import ClosedJaxpr

from jaxcomm._jax_internals.effect import COMM_EFFECT
from jaxcomm._jax_internals.lowering import register_lowering
from jaxcomm._jax_internals.primitive import OrderedPrimitive


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


def restart_chain() -> jax.Array:
    """A ready marker on no device in particular, once the last call is done."""
    _chain.token.block_until_ready()
    _chain.token._buf = _fresh_marker()
    return _chain.token._buf


def continue_chain(marker: jax.Array) -> None:
    """Make `marker`, the last ordered call's, what the next call with COMM_EFFECT
    waits for: JAX's Python dispatch and jax.effects_barrier wait for it."""
    _chain.token._buf = marker
