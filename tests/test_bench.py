"""bench/: the table writer and the pictures on made-up numbers, and one short measuring job end to end."""
import importlib
import json
import sys

import pytest

from bench import report
from harness import launch, last_json, world


def case(label, tags, seconds, **result):
    return {"label": label, "tags": tags,
            "result": {"step_time_s": sorted(seconds)[len(seconds) // 2], "step_time_s_rounds": seconds,
                       **result}}


def runs(ddp_seconds, ours_seconds=(0.010, 0.011, 0.012)):
    """One data-parallel job at N = 2 and a scaling job at N = 4, as bench/run.py records them."""
    dp = {"group": "dp", "ranks": 2, "env": {}, "error": None, "load": [1.0, 1.5], "result": {
        "steps": 12, "rounds": len(ours_seconds), "mpi_library": "MPICH", "config": {"batch_size": 64}, "cases": [
            case("data_parallel.py", {"kind": "strategy", "variant": "default", "scaling": True},
                 list(ours_seconds), buckets=1, comm_s=0.002, losses=[2.3, 2.1]),
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

OURS_8 = [0.010, 0.011, 0.012, 0.010, 0.011, 0.012, 0.011, 0.011]  # 8 rounds: median 11 ms, 10 to 12


def verdict_lines(text, name):
    """The findings' lines that set `name` against another run."""
    return [line for line in text.splitlines() if line.startswith("- ") and name in line]


# The bench's rule: a winner only with at least 8 rounds, the median more than 3% from 1x and a two-sided
# sign test over the rounds below 0.05 (8 of 8: p = 2/256 = 0.008; 7 of 8: p = 2 x 9/256 = 0.070; 9 of 10:
# p = 2 x 11/1024 = 0.021); otherwise a tie, and fewer than 8 rounds no verdict at all.
@pytest.mark.parametrize("ours_seconds,ddp_seconds,verdict", [
    (OURS_8, [0.020] * 8, "data_parallel.py is faster than PyTorch DDP (gloo): 0.55× its step time (median of 8 "
                          "rounds, 0.50 to 0.60); data_parallel.py faster in 8 of 8 rounds, sign test p = 0.008."),
    (OURS_8, [0.005] * 8, "PyTorch DDP (gloo) is faster than data_parallel.py: data_parallel.py takes 2.20× its "
                          "step time (median of 8 rounds, 2.00 to 2.40); data_parallel.py faster in 0 of 8 rounds, "
                          "sign test p = 0.008."),
    (OURS_8 + [0.011] * 2, [0.020] * 9 + [0.005],
     "data_parallel.py is faster than PyTorch DDP (gloo): 0.55× its step time (median of 10 rounds, 0.50 to 2.20); "
     "data_parallel.py faster in 9 of 10 rounds, sign test p = 0.021."),
    # far from 1x, but one round in 8 against: p = 0.070, a tie
    (OURS_8, [0.020] * 7 + [0.005],
     "no clear winner between data_parallel.py and PyTorch DDP (gloo): the rounds do not agree often enough "
     "(0.55×; median of 8 rounds, 0.50 to 2.20); data_parallel.py faster in 7 of 8 rounds, sign test p = 0.070."),
    # every round agrees, but 3 rounds are too few for any verdict
    ([0.010, 0.011, 0.012], [0.020, 0.021, 0.022],
     "data_parallel.py takes 0.52× the step time of PyTorch DDP (gloo) (median of 3 rounds, 0.50 to 0.55); "
     "data_parallel.py faster in 3 of 3 rounds, sign test p = 0.250: fewer than 8 rounds, no verdict.")],
    ids=["ours faster", "DDP faster", "9 of 10", "7 of 8 is a tie", "3 rounds are no verdict"])
def test_the_findings_name_whichever_is_faster_when_the_rounds_agree(ours_seconds, ddp_seconds, verdict):
    text = report.render(META, runs(ddp_seconds, ours_seconds))
    assert verdict_lines(text, "PyTorch DDP (gloo)") == [f"- Data parallelism, N = 2: {verdict}"]


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


def on_gloo(label, seconds, **result):
    """The twin of one of our runs: the same script, its exchanges carried by gloo."""
    return case(f"{label} on gloo", {"kind": "on_gloo", "of": label, "gloo": True}, seconds, **result)


def test_the_pipeline_table_gives_every_schedule_against_1f1b_and_each_torch_peer_or_why_not():
    def pp(schedule, m, seconds):
        return case(f"pipeline_parallel.py --schedule {schedule} --micro-batches {m}",
                    {"kind": "strategy", "strategy": "pipeline_parallel", "schedule": schedule, "m": m},
                    seconds, bubble_fraction=0.2, bubble_fraction_theory=0.1, losses=[2.0, 1.5])
    peer = {"label": "torch.distributed.pipelining ScheduleZBVZeroBubble, M = 4",
            "tags": {"kind": "peer", "schedule": "zbv", "torch": "ScheduleZBVZeroBubble", "placement": "zbv",
                     "m": 4}, "result": {"error": "hangs on gloo: a receive waited 20 s"}}
    job = {"group": "pp", "ranks": 2, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 3, "rounds": 8, "config": {"layers": 4}, "cases": [
            pp("1f1b", 4, [0.10] * 8), pp("zbv", 4, [0.08, 0.09, 0.12, 0.09, 0.09, 0.08, 0.12, 0.09]), peer,
            case("torch.distributed.pipelining Schedule1F1B, M = 4",
                 {"kind": "peer", "schedule": "1f1b", "torch": "Schedule1F1B", "placement": "1f1b", "m": 4},
                 [0.20, 0.25, 0.40, 0.25, 0.25, 0.20, 0.40, 0.25], losses=[2.0, 1.5],
                 peak_memory_bytes_per_rank=[5 * 2 ** 20, 5 * 2 ** 20]),
            # ours on gloo: zbv is the faster of the two on MPI, 1f1b on gloo
            on_gloo("pipeline_parallel.py --schedule 1f1b --micro-batches 4", [0.12] * 8,
                    peak_memory_bytes_per_rank=[2 * 2 ** 20, 3 * 2 ** 20]),
            on_gloo("pipeline_parallel.py --schedule zbv --micro-batches 4", [0.14] * 8)]}}
    text = report.render({**META, "missing": []}, [job])
    # zbv over 1f1b round by round: 0.8, 0.9, 1.2, 0.9, 0.9, 0.8, 1.2, 0.9; 1f1b over torch's 1F1B: 0.5, 0.4,
    # 0.25, 0.4, 0.4, 0.5, 0.25, 0.4.
    assert "| 2 | pipeline_parallel.py --schedule zbv --micro-batches 4 | 4 | 90.0 (80.0–120.0) | " \
           "0.90× (0.80–1.20) | 20% | 10% |" in text
    assert "| 0.40× (0.25–0.50) | – |" in text and "| 2.50× (2.00–4.00) | – | – |" in text
    assert "not measured: hangs on gloo: a receive waited 20 s" in text
    summary = text.split("## Summary")[1].split("\n## ")[0]
    # 1f1b on gloo over torch's 1F1B: 0.6, 0.48, 0.3, ...; beside it the peaks of both and the pairing on MPI
    assert ("| pipeline | 2 | --schedule 1f1b, M = 4 / Schedule1F1B | 0.48× (0.30–0.60; faster in 8 of 8, p = 0.008) "
            "| ours faster | 2.0, 3.0 | 5.0, 5.0 | 0.40× (0.25–0.50; faster in 8 of 8, p = 0.008) | ours faster |") \
        in summary
    assert "| pipeline | 2 | --schedule zbv, M = 4 / ScheduleZBVZeroBubble | PyTorch's not measured: hangs on gloo" \
        in summary
    # the fastest of ours on MPI (zbv, 0.08/0.20, 0.09/0.25, 0.12/0.40, ...) and on gloo (1f1b) against torch's
    assert ("| pipeline | 2 | the fastest of ours (on MPI zbv, on gloo 1f1b), M = 4 / the fastest of torch's "
            "(Schedule1F1B) | 0.48× (0.30–0.60; faster in 8 of 8, p = 0.008) | ours faster | 2.0, 3.0 | 5.0, 5.0 "
            "| 0.36× (0.30–0.40; faster in 8 of 8, p = 0.008) | ours faster |") in summary
    # 10% apart, but zbv is faster in 6 of the 8 rounds only: p = 2 x 37/256 = 0.289, a tie
    assert ("Pipeline, N = 2, M = 4: no clear winner between --schedule zbv and 1f1b: the rounds do not agree often "
            "enough (0.90×; median of 8 rounds, 0.80 to 1.20); --schedule zbv faster in 6 of 8 rounds, sign test "
            "p = 0.289.") in text
    assert ("Pipeline, N = 2: pipeline_parallel.py --schedule 1f1b is faster than torch.distributed.pipelining "
            "Schedule1F1B, M = 4: 0.40× its step time (median of 8 rounds, 0.25 to 0.50)") in text
    assert ("Pipeline, N = 2: pipeline_parallel.py --schedule 1f1b on gloo is faster than torch.distributed."
            "pipelining Schedule1F1B, M = 4: 0.48× its step time (median of 8 rounds, 0.30 to 0.60)") in text
    assert "train the losses of ours placed alike to within 0.0e+00 (Schedule1F1B against 1f1b)" in text


def test_the_hybrid_table_gives_each_grid_against_2x2x2_and_says_what_8_ranks_on_2_cores_show():
    def grid(label, name, seconds, tensor, pipeline, data):
        return case(f"hybrid_parallel.py {label}", {"kind": "strategy", "strategy": "hybrid_parallel",
                                                   "grid": name}, seconds,
                    comm_bytes_per_step_by_axis={"tensor": tensor, "pipeline": pipeline, "data": data},
                    collectives_per_step_by_axis={"tensor": 84, "data": 4}, messages_per_step=16,
                    bubble_fraction=0.3, bubble_fraction_theory=1 / 3)
    job = {"group": "hybrid", "ranks": 8, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 4, "rounds": 8, "torch_threads": 1, "config": {"layers": 4}, "cases": [
            grid("--dp 2 --tp 2 --pp 2", "2x2x2", [0.40] * 8, 9e6, 1e6, 2e6),
            grid("--dp 8", "dp", [0.20, 0.22, 0.24, 0.22, 0.22, 0.20, 0.24, 0.22], 0, 0, 7e6),
            {"label": "hybrid_parallel.py --tp 8", "tags": {"kind": "strategy", "grid": "tp"},
             "result": {"error": "--tp 8 does not divide --heads 4"}}]}}
    text = report.render({**META, "missing": []}, [job])
    assert "| 8 † | hybrid_parallel.py --dp 8 | 220.0 (200.0–240.0) | 0.55× (0.50–0.60) | 0.00 | 0.00 | 7.00 | " \
           "84 + 4 | 16 | 30% (33%) | – |" in text
    assert "| 8 † | hybrid_parallel.py --tp 8 | not measured: --tp 8 does not divide --heads 4 |" in text
    assert "What 8 ranks on 2 cores can and cannot show: the ranks are 4× more than the cores" in text
    assert "from 7.00 MB per step (hybrid_parallel.py --dp 8) to 12.00 MB (hybrid_parallel.py --dp 2 --tp 2 --pp 2)" \
        in text
    assert ("Hybrid, N = 8 †: hybrid_parallel.py --dp 8 is faster than the 2 × 2 × 2 grid: 0.55× its step time "
            "(median of 8 rounds, 0.50 to 0.60); hybrid_parallel.py --dp 8 faster in 8 of 8 rounds, sign test "
            "p = 0.008.") in text


def test_the_exactness_matrix_gives_every_grid_its_difference_verdict_norms_time_peak_and_bytes_by_axis():
    def grid(n, flags, diff, norms, passed=True, precision="fp32"):
        return case(f"hybrid_parallel.py {flags} [{precision}]",
                    {"kind": "strategy", "strategy": "hybrid_parallel", "n": n, "precision": precision,
                     "recipe": ["--optimizer", "adamw", "--ragged"]},
                    [0.05], check_max_abs_diff=diff, check_passed=passed, peak_memory_bytes_per_rank=[3e6, 4e6],
                    comm_bytes_per_step_by_axis={"data": 1e6, "tensor": 0, "pipeline": 0, "context": 0, "expert": 2e6},
                    **({} if norms is None else {"norm_max_abs_diff": norms}))
    job = {"group": "matrix", "ranks": 16, "env": {}, "error": None, "load": [1.0, 2.0], "result": {
        "steps": 3, "rounds": 1, "config": {"layers": 3, "hidden": 16, "heads": 2, "batch_size": 8, "seq_len": 8,
                                            "micro_batches": 2}, "cases": [
            grid(2, "--ep 2 --experts 4", 2.4e-7, 1.2e-7), grid(16, "--dp 2 --tp 2 --pp 2 --cp 2 --ep 2", 3e-5, 2.5e-1, False),
            grid(2, "--tp 2", 4e-3, 1e-2, precision="bf16"), grid(1, "(one process)", 1e-3, None, precision="bf16"),
            {"label": "hybrid_parallel.py --tp 8 [fp32]", "tags": {"kind": "strategy", "n": 8, "precision": "fp32"},
             "result": {"error": "--tp 8 does not divide --heads 2"}}]}}
    text = report.render({**META, "missing": []}, [job])
    assert "| 2 | --ep 2 --experts 4 | fp32 | 2.4e-07 pass | 1.2e-07 | 50.0 | 4.00 | 1.00 / 0.00 / 0.00 / 0.00 / 2.00 |" in text
    assert "| 16 † | --dp 2 --tp 2 --pp 2 --cp 2 --ep 2 | fp32 | 3.0e-05 FAIL | 2.5e-01 |" in text
    assert "| 2 | --tp 2 | bf16 | 4.0e-03 pass | 1.0e-02 |" in text and "| 1 | (one process) | bf16 | 1.0e-03 pass | – |" in text
    assert "| 8 † | --tp 8 | not measured: --tp 8 does not divide --heads 2 |" in text
    assert "3 blocks × 16 hidden × 2 heads" in text and "M = 2 micro-batches, 3 steps, `--optimizer adamw --ragged`" in text


def bare(label, mpi, gloo, kinds):
    """A strategy's step replayed bare: the rounds on MPI and on gloo, its exchanges by kind."""
    return {"label": f"{label}: its step's exchanges bare", "tags": {"kind": "bare", "of": label},
            "result": {"bare_mpi_s": sorted(mpi)[len(mpi) // 2], "bare_mpi_s_rounds": mpi,
                       "bare_gloo_s": sorted(gloo)[len(gloo) // 2], "bare_gloo_s_rounds": gloo, "kinds": kinds}}


def test_the_summary_pairs_ours_on_gloo_with_the_peer_beside_its_peaks_and_ours_on_mpi_and_calls_ties_ties():
    # ours 10, 11, 12, 10, 11, 12, 11, 11 ms against DDP 10, 10.8, 11.5, 10, 10.8, 11.5, 10.8, 10.8: paired 1.000,
    # 1.019, 1.043, 1.000, 1.019, 1.043, 1.019, 1.019: DDP faster in 6 rounds, 2 even (no side): p = 2/64 = 0.031,
    # yet the median, 1.02, is within 3% of 1x: a tie.
    dp = runs([0.010, 0.0108, 0.0115, 0.010, 0.0108, 0.0115, 0.0108, 0.0108], OURS_8)[0]
    ddp = next(c for c in dp["result"]["cases"] if c["label"] == "PyTorch DDP (gloo)")
    ddp["result"]["peak_memory_bytes_per_rank"] = [4 * 2 ** 20, 4.5 * 2 ** 20]
    dp["result"]["cases"] += [
        bare("data_parallel.py", [0.0005] * 8, [0.0025, 0.0030, 0.0035, 0.0025, 0.0030, 0.0035, 0.0030, 0.0030],
             {"allreduce": [1, 247960]}),
        # ours on gloo: 12.5 ms every round, 1.25x DDP's 10 ms, 1.16x its 10.8, 1.09x its 11.5
        on_gloo("data_parallel.py", [0.0125] * 8, peak_memory_bytes_per_rank=[3 * 2 ** 20, 3.5 * 2 ** 20])]
    text = report.render(META, [dp])
    summary = text.split("## Summary")[1].split("\n## ")[0]
    assert ("| data | 2 | data_parallel.py / PyTorch DDP (gloo) | 1.16× (1.09–1.25; faster in 0 of 8, p = 0.008) "
            "| PyTorch's faster | 3.0, 3.5 | 4.0, 4.5 | 1.02× (1.00–1.04; faster in 0 of 8, p = 0.031) | tie |") \
        in summary
    # at gloo's cost: (10 + 2.5 - 0.5)/10, (11 + 3 - 0.5)/10.8, (12 + 3.5 - 0.5)/11.5, ...: 1.20, 1.25, 1.30;
    # beside it, measured, ours on gloo.
    section = text.split("## Data parallelism")[1].split("\n## ")[0]
    assert ("| 2 | data_parallel.py / PyTorch DDP (gloo) | allreduce 1 × = 247,960 B | 0.5 | 3.0 | 6.0× "
            "| 1.02× (1.00–1.04; faster in 0 of 8, p = 0.031) | 1.25× (1.20–1.30; faster in 0 of 8, p = 0.008) "
            "| 1.16× (1.09–1.25; faster in 0 of 8, p = 0.008) |") in section
    assert ("data_parallel.py and PyTorch DDP (gloo) take the same time (1.02×; median of 8 rounds, 1.00 to 1.04); "
            "data_parallel.py faster in 0 of 8 rounds, sign test p = 0.031.") in text
    assert ("PyTorch DDP (gloo) is faster than data_parallel.py on gloo: data_parallel.py on gloo takes 1.16× its "
            "step time (median of 8 rounds, 1.09 to 1.25)") in text
    # fewer than 8 rounds: no verdict, however the rounds agree
    three = runs([0.020, 0.021, 0.022])[0]
    text = report.render(META, [three])
    assert "| data | 2 | data_parallel.py / PyTorch DDP (gloo) | – | – | – (on MPI) | – " \
           "| 0.52× (0.50–0.55; faster in 3 of 3, p = 0.250) | 3 rounds: no verdict |" in text
    # one round is no verdict, however far from 1x
    one = runs([0.020])[0]
    one["result"]["cases"] = [dict(c, result={**c["result"], "step_time_s_rounds": c["result"]["step_time_s_rounds"][:1]})
                              if "step_time_s_rounds" in c["result"] else c for c in one["result"]["cases"]]
    text = report.render(META, [one])
    assert "| data | 2 | data_parallel.py / PyTorch DDP (gloo) | – | – | – (on MPI) | – " \
           "| 0.50× (faster in 1 of 1, p = 1.000) | 1 round: no verdict |" in text
    assert "data_parallel.py takes 0.50× the step time of PyTorch DDP (gloo) in the one round measured: no verdict." in text


def test_the_transport_table_says_whether_gloos_reduce_scatter_moves_what_an_allreduce_moves():
    def kind(op, mpi, gloo, written):
        return {"label": f"{op}, 1 MiB", "tags": {"kind": "bare", "op": op},
                "result": {"bare_mpi_s": mpi, "bare_mpi_s_rounds": [mpi], "bare_gloo_s": gloo,
                           "bare_gloo_s_rounds": [gloo], "bytes": 1 << 20, "gloo_bytes_written": written}}
    job = {"group": "transport", "ranks": 4, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 20, "rounds": 1, "cases": [kind("allreduce", 0.002, 0.010, 1.5 * 2 ** 20),
                                            kind("reduce_scatter", 0.001, 0.012, 1.5 * 2 ** 20),
                                            kind("allgather", 0.001, 0.006, 0.75 * 2 ** 20)]}}
    text = report.render({**META, "missing": []}, [job])
    assert "| 4 † | reduce_scatter, 1 MiB | 1,048,576 | 1.0 | 12.0 | 12.0× | 1.50 |" in text
    assert ("gloo's reduce-scatter wrote 1.50× its vector per rank, its allreduce 1.50×, its all-gather 0.75× "
            "(a ring reduce-scatter sends 0.75×, a ring allreduce 1.50×); it took 1.20× the allreduce's time, "
            "paired by round. It moves what an allreduce moves") in text


@pytest.mark.e2e
def test_a_short_data_parallel_job_measures_every_case_and_ddp_trains_the_same_model():
    out = launch("bench/worker.py", 2, "dp", "--rounds", "1", "--steps", "3", "--collective-reps", "3")
    result = last_json(out)["groups"]["dp"]
    cases = {c["label"]: c["result"] for c in result["cases"]}
    assert all("error" not in r for r in cases.values()), json.dumps(cases)[:2000]
    ours, ddp = cases["data_parallel.py"]["losses"], cases["PyTorch DDP (gloo)"]["losses"]
    assert max(abs(a - b) for a, b in zip(ours, ddp)) < 1e-5
    # the exchanges written down at the MPI call: one allreduce of the gradients (G bytes), or two buckets
    grads = cases["bare MPI Allreduce of the gradients"]["bytes"]
    assert cases["data_parallel.py: its step's exchanges bare"]["kinds"] == {"allreduce": [1, grads]}
    assert cases["data_parallel.py --bucket-mb 0.05: its step's exchanges bare"]["kinds"] == {"allreduce": [2, grads]}
    assert all(r["bare_mpi_s"] > 0 and r["bare_gloo_s"] > 0 for k, r in cases.items() if k.endswith("exchanges bare"))
    # ours on gloo: the same script trains the same model, bit for bit at N = 2 (a + b = b + a), and counts the
    # same exchanges; what the twin cannot show is which transport carried them (tests/test_bench_transport.py)
    for label in ("data_parallel.py", "data_parallel.py --bucket-mb 0.05", "data_parallel.py --no-overlap"):
        mpi, gloo = cases[label], cases[f"{label} on gloo"]
        assert gloo["losses"] == mpi["losses"] and gloo["grad_norms"] == mpi["grad_norms"], label
        assert (gloo["comm_bytes_per_step"], gloo["collectives_per_step"]) == \
            (mpi["comm_bytes_per_step"], mpi["collectives_per_step"]), label
    # DDP with our small buckets' cap allreduces as many buckets as ours (DDP's own count, after its rebuild on
    # the second step), and trains the same model
    small = cases["PyTorch DDP (gloo), bucket_cap_mb 0.05"]
    assert small["buckets"] == cases["data_parallel.py --bucket-mb 0.05"]["collectives_per_step"] == 2
    assert max(abs(a - b) for a, b in zip(ours, small["losses"])) < 1e-5
    assert all(len(r["peak_memory_bytes_per_rank"]) == 2 and min(r["peak_memory_bytes_per_rank"]) > 0
               for k, r in cases.items() if k.startswith(("data_parallel.py", "PyTorch DDP")) and "bare" not in k)


def zero_job():
    """A ZeRO job at N = 2: stage 1, on MPI and on gloo, and its peer, the unsharded baseline, the peer with
    overlap_with_ddp refused on gloo, and FSDP2 unable to run."""
    def held(params, grads, optimizer, gathered=0):
        return {"parameters": params, "gradients": grads, "optimizer": optimizer, "gathered": gathered,
                "total": params + grads + optimizer + gathered}
    return {"group": "zero", "ranks": 2, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 6, "rounds": 8, "config": {"layers": 4, "hidden": 64, "heads": 4, "batch_size": 24,
                                            "seq_len": 64}, "cases": [
            case("sharded_data_parallel.py --zero-stage 1", {"kind": "strategy", "stage": 1},
                 [0.080, 0.090, 0.100, 0.090, 0.090, 0.080, 0.100, 0.090], losses=[4.8, 4.6], param_count=220288,
                 comm_bytes_per_step=1762304, collectives_per_step=12, comm_bytes_formula=1762304,
                 live_bytes_after_last_step=held(881152, 881152, 881176),
                 memory_bytes_formula={"parameters": 881152, "gradients": 881152, "optimizer": 881152,
                                       "gathered": 0, "whole_gradients": 0, "activations": 2_356_544,
                                       "total": 5_000_000},
                 peak_memory_bytes_per_rank=[5_100_000, 5_300_000]),
            on_gloo("sharded_data_parallel.py --zero-stage 1", [0.120] * 8, losses=[4.8, 4.6],
                    peak_memory_bytes_per_rank=[5.5 * 2 ** 20, 5.7 * 2 ** 20]),
            case("PyTorch DDP + AdamW (gloo), unsharded", {"kind": "peer", "variant": "ddp", "stage": 0},
                 [0.100] * 8, losses=[4.8, 4.6 + 2e-7], comm_bytes_per_step=881152,
                 collectives_per_step=1, live_bytes_after_last_step=held(881152, 881152, 1762564),
                 peak_memory_bytes_per_rank=[6_900_000, 7_000_000]),
            case("ZeroRedundancyOptimizer(AdamW) + DDP (gloo), ZeRO-1",
                 {"kind": "peer", "variant": "zero_redundancy", "stage": 1},
                 [0.160, 0.180, 0.200, 0.180, 0.180, 0.160, 0.200, 0.180],
                 losses=[4.8, 4.6], comm_bytes_per_step=1762304, collectives_per_step=66,
                 live_bytes_after_last_step=held(881152, 881152, 884792),
                 peak_memory_bytes_per_rank=[6 * 2 ** 20, 6.3 * 2 ** 20]),
            {"label": "ZeroRedundancyOptimizer(AdamW, overlap_with_ddp) + DDP (gloo), ZeRO-1",
             "tags": {"kind": "peer", "variant": "zero_redundancy_overlap", "stage": 1},
             "result": {"error": "torch 2.13.0+cpu refuses overlap_with_ddp on gloo: Gloo backend using "
                                 "Overlapping DDP with ZeRO may meet hangs"}},
            {"label": "FSDP2 fully_shard (gloo), ZeRO-3",
             "tags": {"kind": "peer", "variant": "fsdp2", "stage": 3},
             "result": {"error": "RuntimeError: no reduce_scatter on gloo"}}]}}


def test_the_zero_table_pairs_each_stage_with_its_peer_and_sets_memory_beside_the_formula():
    text = report.render(META, [zero_job()])
    section = text.split("## ZeRO")[1].split("## ")[0]
    # 0.080/0.160, 0.090/0.180, 0.100/0.200, ...: 0.50 every round; against DDP 0.80, 0.90, 1.00, ...
    assert ("| 2 | sharded_data_parallel.py --zero-stage 1 | 90.0 (80.0–100.0) | 0.50× (0.50–0.50) "
            "| 0.90× (0.80–1.00) | 0.88 / 0.88 / 0.88 / 0.00 = 2.64 | 5.00 | 5.30 "
            "| 1,762,304 in 12 calls (formula 1,762,304) | 2.0e-07 |") in section  # the peak: the largest rank's
    assert "| 0.88 / 0.88 / 1.76 / 0.00 = 3.52 | – | 7.00 | 881,152 in 1 call |" in section
    assert "not measured: RuntimeError: no reduce_scatter on gloo" in section
    assert "not measured: torch 2.13.0+cpu refuses overlap_with_ddp on gloo" in section
    assert ("ZeRO, N = 2: sharded_data_parallel.py --zero-stage 1 is faster than ZeroRedundancyOptimizer"
            "(AdamW) + DDP (gloo), ZeRO-1: 0.50× its step time (median of 8 rounds, 0.50 to 0.50); "
            "sharded_data_parallel.py --zero-stage 1 faster in 8 of 8 rounds, sign test p = 0.008.") in text
    # on gloo: 0.120/0.160, 0.120/0.180, 0.120/0.200, ...: 0.75, 0.67, 0.60, ...
    assert ("ZeRO, N = 2: sharded_data_parallel.py --zero-stage 1 on gloo is faster than ZeroRedundancyOptimizer"
            "(AdamW) + DDP (gloo), ZeRO-1: 0.67× its step time (median of 8 rounds, 0.60 to 0.75)") in text
    summary = text.split("## Summary")[1].split("\n## ")[0]
    assert ("| ZeRO | 2 | --zero-stage 1 / ZeroRedundancyOptimizer(AdamW) + DDP | 0.67× (0.60–0.75; faster in 8 of 8, "
            "p = 0.008) | ours faster | 5.5, 5.7 | 6.0, 6.3 | 0.50× (0.50–0.50; faster in 8 of 8, p = 0.008) "
            "| ours faster |") in summary
    assert ("| ZeRO | 2 | --zero-stage 1 / ZeroRedundancyOptimizer(AdamW, overlap_with_ddp) + DDP | PyTorch's not "
            "measured: torch 2.13.0+cpu refuses overlap_with_ddp on gloo: Gloo backend using Overlapping DDP with "
            "ZeRO may meet hangs |") in summary
    assert ("peaks at stage 1: 5.30 MB against 7.00 MB for DDP + AdamW, measured alike; each measured peak "
            "is within 6% of its stage's formula") in text
    assert "the loss curves of 3 runs agree to within 2.0e-07" in text


@pytest.mark.e2e
def test_a_short_zero_job_gives_every_case_a_result_or_one_line_why():
    out = launch("bench/worker.py", 2, "zero", "--rounds", "1", "--steps", "2")
    cases = last_json(out)["groups"]["zero"]["cases"]
    bare = {c["tags"]["of"]: c["result"] for c in cases if c["tags"]["kind"] == "bare"}
    cases = [c for c in cases if c["tags"]["kind"] != "bare"]
    # 5 runs of ours, 3 of them again on gloo, 5 peers (ZeroRedundancyOptimizer with and without overlap_with_ddp)
    assert len(cases) == 13 and all(
        ("error" in c["result"]) != ("step_time_s" in c["result"]) for c in cases), json.dumps(cases)[:2000]
    # each stage's exchanges as written down at the MPI call: the whole vectors the script counts itself
    for c in cases[:3]:
        assert sum(b for _, b in bare[c["label"]]["kinds"].values()) == c["result"]["comm_bytes_per_step"]
    assert all("\n" not in c["result"]["error"] for c in cases if "error" in c["result"])
    ours = [c["result"] for c in cases if c["tags"]["kind"] == "strategy"]
    assert [r["zero_stage"] for r in ours] == [1, 2, 3, 2, 3]  # stages 2 and 3 again with --no-overlap
    # ours on gloo: the same training as on MPI, bit for bit at N = 2, the same exchanges counted
    mpi = {c["label"]: c["result"] for c in cases if c["tags"]["kind"] == "strategy"}
    twins = [c for c in cases if c["tags"]["kind"] == "on_gloo"]
    assert [c["tags"]["of"] for c in twins] == [c["label"] for c in cases[:3]]
    for c in twins:
        theirs, r = mpi[c["tags"]["of"]], c["result"]
        assert (r["losses"], r["comm_bytes_per_step"], r["collectives_per_step"]) == \
            (theirs["losses"], theirs["comm_bytes_per_step"], theirs["collectives_per_step"]), c["label"]
    # every peer that ran has its peak and its bytes; overlap_with_ddp is refused on gloo in one line that says so
    peers = {c["tags"]["variant"]: c["result"] for c in cases if c["tags"]["kind"] == "peer"}
    assert all(min(r["peak_memory_bytes_per_rank"]) > 0 and r["comm_bytes_per_step"] > 0
               for r in peers.values() if "error" not in r)
    refused = peers["zero_redundancy_overlap"]  # refused by torch 2.13 on gloo; a torch that runs it has a row
    assert "error" not in refused or "overlap_with_ddp on gloo" in refused["error"], refused


def tp_job():
    """A tensor-parallel job at N = 2: plain and --sequence-parallel (with and without overlap), each beside
    torch's peer of its mode."""
    def ours(label, tags, seconds, comm, overlapped, calls, sent, saved):
        return case(f"tensor_parallel.py{label}", {"kind": "strategy", "strategy": "tensor_parallel", **tags},
                    seconds, comm_s=sorted(comm)[1], comm_s_rounds=comm, collectives_per_step=calls,
                    collectives_formula=calls, comm_bytes_per_step=sent, comm_bytes_formula=sent,
                    activation_bytes_per_rank=[saved, saved], activation_bytes_formula=saved, losses=[4.8, 4.4],
                    overlap={"exchanges_under_weight_grad": [overlapped, 9]})
    return {"group": "tp", "ranks": 2, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 6, "rounds": 8, "mpi_library": "MPICH Version: 5.0.2",
        "config": {"layers": 4, "hidden": 64, "heads": 4, "batch_size": 16, "seq_len": 64}, "cases": [
            ours("", {"mode": "plain"}, [0.050] * 8, [0.010] * 3, 9, 21, 4730880, 13_478_400),
            ours(" --sequence-parallel", {"mode": "sequence_parallel"},
                 [0.060, 0.064, 0.072, 0.064, 0.064, 0.060, 0.072, 0.064], [0.010, 0.012, 0.011], 9, 40, 7113216,
                 12_261_888),
            ours(" --sequence-parallel --no-overlap", {"mode": "sequence_parallel", "overlap": False},
                 [0.080] * 8, [0.020, 0.020, 0.022], 0, 40, 7113216, 12_261_888),
            case("torch.distributed.tensor.parallel", {"kind": "peer", "mode": "plain"}, [0.100] * 8,
                 losses=[4.8, 4.4]),
            case("torch.distributed.tensor.parallel with SequenceParallel", {"kind": "peer", "mode": "sequence_parallel"},
                 [0.120] * 8, losses=[4.8, 4.4 + 3e-7])]}}


def test_the_tensor_table_pairs_sequence_parallelism_with_torchs_and_sets_activations_beside_the_formula():
    text = report.render({**META, "missing": []}, [tp_job()])
    # 0.060/0.120, 0.064/0.120, 0.072/0.120, ...: 0.50, 0.53, 0.60, ...; activations 12,261,888 bytes beside the
    # formula.
    assert ("| 2 | tensor_parallel.py --sequence-parallel | 64.0 (60.0–72.0) | 0.53× (0.50–0.60) | 40 (40) "
            "| 7,113,216 (7,113,216) | 12.26 / 12.26 (12.26) | – | – |") in text
    assert "| 2 | torch.distributed.tensor.parallel with SequenceParallel | 120.0 (120.0–120.0) | 1.00× | – | – | – " \
           "| 3.0e-07 | – |" in text
    assert ("Tensor parallelism, N = 2: tensor_parallel.py --sequence-parallel is faster than torch's "
            "SequenceParallel: 0.53× its step time (median of 8 rounds, 0.50 to 0.60); tensor_parallel.py --sequence-parallel faster "
            "in 8 of 8 rounds, sign test p = 0.008.") in text
    # 12.26 / 13.48 MB = 0.91; 7,113,216 / 4,730,880 bytes = 1.50; the steps 1.20, 1.28, 1.44 of plain's.
    assert ("--sequence-parallel saves 12.26 MB of activations per rank against 13.48 MB plain, 0.91× measured "
            "(the formulas: 0.91×); it hands MPI 1.50× the bytes per step in 40 collectives against 21, and its "
            "step takes 1.28× plain's") in text


def cp_job():
    """A context-parallel job at N = 4: the ring (zigzag, also with --no-overlap), the all-gather, the
    all-to-all, the contiguous layout, and torch's peer unable to run."""
    def ours(label, tags, seconds, comm, pairs, sent, messages, collectives, peak=30e6, **more):
        return case(f"context_parallel.py {label}", {"kind": "strategy", "strategy": "context_parallel", **tags},
                    seconds, comm_s=comm[1], comm_s_rounds=comm, causal_pairs_per_rank=pairs,
                    comm_bytes_per_step=sent, comm_bytes_formula=sent, messages_per_step=messages,
                    collectives_per_step=collectives, losses=[4.8, 4.5], peak_memory_bytes_per_rank=[peak - 1e6, peak],
                    **more)
    ring, zigzag = {"cp_comm": "ring", "layout": "zigzag"}, [7230] * 4
    return {"group": "cp", "ranks": 4, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 4, "rounds": 8, "mpi_library": "MPICH Version: 5.0.2",
        "config": {"layers": 4, "hidden": 64, "heads": 4, "batch_size": 16, "seq_len": 240}, "cases": [
            ours("--cp-comm ring --layout zigzag", ring, [0.30] * 8, [0.012] * 3, zigzag, 20_000_000, 40, 2,
                 overlap={"kv_messages_under_compute": [120, 160]}),
            ours("--cp-comm allgather --layout zigzag", {"cp_comm": "allgather", "layout": "zigzag"},
                 [0.36, 0.33, 0.33, 0.33, 0.36, 0.33, 0.33, 0.36], [0.02] * 3, zigzag, 14_000_000, 0, 14, peak=32e6),
            ours("--cp-comm alltoall --layout zigzag", {"cp_comm": "alltoall", "layout": "zigzag"},
                 [0.27, 0.24, 0.27, 0.27, 0.24, 0.27, 0.27, 0.27], [0.02] * 3, [7230] * 4, 6_000_000, 0, 18,
                 peak=31e6),
            ours("--cp-comm ring --layout contiguous", {"cp_comm": "ring", "layout": "contiguous"}, [0.39] * 8,
                 [0.012] * 3, [1830, 5430, 9030, 12630], 20_000_000, 40, 2),
            ours("--cp-comm ring --layout zigzag --no-overlap", {**ring, "overlap": False},
                 [0.30, 0.31, 0.32, 0.31, 0.31, 0.30, 0.32, 0.31], [0.010] * 3, zigzag, 20_000_000, 40, 2,
                 overlap={"kv_messages_under_compute": [0, 160]}),
            {"label": "torch.distributed.tensor.experimental.context_parallel (gloo)", "tags": {"kind": "peer"},
             "result": {"error": "does not run on CPU processes: NotImplementedError: no sharding strategy"}}]}}


def test_the_context_table_gives_each_variant_against_the_ring_and_the_busiest_ranks_share_of_the_work():
    text = report.render({**META, "missing": []}, [cp_job()])
    section = text.split("## Context parallelism")[1].split("## ")[0]
    # contiguous at N = 4: the last rank's 12,630 of the 28,920 pairs, 44%, against 25% for an even split
    assert ("| 4 † | context_parallel.py --cp-comm ring --layout contiguous | 390.0 (390.0–390.0) | 1.30× (1.30–1.30) "
            "| 1,830 / 5,430 / 9,030 / 12,630: 44% (even 25%) | 20,000,000 (20,000,000) | 40 + 2 | 30.00 | 0.0e+00 "
            "| – |") in section
    assert "| 0 + 14 |" in section
    assert "not measured: does not run on CPU processes: NotImplementedError: no sharding strategy" in section
    # the all-gather's rounds: 1.2, 1.1, 1.1, 1.1, 1.2, 1.1, 1.1, 1.2: median 1.10, slower in all 8
    assert ("Context parallelism, N = 4 †: the ring is faster than --cp-comm allgather: --cp-comm allgather takes "
            "1.10× its step time (median of 8 rounds, 1.10 to 1.20); --cp-comm allgather faster in 0 of 8 rounds, "
            "sign test p = 0.008.") in text
    assert "with --layout contiguous the busiest rank computes 44% of the causal pairs, with zigzag 25% (even: 25%)" \
        in text
    # the all-to-all's rounds: 0.27/0.30, 0.24/0.30, 0.27/0.30, ... = 0.9, 0.8, 0.9, ...: median 0.90
    assert "--cp-comm alltoall is faster than the ring: 0.90× its step time (median of 8 rounds, 0.80 to 0.90)" in text
    assert ("the ring hands MPI 20,000,000 bytes per step and rank, --cp-comm allgather 14,000,000 (0.70×), "
            "--cp-comm alltoall 6,000,000 (0.30×); every run's bytes equal its formula") in text
    assert "peak memory of the busiest rank, ring 30.00 MB, allgather 32.00 MB, alltoall 31.00 MB." in text


def ep_job():
    """An expert-parallel job at N = 2: --ep 2, --ep 1 and --ep 2 with a capacity that drops pairs."""
    def ours(label, tags, seconds, experts, rows=6291456, dropped=0, losses=(4.8, 4.5)):
        kinds = {"Alltoallv": rows, "Alltoall": 128, "router": 128, "dense": 356864, "experts": experts}
        return case(f"expert_parallel.py {label}", {"kind": "strategy", "strategy": "expert_parallel", **tags},
                    seconds, comm_bytes_by_kind=kinds, comm_bytes_formula_by_kind=kinds,
                    comm_bytes_per_step=sum(kinds.values()), comm_bytes_formula=sum(kinds.values()),
                    tokens_per_expert=[[768, 768, 768, 768], [1536, 0, 768, 768]], tokens_dropped=dropped,
                    losses=list(losses))
    return {"group": "ep", "ranks": 2, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 4, "rounds": 8, "config": {"layers": 2, "hidden": 64, "heads": 4, "batch_size": 24, "seq_len": 64,
                                            "experts": 4, "top_k": 2}, "cases": [
            ours("--ep 2", {"ep": 2, "capacity": None}, [0.08, 0.09, 0.095, 0.09, 0.09, 0.08, 0.095, 0.09], 1058816,
                 losses=(4.8, 4.5 + 2e-7)),
            ours("--ep 1", {"ep": 1, "capacity": None}, [0.10] * 8, 2117632),
            ours("--ep 2 --capacity-factor 1", {"ep": 2, "capacity": 1.0}, [0.072] * 8, 1058816, rows=5_000_000,
                 dropped=4096, losses=(4.8, 4.6))]}}


def test_the_expert_table_gives_the_spread_experts_against_replicated_ones_with_bytes_load_and_drops():
    text = report.render({**META, "missing": []}, [ep_job()])
    # all-to-all: 6,291,456 rows + 128 of counts; block 1's busiest expert 1,536 = 2.00 x an even 768;
    # 2 blocks x top-2 x 24 x 64 tokens x 4 steps = 24,576 pairs, 4,096 of them dropped.
    assert ("| 2 | expert_parallel.py --ep 2 | 90.0 (80.0–95.0) | 0.90× (0.80–0.95) | 6,291,584 (6,291,584) "
            "| 7,707,392 (7,707,392) | 1.00 / 2.00 | 0 | 2.0e-07 | – |") in text
    assert "| 4,096 of 24,576 (17%) | 1.0e-01 | – |" in text
    assert ("Expert parallelism, N = 2: --ep 2 is faster than --ep 1: 0.90× its step time (median of 8 rounds, 0.80 to "
            "0.95); --ep 2 faster in 8 of 8 rounds, sign test p = 0.008.") in text
    assert ("the experts' gradient allreduce 1,058,816 against 2,117,632 bytes") in text
    assert "the busiest expert of block 1 takes 2.00× an even share (its tokens per expert: 1536 / 0 / 768 / 768)" \
        in text
    assert "--ep 2 --capacity-factor 1 drops 4,096 (token, choice) pairs over the run; its step takes 0.80×" in text
    assert "--ep 2 and --ep 1 train loss curves within 2.0e-07 of each other over 4 steps" in text


def test_the_overlap_table_says_how_much_of_each_exchange_was_hidden_or_plainly_that_none_was():
    dp = {"group": "dp", "ranks": 2, "env": {}, "error": None, "result": {"steps": 16, "rounds": 2, "cases": [
        case("data_parallel.py --bucket-mb 0.05", {"kind": "strategy", "variant": "small"}, [0.02, 0.02],
             comm_s=0.001, comm_s_rounds=[0.001, 0.003], buckets=2, overlap=True),  # an older script's flag
        case("data_parallel.py --no-overlap", {"kind": "strategy", "variant": "no_overlap"}, [0.02, 0.02],
             comm_s=0.002, comm_s_rounds=[0.002, 0.002], buckets=1, overlap=True),
        case("bare MPI Allreduce of the gradients", {"kind": "limit", "variant": "mpi"}, [0.0005], bytes=247960)]}}
    text = report.render({**META, "missing": []}, [dp, tp_job(), cp_job()])
    section = text.split("## Overlap")[1].split("## ")[0]
    # 1 - 1/2 and 1 - 3/2: one round hid half, the other lost half: no verdict
    assert "| 2 | data_parallel.py --bucket-mb 0.05 | 1.0 / 2.0 | 0% (-50% to 50%) | 1.00× (1.00–1.00) | – |" in section
    assert ("data_parallel.py --bucket-mb 0.05: the rounds disagree on whether any of its exchange time was "
            "hidden") in text
    # exposed 10, 12, 11 ms against 20, 20, 22: halves, 60%, halves hidden; the steps 0.75, 0.80, 0.90 of the
    # steps without.
    assert ("| 2 | tensor_parallel.py --sequence-parallel | 11.0 / 20.0 | 50% (40% to 50%) | 0.80× (0.75–0.90) "
            "| exchanges under weight grad 9/9 (0/9) |") in section
    assert ("| 4 † | context_parallel.py --cp-comm ring --layout zigzag | 12.0 / 10.0 | -20% (-20% to -20%) "
            "| 0.97× (0.94–1.00) | kv messages under compute 120/160 (0/160) |") in section
    assert ("Overlap, N = 2: tensor_parallel.py --sequence-parallel hides 50% of its exchange time (11.0 ms exposed "
            "a step against 20.0 ms with --no-overlap; rounds 40% to 50%); the step takes 0.80× the step without.") \
        in text
    assert ("Overlap, N = 4 †: context_parallel.py --cp-comm ring --layout zigzag hides none of its exchange time "
            "(12.0 ms exposed a step against 10.0 ms with --no-overlap: 20% more with overlap; rounds -20% to -20%); "
            "the step takes 0.97× the step without. MPICH without its progress thread moves a non-blocking exchange "
            "on only inside an MPI call") in text


# -----------------------------------------------------------------------------
# The pictures: the numbers they pick need no matplotlib; the drawing is skipped without it
# -----------------------------------------------------------------------------
def pipeline_job():
    """A pipeline job at N = 2 with a schedule the tables do not know by name, and model parallelism."""
    def pp(schedule, m, bubble, theory):
        return case(f"pipeline_parallel.py --schedule {schedule} --micro-batches {m}",
                    {"kind": "strategy", "strategy": "pipeline_parallel", "schedule": schedule, "m": m},
                    [0.1], bubble_fraction=bubble, bubble_fraction_theory=theory)
    return {"group": "pp", "ranks": 2, "env": {}, "error": None, "result": {
        "steps": 3, "rounds": 1, "cases": [
            pp("zb-h1", 4, 0.15, 0.1), pp("1f1b", 4, 0.3, 0.2), pp("zb-h1", 2, 0.25, 0.2),
            case("model_parallel.py", {"kind": "strategy", "strategy": "model_parallel"}, [0.1],
                 idle_fraction=[0.4, 0.6]),
            case("torch.distributed.pipelining Schedule1F1B, M = 4",
                 {"kind": "peer", "schedule": "1f1b", "m": 4}, [0.2])]}}


def test_the_bubble_picture_takes_every_schedule_found_in_the_results():
    importlib.import_module("bench.run")  # puts bench/ on the path, as `python bench/run.py` does
    import plots
    series, model = plots.bubble_series([pipeline_job()] + runs([0.02, 0.02, 0.02]))
    assert series == {2: {"zb-h1": [(2, 0.25, 0.2), (4, 0.15, 0.1)], "1f1b": [(4, 0.3, 0.2)]}}
    assert model == {2: (0.5, 0.5)}
    # The scaling picture: speedup paired by round against N = 1 on one thread (0.020 / 0.011).
    points = plots.scaling_series(runs([0.02, 0.02, 0.02]))["data_parallel.py"]
    assert [(n, t) for n, t, *_ in points] == [(1, 1), (1, 2), (2, 1), (4, 1)]
    assert points[2][2] == pytest.approx(11.0) and points[2][5] == pytest.approx(0.020 / 0.011)


def test_the_timeline_picture_takes_the_median_step_of_every_rank():
    importlib.import_module("bench.run")
    import plots

    def x(rank, name, cat, start, end):  # milliseconds here; microseconds in the trace, as --trace writes
        return {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": 0, "ts": 1e3 * start,
                "dur": 1e3 * (end - start)}

    def step(at, wait):  # rank 1 waits `wait` ms for rank 0's forward; steps begin at `at` ms
        return [x(0, "F0", "compute", at, at + 1), x(0, "send", "comm", at + 1, at + 1.01),
                x(0, "wait recv", "idle", at + 1.01, at + 2 + wait),
                x(0, "B0", "compute", at + 2 + wait, at + 3 + wait),
                x(0, "W0", "compute", at + 3 + wait, at + 3.5 + wait),
                x(0, "optimizer", "compute", at + 3.5 + wait, at + 3.6 + wait),
                x(1, "wait recv", "idle", at - 0.5, at + 1 + wait),
                x(1, "F0", "compute", at + 1 + wait, at + 1.5 + wait),
                x(1, "B0", "compute", at + 1.5 + wait, at + 2 + wait),
                x(1, "optimizer", "compute", at + 2 + wait, at + 2.1 + wait)]
    # Steps of 4.1 + wait ms: the first is left out, then 13.1, 8.1, 11.1 ms: step 4 is the median.
    trace = {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}}]
             + step(0.5, 50) + step(100, 9) + step(200, 4) + step(300, 7)}
    steps, k, count = plots.median_step(trace)
    assert (k, count) == (4, 4)
    assert [(name, kind) for name, kind, _, _ in steps[0]] == [
        ("F0", "forward"), ("send", "send / receive"), ("wait recv", "waiting for a peer"),
        ("B0", "backward"), ("W0", "weight gradient"), ("optimizer", "optimizer")]
    # Rank 1's step starts first (at 299.5 ms), waiting for rank 0's forward: the origin.
    assert [(name, round(s, 3), round(e, 3)) for name, _, s, e in steps[1]] == [
        ("wait recv", 0.0, 8.5), ("F0", 8.5, 9.0), ("B0", 9.0, 9.5), ("optimizer", 9.5, 9.6)]
    assert (round(steps[0][0][2], 3), round(steps[0][-1][3], 3)) == (0.5, 11.1)


def test_the_step_drawn_from_the_saved_trace_holds_every_micro_batch_once_on_every_rank():
    from bench import run
    import plots
    trace = json.loads((run.HERE / "results-trace.json").read_text())
    flags = trace["otherData"]["command"].split()
    ranks, m = int(flags[flags.index("-np") + 1]), int(flags[flags.index("--micro-batches") + 1])
    steps, k, count = plots.median_step(trace)
    assert sorted(steps) == list(range(ranks)) and 1 < k <= count
    for spans in steps.values():
        names = sorted(name for name, kind, _, _ in spans if kind in ("forward", "backward", "optimizer"))
        assert names == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)] + ["optimizer"])


def saved_results(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {**META, "trace": {"file": "results-trace.json", "error": None}},
                                "runs": [pipeline_job()] + runs([0.02, 0.02, 0.02])}))
    return path


def test_without_matplotlib_the_tables_are_written_and_one_line_says_the_pictures_were_skipped(
        tmp_path, monkeypatch, capsys):
    from bench import run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert run.main(["--from-json", str(saved_results(tmp_path))]) == 0
    out, err = capsys.readouterr()
    assert "## Scaling" in out
    assert [line for line in err.splitlines() if "pictures" in line] == [
        "pictures skipped: matplotlib is not installed (pip install -r bench/requirements.txt)"]
    assert not list(tmp_path.glob("*.png"))


def test_the_pictures_are_drawn_from_saved_results(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    if world().Get_rank() != 0:  # once is enough: under mpirun the ranks would share the cores
        pytest.skip("drawn on rank 0")
    from bench import run
    path = saved_results(tmp_path)
    (tmp_path / "results-timeline.png").write_bytes(b"a picture of an older run")
    assert run.main(["--from-json", str(path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["results-bubble.png", "results-scaling.png"]
    (tmp_path / "results-trace.json").write_text(json.dumps({"traceEvents": [
        {"name": n, "cat": "compute", "ph": "X", "pid": 0, "tid": 0, "ts": s, "dur": 1000}
        for n, s in (("F0", 0), ("B0", 1000), ("optimizer", 2000))]}))
    assert run.main(["--from-json", str(path)]) == 0
    pictures = sorted(tmp_path.glob("*.png"))
    assert [p.name for p in pictures] == ["results-bubble.png", "results-scaling.png", "results-timeline.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pictures)


def test_groups_picks_the_jobs_of_the_mode_that_hold_them_and_an_unknown_group_is_one_line(capsys):
    sys.path.insert(0, str(importlib.import_module("harness").ROOT / "bench"))
    run = importlib.import_module("run")
    assert run.main(["--groups", "large,nope"]) == 2
    assert capsys.readouterr().err.startswith("error: --groups: no group nope; the groups are dp, pp,")
    assert [j.groups for j in run.plan("full") if "large" in j.groups] == [("large",)]
