import os

import pytest

# tests/mpi/ runs once per rank under mpiexec (see test_mpiexec.py); a plain
# pytest run launches it rather than collecting it directly.
if not os.environ.get("JAXCOMM_TEST_RANKS"):
    collect_ignore = ["mpi"]


@pytest.fixture(scope="session", autouse=True)
def sanitizer_build(request, tmp_path_factory):
    """test_sanitizer.py's build, started with the session's first test where
    that file's test is to run (SanitizedBuild says why), else None."""
    if not any(item.path.name == "test_sanitizer.py" for item in request.session.items):
        yield None
        return
    from test_sanitizer import SanitizedBuild

    build = SanitizedBuild(tmp_path_factory)
    yield build
    build.stop()
