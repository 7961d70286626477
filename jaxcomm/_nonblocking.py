"""Non-blocking operations: a start that posts MPI's non-blocking call, and a wait
that completes it.

Each non-blocking operation is derived from its blocking twin (same checks, same
result shapes, same FFI attributes, the same messages for a pytree's small
leaves) and is a pair of primitives:

- ``jaxcomm_i<name>``: x -> (pending, request, keep). MPI reads and writes
  buffers that jaxcomm owns until the request completes (the start copies x into
  one; cpp/requests.h), so nothing XLA frees is ever MPI's. `pending` is the
  buffer the wait writes the result into; `request` is a one-element buffer whose
  address names the posted MPI request until the wait; `keep` is x passed
  through (aliased), which the wait's AD rules read. isend has no `pending`,
  irecv no `keep`.
- ``jaxcomm_wait``: (request, keep, pending) -> result, aliased with `pending`,
  plus the status for a receive.

Both carry jaxcomm's ordered effect, so a start and its wait stay in program
order with every other jaxcomm call, while computation that depends on neither
may run between them.

Under AD the tangent of a linear operation is posted and waited alongside the
primal one; a non-linear reduction (MAX, PROD...) computes its tangent at the
wait, with blocking calls. The tangent of a receive from MPI.ANY_TAG is posted
from ANY_TAG too: its wait checks that it came with its message's tag, and its
cotangent goes back with that tag (itagged_send, whose tag is an operand). The
transpose of a wait posts the adjoint operation and the transpose of the start
waits for it, so that cotangents overlap the backward pass as the primal
messages overlap the forward pass. The adjoints of results that every rank
holds alike (iallreduce, ibcast, iallgather) are computed at the wait's
transpose: without a message where the result is one value, else with a
blocking allreduce (jaxcomm._replicated.shared_cotangent).

What the user holds, a Request, and how a post on a pytree becomes these
primitives' calls, is jaxcomm._requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.interpreters import ad, mlir

from jaxcomm import _collectives, _p2p, _reductions, _replicated, _sharded, _variable_size
from jaxcomm._checks import DEST
from jaxcomm._datatypes import ReduceOp
from jaxcomm._jax_internals import (
    COMM_EFFECT,
    OrderedPrimitive,
    apply_primitive,
    lower_with_token,
    manual_axes,
    register_lowering,
    typed,
    varying,
)
from jaxcomm._native import PLATFORMS, cpu
from jaxcomm._primitive import CommInfo, CommPrimitive, comm_primitive
from jaxcomm._rules import (
    define_rules,
    differentiable,
    instantiate,
    move_batch,
    on_rank,
    zero_tangent,
)

# float32, not an integer: a tangent or cotangent request must have the same type.
REQUEST = core.ShapedArray((1,), np.float32)


class StartBuffers(NamedTuple):
    """Which buffers an operation's start returns besides the request, and its
    wait takes: the buffers MPI uses until the wait."""

    result: bool  # the result, which MPI writes
    input: bool  # x passed through, which MPI reads (apart from `result`)
    status: bool  # the wait also returns (source, tag)
    in_place: bool = False  # the result is x's buffer, which MPI reads and writes
    # x is followed by (send counts, given counts) and the start also returns the
    # counts received, known at the post; the wait takes (send, received) after
    # its buffers, for its adjoint (a variable-size exchange).
    counts: bool = False


COLLECTIVE = StartBuffers(result=True, input=True, status=False)
IN_PLACE = StartBuffers(result=True, input=False, status=False, in_place=True)
SEND = StartBuffers(result=False, input=True, status=False)
RECEIVE = StartBuffers(result=True, input=False, status=True)
VARIABLE = StartBuffers(result=True, input=True, status=False, counts=True)


def _aliases(kind: StartBuffers) -> dict[int, int] | None:
    """Which output x's buffer becomes: keep (the wait's AD rules read it as x),
    or pending (ibcast's result). A receive's template is not passed at all
    (comm_primitive's `template`)."""
    if kind.input:
        return {0: 2 if kind.result else 1}
    return {0: 0} if kind.in_place else None


class Nonblocking(NamedTuple):
    """One non-blocking operation: its start primitive and what drives its rules."""

    start: CommPrimitive
    kind: StartBuffers
    # Batch axis of x for the start, and of its result: the blocking op's layout
    # (a rank axis stays leading, so each rank's rows are contiguous).
    batch_in: int
    batch_out: int
    # How the wait's result is typed inside shard_map: the blocking op's
    # (jaxcomm._sharded). The start's buffers vary as x does: AD rules pass x's
    # cotangent through them.
    vma: str = "varying"


def _declare(blocking: CommPrimitive, kind: StartBuffers, batch_in=0, batch_out=0) -> Nonblocking:
    def abstract_eval(x, *counts, **params):
        result, *received = blocking.result_types(x, *counts, **params) or [None]
        return [
            *([result] if kind.result else []),
            REQUEST,
            *([x] if kind.input else []),
            *(received if kind.counts else []),
        ]

    name = "i" + blocking.operation
    aliases = _aliases(kind)
    start = comm_primitive(
        name,
        abstract_eval,
        aliases=lambda *_, **__: aliases,
        before_lowering=partial(_refuse_unwaited, name),
        params=blocking.params,
        elementwise=blocking.elementwise,
        leading_axis=blocking.leading_axis,
    )
    # A start evaluated at once (a rule rebinding it outside any trace) is compiled
    # alone, before its wait is bound: its Request's owner is eager code.
    start.def_impl(
        lambda *operands, posted, **params: apply_primitive(start, *operands, posted=0, **params)
    )
    return Nonblocking(start, kind, batch_in, batch_out, blocking.vma)


# Starts bound while tracing carry a `posted` number (0 otherwise, and in the
# adjoints that AD posts itself); a Request's wait adds its numbers here. Lowering
# refuses a start whose request was never waited in the function that posted it
# (dropped, or kept past it). Memory safety does not rest on this: a start's
# messages live in buffers jaxcomm owns (cpp/requests.h). It turns a request that
# would only be cancelled into an error that names it.
POSTED = itertools.count(1)
WAITED: set[int] = set()


def _refuse_unwaited(operation: str, *, posted: int, **_) -> None:
    if posted and posted not in WAITED:
        raise ValueError(
            f"{operation}: its request is never waited in the function that posted it "
            "(dropped, or kept past the function's end); wait for every request "
            "(comm.wait) in the function, loop body or branch that posted it"
        )


OPERATIONS: dict[str, Nonblocking] = {
    op.start.name.removeprefix("jaxcomm_"): op
    for op in [
        _declare(_reductions.allreduce_p, COLLECTIVE),
        _declare(_reductions.reduce_scatter_p, COLLECTIVE, batch_in=1),
        _declare(_collectives.bcast_p, IN_PLACE),
        _declare(_collectives.allgather_p, COLLECTIVE, batch_out=1),
        _declare(_collectives.alltoall_p, COLLECTIVE, batch_in=1, batch_out=1),
        _declare(_collectives.neighbor_allgather_p, COLLECTIVE, batch_out=1),
        _declare(_collectives.neighbor_alltoall_p, COLLECTIVE, batch_in=1, batch_out=1),
        _declare(_p2p.send_p, SEND),
        _declare(_p2p.recv_p, RECEIVE),
        _declare(_variable_size.alltoallv_p, VARIABLE),
        _declare(_variable_size.neighbor_alltoallv_p, VARIABLE),
        _declare(_variable_size.allgatherv_p, VARIABLE),
        _declare(_variable_size.gatherv_p, VARIABLE),
        _declare(_variable_size.scatterv_p, VARIABLE),
        _declare(_variable_size.neighbor_allgatherv_p, VARIABLE),
    ]
}


def _declare_tagged_send() -> Nonblocking:
    """isend whose tag is read from a receive's status int32[2] = (source, tag) at
    run time: the cotangent of a message received from MPI.ANY_TAG goes back with
    the tag it came with. Only AD posts it (never differentiated or batched)."""
    name = "itagged_send"
    start = comm_primitive(
        name,
        lambda x, status, **_: [REQUEST, x],
        aliases=lambda *_, **__: _aliases(SEND),
        before_lowering=partial(_refuse_unwaited, name),
        params={"dest": DEST},
    )
    start.def_impl(
        lambda *operands, posted, **params: apply_primitive(start, *operands, posted=0, **params)
    )
    return Nonblocking(start, SEND, 0, 0)


OPERATIONS["itagged_send"] = _declare_tagged_send()


# -- the wait --------------------------------------------------------------------------


def _exchange(operation: str) -> _variable_size.Exchange:
    """The blocking variable-size exchange of non-blocking `operation`."""
    return _variable_size.EXCHANGES[operation.removeprefix("i")]


def _rows(operation: str, x, counts) -> int:
    """How many rows x of variable-size `operation` has, past any batch axis."""
    return _variable_size.rows_of(x, counts[0], _exchange(operation).unbatched[0])


def _wait_shapes(*operands, operation, comm, **_):
    kind = OPERATIONS[operation].kind
    if not kind.result:
        return []
    request, _, pending, _ = _split_wait_operands(kind, operands)
    # Inside shard_map: the result typed as the blocking operation's, from the
    # pending buffer's type; the status as the request (jaxcomm._sharded).
    vma = OPERATIONS[operation].vma
    (result,) = _sharded.type_results([pending], [pending], comm, operation, vma)
    if not kind.status:
        return [result]
    return [result, *_sharded.type_results([_p2p.STATUS], [request], comm, operation, "same")]


wait_p = OrderedPrimitive("jaxcomm_wait")
wait_p.multiple_results = True


def _wait_impl(*operands, operation, comm, params):
    # Not through JAX's dispatch: that would copy `pending` (it cannot donate it)
    # before MPI has written it.
    request, keep, pending, rest = _split_wait_operands(OPERATIONS[operation].kind, operands)
    outs = wait_now(operation, comm, params, pending, request, keep, rest)
    return [jnp.asarray(v) for v in outs]


wait_p.def_impl(_wait_impl)
wait_p.def_effectful_abstract_eval(
    lambda *avals, **params: (_wait_shapes(*avals, **params), {COMM_EFFECT})
)


def _wait_lowering(ctx, *operands, operation, comm, params):
    kind = OPERATIONS[operation].kind
    aliases = {1 + kind.input: 0} if kind.result else None  # pending, after request and keep
    return lower_with_token("jaxcomm_wait", aliases=aliases)(ctx, *operands)


# -- polling ---------------------------------------------------------------------------

test_p = OrderedPrimitive("jaxcomm_test")
test_p.def_impl(lambda request: jnp.asarray(test_now(request)))
_DONE = core.ShapedArray((), np.bool_)
test_p.def_effectful_abstract_eval(
    lambda request: (typed(_DONE, varying(request)) if manual_axes() else _DONE, {COMM_EFFECT})
)
register_lowering(test_p, lower_with_token("jaxcomm_test"), platform="cpu")


def test_now(request) -> bool:
    """Whether a request posted outside any trace has completed."""
    code, message, done = cpu.test(request)
    if code:
        raise jax.errors.JaxRuntimeError(f"{code}: {message}")
    return done


def _test_jvp(primals, tangents):
    # A tangent request, if any, completes at the wait with the primal one.
    done = test_p.bind(primals[0])
    return done, zero_tangent(done)


def _test_batch(args, dims):
    if dims[0] is not None:
        raise ValueError("test: a request cannot be batched")
    return test_p.bind(*args), None


define_rules(test_p, jvp=_test_jvp, batch=_test_batch)


def _host_only(primitive):
    """The lowering of `primitive` on a platform other than the host's: an error
    that names the operation (a wait's, or the primitive's own)."""

    def refuse(ctx, *args, **params):
        operation = params.get("operation", primitive.name.removeprefix("jaxcomm_"))
        raise NotImplementedError(
            f"{operation}: jaxcomm's non-blocking operations run on host (CPU) arrays "
            "only; on GPU use the blocking ones (docs: Non-blocking operations)"
        )

    return refuse


register_lowering(wait_p, _wait_lowering, platform="cpu")
for _platform in PLATFORMS:
    if _platform != "cpu":
        for _primitive in (wait_p, test_p, *(op.start for op in OPERATIONS.values())):
            mlir.register_lowering(_primitive, _host_only(_primitive), platform=_platform)


def _wait_operands(kind: StartBuffers, request, keep, pending, counts=()) -> list:
    buffers = [request, *([keep] if kind.input else []), *([pending] if kind.result else [])]
    return [*buffers, *counts]


def bind_wait(
    operation: str, comm: CommInfo, params: dict, request, keep, pending, counts=()
) -> list:
    """The wait of a request; `counts`: a variable-size start's (send, received),
    or a receive's (status,) of the message whose tangent it takes (_wait_jvp)."""
    operands = _wait_operands(OPERATIONS[operation].kind, request, keep, pending, counts)
    return wait_p.bind(
        *operands, operation=operation, comm=comm, params=tuple(sorted(params.items()))
    )


def wait_now(operation, comm, params, pending, request, keep, counts=()):
    """Complete a request posted outside any trace, now (`counts`, a variable-size
    start's, serve only its adjoint; a receive's, the status of the message whose
    tangent it takes, is checked)."""
    # The result is copied into `pending`: a NumPy array on the direct path. A
    # start that went through JAX's dispatch left a read-only jax.Array there,
    # which may already hold the result (ibcast's root): the wait gets a copy.
    if pending is not None and not isinstance(pending, np.ndarray):
        pending = np.array(pending)
    # Through the buffer protocol, which waits for a request buffer that JAX's
    # dispatch is still computing.
    receive = OPERATIONS[operation].kind.status
    tangent_of = np.asarray(counts[0], np.int32) if receive and counts else None
    code, message, source, tag = cpu.complete(request, pending, tangent_of)
    if code:
        raise jax.errors.JaxRuntimeError(f"{code}: {message}")
    if pending is None:
        return []
    if not OPERATIONS[operation].kind.status:
        return [pending]
    return [pending, np.array([source, tag], np.int32)]


# -- AD ----------------------------------------------------------------------------------


def _linear(operation: str, params: dict) -> bool:
    return params.get("op", ReduceOp.SUM) == ReduceOp.SUM


def _start_jvp(operation):
    op = OPERATIONS[operation]

    def jvp(primals, tangents, **params):
        (x, *counts), (t, *_) = primals, tangents
        if differentiable(x):
            _p2p.refuse_derivative_of_reply(operation, params, "differentiating")
        if not differentiable(x):
            outs = op.start.bind(x, *counts, **params)
            return outs, [zero_tangent(v) for v in outs]
        # A variable-size primal raises a rank's error on every rank at the
        # post, before any row moves (see _variable_size's JVP rules), not at a
        # wait, which ranks may reach at different points of their programs.
        # (iallgatherv's is every rank's already: C++ skips the agreement.)
        agreed = {**params, "agree": True} if op.kind.counts else params
        outs = op.start.bind(x, *counts, **agreed)
        zeros = [zero_tangent(v) for v in outs]
        if op.kind.counts:  # the tangent's rows travel as x's, to counts now known
            dots = op.start.bind(
                instantiate(t),
                counts[0],
                outs[-1],
                **{**params, "exchange": _variable_size.MIRRORED},
            )
            return outs, [*dots[:-1], zeros[-1]]
        if operation == "irecv":
            # From ANY_TAG too: the tangent is posted now, from ANY_TAG, so that no
            # rank waits for a tangent its peer has not posted a receive for. It
            # is sent right after its message (every jaxcomm send's JVP), and this
            # receive is posted right after the message's: MPI's order of messages
            # between two ranks pairs them as it paired the messages, which the
            # wait checks by tag (_wait_jvp).
            _p2p.known_source("irecv", params["source"])
        if not _linear(operation, params):
            # The tangent is computed at the wait, from x (kept) and its tangent.
            zeros[-1] = instantiate(t)
            return outs, zeros
        return outs, list(op.start.bind(instantiate(t), **params))

    return jvp


def _split_wait_operands(kind: StartBuffers, operands: Sequence[Any]):
    """(request, keep, pending, counts) of a wait's operands, None where absent.
    `counts`: a variable-size exchange's (send, received), or a receive's
    (status,) of the message whose tangent it takes, or ()."""
    request, *rest = operands
    keep = rest.pop(0) if kind.input else None
    pending = rest.pop(0) if kind.result else None
    return request, keep, pending, tuple(rest)


def _nonlinear_tangent(operation, x, y, t, comm, params):
    if operation == "iallreduce":
        return _reductions._allreduce_tangent(x, y, t, comm=comm, **params)
    return _reductions._reduce_scatter_tangent(x, y, t, comm=comm, **params)


def _wait_jvp(primals, tangents, *, operation, comm, params):
    kind = OPERATIONS[operation].kind
    outs = wait_p.bind(*primals, operation=operation, comm=comm, params=params)
    zeros = [zero_tangent(v) for v in outs]
    t_request, t_keep, _, t_counts = _split_wait_operands(kind, tangents)
    # The tangent wait's counts are the primal ones (counts have no tangent).
    buffers = len(primals) - len(t_counts)
    tangent_wait = [*tangents[:buffers], *primals[buffers:]]
    if not kind.result:
        if type(t_request) is not ad.Zero:
            wait_p.bind(*tangent_wait, operation=operation, comm=comm, params=params)
        return outs, zeros
    if type(t_request) is not ad.Zero:
        if _learns_tag(operation, dict(params)) and not t_counts:
            # The status of the message whose tangent this is: the wait checks the
            # tangent's tag against it, its transpose sends the cotangent with it.
            tangent_wait.append(outs[1])
        dots = wait_p.bind(*tangent_wait, operation=operation, comm=comm, params=params)
        return outs, [dots[0], *zeros[1:]]
    if type(t_keep) is not ad.Zero and not _linear(operation, dict(params)):
        _, keep, _, _ = _split_wait_operands(kind, primals)
        dot = _nonlinear_tangent(operation, keep, outs[0], t_keep, comm, dict(params))
        return outs, [dot, *zeros[1:]]
    return outs, zeros


# The adjoint of each operation, as (posted at the wait's transpose, waited at the
# start's transpose) or, at the wait's transpose, a function of the cotangent:
# where jaxcomm's gradient convention needs no message, or where the adjoint's
# result is not shaped like x (ineighbor_allgather: a blocking neighbor_alltoall).
class Adjoint(NamedTuple):
    operation: str | None  # the non-blocking operation that carries the cotangent
    params: Callable[..., dict] = lambda **p: p
    after: Callable[..., Any] = lambda ct, **_: ct  # applied to the waited cotangent
    local: Callable[..., Any] | None = None  # ct -> cotangent of x, at the wait's transpose
    # (comm, params) of the adjoint from the operation's: a graph's exchange goes
    # back over the reversed graph.
    over: Callable[[CommInfo, dict], tuple[CommInfo, dict]] = lambda comm, params: (comm, params)


def _reversed(comm: CommInfo, params: dict) -> tuple[CommInfo, dict]:
    reverse, back = params["neighborhood"].reversed(comm)
    return reverse, {**params, "neighborhood": back}


def _shared(ct, comm, operation):
    return _replicated.shared_cotangent(ct, comm=comm, operation=operation)


def _reversed_from_root(root, **_):
    return {"exchange": _variable_size.REVERSED, "agree": False, "root": root}


def _blocking_transpose(operation: str):
    """The cotangent of x of variable-size `operation`, by its blocking transpose,
    from the counts the start sent and received (or, `learn`, learnt again)."""
    transpose = _variable_size.EXCHANGES[operation].transpose

    def local(ct, *, comm, x, counts, learn, **params):
        exchange = _variable_size.EXCHANGED if learn else _variable_size.MIRRORED
        sent, received = _known(counts)
        cts = [ct, None]
        return transpose(cts, x, sent, received, comm=comm, **{**params, "exchange": exchange})[0]

    return local


def _known(counts: tuple) -> tuple:
    """Count operands, with zeros in place of one not known (transposed as written)."""
    return tuple(
        jnp.zeros(c.aval.shape, c.aval.dtype) if ad.is_undefined_primal(c) else c for c in counts
    )


def _from_dest(**p):
    return {"source": p["dest"], "tag": p["tag"]}


def _reply(**p):
    _p2p.known_source("irecv", p["source"])
    return {"dest": p["source"], "tag": _p2p.known_tag("irecv", p["source"], p["tag"])}


def _learns_tag(operation: str, params: dict) -> bool:
    """Whether `operation` is a receive from MPI.ANY_TAG, whose cotangent goes back
    with the tag its message came with: by itagged_send, not by ADJOINTS' isend."""
    return operation == "irecv" and _p2p.tag_unknown(params["source"], params["tag"])


def _tag_reply(params: dict) -> dict:
    """The params of itagged_send back to the source of receive `params`."""
    _p2p.known_source("irecv", params["source"])
    return {"dest": params["source"]}


ADJOINTS: dict[str, Adjoint] = {
    "iallreduce": Adjoint(None, local=lambda ct, comm, **_: _shared(ct, comm, "iallreduce")),
    "ibcast": Adjoint(
        None,
        local=lambda ct, comm, root: on_rank(comm.rank == root, _shared(ct, comm, "ibcast")),
    ),
    "iallgather": Adjoint(
        None, local=lambda ct, comm: _sharded.own_row(_shared(ct, comm, "iallgather"), comm)
    ),
    "ialltoall": Adjoint("ialltoall"),
    "ineighbor_allgather": Adjoint(None, local=_collectives.neighbor_allgather_transpose),
    "ineighbor_alltoall": Adjoint("ineighbor_alltoall", over=_reversed),
    "ireduce_scatter": Adjoint(
        "iallgather",
        params=lambda **_: {},
        after=lambda ct, comm: _replicated.pvary(ct, comm=comm),
    ),
    "isend": Adjoint("irecv", params=_from_dest),
    "irecv": Adjoint("isend", params=_reply),
    # Back to the senders, with the counts swapped, into x's rows.
    "ialltoallv": Adjoint(
        "ialltoallv", params=lambda **_: {"exchange": _variable_size.REVERSED, "agree": False}
    ),
    # The same over the reversed graph (on a grid, the grid itself).
    "ineighbor_alltoallv": Adjoint(
        "ineighbor_alltoallv",
        params=lambda neighborhood, **_: {
            "exchange": _variable_size.REVERSED,
            "agree": False,
            "neighborhood": neighborhood,
        },
        over=_reversed,
    ),
    # As the blocking transposes: gatherv's cotangent is scattered back, and
    # scatterv's gathered (off the root, x was not read: zeros, _wait_transpose).
    "igatherv": Adjoint("iscatterv", params=_reversed_from_root),
    "iscatterv": Adjoint("igatherv", params=_reversed_from_root),
    # No message (the replicated cotangent), and a sum of blocks not shaped like x
    # (a blocking neighbor_alltoallv over the reversed graph): the blocking ones.
    "iallgatherv": Adjoint(None, local=_blocking_transpose("allgatherv")),
    "ineighbor_allgatherv": Adjoint(None, local=_blocking_transpose("neighbor_allgatherv")),
}


def _adjoint_params(adjoint: Adjoint, kind: StartBuffers, params: dict, rows: int) -> dict:
    """The params of `adjoint`'s post for an operation with `params` whose x has
    `rows` rows (a variable-size adjoint returns that many)."""
    return {**adjoint.params(**params), **({"capacity": rows} if kind.counts else {})}


def _swapped(operation: str, counts: tuple, comm: CommInfo, learn: bool, params: dict) -> tuple:
    """A variable-size adjoint's count operands (none for other operations): it
    sends what arrived and receives what was sent. `learn`: what arrived is not
    known (transposed as written), so the counts' small collective learns it."""
    if not counts:
        return ()
    sent, received = _known(counts)
    if not learn:
        return received, sent
    name = _exchange(operation).primitive.operation
    return _variable_size.learnt_counts(name, sent, received, comm=comm, **params), sent


def _wait_transpose(cts, *operands, operation, comm, params):
    kind = OPERATIONS[operation].kind
    params = dict(params)
    adjoint = ADJOINTS[operation]
    ct = instantiate(cts[0]) if kind.result else None
    zero = [ad.Zero(v.aval) for v in operands]
    request_ct, keep_ct, pending_ct, counts_ct = _split_wait_operands(kind, zero)
    _, keep, _, counts = _split_wait_operands(kind, operands)
    if not _linear(operation, params):
        raise NotImplementedError(f"{operation}: op={params['op'].name} is not linear")
    learn = kind.counts and ad.is_undefined_primal(counts[1])
    if adjoint.local is not None:  # to the start's transpose, through keep or pending
        rows = {"x": keep, "counts": counts, "learn": learn} if kind.counts else {}
        local = adjoint.local(ct, comm=comm, **rows, **params)
        if kind.input:
            keep_ct = local
        else:
            pending_ct = local
    else:
        target = OPERATIONS[adjoint.operation]
        source = ct
        if source is None:  # isend: the cotangent comes back into a buffer like x
            source = jnp.zeros(operands[1].aval.shape, operands[1].aval.dtype)
        rows = _rows(operation, keep, counts) if kind.counts else 0
        if _learns_tag(operation, params):
            if not counts:  # no message received here: no tag to send back with
                _p2p.known_tag("irecv", params["source"], params["tag"])
            target, a_comm, a_params = OPERATIONS["itagged_send"], comm, _tag_reply(params)
        else:
            a_comm, a_params = adjoint.over(comm, _adjoint_params(adjoint, kind, params, rows))
        a_params["posted"] = 0
        if operation == "irecv":  # see _p2p.refuse_derivative_of_reply
            a_params["cotangent"] = True
        # A variable-size adjoint's counts, or the status whose tag a receive's
        # cotangent goes back with.
        swapped = _swapped(operation, counts, comm, learn, params) if kind.counts else counts
        outs = list(target.start.bind(source, *swapped, comm=a_comm, **a_params))
        a_pending = outs.pop(0) if target.kind.result else None
        request_ct = outs.pop(0)
        a_keep = outs.pop(0) if target.kind.input else None
        # The adjoint's result has x's shape and its kept data the result's, so they
        # travel back to the start's transpose as the cotangents of keep and pending.
        if kind.input:
            keep_ct = a_pending
            if a_pending.shape != keep.aval.shape:
                # iscatterv off the root: its igatherv leaves no rows here, and x's
                # cotangent is zeros, which that wait (writing nothing) returns.
                keep_ct = jnp.zeros(keep.aval.shape, a_pending.dtype)
        if kind.result:
            pending_ct = a_keep
    present = [
        v
        for v, here in zip(
            (request_ct, keep_ct, pending_ct), (True, kind.input, kind.result), strict=True
        )
        if here
    ]
    return [*present, *counts_ct]


def _start_transpose(operation):
    op = OPERATIONS[operation]
    adjoint = ADJOINTS[operation]

    def transpose(cts, x, *counts, comm, **params):
        cts = list(cts)
        pending_ct = cts.pop(0) if op.kind.result else None
        request_ct = cts.pop(0)
        keep_ct = cts.pop(0) if op.kind.input else None
        no_counts = [None] * len(counts)
        if adjoint.local is not None:
            return [instantiate(keep_ct if op.kind.input else pending_ct), *no_counts]
        target = adjoint.operation
        rows = _rows(operation, x, counts) if op.kind.counts else 0
        if _learns_tag(operation, params):  # as the wait's transpose posted it
            target, a_comm, a_params = "itagged_send", comm, _tag_reply(params)
        else:
            a_comm, a_params = adjoint.over(comm, _adjoint_params(adjoint, op.kind, params, rows))
        a_kind = OPERATIONS[target].kind
        learn = op.kind.counts and params["exchange"] == _variable_size.EXCHANGED
        swapped = _swapped(operation, counts, comm, learn, params)
        # As the wait's transpose passed them: the adjoint's pending came as keep's
        # cotangent, its kept data as pending's.
        outs = bind_wait(target, a_comm, a_params, request_ct, pending_ct, keep_ct, swapped)
        if not a_kind.result:
            return [None, *no_counts]
        return [adjoint.after(outs[0], comm=comm), *no_counts]

    return transpose


# -- batching: one MPI call for the whole batch, in the blocking op's layout -------------


def _start_batch(operation):
    op = OPERATIONS[operation]

    def rule(args, dims, *, comm, **params):
        _p2p.refuse_derivative_of_reply(operation, params, "batching")
        if op.kind.counts:  # as the blocking exchange: one call, the batch first
            unbatched = _exchange(operation).unbatched
            operands, restore = _variable_size.batch_first(args, dims, unbatched)
            outs = op.start.bind(*operands, comm=comm, **params)
            result, request, keep, received = outs
            return [restore(result), request, restore(keep), restore(received)], [0, None, 0, 0]
        (x, *counts), (dim, *_count_dims) = args, dims
        outs = op.start.bind(move_batch(x, dim, op.batch_in), *counts, comm=comm, **params)
        out_dims = [op.batch_out] if op.kind.result else []
        in_dims = [op.batch_in] if op.kind.input else []
        return outs, [*out_dims, None, *in_dims, *([None] if op.kind.counts else [])]

    return rule


def _wait_batch(args, dims, *, operation, comm, params):
    kind = OPERATIONS[operation].kind
    request, _, pending, counts = _split_wait_operands(kind, dims)
    if request is not None:
        raise ValueError(f"wait: the request of {operation} cannot be batched")
    if kind.status and any(d is not None for d in counts):
        raise NotImplementedError(
            "vmap of a differentiated receive from MPI.ANY_TAG over its message's tag"
        )
    if kind.counts:  # the counts too carry the batch first, as the start's outputs
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        args = [
            *args[:-2],
            *(
                _variable_size.batch_first_or_broadcast(a, d, size)
                for a, d in zip(args[-2:], counts, strict=True)
            ),
        ]
    outs = wait_p.bind(*args, operation=operation, comm=comm, params=params)
    return outs, ([pending] if kind.result else []) + ([None] if kind.status else [])


for _name, _op in OPERATIONS.items():
    define_rules(
        _op.start,
        jvp=_start_jvp(_name),
        # itagged_send carries a cotangent, which is never transposed: its
        # derivative and batch are refused (_p2p.refuse_derivative_of_reply).
        transpose=_start_transpose(_name) if _name in ADJOINTS else None,
        batch=_start_batch(_name),
    )
define_rules(wait_p, jvp=_wait_jvp, transpose=_wait_transpose, batch=_wait_batch)
