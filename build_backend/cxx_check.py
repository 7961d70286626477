"""Is there a C++20 compiler, as CMake will find it? Checked before anything is built."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

# The C++20 that jaxcomm's sources use (GCC 11 and newer have all of it).
PROBE = """
#include <bit>
#include <cstdint>
#include <memory>
#include <ranges>
#include <span>
#include <stdexcept>
#include <vector>
#if __cplusplus < 202002L
#error "not C++20"
#endif
// A class hierarchy and the standard library: linking them needs the C++
// runtime, which a C compiler driver (CXX=gcc) leaves out.
struct Failed : std::runtime_error {
  using std::runtime_error::runtime_error;
};
extern "C" int jaxcomm_probe() {
  std::vector<int> v{1, 2, 3};
  std::erase_if(v, [](int x) { return x == 2; });
  auto p = std::make_unique_for_overwrite<char[]>(4);
  std::span<int> s(v);
  if (std::ranges::size(s) != 2) throw Failed("probe");
  return std::bit_cast<std::uint32_t>(1.0f) == 0 || !p;
}
"""

FIX = (
    "jaxcomm needs a C++20 compiler (GCC 11 or newer, or a Clang of the same age): install "
    "one (Debian, Ubuntu: apt-get install g++; a cluster: module load gcc) or set CXX to it. "
    "A binary jaxcomm wheel needs no compiler (docs/installation.md)."
)


class CompilerError(RuntimeError):
    """No C++ compiler, or one too old for jaxcomm."""


def compiler() -> list[str]:
    """The C++ compiler as CMake picks it: $CXX, else the first of c++, g++, clang++."""
    if os.environ.get("CXX"):
        command = shlex.split(os.environ["CXX"])
        if not command or not shutil.which(command[0]):
            raise CompilerError(f"CXX={os.environ['CXX']} is not a program. {FIX}")
        return command
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return [name]
    raise CompilerError(f"No C++ compiler on PATH (no c++, g++ or clang++). {FIX}")


def check() -> list[str]:
    """The compiler, once it has built PROBE in C++20 into a shared library with
    every symbol resolved, as jaxcomm's extension is built; else CompilerError."""
    cxx = compiler()
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "probe.cc"
        source.write_text(PROBE)
        library = Path(folder) / "probe.so"
        command = [*cxx, "-std=c++20", "-shared", "-fPIC", "-Wl,--no-undefined"]
        done = subprocess.run(
            [*command, str(source), "-o", str(library)], capture_output=True, text=True
        )
    if done.returncode != 0:
        errors = "\n".join(done.stderr.strip().splitlines()[:8])
        raise CompilerError(
            f"{' '.join(cxx)} cannot compile and link jaxcomm's C++20 (a C compiler, such "
            f"as CXX=gcc, leaves out the C++ runtime):\n{errors}\n{FIX}"
        )
    return cxx
