"""The first run on a GPU node: one command, at most 8 minutes, one markdown table.

    bash bench/gpu_smoke.sh            (or python bench/gpu_smoke.py [--out FILE])

First the facts every row depends on: whether torch sees the GPUs that nvidia-smi lists (if not,
it says so and exits with status 1), whether the mpirun on PATH belongs to the MPI library that
mpi4py loaded, and whether that library reads GPU memory. Rows: every strategy file with
--device cuda --check at small sizes (context and expert parallelism first, the newest paths,
then three in bf16 with recomputation: the precision a GPU run trains in), staged through host memory (MPI_CUDA_AWARE=0) and again direct where the library is CUDA-aware;
hybrid_parallel.py with 3 pipeline stages (the receive in the cool-down that must wait for its
stream) and on 2 x 2 x 2; the thread-level refusal; and a SIGTERM to every rank of a
data_parallel.py run as soon as it trains, then --resume to the uninterrupted losses (within the
tolerance: kernels on a GPU need not add in the same order twice). Each row checks the world size
the run reports, so a launcher that starts N one-rank jobs fails. A run that dies gives its row
its exit status and last error line, and the rows after it still run. Every launch has a time
limit drawn from one budget. Ranks share the node's GPUs (rank r on GPU r % count). Without a
GPU each GPU row says so in one line, and the table is still written.
"""
import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
from harness import clean_env  # noqa: E402  (the tests' clean MPI environment)

BUDGET_S = 480  # the whole smoke, every launch included
LAST_ROWS_S = 150  # kept back for the thread-level row and the stop-and-resume row
STOPPED = 75  # the exit status of a run stopped by a signal (the strategy files' STOPPED)
DEVICE = "cuda"  # the tests run the stop-and-resume row on the CPU
GPT = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--batch-size", "8", "--steps", "4"]
RUNS = [  # (label, script, ranks, flags): the newest paths first
    ("context parallel", "context_parallel.py", 2, GPT),
    ("expert parallel", "expert_parallel.py", 2, GPT),
    ("tensor parallel, bf16, selective recompute", "tensor_parallel.py", 2,
     GPT + ["--sample-chars", "0", "--precision", "bf16", "--recompute", "selective"]),
    ("pipeline 1F1B, bf16, full recompute", "pipeline_parallel.py", 2,
     GPT + ["--micro-batches", "4", "--precision", "bf16", "--recompute", "full"]),
    ("ZeRO stage 3, bf16", "sharded_data_parallel.py", 2, GPT + ["--zero-stage", "3", "--precision", "bf16"]),
    ("data parallel", "data_parallel.py", 2, ["--steps", "4", "--batch-size", "16", "--bucket-mb", "0.05", "--sync-bn"]),
    ("tensor parallel", "tensor_parallel.py", 2, GPT + ["--sample-chars", "0"]),
    ("pipeline 1F1B", "pipeline_parallel.py", 2, GPT + ["--micro-batches", "4"]),
    ("pipeline ZB-V", "pipeline_parallel.py", 2, GPT + ["--micro-batches", "4", "--schedule", "zbv"]),
    ("model parallel", "model_parallel.py", 2, GPT),
    ("ZeRO stage 3", "sharded_data_parallel.py", 2, GPT + ["--zero-stage", "3"]),
    ("hybrid --pp 3", "hybrid_parallel.py", 3, GPT[:1] + ["3"] + GPT[2:] + ["--pp", "3", "--micro-batches", "4"]),
    ("hybrid 2 x 2 x 2", "hybrid_parallel.py", 8, GPT + ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"]),
]


class Budget:
    """One clock for the whole smoke: each launch gets at most what is left of it."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self, keep=0.0):
        return self.end - keep - time.monotonic()


def environment(**extra):
    env = clean_env(**extra)
    env.pop("CUDA_VISIBLE_DEVICES")  # the tests hide the GPUs; this script is for them
    env.update({k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ})
    return env


def last_error(stderr):
    """The last `error:` line of the files, else the last line: Open MPI's mpirun closes a failed
    job with a banner of dashes that would otherwise stand for the error."""
    last = [line for line in stderr.splitlines() if line.strip()]
    said = [line for line in last if line.startswith("error:")] or last
    return said[-1].strip()[:200] if said else ""


def run(script, ranks, flags, timeout, **extra):
    """(exit status, stdout, the last stderr line) of mpirun -np RANKS python SCRIPT FLAGS; the
    status is None when the launch ran past its time limit."""
    cmd = ["mpirun", "-np", str(ranks), sys.executable, str(ROOT / script), *flags]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=environment(**extra), capture_output=True, text=True,
                              timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout, last_error(done.stderr)


def json_result(out):
    """The --json object on the last stdout line, or None (a run that died after its header)."""
    lines = out.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return result if isinstance(result, dict) else None


def strategy_row(label, script, ranks, flags, transport, timeout):
    way = "direct" if transport else "staged"
    code, out, err = run(script, ranks, ["--device", "cuda", "--check", "--json", *flags], timeout,
                         MPI_CUDA_AWARE=transport)
    result = json_result(out)
    if result is None:
        return f"| {label} | {ranks} | {way} | FAIL: {'no result' if code is None else f'exit {code}'}: {err} |"
    if result.get("world_size") != ranks:  # N one-rank jobs would each pass alone
        return (f"| {label} | {ranks} | {way} | FAIL: the run reports a world of {result.get('world_size')}, "
                f"not {ranks}: mpirun and mpi4py's MPI differ? |")
    try:
        peak = max(result["peak_memory_bytes_per_rank"]) / 1e6
        return (f"| {label} | {ranks} | {way} | max diff {result['check_max_abs_diff']:.2e} -> "
                f"{'PASS' if code == 0 else f'FAIL (exit {code})'}, {result['step_time_s'] * 1e3:.1f} ms/step, "
                f"peak {peak:.1f} MB, overlap {result.get('overlap')} |")
    except (KeyError, TypeError, ValueError) as e:
        return f"| {label} | {ranks} | {way} | FAIL: exit {code}, an incomplete result ({e!r}): {err} |"


def ranks_tagged(tag, script):
    """The pids of this node's processes that run script with SMOKE_TAG=tag in their environment:
    found whether mpirun started them itself or through srun (hydra's default inside a Slurm
    allocation, where the ranks are not mpirun's descendants)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and f"SMOKE_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0")
                    and any(a.endswith(script.encode()) for a in (entry / "cmdline").read_bytes().split(b"\0"))):
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def lines_of(stream):
    """A queue that a thread fills with stream's lines (None at the end): read with a time limit."""
    lines = queue.Queue()

    def pump():
        for line in stream:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return lines


def tolerance():
    """data_parallel.py's TOLERANCE, read from its text (importing it would start its MPI setup)."""
    return float(re.search(r"^TOLERANCE = (\S+)", (ROOT / "data_parallel.py").read_text(), re.M).group(1))


def stop_and_resume(save, budget):
    """SIGTERM to every rank as soon as training runs: a save at the next step boundary, exit
    STOPPED; then --resume must reach the losses of the same run never stopped, within tolerance."""
    base = ["--device", DEVICE, "--steps", "12", "--batch-size", "16", "--json", "--no-check"]
    code, out, err = run("data_parallel.py", 2, base, budget.left() / 3)
    whole = json_result(out)
    if code != 0 or whole is None:
        return f"FAIL: no uninterrupted run: exit {code}: {err}"
    tag = uuid.uuid4().hex
    job = subprocess.Popen(["mpirun", "-np", "2", sys.executable, str(ROOT / "data_parallel.py"), *base,
                            "--save", str(save), "--log-every", "1"], cwd=ROOT, env=environment(SMOKE_TAG=tag),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, out = lines_of(job.stdout), []
    try:
        while not any(line.startswith("step 1/") for line in out):  # training has started
            line = lines.get(timeout=max(0.1, budget.left() / 2))
            if line is None:
                return f"FAIL: the job ended before training (exit {job.wait()}): {last_error(''.join(out))}"
            out.append(line)
        signalled, ranks = time.monotonic(), ranks_tagged(tag, "data_parallel.py")
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:  # a rank that has already exited (it finished its steps)
                pass
        job.wait(timeout=max(1.0, min(60.0, budget.left() / 2)))
        took = time.monotonic() - signalled
        while (line := lines.get(timeout=5)) is not None:  # what the job printed to its end
            out.append(line)
    except (queue.Empty, subprocess.TimeoutExpired):
        job.kill()
        return f"FAIL: the job did not stop in time: {last_error(''.join(out))}"
    stop = [line.strip() for line in out if line.startswith("stopped by a signal")]
    if job.returncode != STOPPED or not ranks:
        return (f"FAIL: exit {job.returncode} (a stop gives {STOPPED}), {len(ranks)} rank(s) found, "
                f"{stop or 'no stop line'}: {last_error(''.join(out))}")
    code, resumed, err = run("data_parallel.py", 2, [*base, "--save", str(save), "--resume"], budget.left())
    resumed = json_result(resumed)
    if code != 0 or resumed is None:
        return f"FAIL: stopped with exit {STOPPED} in {took:.1f} s; the resume failed: exit {code}: {err}"
    diff = max(abs(a - b) for a, b in zip(resumed["losses"], whole["losses"]))
    ok = len(resumed["losses"]) == len(whole["losses"]) and diff <= tolerance()
    return (f"{'PASS' if ok else 'FAIL'}: {stop[0] if stop else 'stopped'} in {took:.1f} s; resumed losses within "
            f"{diff:.1e} of the uninterrupted run's (tolerance {tolerance():g})")


def mpi_versions():
    """(the library mpi4py loaded, what the mpirun on PATH says it is): the first line of each."""
    from mpi4py import MPI
    library = MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]
    path = shutil.which("mpirun")
    try:
        said = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout if path else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        said = str(e)
    return library, path, said


def same_mpi(library, said):
    """Whether mpirun's --version names the family and the version of the library: Open MPI and
    Intel MPI by name, MPICH and its derivatives by hydra's 'Version:' line."""
    version = re.search(r"(\d+\.\d+(?:\.\d+)?)", library)
    for family, words in (("Open MPI", ("Open MPI",)), ("Intel", ("Intel",)), ("MVAPICH", ("MVAPICH",)),
                          ("MPICH", ("HYDRA", "MPICH"))):
        if family in library:
            return any(w in said for w in words) and bool(version) and version.group(1) in said
    return False


def cuda_support_line():
    """The library's own answer, MPI_CUDA_AWARE unset: MPI 4.1's memory kinds (as mpirun launches
    a process) and MPIX_Query_cuda_support, from a one-rank job of data_parallel.py's functions."""
    probe = ("import data_parallel as dp; dp.start_mpi(); comm = dp.MPI.COMM_WORLD\n"
             "try: kinds = comm.Get_info().Get('mpi_memory_alloc_kinds')\n"
             "except Exception: kinds = None\n"
             "print(repr(kinds), dp.mpix_query_cuda_support())")
    env = environment()
    env.pop("MPI_CUDA_AWARE", None)
    try:
        done = subprocess.run(["mpirun", "-np", "1", sys.executable, "-c", probe], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown (the probe did not run: {e})"
    if done.returncode != 0 or not done.stdout.strip():
        return f"unknown (the probe failed: exit {done.returncode}: {last_error(done.stderr)})"
    kinds, query = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    verdict = ("yes" if "cuda" in kinds.replace("cuda:host", "") or query == "True" else
               "no" if query == "False" else "unknown (neither memory kinds nor MPIX_Query_cuda_support answer)")
    return f"{verdict}: memory kinds {kinds}, MPIX_Query_cuda_support {query}"


def nvidia_smi_gpus():
    """How many GPUs nvidia-smi lists (0 without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE / "gpu-smoke.md"), help="the markdown table (default: bench/gpu-smoke.md)")
    args = p.parse_args(argv)
    import torch
    budget, started = Budget(BUDGET_S), time.monotonic()
    gpus, listed = torch.cuda.device_count(), nvidia_smi_gpus()
    if listed and not gpus:
        print(f"error: nvidia-smi lists {listed} GPU(s) but torch {torch.__version__} sees none (CUDA "
              f"{torch.version.cuda}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
              f"a CPU-only torch, or a driver older than its CUDA; nothing was run", file=sys.stderr)
        return 1
    library, mpirun, said = mpi_versions()
    name, cuda_support = torch.cuda.get_device_name(0) if gpus else "no GPU", cuda_support_line()
    rows = [f"# First run on a GPU node ({time.strftime('%Y-%m-%d %H:%M')})", "",
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), {gpus} x {name}; mpi4py's MPI: {library}", "",
            f"mpirun on PATH ({mpirun or 'none'}) belongs to that library: "
            + ("yes" if same_mpi(library, said) else f"NO, or unknown: it says {' '.join(said.split())[:160]!r}"), "",
            f"the library reads GPU memory (MPI_CUDA_AWARE unset): {cuda_support}", "",
            "| run | ranks | transport | result |", "|---|---|---|---|"]
    print("\n".join(rows), flush=True)  # the facts and the table's head, before any row
    aware = cuda_support.startswith("yes")
    for label, script, ranks, flags in RUNS:
        for transport in (0, 1):
            left = budget.left(keep=LAST_ROWS_S)
            if not gpus:
                rows.append(f"| {label} | {ranks} | {'direct' if transport else 'staged'} | no GPU |")
            elif transport and not aware:
                rows.append(f"| {label} | {ranks} | direct | not run: this MPI library does not say it reads GPU memory |")
            elif not (ROOT / script).exists():
                rows.append(f"| {label} | {ranks} | - | {script} is not in this checkout |")
            elif left < 20:
                rows.append(f"| {label} | {ranks} | - | not run: the {BUDGET_S} s budget was spent |")
            else:
                try:
                    rows.append(strategy_row(label, script, ranks, flags, transport, min(120, left)))
                except Exception as e:  # noqa: BLE001  one row's surprise must not cost the rows after it
                    rows.append(f"| {label} | {ranks} | - | FAIL: the smoke itself raised {e!r} |")
            print(rows[-1], flush=True)
    if gpus:
        code, _, err = run("data_parallel.py", 2, ["--device", "cuda", "--steps", "1", "--batch-size", "8"],
                           min(60, budget.left()), MPI4PY_RC_THREAD_LEVEL="funneled")
        refused = code == 2 and "MPI_THREAD_SERIALIZED" in err  # that refusal, not any exit 2 (a launcher's banner)
        rows.append(f"| thread level FUNNELED on a GPU | 2 | - | {'PASS' if refused else 'FAIL'}: exit {code}: {err} "
                    f"(expected: exit 2, the line that asks for MPI_THREAD_SERIALIZED) |")
        save = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-smoke-{os.getpid()}"
        rows.append(f"| SIGTERM to every rank, then --resume | 2 | - | "
                    f"{stop_and_resume(save, budget) if budget.left() > 45 else 'not run: budget spent'} |")
        shutil.rmtree(save, ignore_errors=True)
    else:
        rows += ["| thread level FUNNELED on a GPU | 2 | - | no GPU |", "| SIGTERM, then --resume | 2 | - | no GPU |"]
    print("\n".join(rows[-2:]), flush=True)
    rows += ["", f"{time.monotonic() - started:.0f} s in all"]
    Path(args.out).write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
