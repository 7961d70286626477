"""The sanitizer's build of jaxcomm (test_sanitizer.py): a sanitized jaxcomm
installed alone into a folder that goes first on PYTHONPATH, built with this
environment's CMake, nanobind and jaxlib. The session starts it early, in the
background (early.py): it takes a minute of both cores."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from mpirun import run_watched

HERE = Path(__file__).parent


def build(stop: threading.Event | None = None) -> Path:
    """The folder of a new sanitized jaxcomm (an AssertionError with the build's
    output if it fails); killed, with whatever it built, once `stop` is set."""
    top = Path(tempfile.mkdtemp(prefix="jaxcomm-sanitized-"))
    atexit.register(shutil.rmtree, top, ignore_errors=True)
    package, folder = top / "package", top / "build"
    folder.mkdir()
    command = [
        *(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"),
        *("--target", str(package), f"-Cbuild-dir={folder}"),
        # nanobind strips Release modules unless told not to; the install step too.
        *("-Ccmake.define.JAXCOMM_SANITIZE=ON", "-Cinstall.strip=false"),
        str(HERE.parent),
    ]
    # CMake's Makefiles compile one file at a time unless told otherwise.
    cores = str(len(os.sched_getaffinity(0)))
    env = {"CMAKE_BUILD_PARALLEL_LEVEL": cores, **os.environ}
    # Ended only when the build stops writing files: no step (a compile under ASan)
    # takes ten minutes, however loaded the machine.
    result = run_watched(command, folder, stall=600, env=env, stop=stop)
    assert result.returncode == 0, result.stdout + result.stderr
    return package
