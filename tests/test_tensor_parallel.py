"""tensor_parallel.py: Megatron's pieces on sub-communicators of sizes 1 to 4, then the script as launched."""
import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tensor_parallel as tp
from harness import SIZES, agree, assert_refused, last_json, launch, max_everywhere, sub_comm

CPU = torch.device("cpu")
# One layer against nn.Linear: the same products, sums over a few dozen terms reordered across
# ranks; values are O(1), so float32 differences stay near 1e-7. Whole models and training use the
# script's own stated tolerance, tp.TOLERANCE.
LAYER_TOLERANCE = 1e-5
# Divisible by 1, 2, 3 and 4, so every world size in SIZES can split the heads.
SMALL = ["--layers", "2", "--hidden", "48", "--heads", "12", "--seq-len", "16", "--batch-size", "3"]


def exchange_on(comm):
    return tp.Exchange(comm, tp.Timeline(CPU), cuda_aware=False)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def mine(t, dim, comm, groups=1):
    """This rank's slice of a tensor, cut as the script cuts weights."""
    return tp.shard(t, dim, comm, groups).detach()


def largest(a, b):
    return (a.double() - b.double()).abs().max().item()


def gradient_difference(sharded, plain, exchange):
    """Largest difference between the gathered gradients of a sharded module and a plain one."""
    grads = tp.unshard_model(sharded, exchange, of=lambda p: p.grad)
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

            exchange = exchange_on(comm)
            column = tp.ColumnParallelLinear(full, exchange, groups)
            x_mine = x.clone().requires_grad_()
            y = column(x_mine)  # this rank's output features, with groups=3 of q, k and v each
            (y * mine(upstream, 1, comm, groups)).sum().backward()
            calls = dict(exchange.calls)
            diff = max(largest(y, mine(y_full, 1, comm, groups)),
                       largest(tp.unshard(y, (1, groups, out), exchange), y_full),
                       gradient_difference(column, full, exchange),
                       largest(x_mine.grad, x_full.grad))  # whole on every rank, thanks to f
        assert max_everywhere(diff) < LAYER_TOLERANCE
        assert agree(comm is None or calls == {"f": 1})  # only f's backward communicates


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

            exchange = exchange_on(comm)
            row = tp.RowParallelLinear(full, exchange)
            x_mine = mine(x, 1, comm).requires_grad_()  # this rank's input features
            y = row(x_mine)
            (y * upstream).sum().backward()
            calls = dict(exchange.calls)
            diff = max(largest(y, y_full), gradient_difference(row, full, exchange),
                       largest(x_mine.grad, mine(x_full.grad, 1, comm)))
        assert max_everywhere(diff) < LAYER_TOLERANCE
        assert agree(comm is None or calls == {"g": 1})  # only g's forward communicates


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_f_and_g_issue_exactly_their_one_allreduce(size):
    with sub_comm(size) as comm:
        ok = True
        if comm is not None:
            rank, exchange = comm.Get_rank(), exchange_on(comm)
            every_rank = [randn(3, 4, seed=r) for r in range(size)]
            total = sum(every_rank)

            x = every_rank[0].clone().requires_grad_()
            y = tp.f.apply(x, exchange)
            ok &= torch.equal(y, x) and not exchange.calls  # f forward: identity, no exchange
            y.backward(every_rank[rank])
            ok &= exchange.calls == {"f": 1} and exchange.bytes == {"f": 3 * 4 * 4}
            ok &= largest(x.grad, total) < LAYER_TOLERANCE  # f backward: the sum over ranks

            exchange = exchange_on(comm)
            x = every_rank[rank].clone().requires_grad_()
            y = tp.g.apply(x, exchange)
            ok &= exchange.calls == {"g": 1} and exchange.bytes == {"g": 3 * 4 * 4}
            ok &= largest(y, total) < LAYER_TOLERANCE  # g forward: the sum over ranks
            upstream = randn(3, 4, seed=9)
            y.backward(upstream)
            ok &= exchange.calls == {"g": 1} and torch.equal(x.grad, upstream)  # g backward: identity
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
            exchange = exchange_on(comm)
            local = mine(with_padding, 2, comm).requires_grad_()
            loss = tp.VocabParallelCrossEntropy.apply(local, targets, exchange)
            ok &= exchange.calls == {"cross-entropy": 3}  # max, target logit, sum of exp
            loss.backward()
            ok &= exchange.calls == {"cross-entropy": 3}  # and nothing backward
            diff = max(abs(loss.item() - reference.item()),
                       largest(tp.unshard(local.grad, (2, 1, tp.VOCAB), exchange), full.grad))
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
            exchange = exchange_on(comm)
            embedding = tp.VocabParallelEmbedding(full, exchange, tp.padded_vocab(size))
            y = embedding(idx)
            (y * upstream).sum().backward()
            diff = max(largest(y, full(idx)), gradient_difference(embedding, full, exchange))
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

            exchange = exchange_on(comm)
            sharded = tp.shard_block(copy.deepcopy(block), exchange)
            x_mine = x.clone().requires_grad_()
            y = sharded(x_mine)
            calls.append(dict(exchange.calls))
            (y * upstream).sum().backward()
            calls.append(dict(exchange.calls))
            diff = max(largest(y, y_full), largest(x_mine.grad, x_full.grad),
                       gradient_difference(sharded, block, exchange))
        assert max_everywhere(diff) < LAYER_TOLERANCE
        # Shoeybi et al.: two allreduces forward (g), two backward (f), per block.
        assert agree(comm is None or calls == [{"g": 2}, {"g": 2, "f": 2}])


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

            exchange = exchange_on(comm)
            sharded = tp.shard_model(tp.build_model(args, CPU), exchange)
            loss = tp.VocabParallelCrossEntropy.apply(sharded(x), y, exchange)
            loss.backward()
            calls = sum(exchange.calls.values())
            diff = max(abs(loss.item() - reference.item()), gradient_difference(sharded, plain, exchange))
        assert max_everywhere(diff) < tp.TOLERANCE
        assert agree(comm is None or calls == 4 * 2 + 5)  # the docstring's 4L + 5, L = 2


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_training_equals_single_process_training_and_replicas_stay_identical(size):
    with sub_comm(size) as comm:
        diff, sums = 0.0, [0]
        if comm is not None:
            args = tp.parse_args(SMALL + ["--steps", "4", "--sample-chars", "12"], size)
            exchange = exchange_on(comm)
            model, optimizer, _ = tp.setup(args, exchange, CPU)
            losses, _ = tp.train(args, comm, CPU, exchange, model, optimizer)
            sums = comm.allgather(tp.replicated_checksum(model))
            sample = tp.generate(model, exchange, args, CPU)
            samples = comm.allgather(sample)
            diff = tp.check(args, CPU, losses, tp.unshard_model(model, exchange))
        assert max_everywhere(diff) <= tp.TOLERANCE
        assert agree(len(set(sums)) == 1)  # LayerNorms, positions, biases: bitwise the same
        assert agree(comm is None or (len(set(samples)) == 1 and len(sample) == 4 + 12
                                      and sample.startswith(tp.PROMPT)))


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
    """N = 1, 2, 4 with the defaults give the same losses, each within the check's tolerance."""
    runs = {}
    for n in (1, 2, 4):
        extra = ["--trace", tmp_path / "trace.json"] if n == 2 else []
        runs[n] = last_json(launch("tensor_parallel.py", n, "--steps", "5", "--sample-chars", "20",
                                   "--json", *extra))
    for n, run in runs.items():
        assert run["world_size"] == n and run["check_max_abs_diff"] <= tp.TOLERANCE
        assert run["collectives_per_step"] == run["collectives_formula"] == 4 * 4 + 5
        assert run["comm_bytes_per_step"] == run["comm_bytes_formula"]
        assert max(abs(a - b) for a, b in zip(run["losses"], runs[1]["losses"])) <= tp.TOLERANCE
        assert run["losses"][-1] < run["losses"][0]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert {"forward", "backward", "optimizer", "f", "g", "cross-entropy"} <= \
        {e["name"] for e in trace["traceEvents"]}


@pytest.mark.e2e
def test_three_ranks_with_heads_that_three_divides_match_one_process():
    args = ["--heads", "6", "--hidden", "48", "--steps", "5", "--sample-chars", "20", "--json"]
    three, one = last_json(launch("tensor_parallel.py", 3, *args)), last_json(launch("tensor_parallel.py", 1, *args))
    assert three["padded_vocab"] == 129 and three["check_max_abs_diff"] <= tp.TOLERANCE
    assert max(abs(a - b) for a, b in zip(three["losses"], one["losses"])) <= tp.TOLERANCE


@pytest.mark.e2e
def test_heads_that_do_not_split_exit_2_with_one_line():
    assert_refused(launch("tensor_parallel.py", 3), "1, 2, 4")
