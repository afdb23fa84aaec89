"""Tensor parallelism over MPI (Megatron-LM): every rank holds a slice of every layer's weights.

What is split: the weight matrices inside each layer (Shoeybi et al. 2019). Every rank sees the
whole batch and holds 1/N of every block; the N ranks share each matrix product.

  one block on N = 4 ranks; x (B x T x h) is whole on every rank before f and after f̄
      x -- LayerNorm -- f --+-------------+-------------+-------------+
                            |             |             |             |
   attention: q, k, v    rank 0        rank 1        rank 2        rank 3      column-parallel:
   columns of its heads  head 0        head 1        head 2        head 3      its heads, whole
   proj rows             partial sum   partial sum   partial sum   partial sum row-parallel
                            |             |             |             |
      x + bias + sum <- f̄ --+-------------+-------------+-------------+
   the MLP likewise: LayerNorm, f, fc1 columns (4h/N each), GELU, fc2 rows, f̄, + bias, + x

  f: identity forward, allreduce backward (each rank's backward has only the gradient through its
     own columns); f̄: allreduce forward, identity backward (sums the partial products; the bias is
     added after the sum). Korthikanti et al. 2022's names; Shoeybi et al. call f̄ g.
  Embedding: rank r owns a range of the vocabulary, writes zeros for other tokens, f̄ sums. Head:
     f, column-parallel; the cross-entropy takes three allreduces of B x T numbers (maximum,
     target logit, sum of exponentials): the B x T x V logits never exist on one rank.
  Replicated (checked bitwise equal): LayerNorms, positions, row-parallel biases. Vocabulary: 128
     ASCII codes, padded to a multiple of N as Megatron pads; the padding masked out of the softmax.

Sequence parallelism (--sequence-parallel, Korthikanti et al. 2022): between the column- and
row-parallel regions x is cut along the sequence, rank r holding positions [rT/N, (r+1)T/N):
      x_r (B x T/N x h) -- LayerNorm -- g -- [columns ... rows] -- ḡ -- + bias + x_r
  g, in f's place: all-gather along the sequence forward, reduce-scatter backward; ḡ, in f̄'s
  (blocks and embedding): reduce-scatter forward, all-gather backward. LayerNorms, biases,
  positions (at their global offsets) and residual adds work on the slice, so their parameters'
  gradients are partial: one allreduce after backward sums them (forgotten, the replicas drift
  apart: this script compares their checksums after training and raises). --regather: a
  column-parallel layer keeps only its input slice and gathers it again in backward (Megatron's
  way). Overlap (both modes; --no-overlap is the baseline): a column-parallel layer's backward
  posts the input gradient's allreduce (f) or reduce-scatter (g) non-blocking before its
  weight-gradient matmul and waits for it after (whether the bytes move meanwhile: the MPI's doing).

Mixed precision (--precision bf16): forward and loss run under torch.autocast(bfloat16): a matmul
multiplies bf16 copies of the float32 parameters (the master weights; autograd keeps the copies for
backward); gradients land in float32 on the parameters, the optimizer's state is float32. The stream
(the residuals, LayerNorms and their statistics), the softmax and the loss's max, target logit and
sum of exponentials stay float32 (.float() first). MPI's buffers: every sum in float32 (f̄ and ḡ
cast the bf16 partial products up, f and g the input gradients; MPICH refuses MPI_SUM on bf16). bf16
partials all-gathered and added locally: half the bytes handed in, but (N-1)A/2 received against a
ring allreduce's 2(N-1)A/N, no fewer from N = 4 on, and N copies held. Moves carry bf16: g's
all-gather (X cast before it), ḡ's backward one in the blocks (the embedding's is float32: a
lookup). Gradients are reduced in float32 (Megatron's default): bf16 would halve their bytes and
memory, but round as many small partial sums add up, and MPI could not add them.
Recomputation (--recompute): torch.utils.checkpoint(fn, *inputs, use_reentrant=True) keeps fn's
inputs by save_for_backward, where the hooks that measure activations see them (the non-reentrant
form hides them), runs fn without autograd, and again in backward under the forward's autocast
state. selective: attention's core (scores, mask, softmax, times V: what grows with T²), q, k, v
kept (Korthikanti et al.); full: each block from its input alone, its f̄ (ḡ and g) run again.
The recipe (--optimizer adamw, --clip-grad, --lr-schedule cosine, --warmup-steps; nanoGPT's): the
lr is the step's alone; the clip needs the whole gradient's norm, each parameter counted once: the
slices' squares from every rank, the replicas' from rank 0 alone, one allreduce (global_grad_norm).
--ragged (documents of uneven length): the loss summed over the targets before each document's end,
divided by their count: a local count, as every rank holds the same targets (no collective).

Communication per step (L blocks, B sequences of T characters, hidden h, A = 4BTh bytes, e = 4
bytes an element in float32, 2 in bf16):
  plain: 4L + 5 collectives, the paper's two allreduces of A forward (f̄) and two backward (f) per
     block, one each for the embedding and the head, 3 of 4BT for the loss: (4L + 2)A + 12BT bytes
     handed to MPI in float32 and bf16 alike, of which a ring moves 2(N-1)/N in and out of a rank.
  sequence parallel: 8L + 8: 4L + 2 reduce-scatters handing in A (a ring moves (N-1)/N x A each),
     4L + 1 all-gathers handing in eA/4N, the embedding's backward one A/N (a ring moves N-1 times
     that), the loss's 3, one allreduce of 4(6L + 2 + T)h bytes of replicated gradients.
  --regather: 2L + 1 all-gathers of eA/4N more; --recompute full: 2L allreduces of A more (sequence
     parallel: 2L reduce-scatters of A, 2L all-gathers of eA/4N). Bytes grow with BT, not weights.
  --clip-grad: the norm's allreduce of 4 bytes, 1 more (no clip: the norm is a report, not counted).
Activations saved for backward, per block and rank (bytes; no dropout; Korthikanti et al.'s bf16
sbh(10 + 24/t + 5as/(ht)) and (sbh/t)(34 + 5as/h) become, with s, b, a, t = T, B, heads, N and the
stream in float32, S = 4aBT²/N for the float32 softmax, 6aBT²/N in bf16 with its bf16 copy):
  plain BTh(8 + 2e + 12e/N) + S; sequence parallel BTh(8/N + 2e + 12e/N) + S (qkv's and fc1's
  gathered inputs stay whole); --regather (BTh/N)(8 + 14e) + S. selective: no S (q, k, v kept
  instead of the copies their products make: the same bytes); full: the input alone, 4BTh (/N cut).

When to choose it: a layer's weights or activations do not fit on one device and the ranks share
a fast link (Megatron: within a node, on NVLink; data or pipeline parallelism across nodes); with
sequence parallelism, for the same bytes, activations too.

The text: this Python's own argparse.py, textwrap.py and shlex.py, bytes >= 128 replaced by '?'.
Run:  mpirun -np 4 python tensor_parallel.py [--sequence-parallel [--regather]]    (--help: flags)
"""
import argparse, collections, contextlib, ctypes, errno, functools, hashlib  # noqa: E401
import importlib.util, io, json, math, os, pickle, re, shutil, signal, statistics, sys  # noqa: E401
import time, traceback, types, zlib  # noqa: E401

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
import mpi4py

mpi4py.rc.initialize = False  # MPI starts in start_mpi(), once this rank's GPU is chosen
mpi4py.rc.finalize = True  # and ends when the process does
from mpi4py import MPI  # noqa: E402

STRATEGY = "tensor_parallel"
# Largest |difference| allowed against one process (float32), where only float32 sums reorder.
# Measured after 100 steps at N = 2 to 4, plain or cut: 6e-7 to 1e-6 (plain, 300 steps: 2e-6; AdamW:
# make_optimizer). A nudge of 1.5x it to any parameter, loss or norm is reported above it (tests).
TOLERANCE = 2e-5
# bf16 (both sides autocast): the tests' 4 steps 5e-4 to 9e-4 (N = 1 to 4, any mode); 50 default steps 6.5e-3 to
# 9.4e-3 on AVX-512 BF16 (SGD: 4.3e-3 to 8.5e-3 on AVX2, 5.1e-2 to 0.15 on AVX-512 BF16). Gradients / N: 5.6e-2.
TOLERANCE_BF16 = 2e-2
POLL_S = 1e-4  # a rank waiting on MPI sleeps between polls, leaving the core to ranks that compute
VOCAB, IGNORE = 128, -100  # the ASCII codes; --ragged's target past a document's end (ignore_index)
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text
PROMPT, TEMPERATURE = "def ", 0.8  # how the sample at the end starts, and how adventurous it is


# -----------------------------------------------------------------------------
# The strategy: f, f̄ (g, ḡ), the column- and row-parallel layers, the vocabulary-parallel ones
# -----------------------------------------------------------------------------
CUDA_AWARE = False  # MPI reads GPU memory if CUDA-aware (setup() finds out), else a host copy


def mpi_buffer(t, nonblocking=False):
    """The buffer to hand MPI for t: t itself, or a pinned host copy. Open MPI's non-blocking
    collectives never read GPU memory, CUDA-aware or not, so those are always staged."""
    if not t.is_cuda:
        return t
    if CUDA_AWARE and not nonblocking:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the kernels that write t must finish first (not the whole device)
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)  # waits for t's kernels


def receive_buffer(t, nonblocking=False):
    """Where MPI writes a result for t: t itself where MPI reads GPU memory, else an empty pinned
    host buffer. Never a copy of t: MPI overwrites it, and the copy would cost a device transfer."""
    if t.is_cuda and not (CUDA_AWARE and not nonblocking):
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return mpi_buffer(t, nonblocking)


def from_mpi(t, buffer):
    """Bring what MPI wrote into a host copy back to t; returns t."""
    return t if buffer is t else t.copy_(buffer)


def allreduce(t, comm, op=MPI.SUM):
    """t (contiguous) summed, or maximized, over the ranks, in place: f̄, the loss, the sample."""
    buffer = mpi_buffer(t)
    comm.Allreduce(MPI.IN_PLACE, buffer, op=op)
    return from_mpi(t, buffer)


def sequence_blocks(x, comm):
    """x (B x T x ...) as N blocks of T/N positions in rank order: how MPI cuts a buffer."""
    return x.detach().unflatten(1, (comm.Get_size(), -1)).transpose(0, 1).contiguous()


def all_gather_sequence(x, comm):
    """Every rank's slice (B x T/N x ...) joined along the sequence in rank order, on every rank."""
    blocks = x.new_empty((comm.Get_size(), *x.shape))
    send, receive = mpi_buffer(x.detach().contiguous()), receive_buffer(blocks)
    comm.Allgather(send, receive)
    return from_mpi(blocks, receive).transpose(0, 1).flatten(1, 2)


def reduce_scatter_sequence(x, comm):
    """The sum over the ranks of x (B x T x ...), of which this rank keeps its T/N positions."""
    blocks = sequence_blocks(x, comm)
    total = blocks.new_empty(blocks.shape[1:])
    send, receive = mpi_buffer(blocks), receive_buffer(total)
    comm.Reduce_scatter_block(send, receive, op=MPI.SUM)
    return from_mpi(total, receive)


# The tensor-parallel ranks and how they run; the timeline marks the weight-gradient matmuls.
Group = collections.namedtuple("Group", "comm timeline sequence_parallel regather overlap recompute"
                               " precision", defaults=(False, False, True, "none", "fp32"))


class ReduceFromTensorParallel(torch.autograd.Function):
    """f̄ after a row-parallel layer: allreduce forward (the partial products add up to the output),
    identity backward (every rank holds its gradient whole). With the sequence cut, ḡ:
    reduce-scatter forward (each rank keeps its positions), all-gather backward (the products need
    all of them). bf16 partial products are cast up and summed in float32 (MPI has no bf16 sum); the
    gradient goes back in x's dtype, so ḡ's all-gather carries bf16 in bf16."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.dtype = group, x.dtype
        x = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        return (reduce_scatter_sequence if group.sequence_parallel else allreduce)(x, group.comm)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.to(ctx.dtype)
        return all_gather_sequence(dy, ctx.group.comm) if ctx.group.sequence_parallel else dy, None


def start_input_gradient_sum(partial, group):
    """Start summing the ranks' input gradients, non-blocking: f's allreduce, or g's reduce-scatter
    (each rank keeps its positions). Returns the sum's tensor, MPI's buffers and the request.
    Whether the bytes move before the Wait is the MPI's doing: MPICH without asynchronous progress
    (the pip wheel's default) moves them only inside MPI calls, so here mostly at the Wait; with
    MPIR_CVAR_ASYNC_PROGRESS=1 they can travel during the weight-gradient matmul."""
    if group.sequence_parallel:
        send = mpi_buffer(sequence_blocks(partial, group.comm), nonblocking=True)
        total = partial.new_empty(send.shape[1:])
        receive = receive_buffer(total, nonblocking=True)
        return total, receive, send, group.comm.Ireduce_scatter_block(send, receive, op=MPI.SUM)
    total = partial.contiguous()
    buffer = mpi_buffer(total, nonblocking=True)
    return total, buffer, buffer, group.comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)


class ColumnParallelMatmul(torch.autograd.Function):
    """Y_r = X A_r^T + b_r, rank r's output features, with f before it (g, which gathers X, when
    the stream is cut along the sequence). Backward posts the input gradient's sum, computes the
    weight gradient, then waits for the sum (Megatron's asynchronous gradient all-reduce). In bf16
    X is cast before g (its all-gather carries bf16) and the input gradient summed in float32."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        if torch.is_autocast_enabled(x.device.type):  # cast here, not in F.linear: g moves bf16
            x = x.to(torch.get_autocast_dtype(x.device.type))
        whole = all_gather_sequence(x, group.comm) if group.sequence_parallel else x
        ctx.save_for_backward(x if group.regather else whole, weight)  # --regather: the slice only
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (saved, weight), group = ctx.saved_tensors, ctx.group
        whole = all_gather_sequence(saved, group.comm) if group.regather else saved
        partial = dy.matmul(weight.to(dy.dtype)).float()  # its columns' share; summed in fp32
        exchange = start_input_gradient_sum(partial, group) if group.overlap else None  # first
        with group.timeline.span("compute", "weight grad"):  # then the matmul it may hide behind
            dy = dy.reshape(-1, dy.size(-1))
            grad_weight = dy.t().matmul(whole.reshape(-1, whole.size(-1)))
            grad_bias = dy.sum(0) if ctx.has_bias else None
        total, receive, send, request = exchange or start_input_gradient_sum(partial, group)
        request.Wait()  # waited for only after the matmul; send: MPI reads it until here
        return from_mpi(total, receive), grad_weight, grad_bias, None


def sliced(t, dim, comm, groups=1):
    """This rank's slice of t along dim, as a parameter; groups=3: t is q, k and v side by side,
    and the rank keeps the same slice of each (its heads)."""
    rank, world_size = comm.Get_rank(), comm.Get_size()
    parts = [part.chunk(world_size, dim)[rank] for part in t.detach().chunk(groups, dim)]
    p = nn.Parameter(torch.cat(parts, dim))
    p.partition = (dim, groups)  # replicated parameters have none; the check joins the slices by it
    return p


class ColumnParallelLinear(nn.Module):
    """Rank r's slice of the output features of a linear layer; its input is whole (gathered)."""

    def __init__(self, weight, bias, group, groups=1):
        super().__init__()
        self.group, self.weight = group, sliced(weight, 0, group.comm, groups)
        self.bias = None if bias is None else sliced(bias, 0, group.comm, groups)

    def forward(self, x):
        return ColumnParallelMatmul.apply(x, self.weight, self.bias, self.group)


class RowParallelLinear(nn.Module):
    """Y = f̄(X_r B_r) + b (ḡ with the sequence cut): rank r holds the rows of B for its slice X_r
    of the input features. The bias is whole on every rank and added once, after the sum."""

    def __init__(self, full, group):
        super().__init__()
        self.group, self.weight = group, sliced(full.weight, 1, group.comm)
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.group) + self.bias


def padded_vocab(world_size):
    return -(-VOCAB // world_size) * world_size


class VocabParallelEmbedding(nn.Module):
    """Rank r owns the rows of a range of the vocabulary: it looks up the tokens in its range,
    writes zeros for the others, and f̄ (or ḡ) sums: every token's row comes from one rank."""

    def __init__(self, weight, group):
        super().__init__()
        self.group, self.weight = group, sliced(weight, 0, group.comm)
        self.start = group.comm.Get_rank() * self.weight.size(0)

    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.start + self.weight.size(0))
        rows = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        return ReduceFromTensorParallel.apply(rows.masked_fill(outside[..., None], 0), self.group)


class PositionsOfTheSlice(nn.Module):
    """The position embedding, whole on every rank, looked up at this rank's T/N positions."""

    def __init__(self, full, comm):
        super().__init__()
        self.comm, self.weight = comm, nn.Parameter(full.weight.detach().clone())

    def forward(self, positions):
        return F.embedding(positions.chunk(self.comm.Get_size())[self.comm.Get_rank()], self.weight)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over the valid targets (not IGNORE) from each rank's slice of the logits:
    three allreduces of B x T numbers forward (max, target logit, sum of exps), none backward."""

    @staticmethod
    def forward(ctx, logits, target, comm):
        logits = logits.float()  # max, target logit and sum of exponentials in float32, bf16 or not
        per, start = logits.size(-1), comm.Get_rank() * logits.size(-1)
        padding = torch.arange(start, start + per, device=logits.device) >= VOCAB
        logits = logits.masked_fill(padding, float("-inf"))  # padded columns take no probability
        top = allreduce(logits.max(dim=-1).values.contiguous(), comm, MPI.MAX)
        shifted = logits - top.unsqueeze(-1)  # exp() stays <= 1
        owned = (target >= start) & (target < start + per)
        local = (target - start).clamp(0, per - 1)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        allreduce(picked, comm)  # the target's logit: from its one owner
        exps = shifted.exp()
        total = allreduce(exps.sum(dim=-1), comm)
        valid = target != IGNORE  # in no rank's range, no target logit: masked, loss and gradient 0
        ctx.count = valid.sum()  # local, no collective: every rank holds the same targets
        ctx.save_for_backward(exps / total.unsqueeze(-1) * valid.unsqueeze(-1), local, owned)
        return ((total.log() - picked) * valid).sum() / ctx.count

    @staticmethod
    def backward(ctx, dloss):
        softmax, local, owned = ctx.saved_tensors  # d loss / d logit = softmax - one-hot(target)
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -owned.unsqueeze(-1).to(softmax.dtype))
        return grad * (dloss / ctx.count), None, None


def shard_block(block, group):
    """Megatron's block, in place: attention f -> qkv columns (its heads) -> proj rows -> f̄, MLP f
    -> fc1 columns -> GELU -> fc2 rows -> f̄ (g, ḡ with the sequence cut); forward unchanged."""
    block.recompute = group.recompute  # --recompute: what backward computes again (Block.forward)
    block.qkv = ColumnParallelLinear(block.qkv.weight, block.qkv.bias, group, groups=3)  # q, k, v
    block.proj = RowParallelLinear(block.proj, group)
    block.heads //= group.comm.Get_size()
    block.fc1 = ColumnParallelLinear(block.fc1.weight, block.fc1.bias, group)
    block.fc2 = RowParallelLinear(block.fc2, group)
    return block


def shard_model(model, group):
    """Keep this rank's slice of the full model, in place: Megatron's layers take the place of the
    linears and the token embedding; LayerNorms and the position embedding stay whole."""
    padding = (0, 0, 0, padded_vocab(group.comm.Get_size()) - VOCAB)  # zero rows, as Megatron pads
    model.tokens = VocabParallelEmbedding(F.pad(model.tokens.weight.detach(), padding), group)
    if group.sequence_parallel:
        model.positions = PositionsOfTheSlice(model.positions, group.comm)
    for block in model.blocks:
        shard_block(block, group)
    model.out = ColumnParallelLinear(F.pad(model.out.weight.detach(), padding), None, group)
    return model


def sum_partial_gradients(model, comm):
    """With the sequence cut, each rank's gradient of a replicated parameter (LayerNorms,
    positions, row-parallel biases) covers its own positions alone: one allreduce sums them."""
    grads = [p.grad for p in model.parameters() if not hasattr(p, "partition")]
    total = allreduce(torch.cat([g.reshape(-1) for g in grads]), comm)
    for g, summed in zip(grads, total.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))


def global_grad_norm(model, comm):
    """The norm of the whole model's gradient in float32, each parameter counted once. The N ranks
    hold the model once between them: every rank adds the squares of its slices (the padding rows'
    gradient is zero), rank 0 alone those of the replicated parameters (equal on every rank; summed
    first if the sequence is cut), and one allreduce sums them: the same norm, and clip, on every
    rank. Counted on every rank, the replicas would count N times (Megatron-LM's #5916, #6470)."""
    held = [p for p in model.parameters() if hasattr(p, "partition") or comm.Get_rank() == 0]
    squares = torch.stack([p.grad.float().square().sum() for p in held]).sum().reshape(1)
    return allreduce(squares, comm).sqrt().item()  # the same on every rank


def train_step(model, optimizer, x, y, group, meter, max_norm=0.0, norm_comm=None):
    """One step: every rank the whole batch, its slice of every layer; meter counts activations; the
    gradients are clipped to max_norm (0: not). Returns the loss and the global norm, unclipped."""
    optimizer.zero_grad()
    bf16 = torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=group.precision == "bf16")
    with group.timeline.span("compute", "forward"), meter, bf16:  # matmuls on weights' bf16 copies
        loss = VocabParallelCrossEntropy.apply(model(x), y, group.comm)
    with group.timeline.span("compute", "backward"):
        loss.backward()
    if group.sequence_parallel:
        sum_partial_gradients(model, group.comm)
    norm = global_grad_norm(model, norm_comm or group.comm)  # of whole gradients: after their sum
    with group.timeline.span("compute", "optimizer"):
        scale = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s, the same on every rank
        for p in model.parameters() if max_norm and scale < 1 else []:
            p.grad.mul_(scale)
        optimizer.step()  # SGD and AdamW act element by element: each rank updates its slice alone
    return loss.item(), norm  # the same on every rank: made of allreduced numbers


# -----------------------------------------------------------------------------
# The model: a GPT-2 style character-level language model, plain (what one process trains)
# -----------------------------------------------------------------------------
def attend(qkv, heads):
    """Causal self-attention of `heads` heads, from queries, keys and values side by side."""
    b, t, c = qkv.size(0), qkv.size(1), qkv.size(2) // 3
    q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in qkv.split(c, dim=2))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // heads)
    future = torch.ones(t, t, dtype=torch.bool, device=qkv.device).triu(1)
    weights = scores.float().masked_fill(future, float("-inf")).softmax(dim=-1)  # float32 always
    return (weights @ v).transpose(1, 2).reshape(b, t, c)


class Block(nn.Module):
    """Pre-LayerNorm decoder block. GELU and LayerNorm keep training a smooth function of the
    weights, so float32 rounding differences between world sizes stay at rounding level."""
    recompute = "none"  # the plain model's; shard_block sets the run's --recompute

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv = nn.LayerNorm(hidden), nn.Linear(hidden, 3 * hidden)  # q, k, v stacked
        self.proj = nn.Linear(hidden, hidden)
        self.ln2, self.fc1 = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        qkv = self.qkv(self.ln1(x))  # selective: only q, k, v kept; the scores, softmax recomputed
        if self.recompute == "selective" and torch.is_grad_enabled():
            x = x + self.proj(checkpoint(attend, qkv, self.heads, use_reentrant=True))
        else:
            x = x + self.proj(attend(qkv, self.heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, --layers blocks, final LayerNorm, untied head."""

    def __init__(self, layers, hidden, heads, seq_len):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:  # full: only each block's input kept, the block computed again
            full = block.recompute == "full" and torch.is_grad_enabled()
            x = checkpoint(block, x, use_reentrant=True) if full else block(x)
        return self.out(self.norm(x))


def build_model(args, device="cpu"):
    """The full model from the seed: the same network at every world size (GPT-2's init)."""
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.hidden, args.heads, args.seq_len)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return model.to(device)


def make_optimizer(args, parameters):
    """--optimizer: SGD with momentum 0.9 (the default), or AdamW (float32 moments, weight decay on
    every parameter), its two moments cut as the parameters are: 8 bytes for each one a rank holds.
    AdamW's m / sqrt(v) makes the rounding in tiny gradients steps of order lr. Measured against one
    process: 1.0e-6 to 1.4e-6 at lr 1e-3 after 50 default steps (N = 2, 4, clip 1); the tests' tiny
    model, 3 steps: 3.5e-6 at lr 1e-3, 2.7e-5 to 4.5e-5 at 1e-2 (above TOLERANCE), 5e-4 at 0.1."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(parameters, args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return torch.optim.SGD(parameters, lr=args.lr, momentum=0.9)


def sharded_model(args, group, device):
    """The full model from the seed on every rank's CPU; each rank cuts its slice and moves only
    the slice to its device. Returns the slice, its optimizer and the size of the full model."""
    model = build_model(args)
    full_params = sum(p.numel() for p in model.parameters())
    model = shard_model(model, group).to(device)  # Module.to keeps the parameters' .partition
    return model, make_optimizer(args, model.parameters()), full_params


# -----------------------------------------------------------------------------
# The data: characters of Python's own source, batches a function of (seed, step)
# -----------------------------------------------------------------------------
@functools.cache
def load_text():
    """argparse.py, textwrap.py and shlex.py from this Python, bytes >= 128 replaced by '?'."""
    raw = b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in SOURCES)
    return torch.tensor([b if b < 128 else ord("?") for b in raw], dtype=torch.long)


def make_batch(seed, step, size, seq_len, ragged=False):
    """The global batch of one step: inputs and next-character targets, from (seed, step) alone.
    ragged: each sequence a document of 1 to T characters; past it, targets IGNORE and inputs 0."""
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
# The run: the step loop, the sample, and main() as a table of contents
# -----------------------------------------------------------------------------
def learning_rate(args, step):
    """A linear warm-up over --warmup-steps W, then --lr, or a cosine from it down towards lr / 10
    at --steps: a function of the step alone, so that a resumed run goes on where it was."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    low, progress = args.lr / 10, (step - args.warmup_steps) / (args.steps - args.warmup_steps)
    cosine = low + 0.5 * (args.lr - low) * (1 + math.cos(math.pi * progress))  # lr to lr / 10
    return args.lr if args.lr_schedule == "constant" else cosine


def train(args, comm, device, model, optimizer, group, meter, past=((), ())):
    """The steps after the `past` ones (losses and gradient norms from a checkpoint): every step's
    loss and norm, the same on every rank, and the new steps' timings."""
    (losses, norms), records = map(list, past), []
    norm_comm = group.comm if args.clip_grad else comm  # no clip: the norm is a report, not counted
    for step in range(len(losses), args.steps):
        start = time.perf_counter()
        x, y = (t.to(device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged))
        for settings in optimizer.param_groups:
            settings["lr"] = learning_rate(args, step)
        loss, norm = train_step(model, optimizer, x, y, group, meter, args.clip_grad, norm_comm)
        losses.append(loss), norms.append(norm), records.append(group.timeline.step_record(start))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print_progress(comm, args, step, loss, records[-1], norm)
        pieces = lambda: tensor_parallel_shard(comm, args, model, optimizer, losses, norms)
        checkpoint_if_due(comm, args, step, pieces, model_config(args))
    return losses, norms, records


@torch.no_grad()
def generate(model, comm, args, device):
    """Text sampled without gathering the logits: the argmax of logits / temperature + Gumbel
    noise is a draw from their softmax (the Gumbel-max trick). Every rank draws the same noise,
    one number per character of the vocabulary, so the text depends on the seed alone; each adds
    its columns' share, and two max-allreduces find the best score and its column."""
    gen = torch.Generator().manual_seed(args.seed)
    text, n = list(PROMPT.encode()), comm.Get_size()
    for _ in range(args.sample_chars):
        window = text[-args.seq_len:]  # the sequence cut wants N equal slices: padded at the end,
        padding = [0] * (-len(window) % n if args.sequence_parallel else 0)  # never attended to
        logits = model(torch.tensor([window + padding], device=device))[0, len(window) - 1].float()
        per, start = logits.numel(), comm.Get_rank() * logits.numel()
        noise = F.pad(-torch.empty(VOCAB).exponential_(generator=gen).log(), (0, per * n - VOCAB))
        score = logits / TEMPERATURE + noise[start:start + per].to(device)
        score[torch.arange(start, start + per, device=device) >= VOCAB] = float("-inf")
        best = allreduce(score.max().reshape(1), comm, MPI.MAX)
        column = torch.where(score.max() == best[0], start + score.argmax(), -1)
        text.append(int(allreduce(column.reshape(1).clone(), comm, MPI.MAX)[0]))
    return "".join(chr(c) if chr(c).isprintable() or c == 10 else "?" for c in text)


def main(argv=None, comm=MPI.COMM_WORLD):
    """Parse, set up, train, check, report. Returns the exit status of this rank."""
    try:
        args = parse_args(argv, comm.Get_size())
        check_paths(comm, args)
        run = setup(comm, args)
        counted = CountedComm(comm, run.timeline)  # every exchange counted and timed
        group = Group(counted, run.timeline, args.sequence_parallel, args.regather,
                      not args.no_overlap, args.recompute, args.precision)
        model, optimizer, full_params = sharded_model(args, group, run.device)
        past, resumed = ((), ()), None
        if args.resume:  # any world size: each rank asks for the blocks of the slices it holds now
            held = lambda manifest: blocks_held(model, optimizer, comm)
            resumed, blocks = load_checkpoint(comm, args.save, model_config(args), held, args.steps)
            past = restore(comm, model, optimizer, resumed, blocks) if blocks is not None else past
        print_header(comm, args, run, model, full_params, resumed)
        meter = SavedActivations(model)
        run.memory.reset()  # the peak of training, not that of building the model
        losses, norms, records = train(args, comm, run.device, model, optimizer, group, meter, past)
        run.memory.stop()
    except ConfigError as e:
        print0(comm, f"error: {e}", file=sys.stderr)
        return e.status
    traffic = dict(counted.calls), dict(counted.bytes)  # of training; the sample below adds its own
    if len(set(comm.allgather(replicated_checksum(model)))) != 1:
        raise RuntimeError("replicated parameters (LayerNorm, positions, biases) differ by rank")
    sample = generate(model, comm, args, run.device) if args.sample_chars else None
    diff = check(comm, args, losses, norms, model, run.device) if args.check else None
    if args.trace:
        write_trace(comm, run.timeline, args.trace)
    return report(comm, args, run, model, full_params, losses, norms, records,
                  traffic, meter, sample, diff)


# =============================================================================
# You may stop reading here: the strategy is all above. Below, first this file's own machinery
# (the check against single-process training, the report, its arguments and checkpoints), then
# the machinery that every strategy file repeats word for word: the summary, checkpoints and
# signals, counters, timeline and memory, device and MPI setup, arguments.
# =============================================================================

# --- This file's own: the check against single-process training, the report, arguments, checkpoints
# What the reference shares with the ranks, and why each is harmless: GPT, Block, attend and
# build_model (the network; shard_model swaps its linears and token embedding for the parallel
# layers, and Block.forward on a rank's 1/N of the heads must add up to all of them, which is
# what is checked), make_batch, make_optimizer (torch's SGD or AdamW: the recipe's settings stand on
# both sides). Its own: nn.Linear, nn.Embedding, F.cross_entropy on whole logits (ignore_index=IGNORE), the schedule
# written out step by step (not learning_rate: a bug there shows), the norm and the clip of
# torch.nn.utils.clip_grad_norm_ (which returns the norm); never a parallel layer at size 1, f, f̄,
# g, ḡ, the vocabulary-parallel loss or global_grad_norm. join_slices undoes the cut with its own
# code (cat of chunks), and the losses and norms, compared first, come from the uncut model: a wrong
# cut changes what the ranks train.
def reference_training(args, device=torch.device("cpu")):
    """The same steps and recipe in one plain process on `device` (rank 0's): the whole model, on the whole batch."""
    model, lr, warmup = build_model(args, device), args.lr, args.warmup_steps
    optimizer, losses, norms = make_optimizer(args, model.parameters()), [], []
    decay = [lr if args.lr_schedule == "constant" else lr / 10 + 0.5 * (lr - lr / 10) * (
        1 + math.cos(math.pi * k / max(1, args.steps - warmup))) for k in range(args.steps - warmup)]
    schedule = [lr * (k + 1) / warmup for k in range(warmup)] + decay  # written out, not learning_rate's
    for step in range(args.steps):
        x, y = (t.to(device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or math.inf).item())
        optimizer.param_groups[0]["lr"] = schedule[step]  # its one group
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, model

def join_slices(pieces, partition):  # the full tensor from every rank's slice of it, in rank order: sliced's inverse
    dim, groups = partition
    return torch.cat([torch.cat([p.chunk(groups, dim)[k] for p in pieces], dim) for k in range(groups)], dim)

def gather_model(model, comm, root=0):
    """{name: full tensor} of every parameter on root's CPU (padded vocabulary), None elsewhere: the job's only one."""
    full = {}
    for name, p in model.named_parameters():
        local = p.detach().cpu().contiguous()
        if hasattr(p, "partition"):
            pieces = local.new_empty((comm.Get_size(), *local.shape)) if comm.Get_rank() == root else None
            comm.Gather(local, pieces, root=root)
            local = None if pieces is None else join_slices(pieces.unbind(0), p.partition)
        full[name] = local
    return full if comm.Get_rank() == root else None

# The gradient norms count as the losses do, but as |norm - reference| / max(reference, 1): bf16
# rounds a norm in proportion to its size (a norm of 2.97 came 1.7e-2 apart, 0.6%, in model_parallel.py's
# 60 default steps with AdamW at N = 1; docs/results.md, "The recipe at each file's default sizes").
def check(comm, args, losses, norms, model, device=torch.device("cpu")):
    """Rank 0 gathers the slices, trains the reference on its device (the others wait, not spinning): the max |diff|."""
    full, diff = gather_model(model, comm), None
    if comm.Get_rank() == 0:
        ref_losses, ref_norms, ref_model = reference_training(args, device)  # less the padding rows, below
        full = {name: t.narrow(0, 0, ref_model.get_parameter(name).size(0)) for name, t in full.items()}
        scaled = [(n / max(r, 1), r / max(r, 1)) for n, r in zip(norms, ref_norms)]  # the norms: relative (above)
        diff = max_difference(losses + [n for n, _ in scaled], full, ref_losses + [r for _, r in scaled], ref_model)
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)
    return comm.bcast(diff, root=0)

def replicated_checksum(model):  # a bitwise fingerprint of the parameters every rank holds whole
    return zlib.crc32(b"".join(p.detach().cpu().contiguous().numpy().tobytes()
                               for p in model.parameters() if not hasattr(p, "partition")))

class SavedActivations:
    """Entered around a forward: the bytes of the tensors autograd saves for backward (each storage once,
    parameters and autocast's bf16 copies of them left out: a copy's grad_fn is ToCopyBackward0 whose next
    function is the parameter's AccumulateGrad, or a view of one), held until backward; the first step's (alike after)."""

    def __init__(self, model):
        self.parameters, self.bytes = {p.untyped_storage().data_ptr() for p in model.parameters()}, 0

    def pack(self, t):
        base = t if t._base is None else t._base  # the tensor a view (a weight's transpose) looks at
        copied = base.grad_fn.next_functions[0][0] if type(base.grad_fn).__name__ == "ToCopyBackward0" else None
        storage = getattr(copied, "variable", t).untyped_storage()  # a parameter's copy counts as it
        self.storages[storage.data_ptr()] = 0 if storage.data_ptr() in self.parameters else storage.nbytes()
        return t

    def __enter__(self):
        self.storages, self.hooks = {}, contextlib.nullcontext() if self.bytes else torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()

    def __exit__(self, *exception):
        self.hooks.__exit__(*exception)
        self.bytes = max(self.bytes, sum(self.storages.values()))

def activation_bytes_formula(args, world_size, sequence_parallel, regather):
    """Bytes autograd saves per rank in a step: the docstring's formula (e bytes an element) and, beyond Korthikanti
    et al.'s terms, LayerNorm's mean and 1/std (2 x 4sb each), the causal mask (s² bytes; not with selective or
    full), the final LayerNorm, the head's input, the loss's softmax over its vocabulary, 8-byte ids, 1-byte masks."""
    B, T, h, a, L, N = args.batch_size, args.seq_len, args.hidden, args.heads, args.layers, world_size
    cut, gathered, e = (N if sequence_parallel else 1), (N if regather else 1), 2 if args.precision == "bf16" else 4
    attention = ((4 if e == 4 else 6) * a * B * T * T / N + T * T) * (args.recompute == "none")  # softmax, mask
    block = (8 * B * T * h + 16 * B * T) / cut + 2 * e * B * T * h / gathered + 12 * e * B * T * h / N + attention
    block = 4 * B * T * h / cut if args.recompute == "full" else block
    head = (4 * B * T * h + 8 * B * T) / cut + e * B * T * h / gathered + 4 * B * T * padded_vocab(N) / N
    return L * block + head + 2 * (8 + 1) * B * T + 8 * T  # + indices and masks of the loss and embeddings

def communication_formula(args, world_size):
    """Collectives and bytes handed to MPI per step (the docstring's formulas), and the bytes a ring
    moves in and out of each rank. Sums in float32; all-gathers of e bytes an element but one."""
    L, N, T, h, clip = args.layers, world_size, args.seq_len, args.hidden, int(args.clip_grad > 0)
    loss = 3 * 4 * args.batch_size * T + 4 * clip  # the loss's 3 allreduces of BT numbers, the norm's of 1
    A, e, again = 4 * args.batch_size * T * h, 2 if args.precision == "bf16" else 4, L * (args.recompute == "full")
    sums = 4 * L + 2 + 2 * again  # f̄ (ḡ) forward, f (g) backward, the forward's f̄ (ḡ) again with full
    if not args.sequence_parallel:
        return sums + 3 + clip, sums * A + loss, 2 * (N - 1) / N * (sums * A + loss)
    gathers = 4 * L + 1 + (2 * L + 1) * args.regather + 2 * again  # of eA/4N; + the embedding's ḡ, A/N
    handed, grads = (gathers * e + 4) * A // (4 * N), 4 * (6 * L + 2 + T) * h  # + the replicated gradients
    return (sums + gathers + 5 + clip, sums * A + handed + loss + grads,
            (N - 1) / N * sums * A + (N - 1) * handed + 2 * (N - 1) / N * (loss + grads))

def posted_before_weight_grad(events):
    """[n, total]: of the input gradients' exchanges in the spans (name, cat, begin, end), those posted before a
    weight-gradient matmul began and waited for after it ended; a kind's k-th post pairs with its k-th wait."""
    matmuls = [(begin, end) for name, _, begin, end in events if name == "weight grad"]
    n = total = 0
    for kind in ("Iallreduce", "Ireduce_scatter_block"):
        posts = sorted(end for name, _, _, end in events if name == kind)
        waits = sorted(begin for name, _, begin, _ in events if name == kind + " wait")
        total += len(posts)
        n += sum(any(posted <= b and e <= waited for b, e in matmuls) for posted, waited in zip(posts, waits))
    return [n, total]

def model_config(args):  # the model and optimizer a checkpoint holds, whatever the grid (no world size, no padding)
    return {"model": "GPT", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "seq_len": args.seq_len, "vocab": VOCAB, "optimizer": args.optimizer}

# Checkpoints (--save, --resume) hold the whole model's tensors by the names one process gives them, each rank
# writing its blocks: rows of the column-parallel weights and biases, columns of the row-parallel ones, its
# vocabulary rows less the padding (qkv seen as (3, h, ..), q, k, v stacked: the reference's numbers in its order,
# and a rank's heads one block), SGD's momentum or AdamW's moments beside each; rank 0 alone writes the replicated
# ones. A resume at any N, sequence cut or not, asks for the blocks its ranks hold at that N, cut from whichever
# files overlap them; padding rows start at 0.
VOCABULARY_ROWS = ("tokens.weight", "out.weight")  # padded to a multiple of N: only VOCAB rows are saved
# A parameter's optimizer state as a checkpoint names it (<kind>/<name>, cut as the parameter), and as torch does
MOMENTS = {torch.optim.SGD: {"momentum": "momentum_buffer"},
           torch.optim.AdamW: {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}

def place_in_whole(name, p, comm):
    """Where this rank's slice of parameter `name` lies in the whole tensor a checkpoint keeps, the inverse of
    sliced(): (p's shape in the whole's dimensions, the whole's shape, the offset, the size there). q, k and v get
    a dimension of their own, (3h/N, ..) seen as (3, h/N, ..), so that a rank's heads are one block (the whole
    (3, h, ..) holds the reference's (3h, ..) in order); the vocabulary's whole is its VOCAB rows, no padding."""
    view = list(p.shape)
    if not hasattr(p, "partition"):
        return view, view, [0] * len(view), view
    dim, groups = p.partition
    if groups > 1:
        view, dim = view[:dim] + [groups, view[dim] // groups] + view[dim + 1:], dim + 1
    offset = [comm.Get_rank() * n if d == dim else 0 for d, n in enumerate(view)]
    whole, size = [comm.Get_size() * n if d == dim else n for d, n in enumerate(view)], list(view)
    if name in VOCABULARY_ROWS:  # rows [r per, (r + 1) per) of the padded vocabulary, the real ones < VOCAB
        whole[0], size[0] = VOCAB, max(0, min(view[0], VOCAB - offset[0]))
    return view, whole, offset, size

def block_of(t, view, size):  # what a checkpoint holds of t (a slice or its optimizer state): all but padding rows
    return t.view(view)[tuple(slice(0, n) for n in size)]

def tensor_parallel_shard(comm, args, model, optimizer, losses, norms):
    """This rank's pieces: its slices' blocks and their optimizer state (replicas: rank 0's); rank 0's state."""
    pieces, kinds = {}, MOMENTS[type(optimizer)]
    for name, p in model.named_parameters():
        view, whole, offset, size = place_in_whole(name, p, comm)
        if math.prod(size) == 0 or (not hasattr(p, "partition") and comm.Get_rank() != 0):
            continue  # padding rows alone (rank 13 of N = 14), or a replica rank 0 writes
        for key, t in [(name, p)] + [(f"{k}/{name}", optimizer.state[p].get(field)) for k, field in kinds.items()]:
            if t is not None:
                pieces[key] = piece(block_of(t.detach(), view, size), whole, offset)
    step = {"adamw_step": int(optimizer.state[p]["step"])} if "step" in optimizer.state[p] else {}  # of any p
    grid = {"world_size": comm.Get_size(), "sequence_parallel": args.sequence_parallel}
    state = {"losses": list(losses), "grad_norms": list(norms), "grid": grid, **step}  # what was trained so far
    return pieces, state if comm.Get_rank() == 0 else None

def blocks_held(model, optimizer, comm):
    """load_checkpoint's wanted: the blocks of this rank's slices at this N and of their optimizer state."""
    places = {name: place_in_whole(name, p, comm)[1:] for name, p in model.named_parameters()}
    return {key: region(*place) for name, place in places.items() if math.prod(place[2])
            for key in (name, *(f"{kind}/{name}" for kind in MOMENTS[type(optimizer)]))}

@torch.no_grad()
def restore(comm, model, optimizer, manifest, blocks):
    """Every slice and its optimizer state from its blocks, padding rows zero; returns the losses and norms so far."""
    state, kinds = manifest["state"], MOMENTS[type(optimizer)]
    for name, p in model.named_parameters():
        view, _, _, size = place_in_whole(name, p, comm)
        optimizer.state[p].update({field: torch.zeros_like(p) for field in kinds.values()})  # padding: zero gradient
        for key, t in [(name, p.zero_())] + [(f"{k}/{name}", optimizer.state[p][field]) for k, field in kinds.items()]:
            if key in blocks:
                block_of(t, view, size).copy_(blocks[key])
        if "adamw_step" in state:  # torch keeps it for each parameter, as a float32 tensor on the CPU
            optimizer.state[p]["step"] = torch.tensor(float(state["adamw_step"]))
    return state["losses"], state["grad_norms"]

def print_header(comm, args, run, model, full_params, resumed):
    world_size, h, padded = comm.Get_size(), args.hidden, padded_vocab(comm.Get_size())
    if resumed:
        print0(comm, f"resumed from {args.save} at step {resumed['step']} (written by {resumed['world_size']} ranks)")
    stream = (f"cut along the sequence between the regions ({args.seq_len // world_size} positions a rank"
              f"{', gathered again in backward' if args.regather else ''})" if args.sequence_parallel else "whole")
    print0(comm, *run.header,
           f"model: GPT, {args.layers} blocks, hidden {h}, {args.heads} heads, {full_params:,} parameters; "
           f"this rank holds {sum(p.numel() for p in model.parameters()):,}",
           f"each rank: {args.heads // world_size} of {args.heads} heads, {4 * h // world_size} of {4 * h} "
           f"MLP features, {padded // world_size} of {padded} vocabulary rows | batch {args.batch_size} x "
           f"{args.seq_len} characters{f' (--ragged: documents of 1 to {args.seq_len}, the loss a mean over their targets)' if args.ragged else ''}, {stream} | input gradients exchanged "
           f"{'after the weight gradient (--no-overlap)' if args.no_overlap else 'posted before the weight gradient, waited after'}",
           f"text: {' + '.join(s + '.py' for s in SOURCES)} of Python {sys.version.split()[0]} "
           f"({len(load_text()):,} characters) | vocabulary {VOCAB} ASCII codes"
           + (f", padded to {padded} (a multiple of {world_size}, as Megatron pads; the padding is "
              f"masked out of the softmax)" if padded != VOCAB else ""))

def report(comm, args, run, model, full_params, losses, norms, records, traffic, meter, sample, diff):
    """The file's summary lines and --json keys, then finish(); returns the exit status."""
    world_size, steps_run = comm.Get_size(), max(1, len(records))
    calls, volume = ({name: n / steps_run for name, n in counts.items()} for counts in traffic)
    formula_calls, formula_bytes, ring = communication_formula(args, world_size)
    modes = {"plain": (False, False), "sequence_parallel": (True, False), "regather": (True, True)}
    formulas = {mode: activation_bytes_formula(args, world_size, *flags) for mode, flags in modes.items()}
    mode = "regather" if args.regather else "sequence_parallel" if args.sequence_parallel else "plain"
    saved = comm.allgather(meter.bytes)
    overlap = {"exchanges_under_weight_grad": posted_before_weight_grad(run.timeline.step_events)}
    by_name, full = ", ".join(f"{name} {n:g}" for name, n in sorted(calls.items())), args.recompute == "full"
    formula = ("8L + 8" + " + 2L + 1" * args.regather + " + 4L" * full if args.sequence_parallel
               else "4L + 5" + " + 2L" * full) + " + 1" * (args.clip_grad > 0)  # + the norm's with a clip
    lines = [f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f}; a uniform guess is ln {VOCAB} = "
             f"{math.log(VOCAB):.4f}); clipped at {sum(n > args.clip_grad > 0 for n in norms)} of {len(norms)} steps",
             f"collectives per step: {sum(calls.values()):g} ({by_name}); formula "
             f"{formula} = {formula_calls}", f"bytes per step handed to MPI: {sum(volume.values()):,.0f}; formula "
             f"{formula_bytes:,.0f}; a ring moves {ring:,.0f} bytes in and out of each rank",
             f"activations saved for backward per rank ({args.precision}, --recompute {args.recompute}): {' | '.join(f'{b / 1e6:.3f}' for b in saved)} MB measured; "
             f"formula {formulas[mode] / 1e6:.3f} MB ({', '.join(f'{m} {f / 1e6:.3f}' for m, f in formulas.items())})",
             f"replicated parameters (LayerNorms, positions, row-parallel biases): bitwise identical on all "
             f"{world_size} ranks"]
    if sample is not None:
        # a young model writes long runs of indentation: each run of 3+ spaces printed as its length
        shown = re.sub(" {3,}", lambda run: f"[{len(run.group())} spaces]", sample)
        lines += [f"sample ({args.sample_chars} characters after {PROMPT!r}, temperature {TEMPERATURE}; "
                  f"[n spaces]: a run of n spaces):", *("  | " + line for line in shown.split("\n"))]
    return finish(comm, args, run, losses, records, diff, "losses, gradient norms, parameters", lines, {
        "comm_bytes_per_step": sum(volume.values()), "collectives_per_step": sum(calls.values()),
        "collectives_formula": formula_calls, "comm_bytes_formula": formula_bytes, "collectives_by_name": calls,
        "ring_bytes_per_rank": ring, "activation_bytes_per_rank": saved, "activation_bytes_formula": formulas[mode],
        "activation_bytes_formula_by_mode": formulas, "overlap": overlap, "sequence_parallel": args.sequence_parallel,
        "regather": args.regather, "ragged": args.ragged, "parameters": full_params, "padded_vocab": padded_vocab(world_size),
        "parameters_this_rank": sum(p.numel() for p in model.parameters()), "sample": sample, "grad_norms": norms})

def parse_args(argv, world_size):
    p = common_arguments("Tensor parallelism over MPI (Megatron-LM): a small GPT on Python's own source.",
                         steps=50, batch_size=16, lr=1e-3, log_every=10)
    p.add_argument("--layers", type=COUNT, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=COUNT, default=64, help="hidden size")
    p.add_argument("--heads", type=COUNT, default=4, help="attention heads")
    p.add_argument("--seq-len", type=COUNT, default=64, help="characters per sequence")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="cut the stream along the sequence between the tensor-parallel regions")
    p.add_argument("--regather", action="store_true",
                   help="with --sequence-parallel: keep the input's slice, gather it again in backward")
    p.add_argument("--no-overlap", action="store_true",
                   help="baseline: exchange the input gradient after the weight gradient, not during it")
    p.add_argument("--sample-chars", type=COUNT_OR_0, default=120, help="characters of text the trained model writes at the end (0: none)")
    p.add_argument("--ragged", action="store_true", help="documents of uneven length: the loss over the valid targets")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw",
                   help="SGD with momentum 0.9, or AdamW (betas 0.9, 0.95, eps 1e-8, weight decay 0.1)")
    p.add_argument("--clip-grad", type=checked(float, lambda v: v >= 0 and math.isfinite(v), "0 or more"), default=1.0,
                   metavar="MAX_NORM", help="clip the global gradient norm to MAX_NORM, as clip_grad_norm_ (0: off)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="after the warm-up: --lr throughout, or a cosine from --lr towards lr / 10 at --steps")
    p.add_argument("--warmup-steps", type=COUNT_OR_0, help="linear warm-up: step s gets lr (s + 1) / W (default: --steps / 10)")
    args = check_common(p.parse_args(argv))
    args.warmup_steps = args.steps // 10 if args.warmup_steps is None else args.warmup_steps  # a tenth by default
    if args.warmup_steps >= args.steps:  # a warm-up that takes every step
        raise ConfigError(f"--warmup-steps {args.warmup_steps} must be below --steps {args.steps}: fewer or more steps")
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} does not split into {args.heads} heads of equal "
                          f"size; use a multiple of {args.heads}, e.g. {16 * args.heads}")
    if args.heads % world_size:  # whole heads per rank; then hidden and 4 x hidden split too
        works, size = [n for n in range(1, args.heads + 1) if args.heads % n == 0], args.hidden // args.heads
        raise ConfigError(f"--heads {args.heads} does not split over {world_size} ranks (each rank "
                          f"computes whole heads); world sizes that work: {', '.join(map(str, works))}; "
                          f"or for {world_size} ranks e.g. --heads {world_size} --hidden {world_size * size}")
    if args.seq_len >= len(load_text()):
        raise ConfigError(f"--seq-len {args.seq_len} must be shorter than the text ({len(load_text())})")
    if args.regather and not args.sequence_parallel:
        raise ConfigError("--regather gathers the sequence's slices again in backward: add --sequence-parallel")
    if args.sequence_parallel and args.seq_len % world_size:
        fit = max(world_size, args.seq_len // world_size * world_size)
        raise ConfigError(f"--sequence-parallel cuts --seq-len {args.seq_len} into {world_size} equal slices; "
                          f"use a multiple of {world_size}, e.g. --seq-len {fit}")
    return args

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
