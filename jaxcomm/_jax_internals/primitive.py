"""OrderedPrimitive: a primitive with jaxcomm's effect that stays in its scan body.

JAX's reverse mode moves the equations of a scan body whose operands do not
change out of the loop, and which ones they are differs between ranks; a
jaxcomm equation is staged where it was traced instead, through JAX's private
binding and partial evaluation.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from jax._src import config, core
from jax._src.interpreters import partial_eval as pe

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
