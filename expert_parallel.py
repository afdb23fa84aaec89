r"""Expert parallelism over MPI: a mixture of experts whose experts are spread over the ranks.

What is split: the experts. The MLP of every block is a mixture of E expert MLPs (--experts), and a
router sends each token to k of them (--top-k 1 or 2), so the parameters grow with E while a token's
compute stays that of k MLPs (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et
al. 2021). A batch is B sequences (--batch-size) of T characters of Python's own source; every one
of the N ranks is a data-parallel rank with its own B/N of them. --ep P groups P consecutive ranks
that share the experts out, E/P each, and the N/P groups are replicas of one another. The rest, the
dense parameters (attention, embeddings, LayerNorms, routers), is whole on every rank.

  N = 4 ranks, --ep 2, E = 4:     group 0                     group 1
                            rank 0       rank 1         rank 2       rank 3
  tokens                    x0 (B/N)     x1             x2           x3
  experts held              E0 E1        E2 E3          E0 E1        E2 E3

  --ragged, before the forward: Allreduce of the count of valid targets, all N ranks (valid_targets);
    a rank's loss: the sum over its valid targets / that count, so the gradient sums below are / 1
  one MoE layer, on every rank of a group:
    router (float32), top-k  ->  the (token, choice) pairs sorted by expert
    Alltoall    the counts: how many rows go to each expert of each rank of the group
    Alltoallv   each row to the rank that holds its expert                   (dispatch)
    each local expert runs on its rows, from every rank of the group, all at once
    Alltoallv   the outputs back, the counts swapped                         (combine)
    y = g_1 E_1(x) + g_2 E_2(x), added choice by choice in that order
  backward: the combine's exchange reversed, then the dispatch's (a row's gradient goes back to
    the rank the row came from); an expert's weight gradients stay with the expert.
  after backward: dense gradients:  Allreduce over all N ranks, / N
                  expert gradients: Allreduce over the N/P ranks holding the same expert, / N
                  the norm: Allreduce of its squares over a group, each parameter once (--clip-grad)

The router: softmax and top k in float32 (a stable sort: the lowest index wins a tie), the gates the
chosen probabilities. A near-tie can fall otherwise in one process than in N, and one token sent
elsewhere moves the run by far more than rounding: the run prints the smallest top-k gap, and
--check's one process follows the ranks' choices, its own preference held to the tolerance. Load
balance, Switch's: aux = alpha E sum_i f_i P_i, f_i the share of (token, choice) pairs choosing i
over all N ranks (an Allreduce of E counts a layer), P_i its mean probability. Capacity: dropless by
default; --capacity-factor C: at most ceil(C k n / E) pairs an expert from each rank's n tokens, the
first in token order, the rest dropped (the residual carries the token on) and counted.

Precision (--precision bf16): torch.autocast(bfloat16) around the forward and the loss, on the ranks
and in --check's one process. The parameters stay float32 (master weights): autocast casts each to
bf16 as a matmul uses it, autograd keeps that copy; gradients land in float32, optimizer state too.
Float32 also: the residual stream (so the LayerNorms), the router (autocast off: bf16 logits flip
choices), attention's softmax and the loss (.float(): on the CPU autocast leaves softmax in its
input's dtype), the gated sum. MPI buffers: the Alltoallv rows bf16 (the expert's first matmul casts
them anyway: cast first, the same bits in half the bytes), the counts int64, the gradient Allreduces
float32 (see average_gradients). fp16 would need loss scaling: not offered.

Communication per step, L blocks, n = (B/N) T tokens a rank, hidden h, d pairs dropped a rank, p = 2
bytes in bf16 else 4, r = 6 with --recompute full (the forward's two again) else 4; mean per rank:
  Alltoallv: r L (k n - d) h p bytes, a rank's own rows included (1/P of them when balanced)
  Alltoall of the counts, Allreduce of the router's counts: L E 8 bytes each (twice with full)
  Allreduce of the dense gradients (D parameters): 4 D bytes over N ranks; of the expert gradients
    (X parameters an expert): 4 (E/P) L X bytes over N/P ranks. A rank holds (E/P) L X + D in all.
  Allreduce of the norm's sum of squares: 4 bytes over P ranks (with --clip-grad; else a report)
  Allreduce of the count of valid targets: 8 bytes (float64) over N ranks (with --ragged)
Activations (saved for backward in one forward, each storage once, weights and their bf16 copies
aside), mean per rank; b = B/N, s = T, a heads, m = k n - d rows a rank's experts get on average,
float32 parts 4 bytes whatever p, indices 8:
  a block, none: 12nh (the residual twice, the router's input) + 16n (LayerNorm statistics) + 5pnh
    (inputs of qkv, proj; q k v) + s^2 (mask) + 4as^2b (softmax) [+ 2as^2b in bf16: its copy for
    x V] + 16nE + 4E (router) + 32m + 9pmh (indices; experts' inputs, GELU's) + pknh (outputs)
  selective: none less s^2 + 4as^2b [+ 2as^2b]; full: 4nh (its input). Beyond the blocks: 8bs + 8s
    + 4nh + 16n + pnh (indices, final LayerNorm, targets, head's input) + 4nV + 4 (loss, V = 128)

When to choose it: the parameters are mostly experts, too many for every device, and a group's ranks
have all-to-all bandwidth (NVLink, or a fabric built for it): each MoE layer waits on two exchanges
each way across the group. --ep 1 (data parallelism, every expert on every rank) is the baseline.

Run:  mpirun -np 4 python expert_parallel.py            (add --help for the flags)
"""
import argparse
import collections
import contextlib
import ctypes
import decimal
import errno
import fractions
import hashlib
import io
import importlib.util
import json
import math
import os
import pickle
import shutil
import signal
import statistics
import sys
import time
import traceback
import types
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
import mpi4py

mpi4py.rc.initialize = False  # MPI starts in start_mpi(), once this rank's GPU is chosen
mpi4py.rc.finalize = True  # and ends when the process does
from mpi4py import MPI  # noqa: E402

STRATEGY = "expert_parallel"
# Largest |difference| allowed against single-process training. Measured in float32: the default
# model over 50 steps with SGD 9.5e-7, 7.2e-7, 8.0e-7 (--ep 1), 4.8e-7 at N = 1 to 4, with the default recipe
# 7.2e-7 to 9.4e-7, the tests' small one 7.2e-7 (a wrong divisor: 2e-2 in 3 steps); in bf16, the recipe 2.4e-3 to
# 4.4e-3 at N = 1 to 4 on AVX-512 BF16; SGD 1.9e-3 at N = 4 on AVX2, 9.0e-3 on AVX-512 BF16, past it; the tests'
# 4.0e-4 at most. AdamW amplifies rounding (m/sqrt(v)): --lr 1e-2 past it from step 30, N = 1 too: 1.3e-3
TOLERANCE, TOLERANCE_BF16 = 2e-5, 5e-3
POLL_S = 1e-4  # a rank waiting on MPI sleeps between polls, leaving the core to those that compute
VOCAB = 128  # the ASCII codes
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text


# -----------------------------------------------------------------------------
# The strategy: the router, the exchange of tokens (dispatch and combine), the gradients' sums
# -----------------------------------------------------------------------------
def route(tokens, router, top_k):
    """The router in float32: every expert's probability for each token, the top_k experts of each
    token by a stable sort (the lowest index wins a tie), their probabilities as the gates, and the
    smallest gap between a token's k-th and (k+1)-th probability."""
    with torch.autocast(tokens.device.type, enabled=False):  # bf16 rounding would flip choices
        probs = F.linear(tokens.float(), router.weight.float()).softmax(dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    return probs, order[:, :top_k], ranked[:, :top_k], (ranked[:, top_k - 1] - ranked[:, top_k]).detach().min()

def load_balancing_loss(probs, choice, num_experts, coef, comm):
    """Switch's alpha E sum_i f_i P_i, f the shares of all ranks' (token, choice) pairs (one
    Allreduce of E counts: a mean of the ranks' products f_i P_i is not the product of the means), P
    from this rank's tokens (train_step takes its mean over the ranks). Every token counts, padding
    too (--ragged): it passes through the router, in --check's one process alike. Balanced routing
    gives alpha, whatever k; GShard takes (1/E) sum_i f_i P_i, f of first choices; Mixtral's (as
    Hugging Face's transformers computes it) is k times this. Returns the loss, all ranks' counts."""
    counts = torch.bincount(choice.reshape(-1), minlength=num_experts)
    if comm is not None:
        buffer = mpi_buffer(counts)
        comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        from_mpi(counts, buffer)
    share = counts / counts.sum()  # f_i: no gradient flows through a count
    return coef * num_experts * (share * probs.mean(dim=0)).sum(), counts

def expert_capacity(capacity_factor, top_k, n, num_experts):
    """ceil(C k n / E) pairs per expert from one rank's n tokens, exactly (C as the decimal the user
    wrote: 1.1 x 90 / 3 is 33, in floats 33.00000000000001); None (dropless) without one."""
    if capacity_factor is None:
        return None
    return math.ceil(fractions.Fraction(repr(capacity_factor)) * top_k * n / num_experts)

def within_capacity(choice, num_experts, capacity):
    """Which (token, choice) pairs their expert takes: at most `capacity`, the first in token order
    (a token's choices in their order); all of them if capacity is None."""
    if capacity is None:
        return torch.ones_like(choice, dtype=torch.bool)
    pairs = choice.reshape(-1)  # token t's choice c is pair t k + c
    before = F.one_hot(pairs, num_experts).cumsum(0).gather(1, pairs.unsqueeze(1)).squeeze(1) - 1
    return (before < capacity).view_as(choice)  # before: the earlier pairs for the same expert

def all_to_all(rows, send_rows, recv_rows, comm):
    """MPI_Alltoallv of the rows of a matrix: send_rows[j] consecutive rows to rank j, in rank
    order; recv_rows[i] rows from rank i, in rank order. In bytes: MPI has no bfloat16."""
    out = rows.new_empty(sum(recv_rows), rows.size(1))
    send, recv = mpi_buffer(rows.detach().contiguous()), receive_buffer(out)
    counts = [[r * rows.size(1) * rows.element_size() for r in numbers] for numbers in (send_rows, recv_rows)]
    offsets = [[sum(c[:j]) for j in range(len(c))] for c in counts]
    comm.Alltoallv([send, (counts[0], offsets[0]), MPI.BYTE], [recv, (counts[1], offsets[1]), MPI.BYTE])
    return from_mpi(out, recv)

class AllToAll(torch.autograd.Function):
    """The exchange of rows, and its backward: the same exchange reversed, each row's gradient
    sent back to the rank the row came from (the counts swapped)."""

    @staticmethod
    def forward(ctx, rows, send_rows, recv_rows, comm):
        ctx.reverse = (recv_rows, send_rows, comm)
        return all_to_all(rows, send_rows, recv_rows, comm)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, *ctx.reverse), None, None, None

def dispatch_and_run(tokens, choice, keep, experts, comm):
    """Each kept (token, choice) pair's row through its expert, on whichever rank of comm holds it.
    experts: this rank's E/P, rank j holding experts j E/P to (j+1) E/P - 1. Returns n k x h: the
    output of each pair, zero for a dropped one."""
    size, local, k = comm.Get_size(), len(experts), choice.size(1)
    pairs = keep.reshape(-1).nonzero().squeeze(1)  # token t's choice c is pair t k + c
    wanted = choice.reshape(-1)[pairs]
    pairs = pairs[wanted.sort(stable=True).indices]  # by expert; in token order within one
    sent = torch.bincount(wanted, minlength=size * local)  # rows for each expert, in expert order
    received = torch.empty_like(sent)  # from rank i for my expert l: at i local + l
    send, recv = mpi_buffer(sent), receive_buffer(received)
    comm.Alltoall(send, recv)  # each rank gets the counts of its own experts from every rank
    from_mpi(received, recv)
    send_rows, recv_rows = sent.view(size, local).sum(1).tolist(), received.view(size, local).sum(1).tolist()
    rows = tokens[pairs // k]
    if torch.is_autocast_enabled(rows.device.type):  # bf16: the expert's first matmul would cast
        rows = rows.to(torch.get_autocast_dtype(rows.device.type))  # cast first: half the bytes
    rows = AllToAll.apply(rows, send_rows, recv_rows, comm)  # dispatch
    # The rows arrive by source rank, within one by expert: regroup them expert by expert, run each
    # expert once on all its rows, and put the outputs back in the order of arrival. A toy: 2 ranks,
    # experts 0 1 on rank 0 and 2 3 on rank 1, top-1, 3 tokens a rank. Rank 0's tokens a b c choose
    # 2 0 3: by expert b a c, sent [1 0 1 1] (b to rank 0, a c to rank 1); rank 1's d e f choose
    # 1 2 0: f d e, sent [1 1 1 0]. Rank 1 receives a c, then its own e: received [1 1 1 0];
    # by_expert reorders them a e | c, expert 2 runs on a e and 3 on c, the argsort puts the outputs
    # back as a c e, and the combine returns a c to rank 0. Rank 0 gets back b, a c, the order they
    # left in: index_put puts each output at its pair (b is 1, a 0, c 2), zero for a dropped one.
    pieces = torch.arange(len(rows), device=rows.device).split(received.tolist())
    by_expert = torch.cat([pieces[i * local + e] for e in range(local) for i in range(size)])
    sizes = received.view(size, local).sum(0).tolist()
    out = torch.cat([expert(x) for expert, x in zip(experts, rows[by_expert].split(sizes))])
    out = AllToAll.apply(out[by_expert.argsort()], recv_rows, send_rows, comm)  # combine
    return out.new_zeros(choice.numel(), tokens.size(1)).index_put((pairs,), out)  # (index_copy would save out)

def average_gradients(model, comm, replica_comm, divisor):
    """After backward: the dense gradients summed over all N ranks, each expert's over the N/P ranks
    that hold it, both / divisor: N, or 1 with --ragged (each rank's loss its share of the step's).
    Why N, not N/P: the step's loss is the mean of the N ranks' losses; with N = 4, P = 2, expert
    E0's copies on ranks 0 and 2 get the gradients of ranks 0 and 1's tokens and of 2 and 3's: their
    sum holds all 4 losses' terms, the mean's gradient is sum / 4, while / (N/P) would step the
    experts P times too far, with no error. Float32 in bf16 too (Megatron's default): MPI has no
    bfloat16 arithmetic (MPICH refuses MPI.SUM on it); bf16 gradients would halve the bytes and
    their memory, and lose small contributions summed into large ones."""
    experts = expert_parameters(model)
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]
    for params, over in ((dense, comm), (experts, replica_comm)):
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # float32, in bf16 too: see above
        buffer = mpi_buffer(flat)
        over.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        for p, grad in zip(params, (from_mpi(flat, buffer) / divisor).split([p.numel() for p in params])):
            p.grad.copy_(grad.view_as(p))

def global_grad_norm(model, ep_comm):
    """After average_gradients: the whole model's gradient norm, each parameter once. A group's P
    ranks hold the model once (the dense part whole on each, each expert on one): its rank 0 adds
    the dense squares, each rank its experts', one Allreduce over ep_comm sums them. Over all N
    ranks the dense part would count N times, an expert N/P (its replicas hold equal gradients
    after the average). Every group sums the same float32 numbers in the same order: one norm."""
    experts = expert_parameters(model)
    dense = [p for p in model.parameters() if all(p is not e for e in experts)] if ep_comm.Get_rank() == 0 else []
    squares = torch.stack([p.grad.square().sum() for p in dense + experts]).sum().reshape(1)
    buffer = mpi_buffer(squares)
    ep_comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
    return from_mpi(squares, buffer).sqrt()[0]

def expert_groups(comm, ep):
    """Two splits of comm: the ep consecutive ranks that share the experts out (the tokens'
    exchange), and the N/ep ranks, one a group, that hold the same experts (their gradients)."""
    rank = comm.Get_rank()
    return comm.Split(rank // ep, rank), comm.Split(rank % ep, rank)

def expert_parallel(model, ep_comm, stats_comm):
    """Keep this rank's E/P experts of every MoE layer, in place (named as in the whole model);
    the layers exchange tokens over ep_comm and count the router's choices over stats_comm."""
    size, rank = ep_comm.Get_size(), ep_comm.Get_rank()
    for moe in moe_layers(model):
        per = moe.num_experts // size
        moe.experts = nn.ModuleDict({str(e): moe.experts[e] for e in range(rank * per, (rank + 1) * per)})
        moe.ep_comm, moe.stats_comm = ep_comm, stats_comm
    return model

def valid_targets(y, comm):
    """--ragged: the step's targets that are not IGNORE, over the N ranks (each holds other
    sequences): one Allreduce of a number, before the forward. A per-rank mean, averaged, would
    weigh each target of a rank holding fewer valid targets more: a gradient no process computes."""
    count = torch.tensor([(y != IGNORE).sum().item()], dtype=torch.float64)
    comm.Allreduce(MPI.IN_PLACE, count, op=MPI.SUM)  # host memory
    return count.item()

def train_step(model, optimizer, x, y, comm, replica_comm, norm_comm, lr, max_norm, timeline, meter, bf16, count):
    """One step on this rank's slice of the batch (bf16: autocast, see the docstring), the forward
    measured by meter, gradients clipped to max_norm (0: not), at lr; count: the step's valid
    targets (--ragged; else None). Returns this rank's loss (--ragged: its share), its norm."""
    optimizer.zero_grad(set_to_none=False)
    with timeline.span("compute", "forward"), meter, torch.autocast(x.device.type, torch.bfloat16, enabled=bf16):
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE,
                               reduction="mean" if count is None else "sum")
        aux = sum(m.aux for m in moe_layers(model))  # the blocks' load-balancing losses
        # --ragged: its share of the step's loss, aux / N (the ranks' mean: the gradients' sums are not / N)
        loss = loss + aux if count is None else loss / count + aux / comm.Get_size()
    with timeline.span("compute", "backward"):
        loss.backward()
    average_gradients(model, comm, replica_comm, comm.Get_size() if count is None else 1)
    with timeline.span("compute", "optimizer"):
        norm = global_grad_norm(model, norm_comm)
        scale = max_norm / (norm + 1e-6) if max_norm else 1.0  # clip_grad_norm_'s rule, in float32
        for p in model.parameters() if scale < 1 else []:
            p.grad.mul_(scale)  # the same scale on every rank: the same norm
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    return loss.item(), norm.item()


# -----------------------------------------------------------------------------
# Staging: the buffer each MPI call above is handed (on the CPU, the tensor itself)
# -----------------------------------------------------------------------------
# On a GPU: MPI reads GPU memory only when the library is CUDA-aware (found at start-up by
# setup()). Otherwise a tensor on a GPU travels through a host copy. On the CPU these do nothing.
CUDA_AWARE = False

def mpi_buffer(t):
    """The buffer to hand MPI for t: t itself, or a pinned host copy (every call here blocks)."""
    if not t.is_cuda:
        return t
    if CUDA_AWARE:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the kernels that write t must finish first (not the whole device)
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)  # waits for t's kernels

def receive_buffer(t):
    """Where a receive for t lands: an empty pinned host buffer (nothing to copy in), or t itself
    once kernels queued before are done: they may still read it (memory the allocator reuses)."""
    if t.is_cuda and not CUDA_AWARE:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return mpi_buffer(t)  # on a GPU, t after an event: MPI may write it from the moment it has it

def from_mpi(t, buffer):
    """Copy back: what MPI wrote into the host copy of t goes into t; returns t."""
    return t if buffer is t else t.copy_(buffer)


# -----------------------------------------------------------------------------
# The model: tensor_parallel.py's GPT, each block's MLP a mixture of experts
# -----------------------------------------------------------------------------
class Expert(nn.Module):
    """One expert: the block's MLP of a dense GPT, h -> 4h -> h with GELU."""

    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

class MoE(nn.Module):
    """A router and E experts: y = sum over a token's top-k experts of gate x expert(x), added in
    the order of the choices. expert_parallel() gives it its experts' ranks (ep_comm) and the ranks
    whose choices the load-balancing loss counts (stats_comm); --check's is written apart."""

    def __init__(self, hidden, num_experts, top_k, aux_coef, capacity_factor):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden) for _ in range(num_experts))
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_coef, self.capacity_factor = aux_coef, capacity_factor
        self.ep_comm = self.stats_comm = self.aux = None  # aux: the last load-balancing loss (Block sets it)
        # For the report and --check: last forward's load, choices, kept pairs, top-k gap (tally())
        self.load = self.choice = self.keep = self.gap = self.first_load = None
        self.register_buffer("dropped", torch.tensor(0), persistent=False)
        self.register_buffer("min_gap", torch.tensor(math.inf), persistent=False)

    def forward(self, x):
        tokens = x.reshape(-1, x.size(-1))
        probs, choice, gate, gap = route(tokens, self.router, self.top_k)
        capacity = expert_capacity(self.capacity_factor, self.top_k, len(tokens), self.num_experts)
        keep = within_capacity(choice, self.num_experts, capacity)
        aux, self.load = load_balancing_loss(probs, choice, self.num_experts, self.aux_coef, self.stats_comm)
        outputs = dispatch_and_run(tokens, choice, keep, list(self.experts.values()), self.ep_comm)
        outputs, gate = outputs.view(*choice.shape, -1), gate.unsqueeze(-1)
        y = gate[:, 0] * outputs[:, 0]  # float32 gates: the sum is float32 in bf16 too
        for c in range(1, self.top_k):  # the fixed order of the sum
            y = y + gate[:, c] * outputs[:, c]
        self.choice, self.keep, self.gap = choice, keep, gap  # for the report and --check
        return y.view_as(x), aux

def tally(block, inputs, output):
    """After a block's forward (once a step: a recomputation reruns Block.body alone), for the
    report and --check: the pairs dropped, the smallest top-k gap, the first load, the choices."""
    moe = block.moe
    moe.dropped, moe.min_gap = moe.dropped + (~moe.keep).sum(), torch.minimum(moe.min_gap, moe.gap)
    moe.first_load = moe.load if moe.first_load is None else moe.first_load
    if moe.written is not None:
        moe.written.append(moe.choice)

def attention_core(q, k, v):
    """Scores, causal mask, softmax (float32), times V: the part whose activations grow with the
    sequence squared, which --recompute selective runs again in backward from q, k, v."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    future = torch.ones(q.size(2), q.size(2), dtype=torch.bool, device=q.device).triu(1)
    return scores.float().masked_fill(future, float("-inf")).softmax(dim=-1) @ v

def attend(qkv, heads, selective):
    """Causal self-attention of `heads` heads, from queries, keys and values side by side."""
    b, t, c = qkv.size(0), qkv.size(1), qkv.size(2) // 3
    q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in qkv.split(c, dim=2))
    out = checkpoint(attention_core, q, k, v, use_reentrant=True) if selective else attention_core(q, k, v)
    return out.transpose(1, 2).reshape(b, t, c)

class Block(nn.Module):
    """Pre-LayerNorm decoder block whose MLP is a mixture of experts. Recomputation (--recompute):
    torch.utils.checkpoint(fn, *inputs, use_reentrant=True) keeps fn's inputs by save_for_backward
    (where the saved-tensor hooks that measure activations see them, unlike the non-reentrant form),
    runs fn without autograd, and in backward reruns it in the forward's autocast state. full: each
    block from its input; its exchanges (router Allreduce, counts Alltoall, dispatch, combine) run
    again in backward. selective: attention's core (scores, mask, softmax, x V) from q, k, v."""

    def __init__(self, args):
        super().__init__()
        self.heads, h = args.heads, args.hidden
        self.ln1, self.qkv, self.proj, self.ln2 = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h), nn.LayerNorm(h)
        self.moe = MoE(h, args.experts, args.top_k, args.aux_loss_coef, args.capacity_factor)
        self.recompute = "none"  # expert_parallel_model() sets it; --check's one process keeps none

    def forward(self, x):  # full: only x is kept; body() runs again in backward, exchanges too
        x, self.moe.aux = checkpoint(self.body, x, use_reentrant=True) if self.recompute == "full" else self.body(x)
        return x

    def body(self, x):
        x = x + self.proj(attend(self.qkv(self.ln1(x)), self.heads, self.recompute == "selective"))
        y, aux = self.moe(self.ln2(x))
        return x + y, aux

class GPT(nn.Module):
    """Token and position embeddings, --layers blocks, final LayerNorm, untied head."""

    def __init__(self, args):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, args.hidden), nn.Embedding(args.seq_len, args.hidden)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.layers))
        self.norm, self.out = nn.LayerNorm(args.hidden), nn.Linear(args.hidden, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))

def build_model(args):
    """The whole model from the seed on the CPU, the same at every world size: GPT-2's init, but
    the embeddings at std 1 (PyTorch's own default for them), for the router's sake."""
    torch.manual_seed(args.seed)
    model = GPT(args)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=1.0 if isinstance(m, nn.Embedding) else 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    # Why std 1: at GPT-2's 0.02 a token's own part of the residual (norm near 0.2) fell behind what one
    # SGD step adds alike to every token (the biases, attention's average: near 0.4), so every router saw
    # nearly one input and the busiest expert took E/k = 2.00 times an even share on every block from the
    # second step (a small router, Switch's init, keeps the top k). At std 1: 1.10 to 1.31 times on the
    # first step, 1.03 to 1.11 on the last (the default run).
    return model

def moe_layers(model):
    return [block.moe for block in model.blocks]

def expert_parameters(model):
    """This rank's expert parameters: layer by layer, expert by expert."""
    return [p for moe in moe_layers(model) for p in moe.experts.parameters()]

def make_optimizer(model, args):
    """SGD with momentum 0.9, or AdamW (betas 0.9 0.95, weight decay 0.1 on every parameter, float32
    moments); every gradient there from the start: an expert that got no token in a step still takes
    its step, on the ranks and in the reference alike."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

def expert_parallel_model(args, ep_comm, stats_comm, device):
    """The whole model from the seed on the CPU; each rank keeps its experts and moves only its
    part to its device. Returns it and its optimizer."""
    model = expert_parallel(build_model(args), ep_comm, stats_comm).to(device)
    for block in model.blocks:  # --check: the choices of every step, for one process to follow
        block.recompute, block.moe.written = args.recompute, [] if args.check else None
        block.register_forward_hook(tally)
    return model, make_optimizer(model, args)

def checksums(model):
    """Bitwise fingerprints of the dense parameters and of this rank's experts."""
    experts = {id(p) for p in expert_parameters(model)}
    parts = [[p for p in model.parameters() if (id(p) in experts) == kind] for kind in (False, True)]
    return [zlib.crc32(b"".join(p.detach().cpu().contiguous().numpy().tobytes() for p in ps)) for ps in parts]


# -----------------------------------------------------------------------------
# The data: characters of Python's own source, batches a function of (seed, step)
# -----------------------------------------------------------------------------
_TEXT = []
IGNORE = -100  # --ragged: the target past a document's end (F.cross_entropy's ignore_index)

def load_text():
    """argparse.py, textwrap.py and shlex.py from this Python, bytes >= 128 replaced by '?'."""
    if not _TEXT:
        raw = b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in SOURCES)
        _TEXT.append(torch.tensor([b if b < 128 else ord("?") for b in raw], dtype=torch.long))
    return _TEXT[0]

def make_batch(seed, step, size, seq_len, ragged=False):
    """The global batch of one step: inputs and next-character targets, from (seed, step) alone.
    ragged: a document of 1 to T characters a sequence; past it, targets IGNORE and inputs 0."""
    data = load_text()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - seq_len - 1, (size,), generator=gen).tolist()
    x = torch.stack([data[o:o + seq_len] for o in starts])
    y = torch.stack([data[o + 1:o + seq_len + 1] for o in starts])
    if ragged:  # drawn after the starts: without it, the batch is what it always was
        past = torch.arange(seq_len) >= torch.randint(1, seq_len + 1, (size, 1), generator=gen)
        x, y = x.masked_fill(past, 0), y.masked_fill(past, IGNORE)
    return x, y


# -----------------------------------------------------------------------------
# The run: the step loop, and main() as a table of contents
# -----------------------------------------------------------------------------
def learning_rate(args, step):
    """The learning rate of step (from 0): linear warm-up over --warmup-steps W, then constant, or a
    cosine from lr towards lr / 10 at --steps. A function of the step alone (a resume continues it)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    done = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)  # 0 to 1
    cosine = args.lr / 10 + 0.5 * (args.lr - args.lr / 10) * (1 + math.cos(math.pi * done))
    return args.lr if args.lr_schedule == "constant" else cosine

def train(args, comm, device, model, optimizer, counted, timeline, meter, past=(), world_sizes=(), past_norms=()):
    """The steps after the `past` ones (global losses, world sizes, norms: from a checkpoint), each
    forward's saved activations measured by meter. Returns its new losses, norms, timings."""
    rank, world_size = comm.Get_rank(), comm.Get_size()
    per = args.batch_size // world_size
    norm_comm = counted["norm"] if args.clip_grad else counted["norm"].comm  # no clip: a report, not counted
    losses, norms, records = [], [], []
    for step in range(len(past), args.steps):
        start = time.perf_counter()
        batch = make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged)
        x, y = (t[rank * per:(rank + 1) * per].to(device, copy=True) for t in batch)  # a view would keep the batch
        count = valid_targets(y, counted["count"]) if args.ragged else None  # None: all valid
        loss, norm = train_step(model, optimizer, x, y, counted["dense"], counted["experts"], norm_comm,
                                learning_rate(args, step), args.clip_grad, timeline, meter,
                                args.precision == "bf16", count)
        losses.append(loss), norms.append(norm), records.append(timeline.step_record(start))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print_progress(comm, args, step, global_losses(comm, losses[-1:], args.ragged)[0], records[-1], norm)
        checkpoint_if_due(comm, args, step, lambda: expert_parallel_shard(
            comm, args, model, optimizer, list(past) + global_losses(comm, losses, args.ragged),
            list(world_sizes) + [world_size] * len(losses), list(past_norms) + norms), model_config(args))
    return losses, norms, records

def global_losses(comm, losses, ragged=False):
    """Every rank's loss is that of its slice; the step's is their mean (--ragged: their sum)."""
    total = torch.tensor(losses, dtype=torch.float64)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)  # a record, not counted
    return (total if ragged else total / comm.Get_size()).tolist()

def main(argv=None, comm=MPI.COMM_WORLD):
    """Parse, set up, train, check, report. Returns the exit status of this rank."""
    try:
        args = parse_args(argv, comm.Get_size())
        check_paths(comm, args)
        run = setup(comm, args)
        ep_comm, replica_comm = expert_groups(comm, args.ep)
        over = {"all-to-all": ep_comm, "router": comm, "dense": comm, "experts": replica_comm, "norm": ep_comm,
                "count": comm}  # each kind of exchange, counted apart
        counted = {kind: CountedComm(on, run.timeline) for kind, on in over.items()}
        model, optimizer = expert_parallel_model(args, counted["all-to-all"], counted["router"], run.device)
        past, world_sizes, past_norms, resumed = [], [], [], None
        if args.resume:  # this rank's blocks on this grid, whatever grid wrote them
            resumed, blocks = load_checkpoint(comm, args.save, model_config(args), held_here(model, args), args.steps)
            if blocks is not None:
                past, world_sizes, past_norms = restore(model, optimizer, resumed, blocks)
        print_header(comm, args, run, model, resumed)
        run.memory.reset()  # the peak of training alone: not the model's building, nor the check
        losses, norms, records = train(args, comm, run.device, model, optimizer, counted, run.timeline,
                                       activations := SavedActivations(), past, world_sizes, past_norms)
        run.memory.stop()
    except ConfigError as e:
        print0(comm, f"error: {e}", file=sys.stderr)
        return e.status
    losses, norms = past + global_losses(comm, losses, args.ragged), past_norms + norms
    dense, experts = checksums(model)
    if len(set(comm.allgather(dense))) != 1 or len(set(replica_comm.allgather(experts))) != 1:
        raise RuntimeError("replicas diverged: the dense parameters or an expert's copies differ")
    world_sizes += [comm.Get_size()] * (args.steps - len(world_sizes))
    diff, reference = check(comm, args, losses, norms, model, world_sizes) if args.check else (None, None)
    if args.trace:
        write_trace(comm, run.timeline, args.trace)
    return report(comm, args, run, model, losses, norms, records, counted, diff, reference,
                  sum(activations.storages.values()))


# =============================================================================
# You may stop reading here: the strategy is all above. Below, first this file's own machinery
# (the check against single-process training, the report, its arguments and checkpoints), then
# the machinery that every strategy file repeats word for word: the summary, checkpoints and
# signals, counters, timeline and memory, device and MPI setup, arguments.
# =============================================================================

# --- This file's own: the check against single-process training, the report, arguments, checkpoints
# What the reference shares with the ranks: build_model (the GPT, its attention and Expert MLPs, the
# weights from the seed), make_batch (with --ragged, its IGNORE targets: the loss is its own
# F.cross_entropy over them) and make_optimizer (torch's SGD or AdamW). Harmless: the ranks hold
# these whole or as copies of the same modules, with no exchange in them. The mixture itself (routing,
# capacity, the load-balancing loss, the combine) it writes apart in reference_moe, so that a bug on
# either side shows: its own top k by argmax, capacity counted pair by pair, every expert run on every
# token and weighted by a matrix of gates, the load-balancing loss from its definition. It takes the
# ranks' choices rather than its own, and keeps by how much its own probabilities preferred others (0
# when they agree): a near-tie may fall the other way after float32 rounding, and one flipped token would
# move the run by far more than rounding; the check counts that preference against its tolerance, so a
# routing error still fails it. The recipe's schedule it writes apart too, and it clips with torch's
# clip_grad_norm_, whose return value is its norm (the check compares the norms).
def reference_training(args, world_sizes, choices=None, device=torch.device("cpu")):
    """The same steps in one process holding every expert, on device (rank 0's); world_sizes: the ranks of each step (a capacity
    is per rank's tokens); choices: each block's ranks' choices by step, which it follows. Returns losses, norms, model."""
    model = build_model(args).to(device)
    for moe, followed in zip(moe_layers(model), choices or [None] * args.layers):
        moe.followed, moe.differed, moe.disagreement = iter(followed or []), 0, 0.0
        moe.forward = lambda x, moe=moe: reference_moe(moe, x, moe.slices)
    optimizer, losses, norms, W = make_optimizer(model, args), [], [], args.warmup_steps
    for step in range(args.steps):
        for moe in moe_layers(model):
            moe.slices = world_sizes[step]
        x, y = (t.to(device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged))
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16"):  # as the ranks; the mean over valid targets
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE) + sum(m.aux for m in moe_layers(model))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or math.inf).item())
        cosine = args.lr * (0.55 + 0.45 * math.cos(math.pi * max(0, step - W) / max(1, args.steps - W)))  # lr/10 up to lr
        optimizer.param_groups[0]["lr"] = (cosine if args.lr_schedule == "cosine" else args.lr) * min(1, (step + 1) / max(1, W))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, model

def gather_model(model, comm):
    """The whole model {name: tensor} on rank 0's CPU (None elsewhere): the first group's rank j sends its experts."""
    flat = torch.cat([p.detach().reshape(-1) for p in expert_parameters(model)]).cpu()
    every = flat.new_empty(comm.Get_size(), flat.numel()) if comm.Get_rank() == 0 else None
    comm.Gather(flat, every, root=0)
    if comm.Get_rank() != 0:
        return None
    full = {name: p.detach().cpu() for name, p in model.named_parameters() if ".experts." not in name}
    mine = [(name, p) for name, p in model.named_parameters() if ".experts." in name]  # as expert_parameters()
    per = len(moe_layers(model)[0].experts)  # rank j of the first group holds experts j per to (j + 1) per - 1
    for j in range(moe_layers(model)[0].num_experts // per):
        for (name, p), piece in zip(mine, every[j].split([p.numel() for _, p in mine])):
            block, (e, rest) = name.split(".experts.")[0], name.split(".experts.")[1].split(".", 1)
            full[f"{block}.experts.{int(e) + j * per}.{rest}"] = piece.view_as(p)
    return full

def reference_moe(moe, x, slices):
    """The mixture of experts of one process holding them all, written apart from MoE.forward and
    following the ranks' choices (see the comment above reference_training)."""
    tokens, E, k = x.reshape(-1, x.size(-1)), moe.num_experts, moe.top_k
    with torch.autocast(x.device.type, enabled=False):  # the router in float32, as the ranks'
        probs = torch.softmax(tokens.float() @ moe.router.weight.T, dim=1)
    own, left = [], probs.detach().clone()
    for _ in range(k):  # the largest probability left; argmax takes the lowest index of a tie
        own.append(left.argmax(dim=1))
        left[torch.arange(len(left), device=left.device), own[-1]] = -1.0
    own = torch.stack(own, dim=1)
    choice = own if (followed := next(moe.followed, None)) is None else followed.to(own.device)  # None: before a resume
    preferred = (probs.gather(1, own).sum(1) - probs.gather(1, choice).sum(1)).detach().abs()
    moe.differed, moe.disagreement = moe.differed + int((preferred > 0).sum()), max(moe.disagreement, preferred.max().item())
    n = len(tokens) // slices  # each rank's tokens fill every expert's capacity on their own
    capacity = math.ceil(decimal.Decimal(repr(moe.capacity_factor)) * k * n / E) if moe.capacity_factor else math.inf
    keep, taken = [], collections.Counter()  # (rank, expert): the pairs it was given so far from that rank
    for pair, e in enumerate(choice.reshape(-1).tolist()):  # in token order, a token's choices in their order
        taken[pair // (n * k), e] += 1
        keep.append(taken[pair // (n * k), e] <= capacity)
    keep = torch.tensor(keep, device=x.device).view(-1, k)
    moe.dropped = moe.dropped + (~keep).sum()
    gates = sum(F.one_hot(choice[:, c], E) * probs.gather(1, choice[:, c:c + 1]) * keep[:, c:c + 1] for c in range(k))
    y = sum(gates[:, e:e + 1] * expert(tokens) for e, expert in enumerate(moe.experts))
    share = [(choice == e).sum().item() / choice.numel() for e in range(E)]  # f_e, before capacity
    return y.view_as(x), moe.aux_coef * E * sum(share[e] * probs[:, e].mean() for e in range(E))

def gather_choices(model, comm, steps):
    """[block][step]: all ranks' choices, rank by rank, on rank 0 (None elsewhere, and before a resume)."""
    written = torch.stack([torch.stack(moe.written) for moe in moe_layers(model)]).cpu()  # L x S x n x k
    every = written.new_empty(comm.Get_size(), *written.shape) if comm.Get_rank() == 0 else None
    comm.Gather(written, every, root=0)
    return None if every is None else [[None] * (steps - every.size(2)) + list(every[:, block].transpose(0, 1).flatten(1, 2))
                                       for block in range(every.size(1))]

def check(comm, args, losses, norms, model, world_sizes=None):
    """Rank 0 gathers the model and the choices and trains the reference on its device (world_sizes: the
    ranks of each step, before a resume too); the others wait without spinning. All get the largest
    difference (losses, gradient norms, parameters, routing) and its counts, the norms' difference last."""
    full, choices, diff, counts = gather_model(model, comm), gather_choices(model, comm, args.steps), None, None
    if comm.Get_rank() == 0:
        steps, device = world_sizes or [comm.Get_size()] * args.steps, next(model.parameters()).device  # rank 0's
        ref_losses, ref_norms, ref_model = reference_training(args, steps, choices, device)
        moes, norm_diff = moe_layers(ref_model), max_difference(norms, {}, ref_norms, ref_model)
        diff = max(max_difference(losses, full, ref_losses, ref_model), norm_diff, *(m.disagreement for m in moes))
        counts = (int(sum(m.dropped for m in moes)), sum(m.differed for m in moes), max(m.disagreement for m in moes), norm_diff)
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)
    return comm.bcast((diff, counts), root=0)

class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Around a forward: the distinct storages autograd saves for backward, parameters and autocast's bf16
    copies (ToCopyBackward0 of a parameter's AccumulateGrad, or its transpose) left out."""

    def __init__(self):
        super().__init__(self.pack, lambda t: t)

    def __enter__(self):
        self.storages = {}
        return super().__enter__()

    def pack(self, t):
        source = t.grad_fn
        while source is not None and source.name() in ("TBackward0", "ToCopyBackward0"):
            source = source.next_functions[0][0]
        if not (t.is_leaf and t.requires_grad or source is not None and source.name().endswith("AccumulateGrad")):
            self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

def print_header(comm, args, run, model, resumed):
    N, P, E, L, B, T = comm.Get_size(), args.ep, args.experts, args.layers, args.batch_size, args.seq_len
    dense = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in expert_parameters(model))
    one, C = sum(p.numel() for p in next(iter(moe_layers(model)[0].experts.values())).parameters()), args.capacity_factor
    print0(comm, *([f"resumed from {args.save} at step {resumed['step']} (written by {resumed['world_size']} ranks), --ep "
                    f"{resumed['state']['ep']} then, --ep {P} now"] if resumed else []),
           *run.header, f"model: GPT, {L} blocks, hidden {args.hidden}, {args.heads} heads, each block's MLP {E} experts, "
           f"top-{args.top_k}: {dense + L * E * one:,} parameters, {dense:,} of them dense, {one:,} an expert",
           f"--ep {P}: {N // P} group(s) of {P} consecutive ranks, {E // P} expert(s) of every block on each rank (rank j of a "
           f"group: j x {E // P} to j x {E // P} + {E // P - 1}), each expert on {N // P} rank(s)",
           f"batch {B} x {T} characters{f' (--ragged: documents of 1 to {T})' * args.ragged}, {B // N} sequences per rank | "
           + ("dropless" if C is None else f"capacity factor {C:g}: at most {expert_capacity(C, args.top_k, B // N * T, E)} pairs per expert from each rank")
           + f" | {args.optimizer}, lr {args.lr:g} {args.lr_schedule} after {args.warmup_steps} warm-up step(s), gradient norm "
           + (f"clipped to {args.clip_grad:g}" if args.clip_grad else "not clipped")
           + f" | load-balancing coefficient {args.aux_loss_coef:g} | text: {' + '.join(s + '.py' for s in SOURCES)} of Python "
           f"{sys.version.split()[0]} ({len(load_text()):,} characters) | vocabulary {VOCAB} ASCII codes")

def report(comm, args, run, model, losses, norms, records, counted, diff, reference, activations):
    """The summary (bytes beside their formulas, memory, load, drops, the router's gap, the norms); finish() the rest."""
    world_size, P, E, k, L, h, B, T = comm.Get_size(), args.ep, args.experts, args.top_k, args.layers, args.hidden, args.batch_size, args.seq_len
    full, p, steps_run, moes = args.recompute == "full", 2 if args.precision == "bf16" else 4, max(1, len(records)), moe_layers(model)
    experts, one, n = expert_parameters(model), sum(p.numel() for p in next(iter(moes[0].experts.values())).parameters()), B // world_size * T
    dense = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in experts)
    dropped = comm.allreduce(int(sum(m.dropped for m in moes)))  # pairs, all ranks, all layers and steps
    gap, calls = comm.allreduce(float(min(m.min_gap for m in moes)), op=MPI.MIN), sum(sum(c.calls.values()) for c in counted.values()) / steps_run
    mine = {"Alltoallv": counted["all-to-all"].bytes["Alltoallv"], "Alltoall": counted["all-to-all"].bytes["Alltoall"],
            **{kind: sum(counted[kind].bytes.values()) for kind in ("router", "dense", "experts", "norm", "count")}}
    every = comm.allgather({kind: b / steps_run for kind, b in mine.items()})
    measured, per_rank = {kind: sum(r[kind] for r in every) / world_size for kind in mine}, [sum(r.values()) for r in every]
    r, twice, clip, ragged = 6 if full else 4, 1 + full, int(args.clip_grad > 0), int(args.ragged)  # full: the forward's exchanges again in backward
    formula = {"Alltoallv": r * (L * k * n - dropped / (world_size * steps_run)) * h * p, "Alltoall": twice * L * E * 8,
               "router": twice * L * E * 8, "dense": 4 * dense, "experts": 4 * (E // P) * L * one, "norm": 4 * clip, "count": 8 * ragged}
    saved, kept = comm.allgather(activations), comm.allreduce(sum(int(m.keep.sum()) for m in moes)) / world_size
    held, b, s, a = comm.allgather(sum(p.numel() * p.element_size() for p in experts)), B // world_size, T, args.heads
    block = 12 * n * h + 16 * n + 5 * p * n * h + 16 * n * E + 4 * E + p * k * n * h  # the docstring's; and 32 + 9 p h per pair kept
    core = s * s + (6 if p == 2 else 4) * a * s * s * b  # attention's core, which selective recomputes
    saved_formula = (L * 4 * n * h if full else L * (block + core * (args.recompute == "none")) + (32 + 9 * p * h) * kept) \
        + 8 * b * s + 8 * s + 4 * n * h + 16 * n + p * n * h + 4 * n * VOCAB + 4  # beyond the blocks
    load, first = [m.load.tolist() for m in moes], [m.first_load.tolist() for m in moes]
    busiest = {when: [max(c) / (sum(c) / E) for c in counts] for when, counts in (("first_step", first), ("last_step", load))}
    lines = [f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f}; a uniform guess is ln {VOCAB} = {math.log(VOCAB):.4f})",
             f"bytes per step and rank, mean over the {world_size} ranks: {sum(measured.values()):,.0f} (from {min(per_rank):,.0f} to "
             f"{max(per_rank):,.0f}: the rows a rank sends follow the routing); formula {sum(formula.values()):,.0f}",
             f"  Alltoallv {measured['Alltoallv']:,.0f} = {r} L (k n - dropped) h x {p} = {formula['Alltoallv']:,.0f} | Alltoall of counts "
             f"{measured['Alltoall']:,.0f} = {twice} L E 8 = {formula['Alltoall']:,} | router counts {measured['router']:,.0f} = {twice} L E 8 "
             f"= {formula['router']:,} | dense gradients {measured['dense']:,.0f} = 4 D = {formula['dense']:,} | expert gradients "
             f"{measured['experts']:,.0f} = 4 (E/P) L X = {formula['experts']:,} | gradient norm {measured['norm']:,.0f} = "
             f"{formula['norm']} (4 with --clip-grad, else reported, not counted) | count {measured['count']:,.0f} = {formula['count']} (8 with --ragged)",
             f"collectives per step and rank: {calls:g} (formula {r + 2 * twice}L + {2 + clip + ragged} = {(r + 2 * twice) * L + 2 + clip + ragged}: "
             f"per block {r} Alltoallv, {twice} Alltoall, {twice} Allreduce; 2 gradient Allreduces" + ", 1 of the norm" * clip + ", 1 of the count" * ragged + ")",
             f"gradient norm, each parameter once: first step {norms[0]:.4f}, last {norms[-1]:.4f}, largest {max(norms):.4f}"
             + f"; clipped to {args.clip_grad:g} at {sum(x > args.clip_grad for x in norms)} of {len(norms)} steps" * clip,
             f"activations saved for backward, last step, --recompute {args.recompute}: {' | '.join(f'{a / 1e6:.3f}' for a in saved)} MB "
             f"a rank; mean {statistics.mean(saved):,.0f} bytes, formula {saved_formula:,.0f}",
             f"expert parameters per rank: {min(held):,} to {max(held):,} bytes; formula (E/P) L X x 4 = {E // P * L * one * 4:,} "
             f"({E // P} of {E} experts x {L} blocks x {one:,} parameters)",
             f"(token, choice) pairs per expert as the router chose them (before capacity), last step, all ranks ({k} x {B * T} a "
             f"block, {k * B * T / E:g} each if balanced): " + " | ".join(f"block {i} {counts}" for i, counts in enumerate(load)),
             f"busiest expert over an even share, block by block (1 balanced, E/k = {E / k:g} every token choosing it): "
             + ", ".join(f"{when.replace('_', ' ')} " + " ".join(f"{b:.2f}" for b in v) for when, v in busiest.items()),
             f"(token, choice) pairs dropped: {dropped:,} of {L * k * B * T * steps_run:,}" + (" (dropless)" if args.capacity_factor is None
             else f" (capacity factor {args.capacity_factor:g})") + ("" if reference is None else f"; the single process dropped {reference[0]:,}"),
             f"smallest gap between a token's k-th and (k+1)-th router probability: {gap:.2e} (float32 rounding, about 1e-7, flips a smaller one)"]
    if reference is not None:
        lines.append(f"the single process followed the ranks' choices; its own top-{k} differed at {reference[1]:,} token(s), by "
                     f"{reference[2]:.1e} at most in probability (the check counts it: near-ties only); its gradient norms "
                     f"differ by {reference[3]:.1e} at most")
    return finish(comm, args, run, losses, records, diff, "losses, gradient norms, parameters, routing", lines, {
        "experts": E, "top_k": k, "ep": P, "capacity_factor": args.capacity_factor, "aux_loss_coef": args.aux_loss_coef, "comm_bytes_per_step":
        sum(measured.values()), "comm_bytes_formula": sum(formula.values()), "comm_bytes_per_rank": per_rank, "comm_bytes_by_kind": measured,
        "comm_bytes_formula_by_kind": formula, "collectives_per_step": calls, "collectives_formula": (r + 2 * twice) * L + 2 + clip + ragged,
        "activation_bytes_per_rank": saved, "activation_bytes_formula": saved_formula, "expert_param_bytes_per_rank": held,
        "expert_param_bytes_formula": E // P * L * one * 4, "tokens_per_expert": load, "tokens_per_expert_first_step": first,
        "busiest_expert_share": busiest, "tokens_dropped": dropped, "min_topk_gap": gap, "overlap": {},  # blocking: no overlap
        "grad_norms": norms, **{key: vars(args)[key] for key in ("optimizer", "clip_grad", "lr_schedule", "warmup_steps", "ragged")},
        **dict(zip(("tokens_dropped_reference", "choices_differing_in_reference", "reference_preference",
                    "grad_norm_max_abs_diff"), reference or [None] * 4))})

def parse_args(argv, world_size):
    p = common_arguments("Expert parallelism over MPI: a mixture-of-experts GPT on Python's own source.",
                         steps=50, batch_size=24, lr=1e-3, log_every=10)
    for flag, default, text in (("--layers", 4, "transformer blocks"), ("--hidden", 64, "hidden size"), ("--heads", 4, "attention heads"),
                                ("--seq-len", 64, "characters per sequence"), ("--experts", 4, "expert MLPs in every block")):
        p.add_argument(flag, type=COUNT, default=default, help=text)
    p.add_argument("--top-k", type=int, choices=(1, 2), default=2, help="experts per token")
    p.add_argument("--ep", type=COUNT, help="ranks that share the experts out (default: the most that divide both the ranks and the experts)")
    p.add_argument("--capacity-factor", type=AMOUNT, help="at most ceil(C k n / E) pairs per expert from each rank's n tokens (default: dropless)")
    p.add_argument("--aux-loss-coef", type=checked(float, lambda v: v >= 0 and math.isfinite(v), "0 or more"), default=0.01, help="alpha of the load-balancing loss")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw", help="SGD (momentum 0.9) or AdamW (betas "
                   "0.9 0.95, eps 1e-8, weight decay 0.1 on every parameter)")
    p.add_argument("--clip-grad", type=checked(float, lambda v: v >= 0 and math.isfinite(v), "0 or more"), default=1.0,
                   metavar="MAX_NORM", help="clip the global gradient norm to MAX_NORM, as clip_grad_norm_ does (0: off)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="after the warm-up: --lr, or a cosine down towards --lr / 10 at --steps")
    p.add_argument("--warmup-steps", type=COUNT_OR_0, help="linear warm-up: step s (from 0) at lr (s + 1) / W (default: --steps / 10)")
    p.add_argument("--ragged", action="store_true", help="documents of uneven length: the loss over the valid targets")
    args = check_common(p.parse_args(argv))
    args.warmup_steps = args.steps // 10 if args.warmup_steps is None else args.warmup_steps  # a tenth by default
    if args.warmup_steps >= args.steps:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} leaves no step of --steps {args.steps}; use fewer")
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} does not split into {args.heads} heads of equal size; use a multiple of "
                          f"{args.heads}, e.g. {16 * args.heads}")
    if args.batch_size % world_size:
        raise ConfigError(f"--batch-size {args.batch_size} does not split into {world_size} ranks; use a multiple of {world_size}, "
                          f"e.g. {world_size}, {2 * world_size}, {3 * world_size}")
    if args.top_k >= args.experts:
        raise ConfigError(f"--top-k {args.top_k} of --experts {args.experts} leaves the router no choice; use --experts {args.top_k + 1} or more")
    args.ep = args.ep or math.gcd(world_size, args.experts)
    if world_size % args.ep or args.experts % args.ep:
        works = [d for d in range(1, world_size + 1) if world_size % d == 0 and args.experts % d == 0]
        fixes = ([f"--ep {', '.join(map(str, works))}"] + [f"mpirun -np a multiple of {args.ep}"] * (world_size % args.ep > 0)
                 + [f"--experts a multiple of {args.ep}"] * (args.experts % args.ep > 0))
        raise ConfigError(f"--ep {args.ep} must divide both the {world_size} ranks and the {args.experts} experts; use {' or '.join(fixes)}")
    if args.seq_len >= len(load_text()):
        raise ConfigError(f"--seq-len {args.seq_len} must be shorter than the text ({len(load_text())})")
    return args

def model_config(args):
    """The model a checkpoint holds, never the grid (the world size, --ep): it resumes on any."""
    return {"model": "GPT-MoE", "vocab": VOCAB, **{key: vars(args)[key] for key in ("layers", "hidden", "heads", "seq_len", "experts")}}

# Checkpoints (--save, --resume) hold the whole model's tensors, by its names and whole: rank 0 writes the
# dense parameters, rank j < P (the first group) its experts j E/P to (j+1) E/P - 1 (their replicas write
# nothing: every element once), each with its optimizer's state (SGD's momentum, AdamW's exp_avg and
# exp_avg_sq, as torch names them; AdamW's step count in the state). A resume on any N and --ep: every rank
# asks for the dense parameters and the experts it holds now, and reads expert e from whichever file holds it.
OPTIMIZER_STATE = {"sgd": {"momentum": "momentum_buffer"}, "adamw": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}

def expert_parallel_shard(comm, args, model, optimizer, losses, world_sizes, norms):
    """What this rank writes, by the whole model's names, each tensor whole with its optimizer's state: rank 0
    the dense parameters, the first group's ranks (rank < --ep) their experts; the other groups, replicas, nothing.
    Rank 0's state: the losses, norms and world size of each step so far, the --ep, the optimizer, AdamW's step."""
    rank, experts = comm.Get_rank(), {id(p) for p in expert_parameters(model)}
    pieces = {}
    for name, p in model.named_parameters():
        if (rank < args.ep) if id(p) in experts else (rank == 0):
            pieces.update({name: piece(p), **{f"{kind}/{name}": piece(optimizer.state[p][key])
                                              for kind, key in OPTIMIZER_STATE[args.optimizer].items()}})
    steps = {int(state["step"]) for state in optimizer.state.values() if "step" in state}  # AdamW's, one for all
    return pieces, {"losses": list(losses), "world_sizes": list(world_sizes), "grad_norms": list(norms), "ep": args.ep,
                    "optimizer": args.optimizer, **({"adamw_step": steps.pop()} if steps else {})} if rank == 0 else None

def held_here(model, args):
    """load_checkpoint's wanted(): this rank's tensors by the whole model's names, whole, and their optimizer state."""
    def wanted(manifest):
        if (saved := manifest["state"].get("optimizer", "sgd")) != args.optimizer:  # every rank alike: one manifest
            raise ConfigError(f"{args.save} holds --optimizer {saved}'s state; resume with --optimizer {saved}")
        return {key: region(p.shape) for name, p in model.named_parameters()
                for key in (name, *(f"{kind}/{name}" for kind in OPTIMIZER_STATE[args.optimizer]))}
    return wanted

def restore(model, optimizer, manifest, blocks):
    """This rank's parameters and optimizer's state from its blocks; returns the losses, world sizes, norms so far."""
    model.load_state_dict({name: blocks[name] for name in model.state_dict()})
    state, step = manifest["state"], manifest["state"].get("adamw_step")  # AdamW's step: a float32 CPU tensor
    for name, p in model.named_parameters():
        optimizer.state[p].update({key: blocks[f"{kind}/{name}"].to(p.device) for kind, key in OPTIMIZER_STATE[
            state["optimizer"]].items()}, **({} if step is None else {"step": torch.tensor(float(step))}))
    return state["losses"], state["world_sizes"], state["grad_norms"]

# --- The machinery every strategy file shares, word for word (tests/test_machinery.py) ---
def max_difference(losses, state, ref_losses, ref_model):
    """Largest |difference| in the losses and in the tensors of `state` (a state dict of the
    whole model or of a part of it) against the reference model's; a NaN anywhere is infinite."""
    ref_state = ref_model.state_dict()
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)] + [
        (t.detach().double().cpu() - ref_state[name].double().cpu()).abs().max().item() for name, t in state.items()]
    return math.inf if any(math.isnan(d) for d in diffs) else max(diffs)

# --- Report: progress, the summary and --json, --trace -----------------------
def print_progress(comm, args, step, loss, record, norm=None):
    print0(comm, f"step {step + 1}/{args.steps} | loss {loss:.4f} | " + (f"norm {norm:.4f} | " if norm is not None else "")
           + f"{record['step_s'] * 1e3:.1f} ms/step | comm {record['comm_s'] * 1e3:.1f} ms | "
             f"idle {100 * record['idle_s'] / record['step_s']:.0f}%")

def finish(comm, args, run, losses, records, diff, compared, lines, keys):
    """The summary: the file's own `lines`, the split of a step (medians over the steps after the
    first, of the slowest rank), the peak memory each rank measured, the overlap counts of the
    last step (keys['overlap']) and the check's verdict; then --json, the house keys and the
    file's `keys`. Returns the exit status: 1 when the check exceeds the tolerance."""
    medians = [{k: statistics.median(r[k] for r in (mine[1:] or mine)) for k in mine[0]}
               for mine in comm.allgather(records)]
    slowest = max(medians, key=lambda m: m["step_s"])
    peaks = comm.allgather(run.memory.bytes)
    limit = TOLERANCE_BF16 if args.precision == "bf16" else TOLERANCE  # the check's, in this precision
    ok, overlap = diff is None or diff <= limit, keys.get("overlap") or {}
    print0(comm, *lines,
           f"median step {slowest['step_s'] * 1e3:.1f} ms: compute {slowest['compute_s'] * 1e3:.1f} | "
           f"comm {slowest['comm_s'] * 1e3:.1f} | idle {slowest['idle_s'] * 1e3:.1f} ms (slowest rank)",
           f"peak memory per rank ({run.memory.what}): {' | '.join(f'{p / 1e6:.2f}' for p in peaks)} MB",
           *(["overlap, last step (started in time / all): "
              + ", ".join(f"{name} {n}/{total}" for name, (n, total) in overlap.items())] if overlap else []),
           *([f"check against single-process training: max |diff| {diff:.2e} ({compared}; tolerance "
              f"{limit:g}) -> {'PASS' if ok else 'FAIL'}"] if diff is not None else []))
    if args.json:
        print0(comm, json.dumps({
            "strategy": STRATEGY, "world_size": comm.Get_size(), "device": run.device.type, "precision": args.precision,
            "recompute": args.recompute, "steps": args.steps, "losses": losses, "final_loss": losses[-1],
            "step_time_s": slowest["step_s"], "compute_s": slowest["compute_s"], "comm_s": slowest["comm_s"],
            "idle_s": slowest["idle_s"], "check_max_abs_diff": diff, "peak_memory_bytes_per_rank": peaks, **keys}))
    return 0 if ok else 1

def write_trace(comm, timeline, path):
    """Chrome trace-event JSON: one track (pid) per rank; opens in Perfetto or chrome://tracing."""
    events = comm.gather(timeline.events, root=0)
    if comm.Get_rank() == 0:
        trace = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in range(len(events))]
        trace += [{"name": name, "cat": cat, "ph": "X", "pid": r, "tid": 0, "ts": start * 1e6,
                   "dur": (end - start) * 1e6} for r, spans in enumerate(events) for name, cat, start, end in spans]
        with open(path, "w") as out:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, out)

def print0(comm, *lines, file=None):
    if comm.Get_rank() == 0:  # rank 0 alone prints (on sys.stdout as it is now, or on file)
        print(*lines, sep="\n", file=file or sys.stdout, flush=True)

# --- Checkpoints: a folder appears whole or not at all; a signal stops at a step's end
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a batch system's time limit, or its warning
STOPPED = 75  # the exit status of a run stopped by a signal (sysexits' EX_TEMPFAIL): requeue on it
stop_requested = []  # the signals this rank received

def checkpoint_if_due(comm, args, step, make_shard, config):
    """At the end of `step`: save when --save-every or the last step says so, or when any rank got
    SIGTERM or SIGUSR1 (the ranks agree on it here, so all stop after the same step); after a
    signal's save, end the job with status STOPPED. make_shard() gives this rank's shard (collective)."""
    stop = comm.allreduce(bool(stop_requested), op=MPI.LOR) and step + 1 < args.steps
    if args.save and (stop or step + 1 == args.steps or (args.save_every and (step + 1) % args.save_every == 0)):
        save_checkpoint(comm, args.save, step + 1, make_shard(), config)
    if stop:
        print0(comm, f"stopped by a signal after step {step + 1} of {args.steps}: " +
               (f"checkpoint saved in {args.save}; rerun with --resume to continue" if args.save
                else "nothing saved (no --save)") + f" (exit status {STOPPED})")
        sys.exit(STOPPED)

def checkpoints(root):
    """The complete checkpoints in root (step-N folders with a manifest), oldest first, by number."""
    names = [n for n in (os.listdir(root) if os.path.isdir(root) else []) if n[:5] == "step-" and n[5:].isdigit()
             and os.path.isfile(os.path.join(root, n, "manifest.json"))]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[5:]))]

class HashingFile:  # torch.save streams a shard through it to the file: hashed, with no copy in memory
    def __init__(self, stream):
        self.stream, self.sha256, self.flush = stream, hashlib.sha256(), stream.flush

    def write(self, data):
        self.sha256.update(data)
        return self.stream.write(data)

def write_durably(path, data):
    """Bytes, or what data(stream) writes, into path and on to the disk; returns their SHA-256."""
    with open(path, "wb") as stream:
        hashing = HashingFile(stream)
        data(hashing) if callable(data) else hashing.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    return hashing.sha256.hexdigest()

def fsync_folder(path):  # the names a folder holds, made durable as its files' bytes are
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)

def save_checkpoint(comm, root, step, shard, config, keep=2):
    """Each rank's shard, (pieces, state): pieces {key: piece(...)}, state a small JSON dict (the
    first rank's that gives one is kept), goes into root/.tmp-step-N. Rank 0 writes the manifest, the
    index of which file holds which block of which tensor (a block an earlier file holds, replicated,
    left out), and renames the folder to step-N, fsynced before and the parent after: a job killed
    before the rename leaves the previous checkpoint as it was. A write that fails on any rank (a
    full disk) ends the job on every rank with one line, the previous checkpoint whole."""
    final, tmp = os.path.join(root, f"step-{step:06d}"), os.path.join(root, f".tmp-step-{step:06d}")
    pieces, state = shard
    files, error = {}, None
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    comm.Barrier()
    try:
        os.makedirs(tmp, exist_ok=True)
        if pieces:
            name = f"rank-{comm.Get_rank()}.pt"
            tensors = {key: tensor for key, (tensor, _, _) in pieces.items()}
            files[name] = {"sha256": write_durably(os.path.join(tmp, name), lambda stream: torch.save(tensors, stream)),
                           "pieces": {key: [shape, offset, list(t.shape)] for key, (t, shape, offset) in pieces.items()}}
            fsync_folder(tmp)  # this rank's file's name, from this node
    except OSError as e:
        error = f"rank {comm.Get_rank()}: {e}"
    gathered = comm.gather((files, error, state), root=0)
    if comm.Get_rank() == 0:
        error = next((e for _, e, _ in gathered if e), None)
        try:
            if error is None:
                indexed, seen = {}, set()
                for name, entry in (item for f, _, _ in gathered for item in f.items()):
                    fresh = {k: p for k, p in entry["pieces"].items() if (k, json.dumps(p)) not in seen}
                    seen |= {(k, json.dumps(p)) for k, p in fresh.items()}
                    indexed[name] = {"sha256": entry["sha256"], "pieces": fresh}
                manifest = {"strategy": STRATEGY, "world_size": comm.Get_size(), "config": config, "step": step,
                            "state": next((s for _, _, s in gathered if s is not None), None), "files": indexed}
                write_durably(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1).encode())
                fsync_folder(tmp)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)  # atomic: the checkpoint is now complete
                fsync_folder(root)  # make the rename itself durable
        except OSError as e:
            error = f"rank 0: {e}"
        for old in checkpoints(root)[:-keep] if error is None else []:
            try:  # renamed first: a deletion cut short never leaves a checkpoint that looks whole
                os.rename(old, gone := os.path.join(root, ".old-" + os.path.basename(old)))
                shutil.rmtree(gone)
            except OSError as e:  # a full quota, a file held open on NFS: the new checkpoint is whole
                print(f"warning: the old checkpoint {old} could not be deleted ({e}); going on", file=sys.stderr, flush=True)
    error = comm.bcast(error, root=0)
    if error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = (checkpoints(root) or ["none"])[-1]
        raise ConfigError(f"the checkpoint of step {step} could not be written ({error}); the previous "
                          f"one ({previous}) is whole: make room and rerun with --resume", status=1)

def piece(tensor, shape=None, offset=None):
    """A tensor as a checkpoint holds it: a CPU copy (not a view of a larger storage), the shape of
    the whole it is a block of, and where it starts in each dimension."""
    copy = tensor.detach().cpu().clone()
    return copy, list(shape or copy.shape), list(offset or [0] * copy.dim())

def region(shape, offset=None, size=None):
    """A block a rank will hold, to ask load_checkpoint for: the whole's shape, start and size."""
    return list(shape), list(offset or [0] * len(shape)), list(size or shape)

def overlap(a, b):
    """The block that two blocks (offset, size) of one tensor share, as (offset, size); None if none."""
    low = [max(i, j) for i, j in zip(a[0], b[0])]
    high = [min(i + m, j + n) for i, m, j, n in zip(a[0], a[1], b[0], b[1])]
    return None if any(lo >= hi for lo, hi in zip(low, high)) else (low, [hi - lo for lo, hi in zip(low, high)])

def within(block, start):  # the index of a block of the whole inside a tensor that starts at `start`
    return tuple(slice(lo - s, lo - s + n) for lo, n, s in zip(*block, start))

def read_files(comm, path, manifest, names):
    """Each file this rank needs, read once and hashed as read; a file that every rank needs is read
    by rank 0 alone and broadcast. Collective, and it never raises between its collectives: returns
    ({name: {key: tensor}}, None), or (what was read, why a file is damaged)."""
    needs, tensors, damage = comm.allgather(sorted(names)), {}, None
    everyone = set.intersection(*map(set, needs)) if comm.Get_size() > 1 else set()
    for name in sorted(set().union(*map(set, needs))):
        data = None
        if name in names and (name not in everyone or comm.Get_rank() == 0):
            with contextlib.suppress(OSError), open(os.path.join(path, name), "rb") as stream:
                data = stream.read()
        if name in everyone:  # the size first (-1: unreadable on rank 0), then the bytes
            size = comm.bcast(-1 if data is None else len(data), root=0)
            buffer = bytearray(data if data is not None else max(size, 0))
            comm.Bcast([buffer, MPI.BYTE], root=0)
            data = None if size < 0 else bytes(buffer)
        if name not in names or damage:
            continue
        try:
            if data is None:
                raise OSError(f"{name} is missing or unreadable")
            if hashlib.sha256(data).hexdigest() != manifest["files"][name]["sha256"]:
                raise ValueError(f"{name}'s SHA-256 differs from the manifest's")
            tensors[name] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            damage = f"{type(e).__name__}: {e}"
    return tensors, damage

def assemble(manifest, wanted, tensors):
    """The blocks this rank asked for, cut from the pieces that overlap them; a block the checkpoint
    does not wholly cover, or a tensor of another shape, is a ConfigError."""
    out = {}
    for key, (shape, offset, size) in wanted.items():
        out[key], filled = None, 0
        for name, entry in manifest["files"].items():
            whole, start, extent = entry["pieces"].get(key, (shape, None, None))
            if whole != shape:
                raise ConfigError(f"the checkpoint holds {key} of shape {whole}, this run's is {shape}")
            if start is None or (block := overlap((offset, size), (start, extent))) is None:
                continue
            source = tensors[name][key]
            if out[key] is None:
                out[key] = torch.empty(size, dtype=source.dtype)
            out[key][within(block, offset)] = source[within(block, start)]
            filled += math.prod(block[1])
        if filled != math.prod(size):
            raise ConfigError(f"the checkpoint holds {filled} of the {math.prod(size)} elements of {key} "
                              f"this rank needs")
    return out

def load_checkpoint(comm, root, config, wanted, steps):
    """The newest checkpoint whose every file that some rank needs is whole: its manifest and the
    blocks this rank asks for, wanted(manifest) = {key: region(...)}, cut from the pieces that overlap
    them whatever the grid that wrote them; (None, None) when root holds none yet (a first run). All
    ranks take theirs from that one checkpoint: a damaged file makes every rank fall back to the one
    before, and rank 0 says why. One that does not fit this run is a ConfigError on every rank."""
    found, damaged = comm.bcast(checkpoints(root) if comm.Get_rank() == 0 else None, root=0), []
    if not found:
        print0(comm, f"--resume: no checkpoint in {root} yet: starting from step 0")
        return None, None
    for path in reversed(found):
        manifest = damage = unfit = names = blocks = None
        if comm.Get_rank() == 0:  # read once, by one rank
            try:
                with open(os.path.join(path, "manifest.json")) as stream:
                    manifest = json.load(stream)
                if not all({"sha256", "pieces"} <= entry.keys() for entry in manifest["files"].values()):
                    raise ValueError("its index of files is incomplete")
            except (OSError, ValueError, KeyError, TypeError) as e:
                manifest, damage = None, f"{path} is damaged ({type(e).__name__}: {e})"
        manifest, damage = comm.bcast((manifest, damage), root=0)
        if damage is None:
            unfit = next((why for wrong, why in [  # a checkpoint that cannot continue this run
                (manifest["strategy"] != STRATEGY, f"{path} was written by {manifest['strategy']}, not {STRATEGY}"),
                (manifest["step"] >= steps, f"{path} is at step {manifest['step']}: --steps {steps} leaves "
                                            f"nothing to train; ask for more steps to continue"),
                (manifest["config"] != config, f"{path} holds a model {manifest['config']}, these flags make {config}")]
                          if wrong), None)
            asked = wanted(manifest) if unfit is None else {}
            names = {name for name, entry in manifest["files"].items() for key, (_, start, size)
                     in entry["pieces"].items() if key in asked and overlap(asked[key][1:], (start, size))}
        if damage is None and unfit is None:
            tensors, damage = read_files(comm, path, manifest, names)
            try:
                blocks = None if damage else assemble(manifest, asked, tensors)
            except ConfigError as e:
                unfit = f"{path}: {e}"
            damage = damage and f"{path} is damaged ({damage})"
        problems = comm.allgather((unfit, damage))
        if any(u for u, _ in problems):
            raise ConfigError(next(u for u, _ in problems if u))
        if all(d is None for _, d in problems):
            if damaged:
                print0(comm, f"--resume: {'; '.join(damaged)}: resuming from {path}, the newest whole checkpoint")
            return manifest, blocks
        damaged.append(next(d for _, d in problems if d))
    raise ConfigError(f"no whole checkpoint in {root}: {'; '.join(damaged)}")

# --- Counters, timeline and memory: measured around the strategy's own work ---
class Timeline:
    """Spans of compute, comm and idle time on one rank, for the summary and --trace; a span's
    own time leaves out its children's. On a GPU the edges are CUDA events, read once a step
    (step_record), so that timing never stalls the device in the middle of a step."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.origin_s, self.origin = time.perf_counter(), self._mark()  # the trace's zero
        self.open, self.closed, self.events = [], [], []  # events: (name, cat, start_s, end_s)
        self.step_events = []  # the events of the last recorded step

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, mark):
        return self.origin.elapsed_time(mark) / 1e3 if self.cuda else mark - self.origin_s

    @contextlib.contextmanager
    def span(self, cat, name):
        start, children = self._mark(), []
        self.open.append(children)
        try:
            yield
        finally:
            self.open.pop()
            (self.open[-1] if self.open else self.closed).append((name, cat, start, self._mark(), children))

    def step_record(self, start):
        """Close the step begun at perf_counter() `start`: its time, and its spans' own time by
        kind; wait: spans spent waiting on a peer; idle: all that is neither compute nor comm."""
        if self.cuda:
            torch.cuda.synchronize()  # once a step: every event of the step has happened
        record = {"step_s": time.perf_counter() - start, "compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0}
        first = len(self.events)

        def own_time(name, cat, start_mark, end_mark, children):
            begin, end = self._seconds(start_mark), self._seconds(end_mark)
            self.events.append((name, cat, begin, end))
            inner = sum(own_time(*c) for c in children)  # first: a child of the same kind adds to it too
            record[{"idle": "wait"}.get(cat, cat) + "_s"] += end - begin - inner
            return end - begin

        for span in self.closed:
            own_time(*span)
        self.closed, self.step_events = [], self.events[first:]
        record["idle_s"] = max(0.0, record["step_s"] - record["compute_s"] - record["comm_s"])
        return record

def started_within(events, exchange, compute):
    """[n, total]: of the spans named `exchange` (a name or a tuple of names), how many began
    while a span named `compute` (likewise) was running: started in time to hide behind it."""
    names = lambda x: (x,) if isinstance(x, str) else tuple(x)
    running = [(begin, end) for name, _, begin, end in events if name in names(compute)]
    starts = [begin for name, _, begin, _ in events if name in names(exchange)]
    return [sum(any(lo <= s < hi for lo, hi in running) for s in starts), len(starts)]

SLEEP_WHILE_WAITING = True  # setup() says: only when the node's ranks outnumber its cores

class CountedComm:
    """The communicator the strategy is given: every call goes to mpi4py unchanged, and on the
    way the buffer methods are counted (calls, bytes of the first buffer, by name) and timed as
    'comm' spans. Their requests' Wait polls with short sleeps where ranks outnumber cores (MPICH's
    Wait spins on the core of a rank that computes), else it is MPI's own, no naps to pace a GPU.
    A point-to-point wait is the peer's lateness (idle), a collective's comm."""

    COUNTED = {"Allreduce", "Iallreduce", "Bcast", "Ibcast", "Send", "Recv", "Isend", "Irecv", "Sendrecv",
               "Allgather", "Iallgather", "Allgatherv", "Reduce_scatter", "Reduce_scatter_block",
               "Ireduce_scatter_block", "Alltoall", "Alltoallv", "Ialltoallv"}

    def __init__(self, comm, timeline):
        self.comm, self.timeline = comm, timeline
        self.calls, self.bytes = collections.Counter(), collections.Counter()

    def reset(self):
        self.calls.clear(), self.bytes.clear()

    def __getattr__(self, name):
        call = getattr(self.comm, name)
        if name not in self.COUNTED:
            return call

        def counted(*args, **kwargs):
            buffer = args[1] if args[0] is MPI.IN_PLACE else args[0]
            buffer = buffer[0] if isinstance(buffer, (list, tuple)) else buffer
            self.calls[name] += 1
            self.bytes[name] += buffer.numel() * buffer.element_size()
            with self.timeline.span("comm", name):
                result = call(*args, **kwargs)
            if not isinstance(result, MPI.Request):
                return result
            return CountedRequest(result, self.timeline, "idle" if name in ("Isend", "Irecv") else "comm", name)
        return counted

class CountedRequest:
    def __init__(self, request, timeline, cat, name):
        self.request, self.timeline, self.cat, self.name = request, timeline, cat, name

    def Test(self):
        return self.request.Test()

    def Wait(self):
        with self.timeline.span(self.cat, self.name + " wait"):
            while SLEEP_WHILE_WAITING and not self.request.Test():
                time.sleep(POLL_S)
            self.request.Wait()  # at once when the polls saw it done

class PeakMemory:
    """The most memory this rank held while training, less what it held before the model was
    built. CUDA: the allocator's peak. CPU: the peak resident set (VmHWM) less its file-backed
    pages (torch's code, loaded as kernels are first used), which means something because
    start_mpi() fixed the C library's mmap threshold: freed tensors leave the process. Memory
    that training reuses from what the process had freed before (small chunks) is not seen."""

    def __init__(self, device):  # before the model is built
        __import__("torch._dynamo")  # torch's first optimizer imports it: 60+ MB of Python, not training
        self.cuda = device.type == "cuda"
        self.what = "CUDA allocator's peak" if self.cuda else "peak resident set less code, less the process before the model"
        self.baseline = 0 if self.cuda else proc_status("VmRSS") - proc_status("RssFile")

    def reset(self):
        """From here on: the peak of training, not that of building the model."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # Linux: the peak resident set starts again from the current one

    def stop(self):
        """The peak until now: the check and the report that follow training do not count."""
        self.bytes = (torch.cuda.max_memory_allocated() if self.cuda else
                      max(0, proc_status("VmHWM") - proc_status("RssFile") - self.baseline))

def proc_status(key):
    """A size from /proc/self/status in bytes (Linux; 0 elsewhere)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        return next((int(line.split()[1]) * 1024 for line in status if line.startswith(key + ":")), 0)
    return 0

# --- Device and MPI setup -----------------------------------------------------
# The launchers' own variables: Open MPI, MPICH's hydra, MVAPICH, HPE Cray PALS, Flux, and Slurm's
# last, since mpirun's ranks under srun (hydra's and Open MPI's daemons start there) inherit them.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                        "PALS_LOCAL_RANKID", "FLUX_TASK_LOCAL_ID", "SLURM_LOCALID")
# How many ranks the launcher started: PMI (MPICH, srun --mpi=pmi2), Open MPI, MVAPICH; last, srun's
# count of a step whose ranks it started itself (srun --mpi=pmix sets no size of PMIx's own).
WORLD_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "FLUX_JOB_SIZE", "SLURM_STEP_NUM_TASKS")
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PALS_RANKID", "FLUX_TASK_RANK", "SLURM_PROCID")

def launcher_local_rank():
    """This rank's index on its node, as the launcher tells it."""
    return next((int(os.environ[v]) for v in LOCAL_RANK_VARIABLES if os.environ.get(v, "").isdigit()), None)

def check_one_job(world_size):
    """N one-rank jobs, each training alone, when mpi4py's MPI is not the launcher's: refused before
    anything is written, in one line from the launcher's rank 0 alone (each job's rank 0 would say it)."""
    told = next((v for v in WORLD_SIZE_VARIABLES if os.environ.get(v, "").isdigit()), None)
    if told and int(os.environ[told]) > 1 and world_size == 1:
        if next((os.environ[v] for v in RANK_VARIABLES if os.environ.get(v, "").isdigit()), "0") == "0":
            print(f"error: the launcher started {os.environ[told]} ranks ({told}), MPI sees a world of 1: each would "
                  f"train alone; mpi4py's MPI ({mpi_library()}) is likely not the launcher's: use its mpirun, or "
                  f"rebuild mpi4py", file=sys.stderr, flush=True)
        sys.exit(2)

def node_cores(node):
    """The cores the ranks of this node may run on, together (their affinity, e.g. a Slurm cgroup)."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return len(set().union(*node.allgather(set(mine))))

def start_mpi():
    """Before MPI starts: catch the stop signals (one that comes before training, uncaught, would
    kill the rank), give freed memory back to the system at once (glibc otherwise keeps freed
    blocks of up to 32 MB, and the resident set would never fall), and choose this rank's GPU,
    since some CUDA-aware MPIs open a context on the current GPU in MPI_Init. Then start MPI with
    threads: on a GPU, autograd calls MPI from a thread of its own."""
    for s in STOP_SIGNALS:
        signal.signal(s, lambda number, frame: stop_requested.append(number))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: fixed, no longer adaptive
    local, cpu = launcher_local_rank(), any(a in ("cpu", "--device=cpu") for a in sys.argv)
    if local is not None and not cpu and torch.cuda.is_available():
        torch.cuda.set_device(local % torch.cuda.device_count())
    if not MPI.Is_initialized():  # the level mpi4py.rc.thread_level asks for (MPI4PY_RC_THREAD_LEVEL)
        MPI.Init_thread(getattr(MPI, "THREAD_" + mpi4py.rc.thread_level.upper()))

def setup(comm, args):
    """This rank's device, whether MPI reads its memory, the timeline, the memory meter, and the
    header's facts."""
    global CUDA_AWARE, SLEEP_WHILE_WAITING
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this machine
    local_rank, local_size = node.Get_rank(), node.Get_size()
    launcher = launcher_local_rank()
    gpus, cores = torch.cuda.device_count(), node_cores(node)
    SLEEP_WHILE_WAITING = local_size > cores  # a rank with a core of its own waits in MPI, no naps
    notes = [f"note: the launcher says local rank {launcher}, the node's ranks say {local_rank}"] if launcher not in (None, local_rank) else []
    if args.check and args.steps * comm.Get_size() > 5000:
        notes.append(f"note: --check retrains all {args.steps} steps in one process after the last, the work of "
                     f"{comm.Get_size()} ranks on one; --no-check skips it (batch jobs)")
    if args.device == "cuda" or (args.device == "auto" and gpus):
        device = torch.device("cuda", (local_rank if launcher is None else launcher) % gpus)
        torch.cuda.set_device(device)
        check_thread_level(MPI.Query_thread())
        CUDA_AWARE, decided = mpi_cuda_aware(comm)
        if args.check:  # float32 against float32: no TF32, deterministic kernels, in the run and the reference
            try:
                torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "ieee"
            except AttributeError:  # torch before 2.9
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.deterministic = True
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # bf16 products summed in float32
            torch.use_deterministic_algorithms(True, warn_only=True)
        transport = f"{'direct (CUDA-aware MPI' if CUDA_AWARE else 'staged through host memory ('}{decided})"
        uuids = node.allgather(str(torch.cuda.get_device_properties(device).uuid))
        if len(set(uuids)) < local_size:  # by UUID: with one GPU per task every rank sees "GPU 0"
            notes.append(f"note: {local_size} ranks share {len(set(uuids))} GPU(s) on this node (fails in EXCLUSIVE_PROCESS mode)")
    else:
        device, CUDA_AWARE, transport = torch.device("cpu"), False, "n/a (CPU)"
        torch.set_num_threads(max(1, cores // local_size))  # oversubscribed ranks would thrash
        if local_size > cores:
            notes.append(f"note: {local_size} ranks share {cores} CPU cores, so ranks that could compute at once take turns")
    node.Free()
    comm.Barrier()  # the timeline's zero, about the same moment on every rank
    header = [f"{STRATEGY} | {comm.Get_size()} ranks | device {device.type} | {args.precision} | {mpi_library()}",
              f"CUDA buffers: {transport}"] + notes
    return types.SimpleNamespace(device=device, timeline=Timeline(device), memory=PeakMemory(device), header=header)

def mpi_cuda_aware(comm):
    """Can MPI read GPU memory, and how was that decided? MPI_CUDA_AWARE=1|0 when set, no library
    probed (a debug MPICH before 4.0 asserts in its query); a 1 the memory kinds contradict is a
    warning (Open MPI without CUDA over a CUDA UCX lists none, and reads GPU memory). Unset: MPI 4.1's
    memory kinds; Cray MPICH's MPICH_GPU_SUPPORT_ENABLED=1 with its GTL library loaded; else
    MPIX_Query_cuda_support, whose yes in Open MPI 4 tells only how the library was built."""
    try:
        kinds = comm.Get_info().Get("mpi_memory_alloc_kinds")
    except (MPI.Exception, NotImplementedError, AttributeError):
        kinds = None
    forced = os.environ.get("MPI_CUDA_AWARE")
    if forced in ("0", "1"):
        doubt = forced == "1" and kinds is not None and not cuda_in_kinds(kinds)
        return forced == "1", f"MPI_CUDA_AWARE={forced}" + (f"; warning: the library's memory kinds "
                                                           f"({kinds}) list no cuda" if doubt else "")
    if kinds is not None and cuda_in_kinds(kinds):
        return True, f"memory kinds {kinds}"
    if os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1" and mpi_libraries_loaded("libmpi_gtl_cuda"):
        return True, "Cray MPICH: MPICH_GPU_SUPPORT_ENABLED=1, its GTL library loaded"
    says = mpix_query_cuda_support()
    if says and mpi_library().startswith("Open MPI v4"):
        return True, ("probably: Open MPI 4's MPIX_Query_cuda_support says how it was built, not what its "
                      "transport can do; MPI_CUDA_AWARE=0 stages")
    return bool(says), "MPIX_Query_cuda_support" if says is not None else "no sign of CUDA support"

def cuda_in_kinds(kinds):
    """MPI 4.1's memory kinds (e.g. 'mpi,system,cuda:device'), which list only the kinds asked for
    at launch: 'cuda' or 'cuda:device' is GPU memory; 'cuda:host' (pinned host memory) is not."""
    return any(kind.strip() in ("cuda", "cuda:device") for kind in kinds.split(","))

def mpi_libraries_loaded(name="libmpi"):
    """The paths of the libraries loaded in this process whose path holds name (Linux)."""
    maps = "/proc/self/maps"
    return sorted({line.split()[-1] for line in open(maps) if name in line} if os.path.exists(maps) else [])

def mpix_query_cuda_support():
    """The answer of Open MPI's and MPICH's MPIX_Query_cuda_support; None without it."""
    for path in mpi_libraries_loaded():
        query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        if query is not None:
            return bool(query())
    return None

def check_thread_level(provided):
    """On a GPU, autograd runs backward hooks and autograd functions on a thread of its own."""
    if provided < MPI.THREAD_SERIALIZED:
        raise ConfigError(f"MPI runs at thread level {provided}, but on a GPU MPI is called from autograd's "
                          f"thread: MPI_THREAD_SERIALIZED ({MPI.THREAD_SERIALIZED}) or more is needed; "
                          f"keep mpi4py.rc.thread_level (MPI4PY_RC_THREAD_LEVEL) at its default, 'multiple'")

def mpi_library():
    """The first line of the library's version, printable characters only (Open MPI's ends in NUL)."""
    text = "".join(c for c in MPI.Get_library_version() if c.isprintable() or c == "\n")
    return text.strip().splitlines()[0].strip()


# --- Arguments, and the paths a run will write, checked before anything is built
class ConfigError(Exception):
    """A problem every rank finds alike: rank 0 prints one `error:` line, every rank exits with
    `status`: 2 for an impossible configuration, 1 for a checkpoint that could not be written."""

    def __init__(self, message, status=2):
        super().__init__(message)
        self.status = status

EXIT_STATUSES = (f"exit status: 0 trained (and the check passed); 1 the check failed, or a checkpoint could not be "
                 f"written; 2 an impossible configuration; {STOPPED} stopped by SIGTERM or SIGUSR1 at a step's end "
                 f"(saved with --save): requeue the job with --resume")

class Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage on every rank."""

    def error(self, message):
        raise ConfigError(message.replace("argument ", "", 1).replace(": must", " must") if ": must" in message
                          else message)

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:  # --help once, not once per rank
            super()._print_message(message, file)

class DefaultsFormatter(argparse.HelpFormatter):  # --help gives every flag's default
    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: {({'True': 'on', 'False': 'off', 'None': 'none'}).get(str(action.default), action.default)})"

def checked(kind, ok, must):
    """A type= for argparse: kind(text), refused unless ok(value): '--flag must be <must>, got ...'."""
    def parse(text):
        value = kind(text)  # a ValueError is argparse's own "invalid int value: 'x'"
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {value}")
        return value
    parse.__name__ = kind.__name__
    return parse

COUNT = checked(int, lambda v: v > 0, "a positive integer")
COUNT_OR_0 = checked(int, lambda v: v >= 0, "0 or more")
AMOUNT = checked(float, lambda v: v > 0 and math.isfinite(v), "a positive number")
DEVICE = checked(str, lambda v: v in ("auto", "cpu", "cuda"), "auto, cpu or cuda")
PRECISION = checked(str, lambda v: v in ("fp32", "bf16"), "fp32 or bf16 (fp16 would need loss scaling, which is not offered)")

def common_arguments(description, steps, batch_size, lr, log_every):
    p = Parser(description=description, formatter_class=DefaultsFormatter, epilog=EXIT_STATUSES)
    p.add_argument("--steps", type=COUNT, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=COUNT, default=batch_size, help="global batch: samples per step, any world size")
    p.add_argument("--lr", type=AMOUNT, default=lr, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    p.add_argument("--device", default="auto", type=DEVICE, help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--log-every", type=COUNT, default=log_every, help="rank 0 prints progress every N steps")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with single-process training, which retrains every step in one process "
                        "after the last (default: on; batch jobs: --no-check)")
    p.add_argument("--json", action="store_true", help="last stdout line is one JSON object")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace of every rank")
    p.add_argument("--save", metavar="DIR", help="write checkpoints into DIR, a folder every rank sees")
    p.add_argument("--save-every", type=COUNT_OR_0, default=0, help="also checkpoint every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save")
    p.add_argument("--precision", default="fp32", type=PRECISION, help="fp32, or bf16: bfloat16 matmuls on float32 master weights")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="recompute in backward: nothing, attention's scores and softmax (selective), each block (full)")
    return p

def check_common(args):
    if args.resume and not args.save:
        raise ConfigError("--resume needs --save DIR, the folder that holds the checkpoints")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no CUDA device; use --device cpu or auto")
    return args


def check_paths(comm, args):
    """Before anything is built, each rank tries what it will write: --save, a folder (made if
    missing) that every rank can write and sees as one folder; --trace, a file rank 0 creates.
    First of all, N one-rank jobs are refused: they would write N probes in one folder."""
    check_one_job(MPI.COMM_WORLD.Get_size())  # the world's, not comm's: tests train on parts of it
    rank, error = comm.Get_rank(), None
    try:
        if args.save:
            if os.path.exists(args.save) and not os.path.isdir(args.save):
                raise NotADirectoryError(errno.ENOTDIR, "a file, not a folder", args.save)
            os.makedirs(args.save, exist_ok=True)
            write_durably(os.path.join(args.save, f".probe-{rank}"), b"")
        if args.trace and rank == 0:
            open(args.trace, "a").close()
    except OSError as e:
        error = f"cannot write {e.filename}: {e.strerror}"
    comm.Barrier()
    if args.save and error is None:  # a folder on a node-local disk hides the other nodes' probes
        # O(N) file system operations: rank 0 lists the folder once, every other rank looks for rank 0's
        if rank == 0:
            names = set(os.listdir(args.save))
            unseen = [r for r in range(comm.Get_size()) if f".probe-{r}" not in names]
        else:
            unseen = [] if os.path.exists(os.path.join(args.save, ".probe-0")) else [0]
        error = unseen and (f"--save {args.save}: rank {rank} does not see the files of rank(s) "
                            f"{', '.join(map(str, unseen))}; checkpoints need a folder every rank shares")
    errors = [e for e in comm.allgather(error) if e]
    with contextlib.suppress(OSError, TypeError):
        os.remove(os.path.join(args.save, f".probe-{rank}"))
    if errors:
        raise ConfigError(errors[0])

def abort_on_exception(kind, value, tb):
    """An exception on one rank must end the whole job, not leave the others in a collective."""
    text = "".join(traceback.format_exception(kind, value, tb))
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: {text}", file=sys.stderr, flush=True)
    time.sleep(1)  # the launcher forwards the line before Abort tears the job down (once it came too late)
    MPI.COMM_WORLD.Abort(1)

if __name__ == "__main__":
    start_mpi()
    sys.excepthook = abort_on_exception
    sys.exit(main())
