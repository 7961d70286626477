"""``python -m jaxcomm``: which MPI mpi4py loads, which builds this jaxcomm holds,
which one binds and, if none, what to do. Works where the extension cannot load:
it reports before trying to. ``--cmake-args``, ``--cflags``, ``--libs``: the flags
for building a kernel against jaxcomm (docs/extending.md)."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from jaxcomm import _binding, _mpi_headers


def _mpi():
    """mpi4py.MPI, loaded without initialising MPI (no launcher needed)."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    from mpi4py import MPI

    return MPI


def flags(library: _binding.Library) -> dict[str, list[str]]:
    """Include directories and the MPI library for a kernel against this jaxcomm."""
    import jax

    headers = [str(_binding.PACKAGE / "include"), jax.ffi.include_dir()]
    return {
        "include_dirs": [*headers, *_mpi_headers.include_dirs(library)],
        "libraries": [library.path],
    }


def report(mpi) -> int:
    """Print the diagnosis; 0 if a build binds and loads, else 1."""
    print(f"jaxcomm {importlib.metadata.version('jaxcomm')} in {_binding.PACKAGE}")
    try:
        library = _binding.loaded_library(mpi)
    except (OSError, AttributeError) as error:
        print(f"mpi4py's MPI library cannot be found: {error}")
        return 1
    print(f"mpi4py {importlib.metadata.version('mpi4py')} loads the MPI library {library.path}")
    print(f"  {library.version}")
    print(f"  ABI family: {library.family} ({_binding.FAMILIES[library.family]})")
    held = _binding.builds()
    print("builds in this jaxcomm, one per MPI ABI family:")
    for family, build in held.items():
        print(f"  {family:8} compiled against {build['headers']}")
    cuda, missing = _binding.cuda_version(), _binding.cuda_missing()
    if not cuda:
        print("CUDA module: not built")
    else:  # the runtime is linked in: it needs a driver and JAX's plugin, no toolkit
        here = f"not loaded here: {missing}" if missing else "loads here, for JAX's CUDA backend"
        print(f"CUDA module: built with the CUDA {cuda} runtime (no toolkit needed); {here}")
    family = None
    try:
        family = _binding.build_for(library)
        # Before loading it: a crash there still shows which build was tried.
        print(f"binds: the {family} build", flush=True)
        _binding.load("_jaxcomm_cpu", library)
    except _binding.MPILibraryMismatchError as error:
        print(f"  it does not load: {error}" if family else f"binds: none. {error}")
        return 1
    print("  it loads.")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxcomm", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cmake-args", action="store_true", help="CMake -D arguments")
    group.add_argument("--cflags", action="store_true", help="-I flags")
    group.add_argument("--libs", action="store_true", help="the MPI library")
    args = parser.parse_args()
    if why := _binding.not_built():
        print(why, file=sys.stderr)
        return 1
    try:
        mpi = _mpi()
    except ModuleNotFoundError as error:
        if error.name != "mpi4py":
            raise
        print("mpi4py is not installed: install it, on a cluster built against the site's MPI")
        print("(MPICC=mpicc pip install --no-cache-dir --no-binary mpi4py mpi4py; see")
        print("docs/installation.md), elsewhere with an MPI wheel (pip install mpi4py mpich).")
        return 1
    except (ImportError, RuntimeError) as error:
        print(f"mpi4py cannot load an MPI library: {error}")
        print("Load your site's MPI (`module load`), or install one (pip install mpich).")
        return 1
    if not (args.cmake_args or args.cflags or args.libs):
        return report(mpi)
    try:
        found = flags(_binding.loaded_library(mpi))
    except (OSError, AttributeError, _mpi_headers.NoHeadersError) as error:
        # One line, for a build script's log: never a folder that is not there.
        print(error, file=sys.stderr)
        return 1
    if args.cmake_args:
        print(
            f"-DJAXCOMM_INCLUDE_DIRS={';'.join(found['include_dirs'])} "
            f"-DJAXCOMM_MPI_LIBRARY={found['libraries'][0]}"
        )
    elif args.cflags:
        print(" ".join(f"-I{d}" for d in found["include_dirs"]))
    else:
        print(" ".join(found["libraries"]))
    return 0
