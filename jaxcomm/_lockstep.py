"""Keeping ranks in step after a run-time error: the Python side of cpp/lockstep.h.

A jaxcomm operation that fails at run time stops its computation, whose later
operations then never run while the peers run theirs; a rank that went on could
pair its next call with one of them. So the failing rank goes out of step and
refuses every later call, unless the operation was paired with its peers, ran
inside the call that dispatched it, and was the last jaxcomm operation of its
computation (cpp/lockstep.h). XLA cannot tell a handler that last point, so the
lowering marks it: every jaxcomm custom call carries the attribute ``last``,
true when it is emitted and made false when a later jaxcomm call of the same
module is emitted that a peer waits for, or at once where such calls emitted
earlier may follow it at run time: in a loop's body, and anywhere in a module
that has such calls in a function other than its entry (a nested jit, a branch
of lax.cond), which may be called again after any other call. No peer waits for
a wait or a test (they complete a request of this rank; a request whose wait is
skipped is left to MPI to complete) or for an operation on a communicator of
this rank alone.

A call that JAX refuses to run, because a computation it is ordered after
failed, never runs either: jaxcomm's own dispatch notes it here (`refused`).
While out of step, this rank ends the job at exit, where its peers might wait
for it forever (`abort_if_out_of_step`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from jax.interpreters import mlir
from jax.interpreters.mlir import ir
from mpi4py import MPI

from jaxcomm._native import cpu

# The attribute's name, as cpp/cpu.cc and cuda.cc bind it.
LAST = "last"
_CONFIG = "mhlo.backend_config"  # where ffi_lowering puts a custom call's attributes

# Seconds to wait before MPI_Abort at exit: enough for mpiexec to forward the
# message from the pipe on a loaded node.
_ABORT_GRACE_S = 0.5


class _Module(threading.local):
    """The module this thread is lowering: its jaxcomm calls still marked last,
    and whether none of them can be (`sealed`)."""

    module: Any = None
    last: tuple = ()
    sealed = False


_lowering = _Module()


def emitted(
    ctx: mlir.LoweringRuleContext, call: Any, *, marked: bool, awaited: bool, sharded: bool
) -> None:
    """Account for `call`, a jaxcomm custom call just emitted with `ctx`.
    `marked`: it has the attribute ``last`` (jaxcomm's own operations do; a user
    kernel's does not). `awaited`: a peer may wait for it (see above).
    `sharded`: it lies in shard_map over several processes, where JAX's own
    collectives may follow it, which jaxcomm can neither see nor refuse: no call
    of the module is last, and a rank that goes out of step ends the job."""
    state = _lowering
    module = ctx.module_context.module
    if state.module is not module:
        state.module, state.last, state.sealed = module, (), False
    if sharded:
        cpu.end_job_when_out_of_step()
        awaited = state.sealed = True
    in_loop, in_callee = _placement(call)
    if awaited:
        for earlier in state.last:
            _followed(earlier)
        state.last = ()
        state.sealed = state.sealed or in_callee
    if not marked:
        return
    if state.sealed or in_loop:
        _followed(call)
    else:
        state.last = (*state.last, call)


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


def _followed(call: Any) -> None:
    """Mark `call` as one that another jaxcomm call may follow at run time."""
    attributes = {named.name: named.attr for named in ir.DictAttr(call.attributes[_CONFIG])}
    attributes[LAST] = ir.BoolAttr.get(False)
    call.attributes[_CONFIG] = ir.DictAttr.get(attributes)


def refusal(operation: str) -> str | None:
    """The error that refuses `operation` while this rank is out of step, else None."""
    return cpu.refusal(operation)


def refused(operation: str, error: BaseException) -> None:
    """`operation` did not run: JAX raised `error` before dispatching it (a
    computation it is ordered after failed). Its peers run theirs."""
    cpu.diverge(f"{operation} was not run: an earlier computation failed ({error})")


def out_of_step() -> str | None:
    """Why this rank is out of step, if it is."""
    return cpu.out_of_step()


def abort_if_out_of_step() -> None:
    """At exit: end the job if this rank is out of step, so that no peer waits
    for it forever (jaxcomm/__init__.py runs it before waiting for pending
    computations, which may themselves wait for a peer)."""
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
