"""jaxcomm.jit: jax.jit for a function that communicates, dispatched on JAX's C++
path and kept in program order with every other jaxcomm call.

JAX dispatches a computation that has an effect (as every jaxcomm operation has)
on its Python path, which costs a few hundred microseconds per call. jaxcomm.jit
compiles ``(marker, *args) -> (next marker, fun(*args))`` instead, with fun as one
*ordered call* (jaxcomm._jax_internals.ordered_calls): jaxcomm's effect stays
inside, so fun's operations keep their order there as under jax.jit, and the
computation JAX dispatches has no effect. Order across calls comes from the
marker, a zero-size array that each call takes from the previous one and returns
anew (XLA does not start a computation before its arguments are ready): the
ordered calls form a chain with jitted calls that carry the effect and with eager
calls (docs/ordering.md).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxcomm import _lockstep
from jaxcomm._jax_internals import (
    at_top_level,
    chain_marker,
    continue_chain,
    ordered_call,
    restart_chain,
)

_jax_jit = jax.jit  # as imported: the test suite may put jaxcomm.jit in its place

# Options that name fun's arguments by position: the marker comes first.
_BY_POSITION = ("static_argnums", "donate_argnums")
# Options about fun's arguments or results as a whole, which the marker would shift.
_REFUSED = ("in_shardings", "out_shardings")


def jit(fun: Callable[..., Any] | None = None, **options: Any) -> Callable[..., Any]:
    """``jax.jit(fun, **options)`` for a function that calls jaxcomm, dispatched
    faster: a call from Python takes JAX's C++ dispatch path (a few microseconds
    instead of a few hundred), in program order with every other jaxcomm call,
    eager or jitted. Under a transformation (grad, vmap, or inside another
    jitted function) it is ``jax.jit(fun, **options)``. Usable as a decorator,
    with or without options."""
    if fun is None:
        return functools.partial(jit, **options)
    for name in _REFUSED:
        if options.get(name) is not None:
            raise TypeError(
                f"jaxcomm.jit: {name} is not supported (jaxcomm runs on one device per "
                "process); use jax.jit for this function"
            )
    plain = _jax_jit(fun, **options)
    shifted = {name: _after_marker(options[name]) for name in _BY_POSITION if name in options}
    dispatched = _jax_jit(_with_marker(fun), **{**options, **shifted})

    # What refusals name (jaxcomm._lockstep): the call, not an operation.
    name = f"the call of jaxcomm.jit function {_name(fun)!r}"

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not at_top_level():
            return plain(*args, **kwargs)
        if (refused := _lockstep.refusal(name)) is not None:
            raise jax.errors.JaxRuntimeError(refused)
        marker = _waited(chain_marker, name)
        try:
            marker, results = dispatched(marker, *args, **kwargs)
        except ValueError as err:
            if "incompatible devices" not in str(err) and len(marker.sharding.device_set) == 1:
                raise
            # The arguments live on other devices than the last call's marker
            # (a call on several devices made it): wait for that call, then start
            # from a marker that can go anywhere.
            marker, results = dispatched(_waited(restart_chain, name), *args, **kwargs)
        continue_chain(marker)
        return results

    call.dispatched = dispatched  # what JAX dispatches: (marker, *args) -> (marker, results)
    # Ahead-of-time inspection (HLO, shapes) of fun as jax.jit compiles it.
    call.lower, call.trace, call.eval_shape = plain.lower, plain.trace, plain.eval_shape
    return call


def _name(fun: Callable[..., Any]) -> str:
    """fun's name; for a functools.partial, the name of the function it wraps;
    for a callable object without one, its class's."""
    while isinstance(fun, functools.partial):
        fun = fun.func
    return getattr(fun, "__name__", None) or type(fun).__name__


def _waited(marker: Callable[[], jax.Array], name: str) -> jax.Array:
    """`marker()`, which waits for an earlier computation; if that one failed,
    JAX raises its error and the call `name` does not run (jaxcomm._lockstep)."""
    try:
        return marker()
    except jax.errors.JaxRuntimeError as err:
        _lockstep.refused(name, err)
        raise


def _after_marker(numbers: int | Sequence[int] | None) -> tuple[int, ...] | None:
    if numbers is None:
        return None
    numbers = (numbers,) if isinstance(numbers, int) else numbers
    return tuple(n + 1 if n >= 0 else n for n in numbers)


def _with_marker(fun: Callable[..., Any]) -> Callable[..., Any]:
    """(marker, *args, **kwargs) -> (next marker, fun(*args, **kwargs)), fun as one
    ordered call on the arguments being traced; the others (static) stay Python
    values."""

    def with_marker(marker: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(marker, jax.core.Tracer):  # under jax.disable_jit(): fun as it is
            return marker, fun(*args, **kwargs)
        leaves, tree = jax.tree.flatten((args, kwargs))
        traced = [isinstance(leaf, jax.core.Tracer) for leaf in leaves]

        @functools.wraps(fun)  # JAX's errors name fun
        def on_traced(*values: Any) -> Any:
            given = iter(values)
            merged = [next(given) if t else leaf for leaf, t in zip(leaves, traced, strict=True)]
            args, kwargs = jax.tree.unflatten(tree, merged)
            return fun(*args, **kwargs)

        return ordered_call(
            on_traced, marker, [x for x, t in zip(leaves, traced, strict=True) if t]
        )

    # jax.jit reads the signature to match static_argnames and donate_argnames.
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return with_marker
    marker = inspect.Parameter("_jaxcomm_marker", inspect.Parameter.POSITIONAL_ONLY)
    with_marker.__signature__ = signature.replace(
        parameters=[marker, *signature.parameters.values()]
    )
    return with_marker
