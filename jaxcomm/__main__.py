"""``python -m jaxcomm --cmake-args``: CMake arguments for building a kernel against
jaxcomm (``-DJAXCOMM_INCLUDE_DIRS=... -DJAXCOMM_MPI_LIBRARY=...``);
``--cflags`` / ``--libs``: the same as compiler flags."""

import argparse

from jaxcomm import build_flags

parser = argparse.ArgumentParser(prog="python -m jaxcomm", description=__doc__)
group = parser.add_mutually_exclusive_group(required=True)
group.add_argument("--cmake-args", action="store_true")
group.add_argument("--cflags", action="store_true")
group.add_argument("--libs", action="store_true")
args = parser.parse_args()
flags = build_flags()
if args.cmake_args:
    print(
        f"-DJAXCOMM_INCLUDE_DIRS={';'.join(flags['include_dirs'])} "
        f"-DJAXCOMM_MPI_LIBRARY={flags['libraries'][0]}"
    )
elif args.cflags:
    print(" ".join(f"-I{d}" for d in flags["include_dirs"]))
else:
    print(" ".join(flags["libraries"]))
