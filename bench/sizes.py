"""Message sizes as the benchmark tables print them (no MPI: compare.py uses it)."""


def human(nbytes: int) -> str:
    """4 B, 64 KiB, 16 MiB."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024 or unit == "MiB":
            return f"{nbytes:g} {unit}"
        nbytes //= 1024
    raise AssertionError
