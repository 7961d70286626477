"""Non-blocking operations as the user holds them: posting one on a pytree
returns a Request, which a wait completes.

A post checks its arguments as the start primitive declares them (those of its
blocking twin), then posts each message of the same plan as the blocking form
(jaxcomm._fusion): on the eager path at once (jaxcomm._eager.call), or
while tracing by binding the start primitive (jaxcomm._nonblocking). The Request
keeps the buffers of every message and waits for them all.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from mpi4py import MPI

from jaxcomm import _checks, _eager, _fusion, _native, _nonblocking
from jaxcomm._dispatch import agree_on_structure, flatten
from jaxcomm._eager import ONE_ARRAY
from jaxcomm._jax_internals import at_top_level, current_trace
from jaxcomm._native import cpu
from jaxcomm._placement import platforms
from jaxcomm._primitive import CommInfo


class Request:
    """A posted non-blocking operation: pass it to ``JaxComm.wait`` exactly once,
    in the same function (and loop body, or branch) that posted it.

    Not a JAX type: it cannot be returned from a jitted function or carried
    through a loop. Its messages live in buffers jaxcomm owns until MPI is done
    with them, whatever happens to the Request or the arrays it was posted on.
    """

    # Eager code makes one per post: slots make that cheaper.
    __slots__ = (
        "_at_top_level",
        "_comm",
        "_counts",
        "_leaves",
        "_messages",
        "_params",
        "_parts",
        "_posted",
        "_return_status",
        "_trace",
        "_traced",
        "_tree",
        "operation",
        "waited",
    )

    def __init__(
        self,
        operation,
        comm,
        params,
        messages,
        parts,
        leaves,
        tree,
        return_status=False,
        posted=(),
        *,
        now=False,
        counts=(),
    ):
        self.operation = operation
        self._posted = posted
        self._comm = comm
        self._params = params
        self._messages = messages  # the leaves each MPI request carries (_fusion)
        self._parts = parts  # per message: (pending, request, keep), None where absent
        self._leaves = leaves
        self._tree = tree
        self._return_status = return_status
        # A variable-size exchange's (send, received) counts: the wait returns
        # the received ones beside the rows, and its adjoint takes both.
        self._counts = counts
        # `now`: posted outside any trace, on concrete arrays (the shortcut's case).
        self._traced = not now and any(
            isinstance(value, core.Tracer) for part in parts for value in part if value is not None
        )
        # Eager AD posts an operation on constants (no tangent) without tracing it.
        self._at_top_level = now or at_top_level()
        self._trace = None if now else current_trace()
        self.waited = False

    def __repr__(self) -> str:
        state = "waited" if self.waited else "pending"
        return f"jaxcomm.Request({self.operation}, {state})"

    def __del__(self):
        if getattr(self, "waited", True):
            return
        if not self._traced:
            # Cancelled where MPI can; jaxcomm keeps its buffers until MPI is done.
            if not MPI.Is_finalized():
                for _, request, _ in self._parts:
                    cpu.discard(request)
            warnings.warn(
                f"jaxcomm: a request of {self.operation} was never waited; it has been "
                "dropped (a receive or a send is cancelled where MPI can)",
                RuntimeWarning,
                stacklevel=1,
            )

    def _check_usable(self, what: str) -> None:
        if self.waited:
            raise ValueError(f"{what}: this request of {self.operation} has already been waited")
        if self._traced and at_top_level():
            raise ValueError(
                f"{what}: this request of {self.operation} was posted inside a traced "
                f"function (jit, vmap, grad...), which has returned; {what} it there"
            )
        if self._at_top_level and not at_top_level():
            raise ValueError(
                f"{what}: this request of {self.operation} was posted outside the traced "
                "function that uses it; post, test and wait in the same function"
            )
        if what == "wait" and self._traced and current_trace() is not self._trace:
            raise ValueError(
                f"{what}: this request of {self.operation} was posted outside the function, "
                "loop body or branch being traced (lax.cond, lax.fori_loop, jax.checkpoint, "
                "a nested transformation...); post, test and wait at the same level, so "
                "that the wait runs whenever the post does"
            )

    def test(self) -> bool | jax.Array:
        """Whether the operation has completed (a bool; a traced bool scalar inside
        a traced function), without waiting."""
        self._check_usable("test")
        requests = [request for _, request, _ in self._parts]
        if not self._traced:
            return all(_nonblocking.test_now(request) for request in requests)
        done = jnp.array(True)
        for request in requests:
            done = done & _nonblocking.test_p.bind(request)
        return done

    def wait(self) -> tuple[Any, Any]:
        """The operation's result, and the (source, tag) array of a receive posted
        with return_status (else None)."""
        self._check_usable("wait")
        self.waited = True
        _nonblocking.WAITED.update(self._posted)
        waits = _wait_traced if self._traced else _nonblocking.wait_now
        results, status = [None] * len(self._leaves), None
        for message, part in zip(self._messages, self._parts, strict=True):
            out = waits(self.operation, self._comm, self._params, *part, self._counts)
            if not out:
                continue
            if len(out) > 1:
                status = out[1]
            if not message.fused:
                results[message.members[0]] = self._array(message.members[0], out[0])
                continue
            for i, piece in zip(message.members, message.unpack(out[0]), strict=True):
                results[i] = self._array(i, piece)
        if not _nonblocking.OPERATIONS[self.operation].kind.result:
            return None, None
        result = self._tree.unflatten(results)
        if self._counts:
            return (result, self._counts[1]), None
        if not self._return_status:
            return result, None
        if status is None:  # an empty pytree: nothing arrived
            status = jnp.array([self._params["source"], self._params["tag"]], np.int32)
        return result, status

    def _array(self, i: int, value: Any) -> Any:
        # MPI wrote NumPy results on the direct path: each becomes a jax.Array on
        # its leaf's device.
        return _eager.as_array(value, self._leaves[i]) if isinstance(value, np.ndarray) else value


#: Seconds free() sleeps between looks at the requests still in flight on its
#: communicator. Their peers have posted the matching operations (on that
#: communicator, nothing can follow its free), so they end in about a message's
#: time; a sleep leaves the core to the peer it waits for (ranks may share cores).
_SETTLE_POLL_S = 1e-4


def settle(comm_key: int) -> None:
    """Returns once MPI has completed every request posted on the communicator
    `comm_key`, waited or not, dropped or not: before the communicator is freed
    (in_flight in cpp/requests.h says why)."""
    while _native.in_flight(comm_key):
        time.sleep(_SETTLE_POLL_S)


def drop_at_exit() -> None:
    """Drop the requests never waited, before MPI finalises: cancelled where MPI
    can, never waited for (a send that no rank receives would hang the exit)."""
    if MPI.Is_initialized() and not MPI.Is_finalized() and (left := cpu.unfinished_orphans()):
        warnings.warn(
            f"jaxcomm: {left} request(s) never waited were still in flight at exit",
            RuntimeWarning,
            stacklevel=1,
        )


def _wait_traced(operation, comm, params, pending, request, keep, counts=()):
    return _nonblocking.bind_wait(operation, comm, params, request, keep, pending, counts)


def _part(
    kind: _nonblocking.StartBuffers, outputs: Sequence[Any], leaf: Any, direct: bool
) -> tuple:
    """(pending, request, keep) of a leaf's start, from its outputs."""
    outputs = list(outputs)
    pending = outputs.pop(0) if kind.result else None
    request = outputs.pop(0)
    # On the direct path MPI reads the leaf's own buffer: hold on to the leaf.
    keep = outputs.pop(0) if kind.input and not direct else leaf
    return pending, request, keep


def start(
    operation: str, leaves: Sequence[Any], tree, *, comm: CommInfo, return_status=False, **params
) -> Request:
    """Post `operation` on the leaves, small ones of one dtype together where it is
    element-wise (as the blocking form sends them); returns the Request that waits
    for them all."""
    op = _nonblocking.OPERATIONS[operation]
    fuse = _fusion.fuses(op.start.elementwise, comm.check)
    plan = _fusion.messages([(leaf.shape, leaf.dtype) for leaf in leaves], fuse)
    items = tuple(params.items())
    alone = tree is ONE_ARRAY  # what repeat can take next time
    parts, posted = [], []
    for message in plan:
        members = [leaves[i] for i in message.members]
        direct = _eager.can_run(members)
        data = message.pack(leaves, np if direct else jnp) if message.fused else members[0]
        if direct:  # NumPy results, which MPI writes until the wait
            outputs = _eager.call(op.start, [data], comm, items, remember=alone)
        else:
            number = 0 if at_top_level() else next(_nonblocking.POSTED)
            posted.append(number)
            outputs = op.start.bind(data, comm=comm, posted=number, **params)
        parts.append(_part(op.kind, outputs, data, direct))
    return Request(operation, comm, params, plan, parts, leaves, tree, return_status, tuple(posted))


# The plan of one array: it travels alone (only a lone message's members are read).
_ALONE = [_fusion.Message(members=(0,), shapes=((),), spans=((0, 1),))]


def post(
    operation: str, x: Any, comm: CommInfo, params: dict[str, Any], return_status: bool = False
) -> Request:
    """Post `operation` on x, with `params` checked as its start declares them;
    small leaves together where it is element-wise."""
    start_p = _nonblocking.OPERATIONS[operation].start
    _checks.given(operation, x)
    start_p.check_params(params, comm)
    items = tuple(params.items())
    leaves, tree = flatten(x)
    agree_on_structure(start_p, x, tree, comm)
    found = _eager.repeat(start_p, leaves, tree, comm, items) if tree is ONE_ARRAY else None
    if found is not None:  # an earlier post like this one passed the checks below
        first, rest = found
        part = _part(_nonblocking.OPERATIONS[operation].kind, [first, *rest], x, direct=True)
        return Request(
            operation, comm, dict(items), _ALONE, [part], leaves, tree, return_status, now=True
        )
    leaves = start_p.check_operands(leaves, params, comm)
    if params.get("source") == MPI.ANY_SOURCE and comm.check:
        raise ValueError(f"{operation}: checking mode needs an explicit source, not MPI.ANY_SOURCE")
    for leaf in leaves:
        if not isinstance(leaf, jax.core.Tracer) and "cpu" not in platforms(leaf.sharding):
            raise NotImplementedError(
                f"{operation}: non-blocking operations take host (CPU) arrays; "
                "on GPU use the blocking form"
            )
    return start(operation, leaves, tree, comm=comm, return_status=return_status, **params)


def post_rows(
    operation: str, x: Any, counts: Sequence[Any], comm: CommInfo, params: dict, key: Any = None
) -> Request:
    """Post variable-size `operation` on the rows of array x, with its count
    operands (send, given), all checked as the blocking form checks them. A
    direct post is remembered under `key` (jaxcomm._eager.rows_key) for
    `repost_rows`."""
    op = _nonblocking.OPERATIONS[operation]
    operands = [x, *counts]
    if _eager.can_run([a for a in operands if not isinstance(a, np.ndarray)]):
        outputs = _eager.call(op.start, operands, comm, tuple(params.items()), key=key)
        return _rows_request(operation, x, counts[0], outputs, comm, params)
    number = 0 if at_top_level() else next(_nonblocking.POSTED)
    outputs = op.start.bind(*operands, comm=comm, posted=number, **params)
    return _rows_request(operation, x, counts[0], outputs, comm, params, posted=number)


def repost_rows(
    operation: str, x: Any, counts: Sequence[Any], comm: CommInfo, params: dict, key: Any
) -> Request | None:
    """The Request of a direct post like one that post_rows remembered under
    `key`, without its checks (C++ validates the counts' values); None if there
    was none like it."""
    outputs = _eager.repeat_rows(key, x, counts)
    if outputs is None:
        return None
    return _rows_request(operation, x, counts[0], outputs, comm, params)


def _rows_request(
    operation: str, x: Any, sent: Any, outputs: Sequence[Any], comm, params, posted=None
) -> Request:
    """The Request of a variable-size start's `outputs`: NumPy arrays that MPI
    writes until the wait (a direct post), or those of its bind, `posted`."""
    direct = posted is None
    received = _eager.as_array(outputs[-1], x) if direct else outputs[-1]
    part = _part(_nonblocking.OPERATIONS[operation].kind, outputs[:-1], x, direct)
    leaves, tree = flatten(x)
    return Request(
        operation,
        comm,
        params,
        _ALONE,
        [part],
        leaves,
        tree,
        posted=() if direct else (posted,),
        now=direct,
        counts=(sent, received),
    )
