"""jaxcomm: MPI communication for JAX arrays, inside jax.jit, with grad and vmap.

    from mpi4py import MPI
    from jaxcomm import JaxComm

    comm = JaxComm(MPI.COMM_WORLD)
    total = jax.jit(lambda x: comm.allreduce(x, op=MPI.SUM))(x)

The module-level functions (``jaxcomm.allreduce(x, op, comm=None)`` ...) take the
same arguments as the JaxComm methods plus ``comm`` (a JaxComm, an mpi4py
communicator, or None for COMM_WORLD), so mpi4jax code ports with
``import jaxcomm as mpi4jax``.
"""

from __future__ import annotations

from jaxcomm import _binding

if _binding.started_as_main():
    # `python -m jaxcomm` diagnoses an install whose extension may not load: it
    # reports here, before the imports below load the extension.
    from jaxcomm._diagnosis import main

    raise SystemExit(main())

import atexit
import functools
import os
import sys
import time
from typing import Any

import jax
from jax.experimental import io_callback
from mpi4py import MPI

from jaxcomm import _jax_internals, _lockstep, _native, _requests
from jaxcomm._datatypes import DTYPES, ReduceOp
from jaxcomm._jit import jit
from jaxcomm._kernels import build_flags, register_kernel
from jaxcomm._native import MPILibraryMismatchError
from jaxcomm._primitive import PRIMITIVES
from jaxcomm._requests import Request
from jaxcomm.comm import CartComm, GraphComm, JaxComm, Status

__version__ = "0.1.0"  # the one place: pyproject.toml reads it from here

# Seconds abort_on_error waits before MPI_Abort: enough for mpiexec to read a
# traceback from the pipe on a loaded node, and nothing next to a job ending.
_ABORT_GRACE_S = 0.5

__all__ = [  # and every module-level operation, added below
    "DTYPES",
    "CartComm",
    "GraphComm",
    "JaxComm",
    "MPILibraryMismatchError",
    "ReduceOp",
    "Request",
    "Status",
    "abort_on_error",
    "build_flags",
    "cuda_aware",
    "get_comm",
    "get_include",
    "has_cuda_support",
    "has_sycl_support",
    "jit",
    "register_kernel",
]

# Before mpi4py's own exit hook (registered earlier, so run later) finalises MPI
# (atexit runs the last registered first): end the job if this rank is out of
# step, whose peers may wait for it forever (jaxcomm._lockstep); else finish
# pending jaxcomm operations (otherwise a rank can hang at exit), drop the
# requests that were never waited, and end the job if one of those computations
# has put the rank out of step, or stopped before operations that peers wait in.
atexit.register(_lockstep.abort_if_out_of_step, _jax_internals.failure_unclaimed, ended=True)
atexit.register(_requests.drop_at_exit)
atexit.register(_jax_internals.effects_settled)
atexit.register(_lockstep.abort_if_out_of_step, _jax_internals.failure_unclaimed)


def _free_duplicate(base: MPI.Comm, keyval: int, wrapped: JaxComm) -> None:
    # MPI runs this while `base` is being freed, a collective call, so every rank
    # frees the duplicate with it.
    wrapped.free()


# The JaxComm of an mpi4py communicator is kept as an MPI attribute of that
# communicator: MPI deletes it when the communicator is freed, so a later
# communicator that gets the same handle never finds the old one's.
_JAXCOMM_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_duplicate)


def get_comm(comm: JaxComm | MPI.Comm | None = None) -> JaxComm:
    """The JaxComm for `comm`: itself, the duplicate made on first use of an mpi4py
    communicator (freed with it), or (None) the default JaxComm over COMM_WORLD."""
    if isinstance(comm, JaxComm):
        return comm
    base = MPI.COMM_WORLD if comm is None else comm
    wrapped = base.Get_attr(_JAXCOMM_KEYVAL)
    if wrapped is None:
        wrapped = JaxComm(base)
        base.Set_attr(_JAXCOMM_KEYVAL, wrapped)
    return wrapped


def _module_function(name: str):
    method = getattr(JaxComm, name)

    @functools.wraps(method)
    def function(*args: Any, comm: JaxComm | MPI.Comm | None = None, **kwargs: Any) -> Any:
        return getattr(get_comm(comm), name)(*args, **kwargs)

    function.__doc__ = f"{method.__doc__}\n\nModule-level form of :meth:`JaxComm.{name}`."
    return function


def _receiving_function(name: str):
    """A module-level receive that also takes mpi4jax's ``status=``: an mpi4py
    ``MPI.Status`` whose source and tag are set when the receive runs."""
    method = getattr(JaxComm, name)

    @functools.wraps(method)
    def function(
        *args: Any,
        comm: JaxComm | MPI.Comm | None = None,
        status: MPI.Status | None = None,
        **kwargs: Any,
    ) -> Any:
        receive = getattr(get_comm(comm), name)
        if status is None:
            return receive(*args, **kwargs)
        if kwargs.pop("return_status", False):
            raise TypeError(f"{name}: pass status= or return_status=True, not both")
        result, received = receive(*args, return_status=True, **kwargs)
        _fill_status(status, received)
        return result

    function.__doc__ = (
        f"{method.__doc__}\n\nModule-level form of :meth:`JaxComm.{name}`. ``status``, an "
        "``MPI.Status``, gets the message's source and tag when the receive runs (inside "
        "jit, through an ordered ``io_callback`` when the compiled function executes)."
    )
    return function


def _fill_status(status: MPI.Status, received: Status) -> None:
    def write(source: Any, tag: Any) -> None:
        status.Set_source(int(source))
        status.Set_tag(int(tag))

    if isinstance(received.source, jax.core.Tracer):
        io_callback(write, None, received.source, received.tag, ordered=True)
    else:
        write(received.source, received.tag)


#: Module-level receives that take mpi4jax's ``status=`` (an MPI.Status to fill).
_TAKING_MPI_STATUS = ("recv", "sendrecv")
#: Every operation declared (jaxcomm._primitive.PRIMITIVES) that JaxComm has as a
#: method, and the methods that complete requests: each is a module function too.
_MODULE_FUNCTIONS = [
    name for name in (*PRIMITIVES, "wait", "test", "waitall") if hasattr(JaxComm, name)
]
for _name in _MODULE_FUNCTIONS:
    _make = _receiving_function if _name in _TAKING_MPI_STATUS else _module_function
    globals()[_name] = _make(_name)
    __all__.append(_name)
del _name, _make


def abort_on_error(comm: MPI.Comm | JaxComm | None = None, exit_code: int = 1) -> None:
    """Make an uncaught exception on any one rank end the whole job.

    Installs a ``sys.excepthook`` that prints the traceback and then calls
    ``MPI_Abort`` on `comm` (default COMM_WORLD), so that ranks waiting for the
    failed one in a collective exit too instead of hanging. Running the program
    as ``python -m mpi4py program.py`` has the same effect.
    """
    target = comm.mpi if isinstance(comm, JaxComm) else comm or MPI.COMM_WORLD
    previous = sys.excepthook

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        sys.stderr.write(
            f"jaxcomm: uncaught exception on rank {MPI.COMM_WORLD.rank}; aborting the job\n"
        )
        sys.stderr.flush()
        # mpiexec forwards each rank's stderr through a pipe and, once MPI_Abort
        # reaches it, kills the job; a moment's grace lets the traceback through.
        time.sleep(_ABORT_GRACE_S)
        target.Abort(exit_code)

    sys.excepthook = hook


def has_cuda_support() -> bool:
    """Whether this build of jaxcomm has its CUDA handlers (GPU arrays work)."""
    return _native.cuda is not None


def cuda_aware() -> bool:
    """Whether GPU buffers go to MPI directly (a CUDA-aware MPI, or
    ``JAXCOMM_CUDA_AWARE=1``) rather than through pinned host staging."""
    return _native.cuda is not None and bool(_native.cuda.cuda_aware())


def has_sycl_support() -> bool:
    """Always False: jaxcomm has no SYCL (Intel GPU) handlers. For mpi4jax code
    that asks."""
    return False


def get_include() -> str:
    """Directory holding ``jaxcomm/jaxcomm.h``, for building custom FFI kernels."""
    return os.path.join(os.path.dirname(__file__), "include")
