"""bench/gpu_smoke.py on stub runs and under stand-in launchers: each row tells the truth, no launch
outlives its time limit or leaves a process behind, and the smoke never starts MPI itself.

A stand-in launcher is a small script named mpirun, written to a folder put first on PATH: one that
hangs (it and its ranks ignore SIGTERM and block on a pipe no one writes), one whose ranks train
until a signal comes and that ends the job if signalled itself (as Open MPI 4.1's mpirun does), one
that exits 2 with a launcher's banner, one that only answers --version, and none at all. No GPU is
needed: the smoke is told there is one where a row must run."""
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from harness import ROOT, clean_env


def smoke():
    sys.path.insert(0, str(ROOT / "bench"))
    return importlib.import_module("gpu_smoke")


def good_result(ranks):
    return json.dumps({"world_size": ranks, "check_max_abs_diff": 1e-7, "peak_memory_bytes_per_rank": [1e6] * ranks,
                       "step_time_s": 0.01, "overlap": None}) + "\n"


def table_rows(path):
    return [line for line in path.read_text().splitlines() if line.startswith("| ")][1:]  # not the head


def stand_in(tmp_path, monkeypatch, text):
    """A launcher named mpirun in tmp_path/bin, first on PATH (the smoke's default launcher)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    (folder / "mpirun").write_text(text)
    (folder / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return folder / "mpirun"


def one_gpu(monkeypatch):
    """The smoke believes it has a GPU, so that every row runs (through the stand-in launcher)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a stub GPU")


def alive(pid):
    """Whether pid is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_smoke_run_that_dies_after_its_header_gives_its_row_its_status_and_last_error(monkeypatch):
    gpu_smoke = smoke()
    monkeypatch.setattr(gpu_smoke, "run", lambda *args, **kwargs: (
        134, "context_parallel | 2 ranks | device cuda\nCUDA buffers: staged\n", "RuntimeError: CUDA error: an illegal memory access"))
    row = gpu_smoke.strategy_row("context parallel", "context_parallel.py", 2, [], 0, 60)
    assert row == "| context parallel | 2 | staged | FAIL: exit 134: RuntimeError: CUDA error: an illegal memory access |"


def test_n_one_rank_jobs_are_a_failed_row_not_n_passes(monkeypatch):
    gpu_smoke = smoke()
    monkeypatch.setattr(gpu_smoke, "run", lambda script, ranks, *args, **kwargs: (0, good_result(1) * ranks, ""))
    row = gpu_smoke.strategy_row("data parallel", "data_parallel.py", 2, [], 0, 60)
    assert "FAIL: the run reports a world of 1, not 2" in row
    monkeypatch.setattr(gpu_smoke, "run", lambda script, ranks, *args, **kwargs: (0, good_result(ranks), ""))
    assert "-> PASS" in gpu_smoke.strategy_row("data parallel", "data_parallel.py", 2, [], 0, 60)


def test_when_nvidia_smi_lists_gpus_that_torch_cannot_see_the_smoke_says_so_first_and_fails(monkeypatch, tmp_path, capsys):
    gpu_smoke = smoke()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(gpu_smoke, "nvidia_smi_gpus", lambda: 4)
    assert gpu_smoke.main(["--out", str(tmp_path / "smoke.md")]) == 1
    assert capsys.readouterr().err.startswith("error: nvidia-smi lists 4 GPU(s) but torch")
    assert not (tmp_path / "smoke.md").exists()


def test_the_same_mpi_is_the_same_install_prefix_not_the_same_family_and_version():
    gpu_smoke = smoke()
    debian = "/usr/lib/x86_64-linux-gnu/openmpi/lib/libmpi.so.40"
    assert gpu_smoke.same_install(["/usr/bin/mpirun.openmpi"], debian) == "/usr/bin/mpirun.openmpi"
    assert gpu_smoke.same_install(["/opt/hpcx/ompi/bin/mpirun"], debian) is None  # Open MPI 4.1 both, two installs
    assert gpu_smoke.same_install(["/opt/hpcx/ompi/bin/mpirun"], "/opt/hpcx/ompi/lib/libmpi.so.40")
    assert gpu_smoke.same_install(["/home/u/.pyenv/shims/mpirun", "/home/u/.pyenv/versions/3.12/bin/mpiexec.hydra"],
                                  "/home/u/.pyenv/versions/3.12/lib/libmpi.so.12").endswith("mpiexec.hydra")
    assert gpu_smoke.same_install(["/mpirun"], "/usr/lib/libmpi.so.12") is None  # "/" holds everything: no answer


def test_every_row_runs_after_one_that_dies_and_the_whole_smoke_keeps_its_budget(monkeypatch, tmp_path):
    """Every stub launch hangs until its time limit (the clock is made up): the smoke must still
    end within its budget, every row present, the 8-rank row first and the dead one said."""
    gpu_smoke, clock, limits = smoke(), [0.0], []
    monkeypatch.setattr(gpu_smoke.time, "monotonic", lambda: clock[0])
    one_gpu(monkeypatch)
    monkeypatch.setattr(gpu_smoke, "library_facts", lambda: {"library": "a stub MPI", "libmpi": []})
    monkeypatch.setattr(gpu_smoke, "launcher_version", lambda: "")
    monkeypatch.setattr(gpu_smoke, "rank_facts", lambda: {"kinds": "system,cuda", "query": None, "libmpi": []})

    def hangs(script, ranks, flags, timeout, **extra):
        limits.append(timeout)
        clock[0] += timeout
        if not limits[1:]:
            return 134, "the header\n", "RuntimeError: CUDA error: an illegal memory access"
        return (2, "", "error: thread level") if extra.get("MPI4PY_RC_THREAD_LEVEL") else (0, good_result(ranks), "")
    monkeypatch.setattr(gpu_smoke, "run", hangs)

    def stop_and_resume(save, budget, said=None):
        clock[0] += max(0.0, budget.left())
        return "PASS: stubbed"
    monkeypatch.setattr(gpu_smoke, "stop_and_resume", stop_and_resume)
    assert gpu_smoke.main(["--out", str(tmp_path / "smoke.md")]) == 0
    rows = table_rows(tmp_path / "smoke.md")
    assert len(rows) == 2 * len(gpu_smoke.RUNS) + 2 and clock[0] <= gpu_smoke.BUDGET_S, (clock, rows)
    assert rows[0] == ("| hybrid 2 x 2 x 2 | 8 | staged | FAIL: exit 134: RuntimeError: CUDA error: an illegal "
                       "memory access |")
    assert rows[2].startswith("| context parallel | 2 | staged | max diff") and all(0 < t <= 120 for t in limits)
    assert "budget" in rows[-3] and rows[-1].endswith("| PASS: stubbed |")


def test_a_clean_launch_environment_keeps_the_user_s_mpi_settings_and_drops_the_enclosing_job_s_ranks(monkeypatch):
    users = {"OMPI_MCA_btl": "tcp,self", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
             "HYDRA_LAUNCHER": "fork", "HYDRA_HOST_FILE": "/etc/hosts.mpi", "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
             "PMIX_MCA_gds": "hash", "MPIR_CVAR_CH4_NETMOD": "ofi"}
    ranks = {"PMI_RANK": "1", "PMI_SIZE": "4", "PMI_FD": "9", "MPI_LOCALRANKID": "1", "HYDI_CONTROL_FD": "7",
             "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "1", "PMIX_NAMESPACE": "job.1",
             "PMIX_SERVER_URI41": "pmix-server.1;tcp4://127.0.0.1:4242", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    for name, value in {**users, **ranks}.items():
        monkeypatch.setenv(name, value)
    env = clean_env()
    assert {k: env.get(k) for k in users} == users
    assert [k for k in ranks if k in env] == []


def test_the_smoke_reports_the_error_line_not_open_mpis_closing_banner():
    gpu_smoke = smoke()
    stderr = "error: MPI runs at thread level 1, but ... MPI_THREAD_SERIALIZED (2) or more is needed\n" + "-" * 74 + "\n"
    assert gpu_smoke.last_error(stderr).startswith("error: MPI runs at thread level 1")
    assert gpu_smoke.last_error("Traceback\nRuntimeError: boom\n") == "RuntimeError: boom"


# --- Under stand-in launchers (processes of their own: rank 0 alone, after the in-process tests) ----
HUNG = """#!/bin/sh
# Ignores SIGTERM, as do its two ranks: one in its process group, one in a session of its own (as a
# daemon of another session would start it). Each blocks opening a pipe that no one ever writes.
trap '' TERM
(exec cat "{fifo}") &
echo $! >> "{pids}"
setsid cat "{fifo}" &
echo $! >> "{pids}"
echo $$ >> "{pids}"
wait
"""


@pytest.mark.e2e
def test_a_hung_launch_is_ended_within_its_time_limit_and_leaves_no_process(tmp_path, monkeypatch):
    """The launcher and both its ranks outlive SIGTERM: the row must still come back within the
    launch's time limit, say it timed out, and leave none of the three alive."""
    gpu_smoke = smoke()
    fifo, pids = tmp_path / "never-written", tmp_path / "pids"
    os.mkfifo(fifo)
    stand_in(tmp_path, monkeypatch, HUNG.format(fifo=fifo, pids=pids))
    monkeypatch.setattr(gpu_smoke, "GRACE_S", 0.5, raising=False)
    monkeypatch.setattr(gpu_smoke, "LAUNCHER", ["mpirun"], raising=False)
    rows, limit = [], 3.0

    def row():
        rows.append(gpu_smoke.strategy_row("data parallel", "data_parallel.py", 2, [], 0, limit))
    started = time.monotonic()
    worker = threading.Thread(target=row, daemon=True)
    worker.start()
    worker.join(timeout=limit + 6)
    took = time.monotonic() - started
    left = [int(p) for p in pids.read_text().split()] if pids.exists() else []
    still = [pid for pid in left if alive(pid)]
    for pid in still:  # a failing run must not leave them for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert rows and took <= limit + 1.0, f"the row came back after {took:.1f} s, not within {limit:.0f} s: {rows}"
    assert len(left) == 3 and not still, f"processes of the launch still alive after its row: {still} of {left}"
    assert rows[0].startswith("| data parallel | 2 | staged | FAIL: no result: timed out after 3 s"), rows[0]


@pytest.mark.e2e
def test_a_missing_launcher_is_a_failed_row_not_a_crash(tmp_path, monkeypatch):
    gpu_smoke = smoke()
    one_gpu(monkeypatch)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no mpirun (nor anything else) on PATH
    assert gpu_smoke.main(["--out", str(tmp_path / "smoke.md")]) == 0
    rows = table_rows(tmp_path / "smoke.md")
    assert len(rows) == 2 * len(gpu_smoke.RUNS) + 2, rows
    assert all("| FAIL: " in row or "| not run: " in row for row in rows), rows
    assert "the launcher 'mpirun' did not start (No such file or directory)" in rows[0], rows[0]
    assert "belongs to that library: NO: 'mpirun' is not on PATH" in (tmp_path / "smoke.md").read_text()
    assert gpu_smoke.main(["--out", str(tmp_path / "srun.md"), "--launcher", "srun --mpi=pmix"]) == 0
    assert "the launcher 'srun --mpi=pmix' did not start" in table_rows(tmp_path / "srun.md")[0]


BANNER = """#!/bin/sh
# Exits 2 as a launcher that fails does, closing with a banner of dashes (Open MPI's mpirun).
echo "{line}" >&2
echo "--------------------------------------------------------------------------" >&2
exit 2
"""


@pytest.mark.e2e
def test_the_thread_level_row_passes_on_the_thread_level_line_alone_not_on_any_exit_2(tmp_path, monkeypatch):
    gpu_smoke = smoke()
    one_gpu(monkeypatch)
    for line, verdict in (("mpirun noticed that process rank 0 exited on signal 9", "FAIL"),
                          ("error: MPI runs at thread level 1, but on a GPU MPI is called from autograd's thread: "
                           "MPI_THREAD_SERIALIZED (2) or more is needed", "PASS")):
        stand_in(tmp_path, monkeypatch, BANNER.format(line=line))
        assert gpu_smoke.main(["--out", str(tmp_path / "smoke.md")]) == 0
        thread = [row for row in table_rows(tmp_path / "smoke.md") if row.startswith("| thread level")]
        expected = f"| thread level FUNNELED on a GPU | 2 | - | {verdict}: exit 2"
        assert len(thread) == 1 and thread[0].startswith(expected), (line, thread)


VERSION_ONLY = """#!/bin/sh
# Says it is the MPI that mpi4py loaded (its family and version word for word) but lives elsewhere,
# and starts nothing.
if [ "$1" = "--version" ]; then cat "{said}"; exit 0; fi
echo "this launcher starts nothing" >&2
exit 1
"""


def version_only(tmp_path, monkeypatch):
    """A stand-in that answers --version as this machine's mpirun does, in tmp_path/bin."""
    said = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=60).stdout
    (tmp_path / "said").write_text(said)
    return stand_in(tmp_path, monkeypatch, VERSION_ONLY.format(said=tmp_path / "said"))


@pytest.mark.e2e
def test_a_launcher_of_another_install_is_not_the_same_mpi_though_it_names_the_same_version(tmp_path, monkeypatch):
    gpu_smoke = smoke()
    fake = version_only(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert gpu_smoke.main(["--out", str(tmp_path / "smoke.md")]) == 0
    line = [line for line in (tmp_path / "smoke.md").read_text().splitlines() if "belongs to that library" in line]
    assert len(line) == 1 and "belongs to that library: NO: " in line[0] and str(fake) in line[0], line


@pytest.mark.e2e
def test_the_smoke_never_starts_mpi_in_its_own_process(tmp_path, monkeypatch):
    """Open MPI aborts a process that starts MPI without a launcher's PMI (inside srun --pty): the
    smoke's facts come from child processes, and its own process never calls MPI_Init."""
    version_only(tmp_path, monkeypatch)
    check = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import gpu_smoke\n"
             f"assert gpu_smoke.main(['--out', {str(tmp_path / 'smoke.md')!r}]) == 0\n"
             "module = sys.modules.get('mpi4py.MPI')\n"
             "print('MPI started here:', module is not None and module.Is_initialized())")
    done = subprocess.run([sys.executable, "-c", check], env=clean_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("MPI started here: False"), done.stdout + done.stderr


@pytest.mark.e2e
def test_this_machine_s_mpirun_belongs_to_the_library_mpi4py_loads(monkeypatch):
    """The pip MPICH and its own mpirun, found through the probe's rank even behind a shim."""
    gpu_smoke = smoke()
    monkeypatch.setattr(gpu_smoke, "LAUNCHER", ["mpirun"])
    rank = gpu_smoke.rank_facts()
    line = gpu_smoke.launcher_line(gpu_smoke.library_facts(), rank)
    assert "belongs to that library: yes: " in line and isinstance(rank, dict) and rank["world"] == 1, (line, rank)


STOPPING = """#!{python}
# Starts its ranks (the stand-in data_parallel.py for the real one) and returns the lowest rank's
# non-zero status; signalled itself, it ends the job and returns 1, as Open MPI 4.1's mpirun does.
import os, signal, subprocess, sys
args = sys.argv[1:]
if args[:1] == ["--version"]:
    print("mpirun (Open MPI) 4.1.6")
    sys.exit(0)
at = args.index("-n" if "-n" in args else "-np")
count = int(args[at + 1])
command = [{rank!r} if a.endswith("data_parallel.py") else a for a in args[at + 2:]]
ranks = []


def ends_the_job(number, frame):
    open({log!r}, "a").write("the launcher got signal %d\\n" % number)
    for rank in ranks:
        rank.terminate()
    for rank in ranks:
        rank.wait()
    os._exit(1)
signal.signal(signal.SIGTERM, ends_the_job)
ready, told = os.pipe()
for r in reversed(range(count)):  # rank 0 last, once the others are ready for the signal
    if r == 0:
        os.close(told)
        assert len(os.read(ready, count)) == count - 1
    env = dict(os.environ, FAKE_RANK=str(r), FAKE_READY=str(told))
    ranks.append(subprocess.Popen(command, env=env, pass_fds=(told,) if r else ()))
codes = [rank.wait() for rank in reversed(ranks)]
sys.exit(next((code for code in codes if code), 0))
"""
STOPPING_RANK = """import json, os, signal, sys
# Trains until SIGTERM comes (blocked, then waited for: no sleep), saves, says so, exits 75.
args, rank = sys.argv[1:], os.environ["FAKE_RANK"]
steps = int(args[args.index("--steps") + 1])
save = args[args.index("--save") + 1] if "--save" in args else None
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
if rank != "0":  # ready for the signal: rank 0 starts now
    os.write(int(os.environ["FAKE_READY"]), b"r")
if save and "--resume" not in args:
    if rank == "0":
        print("step 1/%d | loss 1.0000" % steps, flush=True)
    signal.sigwait({{signal.SIGTERM}})
    os.makedirs(save, exist_ok=True)
    open(os.path.join(save, "rank-" + rank), "w").close()
    if rank == "0":
        print("stopped by a signal after step 1 of %d: checkpoint saved in %s; rerun with --resume to continue "
              "(exit status 75)" % (steps, save), flush=True)
    sys.exit(75)
if save and not os.path.exists(os.path.join(save, "rank-" + rank)):
    sys.exit(3)
if rank == "0":
    print(json.dumps({{"world_size": 2, "losses": [1.0 / (s + 1) for s in range(steps)]}}))
"""


@pytest.mark.e2e
def test_the_stop_row_signals_the_ranks_alone_and_expects_75_from_the_launcher(tmp_path, monkeypatch):
    """A launcher that ends the job with status 1 when signalled itself (Open MPI 4.1's mpirun; its
    command line names data_parallel.py, as the ranks' do): the row must signal only the ranks,
    whose 75 the launcher then returns."""
    gpu_smoke = smoke()
    (tmp_path / "data_parallel.py").write_text(STOPPING_RANK.format())
    log = tmp_path / "launcher-signals"
    stand_in(tmp_path, monkeypatch, STOPPING.format(python=sys.executable, rank=str(tmp_path / "data_parallel.py"),
                                                    log=str(log)))
    monkeypatch.setattr(gpu_smoke, "LAUNCHER", ["mpirun"], raising=False)
    started = time.monotonic()
    row = gpu_smoke.stop_and_resume(tmp_path / "save", gpu_smoke.Budget(60))
    assert not log.exists(), f"the launcher was signalled: {log.read_text()}; the row: {row}"
    assert row.startswith("PASS: stopped by a signal after step 1 of ") and "the launcher's exit 75" in row, row
    assert "Open MPI's mpirun returns the status of the lowest rank" in row and time.monotonic() - started < 30, row


@pytest.mark.e2e
def test_the_smoke_s_stop_and_resume_row_on_the_cpu(tmp_path, monkeypatch):
    """The row itself with data_parallel.py, on the CPU (50 steps, not 300: at 20 ms a step or more on a
    CPU the signal comes while it trains): SIGTERM to the ranks as soon as training runs, the stop's
    status through this machine's mpirun, and the resumed losses within the tolerance."""
    gpu_smoke = smoke()
    monkeypatch.setattr(gpu_smoke, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_smoke, "STOP_STEPS", 50, raising=False)
    monkeypatch.setattr(gpu_smoke, "LAUNCHER", ["mpirun"], raising=False)
    row = gpu_smoke.stop_and_resume(tmp_path / "save", gpu_smoke.Budget(240))
    assert row.startswith("PASS: stopped by a signal after step ") and "the launcher's exit 75" in row, row


@pytest.mark.e2e
def test_without_a_gpu_the_gpu_commands_say_so_in_one_line_each(tmp_path):
    """bench/gpu_smoke.sh still writes its table, each GPU row 'no GPU'; run.py --gpu refuses."""
    smoke_sh = subprocess.run(["bash", str(ROOT / "bench" / "gpu_smoke.sh"), "--out", str(tmp_path / "smoke.md")],
                              env=clean_env(), capture_output=True, text=True, timeout=180)
    assert smoke_sh.returncode == 0, smoke_sh.stderr
    rows = table_rows(tmp_path / "smoke.md")
    assert len(rows) >= 20 and all(row.endswith("| no GPU |") for row in rows), rows
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--gpu"], env=clean_env(),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --gpu: torch sees no CUDA device")
    assert len(refused.stderr.splitlines()) == 1


@pytest.mark.e2e
def test_the_staged_cost_table_prints_a_row_per_size_and_part(tmp_path):
    """bench/staged_cost.py on the CPU: the host allreduce alone, one row per size, bus bandwidth as
    nccl-tests counts it (2(N-1)/N of the bytes over the time)."""
    from harness import launch
    result = launch("bench/staged_cost.py", 2, "--device", "cpu", "--sizes-mb", "0.01", "0.1", "--repeats", "2")
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| 0.")]
    assert result.returncode == 0 and [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("0.01", "host allreduce"), ("0.1", "host allreduce")], result.stdout + result.stderr
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
