"""The machinery below each strategy file's divider: the same text in every file, and what it does
(CUDA-awareness, thread level, paths checked before training, the timeline and the counters).

The behaviour is tested on data_parallel.py's copy; test_the_machinery_is_word_for_word_alike
proves that every other file holds the same text."""
import ast
import gc
import re

import pytest
import torch

import data_parallel as dp
from harness import ROOT, agree, sub_comm

CPU = torch.device("cpu")
SCRIPTS = ["data_parallel.py", "tensor_parallel.py", "pipeline_parallel.py", "model_parallel.py",
           "sharded_data_parallel.py", "hybrid_parallel.py", "context_parallel.py", "expert_parallel.py"]
PRESENT = [s for s in SCRIPTS if (ROOT / s).exists()]
DIVIDER = "# " + "=" * 77
LESSON_BUDGETS = {"context_parallel.py": 600, "pipeline_parallel.py": 800, "hybrid_parallel.py": 1000}
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
    """The lesson at most 550 lines, its divider included (context 600, pipeline 800, hybrid 1,000:
    it composes five); below the divider, the file's own machinery at most 200 lines of
    definitions, the shared machinery at most 500."""
    lesson, own, shared = parts(script)
    lesson_budget = LESSON_BUDGETS.get(script, 550)
    assert len(lesson.splitlines()) + 1 <= lesson_budget  # + 1: the divider's own line
    assert definition_lines(own) <= 200 and definition_lines(shared) <= 500, (definition_lines(own), definition_lines(shared))


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


@pytest.mark.mpi
def test_a_forced_cuda_aware_mpi_that_the_library_denies_is_refused(monkeypatch):
    """The pip MPICH is built without CUDA: it lists no cuda memory kind and its
    MPIX_Query_cuda_support says 0. MPI_CUDA_AWARE=1 must be one line, not a crash inside MPI."""
    comm = dp.MPI.COMM_WORLD
    monkeypatch.setenv("MPI_CUDA_AWARE", "1")
    with pytest.raises(dp.ConfigError, match="cannot read GPU memory"):
        dp.mpi_cuda_aware(comm)
    monkeypatch.setenv("MPI_CUDA_AWARE", "0")
    assert dp.mpi_cuda_aware(comm) is False
    monkeypatch.delenv("MPI_CUDA_AWARE")
    assert dp.mpi_cuda_aware(comm) is False
    assert dp.mpix_query_cuda_support() is False  # the library has the query, and says no


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
    dp.start_mpi()  # MPI already runs here: this fixes the C library's mmap threshold only
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
            ok = dp.load_checkpoint(comm, root, {}, lambda manifest: "rank-0.pt", 10) == (None, None)
        assert agree(ok)
