"""pipeline_parallel.py: the schedules on paper, the training step under MPI, the script end to end."""
import json
import os

import pytest
import torch

import pipeline_parallel as pp
from harness import SIZES, agree, assert_refused, last_json, launch, max_everywhere, sub_comm, world

SCHEDULES = sorted(pp.SCHEDULES)
GRID = [(n, m) for n in range(1, 7) for m in (1, 2, 3, 5, 8, 13)]  # M below, at and above N
TINY = ["--layers", "5", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "12",
        "--steps", "3", "--seed", "3"]


def lists(name, n, m):
    return [pp.SCHEDULES[name](n, m, r) for r in range(n)]


# -----------------------------------------------------------------------------
# The schedules, in one process
# -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("n,m", GRID)
def test_each_rank_runs_every_micro_batch_once_forward_before_backward(name, n, m):
    for actions in lists(name, n, m):
        order = [(a.op, a.mb) for a in actions]
        assert sorted(i for op, i in order if op == "forward") == list(range(m))
        assert sorted(i for op, i in order if op == "backward") == list(range(m))
        assert all(order.index(("forward", i)) < order.index(("backward", i)) for i in range(m))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("n,m", GRID)
def test_dry_run_orders_stages_meets_the_bound_and_the_bubble_formula(name, n, m):
    spans, peak = pp.dry_run(lists(name, n, m), m)
    when = {(r, label): (s, e) for r, row in enumerate(spans) for label, s, e in row}
    for i in range(m):
        for r in range(1, n):  # forward goes down the stages, backward comes back up
            assert when[(r, f"F{i}")][0] >= when[(r - 1, f"F{i}")][1]
            assert when[(r - 1, f"B{i}")][0] >= when[(r, f"B{i}")][1]
    assert peak == [pp.schedule_bound(name, n, m, r) for r in range(n)]
    assert peak == ([m] * n if name == "gpipe" else [min(m, n - r) for r in range(n)])
    slots = max(e for row in spans for _, _, e in row)
    assert 1 - 2 * m / slots == pytest.approx((n - 1) / (m + n - 1))


def broken(kind):
    """Deliberately broken versions of the 2-rank, 2-micro-batch 1F1B schedule."""
    good = lists("1f1b", 2, 2)
    r0, r1 = list(good[0]), list(good[1])
    if kind == "receive before send":  # each rank waits for the other: deadlock
        r0.insert(0, r0.pop(r0.index(pp.Action("recv_grad", 0))))
    elif kind == "send dropped":
        r0.remove(pp.Action("send_act", 1))
    elif kind == "backward before forward":
        i, j = r1.index(pp.Action("forward", 0)), r1.index(pp.Action("backward", 0))
        r1[i], r1[j] = r1[j], r1[i]
    elif kind == "send past the last stage":
        r1.append(pp.Action("send_act", 0))
    elif kind == "micro-batch missing":
        r0 = [a for a in r0 if a.mb != 1 or a.op not in ("forward", "send_act", "recv_grad", "backward")]
        r1 = [a for a in r1 if a.mb != 1]
    return [r0, r1]


@pytest.mark.parametrize("kind", ["receive before send", "send dropped", "backward before forward",
                                  "send past the last stage", "micro-batch missing"])
def test_dry_run_rejects_a_broken_schedule(kind):
    pp.dry_run(lists("1f1b", 2, 2), 2)  # the unbroken one passes
    with pytest.raises(pp.ScheduleError):
        pp.dry_run(broken(kind), 2)


@pytest.mark.parametrize("layers,n", [(l, n) for n in range(1, 7) for l in range(n, 13)])
def test_layer_split_is_contiguous_complete_and_balanced(layers, n):
    split = pp.layer_split(layers, n)
    assert split[0][0] == 0 and split[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(split, split[1:]))
    sizes = [hi - lo for lo, hi in split]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1 and sizes == sorted(sizes, reverse=True)


# -----------------------------------------------------------------------------
# The training step under MPI, on sub-communicators of every size
# -----------------------------------------------------------------------------
def train_pipeline(args, comm):
    """The pieces main() uses, without the report: losses (on every rank), model, stage, meter."""
    n, rank = comm.Get_size(), comm.Get_rank()
    device = torch.device("cpu")
    # A fair share of the cores for every rank of the job, not only of this sub-communicator:
    # two threads each on a busy 2-core machine make small kernels crawl.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world().Get_size()))
    timeline = pp.Timeline(device)
    exchange = pp.Exchange(comm, timeline, False)
    actions = pp.SCHEDULES[args.schedule](n, args.micro_batches, rank)
    model = pp.build_model(args, device)
    stage = pp.stage_of(model, rank, n)
    optimizer = torch.optim.SGD(stage.parameters(), lr=args.lr, momentum=0.9)
    shapes = pp.agree_shapes(stage, comm, args.batch_size // args.micro_batches, args.seq_len, device)
    meter = pp.ActivationMeter(stage)
    losses = [pp.train_step(stage, optimizer, actions, *pp.make_batch(args.seed, step, args.batch_size,
                                                                      args.seq_len),
                            args.micro_batches, shapes, exchange, meter, timeline)
              for step in range(args.steps)]
    return comm.bcast(losses, root=n - 1), model, stage, meter


@pytest.mark.mpi
@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("size", SIZES)
def test_pipeline_equals_single_process_training(size, name):
    with sub_comm(size) as comm:
        if comm is not None:
            check_against_reference(comm, size, name)


def check_against_reference(comm, size, name):
    for m in sorted({1, max(1, size - 1), 6}):  # M below and above N
        args = pp.parse_args(TINY + ["--micro-batches", str(m), "--schedule", name], size)
        losses, model, stage, meter = train_pipeline(args, comm)
        ref_losses, ref_model = pp.reference_training(args, torch.device("cpu"))
        ref = dict(zip(model.parameters(), ref_model.parameters()))
        diff = max([abs(a - b) for a, b in zip(losses, ref_losses)] +
                   [(p - ref[p]).abs().max().item() for p in stage.parameters()])
        assert max_everywhere(diff, comm) <= pp.TOLERANCE, (size, name, m)
        bound = pp.schedule_bound(name, size, m, comm.Get_rank())
        assert agree(meter.peak_count == bound and meter.peak_bytes <= bound * meter.per_mb, comm)
        assert comm.allreduce(sum(p.numel() for p in stage.parameters())) == \
            sum(p.numel() for p in model.parameters())


# -----------------------------------------------------------------------------
# End to end, as a user runs it
# -----------------------------------------------------------------------------
@pytest.mark.e2e
def test_launches_agree_across_world_sizes_schedules_and_micro_batches(tmp_path):
    runs = {}
    for np_, schedule, m in [(1, "gpipe", 4), (2, "1f1b", 8), (3, "gpipe", 2), (4, "1f1b", 2)]:
        extra = ["--trace", tmp_path / "trace.json"] if np_ == 4 else []
        out = launch("pipeline_parallel.py", np_, "--steps", 4, "--seed", 1, "--schedule", schedule,
                     "--micro-batches", m, "--json", *extra)
        runs[np_, schedule, m] = result = last_json(out)
        assert result["check_max_abs_diff"] <= pp.TOLERANCE and "-> PASS" in out.stdout
        assert "rank 0 | F0" in out.stdout and "measured timeline" in out.stdout
        assert result["peak_activations"] == result["peak_activations_bound"]
        assert result["bubble_fraction_theory"] == pytest.approx((np_ - 1) / (m + np_ - 1))
        assert result["comm_bytes_per_step"] == 2 * (np_ - 1) * 16 * 64 * 64 * 4
        assert result["messages_per_step"] == 2 * m * (np_ - 1)
    first = runs[1, "gpipe", 4]["losses"]
    for key, result in runs.items():
        assert max(abs(a - b) for a, b in zip(result["losses"], first)) <= pp.TOLERANCE, key
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1, 2, 3}
    assert {"F0", "B1", "optimizer", "send", "recv", "wait recv"} <= {e["name"] for e in trace}


@pytest.mark.e2e
@pytest.mark.parametrize("argv,world,says", [
    (["--layers", "3"], 4, "--layers 4 or more"),
    (["--batch-size", "12", "--micro-batches", "5"], 2, "--micro-batches 1, 2, 3, 4, 6, 12"),
    (["--schedule", "interleaved"], 2, "choose from '1f1b', 'gpipe'"),
    (["--hidden", "30", "--heads", "4"], 1, "multiple of 4"),
    (["--seq-len", "1000000"], 1, "use at most"),
    (["--micro-batches", "0"], 1, "positive integer"),
])
def test_bad_configuration_exits_2_with_one_line_that_names_what_works(argv, world, says):
    out = launch("pipeline_parallel.py", world, *argv, timeout=60)
    assert_refused(out, says)
