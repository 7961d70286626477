"""The programs in examples/ run under mpiexec and print what their docs show."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpirun import run

EXAMPLES = Path(__file__).parent.parent / "examples"

SIXES = "[[6. 6. 6.]\n [6. 6. 6.]\n [6. 6. 6.]]"


def run_example(name, nprocs, *args):
    result = run(nprocs, [str(EXAMPLES / name), *args], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_global_sum():
    assert run_example("global_sum.py", 4).strip() == SIXES


def test_send_recv():
    out = run_example("send_recv.py", 2)
    zeros = "r1 | [[0. 0. 0.]\n [0. 0. 0.]\n [0. 0. 0.]]"
    ones = "r0 | [[1. 1. 1.]\n [1. 1. 1.]\n [1. 1. 1.]]"
    # mpiexec may interleave the two ranks' output line by line (Open MPI does).
    assert sorted(out.strip().splitlines()) == sorted(f"{zeros}\n{ones}".splitlines())


def test_jpi_scatter_grad():
    out = run_example("jpi_scatter_grad.py", 4)
    lines = sorted(out.strip().splitlines())
    assert lines == [
        "Rank 0 has result 41.0 and gradient [1. 1. 1. 1. 1. 1. 2. 2.]",
        *(f"Rank {r} has result 41.0 and gradient [0. 0. 0. 0. 0. 0. 0. 0.]" for r in (1, 2, 3)),
    ]


@pytest.fixture(scope="module")
def custom_kernel(tmp_path_factory):
    """examples/custom_op built by its CMake project against the installed jaxcomm."""
    build = tmp_path_factory.mktemp("custom_op")
    env = dict(os.environ, PYTHONSAFEPATH="1")
    flags = subprocess.run(
        [sys.executable, "-m", "jaxcomm", "--cmake-args"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=build,
    ).stdout.split()
    cmake = shutil.which("cmake", path=str(Path(sys.executable).parent)) or "cmake"
    for command in (
        [cmake, "-S", str(EXAMPLES / "custom_op"), "-B", str(build), *flags],
        [cmake, "--build", str(build)],
    ):
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=build)
        assert done.returncode == 0, done.stdout + done.stderr
    return build / "liballreduce_scale.so"


@pytest.mark.parametrize("nprocs", [2, 3])
def test_custom_op(custom_kernel, nprocs):
    out = run_example("custom_op/my_comm.py", nprocs, str(custom_kernel))
    scaled = 0.5 * nprocs * np.arange(3.0) + 0.5 * nprocs * (nprocs - 1) / 2
    lines = sorted(out.strip().splitlines())
    assert len(lines) == nprocs
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank}: allreduce_scaled {scaled}"), line
