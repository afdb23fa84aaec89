"""plan.py: its bytes per axis equal what the strategy files' runs hand to MPI, exactly; its memory
per rank bounds their measured peaks; its step time, calibrated on one run, predicts the others;
and its command line refuses what cannot be, in one line.

The launches (end to end, rank 0 alone, after every in-process test) are tiny models in float32,
one each, shared by every assertion about them through one module-scoped fixture."""
import dataclasses
import json
import subprocess
import sys

import pytest

import plan
from harness import ROOT, clean_env, last_json, launch

TINY = ["--hidden", "16", "--heads", "2", "--steps", "3", "--no-check", "--json"]
# name: (script, ranks, flags, plan's model, plan's grid, global batch)
RUNS = {
    "hybrid 2x2x2": ("hybrid_parallel.py", 8, ["--pp", "2", "--dp", "2", "--tp", "2", "--layers", "3", "--seq-len", "16",
                                              "--batch-size", "8", "--micro-batches", "2"],
                     plan.Model(3, 16, 2, 16), plan.Grid(dp=2, tp=2, pp=2, micro=2), 8),
    "pipeline zbv N=3": ("pipeline_parallel.py", 3, ["--layers", "6", "--seq-len", "16", "--schedule", "zbv",
                                                     "--micro-batches", "3", "--batch-size", "6"],
                         plan.Model(6, 16, 2, 16), plan.Grid(pp=3, micro=3, schedule="zbv"), 6),
    "tensor sp N=2": ("tensor_parallel.py", 2, ["--layers", "2", "--seq-len", "16", "--sequence-parallel",
                                                "--batch-size", "4", "--sample-chars", "0"],
                      plan.Model(2, 16, 2, 16), plan.Grid(tp=2, sp=True), 4),
    "zero 3 N=3": ("sharded_data_parallel.py", 3, ["--layers", "2", "--seq-len", "16", "--zero-stage", "3",
                                                   "--batch-size", "6"],
                   plan.Model(2, 16, 2, 16, key_bias=False), plan.Grid(dp=3, zero=3), 6),
    "context ring N=3": ("context_parallel.py", 3, ["--layers", "2", "--seq-len", "18", "--batch-size", "2"],
                         plan.Model(2, 16, 2, 18), plan.Grid(cp=3), 2),
    "expert ep=2 N=4": ("expert_parallel.py", 4, ["--layers", "2", "--seq-len", "16", "--ep", "2", "--experts", "4",
                                                  "--top-k", "2", "--batch-size", "8"],
                        plan.Model(2, 16, 2, 16, experts=4, top_k=2), plan.Grid(dp=4, ep=2), 8),
}


@pytest.fixture(scope="module")
def measured():
    """Every run of RUNS, launched once: name -> its --json object."""
    return {name: last_json(launch(script, n, *TINY, *flags)) for name, (script, n, flags, *_) in RUNS.items()}


def predicted_total(name):
    """plan.py's bytes for a run, counted as the file counts them: summed over the grid (hybrid,
    pipeline), per rank (tensor, ZeRO), the busiest rank (context), the mean over ranks (expert)."""
    _, n, _, model, grid, batch = RUNS[name]
    busiest, total = plan.grid_bytes(model, grid, batch, "fp32")
    if name.startswith(("hybrid", "pipeline")):
        return total
    if name.startswith("expert"):
        return {axis: b / n for axis, b in total.items()}
    return busiest


@pytest.mark.e2e
@pytest.mark.parametrize("name", RUNS)
def test_bytes_per_axis_equal_the_measured(measured, name):
    run, predicted = measured[name], predicted_total(name)
    if name.startswith("hybrid"):   # the file measures each axis apart
        by_axis = run["comm_bytes_per_step_by_axis"]
        assert by_axis == {a: predicted[a] for a in by_axis}
        assert all(predicted[a] == 0 for a in predicted if a not in by_axis)
    else:
        assert run["comm_bytes_per_step"] == sum(predicted.values()), predicted
    assert sum(1 for b in predicted.values() if b) >= 1  # the run moved something plan.py predicts


def test_a_planted_error_in_the_formulas_shows(monkeypatch):
    """Not padding the vocabulary to a multiple of tp, and forgetting sharded_data_parallel.py's
    missing key bias, each move the predicted bytes off the files' (the values the e2e test holds)."""
    _, _, _, model, grid, batch = RUNS["hybrid 2x2x2"]
    right = plan.grid_bytes(model, grid, batch, "fp32")[1]["data"]
    monkeypatch.setattr(plan, "padded_vocab", lambda vocab, tp: vocab + 1)
    assert plan.grid_bytes(model, grid, batch, "fp32")[1]["data"] != right
    monkeypatch.undo()
    _, _, _, model, grid, batch = RUNS["zero 3 N=3"]
    with_key_bias = plan.Model(2, 16, 2, 16, key_bias=True)
    assert plan.grid_bytes(with_key_bias, grid, batch, "fp32")[0] != plan.grid_bytes(model, grid, batch, "fp32")[0]


def test_the_hybrid_parameters_are_its_docstrings_W():
    """hybrid_parallel.py: W = 2 V_pad h + S h + L(12h^2 + 13h) + 2h + (T - 1)(S h + 6 L h + 2 h), summed
    over a replica's GPUs; plan.py's stage layers add up to it on every grid of up to 8."""
    for L, h, S, T, P in [(3, 16, 16, 2, 2), (5, 64, 32, 4, 3), (4, 32, 8, 1, 4), (7, 48, 24, 3, 2)]:
        m, g = plan.Model(L, h, 12, S), plan.Grid(tp=T, pp=P)
        W = 2 * plan.padded_vocab(128, T) * h + S * h + L * (12 * h * h + 13 * h) + 2 * h + (T - 1) * (S * h + 6 * L * h + 2 * h)
        assert T * sum(d + x for s in range(P) for d, x in plan.stage_layers(m, g, s)) == W


# -----------------------------------------------------------------------------
# The command line
# -----------------------------------------------------------------------------
def run_plan(*args):
    return subprocess.run([sys.executable, str(ROOT / "plan.py"), *map(str, args)], capture_output=True, text=True,
                          env=clean_env(), timeout=120)


GPT3 = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--seq-len", "2048", "--vocab", "51200"]


@pytest.mark.e2e
@pytest.mark.parametrize("grid,words", [
    ("dp=2,tp=5,pp=1", "tp=5 does not divide --heads 96"),
    ("dp=2,tp=8,pp=8", "dp x tp x pp x cp = 128 GPUs, not the 64 given"),
    ("dp=1,tp=8,pp=8,micro=5", "does not split into dp=1 replicas x micro=5"),
    ("dp=1,tp=8,pp=8,zero=4", "zero=4 must be 0, 1, 2 or 3"),
    ("dp=1,tp=8,pq=8", "--grid takes key=value pairs"),
])
def test_an_impossible_grid_is_refused_in_one_line(grid, words):
    result = run_plan(*GPT3, "--batch-size", "64", "--gpus", "64", "--grid", grid)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr


@pytest.mark.e2e
def test_a_model_that_fits_no_grid_says_how_many_gpus_it_needs():
    result = run_plan(*GPT3, "--batch-size", "64", "--gpus", "8", "--gpu", "a100")
    assert result.returncode == 2 and result.stdout == ""
    line = result.stderr.strip()
    assert line.startswith("error: no grid of 8 a100 GPUs fits") and "it would need" in line, line
    need = int(line.split("it would need ")[1].split()[0])
    fits = json.loads(run_plan(*GPT3, "--batch-size", "64", "--gpus", need, "--gpu", "a100", "--json").stdout)
    assert fits["plans"] and all(p["fits"] for p in fits["plans"])


@pytest.mark.e2e
def test_json_plans_fit_and_come_best_first():
    out = run_plan(*GPT3, "--batch-size", "1536", "--gpus", "1024", "--gpu", "a100", "--json", "--top", "5")
    plans = json.loads(out.stdout.strip().splitlines()[-1])["plans"]
    assert len(plans) == 5
    assert [p["step_seconds"] for p in plans] == sorted(p["step_seconds"] for p in plans)
    for p in plans:
        assert p["fits"] and p["memory_bytes_per_gpu"]["total"] <= 0.9 * plan.PRESETS["a100"].hbm
        assert set(p["bytes_per_step"]) == {"data", "tensor", "pipeline", "context", "expert"}
        assert {"grid", "bubble", "step_seconds", "mfu", "tokens_per_second_per_gpu"} <= set(p)
        g = p["grid"]
        assert g["dp"] * g["tp"] * g["pp"] * g["cp"] == 1024


# -----------------------------------------------------------------------------
# Memory and step time: against the same runs, and the quiet full benchmark's (bench/results.json)
# -----------------------------------------------------------------------------
# The measured peak (the resident set over training less the baseline before the model) holds what
# plan.py counts plus the process's own memory (MPI's buffers, autograd's temporaries), and misses
# what a step never holds at once (the momentum appears after the first backward, whose activations
# are gone by then). Seen: in the tiny runs above, peaks 2.6 to 5.7 MB where plan.py counts 0.07 to
# 0.4 MB (the largest excess 5.25 and 5.41 MB in two launches, expert_parallel.py's rank 0: 6 MB
# leaves 0.6 MB for a run's variation); in the larger GPT of the benchmark, from 7% below plan.py
# (tensor_parallel.py, N = 2) to 5% above (ZeRO stage 1); launched at 4 x 128 hidden (batch 16 x 64),
# tensor N = 1 and 2 and 1F1B N = 2 were 3 to 5 MB above it.
MEMORY_BOUND = 0.10, 6e6   # |measured - plan| <= 10% of plan + 6 MB
# Step time, calibrated on the benchmark's tensor_parallel.py (N = 2, 1 thread a rank on 2 cores, load
# about 4), predicts its 1F1B at -4.7%, ZeRO stage 1 at +12.1% and stage 3 at -7.7% of the measured
# median (their rounds spread 8 to 15%).
TIME_ERROR = 0.15

BENCH = ROOT / "bench" / "results.json"
LARGE = plan.Model(4, 256, 4, 32)   # the benchmark's larger GPT (bench/results.json, group "large")
# label: (plan's model, the file's default batch, its optimizer)
LARGE_RUNS = {"tensor_parallel.py": (LARGE, 16, "sgd"),
              "pipeline_parallel.py --schedule 1f1b --micro-batches 4": (LARGE, 16, "sgd"),
              "sharded_data_parallel.py --zero-stage 1": (dataclasses.replace(LARGE, key_bias=False), 24, "adam"),
              "sharded_data_parallel.py --zero-stage 3": (dataclasses.replace(LARGE, key_bias=False), 24, "adam")}


def bench_large():
    runs = json.loads(BENCH.read_text())["runs"]
    group = next(r for r in runs if r["group"] == "large")
    return {c["label"]: c["result"] for c in group["result"]["cases"] if c["label"] in LARGE_RUNS}


def within_memory_bound(predicted, peak):
    return abs(peak - predicted) <= MEMORY_BOUND[0] * predicted + MEMORY_BOUND[1]


def test_memory_per_rank_bounds_the_benchmarks_peaks():
    runs = bench_large()
    assert set(runs) == set(LARGE_RUNS)
    for label, result in runs.items():
        model, batch, optimizer = LARGE_RUNS[label]
        grid = plan.grid_of_run(result)
        predicted = [plan.memory(model, grid, batch, "fp32", "none", optimizer, s)["total"] for s in range(grid.pp)]
        for rank, peak in enumerate(result["peak_memory_bytes_per_rank"]):
            assert within_memory_bound(predicted[rank * grid.pp // result["world_size"]], peak), (label, rank, peak)


def test_a_memory_formula_without_activations_breaks_the_bound(monkeypatch):
    """The planted error: activations forgotten (22.7 of the 42 MB), the bound fails on the benchmark's
    tensor run."""
    result = bench_large()["tensor_parallel.py"]
    monkeypatch.setattr(plan, "block_activations", lambda *a: 0)
    predicted = plan.memory(LARGE, plan.grid_of_run(result), 16, "fp32", "none", "sgd", 0)["total"]
    assert not within_memory_bound(predicted, result["peak_memory_bytes_per_rank"][0])


@pytest.mark.e2e
@pytest.mark.parametrize("name", RUNS)
def test_memory_per_rank_bounds_the_measured_peak(measured, name):
    _, n, _, model, grid, batch = RUNS[name]
    optimizer = "adam" if name.startswith("zero") else "sgd"
    predicted = [plan.memory(model, grid, batch, "fp32", "none", optimizer, s)["total"] for s in range(grid.pp)]
    for rank, peak in enumerate(measured[name]["peak_memory_bytes_per_rank"]):
        stage = rank // (n // grid.pp)   # the files put a stage's ranks together (pipeline outermost)
        assert within_memory_bound(predicted[stage], peak), (name, rank, predicted[stage], peak)


def test_step_time_calibrated_on_one_run_predicts_the_others():
    runs = bench_large()
    base = runs["tensor_parallel.py"]
    cores = json.loads(BENCH.read_text())["meta"]["machine"]["cores"]
    rate = plan.calibrate(LARGE, plan.grid_of_run(base), 16, base, "fp32", "none", "sgd", cores=cores)
    errors = {}
    for label, result in runs.items():
        model, batch, optimizer = LARGE_RUNS[label]
        predicted = plan.step_time(model, plan.grid_of_run(result), batch, "fp32", "none",
                                   plan.cpu_hardware(rate, cores), 1.0, optimizer)["total"]
        errors[label] = (predicted - result["step_time_s"]) / result["step_time_s"]
    assert abs(errors.pop("tensor_parallel.py")) < 1e-6   # the calibration itself
    assert all(abs(e) <= TIME_ERROR for e in errors.values()), errors


@pytest.mark.e2e
def test_calibration_from_a_runs_json_on_the_command_line(tmp_path):
    """--gpu cpu --calibrate RUN.json: the run's own grid then predicts the run's own step."""
    base = bench_large()["tensor_parallel.py"]
    (tmp_path / "run.json").write_text(json.dumps(base))
    out = run_plan("--layers", 4, "--hidden", 256, "--heads", 4, "--seq-len", 32, "--batch-size", 16, "--gpu", "cpu",
                   "--calibrate", tmp_path / "run.json", "--precision", "fp32", "--optimizer", "sgd",
                   "--grid", "tp=2", "--json")
    step = json.loads(out.stdout.strip().splitlines()[-1])["plans"][0]["step_seconds"]
    # this machine's cores may differ from the benchmark's 2: the rate is per core, the grid's the same
    assert step == pytest.approx(base["step_time_s"], rel=1e-6) or plan.machine_cores() != 2


# -----------------------------------------------------------------------------
# The README: its sample output and its comparison with Narayanan et al. 2021 are plan.py's own
# -----------------------------------------------------------------------------
def readme_section():
    text = (ROOT / "README.md").read_text()
    return text[text.index("### Which grid? `plan.py`"):text.index("## When things go wrong")]


@pytest.mark.e2e
def test_the_readme_sample_is_what_plan_py_prints():
    section = readme_section()
    blocks = section.split("```")
    command, output = blocks[1].strip().removeprefix("sh\n"), blocks[3].strip("\n")
    assert command.startswith("python plan.py ")
    assert run_plan(*command.split()[2:]).stdout.rstrip("\n") == output


def test_the_readme_comparison_is_what_plan_py_predicts():
    """Each row of the table: the paper's grid in, plan.py's TFLOP/s per GPU, bubble and memory out."""
    rows = [line.split("|")[1:-1] for line in readme_section().splitlines() if line.startswith("| ") and " B |" in line]
    assert len(rows) == 10
    for params, shape, grid, batch, paper, predicted, ratio, bubble, memory in rows:
        layers, rest = shape.split(" x ")
        hidden, heads = rest.split(" (")
        gpus, split = grid.split(": ")
        dp, tp, pp = map(int, split.split(" x "))
        batch = int(batch.replace(",", ""))
        model = plan.Model(int(layers), int(hidden), int(heads.rstrip(") ")), 2048, 51200)
        out = plan.evaluate(model, plan.Grid(dp=dp, tp=tp, pp=pp, micro=batch // dp), batch, "bf16", "full",
                            plan.PRESETS["a100"], 0.6, "adam", 0.9)
        assert dp * tp * pp == int(gpus.replace(",", "")) and out["fits"]
        assert f"{out['tflops_per_gpu']:.0f}" == predicted.strip()
        assert f"{out['tflops_per_gpu'] / float(paper):.2f}" == ratio.strip()
        assert f"{100 * out['bubble']:.1f}%" == bubble.strip()
        assert f"{out['memory_bytes_per_gpu']['total'] / 1e9:.1f}" == memory.strip()
