"""Which arrays of a pytree travel together: small leaves of one dtype go as one
message. Traced and eager calls group them the same way, so every rank sends the
same messages whichever path its call takes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: Leaves smaller than this many bytes travel together: one message per dtype.
FUSE_BELOW_BYTES = 1 << 16


def message_groups(
    types: Sequence[tuple[tuple[int, ...], Any]], fuse: bool
) -> list[tuple[int, ...]]:
    """The leaves of `types` ((shape, dtype) each) that travel together, as index
    tuples in the order their messages go: without `fuse` every leaf alone, in
    order; with it each large leaf alone, in order, then the small leaves of each
    dtype together, in order of the dtype's first appearance."""
    if not fuse:
        return [(i,) for i in range(len(types))]
    alone: list[tuple[int, ...]] = []
    small: dict[Any, list[int]] = {}
    for i, (shape, dtype) in enumerate(types):
        if int(np.prod(shape)) * np.dtype(dtype).itemsize < FUSE_BELOW_BYTES:
            small.setdefault(dtype, []).append(i)
        else:
            alone.append((i,))
    return alone + [tuple(members) for members in small.values()]


def bounds(shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, int]]:
    """Where arrays of `shapes` lie, as (start, stop), in one flat array holding them
    in order."""
    spans, stop = [], 0
    for shape in shapes:
        start, stop = stop, stop + int(np.prod(shape))
        spans.append((start, stop))
    return spans


def split(flat: Any, shapes: Sequence[tuple[int, ...]]) -> list[Any]:
    """The consecutive pieces of 1-d `flat`, reshaped to `shapes`."""
    return [
        flat[start:stop].reshape(shape)
        for (start, stop), shape in zip(bounds(shapes), shapes, strict=True)
    ]
