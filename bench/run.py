"""Benchmark every strategy against its peers and the machine's limit; print and save the table.

    python bench/run.py              # the full table, under 45 minutes on 2 CPU cores
    python bench/run.py --quick      # a smoke test in about three minutes (2 ranks, one round)
    python bench/run.py --gpu        # every strategy on --device cuda with --check, one GPU

Each measurement is one `mpirun -np N python bench/worker.py GROUP` job, started from this plain
process with the MPI environment removed and a time limit, so that it runs as a user's job would
and a hung job cannot hang the benchmark. Inside a job the strategy scripts and their peers take
turns, round after round, so that every ratio is taken between runs on the same ranks at the
same time. The table goes to standard output and to bench/results.md, the raw numbers to
bench/results.json, and one short pipeline_parallel.py --trace run to bench/results-trace.json;
the pictures drawn from them (bench/plots.py, with matplotlib) to bench/results-*.png.
"""
import argparse
import collections
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
from harness import clean_env  # noqa: E402  (the tests' rule for a clean MPI environment)
import report  # noqa: E402
import plots  # noqa: E402  (imports matplotlib only when it draws)

BUDGET = {"full": 2700, "quick": 240, "gpu": 420}  # seconds, the traced run included: no job runs past them
MODE_ENV = {}  # for every job of a mode (the GPU jobs set their transport one by one)
KEEP_GPUS = []  # set by --gpu: the jobs see this machine's GPUs (the tests' environment hides them)
MIN_JOB_SECONDS = 20
STRATEGIES = ("data_parallel", "pipeline_parallel", "model_parallel", "tensor_parallel",
              "sharded_data_parallel", "hybrid_parallel", "context_parallel", "expert_parallel")
GROUP_NEEDS = {"dp": ("data_parallel",), "pp": ("pipeline_parallel", "model_parallel"),
               "tp": ("tensor_parallel",), "zero": ("sharded_data_parallel",), "hybrid": ("hybrid_parallel",),
               "cp": ("context_parallel",), "ep": ("expert_parallel",), "scaling": STRATEGIES[:4],
               "transport": STRATEGIES, "large": ("tensor_parallel", "pipeline_parallel", "sharded_data_parallel"),
               "precision": STRATEGIES, "matrix": ("hybrid_parallel",)}


Job = collections.namedtuple("Job", "groups ranks flags env seconds timeout")

# The run one step of which the timeline picture shows: 2 ranks, so that on 2 cores the waits drawn
# are the schedule's and not the ranks taking turns on a core.
TRACE_RANKS = 2
TRACE_FLAGS = ["--layers", "8", "--schedule", "1f1b", "--micro-batches", "8", "--steps", "5"]  # as the pp group
TRACE_TIMEOUT = 120  # seconds


def plan(mode):
    """The jobs of a mode. seconds: the job starts no new round past it (at least one round
    runs), so that on a busy machine the run keeps to its budget with fewer rounds; timeout: the
    job is killed past it."""
    if mode == "quick":
        flags = ["--rounds", "1", "--steps", "5", "--collective-reps", "20", "--bare-seconds", "0.1",
                 "--micro-batches", "2,8"]
        return [Job(("dp", "pp", "tp", "zero", "cp", "ep", "scaling", "transport"), 2, flags, {}, 60, 230)]
    if mode == "gpu":  # peers apart, so that one failing cannot take a strategy's rows with it
        # Every strategy with --check at 2 and 4 ranks (ranks may share a GPU), in both transports:
        # staged through host memory, and as the library decides (direct where it is CUDA-aware).
        flags = ["--rounds", "1", "--steps", "6", "--device", "cuda", "--micro-batches", "4"]
        jobs = []
        for transport in ({"MPI_CUDA_AWARE": 0}, {}):
            for n in (2, 4):
                jobs += [Job((g,), n, flags + ["--cases", "strategies", "--check"], transport, 30, 90)
                         for g in ("dp", "pp", "tp", "zero")]
        # hybrid: its 2 x 2 x 2 grid beside the one-axis grids, 8 ranks on the GPU(s)
        jobs += [Job(("hybrid",), 8, flags + ["--cases", "strategies", "--check"], transport, 40, 150)
                 for transport in ({"MPI_CUDA_AWARE": 0}, {})]
        return jobs + [Job(("dp", "pp", "tp"), 2, flags + ["--cases", "peers"], {}, 40, 120)]
    jobs = [Job(("scaling",), 4, ["--rounds", "3", "--steps", "5"], {}, 90, 300)]
    # Every job that draws a verdict runs MIN_ROUNDS rounds (report.py's rule needs them); its seconds
    # are what they took on 2 quiet cores (the run of 2026-12-02, scaled by the cases added since) plus
    # a quarter.
    for n, more in ((2, 0), (4, 1)):  # 4 ranks on 2 cores run slower: more time
        # pp: five schedules at M = N, 2N, 4N, model_parallel.py and five torch schedules: 21 cases a
        # round, on 8 blocks
        # tp: plain and sequence-parallel, each beside torch's; zero: stages 2 and 3 also with
        # --no-overlap; cp: 5 runs a round (ring, all-gather, all-to-all, contiguous, ring with --no-overlap)
        # dp, pp, tp, zero: also each compared run's exchanges replayed bare on both transports, and
        # each compared run again on gloo (pp: all five schedules at torch's M)
        rounds = ["--rounds", str(report.MIN_ROUNDS)]
        jobs += [Job(("transport",), n, ["--rounds", "3"], {}, 25, 120),
                 Job(("dp",), n, ["--rounds", "10", "--steps", "16"], {}, 85 + 50 * more, 360),
                 Job(("pp",), n, [*rounds, "--steps", "5"], {}, 195 + 170 * more, 420 + 180 * more),
                 Job(("tp",), n, [*rounds, "--steps", "6"], {}, 80 + 120 * more, 300),
                 Job(("zero",), n, [*rounds, "--steps", "4"], {}, 75 + 60 * more, 300),
                 Job(("cp",), n, [*rounds, "--steps", "4"], {}, 90 + 50 * more, 240),
                 Job(("ep",), n, [*rounds, "--steps", "6"], {}, 40 + 25 * more, 150)]
    # The larger GPT: each strategy with a peer, one row each, at N = 2 (two ranks on the two cores).
    jobs.append(Job(("large",), 2, ["--rounds", str(report.MIN_ROUNDS), "--steps", "3"], {}, 170, 420))
    # The 2 x 2 x 2 grid beside the one-axis grids, 8 ranks on the machine's cores.
    jobs.append(Job(("hybrid",), 8, ["--rounds", str(report.MIN_ROUNDS), "--steps", "4"], {}, 95, 240))
    # Every script in fp32 and bf16, and with --recompute selective and full, at N = 2.
    jobs.append(Job(("precision",), 2, ["--rounds", "2", "--steps", "4", "--check"], {}, 150, 420))
    # The exactness matrix: hybrid_parallel.py with --check on every grid from one axis to all five, in
    # one 16-rank job (each grid on its first N ranks, the others asleep); one round: differences, not ratios.
    jobs.append(Job(("matrix",), 16, ["--rounds", "1", "--steps", "3", "--check"], {}, 60, 900))
    # MPICH's progress thread moves non-blocking collectives on while backward computes.
    jobs.append(Job(("dp",), 2, ["--rounds", str(report.MIN_ROUNDS), "--steps", "12", "--without-gloo"],
                    {"MPIR_CVAR_ASYNC_PROGRESS": 1}, 60, 240))
    return jobs


def launch(script, ranks, args, env, timeout):
    """mpirun -np RANKS python SCRIPT ARGS with the MPI environment removed, killed as a whole
    (mpirun, its proxies and the ranks) after `timeout` seconds. Returns (stdout, error)."""
    cmd = ["mpirun", "-np", str(ranks), sys.executable, str(script), *map(str, args)]
    environment = clean_env(**env)
    if KEEP_GPUS:
        environment.pop("CUDA_VISIBLE_DEVICES")
        environment.update({k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        return None, f"exit {proc.returncode}: {lines[-1][:300] if lines else 'no message'}"
    return out, None


def merge(runs):
    """One entry per group, world size and environment: the cases of jobs split apart, joined."""
    merged = {}
    for run in runs:
        key = (run["group"], run["ranks"], tuple(sorted(run["env"].items())))
        if key not in merged:
            merged[key] = run
        elif run["result"]:
            first = merged[key]
            if first["result"]:
                first["result"]["cases"] += run["result"]["cases"]
            else:
                first["result"] = run["result"]
            first["error"] = first["error"] or run["error"]
        else:
            merged[key]["error"] = merged[key]["error"] or run["error"]
    return list(merged.values())


def record_trace(mode, path, seconds_left):
    """One short pipeline_parallel.py run with --trace FILE, for the timeline picture; the command
    is kept in the trace's otherData. Returns an error line, or None."""
    path.unlink(missing_ok=True)  # never a picture of an older run under this one's name
    if not present("pipeline_parallel"):
        return "pipeline_parallel.py is not in this checkout"
    if seconds_left < MIN_JOB_SECONDS:
        return f"not run: the {BUDGET[mode]} s budget of the whole run was spent"
    ranks, flags = TRACE_RANKS, TRACE_FLAGS + ["--device", "cuda" if mode == "gpu" else "cpu"]
    load = load_average()
    _, error = launch(ROOT / "pipeline_parallel.py", ranks,
                      [*flags, "--no-check", "--log-every", 10 ** 6, "--trace", path.resolve()],
                      MODE_ENV.get(mode, {}), min(TRACE_TIMEOUT, seconds_left))
    if error is not None:
        path.unlink(missing_ok=True)
    else:
        trace = json.loads(path.read_text())
        command = f"mpirun -np {ranks} python pipeline_parallel.py " + " ".join(flags)
        path.write_text(json.dumps({**trace, "otherData": {"command": command,
                                                            "load": [load, load_average()]}}))
    return error


def pictures(meta, runs, trace, stem):
    """Draw what can be drawn; without matplotlib, one line says the pictures were skipped."""
    try:
        written = plots.draw(meta, runs, trace, stem)
    except ImportError:
        print("pictures skipped: matplotlib is not installed (pip install -r bench/requirements.txt)",
              file=sys.stderr)
        return
    print("pictures: " + (", ".join(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
                                    for p in written) or "none (no numbers to draw)"), file=sys.stderr)


def present(name):
    """Is the strategy file in this checkout? (Benchmarks run on what the repository holds.)"""
    return (ROOT / f"{name}.py").is_file()


def load_average():
    """The 1-minute load average: how busy the (shared) machine was around a job."""
    return round(os.getloadavg()[0], 1) if hasattr(os, "getloadavg") else None


def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor()) if os.path.exists("/proc/cpuinfo") \
        else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "load": load_average(), "python": platform.python_version(),
            "platform": platform.platform(terse=True)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smoke test: 2 ranks, one short round")
    mode.add_argument("--gpu", action="store_true", help="--device cuda, with --check, at 2 and 4 ranks, staged and direct")
    p.add_argument("--out", default=None, help="markdown file (default: bench/results[-quick|-gpu][-GROUPS].md)")
    p.add_argument("--groups", default=None, metavar="G,G", help="only the jobs of the mode that hold these "
                   f"groups, e.g. large or dp,zero (of {', '.join(GROUP_NEEDS)})")
    p.add_argument("--ranks", type=int, default=None, help="only the jobs of this world size")
    p.add_argument("--from-json", metavar="FILE", help="measure nothing: print the table of a saved "
                   "results.json and draw its pictures beside it (with FILE-trace.json's timeline)")
    args = p.parse_args(argv)
    if args.from_json:
        path = Path(args.from_json)
        saved = json.loads(path.read_text())
        print(report.render(saved["meta"], saved["runs"]))
        pictures(saved["meta"], saved["runs"], path.with_name(f"{path.stem}-trace.json"),
                 path.with_suffix(""))
        return 0
    name = "quick" if args.quick else "gpu" if args.gpu else "full"
    only = args.groups.split(",") if args.groups else None
    if only and set(only) - set(GROUP_NEEDS):
        print(f"error: --groups: no group {', '.join(sorted(set(only) - set(GROUP_NEEDS)))}; the groups are "
              f"{', '.join(GROUP_NEEDS)}", file=sys.stderr)
        return 2
    suffix = (("" if name == "full" else "-" + name) + ("-" + "-".join(only) if only else "")
              + (f"-np{args.ranks}" if args.ranks else ""))
    out = Path(args.out) if args.out else HERE / f"results{suffix}.md"

    import torch  # the versions for the header, from the interpreter the jobs run with
    if args.gpu and not torch.cuda.is_available():
        print("error: --gpu: torch sees no CUDA device on this machine; run python bench/run.py "
              "(the CPU) here, or --gpu where there is a GPU", file=sys.stderr)
        return 2
    if args.gpu:
        KEEP_GPUS.append(True)
    start = time.perf_counter()
    meta = {"mode": name, "date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
            "command": "python bench/run.py" + ("" if name == "full" else f" --{name}")
                       + (f" --groups {args.groups}" if only else "") + (f" --ranks {args.ranks}" if args.ranks else ""),
            "torch": torch.__version__, "machine": machine(),
            "environment": {k: str(v) for k, v in MODE_ENV.get(name, {}).items()},
            "missing": [s for s in STRATEGIES if not present(s)]}
    runs = []
    for job in plan(name):
        if args.ranks and job.ranks != args.ranks:
            continue
        groups = [g for g in job.groups if any(present(s) for s in GROUP_NEEDS[g]) and (not only or g in only)]
        if not groups:
            continue
        label = f"{' '.join(groups)} -np {job.ranks}" + "".join(f" {k}={v}" for k, v in job.env.items())
        print(f"[{time.perf_counter() - start:5.0f} s] {label} ...", file=sys.stderr, flush=True)
        began, load = time.perf_counter(), load_average()
        left = BUDGET[name] - (began - start)
        if left < MIN_JOB_SECONDS:
            stdout, error = None, f"not run: the {BUDGET[name]} s budget of the whole run was spent"
        else:  # rounds stop at half of what is left, so that the last round can end in time
            seconds = min(job.seconds, left / 2)
            stdout, error = launch(HERE / "worker.py", job.ranks,
                                   [*groups, *job.flags, "--seconds", f"{seconds:.0f}"],
                                   {**MODE_ENV.get(name, {}), **job.env}, min(job.timeout, left))
        result = None
        if stdout is not None:
            try:
                result = json.loads(stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                error = "no JSON on the last line of the job's output"
        if error:
            print(f"         {label}: {error}", file=sys.stderr, flush=True)
        for group in groups:  # one entry per group, as the report reads them
            layout = {k: v for k, v in (result or {}).items() if k != "groups"}
            runs.append({"group": group, "ranks": job.ranks, "env": {k: str(v) for k, v in job.env.items()},
                         "result": {**layout, **result["groups"][group]} if result else None,
                         "error": error, "seconds": time.perf_counter() - began,
                         "load": [load, load_average()]})
    # Last, in what is left of the budget: the tables come first, the timeline picture after.
    trace = out.with_name(f"{out.stem}-trace.json")
    trace_error = None
    if (not only or "pp" in only) and args.ranks in (None, TRACE_RANKS):  # the timeline is the pipeline's
        print(f"[{time.perf_counter() - start:5.0f} s] pipeline_parallel.py --trace for the timeline picture ...",
              file=sys.stderr, flush=True)
        trace_error = record_trace(name, trace, BUDGET[name] - (time.perf_counter() - start))
    meta["trace"] = {"file": trace.name, "error": trace_error}
    if trace_error:
        print(f"         pipeline_parallel.py --trace: {trace_error}", file=sys.stderr, flush=True)
    meta["seconds"] = time.perf_counter() - start
    runs = merge(runs)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    table = report.render(meta, runs)
    print(table)
    out.write_text(table)
    print(f"written: {out} and {out.with_suffix('.json')} ({meta['seconds']:.0f} s)", file=sys.stderr)
    pictures(meta, runs, trace, out.with_suffix(""))
    return 0 if all(r["error"] is None for r in runs) and trace_error is None else 1


if __name__ == "__main__":
    sys.exit(main())
