"""The machinery below each strategy file's divider: the same text in every file, and what it does
(CUDA-awareness, thread level, paths checked before training, the timeline and the counters).

The behaviour is tested on data_parallel.py's copy; test_the_machinery_is_word_for_word_alike
proves that every other file holds the same text."""
import ast
import re

import pytest
import torch

import data_parallel as dp
from harness import ROOT, agree, sub_comm

CPU = torch.device("cpu")
SCRIPTS = ["data_parallel.py", "tensor_parallel.py", "pipeline_parallel.py", "model_parallel.py",
           "sharded_data_parallel.py", "hybrid_parallel.py"]
PRESENT = [s for s in SCRIPTS if (ROOT / s).exists()]
DIVIDER = "# " + "=" * 77
# Functions and classes below the divider that every file repeats word for word; the others
# (reference_training, check, print_header, report, parse_args, the shard helpers) differ.
SHARED = ["max_difference", "print_progress", "summary_line", "verdict", "house_keys", "step_summary",
          "write_trace", "print0", "checkpoints", "sha256", "write_durably", "save_checkpoint",
          "load_checkpoint", "Timeline", "CountedComm", "CountedRequest", "setup", "mpi_cuda_aware",
          "cuda_in_kinds", "mpix_query_cuda_support", "check_thread_level", "mpi_library", "inject_failure",
          "ConfigError", "Parser", "checked", "common_arguments", "check_common", "check_paths",
          "abort_on_exception"]


def definitions(script):
    """name -> source text of each top-level function or class below the divider."""
    text = (ROOT / script).read_text()
    below = text.index(DIVIDER)
    return {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and text.index(ast.get_source_segment(text, node)) > below}


@pytest.mark.parametrize("script", PRESENT)
def test_the_machinery_is_word_for_word_alike(script):
    ours, theirs = definitions("data_parallel.py"), definitions(script)
    differing = [name for name in SHARED if theirs.get(name) != ours[name]]
    assert not differing, f"{script} differs from data_parallel.py in {differing}"


@pytest.mark.parametrize("script", PRESENT)
def test_the_strategy_comes_first(script):
    """The first strategy definition within 120 lines, its first MPI call within 150, a divider."""
    lines = (ROOT / script).read_text().splitlines()
    first_code = next(i for i, line in enumerate(lines, 1) if re.match(r"(def|class) ", line))
    first_mpi = next(i for i, line in enumerate(lines, 1)
                     if re.search(r"\.(Allreduce|Iallreduce|Isend|Irecv|Reduce_scatter_block|Ireduce_scatter_block"
                                  r"|Allgather|Iallgather|Bcast)\(", line))
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
