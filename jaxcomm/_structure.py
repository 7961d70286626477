"""Checking mode's test that every rank gives a collective a pytree of the same
structure. A pytree's leaves travel as messages of their own, paired across
ranks by position: a rank with a leaf more, or its leaves in another order,
would pair them with its peers' next call, silently where the shapes agree.

What is compared says which leaf pairs with which: the leaves' paths, and the
static data of the nodes (a custom node without keys flattens in an order its
static data may decide). Both are written out the same way in every process
(`_plain`): keys that Python holds equal (0, np.int64(0), False) read alike,
and a value whose text may differ between processes (an object's address, a
set's order) is written as what all such values share. A lone array has no
structure to compare and costs nothing more: a peer that gives the operation a
pytree makes the check where this rank makes the operation, and the
fingerprints differ. Point-to-point calls are left to their messages' headers.
"""

from __future__ import annotations

import enum
import hashlib
import numbers
from typing import Any

import jax
import numpy as np

from jaxcomm._eager import ONE_ARRAY
from jaxcomm._primitive import CommPrimitive, comm_primitive

check_structure_p = comm_primitive("check_structure", lambda **_: [])

# Of the paths, as many characters as the error's line shows (call.cc cuts a
# call's description to 160): the digest stands for the rest.
_SHOWN = 100

_tree = jax.tree_util


def compared(primitive: CommPrimitive, tree: Any) -> bool:
    """Whether `primitive` on a pytree of structure `tree` has its structure
    compared: a collective on anything but one array (a pytree, or none)."""
    lone = tree is ONE_ARRAY or (tree.num_leaves == 1 and tree.num_nodes == 1)
    return not lone and not {"dest", "source"} & primitive.params.keys()


def describe(x: Any, tree: Any) -> str:
    """What every rank's pytree x (of structure `tree`) must agree on: the number
    of its leaves, a digest of their paths and of its nodes' static data, and
    the paths as far as a line shows them: "2 leaves #1a2b3c4d: ['b'], ['w']"."""
    paths = ["".join(map(_key, path)) for path, _ in _tree.tree_leaves_with_path(x)]
    text = ", ".join(paths)
    static = ";".join(_static(tree))
    digest = hashlib.blake2b(f"{text}|{static}".encode(), digest_size=4).hexdigest()
    if len(text) > _SHOWN:
        text = text[:_SHOWN].rsplit(", ", 1)[0] + ", ..."
    counted = f"{len(paths)} {'leaf' if len(paths) == 1 else 'leaves'} #{digest}"
    return f"{counted}: {text}" if text else counted


def _key(key: Any) -> str:
    if isinstance(key, _tree.DictKey):
        return f"[{_plain(key.key)}]"
    if isinstance(key, _tree.GetAttrKey):
        return f".{key.name}"
    if isinstance(key, _tree.SequenceKey):
        return f"[{key.idx}]"
    if isinstance(key, _tree.FlattenedIndexKey):
        return f"[{key.key}]"
    return _plain(key)


def _static(tree: Any) -> list[str]:
    """Each node's static data (a dict's keys, a custom node's aux data), in order."""
    found = []
    stack = [tree]
    while stack:
        node = stack.pop()
        data = node.node_data()
        if data is not None:
            found.append(_plain(data[1]))
            stack.extend(reversed(node.children()))
    return found


def _plain(value: Any) -> str:
    """value as text that is the same in every process for values Python holds
    equal; "?" for one whose text may differ between processes."""
    if value is None or isinstance(value, str | bytes):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, numbers.Number | np.generic):
        number = complex(value)  # keys equal as numbers read alike: 1, 1.0, True
        if number.imag:
            return repr(number)
        return str(int(number.real)) if float(number.real).is_integer() else repr(number.real)
    if isinstance(value, tuple | list):
        return "(" + ",".join(map(_plain, value)) + ")"
    if isinstance(value, frozenset | set):
        return "{" + ",".join(sorted(map(_plain, value))) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(sorted(f"{_plain(k)}:{_plain(v)}" for k, v in value.items())) + "}"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return "?"
