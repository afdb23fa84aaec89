"""context_parallel.py: the attention alone and whole training on sub-communicators of sizes 1 to 4,
in both layouts and the three variants, the counts beside their formulas, then the script as launched."""
import json
import math
from pathlib import Path

import pytest
import torch

import context_parallel as cp
from harness import (SIZES, agree, assert_ragged_batch_is_the_plain_one_cut, assert_refused, clean_env, last_json,
                     launch, max_everywhere, receive_waits_for_queued_kernels, step_2_of, sub_comm, world)

CPU = torch.device("cpu")
VARIANTS = [("ring", True), ("ring", False), ("allgather", True), ("alltoall", True)]  # (--cp-comm, overlap)
HEADS = 4  # the all-to-all splits them: it runs where N divides them (1, 2, 4; not 3)
LAYOUTS = ["zigzag", "contiguous"]
# The attention alone against float64 autograd on the whole sequence, each of out, lse, dQ, dK, dV
# relative to its largest entry (scores up to 17, dK up to 10): float32 autograd itself is off by
# up to 3.5e-7 of that, ours measured at most 1.8e-6 (dK: the weights recomputed from the final
# lse, exp(s - lse), carry lse's rounding). The bound is 5 times ours.
ATTENTION_TOLERANCE = 1e-5
# 24 positions: 2N divides them for every N in SIZES. Four heads, so that heads are kept apart and
# the all-to-all runs at N = 1, 2 and 4.
SMALL = ["--layers", "2", "--hidden", "16", "--heads", str(HEADS), "--seq-len", "24", "--batch-size", "3"]


def plain_attention(q, k, v):
    """Causal attention on the whole sequence, by autograd: the output and the log-sum-exp."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    future = torch.ones(q.size(2), k.size(2), dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def largest(a, b):
    return (a.double() - b.double()).abs().max().item()


def relative(a, b):
    """Largest |a - b| over the largest |b|."""
    return largest(a, b) / b.abs().max().item()


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp_comm, overlap", VARIANTS)
def test_attention_alone_equals_autograd_on_the_whole_sequence(size, layout, cp_comm, overlap):
    """out, lse, dQ, dK and dV of this rank's positions against one process's in float64, with
    large scores (q scaled); the causal pairs of the ranks add up to H x T(T+1)/2. The all-to-all's
    lse is that of its heads over every position, in the order of positions.flatten()."""
    if cp_comm == "alltoall" and HEADS % size:
        pytest.skip(f"the all-to-all needs N to divide the {HEADS} heads")
    with sub_comm(size) as comm:
        diff, ok = 0.0, True
        if comm is not None:
            t, g = 24, torch.Generator().manual_seed(size)
            q, k, v, upstream = (torch.randn(2, HEADS, t, 8, generator=g) for _ in range(4))
            q = 4 * q
            full = [z.double().requires_grad_() for z in (q, k, v)]
            out_full, lse_full = plain_attention(*full)
            (out_full * upstream.double()).sum().backward()

            positions = cp.shard_positions(t, size, layout)
            mine = positions[comm.Get_rank()]
            counted = cp.CountedComm(comm, cp.Timeline(CPU))
            attention = cp.ContextParallelAttention(counted, positions, cp_comm, overlap, counted.timeline, CPU)
            local = [z[:, :, mine].clone().requires_grad_() for z in (q, k, v)]
            out, lse = attention.function.apply(*local, attention)
            (out * upstream[:, :, mine]).sum().backward()
            heads = slice(None)
            if cp_comm == "alltoall":
                mine, group = positions.flatten(), HEADS // size  # lse: its heads, every position
                heads = slice(comm.Get_rank() * group, (comm.Get_rank() + 1) * group)
            diff = max(relative(out, out_full[:, :, positions[comm.Get_rank()]]),
                       relative(lse, lse_full[:, heads][:, :, mine]),
                       *(relative(z.grad, f.grad[:, :, positions[comm.Get_rank()]]) for z, f in zip(local, full)))
            pairs = comm.allreduce(attention.tally["pairs"])
            ok &= pairs == HEADS * t * (t + 1) // 2  # every causal pair of every head computed once
            ok &= counted.calls == {"ring": {"Isend": 3 * size - 2, "Irecv": 3 * size - 2},  # K/V N-1 times
                                    "allgather": {"Allgather": 2, "Reduce_scatter_block": 1},  # each way, dK/dV
                                    "alltoall": {"Alltoall": 4}}[cp_comm]  # N hops home
        assert max_everywhere(diff) < ATTENTION_TOLERANCE
        assert agree(ok)


def test_the_layouts_hold_every_position_once_and_zigzag_pairs_chunks():
    for n in SIZES:
        for layout in LAYOUTS:
            table = cp.shard_positions(24, n, layout)
            assert sorted(table.flatten().tolist()) == list(range(24))
        zigzag, c = cp.shard_positions(24, n, "zigzag"), 24 // (2 * n)
        for r in range(n):  # chunks r and 2N-1-r
            assert zigzag[r].tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * n - 1 - r) * c, (2 * n - r) * c))


def test_merging_is_stable_where_exp_would_overflow():
    """Two blocks whose log-sum-exps are 1e4 apart: the merge gives the better block, no NaN."""
    out, lse = torch.zeros(1, 1, 2, 3), torch.tensor([[[1e4, -1e4]]])
    block_out, block_lse = torch.ones(1, 1, 2, 3), torch.tensor([[[-1e4, 1e4]]])
    cp.merge(out, lse, block_out, block_lse, torch.arange(2))
    assert torch.equal(out[0, 0, 0], torch.zeros(3)) and torch.equal(out[0, 0, 1], torch.ones(3))
    assert torch.equal(lse, torch.tensor([[[1e4, 1e4]]]))


def test_attention_block_by_block_merged_equals_one_softmax_without_mpi(capsys):
    """The lesson's demonstration (no MPI): blocks of keys one at a time, merged, against one
    softmax over the whole sequence, in float64; it prints its result."""
    for blocks, t in ((4, 12), (3, 12), (5, 20)):
        assert cp.blockwise_softmax_demo(blocks, t) < 1e-12
    assert "largest difference" in capsys.readouterr().out


def train(comm, argv, steps=3):
    """Train SMALL for `steps` on comm; the model, its counted communicator, the meter, the losses
    and the gradient norms."""
    args = cp.parse_args(SMALL + ["--steps", str(steps), *argv], comm.Get_size())
    counted = cp.CountedComm(comm, cp.Timeline(CPU))
    run = cp.types.SimpleNamespace(device=CPU, timeline=counted.timeline)
    model, optimizer = cp.context_parallel_model(args, counted, run.timeline, CPU)
    meter = cp.SavedBytes(model)
    losses, norms, _ = cp.train(args, counted, run, model, optimizer, meter)
    return args, model, counted, meter, losses, norms


@pytest.mark.mpi
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp_comm", ["ring", "allgather", "alltoall"])
def test_training_equals_one_process_at_every_size_with_counts_beside_their_formulas(layout, cp_comm):
    """N = 1 to 4 (the all-to-all: 1, 2, 4): losses and parameters within TOLERANCE of one process
    (hence the same at every N); bytes handed to MPI per step = the formula; causal pairs and scores
    computed per rank = their formulas; the ring's scores in zigzag equal on every rank, in
    contiguous unequal; saved activations = their formula, 1/N of one process's up to 4N bytes."""
    failures = []
    for size in [n for n in SIZES if cp_comm != "alltoall" or HEADS % n == 0]:
        with sub_comm(size) as comm:
            diff = 0.0
            if comm is not None:
                args, model, counted, meter, losses, norms = train(comm, ["--layout", layout, "--cp-comm", cp_comm])
                diff, plain, one, _ = cp.check(comm, args, losses, norms, model)
                params = sum(p.numel() for p in model.parameters())
                sent = sum(b for name, b in counted.bytes.items() if name != "Irecv") / args.steps
                total, _, pairs, scores, activations = cp.formulas(args, size, params)
                tally = model.attention.tally
                counted_pairs = comm.allgather(tally["pairs"] // tally["calls"])
                counted_scores = comm.allgather(tally["scores"] // tally["calls"])
                saved = meter.bytes
                if sent != total:
                    failures.append((size, "bytes", sent, total))
                if counted_pairs != pairs or len(set(pairs)) != (1 if layout == "zigzag" or cp_comm == "alltoall"
                                                                 else size):
                    failures.append((size, "pairs", counted_pairs, pairs))
                if counted_scores != scores:
                    failures.append((size, "scores", counted_scores, scores))
                if cp_comm == "ring" and len(set(counted_scores)) != (1 if layout == "zigzag" else size):
                    failures.append((size, "zigzag's equal work", counted_scores))
                # The loss's total weight (a 4-byte scalar) is the one saved tensor that does not
                # shrink with the positions: measured N x saved - one = 4(N-1) at every N.
                if abs(saved * size - one) > 4 * size or saved != activations:
                    failures.append((size, "activations", saved, one, activations))
                if not one < plain:  # plain attention saves the T x T weights besides
                    failures.append((size, "plain", one, plain))
            if max_everywhere(diff) > cp.TOLERANCE:
                failures.append((size, "diff", diff))
    assert agree(not failures), failures


def limit(precision):
    return cp.TOLERANCE_BF16 if precision == "bf16" else cp.TOLERANCE


def sent_per_step(counted, steps):
    return sum(b for name, b in counted.bytes.items() if name != "Irecv") / steps  # Irecv: bytes received


@pytest.mark.mpi
@pytest.mark.parametrize("cp_comm", ["ring", "allgather", "alltoall"])
def test_bf16_equals_one_process_in_bf16_with_bytes_and_activations_beside_their_formulas(cp_comm):
    """--precision bf16 at N = 1 to 4 (the all-to-all 1, 2, 4; contiguous at N = 3, zigzag elsewhere):
    within TOLERANCE_BF16 of one process in bf16; bytes handed to MPI per step = the formula with
    e = 2: what only moves (K/V, Q, the output, their gradients) as bf16 and every sum (dK/dV going
    home, Reduce_scatter_block, the gradients) as float32, so either other choice would miss it;
    the activation bytes saved = their formula with e = 2."""
    failures = []
    for size in [n for n in SIZES if cp_comm != "alltoall" or HEADS % n == 0]:
        with sub_comm(size) as comm:
            diff = 0.0
            if comm is not None:
                layout = "contiguous" if size == 3 else "zigzag"
                args, model, counted, meter, losses, norms = train(comm, ["--layout", layout, "--cp-comm", cp_comm,
                                                                          "--precision", "bf16"])
                diff = cp.check(comm, args, losses, norms, model)[0]
                total, _, _, _, activations = cp.formulas(args, size, sum(p.numel() for p in model.parameters()))
                if sent_per_step(counted, args.steps) != total or meter.bytes != activations:
                    failures.append((size, sent_per_step(counted, args.steps), total, meter.bytes, activations))
            if max_everywhere(diff) > cp.TOLERANCE_BF16:
                failures.append((size, "diff", diff))
    assert agree(not failures), failures


@pytest.mark.mpi
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_saves_its_formula_repeats_the_forward_exchange_and_keeps_the_losses(precision, monkeypatch):
    """N = 2, each variant, 2 steps of --recompute none, selective and full: the activation bytes
    saved = their formula, full < selective < none; the bytes handed to MPI = the formula, whose
    forward exchange comes once more in backward for selective and full (the ring: L(N-1) more
    Isends; the all-gather: L more Allgathers; the all-to-all: 2L more Alltoalls); the losses those
    without recomputation, bit for bit (in bf16 too: the same operations on the same values). And
    the meter's plant: counting autocast's bf16 copies of the parameters adds exactly their bytes."""
    L, n, failures = 2, 2, []
    with sub_comm(n) as comm:
        if comm is not None:
            for cp_comm in ("ring", "allgather", "alltoall"):
                runs = {}
                for recompute in ("none", "selective", "full"):
                    flags = ["--cp-comm", cp_comm, "--precision", precision, "--recompute", recompute]
                    args, model, counted, meter, losses, _ = train(comm, flags, steps=2)
                    total, _, _, _, activations = cp.formulas(args, n, sum(p.numel() for p in model.parameters()))
                    calls = {k: c // args.steps for k, c in counted.calls.items()}
                    runs[recompute] = (losses, meter.bytes, calls)
                    if sent_per_step(counted, args.steps) != total or meter.bytes != activations:
                        failures.append((cp_comm, recompute, sent_per_step(counted, args.steps), total, meter.bytes,
                                         activations))
                (plain, none, calls), (_, selective, again), (_, full, _) = runs.values()
                more = {"ring": {"Isend": L * (n - 1), "Irecv": L * (n - 1)}, "allgather": {"Allgather": L},
                        "alltoall": {"Alltoall": 2 * L}}[cp_comm]
                if {k: again[k] - calls[k] for k in calls} != {**dict.fromkeys(calls, 0), **more}:
                    failures.append((cp_comm, "calls", calls, again))
                if not full < selective < none or any(r[0] != plain for r in runs.values()):
                    failures.append((cp_comm, full, selective, none, [r[0] for r in runs.values()]))
            if precision == "bf16":
                args, model, _, meter, _, _ = train(comm, ["--precision", "bf16"], steps=1)
                class CountingCopies(cp.SavedBytes):
                    def __init__(self, model):
                        super().__init__(model)
                        self.ids = set()  # the plant: no parameter known, so their bf16 copies count
                monkeypatch.setattr(cp, "SavedBytes", CountingCopies)
                _, _, _, counting, _, _ = train(comm, ["--precision", "bf16"], steps=1)
                copies = 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
                if counting.bytes - meter.bytes != copies:
                    failures.append(("copies", counting.bytes - meter.bytes, copies))
        assert agree(comm is None or not failures), failures


@pytest.mark.mpi
@pytest.mark.parametrize("size", [2, 4])
def test_kv_messages_are_in_flight_while_blocks_compute_and_not_without_overlap(size):
    """From the timeline of the last step: with overlap, every ring message but the dK/dV's last
    hop home (2 per layer) is posted before an attention block ends and waited for after it begins,
    L(6N-6) of L(6N-4) per rank; with --no-overlap, each exchange is waited for before its block: none."""
    with sub_comm(size) as comm:
        counts = {}
        if comm is not None:
            for flag in ([], ["--no-overlap"]):
                _, _, counted, _, _, _ = train(comm, flag, steps=1)
                counts[bool(flag)] = cp.kv_messages_under_compute(counted.timeline.step_events)
        L = 2
        assert agree(comm is None or counts == {False: [L * (6 * size - 6), L * (6 * size - 4)],
                                                True: [0, L * (6 * size - 4)]}), counts


@pytest.mark.mpi
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_check_reports_a_nudged_parameter_or_loss_and_nan(precision):
    """Negative control in process: the trained state nudged by 1.5 x the precision's tolerance (a
    parameter on every rank, the last loss or the last gradient norm), or a NaN, must be reported
    above the tolerance: the norm in the check's largest difference in fp32, beside it in bf16 (the
    norms' own largest |difference|, which must show it there)."""
    tolerance = limit(precision)
    with sub_comm(2) as comm:
        failures = []
        if comm is not None:
            args, model, _, _, losses, norms = train(comm, ["--precision", precision], steps=2)
            p = next(model.parameters()).detach().view(-1)
            if not cp.check(comm, args, losses, norms, model)[0] <= tolerance:
                failures.append("unperturbed")
            p[0] += 1.5 * tolerance
            if not cp.check(comm, args, losses, norms, model)[0] > tolerance:
                failures.append("parameter")
            p[0] -= 1.5 * tolerance
            if not cp.check(comm, args, losses[:-1] + [losses[-1] + 1.5 * tolerance], norms, model)[0] > tolerance:
                failures.append("loss")
            nudged = cp.check(comm, args, losses, norms[:-1] + [norms[-1] + 1.5 * tolerance], model)
            if not nudged[0 if precision == "fp32" else 3] > tolerance:
                failures.append("norm")
            p[0] = math.nan
            if not cp.check(comm, args, losses, norms, model)[0] > tolerance:
                failures.append("NaN")
        assert agree(comm is None or not failures), failures


@pytest.mark.mpi
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradients_divided_once_more_by_n_fail_the_check(precision, monkeypatch):
    """A planted bug: the summed gradients divided by N (an average where the loss wants the sum)
    must fail the check in either precision, at N = 2 after 3 steps, with SGD: AdamW's step does not
    change when every gradient is scaled, so under it only the norm shows the bug, which the bf16
    check leaves beside it."""
    sum_gradients = cp.sum_gradients

    def averaged(model, comm):
        sum_gradients(model, comm)
        for p in model.parameters():
            p.grad /= comm.Get_size()
    monkeypatch.setattr(cp, "sum_gradients", averaged)
    with sub_comm(2) as comm:
        diff = None
        if comm is not None:
            sgd = ["--optimizer", "sgd", "--lr", "0.1", "--clip-grad", "0", "--lr-schedule", "constant"]
            args, model, _, _, losses, norms = train(comm, ["--precision", precision, *sgd])
            diff = cp.check(comm, args, losses, norms, model)[0]
        assert agree(comm is None or diff > limit(precision)), diff


# --- The recipe: AdamW, the global gradient norm clipped, a warm-up then a cosine -------------------
# --lr 1e-3, AdamW's scale (the default 0.1 is SGD's). AdamW moves each parameter by about lr whatever
# the size of its gradient, rounding included: the key bias's gradient is rounding alone (zero in exact
# arithmetic: the softmax ignores a constant added to a query's scores). Measured at these 3 steps,
# N = 1 to 4, the three variants: fp32 at most 7.2e-7 (at --lr 0.1, 7.9e-5 in the key bias: over
# TOLERANCE); bf16 at most 2.0e-3, about 2 x lr (elements whose step turned with the rounding).
CLIP = 0.05  # below every step's norm (1.7 to 2.6 here): every step is clipped
RECIPE = ["--optimizer", "adamw", "--lr", "1e-3", "--lr-schedule", "cosine", "--warmup-steps", "1",
          "--clip-grad", str(CLIP)]


@pytest.mark.mpi
def test_the_recipe_equals_one_process_at_every_size_with_the_clip_active():
    """AdamW, one warm-up step then the cosine, the norm clipped on every step: losses, gradient norms
    and parameters within TOLERANCE of one process that clips with torch.nn.utils.clip_grad_norm_, at
    N = 1 to 4 (a variant and layout each); in bf16 at N = 2, losses and parameters within
    TOLERANCE_BF16 (the norms stand beside that check). Every rank computed the same norms, and
    handed MPI no more bytes than the formula's (the norm has no exchange)."""
    failures = []
    for size, layout, cp_comm, precision in [(1, "zigzag", "ring", "fp32"), (2, "contiguous", "allgather", "fp32"),
                                             (3, "zigzag", "ring", "fp32"), (4, "zigzag", "alltoall", "fp32"),
                                             (2, "zigzag", "ring", "bf16")]:
        with sub_comm(size) as comm:
            diff = 0.0
            if comm is not None:
                flags = RECIPE + ["--layout", layout, "--cp-comm", cp_comm, "--precision", precision]
                args, model, counted, _, losses, norms = train(comm, flags)
                diff = cp.check(comm, args, losses, norms, model)[0]
                if min(norms) <= CLIP or len({tuple(n) for n in comm.allgather(norms)}) != 1:
                    failures.append((size, precision, "norms", norms))
                if sent_per_step(counted, args.steps) != cp.formulas(args, size, sum(p.numel() for p in
                                                                                    model.parameters()))[0]:
                    failures.append((size, precision, "bytes", dict(counted.bytes)))
            if max_everywhere(diff) > limit(precision):
                failures.append((size, precision, "diff", diff))
    assert agree(not failures), failures


@pytest.mark.mpi
def test_a_learning_rate_one_step_ahead_fails_the_check(monkeypatch):
    """A planted off-by-one: the ranks' learning_rate(step + 1) (with one warm-up step, step 0's rate is
    right: from step 1 the cosine runs one step early). The reference writes its schedule out by itself,
    so the recipe at N = 2 must FAIL the check."""
    learning_rate = cp.learning_rate
    monkeypatch.setattr(cp, "learning_rate", lambda args, step: learning_rate(args, step + 1))
    with sub_comm(2) as comm:
        diff = None
        if comm is not None:
            args, model, _, _, losses, norms = train(comm, RECIPE)
            diff = cp.check(comm, args, losses, norms, model)[0]
        assert agree(comm is None or diff > cp.TOLERANCE), diff


@pytest.mark.mpi
def test_the_norm_of_a_ranks_partial_gradient_fails_the_check_and_splits_the_replicas(monkeypatch):
    """A planted bug: the norm taken before the Allreduce, of the rank's own share of the gradient,
    and the summed gradient clipped by it. With the recipe, the clip active, at N = 2: the check must
    FAIL, the two ranks' norms differ, and so do the replicas, clipped by different scales."""
    sum_gradients, global_grad_norm, partial = cp.sum_gradients, cp.global_grad_norm, []

    def norm_then_sum(model, comm):
        partial.append(global_grad_norm(model))  # this rank's share alone
        sum_gradients(model, comm)
    monkeypatch.setattr(cp, "sum_gradients", norm_then_sum)
    monkeypatch.setattr(cp, "global_grad_norm", lambda model: partial.pop())
    with sub_comm(2) as comm:
        result = None
        if comm is not None:
            args, model, _, _, losses, norms = train(comm, RECIPE)
            result = (cp.check(comm, args, losses, norms, model)[0], len({tuple(n) for n in comm.allgather(norms)}),
                      len(set(comm.allgather(cp.checksum(model)))))
        assert agree(result is None or (result[0] > cp.TOLERANCE and result[1:] == (2, 2))), result


def test_the_schedule_warms_up_then_holds_or_falls_by_a_cosine_towards_a_tenth():
    """learning_rate against values worked by hand (--lr 1); the check's reference has its own schedule."""
    def rates(schedule, warmup, steps):
        args = cp.parse_args(["--lr", "1", "--lr-schedule", schedule, "--warmup-steps", str(warmup),
                              "--steps", str(steps)], 1)
        return [cp.learning_rate(args, step) for step in range(steps)]
    assert rates("constant", 2, 5) == [0.5, 1, 1, 1, 1]
    assert rates("cosine", 2, 5) == pytest.approx([0.5, 1, 1, 0.775, 0.325])  # 0.1 + 0.45 (1 + cos(pi k / 3))
    half = 0.5 ** 0.5  # cos(pi / 4)
    assert rates("cosine", 0, 4) == pytest.approx([1, 0.1 + 0.45 * (1 + half), 0.55, 0.1 + 0.45 * (1 - half)])


@pytest.mark.mpi
@pytest.mark.parametrize("cp_comm", ["ring", "allgather", "alltoall"])
def test_staged_through_host_memory_no_receive_buffer_is_copied_in(cp_comm, monkeypatch):
    """As on a GPU whose MPI cannot read GPU memory (the CPU stand-in of tests/inject.py's
    STAGE_ALL): every send is a host copy, every receive a fresh empty buffer. The run still
    equals one process (each copy back ran), and the bytes copied into send buffers are exactly
    those handed to MPI to send, but the loss's 8 (a host tensor): a receive buffer copied in
    from the device would add its bytes."""
    copied = []

    def host_copy(t, *args, **kwargs):
        copied.append(t.numel() * t.element_size())
        return torch.empty(t.shape, dtype=t.dtype).copy_(t)
    monkeypatch.setattr(cp, "mpi_buffer", host_copy)
    monkeypatch.setattr(cp, "receive_buffer", lambda t: torch.empty(t.shape, dtype=t.dtype))
    with sub_comm(2) as comm:
        result = None
        if comm is not None:
            args, model, counted, _, losses, norms = train(comm, ["--cp-comm", cp_comm], steps=2)
            sent = sum(b for name, b in counted.bytes.items() if name != "Irecv")
            result = (sum(copied), sent - 8 * args.steps)  # before the check, whose reference stages too
            result = (cp.check(comm, args, losses, norms, model)[0], *result)
        assert agree(result is None or (result[0] <= cp.TOLERANCE and result[1] == result[2])), result


def test_a_receive_into_gpu_memory_waits_alone_for_the_kernels_queued_before(monkeypatch):
    """With a CUDA-aware MPI a receive lands in the tensor itself, whose memory kernels queued before
    may still read (the ring's spare block, or memory the allocator reuses): receive_buffer must wait for them itself (record an event, synchronize
    it) before handing the tensor over, not count on a send staged beside it. On the CPU a stand-in:
    a tensor that says it is on a GPU, torch.cuda.Event a recorder. The plant, the former rule (the
    tensor itself, no event), records nothing and fails; a CPU tensor needs no event."""
    receive_waits_for_queued_kernels(cp, monkeypatch)


# --- --ragged: documents of uneven length, the loss over the valid targets of the whole step ------
def test_ragged_batches_cut_documents_and_leave_the_plain_batch_as_it_was():
    assert_ragged_batch_is_the_plain_one_cut(cp)


def ragged_counts(args, comm):
    """Each rank's count of valid targets, step by step: unequal, or the test would prove nothing."""
    positions = cp.shard_positions(args.seq_len, comm.Get_size(), args.layout)[comm.Get_rank()]
    return [int((cp.make_batch(args.seed, step, args.batch_size, args.seq_len, True)[1][:, positions]
                 != cp.IGNORE).sum()) for step in range(args.steps)]


@pytest.mark.mpi
def test_ragged_training_equals_one_process_whose_loss_is_the_mean_over_valid_targets():
    """--ragged at N = 2, 3, 4 (a layout and variant each; the recipe at N = 2): losses, gradient norms
    and parameters within TOLERANCE of one process taking F.cross_entropy's mean over the valid targets
    of the whole batch; the ranks' own counts differ; bytes handed to MPI = the formula (8 more: the
    count's Allreduce)."""
    failures = []
    for size, flags in [(2, ["--layout", "contiguous"] + RECIPE), (3, ["--cp-comm", "allgather"]),
                        (4, ["--layout", "contiguous", "--cp-comm", "alltoall"])]:
        with sub_comm(size) as comm:
            diff = 0.0
            if comm is not None:
                args, model, counted, _, losses, norms = train(comm, flags + ["--ragged"])
                diff = cp.check(comm, args, losses, norms, model)[0]
                if len({tuple(c) for c in comm.allgather(ragged_counts(args, comm))}) == 1:
                    failures.append((size, "equal counts"))
                if sent_per_step(counted, args.steps) != cp.formulas(args, size, sum(p.numel() for p in
                                                                                    model.parameters()))[0]:
                    failures.append((size, "bytes", dict(counted.bytes)))
            if max_everywhere(diff) > cp.TOLERANCE:
                failures.append((size, "diff", diff))
    assert agree(not failures), failures


@pytest.mark.mpi
def test_ragged_losses_over_each_ranks_own_count_fail_the_check(monkeypatch):
    """A planted bug: each rank divides its loss by its own count of valid targets times N (a per-rank
    mean, averaged: right when the counts are equal, as without --ragged). At N = 2, contiguous (the
    second half of every sequence has fewer valid targets), the check must FAIL."""
    monkeypatch.setattr(cp, "valid_targets", lambda y, comm: (y != cp.IGNORE).sum().item() * comm.Get_size())
    with sub_comm(2) as comm:
        diff = None
        if comm is not None:
            args, model, _, _, losses, norms = train(comm, ["--layout", "contiguous", "--ragged"])
            diff = cp.check(comm, args, losses, norms, model)[0]
        assert agree(comm is None or diff > cp.TOLERANCE), diff


# --- Checkpoints: saved on one grid (N, --layout, --cp-comm), resumed on another ------------------
RESUME = SMALL + ["--seed", "3", "--steps", "4", "--save-every", "2"]  # checkpoints after steps 2 and 4
UNINTERRUPTED = {}  # grid -> the folder of its uninterrupted run, made by the first test that needs it


def grid_flags(grid):
    return ["--layout", grid[1], "--cp-comm", grid[2]]


def uninterrupted(grid, tmp_path_factory, recipe=()):
    """The folder of a run of all 4 steps on `grid` (N, layout, --cp-comm) that was never stopped
    (checkpoints of steps 2 and 4): what a resumed run must equal, and where a resume takes step 2 from."""
    if (grid, *recipe) not in UNINTERRUPTED:
        folder = world().bcast(str(tmp_path_factory.mktemp("uninterrupted")), root=0)
        with sub_comm(grid[0]) as comm:
            status = 0 if comm is None else cp.main(RESUME + [*recipe] + grid_flags(grid) + ["--save", folder,
                                                                                             "--no-check"], comm)
            assert agree(status == 0)
        UNINTERRUPTED[(grid, *recipe)] = folder
    return UNINTERRUPTED[(grid, *recipe)]


def latest_checkpoint(folder):
    """The newest checkpoint in folder: its manifest and rank 0's one file (the model, the optimizer's state)."""
    path = sorted(Path(folder).glob("step-*"))[-1]
    manifest = json.loads((path / "manifest.json").read_text())
    assert list(manifest["files"]) == ["rank-0.pt"], manifest["files"].keys()  # written once, by rank 0
    return manifest, torch.load(path / "rank-0.pt", weights_only=True)


def difference(a, b):
    """Largest |difference| between two checkpoints' losses, gradient norms and tensors (parameters and
    the optimizer's state)."""
    (manifest_a, tensors_a), (manifest_b, tensors_b) = a, b
    assert tensors_a.keys() == tensors_b.keys() and len(manifest_a["state"]["losses"]) == 4
    state_a, state_b = manifest_a["state"], manifest_b["state"]
    return max([abs(x - y) for key in ("losses", "grad_norms") for x, y in zip(state_a[key], state_b[key], strict=True)]
               + [(tensors_a[key] - tensors_b[key]).abs().max().item() for key in tensors_a])


ZIGZAG_RING, CONTIGUOUS_ALLGATHER = (2, "zigzag", "ring"), (3, "contiguous", "allgather")
ZIGZAG_ALLTOALL, ONE_RANK = (4, "zigzag", "alltoall"), (1, "contiguous", "ring")


@pytest.mark.mpi
@pytest.mark.parametrize("saved_on, resumed_on", [
    (ZIGZAG_RING, CONTIGUOUS_ALLGATHER), (CONTIGUOUS_ALLGATHER, ZIGZAG_ALLTOALL), (ZIGZAG_ALLTOALL, ONE_RANK),
    (ONE_RANK, ZIGZAG_RING), (ZIGZAG_RING, ZIGZAG_RING)], ids=lambda g: f"{g[0]}-{g[1]}-{g[2]}")
def test_a_checkpoint_resumes_on_another_grid_as_the_uninterrupted_run_there(saved_on, resumed_on,
                                                                               tmp_path_factory, capsys):
    """Step 2 of a run on one grid (N, --layout, --cp-comm), resumed on another (every rank takes the
    whole model that rank 0 wrote), trains steps 3 and 4 as the uninterrupted run on the new grid:
    their last checkpoints hold the same losses (the first two computed on the old grid), parameters
    and momentum within TOLERANCE, bit for bit on the same grid; the resumed run's check against one
    process passes, and its header names the grid that wrote the checkpoint."""
    source, whole = uninterrupted(saved_on, tmp_path_factory), uninterrupted(resumed_on, tmp_path_factory)
    folder = step_2_of(source, tmp_path_factory)
    said = f"at step 2 (written by {saved_on[0]} ranks, --layout {saved_on[1]}, --cp-comm {saved_on[2]})"
    with sub_comm(resumed_on[0]) as comm:
        run, status = None, 0
        if comm is not None:
            status = cp.main(RESUME + grid_flags(resumed_on) + ["--save", folder, "--resume", "--json"], comm)
            out = capsys.readouterr().out
            run = json.loads(out.strip().splitlines()[-1]) if comm.Get_rank() == 0 else None
            run = comm.bcast((run, said in out), root=0)
        assert agree(status == 0)
        assert agree(run is None or (run[1] and run[0]["check_max_abs_diff"] <= cp.TOLERANCE)), run
    ok = True
    if world().Get_rank() == 0:
        resumed, reference = latest_checkpoint(folder), latest_checkpoint(whole)
        ok = resumed[0]["step"] == 4 and resumed[0]["world_size"] == resumed_on[0]
        if saved_on == resumed_on:  # bit for bit: every loss, parameter and momentum
            ok = ok and resumed[0]["state"] == reference[0]["state"] and resumed[1].keys() == reference[1].keys()
            ok = ok and all(torch.equal(resumed[1][key], reference[1][key]) for key in resumed[1])
        else:
            ok = ok and difference(resumed, reference) <= cp.TOLERANCE
    assert agree(ok)


@pytest.mark.mpi
def test_adamw_resumes_on_another_grid_as_the_uninterrupted_run_there(tmp_path_factory, capsys):
    """The recipe saved at step 2 on 2 ranks (zigzag, ring), resumed on 3 (contiguous, all-gather):
    rank 0 wrote AdamW's moments as pieces of the whole (exp_avg/<name>, exp_avg_sq/<name>) and its
    step count in the state; the last checkpoint equals the uninterrupted run's on 3 ranks within
    TOLERANCE (losses, gradient norms, parameters, moments), its step count 4; the resumed run's
    check passes, its progress lines print the norm and its JSON holds all four norms."""
    source = uninterrupted(ZIGZAG_RING, tmp_path_factory, RECIPE)
    whole = uninterrupted(CONTIGUOUS_ALLGATHER, tmp_path_factory, RECIPE)
    folder = step_2_of(source, tmp_path_factory)
    capsys.readouterr()  # not the uninterrupted runs' lines
    with sub_comm(3) as comm:
        run, status = None, 0
        if comm is not None:
            status = cp.main(RESUME + RECIPE + grid_flags(CONTIGUOUS_ALLGATHER) + ["--save", folder, "--resume",
                                                                                   "--json", "--log-every", "1"], comm)
            out = capsys.readouterr().out
            run = comm.bcast((json.loads(out.strip().splitlines()[-1]), out.count(" | norm ")) if comm.Get_rank() == 0
                             else None, root=0)
        assert agree(status == 0)
        assert agree(run is None or (run[0]["check_max_abs_diff"] <= cp.TOLERANCE and len(run[0]["grad_norms"]) == 4
                                     and run[1] == 2)), run
    ok = True
    if world().Get_rank() == 0:
        resumed, reference = latest_checkpoint(folder), latest_checkpoint(whole)
        names = [name for name, _ in cp.build_model(cp.parse_args(RESUME, 1)).named_parameters()]
        ok = resumed[0]["state"]["adamw_step"] == 4 and not any(key.startswith("momentum/") for key in resumed[1])
        ok = ok and all(f"{key}/{name}" in resumed[1] for name in names for key in ("exp_avg", "exp_avg_sq"))
        ok = ok and difference(resumed, reference) <= cp.TOLERANCE
    assert agree(ok)


@pytest.mark.mpi
def test_a_schedule_one_step_behind_after_a_resume_differs_from_the_uninterrupted_run(tmp_path_factory, monkeypatch):
    """A planted bug: the resumed run's rates one step behind (learning_rate(step - 1)). Resumed on the
    grid that saved it (which otherwise gives the uninterrupted run bit for bit), its last checkpoint
    must differ from the uninterrupted run's beyond TOLERANCE. (The check's reference writes its own
    schedule: a plant in learning_rate fails the check too, test_a_learning_rate_one_step_ahead_....)"""
    folder = step_2_of(uninterrupted(ZIGZAG_RING, tmp_path_factory, RECIPE), tmp_path_factory)
    learning_rate = cp.learning_rate
    monkeypatch.setattr(cp, "learning_rate", lambda args, step: learning_rate(args, step - 1))
    flags = RESUME + RECIPE + grid_flags(ZIGZAG_RING) + ["--save", folder, "--resume", "--no-check"]
    with sub_comm(2) as comm:
        status = 0 if comm is None else cp.main(flags, comm)
        assert agree(status == 0)
    diff = None
    if world().Get_rank() == 0:
        diff = difference(latest_checkpoint(folder), latest_checkpoint(uninterrupted(ZIGZAG_RING, tmp_path_factory,
                                                                                      RECIPE)))
    assert agree(world().Get_rank() != 0 or diff > cp.TOLERANCE), diff


@pytest.mark.mpi
@pytest.mark.parametrize("flag, saved, given", [("--layers", 2, 3), ("--hidden", 16, 32)])
def test_a_checkpoint_of_another_model_is_refused_with_one_line_naming_both(flag, saved, given, tmp_path_factory,
                                                                              capsys):
    """Another number of blocks or hidden size, on another grid: exit 2, one line that names the
    checkpoint's model and this run's, and nothing written in the folder."""
    folder = step_2_of(uninterrupted(ZIGZAG_RING, tmp_path_factory), tmp_path_factory)
    before = sorted(str(p) for p in Path(folder).rglob("*"))
    with sub_comm(3) as comm:
        status, errors = 2, []
        if comm is not None:
            status = cp.main(RESUME + grid_flags(CONTIGUOUS_ALLGATHER) + ["--save", folder, "--resume", flag,
                                                                          str(given)], comm)
            errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        word = flag.removeprefix("--")
        ok = status == 2 and (world().Get_rank() != 0 or (
            len(errors) == 1 and "holds a model" in errors[0]
            and f"'{word}': {saved}" in errors[0] and f"'{word}': {given}" in errors[0]))
        assert agree(ok), errors
    assert agree(world().Get_rank() != 0 or sorted(str(p) for p in Path(folder).rglob("*")) == before)


@pytest.mark.parametrize("argv, world_size, words", [
    (["--seq-len", "90"], 2, ["--seq-len 90", "4 equal chunks", "e.g. 88 or 92", "--layout contiguous"]),
    (["--seq-len", "90", "--layout", "contiguous"], 4, ["--seq-len 90", "4 equal chunks", "e.g. 88 or 92"]),
    ([], 7, ["--seq-len 120", "14 equal chunks"]),
    (["--hidden", "50"], 1, ["--hidden 50", "4 heads"]),
    (["--cp-comm", "allgather", "--no-overlap"], 2, ["--no-overlap", "--cp-comm ring"]),
    (["--cp-comm", "alltoall", "--no-overlap"], 2, ["--no-overlap", "--cp-comm ring"]),
    (["--cp-comm", "alltoall"], 3, ["--cp-comm alltoall", "4 heads", "3 ranks", "--cp-comm ring"]),
    (["--cp-comm", "alltoall", "--heads", "2", "--hidden", "32"], 4, ["2 heads", "4 ranks", "--cp-comm ring"]),
    (["--layout", "diagonal"], 1, ["--layout", "zigzag", "contiguous"]),
    (["--seq-len", "10000000"], 1, ["--seq-len"]),
    (["--steps", "0"], 1, ["--steps"]),
    (["--clip-grad", "-1"], 1, ["--clip-grad", "0 or more", "-1.0"]),
    (["--warmup-steps", "40"], 1, ["--warmup-steps 40", "below --steps 40"]),
    (["--optimizer", "adam"], 1, ["--optimizer", "'adam'", "sgd", "adamw"]),
])
def test_impossible_inputs_are_rejected_with_what_would_work(argv, world_size, words):
    with pytest.raises(cp.ConfigError) as error:
        cp.parse_args(argv, world_size)
    assert all(w in str(error.value) for w in words), str(error.value)


E2E = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "48", "--batch-size", "4", "--steps", "4",
       "--json"]


@pytest.mark.e2e
def test_launched_ring_passes_its_check_with_counts_beside_formulas_and_a_trace(tmp_path):
    """The default layout and variant at N = 4: the JSON's counts against their formulas, the
    overlap (every rank: L(6N-6) of L(6N-4)), and a trace with every rank's blocks and messages."""
    run = last_json(launch("context_parallel.py", 4, *E2E, "--trace", tmp_path / "t.json"))
    assert run["check_max_abs_diff"] <= cp.TOLERANCE and run["losses"][-1] < run["losses"][0]
    assert len(run["grad_norms"]) == 4 and (run["cp_layout"], run["cp_comm"]) == ("zigzag", "ring")
    assert run["comm_bytes_per_step"] == run["comm_bytes_formula"]
    assert run["causal_pairs_per_rank"] == run["causal_pairs_formula"] and len(set(run["causal_pairs_per_rank"])) == 1
    assert run["scores_computed_per_rank"] == run["scores_computed_formula"]
    assert len(set(run["scores_computed_per_rank"])) == 1  # zigzag: the same blocks computed on every rank
    assert run["overlap"] == {"kv_messages_under_compute": [4 * 2 * 18, 4 * 2 * 20]}
    assert all(abs(b * 4 - run["activation_bytes_one_process"]) <= 16 for b in run["activation_bytes_per_rank"])
    assert run["activation_bytes_per_rank"] == [run["activation_bytes_formula"]] * 4
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    for rank in range(4):
        names = {e["name"] for e in trace if e["ph"] == "X" and e["pid"] == rank}
        assert {"forward", "backward", "attention block", "Isend", "Irecv", "Allreduce"} <= names


@pytest.mark.e2e
def test_launched_contiguous_without_overlap_in_bf16_recomputing_blocks_with_every_buffer_staged():
    """--layout contiguous --no-overlap --precision bf16 --recompute full at N = 3, every buffer
    handed to MPI a host copy (each copy back exercised, bf16 ones included): the bf16 check passes,
    bytes and activation bytes equal their formulas, the forward's K/V ring comes again in backward
    (L(4N-3) Isends a step, not L(3N-2)), the pairs are those of the formula and unequal, none of the
    K/V messages is in flight during a block."""
    run = last_json(launch("context_parallel.py", 3, *E2E, "--layout", "contiguous", "--no-overlap",
                           "--precision", "bf16", "--recompute", "full", env=clean_env(STAGE_ALL=1)))
    assert (run["precision"], run["recompute"]) == ("bf16", "full") and run["check_max_abs_diff"] <= cp.TOLERANCE_BF16
    assert run["comm_bytes_per_step"] == run["comm_bytes_formula"] and run["messages_per_step"] == 2 * 9
    assert run["activation_bytes_per_rank"] == [run["activation_bytes_formula"]] * 3
    assert run["causal_pairs_per_rank"] == run["causal_pairs_formula"] == [272, 784, 1296]  # 2 heads
    assert run["scores_computed_per_rank"] == run["scores_computed_formula"] == [512, 1024, 1536]
    assert run["overlap"] == {"kv_messages_under_compute": [0, 3 * 2 * 2 * 9]}  # 3 ranks, Isend and Irecv


@pytest.mark.e2e
def test_a_nudged_parameter_fails_the_launched_check():
    """Negative control as launched: FAIL_AT=*:2:nudge moves every rank's first parameter by
    10 x TOLERANCE after step 2; the check must print -> FAIL and the job exit 1."""
    result = launch("context_parallel.py", 2, *E2E[:-1], "--cp-comm", "allgather", env=clean_env(FAIL_AT="*:2:nudge"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "-> FAIL" in result.stdout and "Traceback" not in result.stderr, result.stdout + result.stderr


@pytest.mark.e2e
def test_a_sequence_that_2n_does_not_divide_exits_2_with_one_line():
    assert_refused(launch("context_parallel.py", 2, "--seq-len", "90"), "use a multiple of 4")
