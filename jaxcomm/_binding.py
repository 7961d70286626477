"""Which build of jaxcomm's extension serves the MPI library that mpi4py loaded.

jaxcomm's extension is compiled once per MPI ABI family, as mpi4py's wheel is:
``_jaxcomm_cpu.<family>`` (and ``_jaxcomm_cuda.<family>``). No build links an MPI
library. At import, jaxcomm finds the libmpi that mpi4py's extension uses, makes
its symbols visible to libraries loaded after it (it reopens the same file with
``RTLD_GLOBAL``, which loads nothing new), and loads the build of that library's
family: the dynamic loader binds the build's MPI calls to that library once, as
for any program linked against it. So MPI is never loaded twice, any file name
serves (Debian's ``libmpich.so.12`` as well as ``libmpi.so.12``), and a call
costs what it costs in a program linked against libmpi.

Pure Python and ctypes, no extension: ``python -m jaxcomm`` reports from here
when the extension cannot load.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).parent

#: The MPI ABI families, as mpi4py names them (MPI4PY_MPIABI), and what each serves.
FAMILIES = {
    "mpich": "MPICH ABI: MPICH, Intel MPI, Cray MPICH, MVAPICH; libmpi.so.12, libmpich.so.12",
    "openmpi": "Open MPI (libmpi.so.40)",
    "mpiabi": "MPI-5 standard ABI (libmpi_abi.so)",
}

REBUILD = (
    "build jaxcomm against that MPI: from jaxcomm's source directory, run "
    "`MPICC=/path/to/that/mpicc python -m pip install --no-deps --force-reinstall .` "
    "(or set MPI_HOME to that MPI's prefix); docs/installation.md says more."
)


class MPILibraryMismatchError(ImportError):
    """jaxcomm holds no build for the MPI library that mpi4py loaded, or that
    library lacks what jaxcomm's build calls."""


@dataclass(frozen=True)
class Library:
    """The MPI library that mpi4py's extension uses."""

    path: str
    family: str
    version: str  # MPI_Get_library_version's first line

    def __str__(self) -> str:
        return f"{self.version!r} ({self.path}, {self.family} ABI)"


class _DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


def _defining_file(function: ctypes._CFuncPtr) -> str:
    """The path of the loaded shared object that defines `function`."""
    dladdr = ctypes.CDLL(None).dladdr
    dladdr.argtypes = (ctypes.c_void_p, ctypes.POINTER(_DlInfo))
    info = _DlInfo()
    if not dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info)):
        raise MPILibraryMismatchError("jaxcomm cannot tell which file mpi4py's MPI library is")
    return os.fsdecode(info.dli_fname)


def _family(library: ctypes.CDLL) -> str:
    """The ABI family, told from the library's symbols as mpi4py tells it."""
    abi_version = getattr(library, "MPI_Abi_get_version", None)
    if abi_version is not None:
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        if abi_version(ctypes.byref(major), ctypes.byref(minor)) == 0 and major.value > 0:
            return "mpiabi"  # MPICH's libmpi.so.12 has the function too, and says -1
    return "openmpi" if hasattr(library, "ompi_mpi_comm_self") else "mpich"


def loaded_library(mpi: ModuleType) -> Library:
    """The libmpi that mpi4py's extension `mpi` (``mpi4py.MPI``) uses, found from
    the extension itself: its MPI functions resolve to that library, whatever
    mpi4py loaded it as (its wheel's finder, or a dependency of a source build)."""
    extension = ctypes.CDLL(mpi.__file__, os.RTLD_NOLOAD | os.RTLD_LAZY)
    path = _defining_file(extension.MPI_Get_library_version)
    library = ctypes.CDLL(path, os.RTLD_NOLOAD | os.RTLD_LAZY)
    version = mpi.Get_library_version().strip().replace("\x00", "").splitlines()[0].strip()
    return Library(path, _family(library), version)


def builds() -> dict[str, dict]:
    """The builds this package holds: family -> {"headers": ..., "include_dirs": [...]}."""
    try:
        from jaxcomm import _build_config
    except ImportError:
        raise ImportError(
            f"jaxcomm is being imported from {PACKAGE}, which has no compiled extension "
            "(a source checkout?). Install it with `pip install .` and run from outside "
            "the source directory."
        ) from None
    return _build_config.BUILDS


def cuda_version() -> str:
    """The CUDA runtime this package's CUDA modules were built with, or ""."""
    from jaxcomm import _build_config

    return _build_config.CUDA_VERSION


def extension_file(module: str, family: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = PACKAGE / f"{module}.{family}{suffix}"
        if path.exists():
            return path
    return None


def build_for(library: Library) -> str:
    """The family of the build that serves `library`; else MPILibraryMismatchError
    saying what this package holds and what to do."""
    held = builds()
    if library.family in held and extension_file("_jaxcomm_cpu", library.family):
        return library.family
    listed = ", ".join(f"{f} ({d['headers']})" for f, d in held.items()) or "none"
    raise MPILibraryMismatchError(
        f"mpi4py loaded the MPI library {library}, and this jaxcomm has no build for the "
        f"{library.family} ABI: it holds {listed}. Either run with an MPI of a family it "
        f"holds, or {REBUILD}"
    )


def _promote(library: Library) -> None:
    """Make the library's symbols visible to libraries loaded from now on. It is
    already loaded: this only reopens it, RTLD_GLOBAL."""
    ctypes.CDLL(library.path, os.RTLD_NOLOAD | os.RTLD_GLOBAL | os.RTLD_NOW)


def load(module: str, library: Library) -> ModuleType | None:
    """Bind `library` and import jaxcomm.<module> from the build of its family
    (None if this package has no such module)."""
    family = build_for(library)
    path = extension_file(module, family)
    if path is None:
        return None
    _promote(library)
    name = f"jaxcomm.{module}"
    spec = importlib.util.spec_from_file_location(name, path)
    try:
        extension = importlib.util.module_from_spec(spec)
    except ImportError as error:
        # Typically "undefined symbol: MPI_...": a function of newer headers than
        # the library, which the dynamic loader refuses before anything runs.
        raise MPILibraryMismatchError(
            f"jaxcomm's {family} build ({path.name}, compiled against "
            f"{builds()[family]['headers']}) does not load with the MPI library {library}: "
            f"{error}. That library is older than those headers; {REBUILD}"
        ) from error
    sys.modules[name] = extension
    spec.loader.exec_module(extension)
    return extension


def include_dirs(library: Library) -> list[str]:
    """Where the mpi.h of `library`'s family is: the build's own headers while they
    exist (a source build), else the library's prefix's include/."""
    recorded = builds().get(library.family, {}).get("include_dirs", [])
    if any(Path(d, "mpi.h").exists() for d in recorded):
        return recorded
    for lib in (Path(library.path), Path(library.path).resolve()):
        # <prefix>/lib/libmpi.so: <prefix>/include; Debian's libdir/libmpich.so.12:
        # libdir/mpich/include.
        name = lib.name.split(".so")[0].removeprefix("lib")
        for include in (lib.parent.parent / "include", lib.parent / name / "include"):
            if (include / "mpi.h").exists():
                return [str(include)]
    raise RuntimeError(
        f"jaxcomm: no mpi.h found for the MPI library {library}: install its development "
        "headers, and add their folder (`mpicc -show` shows it) to the include directories"
    )


def started_as_main() -> bool:
    """True while `python -m jaxcomm` imports this package to run its __main__:
    Python then sets sys.argv[0] to "-m" and keeps the command line in orig_argv."""
    if sys.argv[:1] != ["-m"]:
        return False
    args = iter(sys.orig_argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None) == "jaxcomm"
        if arg.startswith("-m"):
            return arg[2:] == "jaxcomm"
        if arg in ("-W", "-X"):
            next(args, None)
    return False
