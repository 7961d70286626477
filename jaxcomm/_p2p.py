"""Point to point: send, recv and sendrecv.

recv and sendrecv also return a status array int32[2] = (source, tag) of the
received message, so ANY_SOURCE/ANY_TAG callers can learn them inside jit.

Adjoints: send transposes to a receive from dest, recv to a send to source,
sendrecv to the reversed exchange. A cotangent travels with the tag of the
message it belongs to, so transposed messages pair up by tag as the primal ones
did (a receive may pick messages out of order by tag). A receive from ANY_TAG
learns that tag only at run time: its tangent is a `tagged_sendrecv`, whose tags
are an operand, built from the primal message's status.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import core
from mpi4py import MPI

from jaxcomm._checks import DEST, RECEIVED_TAG, SOURCE, TAG
from jaxcomm._primitive import CommInfo, comm_primitive
from jaxcomm._rules import define_rules, differentiable, instantiate, move_batch, zero_tangent

STATUS = core.ShapedArray((2,), np.int32)


def _recv_shape(like, **_):
    return [core.ShapedArray(like.shape, like.dtype), STATUS]


def _sendrecv_shape(x, *, shape, dtype, **_):
    return [core.ShapedArray(shape, dtype), STATUS]


send_p = comm_primitive("send", lambda *_, **__: [], params={"dest": DEST, "tag": TAG})
# recv's operand is its template: only its shape and dtype are used. Being an
# operand lets a tangent reach recv; it is not passed to the FFI call, so a
# template made for the call (jnp.empty_like(x)) costs nothing.
recv_p = comm_primitive("recv", _recv_shape, params={"source": SOURCE, "tag": RECEIVED_TAG})
# sendrecv never runs in place: receiving over the data being sent needs a
# message-sized buffer anyway (MPI_Sendrecv_replace allocates one), so aliasing
# would save no memory and cost a copy even where XLA could keep both arrays.
sendrecv_p = comm_primitive(
    "sendrecv",
    _sendrecv_shape,
    params={"source": SOURCE, "dest": DEST, "sendtag": TAG, "recvtag": RECEIVED_TAG},
)


def _tagged_shape(x, tags, *, shape, dtype, **_):
    return [core.ShapedArray(shape, dtype), STATUS]


# sendrecv whose (sendtag, recvtag) are an int32[2] operand: the AD of receives
# from ANY_TAG (see any_tag_tangent). Never in place, as sendrecv.
tagged_sendrecv_p = comm_primitive("tagged_sendrecv", _tagged_shape)


def send(x, *, comm: CommInfo, dest: int, tag: int, cotangent: bool = False) -> None:
    """`cotangent`: x is a receive's cotangent, going back to the rank that sent
    the data (see refuse_derivative_of_reply)."""
    params = {"cotangent": True} if cotangent else {}
    send_p.bind(x, comm=comm, dest=dest, tag=tag, **params)


def recv(like, *, comm: CommInfo, source: int, tag: int):
    """Receive an array shaped like `like`. Returns (array, status)."""
    out, status = recv_p.bind(like, comm=comm, source=source, tag=tag)
    return out, status


def sendrecv(
    x, *, comm: CommInfo, shape, dtype, source: int, dest: int, sendtag: int, recvtag: int
):
    """Send x to dest and receive an array of `shape`/`dtype` from source."""
    out, status = sendrecv_p.bind(
        x,
        comm=comm,
        shape=tuple(shape),
        dtype=np.dtype(dtype),
        source=source,
        dest=dest,
        sendtag=sendtag,
        recvtag=recvtag,
    )
    return out, status


def tagged_sendrecv(x, tags, *, comm: CommInfo, shape, dtype, source: int, dest: int):
    """sendrecv with tags = int32[2] (sendtag, recvtag), known at run time."""
    out, status = tagged_sendrecv_p.bind(
        x, tags, comm=comm, shape=tuple(shape), dtype=np.dtype(dtype), source=source, dest=dest
    )
    return out, status


# -- AD --------------------------------------------------------------------------------


def known_source(operation: str, source: int) -> None:
    if source == MPI.ANY_SOURCE:
        raise ValueError(
            f"{operation}: differentiating a receive needs an explicit source, not "
            "MPI.ANY_SOURCE (the tangent or cotangent must come from, or go back to, "
            "the rank that sent the data)"
        )


def known_tag(operation: str, source: int, tag: int) -> int:
    """The tag a cotangent goes back with: the received message's."""
    if source == MPI.PROC_NULL:
        return 0  # nothing was received, nothing goes back
    if tag == MPI.ANY_TAG:
        raise ValueError(
            f"{operation}: transposing a receive from MPI.ANY_TAG needs the tag the "
            "message came with; pass the tag explicitly (jax.grad and jax.vjp carry it "
            "themselves)"
        )
    return tag


def tag_unknown(source: int, tag: int) -> bool:
    """Whether a receive learns its message's tag only at run time."""
    return tag == MPI.ANY_TAG and source != MPI.PROC_NULL


def refuse_derivative_of_reply(operation: str, params: dict, how: str) -> None:
    """Refuse to differentiate or batch (`how`) a send that carries a receive's
    cotangent back: its partner, the transpose of the original send, receives
    into a constant, so JAX gives that receive no tangent and no batch, and the
    messages would not match (a hang, or a later receive taking the extra one)."""
    if params.get("cotangent"):
        raise NotImplementedError(
            f"{operation}: {how} the gradient of a standalone send/recv pair (jacrev, "
            "vmap of a gradient, or a second derivative taken through the gradient) is "
            "not supported: the "
            "sending rank could not take part; use sendrecv, whose two directions "
            "are one operation"
        )


def any_tag_tangent(t, status, *, comm, shape, source, dest, sendtag):
    """The tangent of a receive from ANY_TAG (and of a send to dest, if any): received
    with the tag the primal message came with, which the transpose sends it back with."""
    tags = jnp.stack([jnp.int32(sendtag), status[1]])
    dot, _ = tagged_sendrecv(
        t, tags, comm=comm, shape=shape, dtype=t.dtype, source=source, dest=dest
    )
    return dot


def _send_jvp(primals, tangents, **params):
    if differentiable(primals[0]):
        refuse_derivative_of_reply("send", params, "differentiating")
    send_p.bind(*primals, **params)
    if differentiable(primals[0]):
        send_p.bind(instantiate(tangents[0]), **params)
    return [], []


def _send_transpose(cts, x, *, comm, dest, tag, **_):
    like = np.zeros(x.aval.shape, x.aval.dtype)
    ct, _ = recv(like, comm=comm, source=dest, tag=tag)
    return [ct]


def _recv_jvp(primals, tangents, *, comm, source, tag):
    out, status = recv_p.bind(*primals, comm=comm, source=source, tag=tag)
    if not differentiable(out):
        return [out, status], [zero_tangent(out), zero_tangent(status)]
    known_source("recv", source)
    t = instantiate(tangents[0])
    if tag_unknown(source, tag):
        dot = any_tag_tangent(
            t, status, comm=comm, shape=t.shape, source=source, dest=MPI.PROC_NULL, sendtag=0
        )
    else:
        dot, _ = recv_p.bind(t, comm=comm, source=source, tag=tag)
    return [out, status], [dot, zero_tangent(status)]


def _recv_transpose(cts, like, *, comm, source, tag):
    known_source("recv", source)
    tag = known_tag("recv", source, tag)
    send(instantiate(cts[0]), comm=comm, dest=source, tag=tag, cotangent=True)
    return [None]


def _sendrecv_jvp(primals, tangents, *, comm, shape, dtype, source, dest, sendtag, recvtag):
    params = dict(source=source, dest=dest, sendtag=sendtag, recvtag=recvtag)
    out, status = sendrecv_p.bind(*primals, comm=comm, shape=shape, dtype=dtype, **params)
    if not (differentiable(primals[0]) and differentiable(out)):
        return [out, status], [zero_tangent(out), zero_tangent(status)]
    known_source("sendrecv", source)
    t = instantiate(tangents[0])
    if tag_unknown(source, recvtag):
        dot = any_tag_tangent(
            t, status, comm=comm, shape=shape, source=source, dest=dest, sendtag=sendtag
        )
    else:
        dot, _ = sendrecv_p.bind(t, comm=comm, shape=shape, dtype=dtype, **params)
    return [out, status], [dot, zero_tangent(status)]


def _sendrecv_transpose(cts, x, *, comm, shape, dtype, source, dest, sendtag, recvtag):
    known_source("sendrecv", source)
    ct, _ = sendrecv(
        instantiate(cts[0]),
        comm=comm,
        shape=x.aval.shape,
        dtype=x.aval.dtype,
        source=dest,
        dest=source,
        sendtag=known_tag("sendrecv", source, recvtag),
        recvtag=sendtag,
    )
    return [ct]


def _tagged_jvp(primals, tangents, **params):
    (x, tags), (t, _) = primals, tangents
    out, status = tagged_sendrecv_p.bind(x, tags, **params)
    if not (differentiable(x) and differentiable(out)):
        return [out, status], [zero_tangent(out), zero_tangent(status)]
    dot, _ = tagged_sendrecv_p.bind(instantiate(t), tags, **params)  # the same tags
    return [out, status], [dot, zero_tangent(status)]


def _tagged_transpose(cts, x, tags, *, comm, shape, dtype, source, dest):
    # Each cotangent goes back with its message's tag: to source with recvtag, and
    # from dest with sendtag. Where nothing was sent, nothing comes back.
    sent = dest != MPI.PROC_NULL
    ct, _ = tagged_sendrecv(
        instantiate(cts[0]),
        tags[::-1],
        comm=comm,
        shape=x.aval.shape if sent else (0,),
        dtype=x.aval.dtype,
        source=dest,
        dest=source,
    )
    return [ct if sent else None, None]


# -- batching: the batch axis leads, so both sides of a message agree on its layout -----


def _send_batch(args, dims, **params):
    refuse_derivative_of_reply("send", params, "batching")
    send_p.bind(move_batch(args[0], dims[0], 0), **params)
    return [], []


def _recv_batch(args, dims, **params):
    out, status = recv_p.bind(move_batch(args[0], dims[0], 0), **params)
    return [out, status], [0, None]


def _sendrecv_batch(args, dims, *, shape, **params):
    (x,), (dim,) = args, dims
    x = move_batch(x, dim, 0)
    out, status = sendrecv_p.bind(x, shape=(x.shape[0], *shape), **params)
    return [out, status], [0, None]


def _tagged_batch(args, dims, *, shape, **params):
    (x, tags), (dim, tags_dim) = args, dims
    if tags_dim is not None:
        raise NotImplementedError(
            "vmap of a differentiated receive from MPI.ANY_TAG over its message's tag"
        )
    x = move_batch(x, dim, 0)
    out, status = tagged_sendrecv_p.bind(x, tags, shape=(x.shape[0], *shape), **params)
    return [out, status], [0, None]


define_rules(send_p, jvp=_send_jvp, transpose=_send_transpose, batch=_send_batch)
define_rules(recv_p, jvp=_recv_jvp, transpose=_recv_transpose, batch=_recv_batch)
define_rules(sendrecv_p, jvp=_sendrecv_jvp, transpose=_sendrecv_transpose, batch=_sendrecv_batch)
define_rules(tagged_sendrecv_p, jvp=_tagged_jvp, transpose=_tagged_transpose, batch=_tagged_batch)
