"""The eager fast path: outside any trace, an operation on concrete host arrays
runs its host code directly, outside XLA.

Dispatching a primitive with an ordered effect through JAX costs a few hundred
microseconds per call (any effect takes a call off jit's C++ fast path, and an
ordered one also threads a runtime token); even `Primitive.bind` costs several,
so jaxcomm's primitives look for this case before binding (CommPrimitive).
jaxcomm instead waits for earlier jaxcomm work to finish (`jax.effects_barrier()`:
that keeps program order with jitted calls still running) and hands the arrays
to the same C++ function the FFI handler calls, which takes their buffers through
the buffer protocol (waiting for inputs that XLA is still computing). Results
are fresh arrays, never aliased with inputs. Set ``JAXCOMM_EAGER=jit`` to send
eager calls through JAX's dispatch instead.

Everything fixed by a call's signature is prepared once, as a C++ EagerCall.
A pytree's arrays go through a MapCall, which sends small arrays of one dtype as
one message, like a traced call. A call that repeats an earlier one takes a
shortcut (`again`) past the method's argument handling. All of these live in one
bounded cache of prepared calls.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jaxcomm import _fusion, _settings
from jaxcomm._fusion import Params
from jaxcomm._jax_internals import ArrayImpl, at_top_level, host_arrays
from jaxcomm._native import cpu

ENABLED = _settings.EAGER == "direct"
_CODES: dict[np.dtype, int] = {jnp.dtype(name): code for name, code in cpu.dtype_codes.items()}
_ALIGN = 64  # bytes: XLA's own alignment, and what lets host_arrays share the memory


def can_run(arrays: Sequence[Any]) -> bool:
    """Whether an operation on `arrays` can take the fast path: called outside
    any trace, on concrete arrays that each live on one CPU device."""
    if not ENABLED or not at_top_level():
        return False
    for a in arrays:
        if type(a) is not ArrayImpl or not _on_one_host_device(a.sharding):
            return False
    return True


@functools.lru_cache(maxsize=256)  # a program uses few shardings
def _placement(sharding: jax.sharding.Sharding) -> tuple[frozenset[str], Any]:
    """The platforms ("cpu", "gpu", ...) of the devices an array is on, and the
    device when there is one (else None)."""
    devices = sharding.device_set
    device = next(iter(devices)) if len(devices) == 1 else None
    return frozenset(d.platform for d in devices), device


def platforms(sharding: jax.sharding.Sharding) -> frozenset[str]:
    """The platforms ("cpu", "gpu", ...) of the devices an array is on."""
    return _placement(sharding)[0]


def _on_one_host_device(sharding: jax.sharding.Sharding) -> bool:
    kinds, device = _placement(sharding)
    return device is not None and kinds == {"cpu"}


def _device(sharding: jax.sharding.Sharding) -> Any:
    """The device of an array on one device."""
    return _placement(sharding)[1]


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _allocator(aval: core.ShapedArray) -> Callable[[], np.ndarray]:
    """A function that makes the NumPy array a result of type `aval` is written to."""
    nbytes = aval.size * aval.dtype.itemsize
    if nbytes < 4096:  # copying a small result costs less than aligning it
        return functools.partial(np.empty, aval.shape, aval.dtype)
    return functools.partial(_aligned_empty, aval.shape, aval.dtype, nbytes)


def _fail(code: str, message: str) -> None:
    raise jax.errors.JaxRuntimeError(f"{code}: {message}")


class EagerOp:
    """Runs operation `name` now, on the buffers of concrete host arrays.

    abstract_eval(*avals, comm, **params) gives the result types; `attr_names`
    are the params the host function takes after the communicator and check flag;
    the first `templates` args give only the results' types, and the host
    function does not take them.
    """

    def __init__(
        self,
        name: str,
        abstract_eval: Callable[..., Sequence[core.ShapedArray]],
        attr_names: Sequence[str],
        templates: int = 0,
    ):
        self._name = name
        self._abstract_eval = abstract_eval
        self._attr_names = tuple(attr_names)
        self._templates = templates

    def __call__(
        self,
        args: Sequence[Any],
        comm: Any,
        wrapped: int | None = None,
        like: jax.Array | None = None,
        **params: Any,
    ) -> list[Any]:
        """The operation's results, as new arrays (never aliased with `args`): its
        first `wrapped` (default: all) as jax.Arrays on the device of `like`
        (default: the first arg, a jax.Array), the rest as NumPy arrays."""
        in_types = tuple((a.shape, a.dtype) for a in args)
        # Every operation with results has an input; the others never use `device`.
        like = args[0] if like is None and args else like
        device = _device(like.sharding) if like is not None else None
        return _prepared(self, in_types, comm, tuple(params.items()), device, wrapped)(*args)

    def prepare(self, in_types, comm, params, device, wrapped=None) -> cpu.EagerCall:
        """The call on arrays of `in_types` on `device`, prepared afresh (see _prepared).
        Its first `wrapped` results (default: all) are jax.Arrays, the rest NumPy arrays."""
        avals = [core.ShapedArray(shape, dtype) for shape, dtype in in_types]
        params = dict(params)
        outputs = [
            (_allocator(aval), _CODES[aval.dtype], host_arrays(aval, device))
            for aval in self._abstract_eval(*avals, comm=comm, **params)
        ]
        if wrapped is not None:
            outputs[wrapped:] = [(allocate, code, None) for allocate, code, _ in outputs[wrapped:]]
        own = (v if isinstance(v, str) else int(v) for v in map(params.get, self._attr_names))
        return cpu.EagerCall(
            self._name,
            self._templates,
            [_CODES[dtype] for _, dtype in in_types[self._templates :]],
            outputs,
            (comm.key, comm.check, *own),
            before=jax.effects_barrier,
            fail=_fail,
        )


class _Prepared:
    """The one cache of prepared calls (EagerCalls, MapCalls and the shortcut's),
    by signature, least recently used first out: calls mostly repeat a signature,
    and preparing a call costs more than looking it up, but a program that keeps
    making new signatures must not grow it without end."""

    def __init__(self, size: int):
        self._size = size
        self._calls: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Any:
        # Without the lock, which would cost an eager call a fifth of a microsecond:
        # each step is atomic, and a key that another thread evicts in between
        # only stays evicted.
        call = self._calls.get(key)
        if call is not None:
            try:  # noqa: SIM105 (contextlib.suppress costs more than this lookup)
                self._calls.move_to_end(key)
            except KeyError:
                pass
        return call

    def put(self, key: tuple, call: Any) -> Any:
        with self._lock:
            self._calls[key] = call
            while len(self._calls) > self._size:
                self._calls.popitem(last=False)
        return call

    def get_or_make(self, key: tuple, make: Callable[[], Any]) -> Any:
        call = self.get(key)
        return self.put(key, make()) if call is None else call


_prepared_calls = _Prepared(4096)


def _prepared(op: EagerOp, in_types, comm, params, device, wrapped=None) -> cpu.EagerCall:
    # On the per-call path (EagerOp calls, MapCall preparation): no closure to build.
    key = ("call", op, in_types, comm, params, device, wrapped)
    call = _prepared_calls.get(key)
    if call is None:
        call = _prepared_calls.put(key, op.prepare(in_types, comm, params, device, wrapped))
    return call


class MapCall:
    """op on each array of a list, of fixed types on host devices, prepared once.
    Arrays that travel together (jaxcomm._fusion) are packed into one flat NumPy
    array and sent through op in one call; their results are pieces of its output,
    each on its array's device."""

    def __init__(self, op: EagerOp, in_types, devices, comm: Any, params: Params, fuse: bool):
        # (message, call, wraps): wraps, for a fused message, make each member's
        # piece a jax.Array on its device.
        self._steps: list[tuple[_fusion.Message, cpu.EagerCall, list | None]] = []
        for message in _fusion.messages(in_types, fuse):
            first, own = message.members[0], _fusion.message_params(params, message)
            if not message.fused:
                call = _prepared(op, in_types[first : first + 1], comm, own, devices[first], 1)
                self._steps.append((message, call, None))
                continue
            dtype = in_types[first][1]
            wraps = [
                host_arrays(core.ShapedArray(shape, dtype), devices[i])
                for i, shape in zip(message.members, message.shapes, strict=True)
            ]
            # Its one result stays NumPy (wrapped=0), so the device is not used.
            call = _prepared(op, (((message.size,), dtype),), comm, own, devices[first], 0)
            self._steps.append((message, call, wraps))
        # The EagerCall of a map of one array, which always travels alone.
        self.single = self._steps[0][1] if len(in_types) == 1 else None

    def __call__(self, arrays: Sequence[jax.Array]) -> tuple[list[Any], Sequence[np.ndarray]]:
        """Each array's result (None where op has none), and the other results of
        the last message (a receive's status), as NumPy arrays: wrapping those as
        jax.Arrays costs as much as the rest of a small call, and most callers
        discard them."""
        results: list[Any] = [None] * len(arrays)
        rest: Sequence[np.ndarray] = ()
        for message, call, wraps in self._steps:
            if wraps is None:
                i = message.members[0]
                outputs = call(arrays[i])
                if outputs:
                    results[i], rest = outputs[0], outputs[1:]
                continue
            pieces = message.unpack(call(message.pack(arrays, np))[0])
            for i, wrap, piece in zip(message.members, wraps, pieces, strict=True):
                results[i] = wrap(piece)
        return results, rest


def map_call(op: EagerOp, arrays: Sequence[jax.Array], comm: Any, params: Params, fuse: bool):
    """The prepared MapCall of op on `arrays`, which are concrete and each on one
    CPU device (can_run)."""
    in_types = tuple((a.shape, a.dtype) for a in arrays)
    devices = tuple(_device(a.sharding) for a in arrays)
    return _prepared_calls.get_or_make(
        ("map", op, in_types, devices, comm, params, fuse),
        lambda: MapCall(op, in_types, devices, comm, params, fuse),
    )


# The shortcut for JaxComm's methods: a call on an array or a pytree of arrays
# that repeats an earlier one in everything its argument checks depend on (op,
# communicator, params, and the structure and each array's shape, dtype and
# placement) skips those checks and goes straight to the earlier call's
# preparation: for one array its EagerCall, for a pytree its MapCall. That saves
# most of a small call's cost.
def _array_key(op: EagerOp, x: ArrayImpl, comm: Any, params: Params) -> tuple:
    return ("again", op, x.shape, x.dtype, x.sharding, comm, params)


def _tree_key(op: EagerOp, tree: Any, leaves: list, comm: Any, params: Params) -> tuple:
    # A PyTreeDef third, where _array_key has a shape: the two never collide.
    leaf_types = [(a.shape, a.dtype, a.sharding) for a in leaves]
    return ("again", op, tree, *leaf_types, comm, params)


def again(op: EagerOp, x: Any, comm: Any, params: Params) -> tuple[Any, Sequence] | None:
    """(op's results on x now, in x's structure; the rest, as MapCall gives it) if
    `remember` has seen the same call and no trace is active; else None."""
    if type(x) is ArrayImpl:  # the common case, without flattening
        call = _prepared_calls.get(_array_key(op, x, comm, params))
        if call is None or not at_top_level():
            return None
        outputs = call(x)
        return (outputs[0], outputs[1:]) if outputs else (None, ())
    leaves, tree = jax.tree.flatten(x)
    if not all(type(a) is ArrayImpl for a in leaves):
        return None
    call = _prepared_calls.get(_tree_key(op, tree, leaves, comm, params))
    if call is None or not at_top_level():
        return None
    results, rest = call(leaves)
    return tree.unflatten(results), rest


def remember(op: EagerOp, x: Any, comm: Any, params: Params, fuse: bool) -> None:
    """Let calls like this one, on arrays which have just passed the method's checks
    and gone through op's MapCall, take `again`."""
    leaves, tree = jax.tree.flatten(x)
    if not (leaves and all(type(a) is ArrayImpl for a in leaves) and can_run(leaves)):
        return
    call = map_call(op, leaves, comm, params, fuse)
    if type(x) is ArrayImpl:
        _prepared_calls.put(_array_key(op, x, comm, params), call.single)
    else:
        _prepared_calls.put(_tree_key(op, tree, leaves, comm, params), call)


def remember_array(op: EagerOp, x: Any, comm: Any, params: Params, wrapped=None) -> None:
    """Let `again` take calls of op on arrays like x, which has just passed the
    method's checks: op's EagerCall, its first `wrapped` results jax.Arrays."""
    if type(x) is ArrayImpl and can_run([x]):
        call = _prepared(op, ((x.shape, x.dtype),), comm, params, _device(x.sharding), wrapped)
        _prepared_calls.put(_array_key(op, x, comm, params), call)


def _wrapper(shape: tuple[int, ...], dtype: np.dtype, device: Any) -> Callable:
    return _prepared_calls.get_or_make(
        ("wrap", shape, dtype, device), lambda: host_arrays(core.ShapedArray(shape, dtype), device)
    )


def as_array(values: np.ndarray, like: jax.Array) -> jax.Array:
    """NumPy `values` as a jax.Array on `like`'s (CPU) device, sharing their memory
    when it is aligned."""
    return _wrapper(values.shape, values.dtype, _device(like.sharding))(values)


def scalars(values: np.ndarray, like: jax.Array) -> list[jax.Array]:
    """The elements of 1-d `values` as 0-d arrays on `like`'s (CPU) device."""
    wrap = _wrapper((), values.dtype, _device(like.sharding))
    return [wrap(value) for value in values]
