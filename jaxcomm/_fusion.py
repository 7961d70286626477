"""Which arrays of a pytree travel together, and how: small leaves of one dtype go
as one message, packed flat in order. Traced and eager calls take their messages
from the same plan, so every rank sends the same messages whichever path its call
takes. A message's call takes the operation's params, with its own value of each
PerLeaf param."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

#: Leaves smaller than this many bytes travel together: one message per dtype.
FUSE_BELOW_BYTES = 1 << 16


class Message(NamedTuple):
    """The leaves (by index) that travel as one message, with their shapes and
    where each lies, as (start, stop), in the flat array of the message."""

    members: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    spans: tuple[tuple[int, int], ...]

    @property
    def fused(self) -> bool:
        return len(self.members) > 1

    @property
    def size(self) -> int:
        """Elements in the flat array of a fused message."""
        return self.spans[-1][1]

    def pack(self, leaves: Sequence[Any], xp: Any) -> Any:
        """The members of `leaves` as one flat array (xp: numpy or jax.numpy)."""
        return xp.concatenate([xp.ravel(leaves[i]) for i in self.members])

    def unpack(self, flat: Any) -> list[Any]:
        """The members' pieces of the flat array `flat`, in their shapes."""
        return [
            flat[start:stop].reshape(shape)
            for (start, stop), shape in zip(self.spans, self.shapes, strict=True)
        ]


class PerLeaf(tuple):
    """A param with a value for each leaf (sendrecv's result shapes and dtypes), of
    an operation whose leaves travel alone."""


Params = tuple[tuple[str, Any], ...]  # an operation's params, as items: hashable


def message_params(params: Params, message: Message) -> Params:
    """The params of the call that carries `message`."""
    first = message.members[0]
    return tuple((key, value[first] if type(value) is PerLeaf else value) for key, value in params)


def fuses(elementwise: bool, checking: bool) -> bool:
    """Whether an operation's small leaves travel together: where it is
    element-wise, but not in checking mode, whose fingerprint describes a
    call's one message: each leaf's own shape must show in it, or leaves that
    differ between ranks but add up alike would pair silently."""
    return elementwise and not checking


def messages(types: Sequence[tuple[tuple[int, ...], Any]], fuse: bool) -> list[Message]:
    """The messages that carry leaves of `types` ((shape, dtype) each), in the
    order they go: without `fuse` every leaf alone, in order; with it each large
    leaf alone, in order, then the small leaves of each dtype together, in order
    of the dtype's first appearance."""
    alone: list[tuple[int, ...]] = []
    small: dict[Any, list[int]] = {}
    for i, (shape, dtype) in enumerate(types):
        if fuse and int(np.prod(shape)) * np.dtype(dtype).itemsize < FUSE_BELOW_BYTES:
            small.setdefault(dtype, []).append(i)
        else:
            alone.append((i,))
    groups = alone + [tuple(members) for members in small.values()]
    return [_message(members, [tuple(types[i][0]) for i in members]) for members in groups]


def _message(members: tuple[int, ...], shapes: list[tuple[int, ...]]) -> Message:
    spans, stop = [], 0
    for shape in shapes:
        start, stop = stop, stop + int(np.prod(shape))
        spans.append((start, stop))
    return Message(members, tuple(shapes), tuple(spans))
