"""bench/: the table writer on made-up numbers, and one short measuring job end to end."""
import json

import pytest

from bench import report
from harness import launch, last_json


def case(label, tags, seconds, **result):
    return {"label": label, "tags": tags,
            "result": {"step_time_s": sorted(seconds)[len(seconds) // 2], "step_time_s_rounds": seconds,
                       **result}}


def runs(ddp_seconds):
    """One data-parallel job at N = 2 and a scaling job at N = 4, as bench/run.py records them."""
    dp = {"group": "dp", "ranks": 2, "env": {}, "error": None, "load": [1.0, 1.5], "result": {
        "steps": 12, "rounds": 3, "mpi_library": "MPICH", "config": {"batch_size": 64}, "cases": [
            case("data_parallel.py", {"kind": "strategy", "variant": "default", "scaling": True},
                 [0.010, 0.011, 0.012], buckets=1, comm_s=0.002, losses=[2.3, 2.1]),
            case("PyTorch DDP (gloo)", {"kind": "peer", "variant": "ddp"}, ddp_seconds, losses=[2.3, 2.1]),
            case("no exchange (compute alone)", {"kind": "floor"}, [0.008, 0.008, 0.009]),
            case("bare MPI Allreduce of the gradients", {"kind": "limit", "variant": "mpi"}, [0.0005],
                 bytes=247960),
            {"label": "bare gloo allreduce of the gradients", "tags": {"kind": "limit", "variant": "gloo"},
             "result": {"error": "gloo is not built into this torch"}}]}}
    scaling = {"group": "scaling", "ranks": 4, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 8, "rounds": 3, "cases": [
            case("data_parallel.py", {"kind": "strategy", "n": n, "threads": t}, [s, s, s])
            for n, t, s in ((1, 1, 0.020), (1, 2, 0.015), (2, 1, 0.011), (4, 1, 0.012))]}}
    return [dp, scaling]


META = {"mode": "full", "command": "python bench/run.py", "date": "today", "torch": "2",
        "seconds": 1.0, "missing": ["model_parallel"],
        "machine": {"cpu": "a CPU", "cores": 2, "load": 1.0, "python": "3"}}


@pytest.mark.parametrize("ddp_seconds,verdict", [
    ([0.020, 0.021, 0.022], "data_parallel.py is faster than PyTorch DDP (gloo)"),
    ([0.005, 0.006, 0.007], "PyTorch DDP (gloo) is faster than data_parallel.py"),
    ([0.005, 0.021, 0.022], "no clear winner between data_parallel.py and PyTorch DDP (gloo)")])
def test_the_findings_name_whichever_is_faster_when_the_rounds_agree(ddp_seconds, verdict):
    assert verdict in report.render(META, runs(ddp_seconds))


def test_every_gap_says_why_and_oversubscription_is_marked():
    text = report.render(META, runs([0.020, 0.021, 0.022]))
    assert "not measured: gloo is not built into this torch" in text
    assert "Not in the repository when this ran, so not measured: model_parallel.py." in text
    assert "N = 4 †" in text and "N = 2, 1 thread per rank" in text
    # Paired round by round: 0.010/0.020, 0.011/0.021, 0.012/0.022 -> median 0.52; exchange 2 ms,
    # 4 times the bare allreduce's 0.5 ms; step minus compute alone: 10 - 8, 11 - 8, 12 - 9 ms.
    assert "| 0.52× (0.50–0.55) | 2.0 | 4.0× | 3.0 (2.0 to 3.0) |" in text
    # Speedup against one rank on one thread: 0.020/0.011 = 1.82 at N = 2, efficiency 91%.
    assert "11.0 (11.0–11.0), 1.82×, 91%" in text


@pytest.mark.e2e
def test_a_short_data_parallel_job_measures_every_case_and_ddp_trains_the_same_model():
    out = launch("bench/worker.py", 2, "dp", "--rounds", "1", "--steps", "3", "--collective-reps", "3")
    result = last_json(out)["groups"]["dp"]
    cases = {c["label"]: c["result"] for c in result["cases"]}
    assert all("error" not in r for r in cases.values()), json.dumps(cases)[:2000]
    ours, ddp = cases["data_parallel.py"]["losses"], cases["PyTorch DDP (gloo)"]["losses"]
    assert max(abs(a - b) for a, b in zip(ours, ddp)) < 1e-5
