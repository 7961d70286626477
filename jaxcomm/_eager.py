"""The eager path: outside any trace, an operation on concrete host arrays runs
its host code directly, outside XLA.

Dispatching a primitive with an ordered effect through JAX costs a few hundred
microseconds per call (any effect takes a call off jit's C++ fast path, and an
ordered one also threads a runtime token); even `Primitive.bind` costs several,
so jaxcomm's dispatch looks for this case before binding (jaxcomm._dispatch).
jaxcomm instead waits for earlier jaxcomm work to finish (`jax.effects_barrier()`:
that keeps program order with jitted calls still running) and hands the arrays
to the same C++ function the FFI handler calls (cpp/eager.cc), which takes their
buffers through the buffer protocol (waiting for inputs that XLA is still
computing). Results are fresh arrays, never aliased with inputs. Set
``JAXCOMM_EAGER=jit`` to send eager calls through JAX's dispatch instead.

The interface, for blocking calls and posts alike:
- `can_run(arrays)`: whether these arrays can take this path;
- `run(primitive, leaves, ...)`: a pytree's leaves, small ones of one dtype as one
  message like a traced call; the call is remembered for `repeat`;
- `call(primitive, arrays, ...)`: one message, its results as NumPy arrays (a
  non-blocking start, which MPI writes until the wait; barrier);
- `repeat(primitive, leaves, tree, ...)`: a call like one that `run` (or `call`
  with `remember`) made after the method's checks passed, without those checks;
- `run_arrays` and `repeat_rows`: the same for an operation on x and count
  operands (the variable-size exchanges), whose counts' values may change
  between repeats (`rows_key`).

Everything fixed by a call's signature is prepared once, as a C++ EagerCall (or
a MapCall of them), in one bounded cache.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jaxcomm import _fusion, _settings
from jaxcomm._fusion import Params
from jaxcomm._jax_internals import ArrayImpl, at_top_level, host_arrays
from jaxcomm._native import cpu
from jaxcomm._placement import device, on_one_host_device

ENABLED = _settings.EAGER == "direct"
_CODES: dict[np.dtype, int] = {jnp.dtype(name): code for name, code in cpu.dtype_codes.items()}
_ALIGN = 64  # bytes: XLA's own alignment, and what lets host_arrays share the memory


def can_run(arrays: Sequence[Any]) -> bool:
    """Whether an operation on `arrays` can take the fast path: called outside
    any trace, on concrete arrays that each live on one CPU device."""
    if not ENABLED or not at_top_level():
        return False
    return all(type(a) is ArrayImpl and on_one_host_device(a.sharding) for a in arrays)


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


def _prepare(primitive: Any, in_types, comm, params: Params, where, wrapped) -> cpu.EagerCall:
    """primitive's call on arrays of `in_types` on device `where`, its first
    `wrapped` results jax.Arrays there (None: all), the rest NumPy arrays."""
    templates = len(in_types) - primitive.inputs  # a receive's template: not passed
    avals = [core.ShapedArray(shape, dtype) for shape, dtype in in_types]
    values = dict(params)
    outputs = [
        (
            _allocator(aval),
            _CODES[aval.dtype],
            host_arrays(aval, where) if wrapped is None or i < wrapped else None,
        )
        for i, aval in enumerate(primitive.result_types(*avals, comm=comm, **values))
    ]
    own = (v if isinstance(v, str) else int(v) for v in map(values.get, primitive.attrs))
    return cpu.EagerCall(
        primitive.operation,
        templates,
        [_CODES[dtype] for _, dtype in in_types[templates:]],
        outputs,
        (comm.key, comm.check, *own),
        before=jax.effects_barrier,
        fail=_fail,
    )


class _PreparedCalls:
    """The one cache of prepared calls (EagerCalls, MapCalls and repeat's),
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


_prepared_calls = _PreparedCalls(4096)


def _prepared(primitive, in_types, comm, params, where, wrapped) -> cpu.EagerCall:
    # On the per-call path (MapCall preparation, call): no closure to build.
    key = ("call", primitive, in_types, comm, params, where, wrapped)
    prepared = _prepared_calls.get(key)
    if prepared is None:
        prepared = _prepared_calls.put(
            key, _prepare(primitive, in_types, comm, params, where, wrapped)
        )
    return prepared


class MapCall:
    """A primitive on each array of a list, of fixed types on host devices,
    prepared once. Arrays that travel together (jaxcomm._fusion) are packed into
    one flat NumPy array and sent in one call; their results are pieces of its
    output, each on its array's device."""

    def __init__(self, primitive, in_types, devices, comm: Any, params: Params, fuse: bool):
        # (message, call, wraps): wraps, for a fused message, make each member's
        # piece a jax.Array on its device.
        self._steps: list[tuple[_fusion.Message, cpu.EagerCall, list | None]] = []
        for message in _fusion.messages(in_types, fuse):
            first, own = message.members[0], _fusion.message_params(params, message)
            if not message.fused:
                one = in_types[first : first + 1]
                prepared = _prepared(primitive, one, comm, own, devices[first], 1)
                self._steps.append((message, prepared, None))
                continue
            dtype = in_types[first][1]
            wraps = [
                host_arrays(core.ShapedArray(shape, dtype), devices[i])
                for i, shape in zip(message.members, message.shapes, strict=True)
            ]
            # Its one result stays NumPy (wrapped=0), so the device is not used.
            flat = (((message.size,), dtype),)
            prepared = _prepared(primitive, flat, comm, own, devices[first], 0)
            self._steps.append((message, prepared, wraps))
        # The EagerCall of a map of one array, which always travels alone.
        self.single = self._steps[0][1] if len(in_types) == 1 else None

    def __call__(self, arrays: Sequence[jax.Array]) -> tuple[list[Any], Sequence[np.ndarray]]:
        """Each array's result (None where the primitive has none), and the other
        results of the last message (a receive's status), as NumPy arrays:
        wrapping those as jax.Arrays costs as much as the rest of a small call,
        and most callers discard them.

        A message that fails does not stop the others, which the peers send and
        receive all the same: the first error is raised after the last message
        (jaxcomm._lockstep)."""
        results: list[Any] = [None] * len(arrays)
        rest: Sequence[np.ndarray] = ()
        error = None
        for message, prepared, wraps in self._steps:
            try:
                if wraps is None:
                    i = message.members[0]
                    outputs = prepared(arrays[i])
                    if outputs:
                        results[i], rest = outputs[0], outputs[1:]
                    continue
                pieces = message.unpack(prepared(message.pack(arrays, np))[0])
            except jax.errors.JaxRuntimeError as failed:
                error = error or failed
                continue
            for i, wrap, piece in zip(message.members, wraps, pieces, strict=True):
                results[i] = wrap(piece)
        if error is not None:
            raise error
        return results, rest


#: The structure of a lone array, which jaxcomm._dispatch does not flatten.
ONE_ARRAY = jax.tree.structure(0)


# `repeat`'s keys: a call on an array or a pytree of arrays that repeats an
# earlier one in everything the method's argument checks depend on (operation,
# communicator, params, and the structure and each array's shape, dtype and
# placement) skips those checks and goes straight to the earlier call's
# preparation: for one array its EagerCall, for a pytree its MapCall. That saves
# most of a small call's cost.
def _repeat_key(primitive, leaves: Sequence[Any], tree: Any, comm, params: Params) -> tuple:
    if tree is ONE_ARRAY:
        (x,) = leaves
        return ("repeat", primitive, x.shape, x.dtype, x.sharding, comm, params)
    # A PyTreeDef third, where one array has a shape: the two never collide.
    types = [(a.shape, a.dtype, a.sharding) for a in leaves]
    return ("repeat", primitive, tree, *types, comm, params)


def repeat(primitive, leaves: Sequence[Any], tree: Any, comm, params: Params) -> Any:
    """(the results now, in the structure `tree`; the rest of the last message) of
    a call that `run` has made after the checks passed; None if there was none
    like it, or a trace is active."""
    if tree is ONE_ARRAY:  # the common case, on the shortest way (a jax.Array: flatten)
        x = leaves[0]
        key = ("repeat", primitive, x.shape, x.dtype, x.sharding, comm, params)
        prepared = _prepared_calls.get(key)
        if prepared is None or not at_top_level():
            return None
        outputs = prepared(x)
        return (outputs[0], outputs[1:]) if outputs else (None, ())
    if not all(type(a) is ArrayImpl for a in leaves):
        return None
    prepared = _prepared_calls.get(_repeat_key(primitive, leaves, tree, comm, params))
    if prepared is None or not at_top_level():
        return None
    results, rest = prepared(leaves)
    return tree.unflatten(results), rest


def run(primitive, leaves: Sequence[Any], tree, comm, params: Params, fuse: bool):
    """(each leaf's first result, the rest of the last message) of primitive on
    `leaves` (concrete, each on one CPU device: can_run), small leaves of one
    dtype as one message with `fuse`. A later call like it may `repeat` it."""
    in_types = tuple((a.shape, a.dtype) for a in leaves)
    devices = tuple(device(a.sharding) for a in leaves)
    mapped = _prepared_calls.get_or_make(
        ("map", primitive, in_types, devices, comm, params, fuse),
        lambda: MapCall(primitive, in_types, devices, comm, params, fuse),
    )
    if leaves:
        key = _repeat_key(primitive, leaves, tree, comm, params)
        _prepared_calls.put(key, mapped.single if tree is ONE_ARRAY else mapped)
    return mapped(leaves)


def call(
    primitive, arrays: Sequence[Any], comm, params: Params, remember=False, key: Any = None
) -> list:
    """primitive's results on `arrays` (concrete, on one CPU device: can_run) in
    one message, as NumPy arrays: a non-blocking start's, which MPI writes until
    the wait. With `remember`, a later call on an array like arrays[0] (the whole
    of what the method was given) may `repeat` it; with `key` (rows_key), a later
    call with the same key may `repeat_rows` it."""
    in_types = tuple((a.shape, a.dtype) for a in arrays)
    prepared = _prepared(primitive, in_types, comm, params, None, 0)  # NumPy: no device
    if remember:
        _prepared_calls.put(_repeat_key(primitive, arrays, ONE_ARRAY, comm, params), prepared)
    if key is not None:
        _prepared_calls.put(key, prepared)
    return prepared(*arrays)


# The variable-size exchanges (alltoallv, allgatherv, ...) take x and count
# operands, each passed as it is: their shortcut. A call that repeats an earlier
# one in x's shape, dtype and placement, the communicator, the (checked) params
# and the kind of each count operand, but not the counts' values, takes the
# earlier call's EagerCall without the checks of those kinds; the counts' values
# are validated in C++ on every call (cpp/counts.h), as on every path.
_INT64 = range(-(2**63), 2**63)


def rows_key(primitive, x: Any, counts: Iterable[Any], comm, params: dict[str, Any]):
    """(repeat_rows's key, the count operands it passes) of `primitive` on rows x
    with count operands `counts` as the caller passed them; (None, None) where
    they cannot repeat: x not a jax.Array, or a count that the key cannot tell
    how jaxcomm._checks.counts would pass (a NumPy array not C-contiguous in
    native byte order, Python ints beyond int64, anything but integer arrays,
    integers and lists or tuples of Python ints)."""
    if type(x) is not ArrayImpl or not ENABLED:
        return None, None
    key: list[Any] = ["rows", primitive, x.shape, x.dtype, x.sharding, comm, *params.items()]
    operands = []
    for count in counts:  # each count's kind, and the array _checks.counts makes of it
        kind = type(count)
        if kind is np.ndarray:
            if not (count.flags.c_contiguous and count.dtype.isnative):
                return None, None
            key.append((count.dtype, count.shape))
        elif kind is ArrayImpl:
            if count.is_deleted():  # the full path's checks name it
                return None, None
            key.append((count.dtype, count.shape, count.sharding))
        elif kind is int:
            if count not in _INT64:
                return None, None
            key.append(kind)
            count = np.array(count, np.int64)
        elif kind is list or kind is tuple:  # of Python ints: int64
            if not all(type(c) is int and c in _INT64 for c in count):
                return None, None
            key.append((kind, len(count)))
            count = np.array(count, np.int64)
        elif isinstance(count, np.integer):
            key.append(kind)
            count = np.asarray(count)
        else:
            return None, None
        operands.append(count)
    return tuple(key), operands


def repeat_rows(key: Any, x: jax.Array, operands: Sequence[Any]) -> list[Any] | None:
    """The results now of a variable-size exchange on x and count `operands`
    that run_arrays (or, for a start, call) made with the same `key` (rows_key)
    after its checks passed; None if there was none like it, or a trace is
    active."""
    prepared = None if key is None else _prepared_calls.get(key)
    if prepared is None or not at_top_level():
        return None
    return prepared(x, *operands)


def run_arrays(primitive, arrays: Sequence[Any], comm, params: Params, key: Any = None) -> list:
    """primitive's results on `arrays`, its operands as they are (jax.Arrays on one
    CPU device, the first among them, and NumPy arrays: can_run), each a
    jax.Array on the first's device. A later call with the same `key`
    (rows_key) may `repeat_rows` it."""
    in_types = tuple((a.shape, a.dtype) for a in arrays)
    prepared = _prepared(primitive, in_types, comm, params, device(arrays[0].sharding), None)
    if key is not None:
        _prepared_calls.put(key, prepared)
    return prepared(*arrays)


@functools.lru_cache(maxsize=256)
def _wrapper(shape: tuple[int, ...], dtype: np.dtype, where: Any) -> Callable:
    return host_arrays(core.ShapedArray(shape, dtype), where)


def as_array(values: np.ndarray, like: jax.Array) -> jax.Array:
    """NumPy `values` as a jax.Array on `like`'s (CPU) device, sharing their memory
    when it is aligned."""
    return _wrapper(values.shape, values.dtype, device(like.sharding))(values)


def scalars(values: np.ndarray, like: jax.Array) -> list[jax.Array]:
    """The elements of 1-d `values` as 0-d arrays on `like`'s (CPU) device."""
    wrap = _wrapper((), values.dtype, device(like.sharding))
    return [wrap(value) for value in values]
