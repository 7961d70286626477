import os

# tests/mpi/ runs once per rank under mpiexec (see test_mpiexec.py); a plain
# pytest run launches it rather than collecting it directly.
if not os.environ.get("JAXCOMM_TEST_RANKS"):
    collect_ignore = ["mpi"]
