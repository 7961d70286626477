"""Every use of private JAX internals in jaxcomm, in this package.

JAX has no public API for primitives with ordered side effects, which is what lets
MPI calls run in program order without user-visible tokens. This package registers
jaxcomm's effect with JAX's (private) effect registries and lowers an op with the
effect token threaded through the custom call. A JAX upgrade that moves these
internals should only need changes here; the supported range is pinned in
pyproject.toml and tested in CI.

One module per concern: `effect` (the ordered effect and its registries),
`evaluation` (eagerly or traced, and eager evaluation's calls), `tangents`
(taking_part), `primitive` (OrderedPrimitive, which stays in its scan body),
`lowering` (custom calls with the token, and where they may run),
`lowering_hooks` (JAX's lowering patched at import), `ordered_calls`
(jaxcomm.jit's chain), `at_exit` (JAX's token of the effect at exit) and
`varying_axes` (shard_map's types). Importing the package applies the effect's
registration and the hooks, so importing jaxcomm does.
"""

from jaxcomm._jax_internals import lowering_hooks  # noqa: F401  (applies the hooks)
from jaxcomm._jax_internals.at_exit import effects_settled, failure_unclaimed
from jaxcomm._jax_internals.effect import COMM_EFFECT
from jaxcomm._jax_internals.evaluation import (
    ArrayImpl,
    apply_primitive,
    at_top_level,
    current_trace,
    host_arrays,
)
from jaxcomm._jax_internals.lowering import (
    lower_identity,
    lower_with_token,
    register_lowering,
    spans_processes,
)
from jaxcomm._jax_internals.ordered_calls import (
    chain_marker,
    continue_chain,
    ordered_call,
    restart_chain,
)
from jaxcomm._jax_internals.primitive import OrderedPrimitive
from jaxcomm._jax_internals.tangents import taking_part
from jaxcomm._jax_internals.varying_axes import (
    axis_sizes,
    in_shard_map,
    lowering_mesh,
    manual_axes,
    typed,
    vary,
    varying,
)

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
