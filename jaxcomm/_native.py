"""Load the native extension, bound to mpi4py's MPI (jaxcomm/_binding.py), register
its FFI targets."""

from __future__ import annotations

import itertools

import jax
from mpi4py import MPI  # initialises MPI and loads libmpi before our extension

from jaxcomm import _binding, _settings
from jaxcomm._binding import MPILibraryMismatchError

#: The MPI library mpi4py loaded, which jaxcomm's extension is bound to.
library = _binding.loaded_library(MPI)


def _load():
    cpu = _binding.load("_jaxcomm_cpu", library)
    # Bound by construction; checked once, as a guard against another MPI loaded
    # RTLD_GLOBAL before mpi4py's, whose symbols would come first.
    ours = cpu.mpi_library_version().strip().splitlines()[0].strip()
    if not cpu.mpi_initialized() or ours != library.version:
        raise MPILibraryMismatchError(
            "jaxcomm's extension resolved its MPI calls to another MPI library than "
            f"mpi4py's {library}: it sees {ours!r} (initialised: "
            f"{cpu.mpi_initialized()}). Another MPI library is loaded in this process "
            "with global symbols; load only the one mpi4py uses."
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
    """The CUDA handlers, when this package has them (an optional module) and JAX
    can use a GPU; else None, silently."""
    if _binding.cuda_missing():
        return None
    cuda = _binding.load("_jaxcomm_cuda", library)
    if cuda is None:
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


def in_flight(key: int) -> int:
    """How many requests posted on the communicator `key` MPI has not completed,
    waited or not, each tested once (each module keeps its own)."""
    return sum(module.in_flight(key) for module in _modules)


#: The platforms jaxcomm's operations lower to.
PLATFORMS = ("cpu", "cuda") if cuda is not None else ("cpu",)
