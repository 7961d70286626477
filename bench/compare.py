"""Compare jaxcomm with mpi4jax across runs of bench/run.py.

    python bench/compare.py BEFORE.jsonl AFTER.jsonl [MORE.jsonl ...]

Prints a Markdown table of every (op, size, form) where jaxcomm was more than
5% slower than mpi4jax in the same form (jit, or jit-live: x still used after
the call) in the first run, with jaxcomm / mpi4jax in each run (each ratio
within one job, so runs on different days compare).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sizes import human

SLOWER = 1.05  # beyond the run-to-run noise of a ratio measured side by side


def medians(path: Path) -> dict[tuple[str, int, str], float]:
    """(op, bytes, backend) -> median µs per call."""
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {(r["op"], r["bytes"], r["backend"]): r["median_us"] for r in rows}


def ratio(run: dict, op: str, nbytes: int, form: str) -> float | None:
    ours, theirs = (
        run.get((op, nbytes, f"jaxcomm-{form}")),
        run.get((op, nbytes, f"mpi4jax-{form}")),
    )
    return None if ours is None or theirs is None else ours / theirs


def table(paths: list[Path]) -> str:
    runs = [medians(path) for path in paths]
    header = "| op | size | form | " + " | ".join(path.stem for path in paths) + " |"
    lines = [header, "|---|---|---|" + "---|" * len(paths)]
    cells = sorted(
        {(op, n, b.removeprefix("jaxcomm-")) for op, n, b in runs[0] if b.startswith("jaxcomm-")}
    )
    for op, nbytes, form in cells:
        first = ratio(runs[0], op, nbytes, form)
        if first is None or first <= SLOWER:
            continue
        ratios = [ratio(run, op, nbytes, form) for run in runs]
        shown = " | ".join("—" if r is None else f"{r:.2f}x" for r in ratios)
        lines.append(f"| {op} | {human(nbytes)} | {form} | {shown} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    print(table([Path(p) for p in sys.argv[1:]]))
