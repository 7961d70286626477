"""How a JaxComm method runs an operation on its pytree's leaves: while tracing,
on the eager path (jaxcomm._eager) or, for arrays off the host, as one jitted
call. Small leaves travel together as the message plan of jaxcomm._fusion says."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _eager, _fusion, _p2p


def dispatch(body, leaves: list, **static: Any) -> Any:
    """body(leaves, **static): inline on the eager fast path (jaxcomm._eager) or
    while tracing; otherwise as one cached jitted call, which JAX dispatches
    faster than the primitives one by one."""
    if _eager.can_run(leaves) or any(isinstance(a, jax.core.Tracer) for a in leaves):
        return body(leaves, **static)
    return _jitted(body, tuple(sorted(static.items())), leaves)


@partial(jax.jit, static_argnums=(0, 1))
def _jitted(body, static, leaves):
    return body(leaves, **dict(static))


def map_leaves(leaves, *, primitive, comm, fuse=False, **params):
    """`primitive` (an op on one array) on every leaf. With `fuse` (for element-wise
    ops), small leaves of one dtype are packed into one array so that they cost
    one MPI call (jaxcomm._fusion)."""
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return _eager.map_call(primitive.eager, leaves, comm, params, fuse)(leaves)
    results = list(leaves)
    for message in _fusion.messages([(leaf.shape, leaf.dtype) for leaf in leaves], fuse):
        if not message.fused:
            (i,) = message.members
            results[i] = primitive.bind(leaves[i], comm=comm, **params)[0]
            continue
        fused = primitive.bind(message.pack(leaves, jnp), comm=comm, **params)[0]
        for i, piece in zip(message.members, message.unpack(fused), strict=True):
            results[i] = piece
    return results


def send_leaves(leaves, *, comm, dest, tag):
    for leaf in leaves:
        _p2p.send(leaf, comm=comm, dest=dest, tag=tag)


def recv_leaves(leaves, *, comm, source, tag):
    results, status = [], None
    for leaf in leaves:
        out, status = _p2p.recv(leaf, comm=comm, source=source, tag=tag)
        results.append(out)
    return results, _no_message(source, tag) if status is None else status


def _no_message(source, tag):
    """The status of an empty pytree's receive: nothing arrived."""
    return jnp.array([source, tag], np.int32)


def sendrecv_leaves(leaves, *, comm, templates, source, dest, sendtag, recvtag):
    results, status = [], None
    for leaf, (shape, dtype) in zip(leaves, templates, strict=True):
        out, status = _p2p.sendrecv(
            leaf,
            comm=comm,
            shape=shape,
            dtype=dtype,
            source=source,
            dest=dest,
            sendtag=sendtag,
            recvtag=recvtag,
        )
        results.append(out)
    return results, _no_message(source, recvtag) if status is None else status
