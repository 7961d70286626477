"""The JaxComm object: duplication, identity, derived communicators, no recompiles."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data import FLOAT, assert_values
from mpi4py import MPI

import jaxcomm
from jaxcomm import CartComm, GraphComm, JaxComm


def test_duplicates_and_properties(comm):
    assert comm.mpi != MPI.COMM_WORLD
    assert MPI.Comm.Compare(comm.mpi, MPI.COMM_WORLD) == MPI.CONGRUENT
    assert (comm.rank, comm.size) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    assert isinstance(comm.rank, int) and isinstance(comm.size, int)
    assert comm.mpi.Get_errhandler() == MPI.ERRORS_RETURN


def test_hash_and_equality(comm):
    assert comm == comm and hash(comm) == hash(comm)
    other = comm.dup()
    assert other != comm
    assert len({comm, other, comm}) == 2
    other.free()


def test_static_argument(comm):
    f = jax.jit(lambda x, c: c.allreduce(x), static_argnums=1)
    assert_values(f(jnp.ones(2), comm), np.full(2, comm.size, FLOAT))


def test_eager_calls_do_not_recompile(comm):
    x = jnp.ones(3)
    comm.allreduce(x)
    counts = []
    for _ in range(3):
        before = jax._src.dispatch.xla_primitive_callable.cache_info().misses
        comm.allreduce(x)
        comm.bcast(x, root=0)
        counts.append(jax._src.dispatch.xla_primitive_callable.cache_info().misses - before)
    assert counts[1:] == [0, 0], counts


def test_no_cross_matching_with_mpi4py_traffic(comm):
    """A message sent with mpi4py on COMM_WORLD is never received by jaxcomm."""
    world = MPI.COMM_WORLD
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    request = world.isend(np.full(3, -1.0), dest=right, tag=0)
    out = comm.sendrecv(jnp.full(3, float(comm.rank)), source=left, dest=right)
    assert_values(out, np.full(3, float(left), FLOAT))
    assert np.all(world.recv(source=left, tag=0) == -1.0)
    request.wait()


def test_split_and_dup_keep_subclass(comm):
    class MyComm(JaxComm):
        def allmean(self, x):
            return jax.tree.map(lambda a: a / self.size, self.allreduce(x))

    mine = MyComm(comm.mpi)
    half = mine.split(color=comm.rank % 2, key=comm.rank)
    assert type(half) is MyComm and type(mine.dup()) is MyComm
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    assert half.size == len(members) and half.rank == members.index(comm.rank)
    assert_values(half.allmean(jnp.float32(comm.rank)), np.float32(np.mean(members)))
    assert mine.split(MPI.UNDEFINED) is None
    half.free()
    with pytest.raises(ValueError, match="has been freed"):
        half.allreduce(jnp.zeros(1))


def test_rejects_intercommunicator(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    local = MPI.COMM_WORLD.Split(comm.rank % 2, comm.rank)
    inter = local.Create_intercomm(
        0, MPI.COMM_WORLD, 1 - comm.rank % 2 if comm.rank < 2 else (comm.rank + 1) % 2, 9
    )
    with pytest.raises(TypeError, match="must be an intracommunicator"):
        JaxComm(inter)
    inter.Free()
    local.Free()


def test_module_level_functions(comm):
    x = jnp.full(2, float(comm.rank))
    total = float(sum(range(comm.size)))
    assert_values(jaxcomm.allreduce(x, MPI.SUM), np.full(2, total, FLOAT))
    assert_values(jaxcomm.allreduce(x, MPI.SUM, comm=MPI.COMM_WORLD), np.full(2, total, FLOAT))
    assert_values(jaxcomm.bcast(x, 0, comm=comm), np.zeros(2, FLOAT))
    assert jaxcomm.get_comm(MPI.COMM_WORLD) is jaxcomm.get_comm(MPI.COMM_WORLD)


def test_module_functions_follow_a_freed_communicator():
    """jaxcomm.allreduce(x, comm=sub) after sub.Free(): a new communicator that
    MPI gives the same handle gets its own duplicate, not the freed one's."""
    rank = MPI.COMM_WORLD.rank
    for _ in range(3):
        sub = MPI.COMM_WORLD.Split(color=0, key=rank)
        assert_values(jaxcomm.allreduce(jnp.ones(2), comm=sub), np.full(2, sub.size, FLOAT))
        duplicate = jaxcomm.get_comm(sub)
        sub.Free()
        assert duplicate.mpi == MPI.COMM_NULL  # freed with it
        alone = MPI.COMM_WORLD.Split(color=rank, key=0)  # size 1
        assert_values(jaxcomm.allreduce(jnp.ones(2), comm=alone), np.ones(2, FLOAT))
        alone.Free()


def test_a_compiled_call_after_free_raises_instead_of_using_a_reused_handle():
    """A function compiled with a JaxComm, called after its free(): MPI may have
    given the freed handle to a new communicator (of another size), which the
    compiled call must not use."""
    c1 = JaxComm(MPI.COMM_SELF)
    f = jax.jit(lambda x: c1.allreduce(x))
    assert_values(f(jnp.ones(3)), np.ones(3, FLOAT))
    c1.free()
    reuser = JaxComm(MPI.COMM_WORLD)  # may get c1's handle
    for call in (lambda: f(jnp.ones(3)), lambda: c1.allreduce(jnp.ones(3))):
        with pytest.raises(Exception, match="freed"):
            jax.block_until_ready(call())
    assert_values(reuser.allreduce(jnp.ones(2)), np.full(2, reuser.size, FLOAT))
    reuser.free()


def test_the_cpp_and_python_declarations_agree():
    """cpp/operations.h declares every operation once; each has one Python primitive, and
    the modules register exactly those (the CUDA one: the blocking operations).
    The reduction operators have the same numbers on both sides."""
    from jaxcomm import _native, _nonblocking
    from jaxcomm._datatypes import ReduceOp
    from jaxcomm._primitive import PRIMITIVES

    assert list(_native.cpu.reduce_op_names) == [op.name.lower() for op in ReduceOp]

    declared = set(_native.cpu.operations())
    assert set(PRIMITIVES) == declared
    polling = {"wait", "test"}
    # Before a user's kernel (jaxcomm._kernels), and the calls around a loop, a
    # conditional or a nested function that say what a computation owes
    # (jaxcomm._lockstep).
    guard = {"in_step", "settled", "entered"}
    assert set(_native.cpu.registrations()) == {f"jaxcomm_{n}" for n in declared | polling | guard}
    if _native.cuda is not None:
        blocking = declared - set(_nonblocking.OPERATIONS)
        assert set(_native.cuda.registrations()) == {f"jaxcomm_{n}" for n in blocking | guard}
    # Every operation but those the AD rules and checking mode use is a method and a
    # module function, whose signature names every parameter the operation declares
    # a check for.
    # The neighbour collectives are methods of CartComm and GraphComm only.
    public = declared - {"tagged_sendrecv", "itagged_send", "check_replicated", "check_structure"}
    grid = {name for name in declared if "neighbor_" in name}
    for name in public:
        for owner in (CartComm, GraphComm) if name in grid else (JaxComm,):
            assert callable(getattr(owner, name)), name
            signature = inspect.signature(getattr(owner, name))
            assert set(PRIMITIVES[name].params) <= set(signature.parameters), name
        if name in grid:
            assert not hasattr(JaxComm, name) and name not in jaxcomm.__all__, name
            continue
        assert name in jaxcomm.__all__ and getattr(jaxcomm, name).__wrapped__ is getattr(
            JaxComm, name
        ), name
