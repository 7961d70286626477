"""Where an array lives: the platforms and device of its sharding, cached
(a program uses few shardings, and the eager path asks on every call)."""

from __future__ import annotations

import functools
from typing import Any

import jax


@functools.lru_cache(maxsize=256)
def _placement(sharding: jax.sharding.Sharding) -> tuple[frozenset[str], Any]:
    devices = sharding.device_set
    device = next(iter(devices)) if len(devices) == 1 else None
    return frozenset(d.platform for d in devices), device


def platforms(sharding: jax.sharding.Sharding) -> frozenset[str]:
    """The platforms ("cpu", "gpu", ...) of the devices an array is on."""
    return _placement(sharding)[0]


def device(sharding: jax.sharding.Sharding) -> Any:
    """The device of an array on one device, else None."""
    return _placement(sharding)[1]


def on_one_host_device(sharding: jax.sharding.Sharding) -> bool:
    """Whether an array is on one CPU device."""
    kinds, one = _placement(sharding)
    return one is not None and kinds == {"cpu"}
