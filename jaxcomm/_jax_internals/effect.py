"""jaxcomm's ordered effect, registered with JAX's (private) effect registries.

JAX has no public API for primitives with ordered side effects: registering the
effect is what lets MPI calls run in program order without user-visible tokens,
and lets them appear under JAX's control flow and transformations.
"""

from __future__ import annotations

from jax._src import effects


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
