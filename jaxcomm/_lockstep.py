"""Keeping ranks in step after a run-time error: the Python side of cpp/lockstep.h.

A jaxcomm operation that fails at run time stops its computation, whose later
operations then never run while the peers run theirs; a rank that went on could
pair its next call with one of them. So the failing rank goes out of step and
refuses every later call, unless the operation was paired with its peers, ran
inside the call that dispatched it, and was the last jaxcomm operation of its
computation (cpp/lockstep.h). A computation that stops for another reason (a
host callback that raises, a custom kernel, XLA, memory) after an operation
that later ones follow leaves them owed: the next operation on one of its
communicators from another computation puts the rank out of step.

XLA cannot tell a handler where its computation goes next, so the lowering
gives every jaxcomm custom call three attributes:

- ``last``: true when it is emitted, made false when a later jaxcomm call of
  the same module is emitted that a peer waits for, or at once where such calls
  emitted earlier may follow it at run time: in a loop's body, and anywhere in
  a module that has jaxcomm calls in a function other than its entry (a nested
  jit; a loop's body, as JAX lowers it), which may be called again after any
  other call. No peer
  waits for a wait or a test (they complete a request of this rank; a request
  whose wait is skipped is left to MPI to complete) or for an operation on a
  communicator of this rank alone.
- ``comms``: the keys of the module's communicators that peers wait on.
- ``owing``: what the computation owes once the call has run (cpp/lockstep.h,
  Owing). A call in the entry function (or in the body of a shard_map there)
  *owes* the later calls where one that a peer waits for follows it, else it
  *settles* what the computation owed. A call inside a loop, a conditional or
  a nested function owes nothing of its own (*inside*): it may run any number
  of times, or none, and JAX lowers a function once for every place that calls
  it. The outermost such op of the entry function that holds jaxcomm calls is
  bracketed instead (`region`): a call ``jaxcomm_entered`` before it, which
  owes, and a *settling* call ``jaxcomm_settled`` after it, which owes or
  settles as a call there would (neither communicates). So each place gets its
  own attributes, JAX's lowering cache, which would lower an equation once and
  copy it to each place it is used, is bypassed for equations with jaxcomm's
  effect (jaxcomm._jax_internals.lowering_hooks). Inside shard_map over several
  processes a rank that goes out of step ends the job (`emitted`); a shard_map
  that lies in a loop, a conditional or a nested function outside shard_map is
  not bracketed, where XLA partitions the op around it: its calls owe nothing.

A call that JAX refuses to run, because a computation it is ordered after
failed, never runs either: jaxcomm's own dispatch notes it here (`refused`).
While out of step, this rank ends the job at exit, where its peers might wait
for it forever (`abort_if_out_of_step`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from jax.interpreters import mlir
from jax.interpreters.mlir import ir
from mpi4py import MPI

from jaxcomm._native import cpu

# The attributes' names, as cpp/lockstep.h binds them, and `owing`'s values (Owing).
LAST, COMMS, OWING = "last", "comms", "owing"
INSIDE, OWES, SETTLES = 0, 1, 2
_CONFIG = "mhlo.backend_config"  # where ffi_lowering puts a custom call's attributes
# The targets of the calls that bracket a loop, a conditional or a nested
# function (cpp/lockstep.h); the settling one also follows a user's kernel.
SETTLED, ENTERED = "jaxcomm_settled", "jaxcomm_entered"

# Seconds to wait before MPI_Abort at exit: enough for mpiexec to forward the
# message from the pipe on a loaded node.
_ABORT_GRACE_S = 0.5


def attributes() -> dict[str, Any]:
    """The three attributes as a call is emitted with them (`emitted` sets them)."""
    return {LAST: np.bool_(True), COMMS: np.zeros(0, np.int64), OWING: np.int32(SETTLES)}


class _Module(threading.local):
    """The module this thread is lowering, as far as its jaxcomm calls go."""

    module: Any = None
    calls: list  # its calls with the attributes, settling ones too, as emitted
    last: list  # those that no call a peer waits for has followed since
    settling: list  # those that settle: no call a peer waits for has followed since
    comms: list  # keys of the communicators that peers wait on in its calls
    sealed = False  # none of its calls is last
    # Where the equation being lowered lies: one entry per loop, conditional or
    # function being lowered around it (`region`). Empty in the entry function.
    regions: list

    def start(self, module: Any) -> None:
        self.module, self.calls, self.last, self.settling = module, [], [], []
        self.comms, self.regions, self.sealed = [], [], False


_lowering = _Module()

# What `region` finds around an equation: the body of shard_map, lowered in
# the entry function (its calls are placed as there), an op bracketed by
# jaxcomm_entered and jaxcomm_settled, and one that is not (its calls owe
# nothing jaxcomm tracks).
_SHARD_MAP_BODY, BRACKETED, _UNTRACKED = "shard_map body", "bracketed", "untracked"


def _state(module: Any) -> _Module:
    state = _lowering
    if state.module is not module:
        state.start(module)
    return state


def region(ctx: mlir.LoweringRuleContext, *, shard_map: bool, placeable: bool) -> str | None:
    """How to lower an equation whose params hold functions with jaxcomm calls
    (a loop, a conditional, a nested function, shard_map's body), inside
    `within(ctx, how)` with the `how` returned: BRACKETED, by jaxcomm_entered
    and jaxcomm_settled, where it is the outermost of the entry function and
    `placeable` (a jaxcomm call can run there: not in a computation that XLA
    partitions over several processes)."""
    state = _state(ctx.module_context.module)
    at_top = not state.regions or state.regions[-1] == _SHARD_MAP_BODY
    if shard_map:
        return _SHARD_MAP_BODY if at_top else None
    if not at_top:
        return None
    return BRACKETED if placeable else _UNTRACKED


@contextlib.contextmanager
def within(ctx: mlir.LoweringRuleContext, how: str | None) -> Iterator[None]:
    """While an equation that `region` placed is lowered."""
    if how is None:
        yield
        return
    # The list of this module: lowering another module meanwhile starts a new one.
    regions = _state(ctx.module_context.module).regions
    regions.append(how)
    try:
        yield
    finally:
        regions.pop()


def emitted(
    ctx: mlir.LoweringRuleContext,
    call: Any,
    *,
    marked: bool,
    awaited: int | None,
    sharded: bool,
    owes: bool = False,
) -> None:
    """Account for `call`, a jaxcomm custom call just emitted with `ctx`.
    `marked`: it has the three attributes (jaxcomm's own operations do; a user
    kernel's does not). `awaited`: the key of the communicator on which a peer
    may wait for it, else None (see above). `sharded`: it lies in shard_map over
    several processes, where JAX's own collectives may follow it, which jaxcomm
    can neither see nor refuse: no call of the module is last, and a rank that
    goes out of step ends the job. `owes`: it owes whatever follows
    (jaxcomm_entered)."""
    state = _state(ctx.module_context.module)
    if sharded:
        cpu.end_job_when_out_of_step()
        _seal(state)
    in_loop, in_callee = _placement(call)
    if owes or awaited is not None:
        # What the calls that settle so far settled is owed again: peers wait for
        # this call, or for calls in the op that jaxcomm_entered brackets (whose
        # function JAX may have lowered for an earlier place, and not again).
        for earlier in state.settling:
            _set(earlier, owing=OWES)
        state.settling = []
    if awaited is not None:
        for earlier in state.last:
            _set(earlier, last=False)
        state.last = []
        if awaited not in state.comms:
            state.comms.append(awaited)
            for each in state.calls:
                _set(each, comms=state.comms)
        if in_callee:
            _seal(state)
    if not marked:
        return
    state.calls.append(call)
    inside = any(how != _SHARD_MAP_BODY for how in state.regions)
    owing = INSIDE if inside else OWES if owes else SETTLES
    _set(call, comms=state.comms, owing=owing)
    if owing == SETTLES:
        state.settling.append(call)
    if state.sealed or in_loop:
        _set(call, last=False)
    else:
        state.last.append(call)


def _seal(state: _Module) -> None:
    """No call of the module is last."""
    if not state.sealed:
        state.sealed = True
        for call in state.calls:
            _set(call, last=False)
        state.last = []


def _placement(call: Any) -> tuple[bool, bool]:
    """Whether `call` lies in a loop's body, and in a function other than main."""
    in_loop = False
    op = call.operation.parent
    while op is not None:
        if op.name == "stablehlo.while":
            in_loop = True
        elif op.name == "func.func":
            return in_loop, ir.StringAttr(op.attributes["sym_name"]).value != "main"
        op = op.parent
    return in_loop, True


def _set(call: Any, **values: Any) -> None:
    """Set attributes of `call` (last, comms, owing)."""
    attributes = {named.name: named.attr for named in ir.DictAttr(call.attributes[_CONFIG])}
    for name, value in values.items():
        if name == COMMS:
            attributes[name] = mlir.ir_attribute(np.array(value, np.int64))
        elif name == OWING:
            attributes[name] = mlir.ir_attribute(np.int32(value))
        else:
            attributes[name] = ir.BoolAttr.get(bool(value))
    call.attributes[_CONFIG] = ir.DictAttr.get(attributes)


def refusal(operation: str) -> str | None:
    """The error that refuses `operation` while this rank is out of step, else None."""
    return cpu.refusal(operation)


def refusal_on(operation: str, comms: list[int]) -> str | None:
    """The error that refuses `operation`, which communicates outside any
    computation on the communicators whose keys are `comms`, else None: while
    this rank is out of step, and where a computation owes an operation on one
    of them, in which a peer may wait (the rank goes out of step then)."""
    return cpu.refusal_on(operation, comms)


def refused(operation: str, error: BaseException) -> None:
    """`operation` did not run: JAX raised `error` before dispatching it (a
    computation it is ordered after failed). Its peers run theirs."""
    cpu.diverge(f"{operation} was not run: an earlier computation failed ({error})")


def out_of_step() -> str | None:
    """Why this rank is out of step, if it is."""
    return cpu.out_of_step()


def abort_if_out_of_step(failure_unclaimed: Callable[[], bool], *, ended: bool = False) -> None:
    """At exit: end the job if this rank is out of step, so that no peer waits
    for it forever (jaxcomm/__init__.py runs it before waiting for pending
    computations, which may themselves wait for a peer, and after: `ended`). A
    computation that failed after its call had returned, where it would
    otherwise have left the rank in step, puts it out of step only if JAX
    refused a later call for it: not if its error still waits in JAX's token,
    which no call has taken. Once every computation has ended, one that still
    owes operations (it stopped before them) puts it out of step: the peers
    wait in them. `failure_unclaimed`: whether such an error still waits in
    JAX's token (jaxcomm._jax_internals.at_exit, which builds on this module)."""
    if ended:
        cpu.diverge_if_owed()
    if cpu.refusal_pending() is not None:
        cpu.refusal_known(refused=not failure_unclaimed())
    why = cpu.out_of_step()
    if why is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    sys.stderr.write(
        f"jaxcomm: rank {MPI.COMM_WORLD.rank} ends the job at exit: it is out of step with its "
        f"peers ({why}), which may wait for it forever.\n"
    )
    sys.stderr.flush()
    time.sleep(_ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(1)
    # MPICH's MPI_Abort may return while its launcher ends the job; the exit
    # hooks after this one would wait for peers (MPI_Finalize among them).
    os._exit(1)
