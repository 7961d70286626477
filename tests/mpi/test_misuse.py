"""Misuse, generated: per-rank arguments of the operations that take counts,
roots, ranks or tags, valid and not, run eagerly, in jit, under jvp, grad and
vmap, and in checking mode: the variable-size exchanges, blocking and posted
(then waited), over every rank or over a graph's or grid's neighbours (a small
graph or grid drawn per example, made outside any trace), and the fixed-size
neighbour exchanges with wrong shapes. The invariant on every rank: the NumPy
reference, exactly (results come in buffers pre-filled with a pattern, so
uninitialised rows show), or a Python exception that names the argument and,
for a value, the value passed (and, outside AD, whose adjoints' errors name
their own exchange, the operation). Never a crash or a hang (the watchdog
aborts a hang).

Hypothesis is derandomised and does not shrink, so every rank draws the same
examples; each rank passes its own part of a draw and knows every other rank's,
so it computes what every rank must see. Each example's outcome is gathered
from every rank, so all ranks fail together, saying which rank saw what.
JAXCOMM_MISUSE_EXAMPLES sets the examples per property.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import progress
import pytest
from data import expected_collective
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from jaxcomm import JaxComm

WORLD = MPI.COMM_WORLD
SIZE = WORLD.size
RANK = WORLD.rank
INT32_MAX = 2**31 - 1
# Per property, per operation and mode: the seeded mutations of the checks that
# this file tests (tests/mutations/run.py: a count, capacity or rank one past
# its limit) are each caught with 2.
EXAMPLES = int(os.environ.get("JAXCOMM_MISUSE_EXAMPLES", "3"))
REPEATS = 2  # each example runs twice, on a heap dirtied with another pattern
PATTERNS = (np.nan, 0xAB)
# jaxcomm's watchdog (when JAXCOMM_TIMEOUT is not set): a call here waits at most
# for its peers to trace and compile one example (seconds, minutes on a loaded
# machine); a hang is aborted naming the call, before the test's own limit
# (progress.py) reports it without the call's name.
TIMEOUT = progress.TEST_LIMIT / 2

SETTINGS = settings(
    derandomize=True,  # the same examples on every rank
    database=None,
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: one failing example, everywhere
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)


# -- the reference ----------------------------------------------------------------------


class Refused(NamedTuple):
    """A rank raises, and the message names one of `reasons`: (argument, the value
    passed, or None where the argument's name is enough). `kept`: what it received
    all the same (a rank that refused only what it sends), whose cotangents a
    derivative still sends back; None where it kept nothing."""

    reasons: tuple[tuple[str, Any], ...]
    kept: tuple | None = None


def refusal(name: str, counts, rows: int):
    """Why a rank may not send `counts` from `rows` rows: (name, the first value
    out of range), (name, None) if they add up to more than rows, else None."""
    for c in counts:
        if not 0 <= c <= INT32_MAX:
            return (name, c)
    return (name, None) if sum(counts) > rows else None


def padded(pieces: list[np.ndarray], capacity: int, like: np.ndarray) -> np.ndarray:
    """The rows of `pieces` in order, then zero rows, `capacity` in all."""
    rows = np.concatenate([like[:0], *pieces])
    out = np.zeros((capacity, *like.shape[1:]), like.dtype)
    out[: len(rows)] = rows
    return out


class Hood(NamedTuple):
    """Who sends rows to whom, as every rank knows it. Per rank: its destinations
    in order (a rank, or None beyond a grid's non-periodic edge), and its sources
    in order, each (the sender, which of the sender's blocks arrives here) or None
    beyond an edge. `made`: how to make the communicator: None (the one given:
    every rank to every rank), ("graph", edges) or ("cart", dims, periods)."""

    destinations: tuple
    sources: tuple
    made: tuple | None = None


def complete(size: int) -> Hood:
    """alltoallv's: rank s's block r goes to rank r."""
    return Hood(
        tuple(tuple(range(size)) for _ in range(size)),
        tuple(tuple((s, r) for s in range(size)) for r in range(size)),
    )


def graph_hood(edges) -> Hood:
    """A distributed graph of `edges` (source, destination), every rank's lists in
    their order: the k-th edge from s to d is s's k-th block to d and d's k-th
    from s, which is how MPI pairs repeated edges."""
    destinations: list[list] = [[] for _ in range(SIZE)]
    sources: list[list] = [[] for _ in range(SIZE)]
    for s, d in edges:
        sources[d].append((s, len(destinations[s])))
        destinations[s].append(d)
    return Hood(tuple(map(tuple, destinations)), tuple(map(tuple, sources)), ("graph", edges))


def cart_hood(dims, periods) -> Hood:
    """A Cartesian grid (rank order row-major, as MPI's): along each dimension the
    lower neighbour, then the upper one; slot k's neighbour sends its block k ^ 1
    here (the lower one its upper block), whatever the size of the dimension."""
    destinations, sources = [], []
    for r in range(SIZE):
        at = np.unravel_index(r, dims)
        mine = []
        for d, (n, periodic) in enumerate(zip(dims, periods, strict=True)):
            for step in (-1, 1):
                c = list(at)
                c[d] = (c[d] + step) % n if periodic else c[d] + step
                mine.append(int(np.ravel_multi_index(c, dims)) if 0 <= c[d] < n else None)
        destinations.append(tuple(mine))
        sources.append(tuple(None if q is None else (q, k ^ 1) for k, q in enumerate(mine)))
    return Hood(tuple(destinations), tuple(sources), ("cart", tuple(dims), tuple(periods)))


def exchange_reference(xs, blocks, own, capacity, recv_refused, hood: Hood):
    """Per rank (y, recv_counts) or Refused, where rank s sends blocks[s][j] (rows)
    to its j-th destination. own[r]: why rank r refused what it sends (it sent no
    rows), or None; a rank refuses its invalid given recv_counts (recv_refused[r])
    or incoming rows beyond its capacity, keeping none (it still sends)."""
    out = []
    for r, x in enumerate(xs):
        pieces = [x[:0] if src is None else blocks[src[0]][src[1]] for src in hood.sources[r]]
        got = [len(piece) for piece in pieces]
        why = [w for w in (own[r], recv_refused[r]) if w]
        if sum(got) > capacity[r]:
            why.append(("capacity", capacity[r]))
        overflow = sum(got) > capacity[r] or recv_refused[r] is not None  # kept none
        result = None if overflow else (padded(pieces, capacity[r], x), np.array(got, np.int32))
        out.append(Refused(tuple(why), result) if why else result)
    return out


def alltoallv_reference(xs, send, capacity, recv_refused, hood: Hood | None = None):
    """alltoallv's and neighbor_alltoallv's: a rank refuses its invalid send_counts
    and sends nothing."""
    own = [refusal("send_counts", send[r], len(x)) for r, x in enumerate(xs)]
    blocks = []
    for r, x in enumerate(xs):
        counts = [0] * len(send[r]) if own[r] else list(send[r])
        starts = np.cumsum([0, *counts])
        blocks.append([x[a : a + c] for a, c in zip(starts, counts, strict=False)])
    return exchange_reference(xs, blocks, own, capacity, recv_refused, hood or complete(len(xs)))


def neighbor_allgatherv_reference(xs, count, capacity, hood: Hood):
    """Each rank's first count rows (None: all) to every destination; a rank that
    refuses its count sends none, and only it raises: each result is its own."""
    count = [len(x) if c is None else c for x, c in zip(xs, count, strict=True)]
    own = [refusal("count", [c], len(x)) for x, c in zip(xs, count, strict=True)]
    blocks = [
        [x[: 0 if own[r] else count[r]]] * len(hood.destinations[r]) for r, x in enumerate(xs)
    ]
    return exchange_reference(xs, blocks, own, capacity, [None] * len(xs), hood)


def allgatherv_reference(xs, count, capacity, everyone=True):
    """Per rank (y, counts) or Refused. count[r] None: all of x's rows. A rank
    that refuses its count makes every rank raise (`everyone`: allgatherv)."""
    size = len(xs)
    count = [len(xs[r]) if count[r] is None else count[r] for r in range(size)]
    why = [[w for w in [refusal("count", [count[r]], len(xs[r]))] if w] for r in range(size)]
    sent = [0 if why[r] else count[r] for r in range(size)]
    # The replicated result lacks a rank's rows, or exceeds a rank's capacity:
    # every rank raises.
    if everyone and any(why):
        why = [w or [("count", None)] for w in why]
    if everyone and any(sum(sent) > c for c in capacity):
        why = [w or [("capacity", None)] for w in why]
    out = []
    for r in range(size):
        overflow = sum(sent) > capacity[r]
        if overflow:
            why[r].append(("capacity", capacity[r]))
        y = (
            None
            if overflow
            else padded([xs[s][: sent[s]] for s in range(size)], capacity[r], xs[r])
        )
        result = None if overflow else (y, np.array(sent, np.int32))
        out.append(Refused(tuple(why[r]), result) if why[r] else result)
    return out


def gatherv_reference(xs, count, capacity, root):
    """allgatherv's on root; elsewhere ((0, *s) rows, the rank's own count alone)."""
    # Only the root receives: the others' capacity cannot overflow.
    only_root = [c if r == root else 0 for r, c in enumerate(capacity)]
    everyone = allgatherv_reference(xs, count, only_root, everyone=False)
    out = []
    for r, got in enumerate(everyone):
        why = (
            tuple(w for w in got.reasons if w[0] != "capacity") if isinstance(got, Refused) else ()
        )
        if r == root:
            out.append(got)
        elif why:
            out.append(Refused(why))
        else:
            own = np.zeros(len(xs), np.int32)
            own[r] = len(xs[r]) if count[r] is None else count[r]
            out.append((xs[r][:0], own))
    return out


def scatterv_reference(xs, counts, capacity, root):
    """Per rank (y, count) or Refused: root's rows, counts[root] of them for each
    rank; a root whose counts are invalid sends nothing."""
    size = len(xs)
    bad = refusal("counts", counts, len(xs[root]))
    sent = [0] * size if bad else list(counts)
    out = []
    for r in range(size):
        why = [bad] if bad and r == root else []
        if sent[r] > capacity[r]:
            why.append(("capacity", capacity[r]))
        start = sum(sent[:r])
        if why:
            out.append(Refused(tuple(why)))
        else:
            y = padded([xs[root][start : start + sent[r]]], capacity[r], xs[r])
            out.append((y, np.int32(sent[r])))
    return out


def gradient_reference(xs, outs, weights, own_only=False):
    """d sum(y_r * w_r) / dx on every rank, from a reference run on labelled x
    (xs: each element its own label): each element of x gets the weights of the
    places it landed. Refusing ranks contribute nothing; with own_only (a
    replicated result, like allgatherv's) a rank takes its own cotangent only."""
    grads = [np.zeros(x.shape, np.float64) for x in xs]
    where = {}
    for r, x in enumerate(xs):
        for index in np.ndindex(x.shape):
            where[x[index]] = (r, index)
    for d, out in enumerate(outs):
        if isinstance(out, Refused):
            if out.kept is None:
                continue
            out = out.kept
        for index in np.ndindex(out[0].shape):
            label = out[0][index]
            if label:
                r, at = where[label]
                if not own_only or r == d:
                    grads[r][at] += weights(out[0].shape)[index]
    return grads


def weights(shape) -> np.ndarray:
    """The loss's weights: exact in every float dtype, the same prefix whatever the rows."""
    return 1 + np.arange(int(np.prod(shape))).reshape(shape) % 64 / 8


def weighted(y: jax.Array) -> jax.Array:
    """The loss's terms: y times weights(y.shape)."""
    return y * jnp.asarray(weights(y.shape), y.dtype)


# -- what each rank passes --------------------------------------------------------------

X_DTYPES = ("float32", "float64", "int8", "uint16", "int64", "bool", "complex64", "float16")
FLOATS = ("float32", "float64")
ROW_SHAPES = ((), (2,), (3, 2), (0,), (2, 0))
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
#: How counts are passed: a list (int), a NumPy array (scalar) of a dtype, a
#: non-contiguous view of one (a column of a table), a jax.Array.
FORMS = ("list", *INT_DTYPES, "view:int32", "view:uint64", "view:int8", "jax:int32", "jax:int64")
NEGATIVE = (-1, -1000, -(2**31), -(2**31) - 1)
HUGE = (2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**63 - 1, 2**64 - 1)
#: A wrong static argument, the same on every rank (None: none).
STATIC = (None,) * 12 + ("float counts", "bool counts", "counts shape", "capacity=-1",
                        "capacity=2.5", "traced capacity", "root=size", "root=-1",
                        "traced root", "root without counts")  # fmt: skip
#: The variable-size exchanges: blocking, posted (then waited), and over a
#: graph's or grid's neighbours.
OPS = ("alltoallv", "ialltoallv", "allgatherv", "iallgatherv", "gatherv", "igatherv", "scatterv",
       "iscatterv", "neighbor_alltoallv", "ineighbor_alltoallv", "neighbor_allgatherv",
       "ineighbor_allgatherv")  # fmt: skip


def blocking(op: str) -> str:
    """The blocking form of `op`, whose reference it has: ialltoallv's alltoallv."""
    return op.removeprefix("i")


def neighbors(op: str) -> bool:
    return blocking(op).startswith("neighbor_")


def one_count(op: str) -> bool:
    """Whether each rank passes one count (allgatherv's kind), not one per peer."""
    return blocking(op) in ("allgatherv", "gatherv", "neighbor_allgatherv")


def exchanges(op: str) -> bool:
    """Whether `op` sends rows to each destination as its counts say, and takes
    given recv_counts (alltoallv's kind)."""
    return blocking(op) in ("alltoallv", "neighbor_alltoallv")


COUNT_NAME = {"alltoallv": "send_counts", "neighbor_alltoallv": "send_counts",
              "allgatherv": "count", "gatherv": "count", "neighbor_allgatherv": "count",
              "scatterv": "counts"}  # fmt: skip
ROOTED = ("gatherv", "scatterv")


def fits(values, dtype: str) -> bool:
    info = np.iinfo(dtype)
    return all(info.min <= v <= info.max for v in values)


def in_form(values, form: str, scalar: bool):
    """`values` (ints) passed as `form`; as a list (int) where they do not fit its dtype."""
    kind, _, dtype = form.rpartition(":")
    if form == "list" or not fits(values, dtype):
        return int(values[0]) if scalar else list(values)
    if kind == "view":  # a column of a table: strided
        table = np.zeros((len(values), 3), dtype)
        table[:, 1] = values
        return table[0, 1:2].reshape(()) if scalar else table[:, 1]
    if kind == "jax":
        return jnp.asarray(values[0] if scalar else values, dtype)
    return np.asarray(values[0] if scalar else values, dtype)[()]


def labelled(shape, first: int) -> np.ndarray:
    """Elements first, first + 1, ...: each element its own label."""
    return (first + np.arange(int(np.prod(shape)))).reshape(shape).astype(np.float64)


def rank_rows(rank: int, member: int, rows: int, row, dtype: str) -> np.ndarray:
    """Rank `rank`'s x for vmap member `member`: nonzero, differing by position."""
    n = rows * int(np.prod(row))
    values = (np.arange(n) + 37 * rank + 11 * member) % 120 + 1
    if dtype == "bool":
        values = values % 2 == 1
    elif dtype.startswith("complex"):
        values = values + 1j * (rank + 1)
    return np.asarray(values).astype(dtype).reshape((rows, *row))


@dataclasses.dataclass(frozen=True)
class Case:
    """One example: what every rank passes. Per-rank fields are tuples over ranks;
    counts[r] is a tuple over vmap members (one outside vmap)."""

    op: str
    mode: str  # eager, jit, jvp, grad, vmap
    jit: bool
    check: bool
    dtype: str
    row: tuple
    root: int
    static: str | None
    hood: Hood  # who sends to whom: every rank to every rank, or a graph's or grid's
    rows: tuple  # x's rows on each rank
    counts: tuple  # alltoallv: send_counts (one per destination); allgatherv, gatherv:
    # count (None: default); scatterv: the root's counts (None elsewhere)
    batched: tuple  # whether the rank's counts carry the vmap batch
    form: tuple
    slack: tuple  # capacity minus the rows the rank receives (negative: overflow)
    recv: tuple  # alltoallv: None (exchanged), "right", "wrong" or a wrong value


#: JAXCOMM_MISUSE_SKIP: kinds of misuse not to draw (comma-separated), to look
#: past a known failure: wide (counts beyond int32), recv (invalid recv_counts),
#: view (non-contiguous counts), batched (counts batched under vmap), ad-refusal
#: (refusals under jvp and grad), disagree (checking mode), static.
SKIP = set(os.environ.get("JAXCOMM_MISUSE_SKIP", "").split(","))


def _narrow(values):
    return [v for v in values if "wide" not in SKIP or -(2**31) <= v <= INT32_MAX]


def _faulty(draw, base, rows, scalar, faults):
    """A rank's counts (one tuple per member) and rows, with a drawn fault."""
    fault = draw(st.sampled_from(("none",) * 5 + faults))
    members = [list(m) for m in base]
    m = draw(st.integers(0, len(members) - 1))
    i = draw(st.integers(0, max(len(members[m]) - 1, 0)))
    if not members[m]:  # no destinations: no count to spoil
        fault = "none"
    if fault == "negative":
        members[m][i] = draw(st.sampled_from(_narrow(NEGATIVE)))
    elif fault == "huge":
        members[m][i] = draw(st.sampled_from(_narrow(HUGE)))
    elif fault == "excess":  # one row more than x has
        rows = max(sum(c) for c in members)
        members[m][i] += 1
    return tuple(c[0] if scalar else tuple(c) for c in members), rows


def _statics(op: str) -> list:
    """The static mistakes (None: none) that `op` can be given: those of a root
    for gatherv and scatterv, and the root's missing counts for scatterv."""
    rooted, scatters = blocking(op) in ROOTED, blocking(op) == "scatterv"
    return [
        s
        for s in STATIC
        if s is None
        or (
            "static" not in SKIP
            and (rooted or "root" not in s)
            and (scatters or s != "root without counts")
        )
    ]


@st.composite
def hoods(draw) -> Hood:
    """A small graph (repeated edges, self-loops, ranks with no sources or no
    destinations, no edges at all), or a grid, some of its dimensions periodic."""
    if draw(st.sampled_from((True, True, False))):
        rank = st.integers(0, SIZE - 1)
        edges = draw(st.lists(st.tuples(rank, rank), max_size=2 * SIZE + 2))
        return graph_hood(tuple(edges))
    dims = draw(st.sampled_from(((SIZE,), (SIZE, 1), (1, SIZE))))
    return cart_hood(dims, tuple(draw(st.booleans()) for _ in dims))


@st.composite
def cases(draw, op: str, mode: str):
    members = 2 if mode == "vmap" else 1
    jit = mode == "jit" or (mode != "eager" and draw(st.booleans()))
    check = draw(st.sampled_from((False, False, True)))
    dtype = draw(st.sampled_from(FLOATS if mode in ("jvp", "grad") else X_DTYPES))
    row = draw(st.sampled_from(ROW_SHAPES))
    root = draw(st.integers(0, SIZE - 1))
    static = draw(st.sampled_from(_statics(op)))
    hood = draw(hoods()) if neighbors(op) else complete(SIZE)
    refusals = not (mode in ("jvp", "grad") and "ad-refusal" in SKIP)
    faults = ("negative", "excess", "huge") if refusals else ()
    scalar = one_count(op)
    rows, counts, batched, forms, slack = [], [], [], [], []
    for r in range(SIZE):
        has_counts = blocking(op) != "scatterv" or r == root
        width = 1 if scalar else len(hood.destinations[r])
        first = tuple(draw(st.lists(st.integers(0, 3), min_size=width, max_size=width)))
        batch = mode == "vmap" and has_counts and "batched" not in SKIP and draw(st.booleans())
        base = [first] + [
            draw(st.sampled_from([first, tuple(reversed(first)), (0,) * width]))
            if batch else first
            for _ in range(members - 1)
        ]  # fmt: skip
        spare = draw(st.integers(0, 2))
        n = max(sum(c) for c in base) + spare
        if has_counts:
            c, n = _faulty(draw, base, n, scalar, faults)
            if batch is False and members > 1:  # unbatched: one value for every member
                c = (c[0],) * members
            if scalar and draw(st.booleans()) and not batch and c[0] == n:
                c = (None,) * members  # the default count: all of x's rows
        else:
            c = None
        rows.append(n)
        counts.append(c)
        batched.append(batch)
        forms.append(draw(st.sampled_from([f for f in FORMS if "view" not in SKIP
                                           or not f.startswith("view")])))  # fmt: skip
        slack.append(draw(st.sampled_from((0, 0, 1, 2, -1) if refusals else (0, 1))))
    recv = (None,) * SIZE
    if exchanges(op) and mode != "vmap" and (check or draw(st.booleans())):
        kinds = []
        for r in range(SIZE):
            kind = ["right", "right"]
            if "recv" not in SKIP and check and hood.sources[r]:
                # Given counts are trusted: a rank refuses invalid ones before the
                # exchange, as it does a bad root, so outside checking mode its peers
                # would wait for it. Checking mode compares them on every rank.
                kind += _narrow([*NEGATIVE[:2], HUGE[1]])
            if check and "disagree" not in SKIP:  # what checking mode must catch
                kind += ["wrong", None] if hood.sources[r] else [None]
            kinds.append(draw(st.sampled_from(kind)))
        recv = tuple(kinds)
    return Case(op, mode, jit, check, dtype, row, root, static, hood, tuple(rows), tuple(counts),
                tuple(batched), tuple(forms), tuple(slack), recv)  # fmt: skip


# -- running an example ---------------------------------------------------------------


class Expect(NamedTuple):
    """What one rank must see: `value` (a tuple of arrays), or an exception naming
    one of `reasons`; None / () where that outcome is wrong. `operation`: the
    name an exception must also give (None: any)."""

    value: tuple | None
    reasons: tuple = ()
    operation: str | None = None


class Plan(NamedTuple):
    run: Callable[[], tuple]  # this rank's call, in the case's mode: its results
    expect: list[Expect]  # per rank


def _reference(case: Case, xs, counts, capacity):
    """The op's reference for one vmap member: xs and counts per rank."""
    op = blocking(case.op)
    if exchanges(op):
        recv_refused = [(("recv_counts", v) if isinstance(v, int) else None) for v in case.recv]
        return alltoallv_reference(xs, counts, capacity, recv_refused, case.hood)
    if op == "neighbor_allgatherv":
        return neighbor_allgatherv_reference(xs, counts, capacity, case.hood)
    if op == "allgatherv":
        return allgatherv_reference(xs, counts, capacity)
    if op == "gatherv":
        return gatherv_reference(xs, counts, capacity, case.root)
    return scatterv_reference(xs, counts[case.root], capacity, case.root)


def _sent(case: Case, counts) -> list:
    """What each rank sends (a refusing rank sends nothing): alltoallv's kind and
    neighbor_allgatherv one count per destination, scatterv one per rank (the
    root's), allgatherv and gatherv one count."""
    op = blocking(case.op)
    if one_count(op):
        counts = [case.rows[r] if c is None else c for r, c in enumerate(counts)]
        sent = [0 if refusal("", [c], case.rows[r]) else c for r, c in enumerate(counts)]
        if op != "neighbor_allgatherv":
            return sent
        return [[c] * len(case.hood.destinations[r]) for r, c in enumerate(sent)]
    if op == "scatterv":
        root = counts[case.root]
        return [0] * SIZE if refusal("", root, case.rows[case.root]) else list(root)
    return [[0] * len(c) if refusal("", c, case.rows[r]) else list(c) for r, c in enumerate(counts)]


def _arriving(case: Case, counts, rank: int) -> list[int]:
    """The rows `rank` receives from each of its sources (alltoallv's kind and
    neighbor_allgatherv): 0 from beyond a grid's edge."""
    sent = _sent(case, counts)
    return [0 if src is None else sent[src[0]][src[1]] for src in case.hood.sources[rank]]


def _received(case: Case, counts) -> list[int]:
    """Rows each rank receives (for gatherv, the root only)."""
    op = blocking(case.op)
    if op in ("allgatherv", "gatherv"):
        sent = _sent(case, counts)
        return [sum(sent) if op == "allgatherv" or r == case.root else 0 for r in range(SIZE)]
    if op == "scatterv":
        return _sent(case, counts)
    return [sum(_arriving(case, counts, r)) for r in range(SIZE)]


def _static_mistake(case: Case, counts_arg, capacity, root):
    """The case's static mistake applied: (counts, capacity, root, the reason
    every rank must give), the reason None where there is none."""
    name = COUNT_NAME[blocking(case.op)]
    static = case.static
    if static == "root without counts":  # every rank passes None: only the root may not
        return None, capacity, root, ("counts", None)
    if static in ("float counts", "bool counts", "counts shape"):
        if counts_arg is None:  # every rank passes the mistake, or the others would wait
            counts_arg = np.int32(case.rows[RANK]) if name == "count" else np.ones(SIZE, np.int32)
        a = np.asarray(counts_arg)
        if static == "float counts":
            a = a.astype(np.float32)
        elif static == "bool counts":
            a = a.astype(bool)
        else:  # one count too many
            extra = np.zeros((*a.shape[:-1], 1), a.dtype)  # (a is empty without destinations)
            a = a[..., None] if name == "count" else np.concatenate([a, extra], -1)
        return a, capacity, root, (name, None)
    if static == "capacity=-1":
        return counts_arg, -1, root, ("capacity", -1)
    if static == "capacity=2.5":
        return counts_arg, 2.5, root, ("capacity", None)
    if static == "traced capacity":
        return counts_arg, jnp.int32(capacity), root, ("capacity", None)
    if static == "root=size":
        return counts_arg, capacity, SIZE, ("root", SIZE)
    if static == "root=-1":
        return counts_arg, capacity, -1, ("root", -1)
    if static == "traced root":
        return counts_arg, capacity, jnp.int32(root), ("root", None)
    return counts_arg, capacity, root, None


def _spoiled(case: Case, member_counts) -> list:
    """member_counts with the counts of each rank that refuses them in any member
    made invalid in every member."""
    scalar = one_count(case.op)
    refusing = {
        r
        for counts in member_counts
        for r, c in enumerate(counts)
        if c is not None and refusal("", [c] if scalar else c, case.rows[r])
    }
    bad = lambda c: -1 if scalar else (-1,) * len(c)  # noqa: E731
    return [[bad(c) if r in refusing and c is not None else c for r, c in enumerate(counts)]
            for counts in member_counts]  # fmt: skip


def plan(case: Case, comm: JaxComm) -> Plan:
    members = 2 if case.mode == "vmap" else 1
    member_counts = [[c and c[m] for c in case.counts] for m in range(members)]
    received = np.max([_received(case, mc) for mc in member_counts], axis=0)
    capacity = [max(0, int(received[r]) + case.slack[r]) for r in range(SIZE)]
    if blocking(case.op) == "allgatherv" and case.mode == "grad":  # replicated: one capacity
        capacity = [min(capacity)] * SIZE
    xs = [[rank_rows(r, m, case.rows[r], case.row, case.dtype) for r in range(SIZE)]
          for m in range(members)]  # fmt: skip
    refs = [_reference(case, xs[m], member_counts[m], capacity) for m in range(members)]
    # A batch is one call: a rank that refuses its counts in one member sends no
    # rows in any (the values below); the reasons stay each member's own.
    spoiled = _spoiled(case, member_counts)
    sends = [_reference(case, xs[m], spoiled[m], capacity) for m in range(members)]

    # This rank's arguments.
    given = None
    if case.recv[RANK] is not None:  # the right recv_counts, or a mistake in them
        right = _arriving(case, member_counts[0], RANK)
        if case.recv[RANK] == "wrong":
            right[0] += 1
        elif isinstance(case.recv[RANK], int):
            right[0] = case.recv[RANK]
        given = in_form(right, case.form[RANK], False)
    x = jnp.asarray(np.stack([xs[m][RANK] for m in range(members)]) if members > 1 else xs[0][RANK])
    mine = case.counts[RANK]
    scalar = one_count(case.op)
    if mine is None or mine[0] is None:
        counts_arg = None
    elif case.batched[RANK]:  # one row per member, of the first dtype that holds them
        dtype = next(t for t in ("int32", "int64", "uint64") if fits(np.ravel(mine), t))
        counts_arg = np.asarray(mine, dtype)
    else:
        counts_arg = in_form([mine[0]] if scalar else mine[0], case.form[RANK], scalar)
    counts_arg, cap, root, mistake = _static_mistake(case, counts_arg, capacity[RANK], case.root)
    run = _in_mode(case, _caller(case, comm, given), x, counts_arg, cap, root)

    # What every rank must see, in this mode.
    values: list = []
    for r in range(SIZE):
        outs = [sends[m][r] for m in range(members)]
        if any(isinstance(o, Refused) for o in outs):
            values.append(None)
        elif case.mode == "jvp":
            tangents = _reference(case, [x + 0.5 for x in xs[0]], member_counts[0], capacity)
            values.append((outs[0][0], tangents[r][0]))
        else:
            values.append(tuple(np.stack([o[i] for o in outs]) for i in range(2))
                          if members > 1 else outs[0])  # fmt: skip
    if case.mode == "grad":
        first = np.cumsum([0, *(x.size for x in xs[0])])
        labels = [labelled(x.shape, first[r] + 1) for r, x in enumerate(xs[0])]
        outs = _reference(case, labels, member_counts[0], capacity)
        own_only = blocking(case.op) == "allgatherv"
        grads = gradient_reference(labels, outs, weights, own_only=own_only)
        values = [v and (grads[r].astype(case.dtype),) for r, v in enumerate(values)]
    reasons = [tuple(w for m in range(members) if isinstance(refs[m][r], Refused)
                     for w in refs[m][r].reasons) for r in range(SIZE)]  # fmt: skip
    expect = [Expect(values[r], reasons[r]) for r in range(SIZE)]
    if case.mode in ("jvp", "grad") and any(reasons):
        # Under AD a rank's refusal is every rank's, at the primal exchange: the
        # others name the first rank that refused (allgatherv's, any that did).
        first = next(r for r in range(SIZE) if reasons[r])
        named = ("rank", None if blocking(case.op) == "allgatherv" else first)
        expect = [Expect(None, reasons[r] or (named,)) for r in range(SIZE)]

    given_by = [v is not None for v in case.recv]
    if case.check and ("wrong" in case.recv or 0 < sum(given_by) < SIZE):
        # Checking mode: the ranks disagree on recv_counts, so every rank raises.
        expect = [Expect(None, (("recv_counts", None), *e.reasons)) for e in expect]
    elif case.check and any(isinstance(v, int) for v in case.recv):
        # A refusing rank's recv_counts differ from what is sent: the check may say so.
        expect = [e._replace(reasons=(*e.reasons, ("recv_counts", None))) for e in expect]
    if case.mode == "vmap" and any(case.batched):
        # Counts batched on some ranks: right values, or refused on every rank (at
        # trace time) by a message about the batch.
        name = COUNT_NAME[blocking(case.op)]
        batch = ((name, None), ("vmap", None), ("batch", None))
        expect = [e._replace(reasons=(*e.reasons, *batch)) for e in expect]
    if case.static == "root without counts":
        # The root raises before any MPI call; the others would wait for it (as
        # they would for a root that refuses given counts), so they do not call.
        expect = [Expect(None, (mistake,)) if r == case.root else Expect(()) for r in range(SIZE)]
        if case.root != RANK:
            run = tuple
    elif mistake is not None and not (case.static.startswith("traced") and not case.jit):
        expect = [Expect(None, (mistake,))] * SIZE  # raised on every rank, before any MPI call
    elif mistake is not None:  # a concrete jax.Array: taken as an int, or refused
        expect = [e._replace(reasons=(*e.reasons, mistake)) for e in expect]
    if case.mode not in ("jvp", "grad"):  # (under AD an adjoint's exchange may say it)
        expect = [e._replace(operation=case.op) for e in expect]
    return Plan(run, expect)


def _caller(case: Case, comm: JaxComm, given):
    """(x, counts, capacity, root) -> (y, counts received) for the case's op; a
    posted op's request waited at once."""
    op = blocking(case.op)
    call = getattr(comm, case.op)
    done = comm.wait if case.op != op else (lambda result: result)
    if exchanges(op):
        return lambda x, c, capacity, root: done(call(x, c, capacity=capacity, recv_counts=given))
    if op in ("allgatherv", "neighbor_allgatherv"):
        return lambda x, c, capacity, root: done(call(x, capacity=capacity, count=c))
    if op == "gatherv":
        return lambda x, c, capacity, root: done(call(x, root, capacity=capacity, count=c))
    return lambda x, c, capacity, root: done(call(x, c, root, capacity=capacity))


def _in_mode(case: Case, call, x, counts, capacity, root) -> Callable[[], tuple]:
    """This rank's call in the case's mode. Array arguments (counts, and a
    capacity or root passed by mistake as an array) are jit's arguments."""
    traced = {k: v for k, v in [("counts", counts), ("capacity", capacity), ("root", root)]
              if isinstance(v, (np.ndarray, np.generic, jax.Array))}  # fmt: skip
    closed = {"counts": counts, "capacity": capacity, "root": root}

    def op(x, traced):
        args = {**closed, **traced}
        return call(x, args["counts"], args["capacity"], args["root"])

    if case.mode in ("eager", "jit"):
        fn = op
    elif case.mode == "jvp":

        def fn(x, traced):
            return jax.jvp(lambda x: op(x, traced)[0], (x,), (x + 0.5,))

    elif case.mode == "grad":

        def fn(x, traced):
            return (jax.grad(lambda x: jnp.sum(weighted(op(x, traced)[0])))(x),)

    else:  # vmap over x, and over the counts where they carry the batch
        axes = {k: 0 if k == "counts" and case.batched[RANK] else None for k in traced}

        def fn(x, traced):
            return jax.vmap(op, in_axes=(0, axes))(x, traced)

    if case.jit:
        fn = jax.jit(fn)
    return lambda: fn(x, traced)


# -- the invariant, on every rank -------------------------------------------------------


def _named(message: str, reasons) -> bool:
    """Whether `message` names one of `reasons`' arguments, and its value if given."""
    for name, value in reasons:
        if re.search(rf"\b{name}\b", message) and (
            value is None or re.search(rf"(?<![\w-]){re.escape(str(value))}(?!\d)", message)
        ):
            return True
    return False


def _difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
    if want.ndim == 0:
        return f"got {got}, want {want}"
    wrong = ~(got == want).reshape(len(want), -1).all(axis=1)
    rows = np.flatnonzero(wrong)
    return (
        f"rows {rows.tolist()} differ: got {got[rows[:2]].tolist()}, want {want[rows[:2]].tolist()}"
    )


def judge(results, error, expect: Expect) -> str | None:
    """None if this rank's outcome is right, else what is wrong with it."""
    if error is not None:
        message = f"{type(error).__name__}: {error}"
        if _named(message, expect.reasons):
            if expect.operation is None or re.search(rf"\b{expect.operation}\b", message):
                return None
            return f"raised, without naming the operation {expect.operation}: {message[:800]}"
        if expect.reasons:
            return f"raised, without naming {list(expect.reasons)}: {message[:800]}"
        return f"raised where the reference has values: {message[:800]}"
    if expect.value is None:
        got = " ".join(str(np.asarray(a).tolist())[:200] for a in jax.tree.leaves(results))
        return f"returned where it must raise naming {list(expect.reasons)}: {got}"
    leaves = jax.tree.leaves(results)
    if len(leaves) != len(expect.value):
        return f"returned {len(leaves)} arrays, want {len(expect.value)}"
    for i, (got, want) in enumerate(zip(leaves, expect.value, strict=True)):
        got = np.asarray(got)
        if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
            return f"result {i}: {_difference(got, want)}"
    return None


def dirty_heap(pattern) -> None:
    """Leave freed memory holding `pattern`, so that unwritten rows of the next
    results show it: XLA's and NumPy's allocators reuse what was freed."""
    for n in (64, 1 << 10, 1 << 14, 1 << 18):
        if isinstance(pattern, float):
            a, b = jnp.full((n,), pattern, jnp.float32), np.full(n, pattern, np.float32)
        else:
            a, b = jnp.full((n,), pattern, jnp.uint8), np.full(n, pattern, np.uint8)
        a.block_until_ready()
        del a, b


_FAILED: dict[str, str] = {}  # a failing example's message, for Hypothesis' replay


def made(comm: JaxComm, hood: Hood) -> JaxComm | None:
    """The graph or grid of `hood`, made over comm (collective), or None."""
    if hood.made is None:
        return None
    kind, *args = hood.made
    if kind == "cart":
        return comm.create_cart(*args)
    (edges,) = args
    return comm.create_dist_graph(
        [s for s, d in edges if d == RANK], [d for s, d in edges if s == RANK]
    )


def _check_hood(on: JaxComm, hood: Hood) -> None:
    """This test's model of the neighbours against the communicator's own."""
    if hood.made is None:
        return
    if hood.made[0] == "graph":
        destinations, sources = on.destinations, on.sources
    else:
        null = lambda r: None if r == MPI.PROC_NULL else r  # noqa: E731
        destinations = tuple(null(r) for d in range(len(on.dims)) for r in on.shift(d))
        sources = destinations
    assert destinations == hood.destinations[RANK], (destinations, hood)
    assert sources == tuple(src and src[0] for src in hood.sources[RANK]), (sources, hood)


def run_case(case, comm: JaxComm, checking: JaxComm, planner=None) -> None:
    """Run `case` on every rank and fail every rank together if any rank's outcome
    breaks the invariant. `planner(case, communicator)` makes its Plan (default:
    plan), on the case's graph or grid if it has one."""
    digest = hashlib.sha256(repr(case).encode()).hexdigest()[:16]
    digests = WORLD.allgather(digest)
    if len(set(digests)) > 1:
        raise AssertionError(f"Hypothesis drew different examples on the ranks: {digests}")
    if digest in _FAILED:  # Hypothesis replays the failing example: fail again, unrun
        raise AssertionError(_FAILED[digest])
    if os.environ.get("JAXCOMM_MISUSE_TRACE"):
        print(f"rank {RANK}: {case}", flush=True)
    on = checking if case.check else comm
    topology = made(on, case.hood)  # collective: never while tracing
    try:
        _run(case, digest, topology or on, planner or plan)
    finally:
        if topology is not None:
            topology.free()


def _run(case, digest: str, on: JaxComm, planner) -> None:
    p, mistake = None, None
    try:
        _check_hood(on, case.hood)
        p = planner(case, on)
    except Exception as e:
        mistake = e
    mistakes = WORLD.allgather(None if mistake is None else repr(mistake))
    if any(mistakes):  # a mistake of this test's, on some rank: every rank stops
        raise AssertionError(f"planning {case} failed: {mistakes}") from mistake
    verdict, seen = None, ""
    for repeat in range(REPEATS):
        dirty_heap(PATTERNS[repeat % len(PATTERNS)])
        results, error = None, None
        try:
            results = jax.block_until_ready(p.run())
        except Exception as e:
            error = e
        jax.effects_barrier()
        seen = f"raised {type(error).__name__}" if error is not None else "returned values"
        # Every rank makes every run, whatever it saw: the others' runs need it.
        verdict = verdict or judge(results, error, p.expect[RANK])
        if verdict is not None and not verdict.startswith("run "):
            verdict = f"run {repeat + 1}: {verdict}"
    outcomes = WORLD.allgather((verdict, seen))
    raised = {s.startswith("raised") for _, s in outcomes}
    if case.mode == "vmap" and len(raised) > 1 and all(e.value is not None for e in p.expect):
        # Refused at trace time on some ranks only: the others would wait for them.
        outcomes = [(v or "raised on some ranks only", s) for v, s in outcomes]
    if any(v for v, _ in outcomes):
        lines = [f"{case}"]
        for r, (v, s) in enumerate(outcomes):
            want = p.expect[r]
            wanted = "values" if want.value is not None else ""
            if want.reasons:
                wanted += (" or " if wanted else "") + f"raise naming {list(want.reasons)}"
            lines.append(f"  rank {r}: {v or 'right: ' + s}; expected: {wanted or 'any error'}")
        _FAILED[digest] = "\n".join(lines)
        raise AssertionError(_FAILED[digest])


# -- the properties -------------------------------------------------------------------


@pytest.fixture(scope="module")
def checking():
    """A communicator in checking mode, and the watchdog armed for this module."""
    from jaxcomm import _native, _settings

    armed = _settings.TIMEOUT == 0
    if armed:  # a hang becomes an abort that names the call
        _native.cpu.configure(debug=_settings.DEBUG, timeout=TIMEOUT)
    comm = JaxComm(MPI.COMM_WORLD, check=True)
    yield comm
    comm.free()
    if armed:
        _native.cpu.configure(debug=_settings.DEBUG, timeout=0.0)


MODES = ("eager", "jit", "jvp", "grad", "vmap")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OPS)
@SETTINGS
@given(data=st.data())
def test_counts(comm, checking, op, mode, data):
    run_case(data.draw(cases(op, mode), label="case"), comm, checking)


# -- fixed-size blocks to neighbours ----------------------------------------------------

#: Wrong shapes: x's leading axis not one block per destination (on every rank:
#: one rank alone would leave the others waiting for it), or x without one; in
#: checking mode, the shape or dtype of a block differing between ranks.
WRONG_BLOCKS = ("leading axis", "scalar x")
DISAGREEING = ("block shape", "dtype")


@dataclasses.dataclass(frozen=True)
class BlockCase:
    """One example of a fixed-size neighbour exchange: what every rank passes."""

    op: str  # neighbor_alltoall, neighbor_allgather
    posted: bool  # its non-blocking form, posted then waited
    mode: str
    jit: bool
    check: bool
    hood: Hood
    mistake: str | None
    dtype: tuple  # x's dtype on each rank
    shape: tuple  # x's shape on each rank (one vmap member's)


@st.composite
def block_cases(draw, op: str, mode: str):
    jit = mode == "jit" or (mode != "eager" and draw(st.booleans()))
    check = draw(st.sampled_from((False, False, True)))
    dtype = draw(st.sampled_from(FLOATS if mode in ("jvp", "grad") else X_DTYPES))
    block = draw(st.sampled_from(ROW_SHAPES))
    hood = draw(hoods())
    kinds = [None] * 4 + (list(WRONG_BLOCKS) if op == "neighbor_alltoall" else [])
    mistake = draw(st.sampled_from(kinds + (list(DISAGREEING) if check else [])))
    blocks = [len(d) for d in hood.destinations]
    if mistake == "leading axis":
        blocks = [n + draw(st.sampled_from((1, -1) if n else (1,))) for n in blocks]
    odd = [mistake in DISAGREEING and draw(st.booleans()) for _ in range(SIZE)]
    other = "float64" if dtype != "float64" else "float32"
    dtypes = tuple(other if o and mistake == "dtype" else dtype for o in odd)
    shapes = tuple((*block, 2) if o and mistake == "block shape" else block for o in odd)
    if op == "neighbor_alltoall":
        per_rank = zip(blocks, shapes, strict=True)
        shapes = tuple(() if mistake == "scalar x" else (n, *s) for n, s in per_rank)
    return BlockCase(op, draw(st.booleans()), mode, jit, check, hood, mistake, dtypes, shapes)


def blocks_reference(op: str, xs, hood: Hood) -> list[np.ndarray]:
    """Per rank: block i from source i (neighbor_allgather: its x; neighbor_alltoall:
    its block for this rank), zeros from beyond a grid's edge."""
    out = []
    for r, x in enumerate(xs):
        like = x if op == "neighbor_allgather" else np.zeros(x.shape[1:], x.dtype)
        blocks = [
            np.zeros_like(like) if src is None
            else xs[src[0]] if op == "neighbor_allgather" else xs[src[0]][src[1]]
            for src in hood.sources[r]
        ]  # fmt: skip
        out.append(np.stack(blocks) if blocks else np.zeros((0, *like.shape), x.dtype))
    return out


def plan_blocks(case: BlockCase, on: JaxComm) -> Plan:
    members = 2 if case.mode == "vmap" else 1
    name = ("i" if case.posted else "") + case.op
    xs = [[rank_rows(r, m, 1, case.shape[r], case.dtype[r])[0] for r in range(SIZE)]
          for m in range(members)]  # fmt: skip
    post = getattr(on, name)

    def call(x):
        return on.wait(post(x)) if case.posted else post(x)

    if case.mode in ("eager", "jit"):
        fn = lambda x: (call(x),)  # noqa: E731
    elif case.mode == "jvp":
        fn = lambda x: jax.jvp(call, (x,), (x + 0.5,))  # noqa: E731
    elif case.mode == "grad":
        fn = lambda x: (jax.grad(lambda x: jnp.sum(weighted(call(x))))(x),)  # noqa: E731
    else:
        fn = lambda x: (jax.vmap(call)(x),)  # noqa: E731
    fn = jax.jit(fn) if case.jit else fn
    x = jnp.asarray(np.stack([xs[m][RANK] for m in range(members)]) if members > 1 else xs[0][RANK])
    run = lambda: fn(x)  # noqa: E731

    if case.mistake in WRONG_BLOCKS:  # every rank, before any MPI call
        return Plan(run, [Expect(None, (("x", None),), operation=name)] * SIZE)
    blocks = [s[1:] if case.op == "neighbor_alltoall" else s for s in case.shape]
    if len(set(zip(case.dtype, blocks, strict=True))) > 1:  # (checking mode only)
        return Plan(run, [Expect(None, (("jaxcomm check", None),), operation=name)] * SIZE)
    outs = [blocks_reference(case.op, xs[m], case.hood) for m in range(members)]
    if case.mode == "jvp":
        tangents = blocks_reference(case.op, [x + 0.5 for x in xs[0]], case.hood)
        values = [(outs[0][r], tangents[r]) for r in range(SIZE)]
    elif case.mode == "grad":
        first = np.cumsum([0, *(x.size for x in xs[0])])
        labels = [labelled(x.shape, first[r] + 1) for r, x in enumerate(xs[0])]
        landed = [(y,) for y in blocks_reference(case.op, labels, case.hood)]
        grads = gradient_reference(labels, landed, weights)
        values = [(g.astype(case.dtype[r]),) for r, g in enumerate(grads)]
    else:
        values = [(np.stack([o[r] for o in outs]) if members > 1 else outs[0][r],)
                  for r in range(SIZE)]  # fmt: skip
    return Plan(run, [Expect(v, operation=name) for v in values])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ("neighbor_alltoall", "neighbor_allgather"))
@SETTINGS
@given(data=st.data())
def test_neighbor_blocks(comm, checking, op, mode, data):
    case = data.draw(block_cases(op, mode), label="case")
    run_case(case, comm, checking, plan_blocks)


# -- misuse the properties may not draw at every size -----------------------------------


@pytest.mark.parametrize("op", ["scatterv", "iscatterv"])
def test_a_root_without_counts_is_named(comm, op):
    """Each rank the root of its own call, so that every rank raises before any
    MPI call, naming the operation and its counts."""
    with pytest.raises(ValueError, match=rf"^{op}: the root \(rank {RANK}\) must pass counts"):
        getattr(comm, op)(jnp.zeros((2, 3)), None, RANK, capacity=2)


#: Graphs in which no rank waits for another, whatever it refuses: each rank its
#: own only neighbour, or no neighbours at all.
ALONE = {"self-loop": lambda: ([RANK], [RANK]), "no edges": lambda: ([], [])}


@pytest.mark.parametrize("edges", ALONE)
@pytest.mark.parametrize("op", ["neighbor_allgatherv", "ineighbor_allgatherv"])
@pytest.mark.parametrize("count", [np.int8(-2), np.int32(3), 2**64 - 1])
def test_a_refused_count_is_named_under_grad(comm, edges, op, count):
    """The refusal of a count reaches its rank under grad, at the adjoint's
    exchange, where a rank without destinations gets nothing back; and a count
    of any dtype (2**64 - 1: uint64) is traced there as in the exchange."""
    graph = comm.create_dist_graph(*ALONE[edges]())

    def gathered(x):
        if op == "neighbor_allgatherv":
            return graph.neighbor_allgatherv(x, capacity=4, count=count)[0]
        return graph.wait(graph.ineighbor_allgatherv(x, capacity=4, count=count))[0]

    grad = jax.grad(lambda x: jnp.sum(gathered(x)))
    try:
        for run in (grad, jax.jit(grad)):
            with pytest.raises(Exception, match=rf"\bcount=\[{count}\]"):
                jax.block_until_ready(run(jnp.ones((2, 3))))
    finally:
        graph.free()


def test_empty_float_counts_are_refused(comm):
    """As float counts on a rank that has destinations are (no edges: no rank
    waits for another)."""
    refused = pytest.raises(TypeError, match=r"neighbor_alltoallv: send_counts must be integers")
    with comm.create_dist_graph([], []) as graph, refused:
        graph.neighbor_alltoallv(jnp.zeros((1, 2)), np.zeros(0, np.float32), capacity=1)


# -- roots, ranks and tags -----------------------------------------------------------

ROOT_OPS = ("bcast", "reduce", "gather", "scatter")
PEER_OPS = ("sendrecv", "send, recv", "isend, irecv")
#: How a root, rank or tag is passed: right, or wrong in one way (the same on every rank).
VALUES = ("right", "numpy int", "bool", "out of range", "negative", "2**40", "float",
          "str", "None", "traced")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PeerCase:
    op: str
    param: str  # root, dest, source or tag
    value: str  # one of VALUES
    jit: bool


@st.composite
def peer_cases(draw, value: str):
    op = draw(st.sampled_from(ROOT_OPS + PEER_OPS))
    param = "root" if op in ROOT_OPS else draw(st.sampled_from(("dest", "source", "tag")))
    return PeerCase(op, param, value, draw(st.booleans()))


def peer_argument(case: PeerCase, right: int):
    """The value passed, and the (name, value) pairs an error may name (sendrecv
    calls its tags sendtag and recvtag); () if the value is right."""
    tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    out = tag_ub + 1 if case.param == "tag" else SIZE
    wrong = {"out of range": out, "negative": -7, "2**40": 2**40}
    passed = {"right": right, "numpy int": np.int64(right), "bool": right == 1, "float": 1.0,
              "str": str(right), "None": None, "traced": jnp.int32(right),
              **wrong}[case.value]  # fmt: skip
    if case.value == "right":
        return passed, ()
    names = ("tag", "sendtag", "recvtag") if case.param == "tag" else (case.param,)
    return passed, tuple((n, wrong.get(case.value)) for n in names)


def run_peer_case(case: PeerCase, world: JaxComm) -> None:
    digests = WORLD.allgather(hashlib.sha256(repr(case).encode()).hexdigest()[:16])
    if len(set(digests)) > 1:
        raise AssertionError(f"Hypothesis drew different examples on the ranks: {digests}")
    comm = world.dup()  # a message left unreceived by a refusal stays in it
    inputs = [rank_rows(r, 0, 1, (3,), "float32")[0] for r in range(SIZE)]
    x = jnp.asarray(inputs[RANK])
    root, dest, source, tag = SIZE - 1, (RANK + 1) % SIZE, (RANK - 1) % SIZE, 5
    value, reasons = peer_argument(case, {"root": root, "dest": dest, "source": source}.get(
        case.param, tag))  # fmt: skip
    args = {"root": root, "dest": dest, "source": source, "tag": tag, case.param: value}
    traced = {case.param: value} if case.value == "traced" and case.jit else {}

    def call(x, traced):
        a = {**args, **traced}
        if case.op == "scatter":
            x = jnp.stack([x + r for r in range(SIZE)]) if a["root"] == RANK else x
        if case.op in ROOT_OPS:
            return getattr(comm, case.op)(x, root=a["root"])
        if case.op == "sendrecv":
            return comm.sendrecv(x, None, a["source"], a["dest"], a["tag"], a["tag"])
        if case.op == "send, recv":  # small: MPI sends it before a matching receive
            comm.send(x, a["dest"], a["tag"])
            return comm.recv(x, a["source"], a["tag"])
        first = comm.irecv(x, a["source"], a["tag"]) if case.param == "source" else None
        sent = comm.isend(x, a["dest"], a["tag"])
        got = comm.wait(first or comm.irecv(x, a["source"], a["tag"]))
        comm.wait(sent)
        return got

    if case.op == "scatter":
        want = np.asarray(inputs[root] + RANK)
    elif case.op in ROOT_OPS:
        want = expected_collective(case.op, RANK, inputs, root=root)
    else:
        want = inputs[source]
    # A rank passed as an int of another type, or a concrete array, may be taken.
    either = case.value in ("numpy int", "bool") or (case.value == "traced" and not case.jit)
    expect = Expect((want,) if not reasons or either else None, reasons)
    error, results = None, None
    try:
        fn = jax.jit(call) if case.jit else call
        results = (jax.block_until_ready(fn(x, traced)),)
    except Exception as e:
        error = e
    jax.effects_barrier()
    verdict = judge(results, error, expect)
    outcomes = WORLD.allgather(verdict)
    comm.free()
    if any(outcomes):
        lines = [f"{case}"] + [f"  rank {r}: {v or 'right'}" for r, v in enumerate(outcomes)]
        raise AssertionError("\n".join(lines))


# Per way of passing the value, so that each is drawn in every run: an example is
# a few small calls, and one wrong value (a rank equal to the size) is the
# boundary that an off-by-one check passes.
@pytest.mark.parametrize("value", VALUES)
@SETTINGS
@given(data=st.data())
def test_roots_ranks_and_tags(comm, checking, value, data):
    run_peer_case(data.draw(peer_cases(value), label="case"), comm)
