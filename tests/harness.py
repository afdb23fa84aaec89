"""What every strategy's tests share: sub-communicators, collective asserts, clean launches.

In-process tests run under `mpirun -np 4 python -m pytest --with-mpi` and are marked
`@pytest.mark.mpi`; they take a sub-communicator of the size they test. End-to-end tests are
marked `@pytest.mark.e2e`: they launch a script with mpirun as a user would, from rank 0 only,
after every in-process test (see conftest.py), with the MPI environment removed and a timeout.
"""
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = [1, 2, 3, 4]  # the world sizes in-process tests cover, on sub-communicators
LAUNCH_TIMEOUT = 180  # seconds; no launch may hang the suite
MPI_ENV_PREFIXES = ("PMI_", "HYDRA_", "OMPI_", "PMIX_", "PRTE_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")


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
    """This environment without the variables of the MPI job pytest may be running in, and
    without GPUs: the suite runs on the CPU whatever the machine (GPU runs: bench/run.py --gpu)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV_PREFIXES)}
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
