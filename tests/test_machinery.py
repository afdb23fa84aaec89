"""The machinery below each strategy file's divider: the same text in every file, and what it does
(CUDA-awareness, thread level, paths checked before training, the timeline and the counters).

The behaviour is tested on data_parallel.py's copy; test_the_machinery_is_word_for_word_alike
proves that every other file holds the same text."""
import ast
import gc
import importlib
import os
import re
import tracemalloc
import types
from pathlib import Path

import pytest
import torch

import data_parallel as dp
from harness import ROOT, agree, sub_comm

CPU = torch.device("cpu")
SCRIPTS = ["data_parallel.py", "tensor_parallel.py", "pipeline_parallel.py", "model_parallel.py",
           "sharded_data_parallel.py", "hybrid_parallel.py", "context_parallel.py", "expert_parallel.py"]
PRESENT = [s for s in SCRIPTS if (ROOT / s).exists()]
DIVIDER = "# " + "=" * 77
LESSON_BUDGETS = {"context_parallel.py": 650, "pipeline_parallel.py": 850, "hybrid_parallel.py": 1050}
SHARED_MARK = "# --- The machinery every strategy file shares, word for word (tests/test_machinery.py) ---"


def parts(script):
    """(the lesson, the file's own machinery, the shared machinery): the text above the divider,
    between the divider and the shared block's first line, and from there to the end."""
    text = (ROOT / script).read_text()
    divider, shared = text.index(DIVIDER), text.index(SHARED_MARK)
    return text[:divider], text[divider:shared], text[shared:]


def definition_lines(text):
    """Lines of the top-level functions and classes in text (blank lines and comments between
    them aside): the measure of the machinery's budget."""
    return sum(node.end_lineno - node.lineno + 1 for node in ast.parse(text).body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef)))


@pytest.mark.parametrize("script", PRESENT)
def test_the_machinery_is_word_for_word_alike(script):
    assert parts(script)[2] == parts("data_parallel.py")[2], f"{script}'s shared machinery differs from data_parallel.py's"


@pytest.mark.parametrize("script", PRESENT)
def test_each_part_keeps_its_budget(script):
    """The lesson at most 600 lines, its divider included (context 650, pipeline 850, hybrid 1,050:
    it composes five); below the divider, the file's own machinery at most 250 lines of
    definitions, the shared machinery at most 600."""
    lesson, own, shared = parts(script)
    lesson_budget = LESSON_BUDGETS.get(script, 600)
    assert len(lesson.splitlines()) + 1 <= lesson_budget  # + 1: the divider's own line
    assert definition_lines(own) <= 250 and definition_lines(shared) <= 600, (definition_lines(own), definition_lines(shared))


@pytest.mark.parametrize("script", PRESENT)
def test_the_readme_gives_each_lesson_its_length(script):
    """README.md's table of files: the *lesson* column is the lines above the divider, as counted here."""
    row = re.search(r"^\| `%s`[^|]*\| ([\d,]+) \|" % re.escape(script), (ROOT / "README.md").read_text(), re.M)
    assert row and int(row.group(1).replace(",", "")) == len(parts(script)[0].splitlines()) + 1, script


@pytest.mark.parametrize("script", PRESENT)
def test_no_strategy_file_reads_a_test_hook(script):
    assert "FAIL_AT" not in (ROOT / script).read_text()


@pytest.mark.parametrize("script", PRESENT)
def test_the_strategy_comes_first(script):
    """The first strategy definition within 120 lines, its first MPI call within 150, a divider."""
    lines = (ROOT / script).read_text().splitlines()
    first_code = next(i for i, line in enumerate(lines, 1) if re.match(r"(def|class) ", line))
    first_mpi = next(i for i, line in enumerate(lines, 1)
                     if re.search(r"\.(Allreduce|Iallreduce|Isend|Irecv|Reduce_scatter_block|Ireduce_scatter_block"
                                  r"|Allgather|Iallgather|Bcast|Alltoall|Alltoallv|Sendrecv)\(", line))
    assert first_code <= 120 and first_mpi <= 150 and DIVIDER in lines


@pytest.mark.parametrize("kinds, cuda", [
    ("mpi,system", False), ("system,cuda:host", False), ("cuda:host", False), ("", False),
    ("system,cuda", True), ("mpi, system, cuda:device", True), ("cuda:device", True),
    ("system,cudax", False),
])
def test_memory_kinds_are_parsed_not_searched(kinds, cuda):
    assert dp.cuda_in_kinds(kinds) is cuda


def test_mpi_cuda_aware_set_decides_without_probing_the_library_and_a_doubt_is_said(monkeypatch):
    """The pip MPICH is built without CUDA: it lists no cuda memory kind and its query says 0. Set,
    MPI_CUDA_AWARE decides and the query is never called (a debug MPICH before 4.0 asserts in it);
    a 1 against the memory kinds is a warning beside the header's transport, not a refusal."""
    comm = types.SimpleNamespace(Get_info=lambda: types.SimpleNamespace(Get=lambda key: "mpi,system"))

    def no_probe():
        raise AssertionError("MPIX_Query_cuda_support called although MPI_CUDA_AWARE is set")
    monkeypatch.setattr(dp, "mpix_query_cuda_support", no_probe)
    monkeypatch.setenv("MPI_CUDA_AWARE", "1")
    aware, why = dp.mpi_cuda_aware(comm)
    assert aware is True and why.startswith("MPI_CUDA_AWARE=1; warning:") and "list no cuda" in why
    monkeypatch.setenv("MPI_CUDA_AWARE", "0")
    assert dp.mpi_cuda_aware(comm) == (False, "MPI_CUDA_AWARE=0")


def test_mpi_cuda_aware_unset_asks_the_memory_kinds_then_cray_then_the_query(monkeypatch):
    comm = types.SimpleNamespace(Get_info=lambda: types.SimpleNamespace(Get=lambda key: kinds[0]))
    kinds, answers = ["system,cuda:device"], []
    monkeypatch.delenv("MPI_CUDA_AWARE", raising=False)
    monkeypatch.setattr(dp, "mpix_query_cuda_support", lambda: answers[0])
    monkeypatch.setattr(dp, "mpi_libraries_loaded", lambda name="libmpi": ["/opt/cray/libmpi_gtl_cuda.so"])
    assert dp.mpi_cuda_aware(comm) == (True, "memory kinds system,cuda:device")
    kinds[0] = None
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "1")
    assert dp.mpi_cuda_aware(comm)[1].startswith("Cray MPICH")
    monkeypatch.delenv("MPICH_GPU_SUPPORT_ENABLED")
    answers[:] = [True]
    monkeypatch.setattr(dp, "mpi_library", lambda: "Open MPI v4.1.6, package: Open MPI")
    aware, why = dp.mpi_cuda_aware(comm)
    assert aware is True and why.startswith("probably: Open MPI 4's")
    monkeypatch.setattr(dp, "mpi_library", lambda: "MPICH Version: 4.2.0")
    assert dp.mpi_cuda_aware(comm) == (True, "MPIX_Query_cuda_support")
    answers[:] = [None]
    assert dp.mpi_cuda_aware(comm) == (False, "no sign of CUDA support")


@pytest.mark.mpi
def test_the_pip_mpich_is_not_cuda_aware():
    """The real library, unforced: no cuda memory kind, and its query says no."""
    assert dp.mpix_query_cuda_support() is False
    assert dp.mpi_cuda_aware(dp.MPI.COMM_WORLD)[0] is False


def test_a_thread_level_below_serialized_is_refused():
    with pytest.raises(dp.ConfigError, match="MPI_THREAD_SERIALIZED"):
        dp.check_thread_level(dp.MPI.THREAD_FUNNELED)
    dp.check_thread_level(dp.MPI.THREAD_SERIALIZED)
    dp.check_thread_level(dp.MPI.THREAD_MULTIPLE)


def test_the_library_name_is_printable_text(monkeypatch):
    """Open MPI's version string ends in a NUL byte, which makes a batch log 'binary' to grep."""
    monkeypatch.setattr(dp.MPI, "Get_library_version", lambda: "Open MPI v5.0.5, package: Open MPI\0")
    assert dp.mpi_library() == "Open MPI v5.0.5, package: Open MPI"


@pytest.mark.mpi
def test_a_save_folder_that_not_every_rank_sees_is_refused_on_every_rank(tmp_path_factory):
    """A node-local disk, simulated: each rank gets a folder of its own under the same name."""
    with sub_comm(2) as comm:
        refused = shared_ok = True
        if comm is not None:
            own = tmp_path_factory.mktemp(f"rank{comm.Get_rank()}") / "ckpt"
            args = dp.parse_args(["--save", str(own), "--batch-size", "4"], 2)
            try:
                dp.check_paths(comm, args)
                refused = False
            except dp.ConfigError as e:
                refused = "every rank shares" in str(e)
            folder = comm.bcast(str(tmp_path_factory.mktemp("shared") / "a" / "b"), root=0)
            dp.check_paths(comm, dp.parse_args(["--save", folder, "--batch-size", "4"], 2))
            comm.Barrier()
            shared_ok = sorted(p.name for p in (tmp_path_factory.getbasetemp() / folder).iterdir()) == []
        assert agree(refused)
        assert agree(shared_ok)  # made with its parents, and no probe left behind


def test_timeline_spans_count_their_own_time_once():
    timeline = dp.Timeline(CPU)
    start = dp.time.perf_counter()
    with timeline.span("compute", "backward"):
        with timeline.span("comm", "Iallreduce"):
            dp.time.sleep(0.002)
        dp.time.sleep(0.001)
    with timeline.span("idle", "Irecv wait"):
        dp.time.sleep(0.001)
    record = timeline.step_record(start)
    took = {name: end - begin for name, _, begin, end in timeline.events}
    assert sorted(took) == ["Iallreduce", "Irecv wait", "backward"]
    assert record["comm_s"] == took["Iallreduce"] and record["wait_s"] == took["Irecv wait"]
    assert abs(record["compute_s"] - (took["backward"] - took["Iallreduce"])) < 1e-12
    assert abs(record["step_s"] - record["compute_s"] - record["comm_s"] - record["idle_s"]) < 1e-12


@pytest.mark.mpi
def test_the_counted_communicator_passes_calls_through_and_counts_them():
    comm = dp.MPI.COMM_WORLD
    counted = dp.CountedComm(comm, dp.Timeline(CPU))
    t = torch.ones(10)
    counted.Allreduce(dp.MPI.IN_PLACE, t, op=dp.MPI.SUM)
    u = torch.ones(3, dtype=torch.float64)  # must outlive the request: MPI writes into it
    request = counted.Iallreduce(dp.MPI.IN_PLACE, u, op=dp.MPI.SUM)
    request.Wait()
    ok = bool((t == comm.Get_size()).all()) and bool((u == comm.Get_size()).all()) and counted.calls == {"Allreduce": 1, "Iallreduce": 1}
    ok = ok and counted.bytes == {"Allreduce": 40, "Iallreduce": 24} and counted.Get_size() == comm.Get_size()
    assert agree(ok)


def test_started_within_counts_the_exchanges_that_began_inside_the_computation():
    events = [("backward", "compute", 0.0, 1.0), ("Iallreduce", "comm", 0.5, 0.6),
              ("Iallreduce", "comm", 1.0, 1.1), ("Allreduce", "comm", 1.2, 1.3), ("optimizer", "compute", 1.3, 1.4)]
    assert dp.started_within(events, "Iallreduce", "backward") == [1, 2]  # one began as backward ended
    assert dp.started_within(events, ("Iallreduce", "Allreduce"), ("backward", "optimizer")) == [1, 3]
    assert dp.started_within(events, "Isend", "backward") == [0, 0]


def test_the_peak_memory_of_training_is_what_it_allocated_and_freed_memory_leaves():
    """4 MB tensors, 80 MB of them, freed: glibc would keep them in its heap (the resident set
    would not fall, and the next peak would hide inside it) unless start_mpi fixed the threshold.
    Measured: 80.1 MB, and 0.06 MB after the free; with the threshold left adaptive, 80.1 MB after
    the free. The tensors are 4 MB because smaller ones may land in free memory the process
    already held, which no resident-set peak can see: 200 tensors of 400 KB measured 79.1 MB in a
    long pytest process. A small tensor after each keeps the heap's top from shrinking by itself."""
    handlers = {number: dp.signal.getsignal(number) for number in dp.STOP_SIGNALS}
    dp.start_mpi()  # MPI already runs here: this fixes the C library's mmap threshold (and catches signals)
    for number, handler in handlers.items():  # pytest's own again: a SIGTERM must still end the suite
        dp.signal.signal(number, handler)
    gc.collect()  # earlier tests' garbage, freed inside the window, would lower the peak
    memory = dp.PeakMemory(CPU)
    freed = torch.ones(1_000_000)  # an adaptive threshold would rise to 4 MB when this is freed
    del freed
    memory.reset()
    held = [(torch.ones(1_000_000), torch.ones(10)) for _ in range(20)]
    memory.stop()
    assert 80e6 <= memory.bytes <= 80e6 + 20e6, memory.bytes
    del held
    memory.reset()  # the resident set fell: a new peak starts from the low level
    memory.stop()
    assert memory.bytes < 20e6, memory.bytes


@pytest.mark.mpi
def test_resume_on_an_empty_folder_returns_no_checkpoint(tmp_path_factory):
    with sub_comm(2) as comm:
        ok = True
        if comm is not None:
            root = comm.bcast(str(tmp_path_factory.mktemp("empty")), root=0)
            ok = dp.load_checkpoint(comm, root, {}, lambda manifest: {}, 10) == (None, None)
        assert agree(ok)


# --- Batch jobs: the stop's status, --help, the launcher's word, waiting -------------------------
def test_a_run_stopped_by_a_signal_exits_with_a_status_of_its_own(monkeypatch):
    """Not 0 (a batch script would take it for a finished run and never requeue it), not 1 or 2."""
    monkeypatch.setattr(dp, "stop_requested", [dp.signal.SIGTERM])
    args = dp.argparse.Namespace(save=None, save_every=0, steps=10)
    with pytest.raises(SystemExit) as stop:
        dp.checkpoint_if_due(dp.MPI.COMM_SELF, args, 3, lambda: ({}, None), {})
    assert stop.value.code == dp.STOPPED and dp.STOPPED not in (0, 1, 2)
    assert f"{dp.STOPPED} stopped by SIGTERM or SIGUSR1" in dp.EXIT_STATUSES


@pytest.mark.parametrize("script", PRESENT)
def test_help_gives_every_flag_its_default_and_the_exit_statuses(script, monkeypatch):
    module = importlib.import_module(script[:-3])
    printed = []
    monkeypatch.setattr(module.Parser, "_print_message", lambda self, message, file=None: printed.append(message))
    with pytest.raises(SystemExit):
        module.parse_args(["--help"], 4)
    text = "".join(printed)
    options = re.split(r"\n  (?=-)", text.split("options:", 1)[1].split("\n\n")[0])[1:]
    undefaulted = [o.split()[0] for o in options if "default" not in o and not o.startswith("-h")]
    assert len(options) > 10 and undefaulted == [], undefaulted
    assert f"{module.STOPPED} stopped by SIGTERM" in " ".join(text.split())


@pytest.mark.parametrize("variables, world, refused", [
    ({"PMI_SIZE": "4"}, 1, True),  # hydra started 4, mpi4py's MPI sees 1 each
    ({"OMPI_COMM_WORLD_SIZE": "4"}, 1, True),
    ({"SLURM_STEP_NUM_TASKS": "4"}, 1, True),  # srun --mpi=none started 4 singletons
    ({"FLUX_JOB_SIZE": "4"}, 1, True),  # flux run -n 4 of singletons
    ({"PMI_SIZE": "1", "SLURM_STEP_NUM_TASKS": "4"}, 1, False),  # mpirun -np 1 inside a 4-task step
    ({"PMI_SIZE": "2", "SLURM_STEP_NUM_TASKS": "4"}, 2, False),  # mpirun -np 2 inside a 4-task step
    ({}, 1, False),  # python FILE.py, a singleton
    ({"SLURM_NTASKS": "4"}, 1, False),  # python FILE.py in the batch script of a 4-task job
])
def test_n_one_rank_jobs_are_refused_and_a_smaller_mpirun_inside_an_allocation_is_not(
        variables, world, refused, monkeypatch, capsys):
    """Refused with status 2; the line comes from the launcher's rank 0 alone, not from each job."""
    for name in (*dp.WORLD_SIZE_VARIABLES, *dp.RANK_VARIABLES, "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if refused:
        said = {}
        for launcher_rank in ("0", "3"):
            monkeypatch.setenv("PMI_RANK", launcher_rank)
            with pytest.raises(SystemExit) as refusal:
                dp.check_one_job(world)
            assert refusal.value.code == 2
            said[launcher_rank] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert said["3"] == [] and len(said["0"]) == 1 and "the launcher started 4 ranks" in said["0"][0]
        assert "MPI sees a world of 1: each would train alone" in said["0"][0]
    else:
        dp.check_one_job(world)


@pytest.mark.parametrize("variables, local", [
    ({"PALS_LOCAL_RANKID": "3"}, 3), ({"FLUX_TASK_LOCAL_ID": "2"}, 2), ({"MV2_COMM_WORLD_LOCAL_RANK": "1"}, 1),
    ({"SLURM_LOCALID": "0", "MPI_LOCALRANKID": "2"}, 2),  # hydra's rank under a proxy that srun started
    ({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 3), ({"SLURM_LOCALID": "1"}, 1), ({}, None),
])
def test_the_local_rank_comes_from_the_launcher_that_started_the_rank(variables, local, monkeypatch):
    for name in dp.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert dp.launcher_local_rank() == local


@pytest.mark.parametrize("query, aware", [(True, True), (False, False), (None, False)])
def test_memory_kinds_without_cuda_mean_unknown_and_the_next_probe_answers(query, aware, monkeypatch):
    """Memory kinds list only what the launch asked for: 'mpi,system' says nothing of CUDA."""
    monkeypatch.delenv("MPI_CUDA_AWARE", raising=False)
    monkeypatch.setattr(dp, "mpix_query_cuda_support", lambda: query)
    comm = types.SimpleNamespace(Get_info=lambda: types.SimpleNamespace(Get=lambda key: "mpi,system"))
    assert dp.mpi_cuda_aware(comm)[0] is aware


class StubRequest:
    """Done after `polls` Tests, or at once on Wait."""

    def __init__(self, polls):
        self.polls, self.waited = polls, False

    def Test(self):
        self.polls -= 1
        return self.polls < 0

    def Wait(self):
        self.waited = True


@pytest.mark.parametrize("oversubscribed", [True, False])
def test_a_waiting_rank_naps_only_where_ranks_outnumber_cores(oversubscribed, monkeypatch):
    naps = []
    monkeypatch.setattr(dp, "SLEEP_WHILE_WAITING", oversubscribed)
    monkeypatch.setattr(dp.time, "sleep", naps.append)
    request = StubRequest(polls=3)
    dp.CountedRequest(request, dp.Timeline(CPU), "idle", "Irecv").Wait()
    assert naps == ([dp.POLL_S] * 3 if oversubscribed else []) and request.waited


@pytest.mark.mpi
@pytest.mark.parametrize("cores, naps", [(1, True), (64, False)])
def test_setup_counts_the_cores_of_the_node_s_ranks_together(cores, naps, monkeypatch):
    """Two ranks on one node: each may run on `cores` cores (the same ones); they nap only on one."""
    monkeypatch.setattr(dp.os, "sched_getaffinity", lambda pid: set(range(cores)))
    threads = torch.get_num_threads()
    with sub_comm(2) as comm:
        ok = True
        if comm is not None:
            run = dp.setup(comm, dp.parse_args(["--device", "cpu", "--batch-size", "4"], 2))
            ok = dp.SLEEP_WHILE_WAITING is naps and any("share 1 CPU cores" in n for n in run.header) is naps
        torch.set_num_threads(threads)
        dp.SLEEP_WHILE_WAITING = True
        assert agree(ok)


# --- Checkpoints on a shared file system ----------------------------------------------------------
SHARD = ({"weights": dp.piece(torch.arange(12.0))}, {"losses": [1.5]})


def fake_checkpoint(root, step):
    (root / f"step-{step:06d}").mkdir(parents=True)
    (root / f"step-{step:06d}" / "manifest.json").write_text("{}")


def test_checkpoints_sort_by_their_number_past_a_million_steps(tmp_path):
    """step-1000000 sorts before step-999999 as text: the newest would be deleted as the oldest."""
    for step in (5, 999_999, 1_000_000):
        fake_checkpoint(tmp_path, step)
    assert [p.rsplit("-", 1)[1] for p in dp.checkpoints(str(tmp_path))] == ["000005", "999999", "1000000"]
    dp.save_checkpoint(dp.MPI.COMM_SELF, str(tmp_path), 1_000_001, SHARD, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1000000", "step-1000001"]


def test_an_old_checkpoint_that_cannot_be_deleted_warns_and_the_save_goes_on(tmp_path, monkeypatch, capsys):
    rmtree = dp.shutil.rmtree

    def failing(path, *args, **kwargs):
        if "step-000001" in str(path) and not kwargs.get("ignore_errors"):
            raise PermissionError(13, "Permission denied", str(path))
        return rmtree(path, *args, **kwargs)
    monkeypatch.setattr(dp.shutil, "rmtree", failing)
    for step in (1, 2, 3):
        dp.save_checkpoint(dp.MPI.COMM_SELF, str(tmp_path), step, SHARD, {})
    assert [p.rsplit("-", 1)[1] for p in dp.checkpoints(str(tmp_path))] == ["000002", "000003"]
    warning = capsys.readouterr().err
    assert "warning: the old checkpoint" in warning and "Permission denied" in warning


def test_a_checkpoint_s_files_and_folder_are_fsynced_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    events, fsync, rename = [], dp.os.fsync, dp.os.rename

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recorded_rename(source, target):
        events.append(("rename", str(source)))
        return rename(source, target)
    monkeypatch.setattr(dp.os, "fsync", recorded_fsync)
    monkeypatch.setattr(dp.os, "rename", recorded_rename)
    dp.save_checkpoint(dp.MPI.COMM_SELF, str(tmp_path), 7, SHARD, {})
    tmp = str(tmp_path / ".tmp-step-000007")
    synced = [path for kind, path in events[:events.index(("rename", tmp))] if kind == "fsync"]
    assert {tmp + "/rank-0.pt", tmp + "/manifest.json", tmp} <= set(synced) and synced[-1] == tmp, events
    assert ("fsync", str(tmp_path)) in events[events.index(("rename", tmp)):], events


def test_a_shard_streams_to_its_file_without_a_serialised_copy_in_memory(tmp_path):
    """Measured with tracemalloc (torch's tensors are not Python allocations; a serialised copy
    in a BytesIO is): a 20 MB shard went through 20 MB of Python memory before, 0.04 MB now."""
    weights = torch.randn(5_000_000)
    shard = ({"weights": dp.piece(weights)}, None)
    tracemalloc.start()
    try:
        dp.save_checkpoint(dp.MPI.COMM_SELF, str(tmp_path), 1, shard, {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    manifest, loaded = dp.load_checkpoint(dp.MPI.COMM_SELF, str(tmp_path), {},
                                          lambda m: {"weights": dp.region([5_000_000])}, 2)
    assert peak < 2e6, peak
    assert torch.equal(loaded["weights"], weights) and manifest["step"] == 1


def rows(count, parts, index):
    """The rows [start, stop) of part `index` when `count` rows are cut into `parts` near-equal parts."""
    return count * index // parts, count * (index + 1) // parts


WHOLE = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)  # rows cut one way, columns another


def save_cut(comm, root, step, transposed=False):
    """Rank r of N writes rows r/N of WHOLE (columns r/N when transposed), and the same
    replicated vector (rank 0's alone is indexed); the state names the step."""
    n, r = comm.Get_size(), comm.Get_rank()
    lo, hi = rows(WHOLE.size(1 if transposed else 0), n, r)
    block = WHOLE[:, lo:hi] if transposed else WHOLE[lo:hi]
    offset = [0, lo] if transposed else [lo, 0]
    pieces = {"w": dp.piece(block, WHOLE.shape, offset), "bias": dp.piece(torch.full((3,), float(step)))}
    dp.save_checkpoint(comm, str(root), step, (pieces, {"step": step} if r == 0 else None), {})


@pytest.mark.mpi
@pytest.mark.parametrize("written, read", [(3, 2), (2, 4), (4, 3), (1, 4), (4, 1)])
def test_a_checkpoint_is_re_cut_for_another_grid_and_each_rank_reads_only_what_overlaps(
        written, read, tmp_path_factory, monkeypatch):
    """Rows written by `written` ranks, read back by `read` ranks as column blocks (every file
    overlaps every rank's block: rank 0 reads each once and broadcasts it), then rank r asks for
    row r alone and opens only the file that holds it, unless every rank needs that one file."""
    opened = []
    monkeypatch.setattr(dp, "open", lambda path, *a, **k: opened.append(os.path.basename(path)) or open(path, *a, **k),
                        raising=False)
    root = Path(dp.MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("cut")), root=0))
    with sub_comm(written) as comm:
        if comm is not None:
            save_cut(comm, root, 1)
    files = [f"rank-{i}.pt" for i in range(written)]
    with sub_comm(read) as comm:
        ok = True
        if comm is not None:
            r, n = comm.Get_rank(), comm.Get_size()
            lo, hi = rows(6, n, r)
            opened.clear()
            manifest, blocks = dp.load_checkpoint(comm, str(root), {}, lambda m: {
                "w": dp.region([7, 6], [0, lo], [7, hi - lo]), "bias": dp.region([3])}, 10)
            ok = (manifest["state"] == {"step": 1} and torch.equal(blocks["w"], WHOLE[:, lo:hi])
                  and torch.equal(blocks["bias"], torch.ones(3)))
            ok = ok and opened == (["manifest.json", *files] if r == 0 else [] if n > 1 else files)
            opened.clear()
            row = dp.load_checkpoint(comm, str(root), {}, lambda m: {"w": dp.region([7, 6], [r, 0], [1, 6])}, 10)[1]
            holder = [next(f for i, f in enumerate(files) if rows(7, written, i)[0] <= s < rows(7, written, i)[1])
                      for s in range(n)]  # of each rank's row
            shared = n > 1 and len(set(holder)) == 1  # one file holds every rank's row
            ok = ok and torch.equal(row["w"], WHOLE[r:r + 1])
            ok = ok and [f for f in opened if f != "manifest.json"] == ([] if shared and r > 0 else [holder[r]])
        assert agree(ok)


@pytest.mark.mpi
def test_a_file_that_every_rank_needs_is_read_once_and_broadcast(tmp_path_factory, monkeypatch):
    opened = []
    monkeypatch.setattr(dp, "open", lambda path, *a, **k: opened.append(os.path.basename(path)) or open(path, *a, **k),
                        raising=False)
    with sub_comm(3) as comm:
        ok = True
        if comm is not None:
            root = comm.bcast(str(tmp_path_factory.mktemp("every")), root=0)
            pieces = {"w": dp.piece(WHOLE)} if comm.Get_rank() == 0 else {}
            dp.save_checkpoint(comm, root, 1, (pieces, None), {})
            opened.clear()
            blocks = dp.load_checkpoint(comm, root, {}, lambda m: {"w": dp.region([7, 6])}, 10)[1]
            ok = torch.equal(blocks["w"], WHOLE) and opened == (["manifest.json", "rank-0.pt"] if comm.Get_rank() == 0 else [])
        assert agree(ok)


@pytest.mark.mpi
@pytest.mark.parametrize("ask, words", [
    ({"w": dp.region([7, 5])}, "holds w of shape [7, 6], this run's is [7, 5]"),
    ({"w": dp.region([7, 6]), "missing": dp.region([2])}, "holds 0 of the 2 elements of missing")])
def test_a_checkpoint_that_does_not_cover_what_a_rank_asks_for_is_refused_on_every_rank(ask, words, tmp_path_factory):
    with sub_comm(2) as comm:
        ok = True
        if comm is not None:
            root = comm.bcast(str(tmp_path_factory.mktemp("unfit")), root=0)
            save_cut(comm, root, 1)
            try:
                dp.load_checkpoint(comm, root, {}, lambda m: ask if comm.Get_rank() == 1 else {}, 10)
                ok = False
            except dp.ConfigError as e:
                ok = words in str(e)
        assert agree(ok)


def damage(path, how):
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "missing":
        path.unlink()
    else:  # a manifest cut short
        manifest = path.parent / "manifest.json"
        manifest.write_text(manifest.read_text()[:20])


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["flip", "missing", "manifest"])
def test_resume_passes_over_a_damaged_latest_checkpoint_for_the_newest_whole_one(how, tmp_path_factory, capsys):
    """Rank 1's file of step 2 damaged: every rank resumes from step 1, rank 0 too, though the file
    it reads of step 2 is whole (no state joins two checkpoints), and rank 0 says why."""
    with sub_comm(2) as comm:
        ok = True
        if comm is not None:
            root = Path(comm.bcast(str(tmp_path_factory.mktemp("damaged")), root=0))
            for step in (1, 2):
                save_cut(comm, root, step)
            if comm.Get_rank() == 0:
                damage(root / "step-000002" / "rank-1.pt", how)
            comm.Barrier()
            lo, hi = rows(7, 2, comm.Get_rank())
            own_rows = lambda manifest: {"w": dp.region([7, 6], [lo, 0], [hi - lo, 6]), "bias": dp.region([3])}
            try:  # an exception here must fail the test on every rank, not leave the others waiting
                manifest, blocks = dp.load_checkpoint(comm, str(root), {}, own_rows, 10)
            except dp.ConfigError:
                manifest, blocks = {"step": None}, None
            said = capsys.readouterr().out
            ok = manifest["step"] == 1 and torch.equal(blocks["w"], WHOLE[lo:hi]) and blocks["bias"][0] == 1
            ok = ok and (comm.Get_rank() != 0 or ("step-000002 is damaged" in said and "resuming from" in said
                                                   and said.strip().endswith("step-000001, the newest whole checkpoint")))
            if comm.Get_rank() == 0:
                damage(root / "step-000001" / "rank-1.pt", how)
            comm.Barrier()
            try:
                dp.load_checkpoint(comm, str(root), {}, own_rows, 10)
                ok = False
            except dp.ConfigError as e:
                ok = ok and str(e).startswith(f"no whole checkpoint in {root}: ") and "step-000001 is damaged" in str(e)
        assert agree(ok)


@pytest.mark.mpi
def test_the_write_probe_costs_o_n_file_system_operations(tmp_path_factory, monkeypatch):
    """Each rank looked for every rank's probe: N^2 lookups, a storm on a parallel file system."""
    looked, exists, listdir = [], dp.os.path.exists, dp.os.listdir

    def counted_exists(path):
        looked.extend([path] if ".probe" in str(path) else [])
        return exists(path)
    monkeypatch.setattr(dp.os.path, "exists", counted_exists)
    monkeypatch.setattr(dp.os, "listdir", lambda path: looked.append(path) or listdir(path))
    with sub_comm(4) as comm:
        ok = True
        if comm is not None:
            folder = comm.bcast(str(tmp_path_factory.mktemp("probe")), root=0)
            dp.check_paths(comm, dp.parse_args(["--save", folder, "--batch-size", "4"], 4))
            ok = len(looked) == 1
        assert agree(ok)
