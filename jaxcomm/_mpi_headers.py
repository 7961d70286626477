"""Where a user's kernel (docs/extending.md) finds the mpi.h of the MPI library
that mpi4py loaded: ``python -m jaxcomm --cflags`` and ``--cmake-args``.

Found without a compiler, from what this machine has: the headers this jaxcomm
was built against while they exist, else those of the MPI installation the
library belongs to (beside it, in its pkg-config files, or through the mpicc that
mpi4py was built with).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from jaxcomm._binding import Library, builds, mpi4py_mpicc


class NoHeadersError(RuntimeError):
    """No mpi.h of the loaded MPI library's family is found for a kernel's build."""


#: What an mpi.h of each family defines: told apart without a compiler.
_HEADER_MARKS = {"openmpi": ("OPEN_MPI",), "mpich": ("MPICH_VERSION", "I_MPI_VERSION")}


def _serves(include: Path, family: str) -> bool:
    """Whether `include` holds an mpi.h of `family` (the MPI-5 ABI's: any)."""
    try:
        text = (include / "mpi.h").read_text(errors="replace")
    except OSError:
        return False
    return family not in _HEADER_MARKS or any(m in text for m in _HEADER_MARKS[family])


def _existing(dirs: list[str]) -> list[str]:
    return [d for d in dirs if Path(d).is_dir()]


def _pkg_config_includes(pc: Path) -> list[str]:
    """The include directories a pkg-config file names (Cflags' -I, else includedir)."""
    variables: dict[str, str] = {}

    def expand(value: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: variables.get(m.group(1), ""), value)

    cflags = ""
    for line in pc.read_text(errors="replace").splitlines():
        if re.match(r"^\w+=", line):
            name, _, value = line.partition("=")
            variables[name] = expand(value.strip())
        elif line.startswith("Cflags:"):
            cflags = expand(line.partition(":")[2])
    found = [t[2:] for t in cflags.split() if t.startswith("-I")]
    return found or ([variables["includedir"]] if "includedir" in variables else [])


def _own_headers(library: Library) -> list[str] | None:
    """The include directories of the MPI installation `library` belongs to, found
    beside the library file (or the file it links to)."""
    for lib in dict.fromkeys((Path(library.path), Path(library.path).resolve())):
        # <prefix>/lib/libmpi.so: <prefix>/include; Debian's libdir/libmpich.so.12:
        # libdir/mpich/include.
        name = lib.name.split(".so")[0].removeprefix("lib")
        for include in (lib.parent.parent / "include", lib.parent / name / "include"):
            if _serves(include, library.family):
                return [str(include)]
        # Its pkg-config files: Open MPI's ompi-c.pc, MPICH's mpich.pc (Debian's Open
        # MPI keeps its headers in libdir/openmpi/include, found so).
        for pc in sorted((lib.parent / "pkgconfig").glob("*mpi*.pc")):
            dirs = _pkg_config_includes(pc)
            if any(_serves(Path(d), library.family) for d in dirs):
                return _existing(dirs)
    # The wrapper mpi4py was built with, whose MPI it loads (not its binary wheel).
    mpicc = mpi4py_mpicc()
    if mpicc:
        try:
            shown = subprocess.run([mpicc, "-show"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        dirs = [t[2:] for t in shlex.split(shown.stdout) if t.startswith("-I")]
        if any(_serves(Path(d), library.family) for d in dirs):
            return _existing(dirs)
    return None


def include_dirs(library: Library) -> list[str]:
    """Where a kernel finds the mpi.h of `library`'s family: the headers this jaxcomm
    was built against, where they outlive its build (a source build against an MPI
    of this machine), else those of the MPI installation `library` belongs to. Not
    the headers of the binary wheel's build: they were on the machine that built it."""
    recorded = builds().get(library.family, {}).get("include_dirs", [])
    if any(_serves(Path(d), library.family) for d in recorded):
        return _existing(recorded)
    found = _own_headers(library)
    if found is None:
        debian = {"openmpi": "libopenmpi-dev", "mpich": "libmpich-dev"}.get(library.family)
        raise NoHeadersError(
            f"jaxcomm: no mpi.h of the MPI library that mpi4py loads ({library.path}, "
            f"{library.family} ABI) is found beside it: install that MPI's development "
            f"headers (a cluster: its module; Debian: {debian or 'its -dev package'}), "
            "or build mpi4py with that MPI's mpicc (docs/installation.md), whose "
            "`-show` names them."
        )
    return found
