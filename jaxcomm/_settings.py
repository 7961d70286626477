"""jaxcomm's environment variables, read once when jaxcomm is imported.

A value that is not one of those a variable accepts raises a ValueError naming the
variable, rather than silently meaning something else.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def flag(name: str, default: bool | None = False) -> bool | None:
    """1/0, true/false, yes/no or on/off in any case; unset or empty: `default`."""
    value = _raw(name).lower()
    if not value:
        return default
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(
        f"{name}={os.environ[name]!r}: expected 1/0, true/false, yes/no or on/off (any case)"
    )


def seconds(name: str) -> float:
    """A duration in seconds, at least 0; unset or empty: 0."""
    value = _raw(name)
    if not value:
        return 0.0
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{name}={os.environ[name]!r}: expected a number of seconds, 0 or more")
    return number


def choice(name: str, choices: Sequence[str]) -> str:
    """One of `choices` (any case); unset or empty: the first."""
    value = _raw(name).lower()
    if not value:
        return choices[0]
    if value in choices:
        return value
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)}")


#: JAXCOMM_CHECK: the default of JaxComm(check=...).
CHECK = bool(flag("JAXCOMM_CHECK"))
#: JAXCOMM_DEBUG: log every MPI call made by a handler.
DEBUG = bool(flag("JAXCOMM_DEBUG"))
#: JAXCOMM_TIMEOUT: seconds a call may wait before the watchdog aborts the job (0: never).
TIMEOUT = seconds("JAXCOMM_TIMEOUT")
#: JAXCOMM_CUDA_AWARE: hand device pointers to MPI (True), stage (False), or ask MPI (None).
CUDA_AWARE = flag("JAXCOMM_CUDA_AWARE", None)
#: JAXCOMM_EAGER: "direct" runs eager calls on host arrays directly; "jit" through JAX.
EAGER = choice("JAXCOMM_EAGER", ("direct", "jit"))
