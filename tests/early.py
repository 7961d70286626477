"""Work that the session starts once its tests are collected, in the background
at the lowest CPU priority, for tests that come later to take.

Most tests leave a core idle for part of their time: one rank's run, a rank
waiting for its peer, a program starting. Jobs run one after another in a
thread of their own under Linux's SCHED_IDLE policy (a thread's, inherited by
the processes it starts), so they take only what the tests leave: a test's
process that wakes takes the core from them at once, and while other work
wants every core they get none (at nice 19 they would still get a share). A test
that needs a job's result takes it if the job has finished, and otherwise
stops it and does the work itself at normal priority, as if it had never been
started: a busy machine never waits for a job that the tests starve.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: A job's work: its result, given an Event that, once set, asks it to stop
#: soon (its processes killed) and return anything.
Work = Callable[[threading.Event], Any]


@dataclass
class _Job:
    work: Work
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    result: Any = None


_jobs: dict[str, _Job] = {}
_lock = threading.Lock()  # between a job's start and its stop


def start(jobs: dict[str, Work]) -> None:
    """Run `jobs` one after another in the background, in the given order."""
    chosen = {name: _Job(work) for name, work in jobs.items()}
    if not chosen or not hasattr(os, "SCHED_IDLE"):  # not Linux: the tests do it all
        return
    _jobs.update(chosen)
    threading.Thread(target=_run, args=(list(chosen.values()),), daemon=True).start()
    atexit.register(stop_all)


def _run(jobs: list[_Job]) -> None:
    os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    for job in jobs:
        with _lock:
            job.started = not job.stop.is_set()
        try:
            if job.started:
                job.result = job.work(job.stop)
        except Exception as error:  # the test doing the work itself will meet it
            job.result = error
        finally:
            job.done.set()


def take(name: str) -> Any | None:
    """Job `name`'s result if it finished (without being stopped), else None:
    the job, if started, is stopped and the caller does the work itself."""
    job = _jobs.pop(name, None)
    if job is None:
        return None
    with _lock:
        finished, started = job.done.is_set(), job.started
        job.stop.set()
    if not finished:
        if started:  # its processes are being killed: let them go first
            job.done.wait()
        return None
    return None if isinstance(job.result, Exception) else job.result


def stop_all() -> None:
    """Stop every job not taken (the session ends): their processes are killed."""
    jobs = list(_jobs.values())
    _jobs.clear()
    for job in jobs:
        with _lock:
            job.stop.set()
    for job in jobs:
        if job.started:
            job.done.wait(timeout=30)
