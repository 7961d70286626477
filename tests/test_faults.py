"""Faults that would otherwise hang a job or pass silently: the debug log, the
hang watchdog, and an exception on one rank. Each runs a small program under
mpiexec with a timeout, so a hang fails the test instead of stalling the suite."""

import functools
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import early
import progress
import pytest
from mpirun import failure_summary, rank_outputs, run, run_tests, run_watched
from test_mpiexec import ENVIRONMENT

# Each program here takes seconds; a hang (what these tests provoke, where the
# product fails to end it) is cut at two minutes, many times a loaded machine's time.
TIMEOUT = 120


def killed_at_the_limit(result) -> bool:
    """Whether mpirun.run killed the job at TIMEOUT (coreutils timeout's status)."""
    return result.returncode == 128 + 9


def program(tmp_path, source: str) -> str:
    path = tmp_path / "program.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_debug_log_has_one_line_per_call(tmp_path):
    script = program(
        tmp_path,
        """
        import jax, jax.numpy as jnp
        from jaxcomm import JaxComm
        comm = JaxComm()
        peer = 1 - comm.rank
        step = lambda x: comm.sendrecv(comm.allreduce(x), source=peer, dest=peer)
        jax.jit(step)(jnp.ones((2, 3)))
        comm.bcast(jnp.ones(5, jnp.int32), root=1)
    """,
    )
    result = run(2, [script], TIMEOUT, env={"JAXCOMM_DEBUG": "1"})
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("jaxcomm[")]
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"jaxcomm[rank {rank}]")]
        assert len(mine) == 3, lines
        assert re.fullmatch(
            rf"jaxcomm\[rank {rank}\] allreduce\(float32\[2,3\], op=sum\) 24 B [\d.]+ us", mine[0]
        )
        assert re.fullmatch(
            rf"jaxcomm\[rank {rank}\] sendrecv\(float32\[2,3\]\) "
            rf"source={1 - rank}, dest={1 - rank} 24 B [\d.]+ us",
            mine[1],
        )
        assert re.fullmatch(
            rf"jaxcomm\[rank {rank}\] bcast\(int32\[5\], root=1\) 20 B [\d.]+ us", mine[2]
        )


def test_debug_log_names_every_operation_as_the_cpp_table_does(tmp_path):
    """Each operation's log line carries the name its wrapper entered from the C++
    table; running every operation of cpp/operations.h's table shows that every
    one logs, under its own name."""
    script = program(
        tmp_path,
        """
        import jax, jax.numpy as jnp
        from jaxcomm import JaxComm, _native
        comm = JaxComm(check=False)
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        x, rows = jnp.ones(2), jnp.ones((comm.size, 2))
        for name in ("allreduce", "reduce", "scan", "exscan", "bcast", "gather", "allgather"):
            getattr(comm, name)(x)
        comm.reduce_scatter(rows), comm.alltoall(rows)
        comm.alltoallv(rows, [1] * comm.size, capacity=comm.size)
        comm.wait(comm.ialltoallv(rows, [1] * comm.size, capacity=comm.size))
        comm.allgatherv(x, capacity=2 * comm.size), comm.gatherv(x, capacity=2 * comm.size)
        comm.scatterv(rows if comm.rank == 0 else rows[:0], [1] * comm.size, capacity=1)
        comm.wait(comm.iallgatherv(x, capacity=2 * comm.size))
        comm.wait(comm.igatherv(x, capacity=2 * comm.size))
        comm.wait(comm.iscatterv(rows if comm.rank == 0 else rows[:0], [1] * comm.size, capacity=1))
        with comm.create_cart([comm.size], [True]) as cart:
            cart.neighbor_allgather(x), cart.neighbor_alltoall(jnp.ones((2, 2)))
            cart.wait(cart.ineighbor_allgather(x))
            cart.wait(cart.ineighbor_alltoall(jnp.ones((2, 2))))
            cart.neighbor_allgatherv(x, capacity=4)
            cart.neighbor_alltoallv(jnp.ones((2, 2)), [1, 1], capacity=2)
            cart.wait(cart.ineighbor_allgatherv(x, capacity=4))
            cart.wait(cart.ineighbor_alltoallv(jnp.ones((2, 2)), [1, 1], capacity=2))
        comm.scatter(rows if comm.rank == 0 else x)
        comm.sendrecv(x, source=left, dest=right)
        received = comm.irecv(x, source=left)
        comm.send(x, dest=right).wait(received)
        sent = comm.isend(x, dest=right)
        comm.recv(x, source=left)
        comm.wait(sent)
        comm.barrier()
        for name, arg in [("iallreduce", x), ("ibcast", x), ("iallgather", x),
                          ("ireduce_scatter", rows), ("ialltoall", rows)]:
            comm.wait(getattr(comm, name)(arg))
        # The tangent of a receive from ANY_TAG is a tagged_sendrecv; the
        # cotangent of a posted one goes back by itagged_send.
        jax.jvp(lambda t: comm.sendrecv(t, source=left, dest=right), (x,), (x,))
        def ring(t):
            received = comm.irecv(t, source=left)
            comm.wait(comm.isend(t, dest=right))
            return comm.wait(received).sum()
        jax.grad(ring)(x)
        # Checking mode's check of a replicated cotangent.
        jax.grad(lambda t: JaxComm(check=True).allreduce(t).sum())(x)
        # And of a pytree's structure, logged as the operation it goes to.
        JaxComm(check=True).allreduce((x, x))
        if comm.rank == 0:  # one rank: two ranks' lines may interleave
            print("TABLE", *_native.cpu.operations())
    """,
    )
    result = run(2, [script], TIMEOUT, env={"JAXCOMM_DEBUG": "1"})
    assert result.returncode == 0, result.stderr
    table = set(re.search(r"TABLE (.*)", result.stdout).group(1).split())
    lines = re.findall(r"^jaxcomm\[rank 0\] (\w+)\((pytree=)?", result.stderr, re.MULTILINE)
    logged = {"check_structure" if pytree else name for name, pytree in lines}
    assert table <= logged, sorted(table - logged)
    assert logged <= table | {"wait"}, sorted(logged - table)


def test_no_debug_log_by_default(tmp_path):
    script = program(
        tmp_path,
        """
        import jax.numpy as jnp
        from jaxcomm import JaxComm
        JaxComm().allreduce(jnp.ones(2))
    """,
    )
    result = run(2, [script], TIMEOUT, env={"JAXCOMM_DEBUG": "0"})
    assert result.returncode == 0, result.stderr
    assert "jaxcomm[" not in result.stderr


def test_watchdog_aborts_a_send_nobody_receives(tmp_path):
    # 4 MiB is beyond MPI's eager limit: the send blocks until a matching receive.
    script = program(
        tmp_path,
        """
        import jax.numpy as jnp
        from mpi4py import MPI
        from jaxcomm import JaxComm
        comm = JaxComm()
        # Completes without a peer: no wait that a busy machine could stretch past 2 s.
        JaxComm(MPI.COMM_SELF).allreduce(jnp.ones(1))
        if comm.rank == 0:
            comm.send(jnp.ones(1 << 20, jnp.float32), dest=1, tag=3)
        MPI.COMM_WORLD.Barrier()
    """,
    )
    result = run(2, [script], TIMEOUT, env={"JAXCOMM_TIMEOUT": "2", "JAXCOMM_DEBUG": "0"})
    assert result.returncode != 0
    assert re.search(
        r"jaxcomm watchdog: rank 0 has been waiting in send\(float32\[1048576\]\), dest=1, tag=3 "
        r"for [\d.]+ s \(JAXCOMM_TIMEOUT=2\); "
        r"last completed call: allreduce\(float32\[1\], op=sum\)",
        result.stderr,
    ), result.stderr


POLLS = {
    "eager": """
        request = comm.irecv(jnp.zeros(3), source=1, tag=3)
        while not comm.test(request):
            time.sleep(0.01)
    """,
    "jit": """
        def poll(template):
            request = comm.irecv(template, source=1, tag=3)
            lax.while_loop(lambda done: ~done, lambda _: comm.test(request), comm.test(request))
            return comm.wait(request)
        jax.block_until_ready(jax.jit(poll)(jnp.zeros(3)))
    """,
}


@pytest.mark.parametrize("how", POLLS)
def test_watchdog_aborts_a_rank_that_only_polls_a_request(tmp_path, how):
    """A loop of test() calls waits as a blocking wait does (the watchdog's
    `polled`); rank 1 never sends."""
    script = program(
        tmp_path,
        """
        import time
        import jax, jax.numpy as jnp
        from jax import lax
        from mpi4py import MPI
        from jaxcomm import JaxComm
        comm = JaxComm()
        if comm.rank == 0:
        """
        + textwrap.indent(textwrap.dedent(POLLS[how]), " " * 12)
        + """
        MPI.COMM_WORLD.Barrier()
        """,
    )
    result = run(2, [script], TIMEOUT, env={"JAXCOMM_TIMEOUT": "2", "JAXCOMM_DEBUG": "0"})
    assert result.returncode != 0 and not killed_at_the_limit(result), result.stderr
    assert re.search(
        r"jaxcomm watchdog: rank 0 has been polling irecv with test\(\) for [\d.]+ s "
        r"\(JAXCOMM_TIMEOUT=2\), making no other call; "
        r"last completed call: irecv\(float(32|64)\[3\]\), source=1, tag=3",
        result.stderr,
    ), result.stderr


def test_watchdog_aborts_a_free_that_waits_for_a_request_nobody_matches(tmp_path):
    """free() lets the requests on its communicator complete first (rank 1 never
    sends): a wait the watchdog reports as any other."""
    script = program(
        tmp_path,
        """
        import jax.numpy as jnp
        from mpi4py import MPI
        from jaxcomm import JaxComm
        dup = JaxComm().dup()
        if dup.rank == 0:
            request = dup.irecv(jnp.zeros(3), source=1, tag=3)
        dup.free()
        MPI.COMM_WORLD.Barrier()
        """,
    )
    result = run(2, [script], TIMEOUT, env={"JAXCOMM_TIMEOUT": "2", "JAXCOMM_DEBUG": "0"})
    assert result.returncode != 0 and not killed_at_the_limit(result), result.stderr
    assert re.search(
        r"jaxcomm watchdog: rank 0 has been waiting for irecv before freeing its "
        r"communicator for [\d.]+ s \(JAXCOMM_TIMEOUT=2\), making no other call",
        result.stderr,
    ), result.stderr


def test_watchdog_lets_a_rank_poll_between_other_calls(tmp_path):
    """A request tested between other calls, past the timeout, is not a hang: the
    rank is at work; it completes once its peer sends."""
    script = program(
        tmp_path,
        """
        import time
        import jax.numpy as jnp
        from mpi4py import MPI
        from jaxcomm import JaxComm
        comm = JaxComm()
        request = comm.irecv(jnp.zeros(3), source=1 - comm.rank, tag=3)
        start, done = time.monotonic(), 0.0
        while not done:  # every rank stops together, past twice the timeout
            late = float(comm.rank == 0 and time.monotonic() - start > 4.0)
            done = float(comm.allreduce(jnp.full(1, late))[0])
            assert not comm.test(request)
        comm.send(jnp.full(3, comm.rank + 1.0), dest=1 - comm.rank, tag=3)
        print("received", comm.wait(request).tolist())
        """,
    )
    outputs = rank_outputs(2, script, env={"JAXCOMM_TIMEOUT": "2", "JAXCOMM_DEBUG": "0"})
    assert outputs == ["received [2.0, 2.0, 2.0]\n", "received [1.0, 1.0, 1.0]\n"], outputs


def test_along_called_on_one_rank_only_aborts_past_the_timeout(tmp_path):
    # along is collective, like MPI_Comm_split: rank 0 calls it alone, and
    # JAXCOMM_TIMEOUT turns the wait for the others into an abort that says so.
    script = program(
        tmp_path,
        """
        import jax
        from jax.sharding import Mesh
        from mpi4py import MPI
        from jaxcomm import JaxComm
        comm = JaxComm()
        if comm.rank == 0:
            comm.along(Mesh(jax.local_devices()[:1], ("x",)), "x")
        MPI.COMM_WORLD.Barrier()
    """,
    )
    result = run(2, [script], TIMEOUT, env={"JAXCOMM_TIMEOUT": "2"})
    assert result.returncode != 0
    assert re.search(
        r"jaxcomm: rank 0 has been waiting in along for [\d.]+ s \(JAXCOMM_TIMEOUT=2\): "
        r"along is collective, and not every rank of the communicator called it",
        result.stderr,
    ), result.stderr


def test_an_error_inside_shard_map_over_processes_ends_the_job(tmp_path):
    """Rank 1's alltoallv overflows inside shard_map, so its computation stops
    before the psum that follows; rank 0 runs that psum, which rank 1's next
    psum would answer with the wrong value. jaxcomm cannot refuse JAX's
    collectives: rank 1 ends the job, and no rank prints a value."""
    script = program(
        tmp_path,
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax import lax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from jax_processes import start_jax_distributed
        from mpi4py import MPI
        import jaxcomm
        world = MPI.COMM_WORLD
        start_jax_distributed()
        mesh = Mesh(np.array(jax.devices()), ("x",))
        line = jaxcomm.JaxComm().along(mesh, "x")

        def step(v):  # rank 1 receives 3 rows into room for 2
            counts = jnp.where(lax.axis_index("x") == 0, jnp.array([1, 2]), jnp.array([1, 1]))
            y, _ = line.alltoallv(v, counts, capacity=2)
            return lax.psum(y.sum(), "x")[None]

        def total(v):
            return lax.psum(v.sum(), "x")[None]

        spec = dict(mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        step, total = jax.jit(jax.shard_map(step, **spec)), jax.jit(jax.shard_map(total, **spec))
        local = np.full((3, 1), world.rank + 1.0, np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
        for f in (step, total, total):
            try:
                print("value", np.asarray(f(x).addressable_data(0)).tolist(), flush=True)
            except jax.errors.JaxRuntimeError as error:
                print("raised", str(error).splitlines()[0][:80], flush=True)
    """,
    )
    helpers = str(Path(__file__).with_name("mpi"))  # jax_processes.py
    result = run(2, [script], TIMEOUT, env={"PYTHONPATH": helpers})
    assert result.returncode != 0, result.stdout
    assert "value" not in result.stdout, result.stdout
    assert re.search(
        r"jaxcomm: rank 1 ends the job: it is out of step with its peers \(alltoallv failed.*"
        r"more than capacity=2.*JAX's own collectives in shard_map",
        result.stderr,
    ), result.stderr


@pytest.mark.parametrize(("where", "then"), [("straight", "a step"), ("fori_loop", "nothing")])
def test_a_step_in_shard_map_stopped_by_a_callback_ends_the_job(tmp_path, where, then):
    """Inside shard_map over every process, rank 0's step stops in a host
    callback after an allreduce that a later one follows, in the step itself or
    in a loop; the peers wait in that later one, which jaxcomm cannot refuse
    where JAX's own collectives may follow it. Rank 0 ends the job at its next
    call (or at exit): no rank gets a value from the step, and nobody waits
    forever."""
    script = program(
        tmp_path,
        f"""
        import jax, jax.numpy as jnp, numpy as np
        from jax import lax
        from jax.experimental import io_callback
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from jax_processes import start_jax_distributed
        from mpi4py import MPI
        import jaxcomm
        world = MPI.COMM_WORLD
        start_jax_distributed()
        mesh = Mesh(np.array(jax.devices()), ("x",))
        line = jaxcomm.JaxComm().along(mesh, "x")

        def callback(a):
            if world.rank == 0:
                raise RuntimeError("the callback fails")
            return np.asarray(a)

        def fail(a):
            return io_callback(callback, jax.ShapeDtypeStruct(a.shape, a.dtype), a)

        def step(v):
            if {where!r} == "straight":
                return line.allreduce(fail(line.allreduce(v)) * 1000)
            return lax.fori_loop(0, 2, lambda _, c: 0 * c + fail(line.allreduce(c)), v)

        spec = dict(mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        step = jax.jit(jax.shard_map(step, **spec))
        total = jax.jit(jax.shard_map(line.allreduce, **spec))
        local = np.full((2,), world.rank + 1.0, np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
        try:
            print("value", np.asarray(step(x).addressable_data(0)).tolist(), flush=True)
        except jax.errors.JaxRuntimeError as error:
            print("rank", world.rank, "step failed", flush=True)
        if {then!r} == "a step":
            print("next", np.asarray(total(x).addressable_data(0)).tolist(), flush=True)
    """,
    )
    helpers = str(Path(__file__).with_name("mpi"))  # jax_processes.py
    result = run(2, [script], TIMEOUT, env={"PYTHONPATH": helpers})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert not killed_at_the_limit(result), output  # rank 0 ended the job
    assert "rank 0 step failed" in result.stdout, output
    assert "value" not in result.stdout and "next" not in result.stdout, output
    assert re.search(
        r"jaxcomm: rank 0 ends the job: it is out of step with its peers \(a computation "
        r"stopped after its .*JAX's own collectives in shard_map",
        result.stderr,
    ), output


def test_watchdog_is_quiet_when_calls_complete(tmp_path):
    script = program(
        tmp_path,
        """
        import jax.numpy as jnp
        from jaxcomm import JaxComm
        comm = JaxComm()
        x = jnp.ones(4)
        comm.mpi.Barrier()  # both ranks ready: each call waits only for the other's last
        for _ in range(50):
            comm.allreduce(x)
        print("done", flush=True)
    """,
    )
    result = run(2, [script], TIMEOUT, env={"JAXCOMM_TIMEOUT": "30"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done") == 2 and "watchdog" not in result.stderr


RAISES_ON_RANK_1 = """
    import jax.numpy as jnp
    import jaxcomm
    from jaxcomm import JaxComm
    {setup}
    comm = JaxComm()
    if comm.rank == 1:
        raise ValueError("something went wrong on rank 1")
    comm.allreduce(jnp.ones(3)).block_until_ready()  # rank 1 never joins
"""


@pytest.mark.parametrize(
    "how", ["abort_on_error", "python -m mpi4py"], ids=["abort_on_error", "mpi4py_run"]
)
def test_exception_on_one_rank_ends_the_job(tmp_path, how):
    setup = "jaxcomm.abort_on_error()" if how == "abort_on_error" else ""
    script = program(tmp_path, RAISES_ON_RANK_1.format(setup=setup))
    args = [script] if how == "abort_on_error" else ["-m", "mpi4py", script]
    result = run(2, args, TIMEOUT)
    assert result.returncode != 0
    assert "ValueError: something went wrong on rank 1" in result.stderr


def test_thread_level_below_serialized_is_refused(tmp_path):
    script = program(tmp_path, "import jaxcomm\n")
    result = run(1, [script], TIMEOUT, env={"MPI4PY_RC_THREAD_LEVEL": "funneled"})
    assert result.returncode != 0
    assert "jaxcomm needs MPI initialised with MPI_THREAD_SERIALIZED" in result.stderr


def test_works_under_thread_serialized(tmp_path):
    script = program(
        tmp_path,
        """
        import jax, jax.numpy as jnp
        from jaxcomm import JaxComm
        comm = JaxComm()
        step = jax.jit(lambda x: comm.sendrecv(comm.allreduce(x), source=1 - comm.rank,
                                               dest=1 - comm.rank))
        x = step(jnp.ones(3))  # still running while the next line makes a communicator
        half = comm.split(color=0)
        total = half.allreduce(x) + comm.bcast(jnp.full(3, comm.rank), root=1)
        print(total.tolist(), flush=True)
        half.free()
        """,
    )
    result = run(2, [script], TIMEOUT, env={"MPI4PY_RC_THREAD_LEVEL": "serialized"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("[5.0, 5.0, 5.0]") == 2


def test_several_devices_per_process_are_refused(tmp_path):
    """jaxcomm inside shard_map over a process's two CPU devices would make two MPI
    calls per process on one communicator at once: refused before it runs. A jitted
    call on one of the devices still works."""
    script = program(
        tmp_path,
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxcomm import JaxComm
        comm = JaxComm()
        assert len(jax.local_devices()) == 2
        print("one device", jax.jit(comm.allreduce)(jnp.ones(2)).tolist())
        mesh = jax.make_mesh((2,), ("d",))
        body = jax.shard_map(comm.allreduce, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        try:
            jax.jit(body)(jax.device_put(jnp.ones(4), NamedSharding(mesh, P("d"))))
        except ValueError as error:
            print("refused:", error)
    """,
    )
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    for output in rank_outputs(2, script, timeout=TIMEOUT, env=env):
        lines = output.splitlines()
        assert lines[0] == "one device [2.0, 2.0]", output
        assert lines[1].startswith("refused: jaxcomm: allreduce in a computation over 2 devices")


def test_an_eager_pytree_on_several_devices_sends_the_messages_of_one_device(tmp_path):
    """Small leaves of one dtype travel as one message whichever devices they are
    on: rank 0's leaves on two CPU devices match rank 1's on one, and each result
    stays on its leaf's device."""
    script = program(
        tmp_path,
        """
        import jax, jax.numpy as jnp
        from jaxcomm import JaxComm
        comm = JaxComm()
        first, second = jax.local_devices()
        place = second if comm.rank == 0 else first
        tree = {"a": jax.device_put(jnp.full(3, comm.rank + 1.0), first),
                "b": jax.device_put(jnp.full(2, 10.0 * (comm.rank + 1)), place)}
        out = comm.allreduce(tree)
        print(out["a"].tolist(), out["b"].tolist(),
              out["a"].devices() == {first}, out["b"].devices() == {place})
    """,
    )
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    for output in rank_outputs(2, script, timeout=TIMEOUT, env=env):
        assert output.strip() == "[3.0, 3.0, 3.0] [30.0, 30.0] True True", output


def test_a_call_on_two_devices_leaves_the_chain_where_the_next_call_runs(tmp_path):
    """A jaxcomm.jit call without communication on an array over both devices of a
    process returns its marker on both: the next call, on one device, starts the
    chain afresh there instead of being compiled over both."""
    script = program(
        tmp_path,
        """
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jaxcomm
        comm = jaxcomm.JaxComm()
        mesh = jax.make_mesh((2,), ("d",))
        spread = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("d")))
        print(jaxcomm.jit(lambda x: x * 2)(spread).tolist())
        for _ in range(2):
            print(jaxcomm.jit(comm.allreduce)(jnp.ones(2)).tolist())
    """,
    )
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    for output in rank_outputs(2, script, timeout=TIMEOUT, env=env):
        lines = output.splitlines()
        assert lines == ["[2.0, 2.0, 2.0, 2.0]", "[2.0, 2.0]", "[2.0, 2.0]"], output


@pytest.mark.parametrize("read", [True, False], ids=["read", "pending at exit"])
def test_a_rank_out_of_step_ends_the_job_at_exit(tmp_path, read):
    """Rank 0's step fails after its call has returned (its allreduce does not
    run there) and the program ends, with the error read, or the step still
    running, while rank 1 waits in that allreduce. Rank 0 ends the job at exit
    instead of leaving rank 1 waiting forever."""
    script = program(
        tmp_path,
        f"""
        import jax, jax.numpy as jnp
        from jaxcomm import JaxComm
        comm = JaxComm()
        capacity = 1 if comm.rank == 0 else 2

        @jax.jit
        def step(x, m):
            y, _ = comm.alltoallv(x, [1, 1], capacity=capacity)
            return comm.allreduce(y.sum()), m @ m @ m

        out = step(jnp.ones((2, 2)), jnp.ones((256, 256)))
        if {read}:
            try:
                jax.block_until_ready(out)
            except jax.errors.JaxRuntimeError as error:
                print("rank", comm.rank, "raised:", str(error).splitlines()[0][:60])
    """,
    )
    result = run(2, [script], TIMEOUT)
    assert result.returncode != 0
    assert not killed_at_the_limit(result), result.stderr  # rank 0 ended the job
    assert ("rank 0 raised:" in result.stdout) == read, result.stdout + result.stderr
    assert "rank 1 raised" not in result.stdout
    assert result.stderr.count("jaxcomm: rank 0 ends the job at exit: it is out of step") == 1, (
        result.stderr
    )


@pytest.mark.parametrize(
    ("size", "jit", "then"),
    [(2, "jax.jit", "eager"), (3, "jaxcomm.jit", "jax.jit"), (2, "jax.jit", "nothing")],
)
def test_a_step_stopped_by_a_callback_ends_the_job_instead_of_pairing(tmp_path, size, jit, then):
    """The issue's step: allreduce, an ordered host callback that raises on rank 0
    only, allreduce. Rank 0 catches the error; its next allreduce (if any) is
    refused instead of pairing with its peers' second one, and at exit it ends
    the job, whose peers wait in that second allreduce: no rank gets a value
    from it, and nobody waits forever."""
    script = program(
        tmp_path,
        f"""
        import jax, jax.numpy as jnp, numpy as np
        from jax.experimental import io_callback
        import jaxcomm
        comm = jaxcomm.JaxComm()

        def callback(a):
            if comm.rank == 0:
                raise RuntimeError("the callback fails")
            return np.asarray(a)

        @{jit}
        def step(x):
            a = comm.allreduce(x)
            b = io_callback(callback, jax.ShapeDtypeStruct(a.shape, a.dtype), a, ordered=True)
            return comm.allreduce(b * 1000)

        try:
            print("rank", comm.rank, "got", jax.block_until_ready(step(jnp.ones(2))).tolist())
        except Exception as error:
            print("rank", comm.rank, "step failed")
        try:
            if {then!r} == "eager":
                print("rank", comm.rank, "next", comm.allreduce(jnp.ones(2)).tolist())
            elif {then!r} == "jax.jit":
                print("rank", comm.rank, "next", jax.jit(comm.allreduce)(jnp.ones(2)).tolist())
        except jax.errors.JaxRuntimeError as error:
            print("rank", comm.rank, "refused:", str(error).splitlines()[0][:90])
        print("rank", comm.rank, "done", flush=True)
    """,
    )
    result = run(size, [script], TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "rank 0 step failed" in result.stdout, output
    assert " got " not in result.stdout and " next " not in result.stdout, output
    if then != "nothing":
        assert (
            "rank 0 refused: FAILED_PRECONDITION: jaxcomm: allreduce refused: rank 0 is out of step"
            in (result.stdout)
        ), output
    assert result.stderr.count("jaxcomm: rank 0 ends the job at exit: it is out of step") == 1, (
        output
    )
    assert "a computation stopped after its allreduce" in result.stderr, output


@pytest.mark.parametrize(("size", "then"), [(1, "exit"), (2, "exit"), (2, "refused call")])
def test_an_error_no_peer_waits_for_after_its_call_returned(tmp_path, size, then):
    """Each rank's step on COMM_SELF fails after its call has returned (an
    alltoallv overflow beside a long matrix product), and the program catches
    the error. No peer waits in that step; but JAX refuses the next call with
    jaxcomm's effect for it (before 0.12, every later one), and a peer could
    wait in a refused call. With nothing after, the program ends normally on
    every JAX (nothing was refused); after a refused call the job ends at exit."""
    script = program(
        tmp_path,
        f"""
        import jax, jax.numpy as jnp
        from mpi4py import MPI
        from jaxcomm import JaxComm
        alone, world = JaxComm(MPI.COMM_SELF), JaxComm()

        @jax.jit
        def step(x, m):
            y, _ = alone.alltoallv(x, [2], capacity=1)
            return y, m @ m @ m

        out = step(jnp.ones((2, 2)), jnp.ones((256, 256)))
        try:
            jax.block_until_ready(out)
        except jax.errors.JaxRuntimeError as error:
            print(f"rank {{world.rank}} raised: " + str(error).splitlines()[0][:60])
        if {then == "refused call"!r}:
            try:
                jax.block_until_ready(jax.jit(world.allreduce)(jnp.ones(2)))
            except jax.errors.JaxRuntimeError:
                print(f"rank {{world.rank}} refused")
        print(f"rank {{world.rank}} done")
    """,
    )
    result = run(size, [script], TIMEOUT)
    output = result.stdout + result.stderr
    for rank in range(size):
        assert f"rank {rank} raised:" in result.stdout, output
        assert f"rank {rank} done" in result.stdout, output
        assert (f"rank {rank} refused" in result.stdout) == (then == "refused call"), output
    ends_normally = then == "exit"
    assert (result.returncode == 0) == ends_normally, output
    assert ("ends the job at exit" in result.stderr) != ends_normally, output
    # Where the job ends, the launcher may kill it before MPI_Abort's own text is
    # out (both ranks abort at once): the status and jaxcomm's line above say it.
    assert ends_normally <= ("mpi_abort" not in output.lower()), output
    # jaxcomm's exit hook waits for the computations quietly (JAX's own hooks
    # print the error again before 0.12).
    assert "<function effects_barrier" not in result.stderr, output


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("JAXCOMM_CHECK", "maybe", "expected 1/0, true/false, yes/no or on/off"),
        ("JAXCOMM_DEBUG", "2", "expected 1/0, true/false, yes/no or on/off"),
        ("JAXCOMM_CUDA_AWARE", "auto", "expected 1/0, true/false, yes/no or on/off"),
        ("JAXCOMM_TIMEOUT", "abc", "expected a number of seconds, 0 or more"),
        ("JAXCOMM_TIMEOUT", "-5", "expected a number of seconds, 0 or more"),
        ("JAXCOMM_EAGER", "fast", "expected one of direct, jit"),
    ],
)
def test_a_bad_environment_variable_is_an_error(name, value, accepted):
    result = run(1, ["-c", "import jaxcomm"], TIMEOUT, env={name: value})
    assert result.returncode != 0
    assert f"ValueError: {name}={value!r}: {accepted}" in result.stderr, result.stderr


def test_environment_variables_mean_what_they_say(tmp_path):
    script = program(
        tmp_path,
        """
        import jax.numpy as jnp
        from jaxcomm import JaxComm, _settings
        comm = JaxComm()
        comm.allreduce(jnp.ones(2))
        print(comm.check, _settings.DEBUG, _settings.CUDA_AWARE, _settings.TIMEOUT,
              _settings.EAGER)
    """,
    )
    env = {
        "JAXCOMM_CHECK": "off",
        "JAXCOMM_DEBUG": "FALSE",
        "JAXCOMM_CUDA_AWARE": "No",
        "JAXCOMM_TIMEOUT": " 2.5 ",
        "JAXCOMM_EAGER": "JIT",
    }
    result = run(1, [script], TIMEOUT, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "False", "2.5", "jit"]
    assert "jaxcomm[" not in result.stderr  # no debug log


def inner_suite(tmp_path, program: str) -> list[str]:
    """pytest's arguments for tests/programs/`program` under tests/mpi's conftest
    (copied beside it with what it imports)."""
    tests = Path(__file__).parent
    for helper in [*(tests / "mpi").glob("*.py"), tests / "progress.py"]:
        if not helper.name.startswith("test_"):
            shutil.copy(helper, tmp_path)
    inner = shutil.copy(tests / "programs" / program, tmp_path)
    return ["-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}", inner]


# Runs pytest with rank 1's stderr thrown away (PMI_RANK: MPICH; the other: Open MPI).
WITHOUT_STDERR_ON_RANK_1 = (
    "import os, sys, pytest\n"
    "if (os.environ.get('PMI_RANK') or os.environ.get('OMPI_COMM_WORLD_RANK')) == '1':\n"
    "    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)\n"
    "sys.exit(pytest.main(sys.argv[1:]))"
)


# Tests of the test harness itself (mpirun.py, progress.py), which uses no JAX: CI's
# stage with another JAX leaves them out; the one with another MPI keeps those that
# go through its launcher, which forwards output and signals its own way.
through_the_launcher = pytest.mark.skipif(
    ENVIRONMENT == "another-jax", reason="the test harness uses no JAX"
)
harness_alone = pytest.mark.skipif(
    ENVIRONMENT != "first", reason="the test harness alone: no JAX, no MPI"
)


@through_the_launcher
def test_a_failed_test_is_named_with_its_rank(tmp_path):
    """A rank whose test fails names it, with pytest's report, and aborts the job;
    the report reaches the launcher through the journal folder even when the
    rank's stderr does not (an abort can be faster than mpiexec's forwarding;
    here rank 1's stderr goes nowhere)."""
    args = inner_suite(tmp_path, "fails_on_rank_1.py")
    result = run_tests(2, ["-c", WITHOUT_STDERR_ON_RANK_1, *args[2:]])
    assert result.returncode != 0 and not result.stalled
    test = "fails_on_rank_1.py::test_rank_1_fails"
    assert failure_summary(result) == f"rank 1: {test} failed", result.stderr
    assert "AssertionError: rank 1 fails here" in result.stderr, result.stderr


@through_the_launcher
def test_a_test_past_its_time_limit_is_named_with_every_ranks_stacks(tmp_path):
    """tests/mpi/conftest.py's per-test limit: the rank whose test makes no progress
    writes the test's name, its rank and every thread's stack to mpiexec's stderr,
    where test_mpiexec.py's failure message shows them; the other rank, still
    making MPI calls (progress), is not cut, and writes its stacks when asked."""
    args = inner_suite(tmp_path, "stuck_past_the_limit.py")
    result = run_tests(2, args, env={"JAXCOMM_TEST_TIMEOUT": "2"})
    assert not result.stalled, result.stderr
    test = "stuck_past_the_limit.py::test_rank_0_is_stuck_past_the_limit"
    summary = failure_summary(result)
    assert summary == f"rank 0: {test} timed out after 2 s", summary + result.stderr
    # All rank 0's threads' stacks: the watchdog's own, and the test's, where it waits.
    own, _, asked = result.stderr.partition("--- rank 1's stacks:")
    assert re.search(r"Thread 0x[0-9a-f]+ \(most recent call first\)", own), result.stderr
    assert re.search(r"line \d+ in watch\n", own), result.stderr
    assert re.search(r'stuck_past_the_limit.py", line 17 in test_rank_0', own), result.stderr
    # Rank 1's, written when rank 0 asked: in its loop of calls.
    assert re.search(r'stuck_past_the_limit.py", line 19 in test_rank_0', asked), result.stderr


@harness_alone
def test_a_run_of_tests_is_ended_when_it_stops_making_progress(tmp_path):
    """mpirun.run_watched: a program that keeps writing its journal runs past the
    stall limit; once it stops, it writes its stacks when asked and is ended."""
    script = program(
        tmp_path,
        """
        import faulthandler, os, sys, threading, time
        import progress
        folder = sys.argv[1]
        journal = progress.journal_path(folder, 0)
        journal.write_text(f"pid {os.getpid()}\\n")
        stacks = open(progress.stacks_path(folder, 0), "w")
        faulthandler.register(progress.STACKS_SIGNAL, file=stacks, all_threads=True, chain=True)
        for step in range(8):  # 4 s of progress, past the 3 s limit
            time.sleep(0.5)
            with journal.open("a") as out:
                out.write(f"done step {step}\\n")
        print("made progress", flush=True)
        threading.Event().wait()
        """,
    )
    folder = tmp_path / "journal"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    result = run_watched([sys.executable, script, str(folder)], folder, stall=3, env=env)
    assert result.stdout == "made progress\n", result.stdout + result.stderr
    assert result.stalled == f"no progress for 3 s (nothing in {folder} changed): ended"
    stacks = progress.stacks_path(folder, 0).read_text()
    assert re.search(r'line \d+ in wait\n.*program.py", line \d+ in <module>', stacks, re.S), stacks


@harness_alone
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="early.py starts nothing without it")
def test_early_work_runs_idle_and_is_redone_unless_finished(tmp_path):
    """early.py: a job's processes run under SCHED_IDLE; a finished job's result
    is taken; a running one is stopped (its processes killed) and one not yet
    started is dropped, both at once, leaving the work to the caller."""
    started, dropped = tmp_path / "started", tmp_path / "dropped"

    def shell(script: str, stop) -> subprocess.CompletedProcess:
        return run_watched(["sh", "-c", script], tmp_path, stall=600, stop=stop)

    early.start(
        {
            "policy": functools.partial(shell, "ps -o cls= -p $$"),
            "finished": lambda stop: "its result",
            "running": functools.partial(shell, f"echo $$ > {started}; exec sleep 600"),
            "waiting": functools.partial(shell, f"touch {dropped}"),
        }
    )
    while not started.exists() or not started.read_text().strip():
        time.sleep(0.1)
    assert early.take("policy").stdout.split() == ["IDL"]
    assert early.take("finished") == "its result"
    begun = time.monotonic()
    assert early.take("waiting") is None
    assert early.take("running") is None
    assert time.monotonic() - begun < 60  # not the 600 s of the running job
    assert not progress.running(int(started.read_text()))
    time.sleep(0.5)  # time for the dropped job to run, were it run
    assert not dropped.exists()
    assert early.take("unknown") is None
