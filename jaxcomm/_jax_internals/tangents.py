"""taking_part: every operation takes part in its transformation on every rank.

Whether an operand depends on the differentiated inputs (or changes between a
loop's iterations) differs between ranks; the messages must not. So operands
get zero tangents, tied to an input of the function being traced, through
JAX's private tracers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core
from jax._src.interpreters import ad
from jax._src.interpreters import partial_eval as pe

from jaxcomm._jax_internals.primitive import _in_scan_body, _scan_body
from jaxcomm._jax_internals.varying_axes import vary, varying


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
