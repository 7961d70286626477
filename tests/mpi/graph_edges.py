"""The distributed graphs that the graph tests make (the `graphs` fixture,
conftest.py), as functions of the number of ranks.

Each graph is a list of edges (source, destination) that every rank knows, in one
global order; a rank's destinations and sources are its edges in that order, so
that the k-th edge between two ranks is the k-th in both lists (MPI's pairing)."""

import numpy as np


def ring_and_self(size):
    """Each rank to the next one and to itself: a directed ring with self-loops."""
    return [edge for r in range(size) for edge in ((r, (r + 1) % size), (r, r))]


def random_graph(size):
    """About half of all ordered pairs, self-loops included, in a shuffled order."""
    rng = np.random.default_rng(45)
    pairs = [(s, d) for s in range(size) for d in range(size) if rng.random() < 0.5]
    return [pairs[i] for i in rng.permutation(len(pairs))]


def last_isolated(size):
    """Everything from and to every rank but the last, which has no neighbours."""
    return [(s, d) for s in range(size - 1) for d in reversed(range(size - 1))]


def into_zero(size):
    """Every rank sends to rank 0 only: rank 0 has no destinations but itself, the
    others no sources."""
    return [(r, 0) for r in reversed(range(size))]


def no_edges(size):
    return []


def repeated_edges(size):
    """Two edges to the next rank and three to itself, interleaved: blocks pair by
    order (the k-th sent to a rank arrives as the k-th received from this one)."""
    return [(r, d) for r in range(size) for d in [(r + 1) % size, r, (r + 1) % size, r, r]]


GRAPHS = {
    f.__name__: f
    for f in [ring_and_self, random_graph, last_isolated, into_zero, no_edges, repeated_edges]
}


def lists(edges, rank):
    """(sources, destinations) of `rank`, in the edges' order."""
    return [s for s, d in edges if d == rank], [d for s, d in edges if s == rank]
