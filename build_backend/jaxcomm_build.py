"""jaxcomm's build backend: scikit-build-core's, after two checks that fail at once.

pip installs the small build requirements (scikit-build-core, nanobind, the
``mpich`` wheel whose headers are the fallback), then asks this backend for the
rest: before it fetches jaxlib (for the XLA FFI headers) and CMake, this checks
for a C++20 compiler and decides the MPI (mpi_choice.py), so that a missing
compiler or MPI is the first thing the build reports. The MPI choice goes to
the terminal too: pip hides all a successful build prints unless run with
``-v`` (it keeps it in the file of ``--log FILE``), and has no channel for a
backend's messages (pypa/pip#6634); the terminal shows it even when pip's
output is piped.
"""

from __future__ import annotations

import os
import sys

# Beside this file, on the path pip gives the backend (pyproject.toml: backend-path).
import cxx_check
import mpi_choice
from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (the hooks this backend does not change)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

# Fetched only once the checks have passed. jaxlib 0.10's FFI headers: handlers
# built against them register under every later jaxlib (docs/installation.md).
HEAVY_REQUIREMENTS = ["jaxlib>=0.10,<0.11"]


def _tell(message: str) -> None:
    """To the build's log and, where there is one, the user's terminal."""
    print(message, file=sys.stderr, flush=True)
    try:
        with open("/dev/tty", "w") as terminal:
            terminal.write(message + "\n")
    except OSError:
        pass  # no terminal (CI, a batch job): pip -v, pip --log FILE, `python -m jaxcomm`


def _setting(config_settings, name: str) -> str:
    """A CMake variable given as -Ccmake.define.NAME=..., else the environment's."""
    return (config_settings or {}).get(f"cmake.define.{name}") or os.environ.get(name, "")


def _check(config_settings) -> None:
    try:
        cxx = cxx_check.check()
        builds = mpi_choice.choose(
            cxx,
            mpi_home=_setting(config_settings, "MPI_HOME"),
            headers=_setting(config_settings, "JAXCOMM_MPI_HEADERS"),
            headers_origin=_setting(config_settings, "JAXCOMM_MPI_HEADERS_ORIGIN"),
        )
    except (cxx_check.CompilerError, mpi_choice.NoMPIError) as error:
        _tell(f"jaxcomm: {error}")
        raise SystemExit(1) from None
    _tell(mpi_choice.describe(builds))


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    _check(config_settings)
    return [*_skbuild.get_requires_for_build_wheel(config_settings), *HEAVY_REQUIREMENTS]


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    _check(config_settings)
    return [*_skbuild.get_requires_for_build_editable(config_settings), *HEAVY_REQUIREMENTS]
