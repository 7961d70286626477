"""The installed jaxcomm binds its build of the MPI ABI family that mpi4py loaded
(jaxcomm/_binding.py): MPI is loaded once, and `python -m jaxcomm` says what binds,
or why nothing does, without needing the extension."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The installed package, found without importing it (importing jaxcomm starts MPI),
# and its _binding module, which imports nothing of jaxcomm's.
# (in a child: the source tree, without the extension, is on this process's path).
PACKAGE = Path(
    subprocess.run(
        [sys.executable, "-P", "-c", "import importlib.util as u; "
         "print(u.find_spec('jaxcomm').submodule_search_locations[0])"],
        capture_output=True, text=True, check=True, cwd="/",
    ).stdout.strip()
)  # fmt: skip
_spec = importlib.util.spec_from_file_location("_jaxcomm_binding", PACKAGE / "_binding.py")
binding = sys.modules["_jaxcomm_binding"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(binding)

ENV = dict(os.environ, PYTHONSAFEPATH="1")


def python(*args: str, env: dict | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env or ENV, cwd=cwd,
        timeout=300,
    )  # fmt: skip


def test_no_build_links_or_finds_an_mpi_library():
    """Each build leaves the MPI library to the one mpi4py loaded: it names none
    (DT_NEEDED) and has no search path (RPATH, RUNPATH) where another could be found."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf")
    files = sorted(PACKAGE.glob("_jaxcomm_*.so"))
    assert files, "no build installed"
    for path in files:
        dynamic = subprocess.run([readelf, "-d", str(path)], capture_output=True, text=True).stdout
        assert "mpi" not in dynamic.lower(), (path.name, dynamic)
        assert "RPATH" not in dynamic and "RUNPATH" not in dynamic, (path.name, dynamic)


PROBE = """
import ctypes, os, jaxcomm, jax.numpy as jnp
from jaxcomm import _native
from jaxcomm._binding import _defining_file
# The files that define MPI_Init, as the symbol is found from each loaded shared
# object (itself or its dependencies: Open MPI's plugins find libmpi's).
defining = set()
for path in {line.split()[-1] for line in open("/proc/self/maps")}:
    if ".so" in os.path.basename(path):
        try:
            library = ctypes.CDLL(path, os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        if hasattr(library, "MPI_Init"):
            defining.add(os.path.realpath(_defining_file(library.MPI_Init)))
print(sorted(defining))
print(_native.library.path, _native.library.family, _native.cpu.MPI_FAMILY)
print(float(jaxcomm.JaxComm().allreduce(jnp.ones(3)).sum()))
"""


def test_mpi_is_loaded_once_and_the_build_of_its_family_binds(tmp_path):
    done = python("-c", PROBE, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    libraries, bound, total = done.stdout.splitlines()
    path, family, built_for = bound.split()
    assert eval(libraries) == [os.path.realpath(path)]  # one MPI, mpi4py's
    assert family == built_for
    assert float(total) == 3.0


def test_diagnosis_names_the_library_the_builds_and_the_binding(tmp_path):
    done = python("-m", "jaxcomm", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.stdout
    assert "mpi4py" in report and "loads the MPI library /" in report
    family = report.split("ABI family: ")[1].split()[0]
    assert f"binds: the {family} build" in report and "it loads." in report
    assert f"  {family} " in report.split("builds in this jaxcomm")[1]


@pytest.fixture
def copy_without_this_family(tmp_path):
    """A copy of the installed jaxcomm that holds every build but the one of the
    family mpi4py loads here: a wheel without it, or one built for another MPI."""
    copy = tmp_path / "site"
    shutil.copytree(PACKAGE, copy / "jaxcomm")
    family = python("-m", "jaxcomm", cwd=tmp_path).stdout.split("ABI family: ")[1].split()[0]
    for built in (copy / "jaxcomm").glob(f"_jaxcomm_*.{family}.*"):
        built.unlink()
    config = copy / "jaxcomm" / "_build_config.py"
    config.write_text(
        config.read_text() + f"\nBUILDS.pop({family!r}, None)\n"
        "BUILDS.setdefault('openmpi' if BUILDS else 'mpiabi', {'headers': 'some', "
        "'include_dirs': []})\n"
    )
    return copy, family


def test_a_missing_family_is_refused_at_import_with_the_step_that_fixes_it(
    copy_without_this_family,
):
    copy, family = copy_without_this_family
    env = dict(ENV, PYTHONPATH=str(copy))
    imported = python("-c", "import jaxcomm", env=env, cwd=copy)
    assert imported.returncode != 0
    error = imported.stderr.strip().splitlines()[-1]
    assert error.startswith("jaxcomm._binding.MPILibraryMismatchError: mpi4py loaded"), error
    assert f"no build for the {family} ABI" in error
    assert "MPICC=/path/to/that/mpicc python -m pip install --no-deps --force-reinstall ." in error
    assert "\x00" not in imported.stderr

    report = python("-m", "jaxcomm", env=env, cwd=copy)  # without loading the extension
    assert report.returncode == 1
    assert f"ABI family: {family}" in report.stdout
    assert "binds: none. mpi4py loaded the MPI library '" in report.stdout
    assert "Traceback" not in report.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python", "-m", "jaxcomm"], True),
        (["python", "-P", "-W", "error", "-m", "jaxcomm", "--cflags"], True),
        (["python", "-mjaxcomm"], True),
        (["python", "-m", "myapp"], False),  # myapp's __init__ imports jaxcomm
        (["python", "-m", "jaxcomm.other"], False),
    ],
)
def test_python_m_jaxcomm_is_told_from_other_imports(monkeypatch, argv, expected):
    monkeypatch.setattr(sys, "argv", ["-m"])  # as Python sets it while locating a module
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert binding.started_as_main() is expected
    monkeypatch.setattr(sys, "argv", ["script.py"])
    assert binding.started_as_main() is False
