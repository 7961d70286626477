"""Run a script with this rank's stdout in OUT_DIR/rank-N.txt (mpiexec may
interleave ranks' output at any point, even inside a line).

usage: python rank_output.py OUT_DIR SCRIPT [ARGS...]
"""

import os
import runpy
import sys

out_dir, script, *args = sys.argv[1:]
rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
sys.stdout = open(os.path.join(out_dir, f"rank-{rank}.txt"), "w", buffering=1)  # noqa: SIM115
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
