"""Run the shallow-water benchmark on 1, 2, ... ranks and print a scaling table,
with the share of each step spent communicating (against --no-messages, the
same arithmetic without the halo exchange).

python examples/shallow_water_scaling.py --ranks 1 2 --nx 240 --ny 240 --days 0.5
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--nx", type=int, default=240)
    parser.add_argument("--ny", type=int, default=240)
    parser.add_argument("--days", type=float, default=0.5)
    args = parser.parse_args(argv)
    local = Path(sys.executable).with_name("mpiexec")
    mpiexec = str(local) if local.exists() else shutil.which("mpiexec")
    print(f"shallow water, {args.nx}x{args.ny} cells, {args.days:g} days")
    print(f"{'ranks':>5} {'steps/s':>10} {'speed-up':>9} {'efficiency':>11} {'communicating':>14}")
    base = None
    for n in args.ranks:
        rate, alone = (
            steps_per_second(mpiexec, n, args, flags) for flags in ([], ["--no-messages"])
        )
        base = base or rate * args.ranks[0]
        speedup = rate / base
        row = f"{n:>5} {rate:>10.1f} {speedup:>9.2f} {speedup / n:>11.0%} {1 - rate / alone:>14.0%}"
        print(row, flush=True)


def steps_per_second(mpiexec: str, n: int, args: argparse.Namespace, flags: list[str]) -> float:
    """The steps per second that shallow_water.py --benchmark reports on n ranks."""
    sizes = ["--nx", str(args.nx), "--ny", str(args.ny), "--days", str(args.days)]
    script = [sys.executable, str(HERE / "shallow_water.py"), "--benchmark", *sizes, *flags]
    command = [mpiexec, "-n", str(n), *script]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(re.search(r"([\d.]+) steps/s", output).group(1))


if __name__ == "__main__":
    main()
