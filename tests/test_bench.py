"""The benchmark suite keeps working: a tiny run of each script under mpiexec.
Nothing is timed here; the scripts check every backend's results themselves."""

import json
from pathlib import Path

from mpirun import run

BENCH = Path(__file__).parent.parent / "bench"
# Each tiny run takes well under a minute on a loaded 2-core machine; one that
# takes ten is hung (a benchmark whose ranks disagree on a count waits forever).
HANG = 600


def test_latency_suite_checks_and_records_every_backend(tmp_path):
    args = [
        str(BENCH / "run.py"),
        "--quick",
        "--max-bytes",
        "16",  # two sizes: the loop over sizes, at half the cases of three
        "--reps",
        "1",
        "--out",
        str(tmp_path),
        "--backends",
        "C,mpi4py,jaxcomm-jit,jaxcomm-jit-live,jaxcomm-eager,jaxcomm-jit-check",
    ]
    result = run(2, args, timeout=HANG)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (tmp_path / "latency.jsonl").read_text().splitlines()]
    blocking = {"allreduce", "bcast", "sendrecv", "alltoall", "allgather", "reduce_scatter", "scan"}
    ops = blocking | {"i" + op for op in blocking - {"scan"}}
    ops |= {"alltoallv", "alltoallv_skew", "allgatherv", "neighbor", "halo"}
    ops |= {"graph_alltoallv", "graph_dense", "graph_sendrecv"}
    backends = {
        "C",
        "mpi4py",
        "jaxcomm-jit",
        "jaxcomm-jit-live",
        "jaxcomm-eager",
        "jaxcomm-jit-check",
    }
    assert {(r["op"], r["backend"]) for r in records} == {(o, b) for o in ops for b in backends}
    assert {r["bytes"] for r in records} == {4, 16}
    bad = [r for r in records if not r["median_us"] > 0]
    assert not bad, bad
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"


def test_mlp_workload(tmp_path):
    args = [str(BENCH / "mlp.py"), "--steps", "2", "--steps-per-call", "2", "--reps", "1"]
    result = run(2, [*args, "--out", str(tmp_path)], timeout=HANG)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (tmp_path / "mlp.jsonl").read_text().splitlines()]
    timed = {(r["backend"], r["steps_per_call"]) for r in records if r["median_ms"] > 0}
    assert {(name, k) for name in ("no-communication", "jaxcomm") for k in (1, 2)} <= timed


def test_dispatch_costs(tmp_path):
    args = [str(BENCH / "dispatch.py"), "--reps", "1", "--min-time", "0.001"]
    result = run(2, [*args, "--out", str(tmp_path)], timeout=HANG)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (tmp_path / "dispatch.jsonl").read_text().splitlines()]
    assert {"no-communication", "jaxcomm", "jaxcomm.jit"} <= {r["backend"] for r in records}
    assert all(r["median_us"] > 0 for r in records)
    result = run(1, [*args, "--attribute", "--out", str(tmp_path)], timeout=HANG)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (tmp_path / "dispatch-attribution.jsonl").read_text().splitlines()
    timed = {json.loads(line)["function"] for line in lines}
    assert {"total", "RuntimeTokenSet.get_token_input"} <= timed


def test_jax_collectives_beside_jaxcomm(tmp_path):
    """JAX's own collectives (gloo, through shard_map over the processes) and
    jaxcomm per jitted call, checked against NumPy like every backend."""
    backends = ["jaxcomm-jit", "jaxcomm-jax.jit", "jaxcomm-jaxcomm.jit", "gloo-jit", "gloo-jax.jit"]
    ops = ["allreduce", "allgather", "alltoall", "sendrecv", "reduce_scatter"]
    args = [str(BENCH / "run.py"), "--quick", "--max-bytes", "16", "--reps", "1", "--no-plot"]
    args += ["--ops", ",".join(ops), "--backends", ",".join(backends), "--out", str(tmp_path)]
    result = run(2, args, timeout=HANG)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (tmp_path / "latency.jsonl").read_text().splitlines()]
    assert {(r["op"], r["backend"]) for r in records} == {(o, b) for o in ops for b in backends}
    assert all(r["median_us"] > 0 for r in records)
    assert "jaxcomm-jit / gloo-jit:" in result.stdout
