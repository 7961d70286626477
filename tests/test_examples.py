"""The programs in examples/ run under mpiexec and print what their docs show."""

from pathlib import Path

from mpirun import run

EXAMPLES = Path(__file__).parent.parent / "examples"

SIXES = "[[6. 6. 6.]\n [6. 6. 6.]\n [6. 6. 6.]]"


def run_example(name, nprocs):
    result = run(nprocs, [str(EXAMPLES / name)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_global_sum():
    assert run_example("global_sum.py", 4).strip() == SIXES


def test_send_recv():
    out = run_example("send_recv.py", 2)
    zeros = "[[0. 0. 0.]\n [0. 0. 0.]\n [0. 0. 0.]]"
    ones = "[[1. 1. 1.]\n [1. 1. 1.]\n [1. 1. 1.]]"
    assert f"r1 | {zeros}" in out
    assert f"r0 | {ones}" in out


def test_jpi_scatter_grad():
    out = run_example("jpi_scatter_grad.py", 4)
    lines = sorted(out.strip().splitlines())
    assert lines == [
        "Rank 0 has result 41.0 and gradient [1. 1. 1. 1. 1. 1. 2. 2.]",
        *(f"Rank {r} has result 41.0 and gradient [0. 0. 0. 0. 0. 0. 0. 0.]" for r in (1, 2, 3)),
    ]
