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


def _with_mpicc(mpicc: str) -> str:
    """The environment prefix of a command that builds with `mpicc`: MPI_HOME, which
    a cluster's `module load` often sets, would come first (build_backend/mpi_choice.py)."""
    mpi_home = "env -u MPI_HOME " if os.environ.get("MPI_HOME") else ""
    return f"{mpi_home}MPICC={mpicc or '/path/to/that/mpicc'}"


def rebuild_jaxcomm(mpicc: str = "") -> str:
    """How to build jaxcomm against the MPI whose compiler wrapper is `mpicc`."""
    return (
        "from jaxcomm's source directory, run "
        f"`{_with_mpicc(mpicc)} python -m pip install --no-deps --force-reinstall .`"
    )


def rebuild_mpi4py(mpicc: str = "") -> str:
    """How to build mpi4py against the MPI whose compiler wrapper is `mpicc`."""
    return (
        f"`{_with_mpicc(mpicc)} python -m pip install --no-cache-dir --force-reinstall "
        "--no-binary mpi4py mpi4py`"
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


def not_built() -> str:
    """Why this package cannot bind, if it is a source folder without the compiled
    extension (Python puts the current folder first on its path: `python -m jaxcomm`
    in a checkout imports it), naming the installed jaxcomm; else ""."""
    if (PACKAGE / "_build_config.py").exists():  # written by the build
        return ""
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != PACKAGE.parent.resolve()]
    installed = importlib.machinery.PathFinder.find_spec("jaxcomm", elsewhere)
    where = (
        f"The installed jaxcomm is in {installed.submodule_search_locations[0]}: run "
        "`python -P -m jaxcomm` (-P: without the current folder), or from another folder."
        if installed is not None
        else f"No jaxcomm is installed for {sys.executable}: run `pip install .` first."
    )
    return (
        f"jaxcomm is being imported from {PACKAGE}, a source folder without the compiled "
        f"extension (Python looks in the current folder first). {where}"
    )


def builds() -> dict[str, dict]:
    """The builds this package holds: family -> {"headers": ..., "include_dirs": [...],
    "mpicc": ...}."""
    if why := not_built():
        raise ImportError(why)
    from jaxcomm import _build_config

    return _build_config.BUILDS


def cuda_version() -> str:
    """The CUDA runtime this package's CUDA modules were built with, or ""."""
    from jaxcomm import _build_config

    return _build_config.CUDA_VERSION


def cuda_missing() -> str:
    """What keeps JAX from a CUDA backend here (and jaxcomm's CUDA module from
    loading), or "": its CUDA plugin and an NVIDIA driver. Found without starting
    JAX's backends (jax.distributed must come first) or touching the plugin, which
    logs that it found no driver on a machine without a GPU."""
    if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
        return 'no JAX CUDA plugin (pip install "jax[cuda12]")'
    if not (Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()):
        return "no NVIDIA driver"
    return ""


def extension_file(module: str, family: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = PACKAGE / f"{module}.{family}{suffix}"
        if path.exists():
            return path
    return None


def mpi4py_mpicc() -> str:
    """The compiler wrapper mpi4py was built with; "" for mpi4py's binary wheel,
    which chooses among the MPI libraries it finds at run time."""
    import mpi4py

    return str(mpi4py.get_config().get("mpicc", ""))


def _ways_out(held: dict[str, dict]) -> str:
    """Both ways to one MPI, the likelier first: jaxcomm rebuilt for mpi4py's MPI, or
    mpi4py rebuilt for jaxcomm's. Whoever was built against a chosen MPI is right."""
    ours = next((d for d in held.values() if os.access(d.get("mpicc") or "", os.X_OK)), None)
    theirs = mpi4py_mpicc()
    fix_jaxcomm = f"build jaxcomm against the MPI that mpi4py loads: {rebuild_jaxcomm(theirs)}"
    if ours is not None and not theirs:
        # mpi4py's binary wheel took the first MPI it found; jaxcomm was built for
        # an MPI installed here.
        return (
            f"mpi4py's binary wheel chose that library; jaxcomm was built for the MPI of "
            f"{ours['mpicc']}. Either build mpi4py against that MPI: "
            f"{rebuild_mpi4py(ours['mpicc'])}; or {fix_jaxcomm}."
        )
    return (
        f"Either {fix_jaxcomm}; or build mpi4py against an MPI of a family jaxcomm holds "
        f"(your site's): {rebuild_mpi4py(ours['mpicc'] if ours else '')}."
    )


def build_for(library: Library) -> str:
    """The family of the build that serves `library`; else MPILibraryMismatchError
    saying what this package holds and what to do."""
    held = builds()
    if library.family in held and extension_file("_jaxcomm_cpu", library.family):
        return library.family
    listed = ", ".join(f"{f} ({d['headers']})" for f, d in held.items()) or "none"
    raise MPILibraryMismatchError(
        f"mpi4py loaded the MPI library {library}, and this jaxcomm has no build for the "
        f"{library.family} ABI: it holds {listed}. {_ways_out(held)} "
        "docs/installation.md says more."
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
            f"{error}. That library is older than those headers; build jaxcomm against "
            f"it: {rebuild_jaxcomm(mpi4py_mpicc())}."
        ) from error
    sys.modules[name] = extension
    spec.loader.exec_module(extension)
    return extension


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
