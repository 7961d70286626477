"""The installed jaxcomm binds its build of the MPI ABI family that mpi4py loaded
(jaxcomm/_binding.py): MPI is loaded once, and `python -m jaxcomm` says what binds,
or why nothing does, without needing the extension."""

import importlib.util
import os
import re
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
    # Whether the CUDA module loads here, and if not, what is missing.
    (cuda,) = [line for line in report.splitlines() if line.startswith("CUDA module: ")]
    assert cuda == "CUDA module: not built" or re.search(
        r"runtime \(no toolkit needed\); (not loaded here: no (JAX CUDA plugin|NVIDIA driver)"
        r"|loads here, for JAX's CUDA backend)",
        cuda,
    ), cuda


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


ROOT = Path(__file__).parent.parent


def loaded_family(env: dict) -> str:
    """The ABI family of the MPI library mpi4py loads under `env`."""
    report = python("-m", "jaxcomm", env=env, cwd=Path("/"))
    return report.stdout.partition("ABI family: ")[2].partition(" ")[0]


def copy_of_package(into: Path, record: str) -> Path:
    """A copy of the installed jaxcomm whose record of its builds (_build_config.py,
    which the build writes) is changed by the Python statements `record`."""
    shutil.copytree(PACKAGE, into / "jaxcomm")
    config = into / "jaxcomm" / "_build_config.py"
    config.write_text(config.read_text() + "\n" + record + "\n")
    return into


def recorded_builds() -> dict:
    scope: dict = {}
    exec((PACKAGE / "_build_config.py").read_text(), scope)
    return scope["BUILDS"]


@pytest.fixture
def other_mpi():
    """Debian's MPI of the family that mpi4py does not load here, loaded by mpi4py's
    binary wheel instead (MPI4PY_LIBMPI names the library it loads): a real mismatch
    between the MPI mpi4py chose and the one jaxcomm was built for."""
    here = loaded_family(ENV)
    other = "mpich" if here == "openmpi" else "openmpi"
    name = {"openmpi": "libmpi.so.40", "mpich": "libmpich.so.12"}[other]
    library = next(iter(sorted(Path("/usr/lib").glob(f"*/{name}"))), None)
    if library is None:
        pytest.skip(f"no Debian {other} (apt-get install lib{other}-dev)")
    env = dict(ENV, MPI4PY_LIBMPI=str(library))
    if loaded_family(env) != other:
        pytest.skip("mpi4py is not its binary wheel: it loads the MPI it was built with")
    return env, other


def ways_out(report: str) -> tuple[int, int]:
    """Where the hint to rebuild mpi4py, and the one to rebuild jaxcomm, begin."""
    mpi4py, jaxcomm = "--no-binary mpi4py mpi4py`", "--no-deps --force-reinstall .`"
    return report.index(mpi4py), report.index(jaxcomm)


def test_a_mismatch_names_both_ways_out_the_likelier_first(tmp_path, other_mpi):
    """mpi4py's binary wheel loads one MPI, jaxcomm was built for another: either
    may be the wrong one. A jaxcomm built for an MPI of this machine (its mpicc
    recorded) says to rebuild mpi4py first; one built from the headers of pip's
    build environment says to rebuild jaxcomm first. Neither hint sets MPICC
    without unsetting a MPI_HOME, which comes first in a build."""
    env, family = other_mpi
    if set(recorded_builds()) <= {family}:
        pytest.skip(f"this jaxcomm holds only the {family} build")
    wrapper = Path(sys.executable).parent / "mpicc"
    wrapper = str(wrapper if wrapper.exists() else shutil.which("mpicc"))
    record = f"BUILDS.pop({family!r}, None)\nfor build in BUILDS.values():\n    build['mpicc'] = "
    copy = copy_of_package(tmp_path / "site", record + repr(wrapper))
    for built in (copy / "jaxcomm").glob(f"_jaxcomm_*.{family}.*"):
        built.unlink()
    env = dict(env, PYTHONPATH=str(copy))
    report = python("-m", "jaxcomm", env=env, cwd=tmp_path).stdout
    assert f"no build for the {family} ABI" in report, report
    assert (
        f"mpi4py's binary wheel chose that library; jaxcomm was built for the MPI of {wrapper}. "
        in report
    )
    rebuild_mpi4py, rebuild_jaxcomm = ways_out(report)
    assert rebuild_mpi4py < rebuild_jaxcomm, report
    assert f"`MPICC={wrapper} python -m pip install --no-cache-dir --force-reinstall" in report

    at_home = python("-m", "jaxcomm", env=dict(env, MPI_HOME="/opt/mpi"), cwd=tmp_path).stdout
    assert f"`env -u MPI_HOME MPICC={wrapper} python -m pip install --no-cache" in at_home
    assert "`MPICC=" not in at_home

    shutil.rmtree(copy)  # built from the headers of pip's build environment: no mpicc
    copy = copy_of_package(copy, record + "''")
    for built in (copy / "jaxcomm").glob(f"_jaxcomm_*.{family}.*"):
        built.unlink()
    report = python("-m", "jaxcomm", env=env, cwd=tmp_path).stdout
    rebuild_mpi4py, rebuild_jaxcomm = ways_out(report)
    assert rebuild_jaxcomm < rebuild_mpi4py, report
    assert "`MPICC=/path/to/that/mpicc python -m pip install --no-deps --force" in report


@pytest.fixture
def wheel_from_elsewhere(tmp_path):
    """A copy of the installed jaxcomm whose recorded headers are not on this
    machine, as those of a binary wheel built before this change, elsewhere."""
    gone = "/build-machine/wheel/include"
    record = f"for build in BUILDS.values():\n    build['include_dirs'] = [{gone!r}]"
    return copy_of_package(tmp_path / "site", record)


def assert_headers_of(family: str, env: dict, copy: Path):
    """`--cflags` names existing folders only, one with the mpi.h of `family`."""
    env = dict(env, PYTHONPATH=str(copy))
    done = python("-m", "jaxcomm", "--cflags", env=env, cwd=copy)
    assert done.returncode == 0, done.stdout + done.stderr
    folders = [Path(flag[2:]) for flag in done.stdout.split()]
    assert all(folder.is_dir() for folder in folders), folders
    headers = [(f / "mpi.h").read_text() for f in folders if (f / "mpi.h").exists()]
    assert len(headers) == 1, folders
    assert ("OPEN_MPI" in headers[0]) == (family == "openmpi"), folders


def test_kernel_flags_name_headers_of_the_loaded_mpi(wheel_from_elsewhere):
    assert_headers_of(loaded_family(ENV), ENV, wheel_from_elsewhere)


def test_kernel_flags_find_a_system_mpis_headers_or_say_what_to_do(
    tmp_path, wheel_from_elsewhere, other_mpi
):
    """Debian's MPIs keep their headers away from the library's prefix (Open MPI's
    pkg-config file names them); where no headers are near the library, `--cflags`
    fails in one line that says what to do."""
    env, family = other_mpi
    assert_headers_of(family, env, wheel_from_elsewhere)

    library = Path(env["MPI4PY_LIBMPI"])
    alone = tmp_path / "alone" / "lib"
    alone.mkdir(parents=True)
    shutil.copy(library.resolve(), alone / library.name)
    env = dict(env, PYTHONPATH=str(wheel_from_elsewhere), MPI4PY_LIBMPI=str(alone / library.name))
    done = python("-m", "jaxcomm", "--cflags", env=env, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert f"no mpi.h of the MPI library that mpi4py loads ({alone}" in done.stderr
    assert "install that MPI's development headers" in done.stderr


@pytest.mark.skipif((ROOT / "jaxcomm" / "_build_config.py").exists(), reason="built in place")
def test_python_m_jaxcomm_in_the_source_checkout_names_the_installed_one():
    """Python puts the current folder first on its path: in a checkout, `python -m
    jaxcomm` imports the source folder, which has no compiled extension."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = python("-m", "jaxcomm", env=env, cwd=ROOT)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    assert f"jaxcomm is being imported from {ROOT / 'jaxcomm'}, a source folder" in done.stderr
    assert f"The installed jaxcomm is in {PACKAGE}: run `python -P -m jaxcomm`" in done.stderr


def test_python_m_jaxcomm_without_mpi4py_names_the_install(tmp_path):
    """A Python without site-packages (-S), given only jaxcomm: mpi4py cannot be
    imported, as where it was never installed."""
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "jaxcomm").symlink_to(PACKAGE)
    env = dict(ENV, PYTHONPATH=str(tmp_path / "path"))
    done = python("-S", "-m", "jaxcomm", env=env, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("mpi4py is not installed"), done.stdout
    assert "MPICC=mpicc pip install --no-cache-dir --no-binary mpi4py mpi4py" in done.stdout
    assert "pip install mpi4py mpich" in done.stdout
