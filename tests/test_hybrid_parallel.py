"""hybrid_parallel.py: the grid, the schedule on paper for grids up to 4 x 4 x 4, training on every grid
of 1, 2 and 4 ranks under MPI with the overlaps it claims, checkpoints saved on one grid and resumed on
another, and the script end to end at 2 x 2 x 2 on 8 ranks with every buffer staged through host memory."""
import itertools
import json
import math
import os
import shutil
import time

import pytest
import torch

import hybrid_parallel as hp
from harness import (agree, assert_ragged_batch_is_the_plain_one_cut, clean_env, last_json, launch, max_everywhere,
                     sub_comm, world)

CPU = torch.device("cpu")
# 5 blocks: 2 stages take 3 + 2, 4 stages 2 + 1 + 1 + 1 (uneven); 4 heads: tp 1, 2 and 4 divide them.
# SGD at a constant rate, unclipped, named (the defaults are AdamW, the clip and a cosine): the tests written
# for it keep it. AdamW's step does not change when a gradient is scaled, so its plants would show only in the
# norm, and a cosine's rates depend on --steps, which a resume may change. The recipe's tests name theirs after.
SGD = ["--optimizer", "sgd", "--clip-grad", "0", "--lr-schedule", "constant"]
TINY = ["--layers", "5", "--hidden", "16", "--heads", "4", "--seq-len", "8", "--batch-size", "8",
        "--micro-batches", "2", "--steps", "3", "--lr", "0.2", *SGD]


def grids(n):
    """Every (pp, dp, cp, tp) with pp x dp x cp x tp = n."""
    return [(n // (d * c * t), d, c, t) for d in range(1, n + 1) for c in range(1, n + 1) for t in range(1, n + 1)
            if n % (d * c * t) == 0]


def lists(pp, dp, cp, tp, m):
    return [hp.one_f_one_b(pp, m, hp.coordinates(r, dp, cp, tp)[0]) for r in range(pp * dp * cp * tp)]


# -----------------------------------------------------------------------------
# The grid and the schedule, on paper
# -----------------------------------------------------------------------------
def test_grids_of_four_are_every_axis_alone_and_every_pair():
    assert sorted(grids(4)) == [(1, 1, 1, 4), (1, 1, 2, 2), (1, 1, 4, 1), (1, 2, 1, 2), (1, 2, 2, 1), (1, 4, 1, 1),
                                (2, 1, 1, 2), (2, 1, 2, 1), (2, 2, 1, 1), (4, 1, 1, 1)]


@pytest.mark.parametrize("pp,dp,cp,tp", grids(8) + grids(12))
def test_megatron_order_tp_consecutive_then_cp_then_dp_then_pp(pp, dp, cp, tp):
    seen = {}
    for r in range(pp * dp * cp * tp):
        p, d, c, t = hp.coordinates(r, dp, cp, tp)
        assert hp.rank_at(p, d, c, t, dp, cp, tp) == r and (p, d, c, t) not in seen
        seen[(p, d, c, t)] = r
        if t > 0:
            assert seen[(p, d, c, t - 1)] == r - 1  # tensor-parallel ranks are neighbours
        if c > 0:
            assert seen[(p, d, c - 1, t)] == r - tp  # then the context-parallel ones
    assert len(seen) == pp * dp * cp * tp


@pytest.mark.parametrize("pp,dp,cp,tp", [g for g in itertools.product(range(1, 5), repeat=4) if g[1] * g[2] * g[3] <= 16])
def test_dry_run_proves_1f1b_on_every_grid_up_to_4x4x4x4(pp, dp, cp, tp):
    for m in (1, 2, 3, 5):
        spans = hp.dry_run(lists(pp, dp, cp, tp, m), dp, cp, tp, m)
        slots = max(e for row in spans for _, _, e in row)
        assert 1 - 2 * m / slots == pytest.approx((pp - 1) / (m + pp - 1))
        for r in range(pp * dp * cp * tp):
            p, d, c, t = hp.coordinates(r, dp, cp, tp)
            assert peak_held(spans[r]) == min(m, pp - p)  # 1F1B's memory bound
            assert spans[r] == spans[hp.rank_at(p, 0, 0, 0, dp, cp, tp)]  # a stage's ranks move together
            when = {label: s for label, s, _ in spans[r]}
            if p > 0:  # forward goes down the stages, backward comes back up
                up = dict((label, e) for label, _, e in spans[hp.rank_at(p - 1, d, c, t, dp, cp, tp)])
                assert all(when[f"F{i}"] >= up[f"F{i}"] for i in range(m))


def test_the_largest_tag_is_checked_against_what_the_library_allows():
    """MPI promises tags up to 32767 only: M = 16384 micro-batches fit, one more is refused in one
    line that names the most that fit. The bound checked is the largest tag any list sends."""
    class Promised:  # a communicator whose library gives no more than the standard promises
        def Get_attr(self, key):
            return 32767 if key == hp.MPI.TAG_UB else None

    for m in (1, 2, 5):
        sent = [hp.tag(a.op, a.mb) for actions in lists(3, 1, 1, 1, m) for a in actions if a.op.startswith("send_")]
        assert max(sent) == hp.tag("send_grad", m - 1) == 2 * m - 1
    hp.check_tags(Promised(), 16384)
    with pytest.raises(hp.ConfigError, match=r"--micro-batches 16385 needs message tags up to 32769, .* "
                                             r"MPI_TAG_UB is 32767; use --micro-batches 16384 or fewer"):
        hp.check_tags(Promised(), 16385)


def peak_held(spans):
    """The most micro-batches a rank holds at once between their forward and backward, from its timeline."""
    held = peak = 0
    for label, _, _ in sorted(spans, key=lambda span: span[1]):
        held += 1 if label.startswith("F") else -1
        peak = max(peak, held)
    return peak


def broken(kind):
    """The 2 x 2 x 2 grid's lists with one deliberate fault."""
    good = lists(2, 2, 1, 2, 2)  # pp, dp, cp, tp, m
    if kind == "tensor-parallel ranks disagree":  # rank 1 runs its forwards in another order
        i, j = good[1].index(hp.Action("forward", 0)), good[1].index(hp.Action("forward", 1))
        good[1][i], good[1][j] = good[1][j], good[1][i]
    elif kind == "one replica skips the gradient allreduce":  # rank 6 = (1, 1, 0)
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
    hp.dry_run(lists(2, 2, 1, 2, 2), 2, 1, 2, 2)  # the unbroken lists pass
    with pytest.raises(hp.ScheduleError):
        hp.dry_run(broken(kind), 2, 1, 2, 2)


@pytest.mark.parametrize("argv,world_size,words", [
    (["--dp", "3", "--tp", "2"], 4, ["--pp 1 --dp 3 --cp 1 --tp 2 make 6 ranks, this job has 4",
                                     "--pp 1 --dp 2 --cp 1 --tp 2"]),
    (["--tp", "3"], 6, ["--tp 3 does not divide --heads 4", "--pp 1 --dp 3 --cp 1 --tp 2"]),
    (["--pp", "8", "--layers", "4"], 8, ["--pp 8 stages need at least 8 --layers",
                                              "--pp 4 --dp 1 --cp 1 --tp 2", "and 10 more"]),
    (["--cp", "3", "--seq-len", "9"], 3, ["--seq-len 9 does not split into the 6 chunks of --cp 3 --layout zigzag",
                                          "--pp 3 --dp 1 --cp 1 --tp 1"]),
    (["--cp", "4", "--seq-len", "6", "--layout", "contiguous"], 4, ["does not split into the 4 chunks of --cp 4"]),
    (["--sequence-parallel"], 1, ["--sequence-parallel cuts the sequence between tensor-parallel ranks: use it with --tp 2"]),
    (["--sequence-parallel", "--tp", "2", "--cp", "2", "--seq-len", "12"], 4,
     ["--seq-len 12 does not split into the 4 chunks of --cp 2 --layout zigzag x the 2 pieces of --sequence-parallel"]),
    (["--batch-size", "6", "--dp", "2", "--micro-batches", "2"], 2, ["--batch-size 6", "--micro-batches 1, 3,",
                                                                      "multiple of 4"]),
    (["--tp", "0"], 1, ["--tp must be a positive integer"]),
    (["--dp", "2", "--ep", "2"], 2, ["--ep 2 shares out experts, but --experts is 0 (the dense MLP); add --experts"]),
    (["--dp", "2", "--cp", "2", "--experts", "6", "--ep", "4"], 4,
     ["--ep 4 must divide both the D x C = 4 data- and context-parallel ranks of a stage and --experts 6; use --ep 1 or 2"]),
    (["--dp", "4", "--experts", "4", "--ep", "3"], 4, ["--ep 3 must divide both the D x C = 4", "use --ep 1 or 2 or 4"]),
    (["--experts", "2", "--top-k", "2"], 1, ["--top-k 2 of --experts 2 leaves the router no choice; use --experts 3 or more"]),
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
class Watched:
    """An Isend's request that counts the Tests the step calls on it (MPICH moves a message only
    inside MPI calls, so the step must Test its sends between actions)."""

    def __init__(self, request):
        self.request, self.tests = request, 0

    def Test(self):
        self.tests += 1
        return self.request.Test()

    def Wait(self):
        self.request.Wait()


def watch_sends(pipeline, wait_at_once=False):
    """Every Isend on `pipeline` returns a Watched request, listed in the list returned. wait_at_once:
    the overlap removed, as a planted regression: each send is waited for as soon as it starts."""
    isend, requests = pipeline.Isend, []

    def watched(*args, **kwargs):
        requests.append(Watched(isend(*args, **kwargs)))
        if wait_at_once:
            requests[-1].Wait()
        return requests[-1]
    pipeline.Isend = watched
    return requests


def start_buckets_after_backward(buckets):
    """The overlap removed, as a planted regression: no bucket starts its allreduce until the step's
    backwards are all done; then every bucket does, and finish() waits as before."""
    start, finish = buckets.start, buckets.finish

    def late_finish():
        start()
        for p in buckets.bucket_of:
            buckets._grad_ready(p)
        finish()
    buckets.start, buckets.finish = (lambda: None), late_finish


def train_on(comm, pp, dp, cp, tp, extra=(), remove_overlap=False, plant=None, check=True):
    """The pieces main() uses, without the report: (losses, max |diff| from the check (None without),
    measured and formula counts per axis, the communicators' members as world ranks, the overlap counts
    of the last step, the Tests each send got, every rank's count of buckets exchanged, the optimizer,
    the (token, choice) pairs dropped on all ranks and the smallest top-k gap of the router's probabilities,
    the stage)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world().Get_size()))
    args = hp.parse_args(TINY + ["--pp", str(pp), "--dp", str(dp), "--cp", str(cp), "--tp", str(tp), *extra],
                         comm.Get_size())
    lists = [hp.one_f_one_b(pp, args.micro_batches, hp.coordinates(r, dp, cp, tp)[0]) for r in range(comm.Get_size())]
    hp.dry_run(lists, dp, cp, tp, args.micro_batches, args.experts > 0)
    timeline = hp.Timeline(CPU)
    counted = {axis: hp.CountedComm(c, timeline) for axis, c in hp.make_grid(comm, pp, dp, cp, tp, args.ep).items()}
    stage = hp.build_stage(args, counted, CPU)
    buckets, optimizer = hp.build_optimizer(args, stage, counted)
    if plant:
        plant(buckets, optimizer)
    sends = watch_sends(counted["pipeline"], wait_at_once=remove_overlap)
    if remove_overlap:
        start_buckets_after_backward(buckets)
    losses, norms, _ = hp.train(args, comm, counted, CPU, stage, optimizer, buckets, lists[comm.Get_rank()], timeline)
    overlap = hp.overlap_counts(comm, timeline.step_events, args.micro_batches, buckets)
    measured = hp.per_axis(comm, counted, args.steps)
    dropped = comm.allreduce(sum(b.mlp.dropped for b in stage.blocks if args.experts))
    gap = comm.allreduce(min([b.mlp.gap for b in stage.blocks if args.experts], default=float("inf")), op=hp.MPI.MIN)
    formula = hp.formulas(args, comm, stage, buckets, hp.fractions.Fraction(dropped, args.steps))
    members = {axis: c.comm.allgather(world().Get_rank()) for axis, c in counted.items()}
    diff = hp.check(comm, args, CPU, losses, norms, stage, counted) if check else None
    return losses, diff, measured, formula, members, overlap, [r.tests for r in sends], \
        comm.allgather(sum(c.Get_size() > 1 for c in buckets.comms)), optimizer, (dropped, gap), stage, norms


def promised_overlap(pp, dp, cp, tp, m, buckets):
    """What the lesson promises: in the last backward, every bucket's allreduce but a stage's last
    is posted before backward computes a later gradient; 1F1B computes after every send but those
    that follow a stage's last backward: (2M - 1)(P - 1) of 2M(P - 1) sends per pipeline, D x C x T
    pipelines."""
    n, pipelines = dp * cp > 1, dp * cp * tp
    return {"buckets_posted_before_later_gradients": [sum(b - 1 for b in buckets) * n, sum(buckets) * n],
            "sends_in_flight_during_compute": [(2 * m - 1) * (pp - 1) * pipelines, 2 * m * (pp - 1) * pipelines]}


def assert_trains_like_one_process(comm, pp, dp, cp, tp, extra=()):
    losses, diff, measured, formula, members, overlap, tests, buckets, _, dropped, *_ = train_on(comm, pp, dp, cp, tp, extra)
    limit = hp.TOLERANCE_BF16 if "bf16" in extra else hp.TOLERANCE
    assert max_everywhere(diff, comm) <= limit, (pp, dp, cp, tp, diff)
    assert agree(losses[-1] < losses[0], comm)
    exact = all(measured[a] == formula[a] for a in measured)
    assert agree(exact and measured.keys() == formula.keys(), comm), (measured, formula)
    base = world().Get_rank() - comm.Get_rank()
    p, d, c, t = hp.coordinates(comm.Get_rank(), dp, cp, tp)
    ep, i = int(extra[extra.index("--ep") + 1]) if "--ep" in extra else 1, d * cp + c  # i: the rank's place in "data"
    folded = [base + hp.rank_at(p, j // cp, j % cp, t, dp, cp, tp) for j in range(dp * cp)]  # "data", in (dp, cp) order
    expect = {"pipeline": [base + hp.rank_at(q, d, c, t, dp, cp, tp) for q in range(pp)], "data": folded,
              "context": [base + hp.rank_at(p, d, b, t, dp, cp, tp) for b in range(cp)],
              "tensor": [base + hp.rank_at(p, d, c, u, dp, cp, tp) for u in range(tp)],
              "stage": [base + hp.rank_at(p, e, b, u, dp, cp, tp) for e in range(dp) for b in range(cp) for u in range(tp)],
              "expert": folded[i // ep * ep:(i // ep + 1) * ep], "expert-data": folded[i % ep::ep]}
    assert agree(members == expect, comm)  # each axis's communicator holds the right ranks, in order
    assert agree(overlap == promised_overlap(pp, dp, cp, tp, 2, buckets), comm), overlap
    assert agree(all(n > 0 for n in tests), comm), tests  # each send Tested during its step
    return losses, measured, dropped


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp", grids(4))
def test_every_axis_alone_and_every_pair_at_four_ranks_trains_like_one_process(pp, dp, cp, tp):
    with sub_comm(4) as comm:
        if comm is not None:
            assert_trains_like_one_process(comm, pp, dp, cp, tp)


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp", grids(1) + grids(2))
def test_every_grid_of_one_and_two_trains_like_one_process(pp, dp, cp, tp):
    with sub_comm(pp * dp * cp * tp) as comm:
        if comm is not None:
            assert_trains_like_one_process(comm, pp, dp, cp, tp)


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp", [(1, 1, 4, 1), (1, 1, 2, 2), (2, 1, 2, 1)])
def test_the_contiguous_layout_trains_like_one_process_and_moves_what_zigzag_moves(pp, dp, cp, tp):
    """The layout changes which positions a rank holds and which blocks it skips, not the bytes:
    every K/V block still goes round the whole ring."""
    with sub_comm(4) as comm:
        if comm is not None:
            losses, measured, _ = assert_trains_like_one_process(comm, pp, dp, cp, tp, ["--layout", "contiguous"])
            assert agree(measured["context"][2] > 0, comm)


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp,extra", [(1, 4, 1, 1, []), (1, 2, 2, 1, ["--layout", "contiguous"]),
                                               (2, 2, 1, 1, ["--bucket-mb", str(2 / 1024)]), (1, 2, 1, 2, [])])
def test_zero_1_trains_like_one_process_with_a_slice_of_the_momentum_on_each_rank(pp, dp, cp, tp, extra):
    """ZeRO-1 over the D x C ranks: the same check and byte formulas as without it (a reduce-scatter
    and an all-gather per bucket in place of an allreduce), and each rank's momentum is 1/(D x C) of
    its buckets, padded."""
    with sub_comm(4) as comm:
        if comm is not None:
            assert_trains_like_one_process(comm, pp, dp, cp, tp, ["--zero-stage", "1", *extra])
            _, _, _, _, _, _, _, _, optimizer, *_ = train_on(comm, pp, dp, cp, tp, ["--zero-stage", "1", "--steps", "1", *extra])
            kept = sum(s["momentum_buffer"].numel() for s in optimizer.state.values())
            assert agree(kept == sum(optimizer.buckets.padded) // (dp * cp), comm)


def skip_the_all_gather(buckets, optimizer):
    """A planted bug: the all-gather replaced by copies of this rank's own slice, so that the updates
    of the other slices never arrive."""
    for comm in buckets.comms:
        comm.Allgather = lambda send, recv: recv[:].copy_(torch.cat([send] * (len(recv) // len(send))))


@pytest.mark.mpi
def test_zero_1_without_its_all_gather_fails_the_check():
    with sub_comm(2) as comm:
        if comm is not None:
            diff = train_on(comm, 1, 2, 1, 1, ["--zero-stage", "1"], plant=skip_the_all_gather)[1]
            assert max_everywhere(diff, comm) > 10 * hp.TOLERANCE


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp,extra", [(1, 1, 1, 4, []), (1, 1, 2, 2, []), (1, 1, 2, 2, ["--layout", "contiguous"]),
                                               (2, 1, 1, 2, []), (1, 2, 1, 2, ["--zero-stage", "1"])])
def test_sequence_parallelism_trains_like_one_process_and_its_bytes_match(pp, dp, cp, tp, extra):
    """--sequence-parallel: all-gathers and reduce-scatters in place of f's and g's allreduces, the
    sums of the replicated parameters' gradients, and pipeline messages of S/(C x T) positions."""
    with sub_comm(4) as comm:
        if comm is not None:
            losses, measured, _ = assert_trains_like_one_process(comm, pp, dp, cp, tp, ["--sequence-parallel", *extra])
            plain = train_on(comm, pp, dp, cp, tp, extra)
            assert agree(max(abs(a - b) for a, b in zip(losses, plain[0])) <= hp.TOLERANCE, comm)
            if pp > 1:  # each tensor-parallel rank sends 1/T of the activation it sent without
                assert agree(measured["pipeline"][2] * tp == plain[2]["pipeline"][2], comm)


EXPERTS = ["--experts", "4", "--top-k", "2"]


@pytest.mark.mpi
@pytest.mark.parametrize("capacity", [None, "1.0"])
@pytest.mark.parametrize("pp,dp,cp,tp,extra", [(1, 4, 1, 1, ["--ep", "4"]), (1, 4, 1, 1, ["--ep", "2"]), (1, 2, 2, 1, ["--ep", "2"]),
                                               (1, 2, 1, 2, ["--ep", "2"]), (1, 2, 1, 2, ["--ep", "2", "--sequence-parallel"]),
                                               (2, 2, 1, 1, ["--ep", "2"])])
def test_the_expert_axis_alone_and_with_each_other_axis_trains_like_one_process(pp, dp, cp, tp, extra, capacity):
    """Expert groups of E folded over the D x C ranks of a stage: alone (--dp 4 --ep 4), with data parallelism
    (--ep 2 of --dp 4: each expert on 2 ranks), context, tensor (experts whole on each tensor-parallel rank, with
    and without sequence parallelism) and pipeline; dropless, and with a capacity that drops pairs. The check,
    the communicators and the bytes of every axis, the expert axis's among them, as the docstring says."""
    with sub_comm(4) as comm:
        if comm is not None:
            more = extra + EXPERTS + ["--capacity-factor", capacity] * (capacity is not None)
            losses, measured, (dropped, gap) = assert_trains_like_one_process(comm, pp, dp, cp, tp, more)
            assert agree(measured["expert"][2] > 0 and (dropped > 0) == (capacity is not None), comm), dropped
            assert 0 < gap < 1  # measured and reported (a near-tie may flip: the check follows the ranks' choices)


def divide_the_experts_by_their_holders(buckets, optimizer):
    """A planted bug: each expert's gradient sum divided by the D x C / E ranks that hold it, not by the
    D x C shares of the loss: the experts step E times too far, and nothing but the check can tell."""
    finish = buckets.finish

    def wrong():
        finish()
        for p in buckets.bucket_of:
            if getattr(p, "expert", False):
                p.grad *= buckets.shares // buckets.comms[buckets.bucket_of[p]].Get_size()
    buckets.finish = wrong


@pytest.mark.mpi
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_expert_gradient_divided_by_its_holders_fails_the_check(precision):
    """At least 10x the tolerance in fp32, 5x in bf16 (the experts trained in bf16 too)."""
    with sub_comm(4) as comm:
        if comm is not None:
            diff = train_on(comm, 1, 4, 1, 1, ["--ep", "2", *EXPERTS, "--precision", precision],
                            plant=divide_the_experts_by_their_holders)[1]
            assert max_everywhere(diff, comm) > (5 * hp.TOLERANCE_BF16 if precision == "bf16" else 10 * hp.TOLERANCE), diff


def write_down_the_next_expert(forward):
    """A planted fault in what the check follows: each choice the ranks wrote down moved on to the next expert."""
    def planted(self, x):
        y = forward(self, x)
        self.written[-1] = (self.written[-1] + 1) % self.router.out_features
        return y
    return planted


def route_to_the_least_likely(forward):
    """A planted fault in the ranks' router, which following their choices would hide: the K least likely experts
    taken (with their probabilities as gates), every other sort left as it was."""
    def planted(self, x):
        sort = torch.Tensor.sort
        torch.Tensor.sort = lambda t, dim=-1, descending=False, stable=False: sort(t, dim=dim, stable=stable)
        try:
            return forward(self, x)
        finally:
            torch.Tensor.sort = sort
    return planted


@pytest.mark.mpi
@pytest.mark.parametrize("plant", [write_down_the_next_expert, route_to_the_least_likely])
@pytest.mark.parametrize("pp,dp,cp,tp,extra", [(1, 4, 1, 1, ["--ep", "2"]), (2, 1, 1, 2, ["--sequence-parallel"])])
def test_the_check_follows_the_experts_the_ranks_chose_and_says_how_far_its_own_would_differ(pp, dp, cp, tp, extra, plant,
                                                                                             monkeypatch):
    """The ranks write their choices down once a forward (steps x M a block) and the one process follows them (a
    near-tie flips on rounding: the comment above check()). Planted, each fails the check: the written choices moved
    to the next expert (the one process routes otherwise); the ranks' router taking the least likely experts, which
    the one process follows to the same losses and parameters: only its own choice's disagreement shows it."""
    with sub_comm(4) as comm:
        if comm is not None:
            stage = train_on(comm, pp, dp, cp, tp, [*extra, *EXPERTS])[10]
            assert agree(all(len(b.mlp.written) == 3 * 2 for b in stage.blocks), comm)  # TINY: 3 steps, M = 2
            monkeypatch.setattr(hp.MoE, "forward", plant(hp.MoE.forward))
            diff = train_on(comm, pp, dp, cp, tp, [*extra, *EXPERTS])[1]
            assert max_everywhere(diff, comm) > 10 * hp.TOLERANCE, diff


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp,extra", [(1, 2, 1, 2, ["--ep", "2", "--sequence-parallel"]), (2, 2, 1, 1, ["--ep", "2"]),
                                               (1, 2, 2, 1, ["--ep", "2", "--capacity-factor", "1.0"])])
def test_experts_in_bf16_train_like_one_process_in_bf16_and_move_their_rows_in_bf16(pp, dp, cp, tp, extra):
    """--experts with --precision bf16: the router in float32 on the ranks and in the reference (bf16 logits would
    flip choices), the rows dispatched and combined in bf16: the check within TOLERANCE_BF16, every axis's bytes the
    formula's (e = 2 for the rows, the counts int64), fewer than in fp32."""
    with sub_comm(4) as comm:
        if comm is not None:
            _, measured, (dropped, gap) = assert_trains_like_one_process(comm, pp, dp, cp, tp, [*extra, *EXPERTS, "--precision", "bf16"])
            plain = train_on(comm, pp, dp, cp, tp, [*extra, *EXPERTS], check=False)[2]
            assert agree(0 < measured["expert"][2] < plain["expert"][2] and measured["expert"][0] == plain["expert"][0], comm)
            assert (dropped > 0) == ("--capacity-factor" in extra) and 0 < gap < 1, (dropped, gap)


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp,extra", [(1, 4, 1, 1, ["--ep", "4", "--capacity-factor", "1.0"]),
                                               (2, 1, 1, 2, ["--sequence-parallel"]),
                                               (1, 2, 2, 1, ["--ep", "2", "--precision", "bf16"])])
def test_experts_with_recomputation_train_like_one_process_and_exchange_again_in_backward(pp, dp, cp, tp, extra):
    """--experts with --recompute selective and full: the check; the losses of none, selective and full alike
    (bitwise in fp32); every axis's exchanges the formula's: selective's experts' as none's, full's with the Alltoall
    of the counts, the dispatch, the combine and the router's Allreduce again in backward; the pairs dropped
    counted once a forward (full's first pass, without grad, counts none)."""
    with sub_comm(4) as comm:
        if comm is not None:
            runs = {mode: assert_trains_like_one_process(comm, pp, dp, cp, tp, [*extra, *EXPERTS, "--recompute", mode])
                    for mode in ("none", "selective", "full")}
            (none, plain, dropped), (selective, again, _), (full, twice, _) = runs["none"], runs["selective"], runs["full"]
            assert agree(none == selective == full if "bf16" not in extra else
                         max(abs(a - b) for a, b in zip(none + none, selective + full)) <= hp.TOLERANCE_BF16, comm)
            assert agree(again["expert"] == plain["expert"] and twice["expert"][0] > plain["expert"][0], comm)
            assert len({r[2][0] for r in runs.values()}) == 1 and (dropped[0] > 0) == ("--capacity-factor" in extra), runs


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp,extra", [(2, 1, 1, 2, ["--sequence-parallel"]), (1, 2, 2, 1, [])])
def test_bf16_trains_like_one_process_in_bf16_and_moves_half_the_bytes_of_what_only_moves(pp, dp, cp, tp, extra):
    """--precision bf16 against one process in bf16 within TOLERANCE_BF16; every axis's bytes equal the
    formula in bf16: pipeline messages, ring K/V and sequence-parallel all-gathers in bf16, sums in float32."""
    with sub_comm(4) as comm:
        if comm is not None:
            losses, measured, _ = assert_trains_like_one_process(comm, pp, dp, cp, tp, ["--precision", "bf16", *extra])
            plain = train_on(comm, pp, dp, cp, tp, extra, check=False)[2]
            moves = "pipeline" if pp > 1 else "context"  # pipeline: all bf16; context: K/V bf16, dK/dV float32
            assert agree(0 < measured[moves][2] < plain[moves][2] and measured["data"][2] == plain["data"][2], comm)


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp,extra", [(1, 1, 2, 2, ["--sequence-parallel"]), (2, 1, 2, 1, ["--precision", "bf16"])])
def test_recomputation_keeps_what_the_formula_says_with_the_same_losses(pp, dp, cp, tp, extra):
    """--recompute none, selective, full: the bytes one micro-batch's forward saved for backward (saved-tensor hooks,
    autocast's parameter copies left out) equal the docstring's formula on every rank, full < selective < none; the
    losses equal those without recomputation (bitwise in fp32); every axis's exchanges equal the formula, full's with
    the blocks' g (all-gathers, reduce-scatters) and ring hops again in backward, selective's with the ring's hops."""
    with sub_comm(4) as comm:
        if comm is not None:
            runs = {}
            for mode in ("none", "selective", "full"):
                losses, _, measured, formula, *_, stage, _ = train_on(comm, pp, dp, cp, tp, [*extra, "--recompute", mode,
                                                                                          "--steps", "2"], check=False)
                args = hp.parse_args(TINY + ["--pp", str(pp), "--cp", str(cp), "--tp", str(tp), *extra, "--recompute", mode], 4)
                runs[mode] = (losses, stage.meter.bytes, measured)
                assert agree(stage.meter.bytes == hp.activation_bytes(args, hp.coordinates(comm.Get_rank(), dp, cp, tp)[0]), comm)
                assert agree(measured == formula, comm), (mode, measured, formula)
            (none, n, plain), (selective, s, again), (full, f, twice) = runs["none"], runs["selective"], runs["full"]
            assert agree(f < s < n, comm), (f, s, n)
            assert agree(none == selective == full if "bf16" not in extra else
                         max(abs(a - b) for a, b in zip(none + none, selective + full)) <= hp.TOLERANCE_BF16, comm)
            assert agree(again["context"][1] > plain["context"][1] and twice["context"][1] == again["context"][1], comm)
            if tp > 1:  # only full runs the blocks' tensor-parallel exchanges again
                assert agree(again["tensor"] == plain["tensor"] and twice["tensor"][0] > plain["tensor"][0], comm)


@pytest.mark.mpi
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradients_divided_once_more_by_n_fail_the_check(precision, monkeypatch):
    """Negative control for the data axis: the averaged gradients planted to be divided by N = D x C once more.
    At N = 2 the check must report at least 5x the precision's tolerance (bf16: 0.16 measured)."""
    real = hp.GradBuckets.finish

    def finish_and_divide(buckets):
        real(buckets)
        for p in buckets.bucket_of:
            p.grad /= buckets.shares
    monkeypatch.setattr(hp.GradBuckets, "finish", finish_and_divide)
    with sub_comm(2) as comm:
        if comm is not None:
            diff = train_on(comm, 1, 2, 1, 1, ["--precision", precision])[1]
            assert max_everywhere(diff, comm) > 5 * (hp.TOLERANCE_BF16 if precision == "bf16" else hp.TOLERANCE), diff


@pytest.mark.mpi
def test_small_buckets_give_one_allreduce_per_bucket():
    with sub_comm(4) as comm:
        if comm is not None:  # 2 KB buckets: several per rank, each one allreduce, all but the last posted before a later gradient
            assert_trains_like_one_process(comm, 2, 2, 1, 1, ["--bucket-mb", str(2 / 1024)])


@pytest.mark.mpi
def test_the_overlap_counts_fall_when_the_overlap_is_removed():
    """The planted regression of watch_sends and start_buckets_after_backward: the same losses, but
    no bucket is posted before a later gradient and no send stays in flight while the rank computes."""
    with sub_comm(4) as comm:
        if comm is not None:
            _, diff, _, _, _, overlap, _, buckets, *_ = train_on(comm, 2, 2, 1, 1, ["--bucket-mb", str(2 / 1024)],
                                                        remove_overlap=True)
            assert max_everywhere(diff, comm) <= hp.TOLERANCE
            promised = promised_overlap(2, 2, 1, 1, 2, buckets)
            assert promised["buckets_posted_before_later_gradients"][0] >= 4 and promised["sends_in_flight_during_compute"][0] == 6
            assert agree(overlap == {"buckets_posted_before_later_gradients": [0, sum(buckets)],
                                     "sends_in_flight_during_compute": [0, 8]}, comm), overlap


@pytest.mark.mpi
@pytest.mark.parametrize("remove_overlap", [False, True])
def test_a_full_bucket_is_posted_before_the_last_backward_computes_the_next_buckets_gradients(remove_overlap):
    """The buckets' overlap as an order, on the timeline's clock, at D = 2 with 2 KB buckets: in the
    step's last backward, each bucket's allreduce is posted before the first gradient of the next
    bucket is in, so backward still has work to hide it behind; with start_buckets_after_backward
    planted, none is. The run's count, from GradBuckets' marks, says the same: n - 1 of n, or 0."""
    with sub_comm(2) as comm:
        ok = True
        if comm is not None:
            args = hp.parse_args(TINY + ["--dp", "2", "--steps", "1", "--bucket-mb", str(2 / 1024)], 2)
            timeline = hp.Timeline(CPU)
            counted = {axis: hp.CountedComm(c, timeline) for axis, c in hp.make_grid(comm, 1, 2, 1, 1).items()}
            stage = hp.build_stage(args, counted, CPU)
            buckets, _ = hp.build_optimizer(args, stage, counted)
            arrivals, posted, iallreduce = {}, [], counted["data"].Iallreduce
            clock = lambda: time.perf_counter() - timeline.origin_s  # noqa: E731 (the timeline's)

            def arrived(p):  # each gradient of each bucket, every micro-batch's
                arrivals.setdefault(buckets.bucket_of[p], []).append(clock())

            def timed(*args, **kwargs):
                request = iallreduce(*args, **kwargs)
                posted.append(clock())
                return request
            for p in buckets.bucket_of:
                p.register_post_accumulate_grad_hook(arrived)
            counted["data"].Iallreduce = timed
            if remove_overlap:
                start_buckets_after_backward(buckets)
            hp.train(args, comm, counted, CPU, stage, torch.optim.SGD(stage.parameters(), lr=args.lr), buckets,
                     hp.one_f_one_b(1, args.micro_batches, 0), timeline)
            last = max(b for name, _, b, _ in timeline.step_events if name == f"B{args.micro_batches - 1}")
            first = [min(t for t in arrivals[k] if t > last) for k in range(len(buckets.buckets))]
            n = len(buckets.buckets)  # of the last backward: the first gradient of each bucket
            in_order = [posted[k] < first[k + 1] for k in range(n - 1)]
            count = hp.overlap_counts(comm, timeline.step_events, args.micro_batches, buckets)
            ok = n >= 4 and [i for i, *_ in buckets.pending] == list(range(n)) and in_order == [not remove_overlap] * (n - 1) \
                and count["buckets_posted_before_later_gradients"] == [0 if remove_overlap else 2 * (n - 1), 2 * n]
        assert agree(ok)


# -----------------------------------------------------------------------------
# The recipe: AdamW, the clip to the global gradient norm, the warm-up and the cosine
# -----------------------------------------------------------------------------
# lr 1e-3 and a clip of 1, below every step's norm of TINY's 3 steps (1.6 to 2.3 at --tp 2, measured): it acts.
RECIPE = ["--optimizer", "adamw", "--lr", "1e-3", "--clip-grad", "1", "--lr-schedule", "cosine", "--warmup-steps", "1"]


def test_a_warm_up_as_long_as_the_run_is_refused_in_one_line():
    with pytest.raises(hp.ConfigError, match=r"--warmup-steps 3 leaves no step of --steps 3; use fewer"):
        hp.parse_args(TINY + ["--warmup-steps", "3"], 1)
    assert [hp.learning_rate(hp.parse_args(TINY + RECIPE, 1), s) for s in range(3)] == \
        pytest.approx([1e-3, 1e-3, 0.55e-3])  # warm-up (s + 1)/W; then the cosine's lr, then halfway to lr / 10


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp,extra", [(2, 1, 1, 2, ["--sequence-parallel"]), (1, 2, 1, 2, ["--zero-stage", "1"]),
                                               (1, 4, 1, 1, ["--ep", "2", *EXPERTS])])
def test_the_recipe_trains_like_one_process_with_the_norm_of_each_parameter_once(pp, dp, cp, tp, extra):
    """AdamW, a clip that acts at every step, warm-up and cosine: the losses, the norms (as losses) and the
    parameters against one process's torch AdamW and clip_grad_norm_, on a grid of stages and tensor-parallel
    slices, one of ZeRO-1's shards (each rank's AdamW holds both moments of its slice of each bucket alone) and
    one of experts held twice over 4 replicas."""
    with sub_comm(4) as comm:
        if comm is not None:
            _, diff, *_, optimizer, _, _, norms = train_on(comm, pp, dp, cp, tp, RECIPE + extra)
            assert max_everywhere(diff, comm) <= hp.TOLERANCE, diff
            assert agree(min(norms) > 1, comm), norms  # the clip acted at every step
            if "--zero-stage" in extra:
                state = optimizer.state.values()
                moments = [sum(s[field].numel() for s in state) for field in ("exp_avg", "exp_avg_sq")]
                assert agree(moments == [sum(optimizer.buckets.padded) // (dp * cp)] * 2, comm), moments


def counted_on_every_tensor_rank(p, axes, sharded=False):
    """Planted: a parameter whole on the T ranks adds its squares on each of them."""
    return sharded or axes["expert-data" if hasattr(p, "expert") else "data"].Get_rank() == 0


def experts_on_every_replica(p, axes, sharded=False, real=hp.adds_squares):
    """Planted: an expert adds its squares on each of the D x C / E ranks that hold it."""
    return real(p, axes, sharded or hasattr(p, "expert"))


def one_stage_alone(stage, buckets, axes, comm, real=hp.global_grad_norm):
    """Planted: the squares summed over the ranks of this stage alone, the other stages' missing."""
    return real(stage, buckets, axes, axes["stage"].comm)


def a_step_ahead(args, step, real=hp.learning_rate):
    """Planted: the schedule one step off."""
    return real(args, step + 1)


@pytest.mark.mpi
@pytest.mark.parametrize("name,plant,grid", [("adds_squares", counted_on_every_tensor_rank, (1, 1, 1, 2, [])),
                                             ("adds_squares", experts_on_every_replica, (1, 2, 1, 1, ["--ep", "1", *EXPERTS])),
                                             ("global_grad_norm", one_stage_alone, (2, 1, 1, 1, [])),
                                             ("learning_rate", a_step_ahead, (1, 2, 1, 1, []))])
def test_negative_control_a_norm_that_counts_a_parameter_wrongly_or_a_schedule_off_by_one_fails_the_check(
        name, plant, grid, monkeypatch):
    """Each planted bug on 2 ranks, the recipe's flags: a replicated parameter counted on both tensor-parallel
    ranks, an expert counted on both replicas that hold it (--ep 1 --dp 2), the other stage's squares missing,
    the learning rate of the next step. The check (the norms compared as losses) must fail."""
    monkeypatch.setattr(hp, name, plant)
    with sub_comm(2) as comm:
        if comm is not None:
            diff = train_on(comm, *grid[:4], RECIPE + grid[4])[1]
            assert max_everywhere(diff, comm) > 10 * hp.TOLERANCE, diff


# -----------------------------------------------------------------------------
# --ragged: documents of uneven length, the loss over the valid targets of the whole step
# -----------------------------------------------------------------------------
def test_ragged_batches_cut_documents_and_leave_the_plain_batch_as_it_was():
    assert_ragged_batch_is_the_plain_one_cut(hp, seq_len=16)


def local_counts(args, comm, pp, dp, cp, tp):
    """This rank's own count of valid targets, step by step (its replica's sequences, its context positions)."""
    _, d, c, _ = hp.coordinates(comm.Get_rank(), dp, cp, tp)
    positions = hp.shard_positions(args.seq_len, cp, args.layout)[c]
    return [int((hp.make_batch(args.seed, step, args.batch_size, args.seq_len, True)[1].chunk(dp)[d][:, positions]
                 != hp.IGNORE).sum()) for step in range(args.steps)]


RAGGED_GRIDS = [(1, 2, 1, 1, []), (1, 1, 1, 2, ["--sequence-parallel"]), (2, 1, 1, 1, []), (1, 1, 2, 1, []),
                (1, 2, 1, 1, ["--ep", "2", *EXPERTS]), (2, 2, 1, 1, ["--zero-stage", "1"]),
                (1, 2, 2, 1, ["--zero-stage", "1", "--precision", "bf16"])]


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp,extra", RAGGED_GRIDS)
def test_the_recipe_on_ragged_documents_trains_like_one_process_over_the_valid_targets(pp, dp, cp, tp, extra):
    """--ragged with the whole recipe (AdamW, a clip of 1 that acts at every step, warm-up, cosine) on data,
    tensor with sequence parallelism, pipeline (M = 2), context, data with experts (--ep 2), and 4-rank grids of
    data x pipeline and data x context with ZeRO-1, the last in bf16: losses, norms and parameters against one
    process taking F.cross_entropy's mean over the valid targets of the whole batch. Where D x C > 1 the ranks'
    own counts differ (else the test proves nothing), and every axis moves what the formula says: the data
    axis's with the count's T Allreduces of 8 bytes each of the last stage's D x C ranks."""
    with sub_comm(pp * dp * cp * tp) as comm:
        if comm is not None:
            _, diff, measured, formula, *_, norms = train_on(comm, pp, dp, cp, tp, RECIPE + ["--ragged", *extra])
            limit = hp.TOLERANCE_BF16 if "bf16" in extra else hp.TOLERANCE
            assert max_everywhere(diff, comm) <= limit, (pp, dp, cp, tp, diff)
            assert agree(min(norms) > 1, comm), norms  # the clip acted at every step
            assert agree(measured == formula, comm), (measured, formula)
            args = hp.parse_args(TINY + RECIPE + ["--ragged"], 1)
            counts = comm.allgather(local_counts(args, comm, pp, dp, cp, tp))
            assert dp * cp == 1 or len({tuple(c) for c in counts}) > 1, counts


@pytest.mark.mpi
@pytest.mark.parametrize("pp,dp,cp,tp", [(1, 2, 1, 1), (1, 1, 2, 1)])
def test_ragged_losses_over_each_ranks_own_count_fail_the_check(pp, dp, cp, tp, monkeypatch):
    """A planted bug: each rank divides by its own count of valid targets times the D x C ranks (a per-rank
    mean, averaged: right only where the counts are equal, as without --ragged). At --dp 2 and --cp 2, where
    the counts differ, the check with the recipe must fail."""
    monkeypatch.setattr(hp, "valid_targets", lambda y, comm: (y != hp.IGNORE).sum().item() * comm.Get_size())
    with sub_comm(2) as comm:
        if comm is not None:
            diff = train_on(comm, pp, dp, cp, tp, RECIPE + ["--ragged"])[1]
            assert max_everywhere(diff, comm) > hp.TOLERANCE, diff


@pytest.mark.mpi
def test_a_ragged_run_says_so_in_its_header_and_its_json(capsys):
    with sub_comm(2) as comm:
        if comm is not None:
            status = hp.main(TINY + ["--dp", "2", "--ragged", "--steps", "1", "--no-check", "--json"], comm)
            out = capsys.readouterr().out
            ok = status == 0 and (comm.Get_rank() > 0 or "--ragged: documents of 1 to 8 characters" in out
                                  and json.loads(out.strip().splitlines()[-1])["ragged"] is True)
            assert agree(ok, comm), out


# -----------------------------------------------------------------------------
# Checkpoints: saved on one grid, resumed on another, in process
# -----------------------------------------------------------------------------
# One model (experts in every block) on grids that cut it every way: tensor-parallel slices with sequence
# parallelism and ZeRO-1's slices of the dense and the expert buckets; tensor-parallel rank 2 of 3 with a
# vocabulary padding row; experts on 2 of 4 data-parallel ranks each, ZeRO-1 over those 2 and small buckets;
# pipeline stages with a context-parallel ring. Head size 2 lets 2 and 3 tensor-parallel ranks split 6 heads.
# One micro-batch: the load-balancing loss is Switch's over each micro-batch of all replicas, so with M > 1 the
# grid's D and M decide which sequences share one (the check's reference_moe does the same), and steps trained
# before a resume on another grid would have had another objective than the new grid's uninterrupted run.
RESHARD = ["--layers", "2", "--hidden", "12", "--heads", "6", "--seq-len", "16", "--batch-size", "8",
           "--micro-batches", "1", "--experts", "4", "--top-k", "2", "--lr", "0.2", "--log-every", "4", *SGD]
GRIDS = {"dp-tp-sp-zero": ["--dp", "2", "--tp", "2", "--sequence-parallel", "--zero-stage", "1"],
         "tp3": ["--tp", "3"],
         "dp-ep-zero": ["--dp", "4", "--ep", "2", "--zero-stage", "1", "--bucket-mb", str(2 / 1024)],
         "pp-cp": ["--pp", "2", "--cp", "2"], "dp2": ["--dp", "2"], "one": []}


def ranks(grid):
    """The world size of a grid's flags."""
    flags = GRIDS[grid]
    return math.prod(int(flags[flags.index(f"--{axis}") + 1]) for axis in ("pp", "dp", "cp", "tp")
                     if f"--{axis}" in flags)


def run_main(capsys, grid, *argv):
    """hybrid_parallel.main on the first ranks(grid) ranks with --json: (status, rank 0's JSON or None,
    rank 0's stdout and stderr), the same on every rank of the world."""
    with sub_comm(ranks(grid)) as comm:
        result = None
        if comm is not None:
            status = hp.main([*RESHARD, *GRIDS[grid], *map(str, argv), "--json"], comm)
            out, err = capsys.readouterr()
            alike = agree(status == comm.bcast(status, root=0), comm)
            line = json.loads(out.strip().splitlines()[-1]) if status == 0 and comm.Get_rank() == 0 else None
            result = (status if alike else "the ranks' exit statuses differ", line, out, err)
    return world().bcast(result, root=0)  # after sub_comm: the ranks left out waited without spinning


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each grid's uninterrupted 4 steps, checkpoints after steps 2 and 4 (the first a resume's start, the last
    what a resume on the same grid must write again), run once per module: grid -> (folder, result)."""
    runs = {}

    def run(grid, capsys):
        if grid not in runs:
            folder = world().bcast(str(tmp_path_factory.mktemp(grid)), root=0)
            status, result, *_ = run_main(capsys, grid, "--steps", 4, "--save-every", 2, "--save", folder, "--no-check")
            assert status == 0
            runs[grid] = folder, result
        return runs[grid]
    return run


def checkpoint_tensors(folder):
    """Every tensor of a checkpoint by file and key, and its manifest's index of pieces."""
    with open(os.path.join(folder, "manifest.json")) as stream:
        index = {name: entry["pieces"] for name, entry in json.load(stream)["files"].items()}
    return {name: torch.load(os.path.join(folder, name), weights_only=True) for name in index}, index


@pytest.mark.mpi
@pytest.mark.parametrize("saved,resumed", [("dp-tp-sp-zero", "tp3"), ("tp3", "dp-ep-zero"), ("dp-ep-zero", "pp-cp"),
                                           ("pp-cp", "dp-tp-sp-zero"), ("dp-ep-zero", "dp-ep-zero")])
def test_a_checkpoint_resumes_on_another_grid_as_the_uninterrupted_run_on_that_grid(saved, resumed, uninterrupted,
                                                                                      tmp_path_factory, capsys):
    """The step-2 checkpoint of the run on `saved`, resumed for 2 more steps on `resumed`: the losses so far are
    the saved run's, the next ones the uninterrupted run's on `resumed` within TOLERANCE, and the check against 4
    steps of one process (the parameters after the momentum of 3 steps, the losses) passes. On the same grid:
    every loss and every tensor of the step-4 checkpoint bit for bit the uninterrupted run's."""
    source, before = uninterrupted(saved, capsys)
    target, whole = uninterrupted(resumed, capsys)
    folder = world().bcast(str(tmp_path_factory.mktemp("resumed")), root=0)
    if world().Get_rank() == 0:  # the step-2 checkpoint alone: the resume starts there
        shutil.copytree(os.path.join(source, "step-000002"), os.path.join(folder, "step-000002"))
    status, result, out, _ = run_main(capsys, resumed, "--steps", 4, "--save", folder, "--resume", "--check")
    assert status == 0 and "resumed from" in out and "at step 2 (written by" in out, out
    losses = result["losses"]
    assert losses[:2] == before["losses"][:2] and len(losses) == 4
    difference = max(abs(a - b) for a, b in zip(losses[2:], whole["losses"][2:]))
    assert difference <= hp.TOLERANCE and result["check_max_abs_diff"] <= hp.TOLERANCE, (difference, result)
    if saved == resumed:
        assert losses == whole["losses"]
        same = True
        if world().Get_rank() == 0:
            (again, index), (first, first_index) = (checkpoint_tensors(os.path.join(f, "step-000004"))
                                                    for f in (folder, target))
            same = index == first_index and all(torch.equal(again[n][k], first[n][k]) for n in first for k in first[n])
        assert agree(same)


@pytest.mark.mpi
def test_after_a_resume_the_check_replays_each_step_as_the_grid_that_trained_it(tmp_path_factory, capsys):
    """Experts with 2 micro-batches and a capacity: D and M decide which sequences share a load-balancing loss and
    a capacity, so the 2 steps saved on 2 replicas trained another objective than one rank's would have (a check that
    replays them as one rank's differs by 9e-3, measured). It replays each step as the checkpoint's grids say: PASS."""
    folder = world().bcast(str(tmp_path_factory.mktemp("grids")), root=0)
    more = ["--micro-batches", "2", "--capacity-factor", "1.0", "--save", folder]
    assert run_main(capsys, "dp2", "--steps", 2, "--no-check", *more)[0] == 0
    status, result, out, _ = run_main(capsys, "one", "--steps", 4, "--resume", "--check", *more)
    assert status == 0 and "--dp 2" in out.splitlines()[0] and result["check_max_abs_diff"] <= hp.TOLERANCE, out
    assert result["pairs_dropped_per_step"] > 0


@pytest.mark.mpi
def test_the_recipe_resumes_on_another_grid_with_its_moments_and_its_schedule(tmp_path_factory, capsys, monkeypatch):
    """AdamW (its moments ZeRO-1's slices on 2 of 4 replicas), a clip that acts (0.5, below the one-process
    norms 1.0 to 2.3 of these 4 steps, measured), warm-up and cosine: 2 steps saved on dp-ep-zero, resumed on
    dp-tp-sp-zero (other slices of the moments, AdamW's step count from the checkpoint). The check against 4
    uninterrupted steps of one process, norms compared as losses, passes; the saved steps' norms are kept.
    Negative control: the same resume with the schedule one step off (a_step_ahead) fails the check."""
    source = world().bcast(str(tmp_path_factory.mktemp("recipe")), root=0)
    recipe = [*RECIPE, "--clip-grad", "0.5", "--steps", 4]
    status, before, *_ = run_main(capsys, "dp-ep-zero", *recipe, "--save-every", 2, "--save", source, "--no-check")
    assert status == 0
    for planted in (True, False):
        folder = world().bcast(str(tmp_path_factory.mktemp("recipe-resumed")), root=0)
        if world().Get_rank() == 0:
            shutil.copytree(os.path.join(source, "step-000002"), os.path.join(folder, "step-000002"))
        with monkeypatch.context() as patch:
            if planted:
                patch.setattr(hp, "learning_rate", a_step_ahead)
            status, result, out, _ = run_main(capsys, "dp-tp-sp-zero", *recipe, "--save", folder, "--resume", "--check")
        assert "at step 2 (written by 4 ranks)" in out and status == (1 if planted else 0), out
        if not planted:
            assert result["grad_norms"][:2] == before["grad_norms"][:2] and min(result["grad_norms"]) > 0.5
            assert result["check_max_abs_diff"] <= hp.TOLERANCE, result["check_max_abs_diff"]


@pytest.mark.mpi
def test_a_checkpoint_of_another_model_is_refused_in_one_line_naming_both(uninterrupted, capsys):
    """The checkpoint of the tp3 grid's model (hidden 12, experts 4), resumed with --hidden 24: exit status 2 on
    every rank, one error line that names both models, nothing written."""
    folder, _ = uninterrupted("tp3", capsys)
    before = sorted(os.listdir(folder))
    status, _, out, err = run_main(capsys, "tp3", "--steps", 6, "--save", folder, "--resume", "--hidden", 24)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "holds a model" in lines[0] and "'hidden': 12" in lines[0] and "'hidden': 24" in lines[0], lines[0]
    assert agree(sorted(os.listdir(folder)) == before)


# -----------------------------------------------------------------------------
# End to end, as a user runs it
# -----------------------------------------------------------------------------
E2E = ["--layers", "3", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8",
       "--micro-batches", "2", "--log-every", "1"]


@pytest.mark.e2e
@pytest.mark.parametrize("grid", [{"pp": 1, "dp": 2, "cp": 2, "tp": 2}, {"pp": 2, "dp": 1, "cp": 2, "tp": 2,
                                                                         "sequence-parallel": True},
                                  {"pp": 2, "dp": 2, "cp": 2, "tp": 1, "zero-stage": 1},
                                  {"pp": 2, "dp": 4, "cp": 1, "tp": 1, "ep": 2, "experts": 4, "zero-stage": 1}])
def test_triples_on_eight_ranks_staged_through_host_copies_pass_their_check_and_counts_match(tmp_path, grid):
    """Three axes at once on 8 ranks: data x context x tensor, pipeline x context x tensor with sequence
    parallelism, pipeline x data x context and pipeline x data x expert with ZeRO-1. STAGE_ALL=1 (tests/inject.py): every buffer
    handed to MPI is a host copy, as on a GPU whose MPI cannot read its memory, so that the check
    proves every copy back."""
    flags = [x for axis, size in grid.items() for x in ((f"--{axis}",) if size is True else (f"--{axis}", size))]
    out = launch("hybrid_parallel.py", 8, *E2E, *flags, "--steps", 3, "--json", "--trace", tmp_path / "trace.json",
                 timeout=400, env=clean_env(STAGE_ALL=1))
    result = last_json(out)
    pp, dp, cp, tp, ep = (grid.get(a, 1) for a in ("pp", "dp", "cp", "tp", "ep"))
    assert result["grid"] == {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep} and result["world_size"] == 8
    assert result["zero_stage"] == grid.get("zero-stage", 0)
    assert result["check_max_abs_diff"] <= hp.TOLERANCE and "-> PASS" in out.stdout
    formula = result["formula_by_axis"]
    assert set(result["comm_bytes_per_step_by_axis"]) == set(formula) == {"pipeline", "data", "context", "tensor", "expert"}
    for axis, size in (("pipeline", pp), ("data", dp * cp), ("context", cp), ("tensor", tp), ("expert", ep)):
        assert result["comm_bytes_per_step_by_axis"][axis] == formula[axis]["bytes"]
        assert (formula[axis]["bytes"] > 0) == (size > 1), axis
        assert result["collectives_per_step_by_axis"][axis] == formula[axis]["collectives"]
    assert result["sequence_parallel"] == grid.get("sequence-parallel", False)
    per_micro_batch = (14 * 3 + 10) if result["sequence_parallel"] else (4 * 3 + 5) * (tp > 1)  # 14L + 10, or 4L + 5
    assert result["collectives_per_step_by_axis"]["tensor"] == dp * cp * 2 * per_micro_batch  # x D x C x M
    assert result["messages_per_step"] == 2 * 2 * (pp - 1) * dp * cp * tp  # 2M(P-1) x D x C x T
    assert result["overlap"] == promised_overlap(pp, dp, cp, tp, 2, [1 + (ep > 1)] * 8)  # one 25 MB bucket a rank, and the experts'

    assert len(result["peak_memory_bytes_per_rank"]) == 8
    assert (tmp_path / "trace.json").exists()
    if grid == {"pp": 1, "dp": 2, "cp": 2, "tp": 2}:
        assert "(pp, dp, cp, tp) 0:(0, 0, 0, 0) 1:(0, 0, 0, 1) 2:(0, 0, 1, 0) 3:(0, 0, 1, 1) 4:(0, 1, 0, 0)" in out.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_negative_control_a_nudged_weight_fails_the_check(precision):
    """The flags of the in-process run at --pp 2, which passes, with the first parameter of each
    rank's stage moved by 10 x the precision's tolerance before the last of its 3 steps
    (FAIL_AT=*:2:nudge, tests/inject.py): the check must fail."""
    out = launch("hybrid_parallel.py", 2, *TINY, "--pp", 2, "--precision", precision, "--json",
                 env=clean_env(FAIL_AT="*:2:nudge"))
    assert out.returncode == 1 and "-> FAIL" in out.stdout, out.stdout + out.stderr
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["precision"] == precision and run["check_max_abs_diff"] > (hp.TOLERANCE_BF16 if precision == "bf16" else hp.TOLERANCE)
