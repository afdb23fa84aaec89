"""tensor_parallel.py: Megatron's pieces on sub-communicators of sizes 1 to 4, then the script as launched."""
import copy
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tensor_parallel as tp
from harness import SIZES, agree, assert_refused, clean_env, last_json, launch, max_everywhere, sub_comm, world

CPU = torch.device("cpu")
# One layer against nn.Linear: the same products, sums over a few dozen terms reordered across
# ranks; values are O(1), so float32 differences stay near 1e-7. Whole models and training use the
# script's own stated tolerance, tp.TOLERANCE.
LAYER_TOLERANCE = 1e-5
# Divisible by 1, 2, 3 and 4, so every world size in SIZES can split the heads.
SMALL = ["--layers", "2", "--hidden", "48", "--heads", "12", "--seq-len", "16", "--batch-size", "3"]


def counted(comm):
    return tp.CountedComm(comm, tp.Timeline(CPU))


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def mine(t, dim, comm, groups=1):
    """This rank's slice of a tensor, cut as the script cuts weights."""
    return tp.shard(t, dim, comm, groups).detach()


def largest(a, b):
    return (a.double() - b.double()).abs().max().item()


def unshard(t, partition, comm):
    """The full tensor from every rank's slice of it, on every rank."""
    pieces = t.new_empty((comm.Get_size(), *t.shape))
    comm.Allgather(t.detach().contiguous(), pieces)
    return tp.join_slices(pieces.unbind(0), partition)


def gradient_difference(sharded, plain, comm):
    """Largest difference between the gathered gradients of a sharded module and a plain one."""
    grads = {name: unshard(p.grad, p.partition, comm) if hasattr(p, "partition") else p.grad
             for name, p in sharded.named_parameters()}
    return max(largest(grads[name], p.grad) for name, p in plain.named_parameters())


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("groups", [1, 3])
def test_column_parallel_linear_equals_nn_linear(size, groups):
    with sub_comm(size) as comm:
        diff, calls = 0.0, {}
        if comm is not None:
            torch.manual_seed(0)
            full, out = nn.Linear(8, 12 * groups), 12 * groups
            x, upstream = randn(5, 8), randn(5, out, seed=1)
            x_full = x.clone().requires_grad_()
            y_full = full(x_full)
            (y_full * upstream).sum().backward()

            f_comm = counted(comm)
            column = tp.ColumnParallelLinear(full, f_comm, groups)
            x_mine = x.clone().requires_grad_()
            y = column(x_mine)  # this rank's output features, with groups=3 of q, k and v each
            (y * mine(upstream, 1, comm, groups)).sum().backward()
            calls = dict(f_comm.calls)
            diff = max(largest(y, mine(y_full, 1, comm, groups)),
                       largest(unshard(y, (1, groups, out), comm), y_full),
                       gradient_difference(column, full, comm),
                       largest(x_mine.grad, x_full.grad))  # whole on every rank, thanks to f
        assert max_everywhere(diff) < LAYER_TOLERANCE
        assert agree(comm is None or calls == {"Allreduce": 1})  # only f's backward communicates


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_row_parallel_linear_equals_nn_linear(size):
    with sub_comm(size) as comm:
        diff, calls = 0.0, {}
        if comm is not None:
            torch.manual_seed(0)
            full = nn.Linear(12, 8)
            x, upstream = randn(5, 12), randn(5, 8, seed=1)
            x_full = x.clone().requires_grad_()
            y_full = full(x_full)
            (y_full * upstream).sum().backward()

            g_comm = counted(comm)
            row = tp.RowParallelLinear(full, g_comm)
            x_mine = mine(x, 1, comm).requires_grad_()  # this rank's input features
            y = row(x_mine)
            calls = dict(g_comm.calls)
            (y * upstream).sum().backward()
            calls = [calls, dict(g_comm.calls)]
            diff = max(largest(y, y_full), gradient_difference(row, full, comm),
                       largest(x_mine.grad, mine(x_full.grad, 1, comm)))
        assert max_everywhere(diff) < LAYER_TOLERANCE
        assert agree(comm is None or calls == [{"Allreduce": 1}] * 2)  # only g's forward communicates


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_f_and_g_issue_exactly_their_one_allreduce(size):
    with sub_comm(size) as comm:
        ok = True
        if comm is not None:
            rank, f_comm = comm.Get_rank(), counted(comm)
            every_rank = [randn(3, 4, seed=r) for r in range(size)]
            total = sum(every_rank)

            x = every_rank[0].clone().requires_grad_()
            y = tp.f.apply(x, f_comm)
            ok &= torch.equal(y, x) and not f_comm.calls  # f forward: identity, no exchange
            y.backward(every_rank[rank])
            ok &= f_comm.calls == {"Allreduce": 1} and f_comm.bytes == {"Allreduce": 3 * 4 * 4}
            ok &= largest(x.grad, total) < LAYER_TOLERANCE  # f backward: the sum over ranks

            g_comm = counted(comm)
            x = every_rank[rank].clone().requires_grad_()
            y = tp.g.apply(x, g_comm)
            ok &= g_comm.calls == {"Allreduce": 1} and g_comm.bytes == {"Allreduce": 3 * 4 * 4}
            ok &= largest(y, total) < LAYER_TOLERANCE  # g forward: the sum over ranks
            upstream = randn(3, 4, seed=9)
            y.backward(upstream)
            ok &= g_comm.calls == {"Allreduce": 1} and torch.equal(x.grad, upstream)  # g backward: identity
        assert agree(ok)


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(size):
    with sub_comm(size) as comm:
        diff, ok = 0.0, True
        if comm is not None:
            logits = 3 * randn(4, 6, tp.VOCAB)
            targets = torch.randint(tp.VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
            full = logits.clone().requires_grad_()
            reference = F.cross_entropy(full.flatten(0, 1), targets.flatten())
            reference.backward()

            # Megatron's padded vocabulary: big logits in the padding must not count.
            padded = tp.padded_vocab(size)
            with_padding = torch.cat([logits, torch.full((4, 6, padded - tp.VOCAB), 50.0)], dim=2)
            loss_comm = counted(comm)
            local = mine(with_padding, 2, comm).requires_grad_()
            loss = tp.VocabParallelCrossEntropy.apply(local, targets, loss_comm)
            ok &= loss_comm.calls == {"Allreduce": 3}  # max, target logit, sum of exp
            loss.backward()
            ok &= loss_comm.calls == {"Allreduce": 3}  # and nothing backward
            diff = max(abs(loss.item() - reference.item()),
                       largest(unshard(local.grad, (2, 1, tp.VOCAB), comm), full.grad))
            start = comm.Get_rank() * local.size(2)
            ok &= bool((local.grad[..., max(0, tp.VOCAB - start):] == 0).all())
        assert max_everywhere(diff) < LAYER_TOLERANCE
        assert agree(ok)


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_vocab_parallel_embedding_equals_nn_embedding(size):
    with sub_comm(size) as comm:
        diff = 0.0
        if comm is not None:
            torch.manual_seed(0)
            full, idx, upstream = nn.Embedding(tp.VOCAB, 6), torch.randint(tp.VOCAB, (4, 9)), randn(4, 9, 6)
            (full(idx) * upstream).sum().backward()
            embedding = tp.VocabParallelEmbedding(full, comm, tp.padded_vocab(size))
            y = embedding(idx)
            (y * upstream).sum().backward()
            diff = max(largest(y, full(idx)), gradient_difference(embedding, full, comm))
        assert max_everywhere(diff) < LAYER_TOLERANCE


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_one_block_equals_the_unsharded_block(size):
    with sub_comm(size) as comm:
        diff, calls = 0.0, []
        if comm is not None:
            torch.manual_seed(0)
            block = tp.Block(48, 12)
            with torch.no_grad():  # LayerNorms away from their identity start
                for p in block.parameters():
                    p.add_(0.1 * torch.randn(p.shape))
            x, upstream = randn(2, 16, 48), randn(2, 16, 48, seed=1)
            x_full = x.clone().requires_grad_()
            y_full = block(x_full)
            (y_full * upstream).sum().backward()

            f_comm, g_comm = counted(comm), counted(comm)
            sharded = tp.shard_block(copy.deepcopy(block), f_comm, g_comm)
            x_mine = x.clone().requires_grad_()
            y = sharded(x_mine)
            calls.append((f_comm.calls["Allreduce"], g_comm.calls["Allreduce"]))
            (y * upstream).sum().backward()
            calls.append((f_comm.calls["Allreduce"], g_comm.calls["Allreduce"]))
            diff = max(largest(y, y_full), largest(x_mine.grad, x_full.grad),
                       gradient_difference(sharded, block, comm))
        assert max_everywhere(diff) < LAYER_TOLERANCE
        # Shoeybi et al.: two allreduces forward (g), two backward (f), per block.
        assert agree(comm is None or calls == [(0, 2), (2, 2)])


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_whole_model_equals_the_unsharded_model(size):
    with sub_comm(size) as comm:
        diff, calls = 0.0, None
        if comm is not None:
            args = tp.parse_args(SMALL, size)
            x, y = tp.make_batch(args.seed, 0, args.batch_size, args.seq_len)
            plain = tp.build_model(args, CPU)
            reference = F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
            reference.backward()

            every = counted(comm)  # f, g and the loss
            sharded = tp.shard_model(tp.build_model(args, CPU), every)
            loss = tp.VocabParallelCrossEntropy.apply(sharded(x), y, every)
            loss.backward()
            calls = sum(every.calls.values())
            diff = max(abs(loss.item() - reference.item()), gradient_difference(sharded, plain, comm))
        assert max_everywhere(diff) < tp.TOLERANCE
        assert agree(comm is None or calls == 4 * 2 + 5)  # the docstring's 4L + 5, L = 2


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_training_equals_single_process_training_and_replicas_stay_identical(size):
    with sub_comm(size) as comm:
        diff, sums = 0.0, [0]
        if comm is not None:
            args = tp.parse_args(SMALL + ["--steps", "4", "--sample-chars", "0"], size)
            model, optimizer, _ = tp.sharded_model(args, comm, CPU)
            losses, _ = tp.train(args, comm, CPU, model, optimizer, comm, tp.Timeline(CPU))
            sums = comm.allgather(tp.replicated_checksum(model))
            diff = tp.check(comm, args, losses, model)  # the reference runs on rank 0 alone
        assert max_everywhere(diff) <= tp.TOLERANCE
        assert agree(len(set(sums)) == 1)  # LayerNorms, positions, biases: bitwise the same


@pytest.mark.mpi
def test_the_sample_is_a_function_of_the_seed_the_same_text_at_every_world_size():
    """Trained two steps, then 40 characters written at N = 1 to 4: one text, on every rank.
    Each rank must add its own columns' share of the noise; with one slice for all, N = 2 writes
    another text."""
    texts, ok = {}, True
    for size in SIZES:
        with sub_comm(size) as comm:
            if comm is not None:
                args = tp.parse_args(SMALL + ["--steps", "2", "--sample-chars", "40"], size)
                model, optimizer, _ = tp.sharded_model(args, comm, CPU)
                tp.train(args, comm, CPU, model, optimizer, comm, tp.Timeline(CPU))
                texts[size] = tp.generate(model, comm, args, CPU)
                ok &= len(set(comm.allgather(texts[size]))) == 1
    texts = world().bcast(texts, root=0)  # rank 0 is in every sub-communicator
    assert agree(ok), texts
    assert len(texts) == len(SIZES) and len(set(texts.values())) == 1, texts
    assert len(texts[1]) == len(tp.PROMPT) + 40 and texts[1].startswith(tp.PROMPT)


class DeviceAllocations(TorchDispatchMode):
    """Bytes of every new tensor an operation makes on one device (views and in-place ops make
    none): with the meta device as the rank's accelerator, the CPU can count what lands there."""

    def __init__(self, device):
        super().__init__()
        self.device, self.bytes = device, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func._schema.is_mutable):
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                              if isinstance(t, torch.Tensor) and t.device == self.device)
        return out


@pytest.mark.mpi
@pytest.mark.parametrize("size", [1, 4])
def test_each_rank_device_receives_its_slice_and_nothing_more(size):
    """The full model is built on the CPU; only the slice goes to the device: the bytes allocated
    there are exactly the rank's parameters (building there, then cutting, costs the full model
    and the slice)."""
    with sub_comm(size) as comm:
        allocated = held = full = 0
        if comm is not None:
            args = tp.parse_args(SMALL, size)
            meta = torch.device("meta")
            with DeviceAllocations(meta) as counter:
                model, _, full_params = tp.sharded_model(args, comm, meta)
            allocated, full = counter.bytes, 4 * full_params
            held = sum(p.numel() * p.element_size() for p in model.parameters())
            assert all(p.device == meta for p in model.parameters())
        assert agree(allocated == held and held <= full), (allocated, held, full)
        assert agree(comm is None or size == 1 or held < full / 2)


@pytest.mark.mpi
def test_check_reports_any_parameter_or_loss_nudged_past_the_tolerance(monkeypatch):
    """Negative control. The trained state is nudged by 1.5 x TOLERANCE, one parameter at a time
    (a sliced one on the last rank only, so that the gathering to rank 0 is tested too; a
    replicated one on every rank), then one loss; and one parameter is made NaN. The check must
    report more than TOLERANCE each time, and within it when nothing is nudged."""
    with sub_comm(3) as comm:  # 3 ranks: the vocabulary padded to 129, the last rank's slice odd
        failures = []
        if comm is not None:
            rank, last, nudge = comm.Get_rank(), comm.Get_size() - 1, 1.5 * tp.TOLERANCE
            args = tp.parse_args(SMALL + ["--steps", "2", "--sample-chars", "0"], 3)
            model, optimizer, _ = tp.sharded_model(args, comm, CPU)
            losses, _ = tp.train(args, comm, CPU, model, optimizer, comm, tp.Timeline(CPU))
            reference = tp.reference_training(args)
            monkeypatch.setattr(tp, "reference_training", lambda args: reference)  # train it once

            def nudged(p, value):
                """The check's report with p's first element (on the ranks that hold it) set to value."""
                element = p.detach().view(-1)[:1]
                kept = element.clone()
                if not hasattr(p, "partition") or rank == last:
                    element.fill_(value)
                report = tp.check(comm, args, losses, model)
                element.copy_(kept)
                return report

            if not tp.check(comm, args, losses, model) <= tp.TOLERANCE:
                failures.append("unperturbed")
            for name, p in model.named_parameters():
                if not nudged(p, p.detach().view(-1)[0].item() + nudge) > tp.TOLERANCE:
                    failures.append(name)
            if not tp.check(comm, args, losses[:-1] + [losses[-1] + nudge], model) > tp.TOLERANCE:
                failures.append("last loss")
            if nudged(next(model.parameters()), math.nan) <= tp.TOLERANCE:
                failures.append("NaN")
        assert agree(comm is None or not failures), failures
    with sub_comm(2) as pair:  # rank 0 alone receives the full model for the check
        full = None if pair is None else tp.gather_model(tp.sharded_model(tp.parse_args(SMALL, 2), pair, CPU)[0], pair)
        assert agree(pair is None or (full is None) == (pair.Get_rank() != 0))
        assert agree(pair is None or full is None or len(full) == 29)  # every parameter, L = 2


@pytest.mark.parametrize("argv, world, words", [
    ([], 3, ["--heads 4", "3 ranks", "1, 2, 4"]),
    (["--heads", "6", "--hidden", "48"], 4, ["--heads 6", "1, 2, 3, 6"]),
    (["--hidden", "50"], 1, ["--hidden 50", "4 heads"]),
    (["--steps", "0"], 1, ["--steps"]),
    (["--lr", "nan"], 1, ["--lr"]),
    (["--seq-len", "10000000"], 1, ["--seq-len"]),
    (["--nonsense"], 1, ["--nonsense"]),
])
def test_bad_arguments_are_rejected_with_what_would_work(argv, world, words):
    with pytest.raises(tp.ConfigError) as error:
        tp.parse_args(argv, world)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_vocabulary_is_padded_to_a_multiple_of_the_world_size():
    assert [tp.padded_vocab(n) for n in (1, 2, 3, 4, 5)] == [128, 128, 129, 128, 130]


@pytest.mark.e2e
def test_world_sizes_agree_and_pass_their_check(tmp_path):
    """N = 1, 2, 4 with the default network (a smaller batch, for time) give the same losses and
    the same sample, each within the check's tolerance."""
    runs = {}
    for n in (1, 2, 4):
        extra = ["--trace", tmp_path / "trace.json"] if n == 2 else []
        runs[n] = last_json(launch("tensor_parallel.py", n, "--steps", "5", "--sample-chars", "20",
                                   "--batch-size", "4", "--seq-len", "32", "--json", *extra))
    for n, run in runs.items():
        assert run["world_size"] == n and run["check_max_abs_diff"] <= tp.TOLERANCE
        assert run["collectives_per_step"] == run["collectives_formula"] == 4 * 4 + 5
        assert run["comm_bytes_per_step"] == run["comm_bytes_formula"]
        assert max(abs(a - b) for a, b in zip(run["losses"], runs[1]["losses"])) <= tp.TOLERANCE
        assert run["losses"][-1] < run["losses"][0]
        assert run["sample"] == runs[1]["sample"]  # the text is a function of the seed alone
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert {"forward", "backward", "optimizer", "Allreduce"} <= {e["name"] for e in spans}

    def inside(name):  # allreduces within the spans called name: g and the loss's, f's
        return [a for a in spans if a["name"] == "Allreduce" and any(
            s["name"] == name and s["ts"] <= a["ts"] and a["ts"] + a["dur"] <= s["ts"] + s["dur"] for s in spans)]
    steps, L = 5, 4  # per step: g twice a block, in the embedding, 3 for the loss; f twice a block, at the head
    assert len(inside("forward")) == steps * (2 * L + 1 + 3) and len(inside("backward")) == steps * (2 * L + 1)


@pytest.mark.e2e
def test_three_ranks_with_heads_that_three_divides_match_one_process():
    args = ["--heads", "6", "--hidden", "48", "--steps", "5", "--sample-chars", "20", "--batch-size", "4",
            "--seq-len", "32", "--json"]
    three, one = last_json(launch("tensor_parallel.py", 3, *args)), last_json(launch("tensor_parallel.py", 1, *args))
    assert three["padded_vocab"] == 129 and three["check_max_abs_diff"] <= tp.TOLERANCE
    assert max(abs(a - b) for a, b in zip(three["losses"], one["losses"])) <= tp.TOLERANCE


@pytest.mark.e2e
def test_a_nudged_parameter_fails_the_check():
    """Negative control as launched: FAIL_AT=1:2:nudge moves rank 1's first parameter by 10 x
    TOLERANCE at step 2; the check must print -> FAIL and the job exit 1."""
    result = launch("tensor_parallel.py", 2, "--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "16",
                    "--batch-size", "4", "--steps", "3", "--sample-chars", "0", env=clean_env(FAIL_AT="1:2:nudge"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "-> FAIL" in result.stdout and "Traceback" not in result.stderr, result.stdout + result.stderr


@pytest.mark.e2e
def test_heads_that_do_not_split_exit_2_with_one_line():
    assert_refused(launch("tensor_parallel.py", 3), "1, 2, 4")
