"""What every strategy's tests share: sub-communicators, collective asserts, clean launches.

In-process tests run under `mpirun -np 4 python -m pytest --with-mpi` and are marked
`@pytest.mark.mpi`; they take a sub-communicator of the size they test. End-to-end tests are
marked `@pytest.mark.e2e`: they launch a script with mpirun as a user would, from rank 0 only,
after every in-process test (see conftest.py), with the MPI environment removed and a timeout.
"""
import contextlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SIZES = [1, 2, 3, 4]  # the world sizes in-process tests cover, on sub-communicators
LAUNCH_TIMEOUT = 180  # seconds; no launch may hang the suite
# What an enclosing job's launcher gives each of its ranks (who it is, how to reach its launcher):
# removed from a launch's environment. The user's MPI configuration stays (OMPI_MCA_*, PRTE_MCA_*,
# PMIX_MCA_*, OMPI_ALLOW_RUN_AS_ROOT*, HYDRA_LAUNCHER, HYDRA_HOST_FILE, ...), so that a launch
# runs as the user's own mpirun would.
RANK_ENV_NAMES = {"PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "PMI_ID", "PMI_JOBID", "PMI_HOSTNAME",
                  "PMI_SPAWNED", "PMI_APPNUM", "PMI_KVSNAME", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "HYDI_CONTROL_FD",
                  "OMPI_UNIVERSE_SIZE", "OMPI_FILE_LOCATION", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_NUM_PROCS",
                  "OMPI_NUM_APP_CTX", "OMPI_ARGV", "OMPI_COMMAND", "OMPI_MCA_ess", "OMPI_MCA_pmix",
                  "OMPI_MCA_initial_wdir", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS",
                  "PALS_RANKID", "PALS_LOCAL_RANKID", "FLUX_TASK_RANK", "FLUX_TASK_LOCAL_ID"}
RANK_ENV_PREFIXES = ("OMPI_COMM_WORLD_", "OMPI_MCA_ess_base_", "MV2_COMM_WORLD_")
# Open MPI's per-job orte settings (its daemon's address, the job's layout and session folders); the
# other OMPI_MCA_orte_* are the user's (orte_tmpdir_base, orte_keep_fqdn_hostnames, ...) and stay.
RANK_ENV_NAMES |= {"OMPI_MCA_orte_hnp_uri", "OMPI_MCA_orte_local_daemon_uri", "OMPI_MCA_orte_num_nodes",
                   "OMPI_MCA_orte_app_num", "OMPI_MCA_orte_precondition_transports", "OMPI_MCA_orte_ess_num_procs",
                   "OMPI_MCA_orte_ess_node_rank", "OMPI_MCA_orte_jobfam_session_dir", "OMPI_MCA_orte_top_session_dir"}


def belongs_to_a_rank(name):
    """PMIX_* but the user's PMIX_MCA_* settings: the PMIx server's address, namespace and rank."""
    return (name in RANK_ENV_NAMES or name.startswith(RANK_ENV_PREFIXES)
            or (name.startswith("PMIX_") and not name.startswith("PMIX_MCA_")))


def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


@contextlib.contextmanager
def sub_comm(size):
    """The first `size` ranks of COMM_WORLD as a communicator; None on the others.

    Every rank of COMM_WORLD must enter (Split is collective); the ones outside get None.
    """
    from mpi4py import MPI
    comm = world()
    if comm.Get_size() < size:
        import pytest
        pytest.skip(f"needs {size} ranks, run under mpirun -np {size} or more")
    sub = comm.Split(0 if comm.Get_rank() < size else MPI.UNDEFINED, comm.Get_rank())
    try:
        yield None if sub == MPI.COMM_NULL else sub
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()
        settle()  # the ranks left out sleep here instead of spinning beside the others


def agree(ok, comm=None):
    """True on every rank if ok is true on every rank: assert on this, never on a local fact
    alone, or one failing rank leaves the others waiting in the next collective."""
    from mpi4py import MPI
    return (comm or world()).allreduce(bool(ok), op=MPI.LAND)


def settle(comm=None):
    """A barrier that sleeps while it waits. Ranks outside a sub-communicator would otherwise
    busy-poll in the next collective (MPICH does) on the cores the ranks inside compute on."""
    request = (comm or world()).Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def max_everywhere(value, comm=None):
    from mpi4py import MPI
    return (comm or world()).allreduce(float(value), op=MPI.MAX)


def clean_env(**extra):
    """This environment without what an enclosing MPI job gave its ranks (pytest itself may be
    one), and without GPUs: the suite runs on the CPU whatever the machine (GPU runs: bench/run.py --gpu)."""
    env = {k: v for k, v in os.environ.items() if not belongs_to_a_rank(k)}
    env.update({"CUDA_VISIBLE_DEVICES": "", **{k: str(v) for k, v in extra.items()}})
    return env


def launch(script, np, *args, timeout=LAUNCH_TIMEOUT, env=None, cwd=ROOT):
    """mpirun -np NP python SCRIPT ARGS, as a user would run it; returns CompletedProcess. With
    FAIL_AT or STAGE_ALL in env, the script runs under tests/inject.py, which plants the fault."""
    env = env or clean_env()
    runner = [str(ROOT / "tests" / "inject.py")] if env.get("FAIL_AT") or env.get("STAGE_ALL") else []
    cmd = ["mpirun", "-np", str(np), sys.executable, *runner, str(ROOT / script), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def start(script, np, *args, env=None):
    """launch(), but running: a Popen whose stdout (text) the test reads as the job goes on."""
    cmd = ["mpirun", "-np", str(np), sys.executable, str(ROOT / script), *map(str, args)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def ranks_of(job, script):
    """The pids of the python processes that mpirun `job` started for script (Linux /proc)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    family, grew = {job.pid}, True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in family} - family
        family, grew = family | more, bool(more)
    ranks = []
    for pid in family - {job.pid}:
        with contextlib.suppress(OSError):
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
            if Path(argv[0].decode()).name.startswith("python") and any(a.endswith(script.encode()) for a in argv):
                ranks.append(pid)
    return ranks


def last_json(result):
    """The JSON object on the last line of stdout (the --json contract)."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def error_lines(result):
    """The lines of stderr that the scripts print for a rejected input."""
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def assert_refused(result, words):
    """A rejected input: exit status 2, one `error:` line that says `words`, no traceback, no
    output on stdout. Returns the line."""
    lines = error_lines(result)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == "", result.stdout + result.stderr
    return lines[0]


def step_2_of(folder, tmp_path_factory):
    """A new folder that holds only the checkpoint of step 2 of `folder` (rank 0 copies it)."""
    copy = None
    if world().Get_rank() == 0:
        copy = tmp_path_factory.mktemp("resumed")
        shutil.copytree(Path(folder) / "step-000002", copy / "step-000002")
    return world().bcast(str(copy), root=0)


def receive_waits_for_queued_kernels(module, monkeypatch):
    """module.receive_buffer on a stand-in GPU tensor (is_cuda, torch.cuda.Event a recorder) with a
    CUDA-aware MPI: it records an event and synchronizes it before handing the tensor itself to MPI.
    The former rule (the tensor itself, no event) records nothing; a CPU tensor needs no event."""
    log = []

    class Event:
        def record(self, stream=None):
            log.append("record")

        def synchronize(self):
            log.append("synchronize")
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(module, "CUDA_AWARE", True)
    on_gpu, on_cpu = types.SimpleNamespace(is_cuda=True, shape=(2, 3), dtype=torch.float32), torch.zeros(3)

    def events(receive_buffer, t):
        log.clear()
        return receive_buffer(t) is t, list(log)
    former = lambda t: t if not t.is_cuda or module.CUDA_AWARE else None  # noqa: E731
    assert events(module.receive_buffer, on_gpu) == (True, ["record", "synchronize"])
    assert events(former, on_gpu) == (True, [])
    assert events(module.receive_buffer, on_cpu) == (True, [])


def planted(monkeypatch, module, name, old, new):
    """The planted bug: module.name recompiled from its source with `old` replaced by `new` (once)."""
    source = textwrap.dedent(inspect.getsource(getattr(module, name)))
    assert source.count(old) == 1, f"the plant needs {old!r} once in {name}"
    scope = {}
    exec(compile(source.replace(old, new), module.__file__, "exec"), vars(module), scope)
    monkeypatch.setattr(module, name, scope[name])


def assert_ragged_batch_is_the_plain_one_cut(module, seq_len=24):
    """module.make_batch without ragged: the slices at the starts, nothing more drawn; with it, the same
    text cut after a document of 1 to seq_len characters in each sequence, its length drawn next from
    the same generator: inputs 0 and targets IGNORE (-100, F.cross_entropy's ignore_index) past it."""
    gen = torch.Generator().manual_seed(5 * 1_000_003 + 7)  # seed 5, step 7, as make_batch seeds it
    data, t = module.load_text(), seq_len
    starts = torch.randint(len(data) - t - 1, (6,), generator=gen).tolist()
    x, y = module.make_batch(5, 7, 6, t)
    assert torch.equal(x, torch.stack([data[o:o + t] for o in starts]))
    assert torch.equal(y, torch.stack([data[o + 1:o + t + 1] for o in starts]))
    lengths = torch.randint(1, t + 1, (6,), generator=gen).tolist()
    rx, ry = module.make_batch(5, 7, 6, t, ragged=True)
    for row, length in enumerate(lengths):
        assert torch.equal(rx[row, :length], x[row, :length]) and torch.equal(ry[row, :length], y[row, :length])
        assert (rx[row, length:] == 0).all() and (ry[row, length:] == -100).all()
    assert module.IGNORE == -100 and len(set(lengths)) > 1
