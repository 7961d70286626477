import os

# tests/mpi/ runs once per rank under mpiexec (see test_mpiexec.py); a plain
# pytest run launches it rather than collecting it directly.
if not os.environ.get("JAXCOMM_TEST_RANKS"):
    collect_ignore = ["mpi"]


def pytest_collection_finish(session):
    """Starts, in the background, what later tests will take (early.py)."""
    if os.environ.get("JAXCOMM_TEST_RANKS"):
        return
    import early
    import test_mpiexec
    import test_sanitizer

    chosen = {item.name for item in session.items}
    early.start({**test_mpiexec.early_jobs(chosen), **test_sanitizer.early_jobs(chosen)})


def pytest_unconfigure(config):
    # Before the temporary folders they write in are removed at exit.
    import early

    early.stop_all()
