"""Lowering rules for jaxcomm's primitives: custom calls with the effect's token.

Each op is lowered with JAX's (private) token of jaxcomm's effect threaded
through its FFI custom call, after a check that the computation being lowered
is one where an MPI call can run (one device per process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core, sharding_impls
from jax._src.interpreters import mlir

from jaxcomm import _lockstep
from jaxcomm._jax_internals.effect import COMM_EFFECT


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
