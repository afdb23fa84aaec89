"""The first run on a GPU node: one command, at most 8 minutes, one markdown table.

    bash bench/gpu_smoke.sh            (or python bench/gpu_smoke.py [--out FILE] [--launcher CMD])

First the facts every row depends on: whether torch sees the GPUs that nvidia-smi lists (if not,
it says so and exits with status 1), whether the launcher (mpirun) belongs to the MPI library that
mpi4py loads (the same install prefix), and whether that library reads GPU memory. Rows: every
strategy file with --device cuda --check at small sizes (hybrid_parallel.py on 2 x 2 x 2 first: eight
ranks, the launch most likely to run out of time; then context and expert parallelism, the newest paths,
then three in bf16 with recomputation: the precision a GPU run trains in), staged through host memory
(MPI_CUDA_AWARE=0) and again direct where the library is CUDA-aware; hybrid_parallel.py with 3 pipeline
stages (the receive in the cool-down that must wait for its stream); the thread-level refusal; and a
SIGTERM to the ranks of a data_parallel.py run (not to the launcher) as soon as it trains, then --resume
to the uninterrupted losses (within the tolerance: kernels on a GPU need not add in the same order twice).
Each row checks the world size the run reports, so a launcher that starts N one-rank jobs fails. A run
that dies gives its row its exit status and last error line, and the rows after it still run. Every
launch has a time limit drawn from one budget; a launch out of time is ended whole (SIGTERM to the
launcher, then SIGKILL to its process group and to every process it started), so no rank stays on a GPU.
Ranks share the node's GPUs (rank r on GPU r % count). Without a GPU each GPU row says so in one line, and
the table is still written. This process never starts MPI itself: Open MPI aborts a process that starts
MPI alone without a launcher's PMI (inside `srun --pty`, for one).
"""
import argparse
import contextlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

with contextlib.suppress(ImportError):  # should anything here import mpi4py.MPI, MPI must not start
    import mpi4py
    mpi4py.rc.initialize = False

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
from harness import clean_env  # noqa: E402  (the tests' clean MPI environment)

BUDGET_S = 480  # the whole smoke, every launch included
LAST_ROWS_S = 150  # kept back for the thread-level row and the stop-and-resume row
STOPPED = 75  # the exit status of a run stopped by a signal (the strategy files' STOPPED)
STOP_STEPS = 300  # the stop row's runs: long enough that no GPU finishes before the signal (H200: stopped at 3)
GRACE_S = 10  # a launch out of time: SIGTERM to the launcher, this long for it to end its ranks, then SIGKILL
DEVICE = "cuda"  # the tests run the stop-and-resume row on the CPU
LAUNCHER = ["mpirun"]  # --launcher: what starts N ranks, given `-n N python FILE FLAGS` after it
GPT = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--batch-size", "8", "--steps", "4"]
RUNS = [  # (label, script, ranks, flags): eight ranks first, then the newest paths
    ("hybrid 2 x 2 x 2", "hybrid_parallel.py", 8,
     GPT + ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"]),
    ("context parallel", "context_parallel.py", 2, GPT),
    ("expert parallel", "expert_parallel.py", 2, GPT),
    ("tensor parallel, bf16, selective recompute", "tensor_parallel.py", 2,
     GPT + ["--sample-chars", "0", "--precision", "bf16", "--recompute", "selective"]),
    ("pipeline 1F1B, bf16, full recompute", "pipeline_parallel.py", 2,
     GPT + ["--micro-batches", "4", "--precision", "bf16", "--recompute", "full"]),
    ("ZeRO stage 3, bf16", "sharded_data_parallel.py", 2, GPT + ["--zero-stage", "3", "--precision", "bf16"]),
    ("data parallel", "data_parallel.py", 2,
     ["--steps", "4", "--batch-size", "16", "--bucket-mb", "0.05", "--sync-bn"]),
    ("tensor parallel", "tensor_parallel.py", 2, GPT + ["--sample-chars", "0"]),
    ("pipeline 1F1B", "pipeline_parallel.py", 2, GPT + ["--micro-batches", "4"]),
    ("pipeline ZB-V", "pipeline_parallel.py", 2, GPT + ["--micro-batches", "4", "--schedule", "zbv"]),
    ("model parallel", "model_parallel.py", 2, GPT),
    ("ZeRO stage 3", "sharded_data_parallel.py", 2, GPT + ["--zero-stage", "3"]),
    ("hybrid --pp 3", "hybrid_parallel.py", 3, GPT[:1] + ["3"] + GPT[2:] + ["--pp", "3", "--micro-batches", "4"]),
]
LAUNCHER_HELP = """the command that starts the ranks, given `-n N python FILE FLAGS` after it (default: mpirun).
Where a site has no mpirun and Slurm starts MPI ranks: --launcher "srun --mpi=pmix" (or pmi2: the
PMI your MPI was built with). Open MPI's mpirun inside a Slurm allocation of fewer than 8 slots, or on
a node of fewer than 8 cores, refuses the 8-rank row: --launcher "mpirun --oversubscribe" (Open MPI 5:
"mpirun --map-by :OVERSUBSCRIBE"). As root, Open MPI's mpirun also wants OMPI_ALLOW_RUN_AS_ROOT=1 and
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 in the environment."""
# Not started by this process: a plain python child says which libmpi mpi4py loads, MPI not started.
LIBRARY_PROBE = """import json, mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
text = ''.join(c for c in MPI.Get_library_version() if c.isprintable() or c == '\\n').strip()
paths = sorted({line.split()[-1] for line in open('/proc/self/maps') if '/libmpi' in line})
print(json.dumps({'library': text.splitlines()[0] if text else '?', 'libmpi': paths}))"""
# One rank under the launcher, with data_parallel.py's own start: what the library says of GPU memory
# (MPI 4.1's memory kinds, MPIX_Query_cuda_support), which libmpi the rank loaded, and the programs
# between the rank and this process (the launcher's own, shims resolved; empty if a daemon of
# another session started the rank, as srun's does).
RANK_PROBE = """import json, os
import data_parallel as dp
dp.start_mpi()
comm = dp.MPI.COMM_WORLD
try:
    kinds = comm.Get_info().Get('mpi_memory_alloc_kinds')
except Exception:
    kinds = None
chain, pid, smoke = [], os.getppid(), int(os.environ['SMOKE_PID'])
while pid > 1 and pid != smoke:
    try:
        chain.append(os.readlink(f'/proc/{pid}/exe'))
        pid = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        break
print(json.dumps({'world': comm.Get_size(), 'kinds': kinds, 'query': dp.mpix_query_cuda_support(),
                  'libmpi': dp.mpi_libraries_loaded(), 'launched_by': chain if pid == smoke else []}))"""
INTERPRETERS = ("sh", "bash", "dash", "zsh", "ksh", "env", "perl")  # a launcher script's, not an MPI's


class Budget:
    """One clock for the whole smoke: each launch gets at most what is left of it."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self, keep=0.0):
        return self.end - keep - time.monotonic()


def environment(**extra):
    """The tests' clean launch environment, the GPUs visible; extra settings added (None: removed)."""
    env = clean_env(**{k: v for k, v in extra.items() if v is not None})
    env.pop("CUDA_VISIBLE_DEVICES")  # the tests hide the GPUs; this script is for them
    env.update({k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ})
    return {k: v for k, v in env.items() if extra.get(k, "") is not None}


def last_error(stderr):
    """The last `error:` line of the files, else the last line: Open MPI's mpirun closes a failed
    job with a banner of dashes that would otherwise stand for the error."""
    last = [line for line in stderr.splitlines() if line.strip()]
    said = [line for line in last if line.startswith("error:")] or last
    return said[-1].strip()[:200] if said else ""


def no_launcher(error):
    return f"the launcher {' '.join(LAUNCHER)!r} did not start ({error.strerror or error}): --launcher names another"


def tagged(tag):
    """The pids of this node's processes that carry SMOKE_TAG=tag in their environment: every process
    of one launch, whether its launcher started it or a daemon of another session did (srun's)."""
    pids, mark = [], f"SMOKE_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


def start(command, ranks, tag, **popen):
    """The launcher, in a process group of its own (a time limit ends all of it), SMOKE_TAG=tag in
    the environment of every process it starts. Raises OSError when there is no such launcher."""
    extra = popen.pop("env", {})
    return subprocess.Popen([*LAUNCHER, "-n", str(ranks), *command], cwd=ROOT, start_new_session=True,
                            stdin=subprocess.DEVNULL, env=environment(SMOKE_TAG=tag, SMOKE_PID=os.getpid(), **extra),
                            **popen)


def end(job, tag, grace):
    """End a launch for good: SIGTERM to the launcher alone (mpirun then ends its ranks in order),
    `grace` seconds for that, then SIGKILL to its process group and to every process that carries its
    tag. Returns the pids still alive a few seconds later (a process stuck in the driver)."""
    if job.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            job.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job.pid, signal.SIGKILL)
    gone = time.monotonic() + 5
    while (alive := tagged(tag)) and time.monotonic() < gone:  # a killed process leaves /proc at once,
        for pid in alive:  # a zombie's environment reads empty
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(timeout=max(0.1, gone - time.monotonic()))
    return alive


def launch(command, ranks, timeout, **extra):
    """(exit status, stdout, the last stderr line) of LAUNCHER -n RANKS COMMAND; the status is None
    when the launch did not start or ran past its time limit, which ends it whole. The output goes to
    files, not pipes: a rank that outlives its launcher cannot hold the reading open."""
    tag, grace, timed_out = uuid.uuid4().hex, min(GRACE_S, timeout / 4), False
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            job = start(command, ranks, tag, stdout=out, stderr=err, env=extra)
        except OSError as e:  # FileNotFoundError: no such launcher; PermissionError: not a program
            return None, "", no_launcher(e)
        try:
            job.wait(timeout=max(0.1, timeout - grace))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also after a launcher that ended by itself: no process of it may stay behind
            left = end(job, tag, grace)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    still = f"; {len(left)} process(es) of it still alive: {left}" if left else ""
    if timed_out:
        return None, stdout, f"timed out after {timeout:.0f} s: the launch was ended{still}"
    return job.returncode, stdout, last_error(stderr) + still


def run(script, ranks, flags, timeout, **extra):
    """(exit status, stdout, the last stderr line) of LAUNCHER -n RANKS python SCRIPT FLAGS."""
    return launch([sys.executable, str(ROOT / script), *flags], ranks, timeout, **extra)


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
                f"not {ranks}: the launcher and mpi4py's MPI differ? |")
    try:
        peak = max(result["peak_memory_bytes_per_rank"]) / 1e6
        return (f"| {label} | {ranks} | {way} | max diff {result['check_max_abs_diff']:.2e} -> "
                f"{'PASS' if code == 0 else f'FAIL (exit {code})'}, {result['step_time_s'] * 1e3:.1f} ms/step, "
                f"peak {peak:.1f} MB, overlap {result.get('overlap')} |")
    except (KeyError, TypeError, ValueError) as e:
        return f"| {label} | {ranks} | {way} | FAIL: exit {code}, an incomplete result ({e!r}): {err} |"


def thread_level_row(budget):
    """mpi4py asked for MPI_THREAD_FUNNELED on a GPU: the files refuse with exit 2 and the line that asks
    for MPI_THREAD_SERIALIZED. Another exit 2 (a launcher's own failure) is no such refusal."""
    code, _, err = run("data_parallel.py", 2, ["--device", "cuda", "--steps", "1", "--batch-size", "8"],
                       min(60, budget.left()), MPI4PY_RC_THREAD_LEVEL="funneled")
    refused = code == 2 and "MPI_THREAD_SERIALIZED" in err
    return (f"| thread level FUNNELED on a GPU | 2 | - | {'PASS' if refused else 'FAIL'}: exit {code}: {err} "
            f"(expected: exit 2, the line that asks for MPI_THREAD_SERIALIZED) |")


def ranks_of(launcher, tag, script):
    """The pids of one launch's ranks: processes of this python that run script with SMOKE_TAG=tag,
    never the launcher itself (its command line names the script too). Those whose parent chain holds
    the launcher, if any; else all (hydra inside a Slurm allocation starts its proxies through srun,
    and the ranks are no descendants of mpirun)."""
    python, parent, found = os.path.realpath(sys.executable), {}, []
    for pid in tagged(tag):
        with contextlib.suppress(OSError, ValueError, IndexError):
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
            if (pid != launcher and os.path.realpath(f"/proc/{pid}/exe") == python
                    and any(a.endswith(script.encode()) for a in argv)):
                found.append(pid)
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])

    def under_launcher(pid):
        while pid > 1 and pid != launcher:
            pid = parent.get(pid, 0)
        return pid == launcher
    return [pid for pid in found if under_launcher(pid)] or found


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


def stop_status(said):
    """What the launcher returns when its ranks exit 75 (the smoke signals the ranks, never the
    launcher), by the family its --version names."""
    if LAUNCHER and Path(LAUNCHER[0]).name == "srun":
        return "srun returns the highest status of its tasks"
    if "Open MPI" in said or "OpenRTE" in said:
        return ("Open MPI's mpirun returns the status of the lowest rank that ended non-zero; signalled itself, "
                "it ends the job and returns 1")
    if "HYDRA" in said or "Intel" in said:
        return "hydra's mpiexec returns its ranks' statuses combined"
    return "a launcher that passes its ranks' status on"


def stop_and_resume(save, budget, said=None):
    """SIGTERM to every rank (not to the launcher) as soon as training runs: a save at the next step
    boundary, exit STOPPED from every rank and so from the launcher (said: its --version); then
    --resume must reach the losses of the same run never stopped, within tolerance."""
    said = launcher_version() if said is None else said
    base = ["--device", DEVICE, "--steps", str(STOP_STEPS), "--batch-size", "16", "--json", "--no-check"]
    code, out, err = run("data_parallel.py", 2, base, budget.left() / 3)
    whole, expect = json_result(out), f"{STOPPED} ({stop_status(said)})"
    if code != 0 or whole is None:
        return f"FAIL: no uninterrupted run: exit {code}: {err}"
    tag, out = uuid.uuid4().hex, []
    try:
        job = start([sys.executable, str(ROOT / "data_parallel.py"), *base, "--save", str(save), "--log-every", "1"],
                    2, tag, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        return f"FAIL: {no_launcher(e)}"
    try:
        lines = lines_of(job.stdout)
        while not any(line.startswith("step 1/") for line in out):  # training has started
            line = lines.get(timeout=max(0.1, budget.left() / 2))
            if line is None:
                return f"FAIL: the job ended before training (exit {job.wait()}): {last_error(''.join(out))}"
            out.append(line)
        signalled, ranks = time.monotonic(), ranks_of(job.pid, tag, "data_parallel.py")
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):  # a rank that has already exited
                os.kill(pid, signal.SIGTERM)
        job.wait(timeout=max(1.0, min(60.0, budget.left() / 2)))
        took = time.monotonic() - signalled
        while (line := lines.get(timeout=5)) is not None:  # what the job printed to its end
            out.append(line)
    except (queue.Empty, subprocess.TimeoutExpired):
        return f"FAIL: the job did not stop in time (it was ended): {last_error(''.join(out))}"
    finally:
        end(job, tag, min(GRACE_S, max(1.0, budget.left() / 4)))
    stop = [line.strip() for line in out if line.startswith("stopped by a signal")]
    if job.returncode != STOPPED or len(ranks) != 2:
        return (f"FAIL: exit {job.returncode} (expected {expect}), {len(ranks)} of 2 ranks found and signalled, "
                f"{stop or 'no stop line'}: {last_error(''.join(out))}")
    code, resumed, err = run("data_parallel.py", 2, [*base, "--save", str(save), "--resume"], budget.left())
    resumed = json_result(resumed)
    if code != 0 or resumed is None:
        return f"FAIL: stopped with exit {STOPPED} in {took:.1f} s; the resume failed: exit {code}: {err}"
    diff = max(abs(a - b) for a, b in zip(resumed["losses"], whole["losses"]))
    ok = len(resumed["losses"]) == len(whole["losses"]) and diff <= tolerance()
    return (f"{'PASS' if ok else 'FAIL'}: {stop[0] if stop else 'stopped'} in {took:.1f} s, the launcher's exit "
            f"{job.returncode} (expected {expect}); resumed losses within {diff:.1e} of the uninterrupted run's "
            f"(tolerance {tolerance():g})")


def library_facts():
    """mpi4py's library as a plain python child loads it (MPI not started): a dict, or why not."""
    try:
        done = subprocess.run([sys.executable, "-c", LIBRARY_PROBE], capture_output=True, text=True, timeout=60,
                              env=environment())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the probe did not run: {e}"
    return json_result(done.stdout) or f"the probe failed: exit {done.returncode}: {last_error(done.stderr)}"


def launcher_version():
    """What `LAUNCHER --version` prints ('' when it does not run)."""
    try:
        return subprocess.run([*LAUNCHER, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def rank_facts():
    """The one-rank probe under the launcher (ended whole if out of time): a dict, or why not."""
    code, out, err = launch([sys.executable, "-c", RANK_PROBE], 1, 90, MPI_CUDA_AWARE=None)
    return json_result(out) or f"the probe failed: {'no result' if code is None else f'exit {code}'}: {err}"


def install_prefix(program):
    """The folder a program was installed into: the one above the bin/ (or sbin/) that holds it."""
    folder = Path(program).parent
    return folder.parent if folder.name in ("bin", "sbin") else folder


def same_install(programs, library):
    """The first of programs (the launcher's, shims and links resolved) whose install prefix holds
    the library mpi4py loaded, else None. A prefix that several MPIs share (/usr, where Debian puts
    Open MPI and MPICH alike) cannot tell them apart: there each row's world-size check still does."""
    for program in programs:
        prefix = install_prefix(os.path.realpath(program))
        if prefix != Path("/") and Path(os.path.realpath(library)).is_relative_to(prefix):
            return program
    return None


def launcher_line(library, rank):
    """Whether the launcher belongs to the library mpi4py loaded, by install prefix: the libmpi of the
    probe's rank (else of a plain python's) against the launcher on PATH and the programs between the
    rank and this process (a shim's target, mpirun's daemons; not interpreters of scripts)."""
    found = shutil.which(LAUNCHER[0])
    libmpi = ((rank.get("libmpi") if isinstance(rank, dict) else None)
              or (library.get("libmpi") if isinstance(library, dict) else None))
    python = os.path.realpath(sys.executable)
    programs = [found] + [p for p in (rank.get("launched_by", []) if isinstance(rank, dict) else [])
                          if Path(p).name not in INTERPRETERS and os.path.realpath(p) != python]
    match = same_install(programs, libmpi[0]) if found and libmpi else None
    if not found:
        verdict = f"NO: {LAUNCHER[0]!r} is not on PATH (--launcher names another)"
    elif Path(LAUNCHER[0]).name in ("srun", "flux", "aprun", "jsrun"):
        verdict = (f"not asked: {LAUNCHER[0]} starts the ranks itself, the library must take its PMI (each row's "
                   f"world-size check tells whether it does)")
    elif not libmpi:
        verdict = f"unknown: no libmpi found ({rank if isinstance(rank, str) else library})"
    elif match:
        verdict = f"yes: {libmpi[0]} lies in the install prefix of {match} ({install_prefix(os.path.realpath(match))})"
    else:
        verdict = (f"NO: {libmpi[0]} lies outside the install prefix of {', '.join(programs)} (a launcher of "
                   f"another MPI may start one-rank jobs)")
    return f"the launcher ({' '.join(LAUNCHER)}: {found or 'not found'}) belongs to that library: {verdict}"


def cuda_support_line(rank):
    """The library's own answer, MPI_CUDA_AWARE unset: MPI 4.1's memory kinds (as the launcher starts
    a process) and MPIX_Query_cuda_support, from the one-rank probe of data_parallel.py's functions."""
    if not isinstance(rank, dict):
        return f"unknown ({rank})"
    kinds, query = repr(rank.get("kinds")), rank.get("query")
    verdict = ("yes" if "cuda" in kinds.replace("cuda:host", "") or query is True else
               "no" if query is False else "unknown (neither memory kinds nor MPIX_Query_cuda_support answer)")
    return f"{verdict}: memory kinds {kinds}, MPIX_Query_cuda_support {query}"


def nvidia_smi_gpus():
    """How many GPUs nvidia-smi lists (0 without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def main(argv=None):
    global LAUNCHER
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE / "gpu-smoke.md"), help="the markdown table (default: bench/gpu-smoke.md)")
    p.add_argument("--launcher", default="mpirun", help=LAUNCHER_HELP)
    args = p.parse_args(argv)
    LAUNCHER = shlex.split(args.launcher)
    if not LAUNCHER:
        p.error("--launcher: give a command, e.g. mpirun or \"srun --mpi=pmix\"")
    import torch
    budget, started = Budget(BUDGET_S), time.monotonic()
    gpus, listed = torch.cuda.device_count(), nvidia_smi_gpus()
    if listed and not gpus:
        print(f"error: nvidia-smi lists {listed} GPU(s) but torch {torch.__version__} sees none (CUDA "
              f"{torch.version.cuda}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
              f"a CPU-only torch, or a driver older than its CUDA; nothing was run", file=sys.stderr)
        return 1
    library, said, rank = library_facts(), launcher_version(), rank_facts()
    name, cuda_support = torch.cuda.get_device_name(0) if gpus else "no GPU", cuda_support_line(rank)
    rows = [f"# GPU smoke run ({time.strftime('%Y-%m-%d %H:%M')})", "",
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), {gpus} x {name}; mpi4py's MPI: "
            + (library["library"] if isinstance(library, dict) else f"unknown ({library})"), "",
            launcher_line(library, rank) + (f"; it says {' '.join(said.split())[:120]!r}" if said.strip() else ""), "",
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
                rows.append(f"| {label} | {ranks} | direct | not run: this MPI library does not say it reads GPU "
                            f"memory |")
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
        save = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-smoke-{os.getpid()}"
        last = [("thread level FUNNELED on a GPU", lambda: thread_level_row(budget)),
                ("SIGTERM to the ranks, then --resume", lambda: "| SIGTERM to the ranks, then --resume | 2 | - | " + (
                    stop_and_resume(save, budget, said) if budget.left() > 45 else "not run: budget spent") + " |")]
        for label, row in last:
            try:
                rows.append(row())
            except Exception as e:  # noqa: BLE001
                rows.append(f"| {label} | 2 | - | FAIL: the smoke itself raised {e!r} |")
        shutil.rmtree(save, ignore_errors=True)
    else:
        rows += ["| thread level FUNNELED on a GPU | 2 | - | no GPU |", "| SIGTERM, then --resume | 2 | - | no GPU |"]
    print("\n".join(rows[-2:]), flush=True)
    rows += ["", f"{time.monotonic() - started:.0f} s in all"]
    Path(args.out).write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
