"""Point to point: send, recv, sendrecv, and barrier.

recv and sendrecv also return a status array int32[2] = (source, tag) of the
received message, so ANY_SOURCE/ANY_TAG callers can learn them inside jit.
"""

from __future__ import annotations

import numpy as np
from jax import core

from jaxcomm._primitive import CommInfo, comm_primitive

_STATUS = core.ShapedArray((2,), np.int32)


def _recv_shape(*_, shape, dtype, **__):
    return [core.ShapedArray(shape, dtype), _STATUS]


def _sendrecv_aliases(x, *, shape, dtype, **_):
    return {0: 0} if (x.shape, x.dtype) == (shape, dtype) else None


send_p = comm_primitive("send", lambda *_, **__: [], attrs=("dest", "tag"))
recv_p = comm_primitive("recv", _recv_shape, attrs=("source", "tag"))
sendrecv_p = comm_primitive(
    "sendrecv",
    _recv_shape,
    attrs=("source", "dest", "sendtag", "recvtag"),
    aliases=_sendrecv_aliases,
)
barrier_p = comm_primitive("barrier", lambda **_: [])


def send(x, *, comm: CommInfo, dest: int, tag: int) -> None:
    send_p.bind(x, comm=comm, dest=dest, tag=tag)


def recv(*, comm: CommInfo, shape, dtype, source: int, tag: int):
    """Receive an array of `shape`/`dtype`. Returns (array, status)."""
    out, status = recv_p.bind(comm=comm, shape=shape, dtype=dtype, source=source, tag=tag)
    return out, status


def sendrecv(
    x, *, comm: CommInfo, shape, dtype, source: int, dest: int, sendtag: int, recvtag: int
):
    """Send x to dest and receive an array of `shape`/`dtype` from source."""
    out, status = sendrecv_p.bind(
        x,
        comm=comm,
        shape=shape,
        dtype=dtype,
        source=source,
        dest=dest,
        sendtag=sendtag,
        recvtag=recvtag,
    )
    return out, status


def barrier(*, comm: CommInfo) -> None:
    barrier_p.bind(comm=comm)
