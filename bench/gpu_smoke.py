"""The first run on a GPU node: one command, at most 8 minutes, one markdown table.

    bash bench/gpu_smoke.sh            (or python bench/gpu_smoke.py [--out FILE])

Rows: the versions and whether the MPI library reads GPU memory; every strategy file with
--device cuda --check at small sizes, staged through host memory (MPI_CUDA_AWARE=0) and again
direct where the library is CUDA-aware; hybrid_parallel.py with 3 pipeline stages (the receive
in the cool-down that must wait for its stream) and on 2 x 2 x 2; the thread-level refusal; and
a SIGTERM to every rank of a data_parallel.py run, then --resume to the uninterrupted losses.
Ranks share the node's GPUs (rank r on GPU r % count). Without a GPU each GPU row says so in
one line, and the table is still written.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
from harness import clean_env, ranks_of  # noqa: E402  (the tests' clean MPI environment)

BUDGET_S = 480
GPT = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--batch-size", "8", "--steps", "4"]
RUNS = [  # (label, script, ranks, flags)
    ("data parallel", "data_parallel.py", 2, ["--steps", "4", "--batch-size", "16", "--bucket-mb", "0.05", "--sync-bn"]),
    ("tensor parallel", "tensor_parallel.py", 2, GPT + ["--sample-chars", "0"]),
    ("pipeline 1F1B", "pipeline_parallel.py", 2, GPT + ["--micro-batches", "4"]),
    ("pipeline ZB-V", "pipeline_parallel.py", 2, GPT + ["--micro-batches", "4", "--schedule", "zbv"]),
    ("model parallel", "model_parallel.py", 2, GPT),
    ("ZeRO stage 3", "sharded_data_parallel.py", 2, GPT + ["--zero-stage", "3"]),
    ("hybrid --pp 3", "hybrid_parallel.py", 3, GPT[:1] + ["3"] + GPT[2:] + ["--pp", "3", "--micro-batches", "4"]),
    ("hybrid 2 x 2 x 2", "hybrid_parallel.py", 8, GPT + ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"]),
    ("context parallel", "context_parallel.py", 2, GPT),
    ("expert parallel", "expert_parallel.py", 2, GPT),
]


def environment(**extra):
    env = clean_env(**extra)
    env.pop("CUDA_VISIBLE_DEVICES")  # the tests hide the GPUs; this script is for them
    env.update({k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ})
    return env


def run(script, ranks, flags, timeout, **extra):
    """(exit status, stdout, the last stderr line) of mpirun -np RANKS python SCRIPT FLAGS."""
    cmd = ["mpirun", "-np", str(ranks), sys.executable, str(ROOT / script), *flags]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=environment(**extra), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout:.0f} s"
    last = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, done.stdout, last[-1][:200] if last else ""


def strategy_row(label, script, ranks, flags, transport, timeout):
    code, out, err = run(script, ranks, ["--device", "cuda", "--check", "--json", *flags], timeout,
                         MPI_CUDA_AWARE=transport)
    if code is None or not out.strip():
        return f"| {label} | {ranks} | {'direct' if transport else 'staged'} | no result: {err} |"
    result = json.loads(out.strip().splitlines()[-1])
    peak = max(result["peak_memory_bytes_per_rank"]) / 1e6
    return (f"| {label} | {ranks} | {'direct' if transport else 'staged'} | max diff "
            f"{result['check_max_abs_diff']:.2e} -> {'PASS' if code == 0 else 'FAIL'}, "
            f"{result['step_time_s'] * 1e3:.1f} ms/step, peak {peak:.1f} MB, overlap {result.get('overlap')} |")


def stop_and_resume(save, timeout):
    """SIGTERM to every rank of a running job: a save at the next step boundary, exit 0; then
    --resume must reach the losses of the same run never stopped."""
    flags = ["--device", "cuda", "--steps", "12", "--batch-size", "16", "--save", str(save), "--json",
             "--no-check", "--log-every", "1"]
    code, out, err = run("data_parallel.py", 2, ["--device", "cuda", "--steps", "12", "--batch-size", "16",
                                                 "--json", "--no-check"], timeout)
    if code != 0:
        return f"no uninterrupted run: {err}"
    whole = json.loads(out.strip().splitlines()[-1])["losses"]
    job = subprocess.Popen(["mpirun", "-np", "2", sys.executable, str(ROOT / "data_parallel.py"), *flags],
                           cwd=ROOT, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in job.stdout:
        if line.startswith("step 3/"):
            break
    signalled = time.monotonic()
    for pid in ranks_of(job, "data_parallel.py"):
        os.kill(pid, signal.SIGTERM)
    try:
        out, _ = job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        job.kill()
        return "the ranks did not stop within 60 s"
    took = time.monotonic() - signalled
    code, resumed, err = run("data_parallel.py", 2, [*flags, "--resume"], timeout)
    if code != 0:
        return f"stopped with exit {job.returncode} in {took:.1f} s; the resume failed: {err}"
    same = json.loads(resumed.strip().splitlines()[-1])["losses"] == whole
    return (f"stopped with exit {job.returncode} in {took:.1f} s; resumed losses "
            f"{'equal' if same else 'DIFFER from'} the uninterrupted run's")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE / "gpu-smoke.md"), help="the markdown table (default: bench/gpu-smoke.md)")
    args = p.parse_args(argv)
    import torch
    from mpi4py import MPI
    start = time.monotonic()
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0) if gpus else "no GPU"
    # the header of a short GPU run says how its CUDA buffers travel: the library's own answer
    _, header, err = (run("data_parallel.py", 2, ["--device", "cuda", "--steps", "1", "--batch-size", "8",
                                                  "--no-check"], 120) if gpus else (None, "", "no GPU"))
    rows = [f"# First run on a GPU node ({time.strftime('%Y-%m-%d %H:%M')})", "",
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), {gpus} x {name}; "
            f"{MPI.Get_library_version().splitlines()[0].strip()}", "",
            "MPI reads GPU memory (MPI_CUDA_AWARE unset): "
            + next((line for line in header.splitlines() if line.startswith("CUDA buffers")), err), "",
            "| run | ranks | transport | result |", "|---|---|---|---|"]
    aware = "direct (CUDA-aware MPI)" in header
    for label, script, ranks, flags in RUNS:
        for transport in (0, 1):
            left = BUDGET_S - (time.monotonic() - start)
            if not gpus:
                rows.append(f"| {label} | {ranks} | {'direct' if transport else 'staged'} | no GPU |")
            elif transport and not aware:
                rows.append(f"| {label} | {ranks} | direct | not run: this MPI library does not read GPU memory |")
            elif not (ROOT / script).exists():
                rows.append(f"| {label} | {ranks} | - | {script} is not in this checkout |")
            elif left < 30:
                rows.append(f"| {label} | {ranks} | - | not run: the {BUDGET_S} s budget was spent |")
            else:
                rows.append(strategy_row(label, script, ranks, flags, transport, min(120, left)))
    if gpus:
        code, _, err = run("data_parallel.py", 2, ["--device", "cuda", "--steps", "1", "--batch-size", "8"], 120,
                           MPI4PY_RC_THREAD_LEVEL="funneled")
        rows.append(f"| thread level FUNNELED on a GPU | 2 | - | exit {code}: {err} (expected: exit 2, one error line) |")
        left = BUDGET_S - (time.monotonic() - start)
        save = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-smoke-{os.getpid()}"
        rows.append(f"| SIGTERM to every rank, then --resume | 2 | - | "
                    f"{stop_and_resume(save, min(120, left)) if left > 60 else 'not run: budget spent'} |")
    else:
        rows += ["| thread level FUNNELED on a GPU | 2 | - | no GPU |", "| SIGTERM, then --resume | 2 | - | no GPU |"]
    rows += ["", f"{time.monotonic() - start:.0f} s in all"]
    Path(args.out).write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
