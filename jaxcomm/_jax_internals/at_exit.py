"""What jaxcomm asks of JAX's runtime token of its effect at exit.

Whether a failed computation's error still waits in the token, which no call
has taken (before JAX 0.12 only a hook on JAX's private token handler can
tell), and waiting for every computation with the effect to end: jaxcomm asks
both at exit, where a rank out of step ends the job (jaxcomm._lockstep).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core, dispatch
from jax._src.interpreters import pxla

from jaxcomm._jax_internals.effect import COMM_EFFECT


def failure_unclaimed() -> bool:
    """Whether JAX's token of jaxcomm's effect on this thread holds the error of
    a computation that failed after its call had returned, and no call with the
    effect (which a peer may run) has been refused for it since. JAX 0.12
    refuses the next such call of the thread and takes the error from the
    token; older JAX keeps it there and refuses every later call, which
    `_note_refusals` sees."""
    token = dispatch.runtime_tokens.current_tokens.get(COMM_EFFECT)
    return token is not None and token is not _refused.token and _holds_error(token)


class _Refused(threading.local):
    """This thread's token of jaxcomm's effect when JAX last refused a call for
    its error (JAX before 0.12, which leaves the token as it was)."""

    token: core.Token | None = None


_refused = _Refused()


def _note_refusals(shard_tokens: Callable[..., Any]) -> Callable[..., Any]:
    """JAX's handler that puts an ordered effect's token on the devices of the
    computation being dispatched, noting each refusal of a call with jaxcomm's
    effect: before 0.12 JAX refuses a call there, raising the error of the
    computation that returned the token. Another effect's token may raise
    before jaxcomm's is reached: a refusal while jaxcomm's token holds an error
    counts as a refusal for that error."""

    def shard(tokens: Sequence[Any], *args: Any) -> Any:
        try:
            return shard_tokens(tokens, *args)
        except jax.errors.JaxRuntimeError:
            ours = dispatch.runtime_tokens.current_tokens.get(COMM_EFFECT)
            if ours is not None and (any(t is ours for t in tokens) or _holds_error(ours)):
                _refused.token = ours
            raise

    return shard


def _holds_error(token: core.Token) -> bool:
    """Whether the computation that returned `token` failed (once it has ended)."""
    try:
        token.block_until_ready()
    except jax.errors.JaxRuntimeError:
        return True
    return False


# Before 0.12 nothing of JAX's state tells a refused call from none at exit
# (failure_unclaimed): both leave the same token. The handler, as wrapped, does
# what JAX's does; JAX 0.10 and 0.11 are released, so the handler stays as read.
if jax.__version_info__ < (0, 12):
    pxla.shard_arg_handlers[core.Token] = _note_refusals(pxla.shard_arg_handlers[core.Token])


def effects_settled() -> None:
    """Wait for every computation with an ordered effect to end. A failed one's
    error is left to JAX and to jaxcomm._lockstep (which ends the job if the
    failure put the rank out of step): at exit it was either seen by the
    program already or, as JAX itself does, not reported."""
    with contextlib.suppress(jax.errors.JaxRuntimeError):
        jax.effects_barrier()
