"""A computation that fails between two jaxcomm calls on every rank, drawn from
the oracle's programs (test_oracle.py): each rank is then out of step and
refuses its next call (jaxcomm cannot know that its peers skipped the same
calls), unless its communicator has one rank.

Runs before the other files of the sharded runs (tests/test_mpiexec.py): once a
process has run jaxcomm inside shard_map over several processes, a rank that
goes out of step ends the job instead, so these examples stay outside
shard_map. Runs only with JAXCOMM_TEST_DISTRIBUTED=1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, seed
from hypothesis import strategies as st
from jax_processes import distributed_only
from test_lockstep import forget_failures
from test_oracle import (  # noqa: F401 (comms: the oracle's fixture)
    SEED,
    SETTINGS,
    WORLD,
    Example,
    Op,
    comms,
    examples,
    excluded,
    ours,
)

from jaxcomm import JaxComm

pytestmark = distributed_only


def check_failure(example: Example, comm: JaxComm) -> None:
    """Every rank's computation fails between two of its jaxcomm calls: each
    rank is then out of step (jaxcomm cannot know that its peers skipped the
    same calls) and refuses its next call, unless the communicator has one rank
    (no peer waits for it). Then back in step, as a test may be."""
    try:
        ours(example, comm)
        ran = "ran"
    except jax.errors.JaxRuntimeError as error:
        ran = str(error)
    try:
        np.asarray(comm.allreduce(jnp.ones(1)))
        next_call = "ran"
    except jax.errors.JaxRuntimeError as error:
        next_call = str(error)
    forget_failures()
    ok = "the test's failure" in ran and (
        "out of step" in next_call if comm.size > 1 else next_call == "ran"
    )
    outcomes = WORLD.allgather((ok, next_call[-300:], ran[-300:]))
    failed = [(rank, seen) for rank, (ok, *seen) in enumerate(outcomes) if not ok]
    assert not failed, (f"JAXCOMM_ORACLE_SEED={SEED}", example, failed)


@st.composite
def failing(draw) -> Example:
    """An example that fails after one of its operations, with a later one that
    its peers would wait for, outside shard_map (inside, a rank out of step
    ends the job), in a jitted computation (eager calls are computations of one
    operation each)."""
    # Blocking operations only: a failure between a post and its wait leaves the
    # posted message unreceived, and a later test would receive it.
    example = draw(examples(posted=False))
    ops = example.ops if len(example.ops) > 1 else (*example.ops, Op("allreduce"))
    return dataclasses.replace(
        example,
        ops=ops,
        place="outside",
        # Both see where a computation's calls end, wherever they lie: in the
        # jitted function, in a loop, a conditional or a nested jit.
        mode=draw(st.sampled_from(["jax.jit", "jaxcomm.jit"])),
        fail=draw(st.integers(0, len(ops) - 2)),
    )


@given(example=failing().filter(lambda e: excluded(e) is None))
@SETTINGS
@seed(SEED)
def test_a_failure_between_calls_refuses_the_next_call(comms, example):  # noqa: F811
    check_failure(example, comms[example.group])
