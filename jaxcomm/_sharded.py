"""jaxcomm in sharded programs (jax.distributed, a global Mesh, shard_map).

Inside shard_map over a mesh with one device per process, an operation acts on
this process's block, and its results carry JAX's varying-axes types
(check_vma). Which mesh axes a communicator's processes lie along decides them:

- a communicator made by ``comm.along(mesh, axes)`` spans exactly `axes`: its
  processes are this process's line of the mesh along them. Its operations are
  typed as JAX's collectives over those axes: a result that every rank of the
  communicator holds alike (allreduce, bcast, allgather, allgatherv; the
  operation is declared ``vma="replicated"``) is invariant along `axes`, as
  ``lax.psum``'s is;
- any other communicator may group processes in any way (``split``, a graph,
  COMM_WORLD over a mesh of some of its processes): JAX cannot know along
  which axes its results agree, so they vary along every manual axis.

Every operand is first made varying along the axes the communicator spans,
with JAX's own ``pcast(..., to="varying")``, as JAX's collectives do: an
operand that is invariant along them is one value for JAX, whose cotangent
JAX sums over those axes.

One gradient rule follows from these types (`one_value`): a result that every
rank holds alike is one value, whose cotangent passes back as it is
(jaxcomm._replicated), only where JAX's types make it invariant, or outside
shard_map (jaxcomm's convention). Any other such result inside shard_map
(another communicator, or check_vma off: no types, as for JAX's psum) is one
value per device, and its transpose is the exact adjoint, which sums every
device's cotangent, as JAX's transposes of its varying collectives do.

JAX pairs its own collectives across processes by their place in the compiled
program, so beside them every process must compile the same one: XLA orders
jaxcomm's calls against JAX's collectives (the token orders them only among
themselves), alike on every process only if the programs are alike. Inside
shard_map the rules therefore keep rank-dependent values from XLA's folding
(jaxcomm._rules.same_program, own_row), and over several processes every
rank's call has the same buffers: an operation whose result is x on some ranks
(bcast's root) gets a result of its own there too, which the call fills
(jaxcomm._primitive).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from mpi4py import MPI

from jaxcomm import _settings
from jaxcomm._jax_internals import (
    axis_sizes,
    in_shard_map,
    lowering_mesh,
    manual_axes,
    typed,
    vary,
    varying,
)
from jaxcomm._rules import same_program


class Span(NamedTuple):
    """The mesh line a communicator made by along() spans: the mesh axes in the
    order given (its ranks are row-major in that order, as lax.axis_index(axes)),
    and the mesh as (axis names, shape, device ids)."""

    axes: tuple[str, ...]
    mesh: tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]

    def describe(self) -> str:
        names, shape, _ = self.mesh
        sizes = ", ".join(f"{n!r}: {s}" for n, s in zip(names, shape, strict=True))
        return f"along {self.axes} of a mesh {{{sizes}}}"


def _mesh_key(mesh: jax.sharding.Mesh) -> tuple:
    return (
        tuple(mesh.axis_names),
        tuple(mesh.devices.shape),
        tuple(int(d.id) for d in mesh.devices.flat),
    )


# -- types inside shard_map --------------------------------------------------------------


def spanned(comm: Any, operation: str) -> frozenset[str]:
    """The manual mesh axes along which `comm`'s processes lie in the function
    being traced: its along() axes, else every manual axis; () outside
    shard_map (or with check_vma off)."""
    axes = manual_axes()
    if not axes:
        return frozenset()
    span = comm.span
    if span is None:
        return frozenset(axes)
    sizes = axis_sizes()
    names, shape, _ = span.mesh
    theirs = dict(zip(names, shape, strict=True))
    if any(a not in axes or sizes.get(a) != theirs[a] for a in span.axes):
        here = ", ".join(f"{a!r}: {sizes.get(a)}" for a in axes)
        raise ValueError(
            f"{operation}: the communicator was made {span.describe()} (comm.along), "
            f"but this shard_map runs over the mesh axes {{{here}}}: use a communicator "
            "made by along() for this shard_map's mesh"
        )
    return frozenset(span.axes)


def vary_operands(operands: Sequence[Any], comm: Any, operation: str) -> list[Any]:
    """The operands, each varying along the axes `comm` spans and along every axis
    another operand varies along: one type for all (as JAX's collectives and its
    element-wise operations make them)."""
    axes = spanned(comm, operation)
    if not axes:
        return list(operands)
    common = frozenset(axes).union(*(varying(jax.typeof(x)) for x in operands))
    return [vary(x, common) for x in operands]


def one_value(comm: Any, operation: str) -> bool:
    """Whether a result that every rank of `comm` holds alike (vma="replicated")
    is one value for AD: outside shard_map (jaxcomm's convention), and inside
    where JAX's types make it invariant (check_vma on, a communicator made by
    along()). Elsewhere inside shard_map it is one value per device: its
    cotangents differ between devices, and its transpose sums them."""
    if not in_shard_map():
        return True
    return comm.span is not None and bool(spanned(comm, operation))


def own_row(x: Any, comm: Any) -> Any:
    """Row `comm.rank` of x (shape (size, ...)). Inside shard_map the index is
    no constant of the program: lax.axis_index of its axes for a communicator
    made by along(), else the rank through same_program. Every process then
    compiles the same program, as JAX needs where the program also holds its
    own collectives (a constant index lets one process's compiler drop what
    another's keeps)."""
    if not in_shard_map():
        return x[comm.rank]
    if comm.span is not None:
        index = lax.axis_index(comm.span.axes)
    else:
        index = same_program(np.int32(comm.rank))
    return lax.dynamic_index_in_dim(x, index, keepdims=False)


def type_results(
    results: Sequence[Any], operands: Sequence[Any], comm: Any, operation: str, vma: str
) -> list[Any]:
    """The results' types inside shard_map: varying along what the operands vary
    along and the axes `comm` spans; for vma="replicated" the first result,
    which every rank of comm holds alike, is invariant along the span where it
    is one value (`one_value`); for vma="same", the first operand's type (an
    identity)."""
    axes = spanned(comm, operation)
    if not axes:
        return list(results)
    common = frozenset().union(*(varying(a) for a in operands))
    if vma == "same":
        return [typed(r, common) for r in results]
    typed_results = [typed(r, common | axes) for r in results]
    if vma == "replicated" and one_value(comm, operation) and typed_results:
        typed_results[0] = typed(results[0], common - axes)
    return typed_results


def refuse_other_mesh(ctx: Any, comm: Any, operation: str) -> None:
    """At lowering: a communicator made by along() for one mesh, used inside
    shard_map over another mesh of the same shape, is refused."""
    span = comm.span
    mesh = lowering_mesh(ctx)
    if span is None or mesh is None or _mesh_key(mesh) == span.mesh:
        return
    raise ValueError(
        f"{operation}: the communicator was made {span.describe()} (comm.along), "
        f"but this shard_map runs on another mesh (devices {list(_mesh_key(mesh)[2])}, "
        f"not {list(span.mesh[2])}): use a communicator made by along() for this mesh"
    )


# -- along ---------------------------------------------------------------------------------


class _Line(NamedTuple):
    """This process's line of a mesh along some axes, as MPI_Comm_split needs it."""

    axes: tuple[str, ...]
    mesh: tuple  # _mesh_key
    color: int  # which line: this device's index over the other axes, row-major
    key: int  # this device's index along `axes`, row-major in their order
    lines: tuple[tuple[int, ...], ...]  # each line's processes (JAX's indices)


def _axes_of(mesh: jax.sharding.Mesh, axes: Any) -> tuple[str, ...]:
    names = (axes,) if isinstance(axes, str) else axes
    if not isinstance(names, tuple | list) or not all(isinstance(a, str) for a in names):
        raise TypeError(f"along: axes must be a mesh axis name or a tuple of them, got {axes!r}")
    if not names:
        raise ValueError("along: axes is empty; name at least one axis of the mesh")
    for name in names:
        if name not in mesh.axis_names:
            raise ValueError(
                f"along: axes names {name!r}, which is not an axis of mesh "
                f"(its axes: {tuple(mesh.axis_names)})"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"along: axes names an axis twice: {tuple(names)}")
    return tuple(names)


def _arguments(mesh: Any, axes: Any) -> tuple[str, ...]:
    """along's arguments, checked as far as they alone tell: the axes as a tuple."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"along: mesh must be a jax.sharding.Mesh (with devices), got {type(mesh).__name__}"
        )
    return _axes_of(mesh, axes)


def _line(mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> _Line:
    """This process's line of `mesh` along `axes`, or an error naming the mesh."""
    names = tuple(mesh.axis_names)
    process = jax.process_index()
    owners = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    mine = np.argwhere(owners == process)
    if len(mine) != 1:
        what = "no device" if len(mine) == 0 else f"{len(mine)} devices"
        raise ValueError(
            f"along: mesh has {what} of this process (JAX process {process}); along needs "
            "a mesh with one device of every process of the communicator"
        )
    # The other axes first (in the mesh's order), then `axes` (in the order given):
    # each line is then a row of the reshaped mesh, ranked row-major along `axes`.
    others = [names.index(a) for a in names if a not in axes]
    along = [names.index(a) for a in axes]
    rows = np.transpose(owners, others + along).reshape(-1, _count(owners, along))
    (where,) = mine
    color = _row_major([where[i] for i in others], [owners.shape[i] for i in others])
    key = _row_major([where[i] for i in along], [owners.shape[i] for i in along])
    return _Line(axes, _mesh_key(mesh), color, key, tuple(tuple(int(p) for p in r) for r in rows))


def _count(owners: np.ndarray, dims: list[int]) -> int:
    return int(np.prod([owners.shape[i] for i in dims], dtype=int))


def _row_major(index: list[int], shape: list[int]) -> int:
    return int(np.ravel_multi_index(index, shape)) if shape else 0


def along_split(comm: MPI.Intracomm, mesh: Any, axes: Any) -> tuple[MPI.Intracomm, Span]:
    """A new MPI communicator over the processes of `comm` on this process's line
    of `mesh` along `axes`, ranked by their index along `axes`; collective over
    `comm` (as MPI_Comm_split).

    Every rank first takes part in one exchange of what it found (whether its
    arguments are right, which mesh and axes it passed, its JAX process), so
    that misuse any rank detects raises on every rank, before any communicator
    is made: wrong arguments, a mesh without this process's device, arguments
    that differ between ranks.
    """
    try:
        line, problem = _line(mesh, _arguments(mesh, axes)), None
    except (TypeError, ValueError) as error:
        line, problem = None, error
    _arrive(comm)
    found = comm.allgather(
        (
            None if problem is None else (type(problem) is TypeError, str(problem)),
            None if line is None else (line.axes, line.mesh),
            jax.process_index(),
        )
    )
    if problem is not None:
        raise problem
    for rank, (refused, _, _) in enumerate(found):
        if refused is not None:
            kind, reason = refused
            raise (TypeError if kind else ValueError)(
                f"along: rank {rank} of the communicator refused its arguments: "
                + reason.removeprefix("along: ")
            )
    assert line is not None
    if any(arguments != (line.axes, line.mesh) for _, arguments, _ in found):
        raise ValueError(
            "along: the ranks of the communicator passed different meshes or axes "
            "(along is collective: every rank passes the same mesh and axes)"
        )
    processes = [p for _, _, p in found]
    if len(set(processes)) != len(processes):
        raise ValueError(
            "along: several ranks of the communicator are one JAX process "
            f"(JAX process indices {processes}): call jax.distributed.initialize() in "
            "every process first, one process per rank"
        )
    members = set(processes)
    for row in line.lines:
        if members.intersection(row) and not members.issuperset(row):
            outside = sorted(set(row) - members)
            raise ValueError(
                f"along: the line of the mesh along {line.axes} through JAX processes "
                f"{sorted(members.intersection(row))} also holds processes {outside}, "
                "which are not in the communicator"
            )
    part = comm.Split(line.color, line.key)
    return part, Span(line.axes, line.mesh)


def _arrive(comm: MPI.Intracomm) -> None:
    """Wait until every rank of `comm` has called along. Past JAXCOMM_TIMEOUT
    seconds (if set) the job is aborted with a message, as jaxcomm's watchdog
    does for an operation whose peers never come."""
    arrived = comm.Ibarrier()
    if _settings.TIMEOUT <= 0:
        arrived.Wait()
        return
    start = time.monotonic()
    while not arrived.Test():
        if time.monotonic() - start > _settings.TIMEOUT:
            sys.stderr.write(
                f"jaxcomm: rank {MPI.COMM_WORLD.rank} has been waiting in along for "
                f"{time.monotonic() - start:.1f} s (JAXCOMM_TIMEOUT={_settings.TIMEOUT:g}): "
                "along is collective, and not every rank of the communicator called it. "
                "Aborting the job.\n"
            )
            sys.stderr.flush()
            time.sleep(0.5)  # as the watchdog: let mpiexec forward the message
            MPI.COMM_WORLD.Abort(1)
        time.sleep(0.001)
