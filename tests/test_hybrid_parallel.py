"""hybrid_parallel.py: the grid, the schedule on paper for grids up to 4x4x4, training on every grid of
1, 2 and 4 ranks under MPI, and the script end to end at 2x2x2 on 8 ranks."""
import itertools
import json
import os
import shutil

import pytest
import torch

import hybrid_parallel as hp
from harness import agree, assert_refused, clean_env, last_json, launch, max_everywhere, sub_comm, world

CPU = torch.device("cpu")
# 5 blocks: 2 stages take 3 + 2, 4 stages 2 + 1 + 1 + 1 (uneven); 4 heads: tp 1, 2 and 4 divide them.
TINY = ["--layers", "5", "--hidden", "16", "--heads", "4", "--seq-len", "8", "--batch-size", "8",
        "--micro-batches", "2", "--steps", "3", "--lr", "0.2"]


def grids(n):
    """Every (dp, tp, pp) with dp x tp x pp = n."""
    return [(d, t, n // (d * t)) for d in range(1, n + 1) for t in range(1, n + 1) if n % (d * t) == 0]


def lists(dp, tp, pp, m):
    return [hp.one_f_one_b(pp, m, hp.coordinates(r, dp, tp)[1]) for r in range(dp * tp * pp)]


# -----------------------------------------------------------------------------
# The grid and the schedule, on paper
# -----------------------------------------------------------------------------
def test_grids_of_four_are_the_six_factorizations():
    assert sorted(grids(4)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]


@pytest.mark.parametrize("dp,tp,pp", grids(8) + grids(12))
def test_megatron_order_tp_consecutive_then_dp_then_pp(dp, tp, pp):
    seen = {}
    for r in range(dp * tp * pp):
        d, p, t = hp.coordinates(r, dp, tp)
        assert hp.rank_at(d, p, t, dp, tp) == r and (d, p, t) not in seen
        seen[(d, p, t)] = r
        if t > 0:
            assert seen[(d, p, t - 1)] == r - 1  # tensor-parallel ranks are neighbours
    assert len(seen) == dp * tp * pp


@pytest.mark.parametrize("dp,tp,pp", list(itertools.product(range(1, 5), repeat=3)))
def test_dry_run_proves_1f1b_on_every_grid_up_to_4x4x4(dp, tp, pp):
    for m in (1, 2, 3, 5, 8):
        spans, peak = hp.dry_run(lists(dp, tp, pp, m), dp, tp, m)
        slots = max(e for row in spans for _, _, e in row)
        assert 1 - 2 * m / slots == pytest.approx((pp - 1) / (m + pp - 1))
        for r in range(dp * tp * pp):
            d, p, t = hp.coordinates(r, dp, tp)
            assert peak[r] == min(m, pp - p)  # 1F1B's memory bound
            assert spans[r] == spans[hp.rank_at(0, p, 0, dp, tp)]  # a stage's ranks move together
            when = {label: s for label, s, _ in spans[r]}
            if p > 0:  # forward goes down the stages, backward comes back up
                up = dict((label, e) for label, _, e in spans[hp.rank_at(d, p - 1, t, dp, tp)])
                assert all(when[f"F{i}"] >= up[f"F{i}"] for i in range(m))


def broken(kind):
    """The 2 x 2 x 2 grid's lists with one deliberate fault."""
    good = lists(2, 2, 2, 2)
    if kind == "tensor-parallel ranks disagree":  # rank 1 runs its forwards in another order
        i, j = good[1].index(hp.Action("forward", 0)), good[1].index(hp.Action("forward", 1))
        good[1][i], good[1][j] = good[1][j], good[1][i]
    elif kind == "one replica skips the gradient allreduce":
        good[6] = good[6][:-1]
    elif kind == "send dropped":
        good[0].remove(hp.Action("send_act", 1))
    elif kind == "backward before forward":
        i, j = good[5].index(hp.Action("forward", 0)), good[5].index(hp.Action("backward", 0))
        good[5][i], good[5][j] = good[5][j], good[5][i]
    elif kind == "send past the last stage":
        good[4].append(hp.Action("send_act", 0))
    return good


@pytest.mark.parametrize("kind", ["tensor-parallel ranks disagree", "one replica skips the gradient allreduce",
                                  "send dropped", "backward before forward", "send past the last stage"])
def test_dry_run_rejects_a_broken_grid(kind):
    hp.dry_run(lists(2, 2, 2, 2), 2, 2, 2)  # the unbroken lists pass
    with pytest.raises(hp.ScheduleError):
        hp.dry_run(broken(kind), 2, 2, 2)


@pytest.mark.parametrize("argv,world_size,words", [
    (["--dp", "3", "--tp", "2"], 4, ["make 6 ranks, this job has 4", "--dp 2 --tp 2 --pp 1"]),
    (["--tp", "3"], 6, ["--tp 3 does not divide --heads 4", "--dp 3 --tp 2 --pp 1"]),
    (["--pp", "8", "--layers", "4"], 8, ["--pp 8 stages need at least 8 --layers", "--dp 2 --tp 2 --pp 2"]),
    (["--batch-size", "6", "--dp", "2", "--micro-batches", "2"], 2, ["--batch-size 6", "--micro-batches 1, 3,",
                                                                      "multiple of 4"]),
    (["--tp", "0"], 1, ["--tp must be a positive integer"]),
])
def test_bad_grids_are_rejected_with_what_would_work(argv, world_size, words):
    with pytest.raises(hp.ConfigError) as error:
        hp.parse_args(argv, world_size)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_the_default_micro_batches_are_the_most_up_to_4_that_each_replica_share_splits_into():
    """So that the plain command runs at any world size that divides the batch of 16."""
    assert [hp.parse_args([], n).micro_batches for n in (1, 2, 4, 8, 16)] == [4, 4, 4, 2, 1]
    assert hp.parse_args(["--batch-size", "18", "--dp", "2"], 2).micro_batches == 3


def test_dp_defaults_to_what_the_world_leaves():
    assert hp.parse_args(["--tp", "2", "--pp", "2"], 8).dp == 2


# -----------------------------------------------------------------------------
# Training under MPI, on sub-communicators
# -----------------------------------------------------------------------------
def train_on(comm, dp, tp, pp, extra=()):
    """The pieces main() uses, without the report: (losses, max |diff| from the check, measured
    and formula counts per axis, the communicators' members as world ranks)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world().Get_size()))
    args = hp.parse_args(TINY + ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), *extra], comm.Get_size())
    timeline = hp.Timeline(CPU)
    counted = {axis: hp.CountedComm(c, timeline)
               for axis, c in zip(("tensor", "pipeline", "data"), hp.make_grid(comm, dp, tp, pp))}
    stage = hp.build_stage(args, counted["tensor"], counted["pipeline"], CPU)
    optimizer = torch.optim.SGD(stage.parameters(), lr=args.lr, momentum=0.9)
    buckets = hp.GradBuckets(stage.parameters(), counted["data"], args.bucket_mb * 2**20)
    losses, _ = hp.train(args, comm, counted, CPU, stage, optimizer, buckets, timeline)
    measured = hp.per_axis(comm, counted, args.steps)
    formula = hp.formulas(args, comm.allgather(sum(p.numel() for p in stage.parameters())),
                          comm.allgather(len(buckets.buckets)))
    members = [c.comm.allgather(world().Get_rank()) for c in counted.values()]
    diff = hp.check(comm, args, CPU, losses, stage, counted)
    return losses, diff, measured, formula, members


def assert_trains_like_one_process(comm, dp, tp, pp, extra=()):
    losses, diff, measured, formula, members = train_on(comm, dp, tp, pp, extra)
    assert max_everywhere(diff, comm) <= hp.TOLERANCE, (dp, tp, pp)
    assert agree(losses[-1] < losses[0], comm)
    exact = all(measured[a][0] == formula[a][0] and measured[a][1] == formula[a][1]
                and measured[a][2] == formula[a][2] for a in measured)
    assert agree(exact, comm), (measured, formula)
    base = world().Get_rank() - comm.Get_rank()
    d, p, t = hp.coordinates(comm.Get_rank(), dp, tp)
    expect = [[base + hp.rank_at(d, p, u, dp, tp) for u in range(tp)],
              [base + hp.rank_at(d, q, t, dp, tp) for q in range(pp)],
              [base + hp.rank_at(e, p, t, dp, tp) for e in range(dp)]]
    assert agree(members == expect, comm)  # each axis's communicator holds the right ranks, in order


@pytest.mark.mpi
@pytest.mark.parametrize("dp,tp,pp", grids(4))
def test_every_grid_of_four_trains_like_one_process(dp, tp, pp):
    with sub_comm(4) as comm:
        if comm is not None:
            assert_trains_like_one_process(comm, dp, tp, pp)


@pytest.mark.mpi
@pytest.mark.parametrize("dp,tp,pp", grids(1) + grids(2))
def test_every_grid_of_one_and_two_trains_like_one_process(dp, tp, pp):
    with sub_comm(dp * tp * pp) as comm:
        if comm is not None:
            assert_trains_like_one_process(comm, dp, tp, pp)


@pytest.mark.mpi
def test_small_buckets_give_one_allreduce_per_bucket():
    with sub_comm(4) as comm:
        if comm is not None:  # 2 KB buckets: several per rank, each one allreduce
            assert_trains_like_one_process(comm, 2, 1, 2, ["--bucket-mb", str(2 / 1024)])


# -----------------------------------------------------------------------------
# End to end, as a user runs it
# -----------------------------------------------------------------------------
E2E = ["--layers", "3", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8",
       "--micro-batches", "2", "--log-every", "1"]


@pytest.mark.e2e
def test_2x2x2_on_eight_ranks_passes_its_check_and_counts_match_the_formulas(tmp_path):
    out = launch("hybrid_parallel.py", 8, *E2E, "--dp", 2, "--tp", 2, "--pp", 2, "--steps", 3, "--json",
                 "--trace", tmp_path / "trace.json", timeout=400)
    result = last_json(out)
    assert result["grid"] == {"dp": 2, "tp": 2, "pp": 2} and result["world_size"] == 8
    assert result["check_max_abs_diff"] <= hp.TOLERANCE and "-> PASS" in out.stdout
    formula = result["formula_by_axis"]
    for axis in ("tensor", "pipeline", "data"):
        assert result["comm_bytes_per_step_by_axis"][axis] == formula[axis]["bytes"] > 0
        assert result["collectives_per_step_by_axis"][axis] == formula[axis]["collectives"]
    assert result["collectives_per_step_by_axis"]["tensor"] == 2 * 2 * (4 * 3 + 5)  # D x M x (4L + 5)
    assert result["messages_per_step"] == 2 * 2 * 1 * 2 * 2  # 2M(P-1) x D x T
    assert result["bubble_fraction_theory"] == pytest.approx(1 / 3)
    assert "(dp, pp, tp) 0:(0, 0, 0) 1:(0, 0, 1) 2:(1, 0, 0) 3:(1, 0, 1) 4:(0, 1, 0)" in out.stdout
    assert (tmp_path / "trace.json").exists()


@pytest.mark.e2e
def test_resume_is_bit_exact_on_the_same_grid_and_refused_on_another(tmp_path):
    grid = ["--dp", 1, "--tp", 2, "--pp", 2]
    run = [*E2E, "--steps", 4, "--save-every", 2, "--save", tmp_path, "--no-check", "--json"]
    whole = last_json(launch("hybrid_parallel.py", 4, *run, *grid))
    final = {f.name: torch.load(f, weights_only=True) for f in sorted((tmp_path / "step-000004").glob("*.pt"))}
    assert len(final) == 4  # each rank its shard
    shutil.rmtree(tmp_path / "step-000004")
    resumed = launch("hybrid_parallel.py", 4, *run, *grid, "--resume")
    assert last_json(resumed)["losses"] == whole["losses"] and "resumed from" in resumed.stdout
    again = {f.name: torch.load(f, weights_only=True) for f in sorted((tmp_path / "step-000004").glob("*.pt"))}
    assert again.keys() == final.keys()
    for name in final:
        assert all(torch.equal(a, b) for a, b in zip(final[name]["model"].values(), again[name]["model"].values()))
        moment = [s["momentum_buffer"] for s in final[name]["optimizer"]["state"].values()]
        assert all(torch.equal(a, s["momentum_buffer"]) for a, s in
                   zip(moment, again[name]["optimizer"]["state"].values()))
    other = launch("hybrid_parallel.py", 4, *run, "--steps", 6, "--dp", 2, "--tp", 1, "--pp", 2, "--resume",
                   timeout=120)
    assert_refused(other, "'grid': {'dp': 1, 'tp': 2, 'pp': 2}")


@pytest.mark.e2e
def test_negative_control_a_nudged_weight_fails_the_check():
    """The flags of the in-process 1x1x2 run, which passes, with one weight of the last stage moved
    by 10 x the tolerance at step 1: the check must fail."""
    out = launch("hybrid_parallel.py", 2, *TINY, "--pp", 2, "--json", env=clean_env(FAIL_AT="1:1:nudge"))
    assert out.returncode == 1 and "-> FAIL" in out.stdout, out.stdout + out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["check_max_abs_diff"] > hp.TOLERANCE
