"""The ranks of a run compile each of their programs once between them.

Most of the suite's time is XLA compiling thousands of small programs, and the
ranks of a run mostly compile the same ones at the same moment: on more ranks
than cores, each such compile takes a core from the rank that would otherwise
run. So every rank of the session's runs uses one folder of JAX's persistent
compilation cache (test_mpiexec.py's xla_cache), and the first rank to miss a
program claims it, compiles it and writes it, while the others wait for the
claim to go and load what it wrote.

A claim is a file created under an exclusive lock (flock), which the kernel
releases if its process ends: a rank that dies while compiling stops no other,
which then compiles the program itself. A rank never reads an entry while its
claim is held, so never one half written. Programs with host callbacks are
never written to the cache, so none is claimed.

This leans on two private functions of jax._src.compiler. Where they are not as
expected (another JAX), each rank keeps a folder of its own instead, which still
serves the session's later runs."""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import os
from pathlib import Path

import jax

# The parameters of jax._src.compiler._compile_and_write_cache that this module
# reads; _cache_read's must be among them (it reads again after a wait).
_NEEDED = ("cache_key", "host_callbacks")


def start(folder: str, rank: int) -> None:
    """Use JAX's persistent cache in `folder`: shared by the ranks where this
    JAX allows it, else in a folder of rank `rank`'s own."""
    from jax._src import compiler

    read, compile_ = compiler._cache_read, compiler._compile_and_write_cache
    read_signature, compile_signature = inspect.signature(read), inspect.signature(compile_)
    read_names = list(read_signature.parameters)
    shared = {*_NEEDED, *read_names} <= set(compile_signature.parameters)
    jax.config.update("jax_compilation_cache_dir", folder if shared else f"{folder}/rank{rank}")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if not shared:
        return
    claims = Path(folder, "claims")
    claims.mkdir(parents=True, exist_ok=True)

    def cache_read(*args, **kwargs):
        found = read_signature.bind(*args, **kwargs).arguments
        _wait_for(claims / found["cache_key"])
        return read(*args, **kwargs)

    def compile_and_write_cache(*args, **kwargs):
        found = compile_signature.bind(*args, **kwargs).arguments
        if found["host_callbacks"]:
            return compile_(*args, **kwargs)
        with _claim(claims / found["cache_key"]) as ours:
            if ours:
                return compile_(*args, **kwargs)
        executable, _ = read(**{name: found[name] for name in read_names})
        return executable if executable is not None else compile_(*args, **kwargs)

    compiler._cache_read = cache_read
    compiler._compile_and_write_cache = compile_and_write_cache


@contextlib.contextmanager
def _claim(path: Path):
    """Yields True while this process holds the claim `path` (it compiles and
    writes the program), or False once another's claim has gone."""
    staged = path.with_name(f"{path.name}.{os.getpid()}")
    fd = os.open(staged, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        # Locked before it is visible as the claim: a waiter never finds it free.
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            os.link(staged, path)
        except FileExistsError:
            ours = False
        else:
            ours = True
        os.unlink(staged)
        if not ours:
            _wait_for(path)
            yield False
            return
        try:
            yield True
        finally:
            # Gone before the lock is released: a waiter then finds the entry.
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _wait_for(path: Path) -> None:
    """Until the claim `path` is released (at once if there is none), asleep."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)
