"""The programs in examples/ run under mpiexec and print what their docs show."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from mpirun import run

HERE = Path(__file__).parent
EXAMPLES = HERE.parent / "examples"

SIXES = "[[6. 6. 6.]\n [6. 6. 6.]\n [6. 6. 6.]]"


def run_example(name, nprocs, *args):
    """Each rank's stdout, in rank order."""
    with tempfile.TemporaryDirectory() as out:
        script = [str(HERE / "rank_output.py"), out, str(EXAMPLES / name), *args]
        result = run(nprocs, script, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        return [(Path(out) / f"rank-{r}.txt").read_text() for r in range(nprocs)]


def test_global_sum():
    assert [out.strip() for out in run_example("global_sum.py", 4)] == [SIXES, "", "", ""]


def test_send_recv():
    outputs = run_example("send_recv.py", 2)
    assert outputs[0].strip() == "r0 | [[1. 1. 1.]\n [1. 1. 1.]\n [1. 1. 1.]]"
    assert outputs[1].strip() == "r1 | [[0. 0. 0.]\n [0. 0. 0.]\n [0. 0. 0.]]"


def test_jpi_scatter_grad():
    outputs = run_example("jpi_scatter_grad.py", 4)
    assert outputs[0] == "Rank 0 has result 41.0 and gradient [1. 1. 1. 1. 1. 1. 2. 2.]\n"
    for rank in (1, 2, 3):
        expected = f"Rank {rank} has result 41.0 and gradient [0. 0. 0. 0. 0. 0. 0. 0.]\n"
        assert outputs[rank] == expected


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
    outputs = run_example("custom_op/my_comm.py", nprocs, str(custom_kernel))
    scaled = 0.5 * nprocs * np.arange(3.0) + 0.5 * nprocs * (nprocs - 1) / 2
    for rank, out in enumerate(outputs):
        assert out.startswith(f"rank {rank}: allreduce_scaled {scaled}"), out
