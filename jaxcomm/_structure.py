"""Checking mode's test that every rank gives a collective a pytree of the same
structure. A pytree's leaves travel as messages of their own, paired across
ranks by position: a rank with a leaf more, or its leaves in another order,
would pair them with its peers' next call, silently where the shapes agree.

The structure compared is the leaves' paths (`jax.tree_util.keystr`): which
leaf pairs with which. A lone array has none to compare and costs nothing
more: a peer that gives the same operation a pytree makes the check where this
rank makes the operation, and the fingerprints differ. Point-to-point calls
are left to their messages' headers: a pytree's structure is not compared there.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax

from jaxcomm._eager import ONE_ARRAY
from jaxcomm._primitive import CommPrimitive, comm_primitive

check_structure_p = comm_primitive("check_structure", lambda **_: [])


def compared(primitive: CommPrimitive, tree: Any) -> bool:
    """Whether `primitive` on a pytree of structure `tree` has its structure
    compared: a collective on more than a lone array."""
    lone = tree is ONE_ARRAY or tree.num_nodes == 1
    return not lone and not {"dest", "source"} & primitive.params.keys()


def describe(x: Any) -> str:
    """x's leaves' paths after their number and a digest of them, which still
    shows where two descriptions cut to fit a line differ:
    "2 leaves #1a2b3c4d: ['b'], ['w']"."""
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(x)]
    text = ", ".join(paths)
    digest = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    return f"{len(paths)} {'leaf' if len(paths) == 1 else 'leaves'} #{digest}: {text}"
