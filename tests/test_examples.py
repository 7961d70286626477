"""The programs in examples/ run under mpiexec and print what their docs show."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpirun import launch_environment, rank_outputs

HERE = Path(__file__).parent
EXAMPLES = HERE.parent / "examples"

SIXES = "[[6. 6. 6.]\n [6. 6. 6.]\n [6. 6. 6.]]"


def run_example(name, nprocs, *args):
    """Each rank's stdout, in rank order."""
    return rank_outputs(nprocs, str(EXAMPLES / name), *args)


def rank_counts(*counts: int, everywhere: int) -> list:
    """`counts` for an example's nprocs: `everywhere` in every environment, the
    others in the first only (matrix): another JAX changes how the program
    traces and runs, not how its messages depend on the number of ranks.

    An example runs on the counts where its own messages differ: 3 ranks, whose
    neighbours are distinct, and a count where its decomposition or its peers
    change (1: a rank that is its own neighbour; 2: both neighbours one rank;
    4: more pieces). How jaxcomm's operations depend on the number of ranks is
    tests/mpi's concern, on 1 to 9."""
    return [n if n == everywhere else pytest.param(n, marks=pytest.mark.matrix) for n in counts]


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


@pytest.mark.parametrize("nprocs", rank_counts(2, 3, everywhere=3))
def test_custom_op(custom_kernel, nprocs):
    outputs = run_example("custom_op/my_comm.py", nprocs, str(custom_kernel))
    scaled = 0.5 * nprocs * np.arange(3.0) + 0.5 * nprocs * (nprocs - 1) / 2
    for rank, out in enumerate(outputs):
        assert out.startswith(f"rank {rank}: allreduce_scaled {scaled}"), out


def test_a_custom_kernel_does_not_run_out_of_step(custom_kernel, tmp_path):
    """While a rank is out of step (after an error, jaxcomm._lockstep), a user's
    kernel is refused like jaxcomm's own operations, rather than pair with the
    wrong call of a peer."""
    program = tmp_path / "refused.py"
    program.write_text(
        f"""
import sys, jax, jax.numpy as jnp
sys.path.insert(0, {str(EXAMPLES / "custom_op")!r})
from my_comm import MyComm, load_kernel
from jaxcomm import _native
jax.config.update("jax_enable_x64", True)
load_kernel({str(custom_kernel)!r})
comm = MyComm()
print(comm.allreduce_scaled(jnp.ones(2), 2.0).tolist())
_native.cpu.diverge("a test said so")
try:
    comm.allreduce_scaled(jnp.ones(2), 2.0).block_until_ready()
except jax.errors.JaxRuntimeError as error:
    print(str(error).splitlines()[0])
_native.cpu.resume()
"""
    )
    (output,) = rank_outputs(1, str(program))
    first, second = output.splitlines()
    assert first == "[2.0, 2.0]"
    assert "allreduce_scale refused: rank 0 is out of step" in second, second
    assert "a test said so" in second


def test_a_custom_kernel_that_fails_puts_its_rank_out_of_step(custom_kernel, tmp_path):
    """A jitted step allreduces, then calls the user's kernel, which fails on rank
    0 only (XLA refuses its argument there: float32 where it takes float64): the
    step stops on rank 0, while rank 1 waits in the kernel's MPI_Allreduce.
    Rank 0's next call raises instead of pairing with it; it then makes that
    allreduce with mpi4py, and both go on in step."""
    program = tmp_path / "failing.py"
    program.write_text(
        f"""
import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, {str(EXAMPLES / "custom_op")!r})
from my_comm import MyComm, load_kernel
from jaxcomm import _native
jax.config.update("jax_enable_x64", True)
load_kernel({str(custom_kernel)!r})
comm = MyComm()
dtype = jnp.float32 if comm.rank == 0 else jnp.float64

@jax.jit
def step(x):
    s = comm.allreduce(x).astype(dtype)
    (out,) = comm.call_kernel(
        "allreduce_scale", s, results=[jax.ShapeDtypeStruct(s.shape, dtype)], scale=2.0
    )
    return out

x = jnp.ones(2, jnp.float64)
try:
    print(jax.block_until_ready(step(x)).tolist())
except jax.errors.JaxRuntimeError as error:
    print("step failed")
try:
    print(comm.allreduce(x).tolist())
except jax.errors.JaxRuntimeError as error:
    print(str(error).splitlines()[0][:120])
    comm.mpi.Allreduce(np.full(2, 2.0), np.empty(2))  # the kernel's, which rank 1 waits in
    comm.mpi.Allreduce(np.ones(2), np.empty(2))  # and the allreduce rank 1 then makes
    _native.cpu.resume()
print(comm.allreduce(x).tolist())
"""
    )
    zero, one = rank_outputs(2, str(program))
    failed, refused, after = zero.splitlines()
    assert failed == "step failed", zero
    assert "allreduce refused: rank 0 is out of step with its peers: a computation " in refused
    assert after == "[2.0, 2.0]", zero
    assert one.splitlines() == ["[8.0, 8.0]", "[2.0, 2.0]", "[2.0, 2.0]"], one


@pytest.fixture(scope="module")
def shallow_water_1_rank(tmp_path_factory):
    path = tmp_path_factory.mktemp("water") / "1.npy"
    run_example("shallow_water.py", 1, *SMALL_WATER, "--save", str(path))
    return np.load(path)


SMALL_WATER = ["--nx", "36", "--ny", "20", "--days", "0.1"]


@pytest.mark.parametrize("nprocs", rank_counts(2, everywhere=2))  # 3: the overlap test's
def test_shallow_water_matches_one_rank(shallow_water_1_rank, tmp_path, nprocs):
    path = tmp_path / f"{nprocs}.npy"
    png = tmp_path / "water.png"
    args = [*SMALL_WATER, "--save", str(path), "--plot", str(png)]
    outputs = run_example("shallow_water.py", nprocs, *args)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.match(
        rf"{nprocs} ranks, 36x20 cells, \d+ steps of [\d.]+ s: [\d.]+ steps/s", outputs[0]
    )
    state = np.load(path)
    h = shallow_water_1_rank[0]
    assert state.shape == (3, 36, 20) and np.ptp(h) > 1.0  # the hill has moved water about
    np.testing.assert_allclose(state, shallow_water_1_rank, rtol=1e-5, atol=1e-3)


def test_shallow_water_without_messages_is_the_same_arithmetic(shallow_water_1_rank, tmp_path):
    """On one rank the strip is the whole periodic domain: filling its halos from
    its own edges (--no-messages, the timing baseline) gives the same bits."""
    path = tmp_path / "alone.npy"
    run_example("shallow_water.py", 1, *SMALL_WATER, "--no-messages", "--save", str(path))
    np.testing.assert_array_equal(np.load(path), shallow_water_1_rank)


@pytest.mark.parametrize("nprocs", rank_counts(1, 3, everywhere=3))
def test_shallow_water_overlap_gives_the_same_bits(shallow_water_1_rank, tmp_path, nprocs):
    """--overlap (irecv/isend, interior update, wait, edges) against halo_exchange."""
    states = []
    for flags in ([], ["--overlap"]) if nprocs > 1 else (["--overlap"],):
        path = tmp_path / f"{nprocs}{''.join(flags)}.npy"
        run_example("shallow_water.py", nprocs, *SMALL_WATER, *flags, "--save", str(path))
        states.append(np.load(path))
    blocking = states[0] if nprocs > 1 else shallow_water_1_rank
    np.testing.assert_allclose(blocking, shallow_water_1_rank, rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(states[-1], blocking)


def test_shallow_water_scaling_table():
    table = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "shallow_water_scaling.py"),
            "--ranks",
            "1",
            "2",
            "--nx",
            "24",
            "--ny",
            "12",
            "--days",
            "0.02",
        ],
        capture_output=True,
        text=True,
        timeout=300,  # two tiny runs: seconds each, even on a loaded machine
        env=launch_environment(),
    )
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["1", "2"]


def trained(nprocs: int, *flags: str) -> str:
    """Rank 0's output of 100 steps, checked: the loss falls, and the parameters
    stay identical on every rank."""
    output = run_example("data_parallel_mlp.py", nprocs, "--steps", "100", "--check", *flags)[0]
    losses = [float(v) for v in re.findall(r"loss ([\d.]+)", output)]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2] and losses[2] < 0.5 * losses[0], (
        output
    )
    assert output.endswith(f"parameters identical on all {nprocs} ranks\n")
    return output


@pytest.fixture(scope="module")
def mlp_3_ranks() -> str:
    return trained(3)


def test_data_parallel_mlp(mlp_3_ranks):
    assert mlp_3_ranks.startswith("step    1  loss ")


def test_data_parallel_mlp_buckets_train_the_same(mlp_3_ranks):
    """--buckets posts each layer's gradients as the backward pass produces them."""
    assert trained(3, "--buckets") == mlp_3_ranks


SMALL_PARTICLES = ["--particles", "600", "--steps", "40"]


@pytest.fixture(scope="module")
def particles_1_rank(tmp_path_factory):
    path = tmp_path_factory.mktemp("particles") / "1.npy"
    run_example("particles.py", 1, *SMALL_PARTICLES, "--save", str(path))
    return np.load(path)


@pytest.mark.parametrize("nprocs", rank_counts(3, 4, everywhere=3))
def test_particles_migrate_as_on_one_rank(particles_1_rank, tmp_path, nprocs):
    """Every particle arrives once (the program checks), and the motion is the
    same as on one rank up to the order of the force's sum."""
    path = tmp_path / f"{nprocs}.npy"
    outputs = run_example("particles.py", nprocs, *SMALL_PARTICLES, "--save", str(path))
    found = re.match(
        rf"{nprocs} ranks, 600 particles, 40 steps: (\d+) migrations, none lost, "
        r"momentum drift [\d.e+-]+, [\d.]+ steps/s",
        outputs[0],
    )
    assert found and int(found.group(1)) > 0, outputs[0]
    np.testing.assert_allclose(np.load(path), particles_1_rank, atol=1e-5)


@pytest.mark.parametrize("nprocs", rank_counts(2, 3, everywhere=2))
def test_sharded_particles_move_as_particles_on_one_rank(particles_1_rank, tmp_path, nprocs):
    """The sharded program (jax.distributed, shard_map, psum and jaxcomm's
    alltoallv) checks that every particle arrives once and momentum is kept;
    its particles move as particles.py's on one rank, up to the force sum's order."""
    path = tmp_path / f"{nprocs}.npy"
    outputs = run_example("sharded_particles.py", nprocs, *SMALL_PARTICLES, "--save", str(path))
    found = re.search(
        rf"{nprocs} processes, 600 particles, 40 steps: (\d+) migrations, none lost, "
        r"momentum drift [\d.e+-]+, [\d.]+ steps/s",
        outputs[0],
    )
    assert found and int(found.group(1)) > 0, outputs[0]
    np.testing.assert_allclose(np.load(path), particles_1_rank, atol=1e-5)


def test_particles_plot(tmp_path):
    png = tmp_path / "particles.png"
    run_example("particles.py", 2, "--particles", "200", "--steps", "5", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("nprocs", rank_counts(3, 4, everywhere=3))
def test_unstructured_mesh_matches_one_rank(tmp_path, nprocs):
    """The field and the gradient through the loop agree with the program's own
    1-rank run. The scheme is a convex combination of neighbours (u stays within
    [0, 1]), and each cell's arithmetic is the same on any number of ranks: the
    field differs by rounding alone, at most float32's eps per step. The
    gradient's sums over cells and ranks change order: relative error eps per step."""
    png = tmp_path / "mesh.png"
    steps = 60
    args = ["--n", "16", "--steps", str(steps), "--plot", str(png)]
    out = run_example("unstructured_mesh.py", nprocs, *args)[0]
    found = re.search(
        rf"{nprocs} ranks, 512 triangles, {steps} steps: max \|u - u_1rank\| (\S+), "
        r"dmisfit/dD (\S+) vs 1 rank (\S+) \(relative \S+\), tolerance \S+: ok",
        out,
    )
    assert found, out
    error, gradient, serial = map(float, found.groups())
    tolerance = steps * np.finfo(np.float32).eps
    assert error <= tolerance
    assert serial < 0 and abs(gradient - serial) <= tolerance * abs(serial)
    fitted = re.search(r"fitted D: 0.40000 -> .* -> (\S+) \(true 1.0\)", out)
    assert fitted and abs(float(fitted.group(1)) - 1.0) < 1e-3, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
