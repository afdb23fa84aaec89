r"""Context parallelism over MPI: the sequence split; attention by ring, all-gather or all-to-all.

What is split: the sequence. Every rank holds the whole model and every sequence of the batch, but
only T/N of each sequence's positions (N = the world size). What a transformer does token by token
(embeddings, LayerNorms, linears, MLP, loss) needs nothing from the other ranks; attention does: a
query attends to every earlier key. So keys and values travel round a ring of ranks a block at a
time while each rank computes its queries against the block in hand, merging partial results by
the softmax's log-sum-exp (Liu et al. 2023, "Ring Attention"); or the ranks trade the sequence split
for a split of the heads and back (Jacobs et al. 2023, DeepSpeed-Ulysses).

  --layout zigzag (the default): 2N chunks, rank r holds r and 2N-1-r (N = 4: chunks 0..7 on ranks
  0 1 2 3 3 2 1 0); --layout contiguous: rank r holds [rT/N, (r+1)T/N). Causal work (# a block of
  keys computed, \ the diagonal, . skipped: all masked):
     contiguous, blocks of T/N            zigzag, chunks of T/2N: every rank the same work
     keys:    0 1 2 3                     keys:     0 1 2 3 4 5 6 7
     rank 0   \ . . .                     rank 0 0  \ . . . . . . .     r x B^2 + B(B+1)/2 pairs
     rank 1   # \ . .                            7  # # # # # # # \     for rank r, contiguous;
     rank 2   # # \ .                     rank 3 3  # # # \ . . . .     (2N-1)c^2 + c(c+1) on every
     rank 3   # # # \                            4  # # # # \ . . .     rank, zigzag (c = T/2N)
  ring attention, one layer on rank r, N steps (--cp-comm ring, the default):
     step i: the K/V block of rank r-i is in hand: Irecv the next from rank r-1, Isend this one to
             rank r+1 (double-buffered), compute the local queries against it under the causal mask
             of the global positions (skipped when all masked), Waitall and swap. Whether the bytes
             move during the compute is the MPI's doing (MPICH's default: only inside MPI calls).
             rank 0 --K,V--> rank 1 --K,V--> rank 2 --K,V--> rank 3 --K,V--> rank 0
     merge:  out_b, lse_b: the softmax over the block's keys, lse_b = log sum_j e^s_j and out_b =
             sum_j e^(s_j - lse_b) v_j. Over both sets of keys the softmax is their mean weighted
             by e^lse: out <- (e^lse out + e^lse_b out_b) / (e^lse + e^lse_b) = out - sigmoid(lse_b - lse)
             (out - out_b), and lse <- log(e^lse + e^lse_b) = lse - logsigmoid(lse - lse_b)
     backward: the K/V blocks go round again, the scores recomputed from the saved lse (no weights
             kept, as FlashAttention); dQ adds up at home; a block's dK/dV goes with it, each rank
             adding its share:  rank 0 +--> rank 1 +--> rank 2 +--> rank 3 +--> rank 0 (N hops)
  --cp-comm allgather (Llama 3's variant): Allgather K and V, one mask from the global positions;
     backward gathers them again and Reduce_scatter_block sums dK and dV back to their owners.
  --cp-comm alltoall (DeepSpeed-Ulysses): Alltoall Q, K and V from a sequence split to a head split,
       before: rank r [ heads 0..H-1 | its T/N positions ]   after: rank r [ heads rH/N.. | all T ]
     causal attention of H/N heads over all T (the same work in either layout), an Alltoall of the
     output back; backward mirrors it (dO in; dQ, dK, dV back). N must divide the heads.

Precision: --precision bf16 runs forward and loss under torch.autocast(bfloat16), on the ranks and
in the one-process reference. Parameters stay float32 (the master weights; optimizer state too): a
linear multiplies a bf16 copy of its weight, kept for backward; gradients land and are summed in
float32 (Megatron's default: bf16 would halve 4P below, but round small terms away, and MPI cannot
sum bf16, which it passes as bytes). What only moves is bf16: K/V round the ring, the Allgathers,
the Alltoalls. Float32: every sum (dQ, dK/dV going home, Reduce_scatter_block, Allreduce), the
scores, max and lse, the merged output, the residual stream (so LayerNorm's statistics), the loss.
Bytes handed to MPI per step and rank (L blocks, b sequences of T, hidden h, P parameters,
S = b(T/N)h values: one rank's K or V of one layer, e bytes each: 4, or 2 in bf16; R = 1 when
--recompute reruns the forward's exchange in backward (selective, full), else 0):
  ring:      L x 2S x ((2+R)e(N-1) + 4N): K/V N-1 hops forward (twice if R) and backward, dK/dV N
             hops home in float32 (at N = 1, one to itself), in L x (3N-2 + R(N-1)) Isends
  allgather: L x 2S x ((2+R)e + 4N): 2S to each of 2+R Allgathers, the float32 2SN of dK, dV to a
             Reduce_scatter_block (a ring algorithm forwards what it gathers: (N-1) x 2S a gather)
  alltoall:  L x 4S x (2+R)e: Q, K, V in, the output back (again if R), dO in and dQ, dK, dV back;
             (N-1)/N leaves the rank. As T grows with N, S stays, where the ring's bytes grow with N
  all:       + 4P (the gradients' Allreduce: ranks saw other tokens of the same sequences) + 8 (the
             loss, float64: the b x T tokens' summed losses) + 8 if --ragged (the count); norm: none
Recomputation: torch.utils.checkpoint, reentrant: it keeps fn's inputs by save_for_backward (there
the saved-tensor hooks that measure activations see them; the non-reentrant form hides them), runs
fn without autograd, and in backward reruns it under the forward's autocast and backpropagates.
--recompute full: a block keeps its input alone; selective: attention's core (scores, mask, softmax,
times V) keeps q, k, v. No variant keeps attention's weights, which Korthikanti et al.'s selective
drops (backward recomputes them from lse): selective here drops only the output and lse, and pays
with attention's forward again in backward, exchanges included (R above): a poor trade here.
Memory, bytes saved for backward per rank and block (s = T/N, H heads; 1/N of one process's):
  none bsh(8 + 15e) + 16bs + 4Hbs: float32 the LayerNorms' inputs, mean, rstd, lse; e: q, k, v, the
  output, the inputs of qkv, proj and fc1, GELU's and fc2's (4h each); selective bsh(8 + 14e) + 16bs
  (no output, no lse); full 4bsh. Once: bsh(4 + e) + 4bsV + 24bs + 8s + 4 (head, log-softmax, ids)
When to choose it: a sequence whose activations one device cannot hold, even with tensor parallelism
(which stops at the heads and the node). The ring has no limit in N, can hide its messages behind
compute and holds one block of scores, (T/N)^2 H; the all-to-all moves fewer bytes as N grows but
exposes them and stops at N = heads (so: all-to-all in a node, ring across), T^2 H/N scores; the
all-gather is the simplest, and holds all of K and V and T/N x T x H scores.
The network: tensor_parallel.py's GPT-2 character model, on Python's argparse, textwrap, shlex.
Run:  mpirun -np 4 python context_parallel.py     (add --help; --precision bf16, --recompute full)
The merge alone, no MPI:  python -c "import context_parallel as cp; cp.blockwise_softmax_demo()"
"""
import argparse
import collections
import contextlib
import ctypes
import errno
import hashlib
import importlib.util
import io
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
import mpi4py

mpi4py.rc.initialize = False  # MPI starts in start_mpi(), once this rank's GPU is chosen
mpi4py.rc.finalize = True  # and ends when the process does
from mpi4py import MPI  # noqa: E402

STRATEGY = "context_parallel"
# Largest |difference| allowed against one process; a nudge of 1.5x it is reported (tests). float32,
# 50 steps of 2 blocks, hidden 32, 48 positions: at most 8.0e-7 (ring, all-gather: N = 1 to 4, both
# layouts; all-to-all 7.2e-7 at N = 1, 2, 4). bf16 against bf16: 1.9e-3 over the tests' runs (3, 4 steps,
# N = 1 to 4), the default 40 steps 7.8e-3, 1.1e-2 at N = 2, 4 (SGD: 5.9e-3, 5.3e-3; gradients / N: 0.2)
TOLERANCE, TOLERANCE_BF16 = 2e-5, 2e-2
POLL_S = 1e-4  # a rank waiting on MPI sleeps between polls, leaving the core to those that compute
TAG_KV, TAG_GRAD = 1, 2  # a K/V block, a dK/dV accumulator: kept apart between one pair of ranks

# -----------------------------------------------------------------------------
# The strategy: the sequence split, ring attention forward and backward, all-gather, all-to-all
# -----------------------------------------------------------------------------
class RingExchange:
    """Isend of `send` to the next rank and Irecv into `recv` from the previous, posted at once;
    wait() completes both (requests are waited in the order they were posted) and returns recv."""

    def __init__(self, comm, send, recv, tag):
        rank, size = comm.Get_rank(), comm.Get_size()
        self.recv, self.buffers = recv, (mpi_buffer(send), receive_buffer(recv))  # until wait()
        self.requests = [comm.Irecv(self.buffers[1], source=(rank - 1) % size, tag=tag),
                         comm.Isend(self.buffers[0], dest=(rank + 1) % size, tag=tag)]

    def wait(self):
        for request in self.requests:  # Waitall
            request.Wait()
        self.requests = []
        return from_mpi(self.recv, self.buffers[1])

def shard_positions(seq_len, world_size, layout):
    """Row r: the global positions rank r holds. zigzag: chunks r and 2N-1-r of 2N, so that every
    rank has early and late positions alike; contiguous: the r-th block of T/N."""
    if layout == "contiguous":
        return torch.arange(seq_len).view(world_size, -1)
    chunks = torch.arange(seq_len).view(2 * world_size, -1)
    return torch.stack([torch.cat([chunks[r], chunks[-1 - r]]) for r in range(world_size)])

def block_plan(query_positions, key_positions, device):
    """What to compute of one block: the queries that see any of its keys (rows), the keys that
    any query sees (cols), the causal mask of those (None: all visible) and its visible pairs.
    None when the block is all masked (the keys all come after the queries): skip it."""
    visible = key_positions.view(1, -1) <= query_positions.view(-1, 1)
    rows, cols = visible.any(1).nonzero().flatten(), visible.any(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    seen = visible[rows][:, cols]
    return types.SimpleNamespace(rows=rows.to(device), cols=cols.to(device), pairs=int(seen.sum()),
                                 mask=None if seen.all() else (~seen).to(device))

def wide(dtype):
    """The dtype of the softmax's statistics and every sum: float32 for bf16 values, else theirs."""
    return torch.promote_types(dtype, torch.float32)

def block_attention(q, k, v, plan):
    """The plan's queries against one block of keys: the block's output and log-sum-exp, both wide
    (the matmuls in the dtype of q, k, v, bf16 under autocast; the scores and softmax wide)."""
    scores = q[:, :, plan.rows] @ k[:, :, plan.cols].transpose(-2, -1)
    scores = scores.to(wide(q.dtype)) / math.sqrt(q.size(-1))
    if plan.mask is not None:
        scores = scores.masked_fill(plan.mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return ((scores - lse.unsqueeze(-1)).exp().to(v.dtype) @ v[:, :, plan.cols]).to(lse.dtype), lse

def merge(out, lse, block_out, block_lse, rows):
    """Fold one block's partial attention into the running one, on the rows it covers, in the
    stable form: sigmoid and logsigmoid never exponentiate a large number."""
    o, s = out[:, :, rows], lse[:, :, rows]
    out[:, :, rows] = o - torch.sigmoid(block_lse - s).unsqueeze(-1) * (o - block_out)
    lse[:, :, rows] = s - F.logsigmoid(s - block_lse)

def blockwise_softmax_demo(blocks=4, t=12, d=8, seed=0):
    """No MPI: causal attention of t positions over `blocks` blocks of keys, one by one, merged as
    the ring merges them, against one softmax over the whole sequence. Returns the largest gap."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, t, d, generator=g, dtype=torch.float64) for _ in range(3))
    positions, (first, *rest) = torch.arange(t), torch.arange(t).chunk(blocks)
    out, lse = block_attention(q, k[:, :, first], v[:, :, first], block_plan(positions, first, q.device))
    for keys in rest:
        plan = block_plan(positions, keys, q.device)  # the queries that see any of these keys
        merge(out, lse, *block_attention(q, k[:, :, keys], v[:, :, keys], plan), plan.rows)
    gap = (out - causal_attention(q, k, v)).abs().max().item()
    print(f"causal attention over {blocks} blocks of keys, merged, against one softmax of all {t}: "
          f"largest difference {gap:.1e}")
    return gap

def block_gradients(q, k, v, dout, lse, delta, plan, dq, dk, dv):
    """Backward of one block, the scores recomputed and normalized by the final lse (so they are
    the block's share of the whole softmax): adds into dq, and into the block's dk and dv, which
    are wide, as the softmax's algebra; the matmuls in the dtype of q, k, v, as the forward's."""
    scale, rows, cols, low, w = 1 / math.sqrt(q.size(-1)), plan.rows, plan.cols, q.dtype, lse.dtype
    qr, kc, vc, dor = q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows].to(q.dtype)
    scores = (qr @ kc.transpose(-2, -1)).to(w) * scale
    if plan.mask is not None:
        scores = scores.masked_fill(plan.mask, float("-inf"))
    weights = (scores - lse[:, :, rows].unsqueeze(-1)).exp()
    dv.index_add_(2, cols, (weights.to(low).transpose(-2, -1) @ dor).to(w))
    dscores = weights * ((dor @ vc.transpose(-2, -1)).to(w) - delta[:, :, rows].unsqueeze(-1)) * scale
    dq.index_add_(2, rows, (dscores.to(low) @ kc).to(w))
    dk.index_add_(2, cols, (dscores.to(low).transpose(-2, -1) @ qr).to(w))

def softmax_delta(dout, out):
    """Softmax's backward is dS = P (dP - rowsum(P dP)) with dP = dO V^T. Its row sum needs every
    block's P, but rowsum(P dO V^T) = rowsum(dO (P V)) = rowsum(dO O): one number per query, from
    the output (FlashAttention's D), computed once before the blocks go round."""
    return (dout.to(wide(out.dtype)) * out.to(wide(out.dtype))).sum(-1)

class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's keys, which come round
    the ring of cp.comm one block at a time. q, k, v: b x heads x T/N x d. Returns out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, cp):
        size, rank = cp.comm.Get_size(), cp.comm.Get_rank()
        kv, spare = torch.stack([k, v]), k.new_empty((2, *k.shape))  # bf16 if k is
        out = lse = None
        for i in range(size):
            exchange = RingExchange(cp.comm, kv, spare, TAG_KV) if i < size - 1 else None
            if exchange and not cp.overlap:
                exchange.wait()  # the baseline: the exchange before the block, nothing in flight
            plan = cp.plans[(rank - i) % size]  # the block in hand is rank r-i's
            if plan is not None:
                with cp.timeline.span("compute", "attention block"):
                    cp.count(plan, q)  # not the strategy: the work, for the report and the tests
                    block_out, block_lse = block_attention(q, kv[0], kv[1], plan)
                    if out is None:  # step 0, the own block: every query sees itself
                        out, lse = block_out, block_lse
                    else:
                        merge(out, lse, block_out, block_lse, plan.rows)
            if exchange:
                spare, kv = kv, exchange.wait()
        out = out.to(q.dtype)  # merged wide; kept, returned in q's dtype (proj's, under autocast)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse = ctx.saved_tensors
        cp, dout = ctx.cp, dout.contiguous()
        size, rank = cp.comm.Get_size(), cp.comm.Get_rank()
        delta = softmax_delta(dout, out)
        dq = torch.zeros_like(q, dtype=wide(q.dtype))  # sums wide: dq here, dK/dV round the ring
        kv, spare = torch.stack([k, v]), torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
        accumulator = None  # the dK/dV of the block in hand from the ranks before, on its way here
        for i in range(size):
            exchange = RingExchange(cp.comm, kv, spare, TAG_KV) if i < size - 1 else None
            if exchange and not cp.overlap:
                exchange.wait()
            partial = torch.zeros_like(kv, dtype=dq.dtype)  # its share of the block's dK, dV
            plan = cp.plans[(rank - i) % size]
            if plan is not None:
                with cp.timeline.span("compute", "attention block"):
                    block_gradients(q, *kv, dout, lse, delta, plan, dq, *partial)
            if accumulator is not None:
                partial += accumulator.wait()  # posted before this block computed, waited for after
            accumulator = RingExchange(cp.comm, partial, torch.empty_like(partial), TAG_GRAD)
            if not cp.overlap:
                accumulator.wait()
            if exchange:
                spare, kv = kv, exchange.wait()
        dkv = accumulator.wait()  # the N-th hop: this rank's own block, every rank's share in it
        return dq, dkv[0], dkv[1], None

class AllGatherAttention(torch.autograd.Function):
    """The same attention with one collective: every rank gathers all of K and V, computes its
    queries against them under one mask, and in backward reduce-scatters dK, dV to their owners."""

    @staticmethod
    def gather(comm, k, v):
        kv = torch.stack([k, v])
        every = kv.new_empty((comm.Get_size(), *kv.shape))  # rank s's K, V at [s]
        buffer = receive_buffer(every)
        comm.Allgather(mpi_buffer(kv), buffer)
        b, heads, t, d = k.shape  # keys in the order of cp.gathered_plan: rank 0's, rank 1's, ...
        return from_mpi(every, buffer).permute(1, 2, 3, 0, 4, 5).reshape(2, b, heads, -1, d)

    @staticmethod
    def forward(ctx, q, k, v, cp):
        keys, values = AllGatherAttention.gather(cp.comm, k, v)
        with cp.timeline.span("compute", "attention block"):
            cp.count(cp.gathered_plan, q)
            out, lse = block_attention(q, keys, values, cp.gathered_plan)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # not the gathered K, V: backward gathers again
        ctx.cp = cp
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse = ctx.saved_tensors
        cp, dout, size = ctx.cp, dout.contiguous(), ctx.cp.comm.Get_size()
        keys, values = AllGatherAttention.gather(cp.comm, k, v)
        dq = torch.zeros_like(q, dtype=wide(q.dtype))  # sums wide: Reduce_scatter_block's buffers too
        dkv = torch.zeros((2, *keys.shape), dtype=dq.dtype, device=k.device)
        with cp.timeline.span("compute", "attention block"):
            block_gradients(q, keys, values, dout, lse, softmax_delta(dout, out), cp.gathered_plan, dq, *dkv)
        b, heads, t, d = k.shape
        every = dkv.view(2, b, heads, size, t, d).permute(3, 0, 1, 2, 4, 5).contiguous()  # rank s's at [s]
        mine = torch.empty((2, *k.shape), dtype=dkv.dtype, device=k.device)  # a sum: wide
        buffer = receive_buffer(mine)
        cp.comm.Reduce_scatter_block(mpi_buffer(every), buffer, op=MPI.SUM)
        dk, dv = from_mpi(mine, buffer)
        return dq, dk, dv, None

def all_to_all(comm, chunks):
    """chunks[s] goes to rank s; returns what came, rank s's at [s] (one Alltoall)."""
    came = torch.empty_like(chunks)
    buffer = receive_buffer(came)
    comm.Alltoall(mpi_buffer(chunks), buffer)
    return from_mpi(came, buffer)

def sequence_to_heads(comm, x):
    """... x H x T/N x d (every head, this rank's positions) -> ... x H/N x T x d: this rank's heads
    for every rank's positions, in rank order (rank 0's, rank 1's, ...: positions.flatten())."""
    n, (*lead, heads, t, d) = comm.Get_size(), x.shape
    came = all_to_all(comm, x.reshape(*lead, n, heads // n, t, d).movedim(-4, 0).contiguous())
    return came.movedim(0, -3).reshape(*lead, heads // n, n * t, d)

def heads_to_sequence(comm, x):
    """The way back: ... x H/N x T x d -> ... x H x T/N x d, every head of this rank's positions."""
    n, (*lead, heads, t, d) = comm.Get_size(), x.shape
    came = all_to_all(comm, x.reshape(*lead, heads, n, t // n, d).movedim(-3, 0).contiguous())
    return came.movedim(0, -4).reshape(*lead, n * heads, t // n, d)

class AllToAllAttention(torch.autograd.Function):
    """DeepSpeed-Ulysses: Q, K, V to a head split, causal attention of H/N heads over the whole
    sequence, the output back to the sequence split; backward the mirror image. Returns out (this
    rank's positions, every head) and lse (its heads, every position: it stays here)."""

    @staticmethod
    def forward(ctx, q, k, v, cp):
        q, k, v = sequence_to_heads(cp.comm, torch.stack([q, k, v]))
        with cp.timeline.span("compute", "attention block"):
            cp.count(cp.whole_plan, q)
            out, lse = block_attention(q, k, v, cp.whole_plan)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # H/N heads of T positions: the bytes of H of T/N
        ctx.cp = cp
        ctx.mark_non_differentiable(lse)
        return heads_to_sequence(cp.comm, out), lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse = ctx.saved_tensors
        cp, dout = ctx.cp, sequence_to_heads(ctx.cp.comm, dout.contiguous())
        grads = torch.zeros((3, *q.shape), dtype=wide(q.dtype), device=q.device)
        with cp.timeline.span("compute", "attention block"):
            block_gradients(q, k, v, dout, lse, softmax_delta(dout, out), cp.whole_plan, *grads)
        dq, dk, dv = heads_to_sequence(cp.comm, grads.to(q.dtype))  # a move: in the dtype of q
        return dq, dk, dv, None

VARIANTS = {"ring": RingAttention, "allgather": AllGatherAttention, "alltoall": AllToAllAttention}

class ContextParallelAttention:
    """What every block calls for attention on this rank: the ring, the all-gather or the all-to-all
    over comm, with the plans of its positions against every rank's (shard_positions' table)."""

    def __init__(self, comm, positions, cp_comm, overlap, timeline, device):
        rank = comm.Get_rank()
        self.comm, self.function = comm, VARIANTS[cp_comm]
        self.overlap, self.timeline, self.tally = overlap, timeline, collections.Counter()
        self.plans = [block_plan(positions[rank], positions[s], device) for s in range(len(positions))]
        self.gathered_plan = block_plan(positions[rank], positions.flatten(), device)
        self.whole_plan = block_plan(positions.flatten(), positions.flatten(), device)  # all-to-all's

    def __call__(self, q, k, v):
        self.tally["calls"] += 1
        return self.function.apply(q, k, v, self)[0]  # the output; the lse is for the tests

    def count(self, plan, q):
        """For the report and the tests, not the strategy: the work of one block's forward, in
        (query, key) pairs of one sequence summed over the heads q holds: causal, and computed."""
        self.tally["pairs"] += plan.pairs * q.size(-3)
        self.tally["scores"] += plan.rows.numel() * plan.cols.numel() * q.size(-3)

def context_parallel_model(args, comm, timeline, device):
    """The whole model on every rank, its optimizer, and the attention its blocks call: this
    rank's positions against every rank's, over comm."""
    model = build_model(args, device)
    model.attention = ContextParallelAttention(comm, shard_positions(args.seq_len, comm.Get_size(), args.layout),
                                               args.cp_comm, not args.no_overlap, timeline, device)
    model.recompute = args.recompute
    if args.optimizer == "adamw":  # the recipe's: two float32 moments, on every rank: 8P bytes
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                        weight_decay=0.1)
    return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

def sum_gradients(model, comm):
    """Each rank's gradients are those of its tokens' share of the loss; their sum over the ranks
    is the gradient of the whole loss: one Allreduce of all of them."""
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    buffer = mpi_buffer(flat)
    comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)  # float32 in bf16 too: MPI cannot sum bf16
    flat, offset = from_mpi(flat, buffer), 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()

# The recipe (--optimizer adamw, --clip-grad, --lr-schedule, --warmup-steps), as nanoGPT's train.py
def learning_rate(args, step):
    """The schedule, a function of the step alone (a resume continues it): a linear warm-up over
    --warmup-steps, then constant, or a cosine from --lr down towards lr / 10 at --steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.lr
    low, progress = args.lr / 10, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return low + 0.5 * (args.lr - low) * (1 + math.cos(math.pi * progress))

def global_grad_norm(model):
    """The norm of the whole gradient, each parameter once, in float32. After sum_gradients every
    rank holds all of it, the same bits: no exchange, the same norm (so clip) on every rank. Taken
    before the sum, of a rank's own share g_r, it would be |g_r|, not |g_0 + ... + g_N-1|: wrong
    (the shares are terms of one sum, not disjoint parts: no sum of their squares gives it), and
    another on each rank, whose clips would differ: the replicas would drift apart."""
    return torch.stack([p.grad.float().square().sum() for p in model.parameters()]).sum().sqrt().item()

def clip_gradients(model, norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s rule: every gradient times max_norm / (norm + 1e-6) when
    that is below 1 (max_norm 0: no clip). The same norm on every rank: one scale, equal replicas."""
    scale = max_norm / (norm + 1e-6)
    if max_norm and scale < 1:
        for p in model.parameters():
            p.grad.mul_(scale)

def valid_targets(y, comm):
    """--ragged: the step's targets that are not IGNORE, over every rank (each holds a part of every
    sequence, and counts its own): one Allreduce of a number, before the forward. Each rank's loss
    is its sum over this. A per-rank mean would weigh each token of a rank with fewer valid targets
    more than the others: a gradient that no one process computes."""
    count = torch.tensor([(y != IGNORE).sum().item()], dtype=torch.float64)
    comm.Allreduce(MPI.IN_PLACE, count, op=MPI.SUM)  # host memory
    return count.item()

def train_step(model, optimizer, x, y, positions, args, comm, timeline, meter):
    """One step on this rank's positions of every sequence; returns the loss of the whole batch and
    the global gradient norm (before the clip)."""
    optimizer.zero_grad()
    count = valid_targets(y, comm) if args.ragged else args.batch_size * args.seq_len  # the loss's divisor
    bf16 = args.precision == "bf16"  # the matmuls on bf16 copies of the float32 (master) weights
    with timeline.span("compute", "forward"), meter, torch.autocast(x.device.type, torch.bfloat16, enabled=bf16):
        logits = model(x, positions).float()  # the loss in float32
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE) / count
    with timeline.span("compute", "backward"):
        loss.backward()
    sum_gradients(model, comm)
    norm = global_grad_norm(model)  # after the sum: the whole gradient's (before: a rank's share's)
    clip_gradients(model, norm, args.clip_grad)
    total = torch.tensor([loss.item()], dtype=torch.float64)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)  # the loss of all tokens (host memory)
    with timeline.span("compute", "optimizer"):
        optimizer.step()
    return total.item(), norm


# On a GPU: MPI reads GPU memory only when the library is CUDA-aware (found at start-up by
# setup()). Otherwise a tensor on a GPU travels through a host copy. On the CPU these do nothing.
CUDA_AWARE = False

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

def receive_buffer(t):
    """Where a receive for t lands: an empty pinned host buffer (nothing to copy in), or t itself
    once kernels queued before are done: they may still read it (as the ring's spare block)."""
    if t.is_cuda and not CUDA_AWARE:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return mpi_buffer(t)  # on a GPU, t after an event: MPI may write it from the moment it has it

def from_mpi(t, buffer):
    """Bring what MPI wrote into a host copy back to t; returns t."""
    if buffer is not t:
        t.copy_(buffer)
    return t

# -----------------------------------------------------------------------------
# The model: tensor_parallel.py's GPT, with global positions and a choice of attention
# -----------------------------------------------------------------------------
VOCAB = 128  # the ASCII codes
IGNORE = -100  # --ragged: the target past a document's end (F.cross_entropy's ignore_index)
def causal_attention(q, k, v):
    """Plain causal attention on whole sequences (b x heads x T x d): the reference."""
    scores = (q @ k.transpose(-2, -1)).to(wide(q.dtype)) / math.sqrt(q.size(-1))  # the softmax wide
    future = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(v.dtype) @ v

class Block(nn.Module):
    """Pre-LayerNorm decoder block. GELU and LayerNorm keep training a smooth function of the
    weights, so float32 rounding differences between world sizes stay at rounding level."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv = nn.LayerNorm(hidden), nn.Linear(hidden, 3 * hidden)  # q, k, v in a row
        self.proj = nn.Linear(hidden, hidden)
        self.ln2, self.fc1 = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x, attention, recompute="none"):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        out = (torch.utils.checkpoint.checkpoint(attention, q, k, v, use_reentrant=True, preserve_rng_state=False)
               if recompute == "selective" else attention(q, k, v))  # selective: q, k, v kept, the core rerun
        x = x + self.proj(out.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

class GPT(nn.Module):
    """Token and position embeddings, --layers blocks, final LayerNorm, untied head. `attention`
    is what the blocks call: plain causal attention, or a rank's ContextParallelAttention."""

    def __init__(self, layers, hidden, heads, seq_len):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)
        self.attention, self.recompute = causal_attention, "none"

    def forward(self, idx, positions):
        x = self.tokens(idx) + self.positions(positions)  # global positions, on whichever rank
        for block in self.blocks:
            x = (torch.utils.checkpoint.checkpoint(block, x, self.attention, use_reentrant=True,
                                                   preserve_rng_state=False)  # keeps x alone; no dropout: no RNG
                 if self.recompute == "full" else block(x, self.attention, self.recompute))
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


# -----------------------------------------------------------------------------
# The data: characters of Python's own source, batches a function of (seed, step)
# -----------------------------------------------------------------------------
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text
_TEXT = []

def load_text():
    """argparse.py, textwrap.py and shlex.py from this Python, bytes >= 128 replaced by '?'."""
    if not _TEXT:
        raw = b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in SOURCES)
        _TEXT.append(torch.tensor([b if b < 128 else ord("?") for b in raw], dtype=torch.long))
    return _TEXT[0]

def make_batch(seed, step, size, seq_len, ragged=False):
    """The global batch of one step: inputs and next-character targets, from (seed, step) alone.
    ragged: a document of 1 to T characters a sequence; past its end, targets IGNORE and inputs 0."""
    data = load_text()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - seq_len - 1, (size,), generator=gen).tolist()
    x = torch.stack([data[o:o + seq_len] for o in starts])
    y = torch.stack([data[o + 1:o + seq_len + 1] for o in starts])
    if ragged:  # drawn after the starts: without it, the batch is what it always was
        past = torch.arange(seq_len) >= torch.randint(1, seq_len + 1, (size,), generator=gen).view(-1, 1)
        x, y = x.masked_fill(past, 0), y.masked_fill(past, IGNORE)
    return x, y


# -----------------------------------------------------------------------------
# The run: the step loop, and main() as a table of contents
# -----------------------------------------------------------------------------
def train(args, comm, run, model, optimizer, meter, past=((), ())):
    """The steps after the `past` ones (their losses and gradient norms, from a checkpoint). The
    batch is made whole on the full sequence, targets shifted; this rank keeps its positions."""
    (losses, norms), records = map(list, past), []
    positions = shard_positions(args.seq_len, comm.Get_size(), args.layout)[comm.Get_rank()].clone()
    for step in range(len(losses), args.steps):
        start = time.perf_counter()
        x, y = make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged)
        x, y = x[:, positions].to(run.device), y[:, positions].to(run.device)
        for group in optimizer.param_groups:  # by the global step: a resume goes on where it was
            group["lr"] = learning_rate(args, step)
        loss, norm = train_step(model, optimizer, x, y, positions.to(run.device), args, comm, run.timeline, meter)
        losses.append(loss)
        norms.append(norm)
        records.append(run.timeline.step_record(start))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print_progress(comm, args, step, loss, records[-1], norm)
        # Every rank holds the same model: rank 0 alone writes it, each parameter and its
        # optimizer's state (SGD's momentum; AdamW's exp_avg, exp_avg_sq) whole by the model's own
        # names, with the losses and norms (model_shard). A resume at any N, --layout or --cp-comm
        # gives every rank all of it (rank 0 reads the one file and broadcasts it): the positions a
        # rank holds are a function of (N, layout), not state.
        checkpoint_if_due(comm, args, step, lambda: model_shard(comm, args, model, optimizer, losses, norms),
                          model_config(args))
    return losses, norms, records

def model_config(args):
    """What a checkpoint's model and optimizer state depend on (all on every rank: any N resumes)."""
    return {"model": "GPT", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "seq_len": args.seq_len, "vocab": VOCAB, "optimizer": args.optimizer}

def main(argv=None, comm=MPI.COMM_WORLD):
    """Parse, set up, train, check, report. Returns the exit status of this rank."""
    try:
        args = parse_args(argv, comm.Get_size())
        check_paths(comm, args)
        run = setup(comm, args)
        counted = CountedComm(comm, run.timeline)
        model, optimizer = context_parallel_model(args, counted, run.timeline, run.device)
        past, resumed = ((), ()), None
        if args.resume:
            resumed, blocks = load_checkpoint(comm, args.save, model_config(args),
                                              lambda manifest: model_regions(model, args), args.steps)
            if blocks is not None:
                past = restore(model, optimizer, resumed, blocks)
        print_header(comm, args, run, model, resumed)
        meter = SavedBytes(model)
        run.memory.reset()  # the peak of training alone: not the model's building, nor the check
        losses, norms, records = train(args, counted, run, model, optimizer, meter, past)
        run.memory.stop()
    except ConfigError as e:
        print0(comm, f"error: {e}", file=sys.stderr)
        return e.status
    if len(set(comm.allgather(checksum(model)))) != 1:
        raise RuntimeError("model replicas diverged")
    diff = check(comm, args, losses, norms, model) if args.check else None
    if args.trace:
        write_trace(comm, run.timeline, args.trace)
    return report(comm, args, run, model, losses, norms, records, counted, meter, diff)


# =============================================================================
# You may stop reading here: the strategy is all above. Below, first this file's own machinery
# (the check against single-process training, the report, its arguments and checkpoints), then
# the machinery that every strategy file repeats word for word: the summary, checkpoints and
# signals, counters, timeline and memory, device and MPI setup, arguments.
# =============================================================================

# --- Check against single-process training -----------------------------------
# What the reference shares with the ranks: build_model (the GPT class and its initial weights, the
# same on both sides by construction: the model is not what is split), make_batch (the same data)
# and F.cross_entropy. All that the check proves is written apart: its own learning-rate schedule (a
# bug in learning_rate shows); it attends with causal_attention, one softmax over whole sequences
# with a triu mask, and none of shard_positions, block_plan, block_attention, merge, block_gradients,
# softmax_delta, the exchanges and the hand-written backwards; it takes the mean loss where the ranks
# sum theirs and their gradients; it builds its optimizer itself and clips (and takes the norm) with
# torch.nn.utils.clip_grad_norm_.
def reference_training(args, device=torch.device("cpu")):
    """The same steps in one plain process on device (rank 0's): whole sequences, plain causal attention
    (the T x T weights of every head), F.cross_entropy's mean, the same recipe. Also the gradient
    norms and the bytes its first forward saved for backward."""
    model = build_model(args, device)
    optimizer, meter = (torch.optim.AdamW(model.parameters(), args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
                        if args.optimizer == "adamw" else torch.optim.SGD(model.parameters(), args.lr, momentum=0.9),
                        SavedBytes(model))
    losses, norms, positions, W = [], [], torch.arange(args.seq_len, device=device), args.warmup_steps
    for step in range(args.steps):
        x, y = (t.to(device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged))
        with meter if step == 0 else contextlib.nullcontext(), autocast(args, device.type):
            loss = F.cross_entropy(model(x, positions).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or math.inf).item())
        cosine = args.lr * (0.55 + 0.45 * math.cos(math.pi * max(0, step - W) / max(1, args.steps - W)))  # lr/10 up to lr
        optimizer.param_groups[0]["lr"] = (cosine if args.lr_schedule == "cosine" else args.lr) * min(1, (step + 1) / max(1, W))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, model, meter.bytes

def one_process_activations(args):
    """Bytes saved for backward by the first step's forward and loss as train_step computes them,
    on the whole sequence in one process: this file's attention on one rank (MPI.COMM_SELF)."""
    model = build_model(args)
    model.attention = ContextParallelAttention(MPI.COMM_SELF, torch.arange(args.seq_len).view(1, -1), args.cp_comm,
                                               True, Timeline(torch.device("cpu")), torch.device("cpu"))
    model.recompute = args.recompute
    x, y = make_batch(args.seed, 0, args.batch_size, args.seq_len, args.ragged)
    with SavedBytes(model) as meter, autocast(args):
        F.cross_entropy(model(x, torch.arange(args.seq_len)).float().flatten(0, 1), y.flatten(), reduction="sum")
    return meter.bytes

def autocast(args, device_type="cpu"):  # the ranks' bf16, where the reference runs
    return torch.autocast(device_type, torch.bfloat16, enabled=args.precision == "bf16")

# The gradient norms count as losses (their absolute |diff|, as the other files compare them) in fp32;
# in bf16 they stand beside the check. Measured, the default 40 steps at N = 2: fp32 2.2e-6 (SGD), 7.2e-7
# (AdamW, --lr 1e-3, --clip-grad 1, cosine), their losses and parameters 6.0e-7, 1.3e-6; bf16 3.2e-2 (SGD:
# over TOLERANCE_BF16, the two sides' bf16 roundings part norms of 0.3 to 5 by up to 6%) and 5.6e-3
# (AdamW), the tests' bf16 runs (3 steps, N = 1 to 4, every variant) 2.4e-3 at most.
def check(comm, args, losses, norms, model):
    """Rank 0 trains the reference on its device and compares (every rank holds the same model); every
    rank gets the largest difference, the one-process activation bytes and the norms' largest |diff|."""
    result = None
    if comm.Get_rank() == 0:
        ref_losses, ref_norms, ref_model, plain_bytes = reference_training(args, next(model.parameters()).device)
        joined = args.precision == "fp32"  # the norms as losses (see above)
        diff = max_difference(losses + norms * joined, model.state_dict(), ref_losses + ref_norms * joined, ref_model)
        result = (diff, plain_bytes, one_process_activations(args), max_difference(norms, {}, ref_norms, ref_model))
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)  # the other ranks leave the cores to rank 0, which trains the reference
    return comm.bcast(result, root=0)

class SavedBytes:
    """Bytes autograd saves for backward during a forward, measured with saved-tensor hooks (as
    pipeline_parallel.py's ActivationMeter): each storage once, the parameters left out, and their
    bf16 copies under autocast: a tensor (or its base, for a view as a weight's transpose) cast by
    ToCopyBackward0 from a parameter's AccumulateGrad. All of it stays alive until backward."""

    def __init__(self, model):
        self.fixed = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.ids = {id(p) for p in model.parameters()}
        self.bytes, self.storages = 0, {}

    def pack(self, t):
        storage, cast = t.untyped_storage(), (t if t._base is None else t._base).grad_fn
        if type(cast).__name__ == "ToCopyBackward0" and id(getattr(cast.next_functions[0][0], "variable", 0)) in self.ids:
            return t  # a parameter's bf16 copy
        if storage.data_ptr() not in self.fixed:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.storages, self.hooks = {}, torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self.bytes = sum(self.storages.values())

def kv_messages_under_compute(events):
    """[n, total] of the ring's messages (Isend, Irecv) in `events`: a message counts when it was
    posted before an attention block ended and waited for after it began (whether its bytes moved
    meanwhile is the MPI's doing). Requests are waited in the order they were posted: the k-th
    'Isend wait' is the k-th Isend's."""
    blocks = [(begin, end) for name, _, begin, end in events if name == "attention block"]
    n = total = 0
    for kind in ("Isend", "Irecv"):
        posts = sorted(begin for name, _, begin, _ in events if name == kind)
        waits = sorted(end for name, _, _, end in events if name == kind + " wait")
        assert len(posts) == len(waits), f"{len(posts)} {kind} but {len(waits)} waits"
        total += len(posts)
        n += sum(any(post < hi and lo < done for lo, hi in blocks) for post, done in zip(posts, waits))
    return [n, total]

def checksum(model):
    """A bitwise fingerprint of every parameter."""
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().cpu().contiguous().numpy().tobytes(), crc)
    return crc

# The optimizer's state of a parameter as a checkpoint names it (key/<name>), and as torch does
OPTIMIZER_STATE = {"sgd": {"momentum": "momentum_buffer"}, "adamw": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}

def model_shard(comm, args, model, optimizer, losses, norms):
    """What rank 0 saves, the others nothing (every rank holds the same model): each parameter and its
    optimizer's state, whole; as state the losses and norms so far, AdamW's step count, the grid."""
    if comm.Get_rank() != 0:
        return {}, None
    pieces = {name: piece(t) for name, t in model.state_dict().items()}
    pieces.update({f"{key}/{name}": piece(optimizer.state[p][field]) for name, p in model.named_parameters()
                   for key, field in OPTIMIZER_STATE[args.optimizer].items() if field in optimizer.state[p]})
    grid = {"world_size": comm.Get_size(), "layout": args.layout, "cp_comm": args.cp_comm}
    steps = {"adamw_step": int(optimizer.state[next(model.parameters())]["step"])} if args.optimizer == "adamw" else {}
    return pieces, {"losses": list(losses), "grad_norms": list(norms), "grid": grid, **steps}

def model_regions(model, args):
    """What every rank asks a checkpoint for, whatever grid wrote it: all of the model and its optimizer's state."""
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    shapes.update({f"{key}/{name}": p.shape for name, p in model.named_parameters()
                   for key in OPTIMIZER_STATE[args.optimizer]})
    return {key: region(shape) for key, shape in shapes.items()}

def restore(model, optimizer, manifest, blocks):
    """Every rank loads the one saved model and optimizer state (any N, layout, --cp-comm); returns
    the losses and gradient norms so far."""
    model.load_state_dict({name: blocks[name] for name in model.state_dict()})
    state = manifest["state"]
    for name, p in model.named_parameters():
        for key, field in OPTIMIZER_STATE[manifest["config"]["optimizer"]].items():
            optimizer.state[p][field] = blocks[f"{key}/{name}"].to(p.device)
        if "adamw_step" in state:  # torch keeps it per parameter, as a float32 tensor on the CPU
            optimizer.state[p]["step"] = torch.tensor(float(state["adamw_step"]))
    return state["losses"], state["grad_norms"]

# --- Report: header, the summary and --json ----------------------------------
def formulas(args, world_size, params):
    """The docstring's bytes per step and rank and activation bytes per rank; each rank's causal pairs
    and scores computed (masked or not) of one layer and sequence, summed over the heads it attends for."""
    n, t, L, h, e = world_size, args.seq_len, args.layers, args.heads, 2 if args.precision == "bf16" else 4
    b, c, R = t // n, t // (2 * n), int(args.recompute != "none")  # R = 1: the forward's exchange again
    bs, S = args.batch_size * b, args.batch_size * b * args.hidden  # S: one rank's K (or V) of a layer, in values
    exchange = L * S * {"ring": 2 * ((2 + R) * e * (n - 1) + 4 * n), "allgather": 2 * ((2 + R) * e + 4 * n),
                        "alltoall": 4 * (2 + R) * e}[args.cp_comm]
    per_block = {"none": S * (8 + 15 * e) + 16 * bs + 4 * h * bs, "selective": S * (8 + 14 * e) + 16 * bs,
                 "full": 4 * S}[args.recompute]
    activations = L * per_block + (4 + e) * S + 4 * bs * VOCAB + 24 * bs + 8 * b + 4
    if args.cp_comm == "alltoall":  # H/N heads over the whole sequence, whatever the layout
        pairs, scores = [h // n * t * (t + 1) // 2] * n, [h // n * t * t] * n
    elif args.layout == "contiguous":  # the blocks up to its own (the all-gather's keys likewise)
        pairs, scores = [h * (r * b * b + b * (b + 1) // 2) for r in range(n)], [h * (r + 1) * b * b for r in range(n)]
    else:
        pairs = [h * ((2 * n - 1) * c * c + c * (c + 1))] * n
        scores = ([h * 2 * (n + 1) * c * c] * n if args.cp_comm == "ring"  # 4c^2 its own, 2c^2 every other
                  else [h * 2 * c * (2 * n - r) * c for r in range(n)])  # the all-gather: up to its last key
    return exchange + 4 * params + 8 + 8 * args.ragged, exchange, pairs, scores, activations

def print_header(comm, args, run, model, resumed):
    n, params = comm.Get_size(), sum(p.numel() for p in model.parameters())
    if resumed:
        grid = resumed["state"]["grid"]
        print0(comm, f"resumed from {args.save} at step {resumed['step']} (written by {resumed['world_size']} ranks, "
                     f"--layout {grid['layout']}, --cp-comm {grid['cp_comm']})")
    split = (f"chunks r and {2 * n - 1}-r of {2 * n}, {args.seq_len // (2 * n)} positions each" if args.layout == "zigzag"
             else f"positions [r x {args.seq_len // n}, (r+1) x {args.seq_len // n})")
    print0(comm, *run.header,
           f"model: GPT, {args.layers} blocks, hidden {args.hidden}, {args.heads} heads, {params:,} parameters, "
           f"whole on every rank",
           f"each rank: {args.seq_len // n} of {args.seq_len} positions of all {args.batch_size} sequences "
           f"(--layout {args.layout}: rank r holds {split}) | attention: --cp-comm {args.cp_comm}"
           + (", no overlap (each exchange waited before its block)" if args.no_overlap else ""),
           f"text: {' + '.join(s + '.py' for s in SOURCES)} of Python {sys.version.split()[0]} "
           f"({len(load_text()):,} characters) | vocabulary {VOCAB} ASCII codes")

def report(comm, args, run, model, losses, norms, records, counted, meter, checked):
    """The summary lines and the file's JSON keys; finish() prints them with the house's."""
    n, steps_run = comm.Get_size(), max(1, len(records))
    params = sum(p.numel() for p in model.parameters())
    sent = sum(b for name, b in counted.bytes.items() if name != "Irecv") / steps_run  # Irecv: bytes received
    calls = {name: c / steps_run for name, c in counted.calls.items()}
    total_formula, exchange_formula, pairs_formula, scores_formula, saved_formula = formulas(args, n, params)
    tally = model.attention.tally
    pairs = comm.allgather(tally["pairs"] // max(1, tally["calls"]))
    scores = comm.allgather(tally["scores"] // max(1, tally["calls"]))
    saved = comm.allgather(meter.bytes)
    diff, plain, one, norm_diff = checked if checked else (None, None, None, None)
    overlap = {}
    if args.cp_comm == "ring":
        overlap["kv_messages_under_compute"] = [int(v) for v in comm.allreduce(
            torch.tensor(kv_messages_under_compute(run.timeline.step_events))).tolist()]
    attention = {"ring": ("L x 2S x ((2+R)e(N-1) + 4N)", "K/V forward and backward, dK/dV home"),
                 "allgather": ("L x 2S x ((2+R)e + 4N)", "Allgather twice, Reduce_scatter_block"),
                 "alltoall": ("L x 4S x (2+R)e", "Q, K, V, the output, dO, dQ, dK, dV by Alltoall")}[args.cp_comm]
    R, e = int(args.recompute != "none"), 2 if args.precision == "bf16" else 4
    lines = [f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f}; a uniform guess is ln {VOCAB} = "
             f"{math.log(VOCAB):.4f})",
             f"bytes handed to MPI per step and rank: {sent:,.0f} counted; formula {attention[0]} + 4P + {8 + 8 * args.ragged} = "
             f"{exchange_formula:,} ({attention[1]}{', the forward again' if R else ''}; e = {e}, R = {R}) + "
             f"{4 * params + 8 + 8 * args.ragged:,} (gradients, loss{', count' * args.ragged}) = {total_formula:,}",
             f"causal pairs per rank (one layer and sequence, over its heads): {pairs}, formula {pairs_formula}; "
             f"scores computed (masked or not): {scores}, formula {scores_formula}",
             f"global gradient norm (after the Allreduce, no exchange): first {norms[0]:.4f}, last {norms[-1]:.4f}"
             + (f"; clipped to {args.clip_grad:g} in {sum(n > args.clip_grad for n in norms)} of {len(norms)} steps"
                if args.clip_grad else ""),
             f"activation bytes saved for backward per rank: {', '.join(f'{b:,}' for b in saved)}, formula "
             f"{saved_formula:,} (--recompute {args.recompute})"
             + (f"; one process (this attention, whole sequence): {one:,}, against {n} x rank 0's {n * saved[0]:,}; "
                f"plain attention: {plain:,} (it saves the T x T weights)" if one else "")]
    compared = ("losses, gradient norms, parameters" if args.precision == "fp32" else
                f"losses, parameters; gradient norms beside it: {norm_diff:.1e}") if checked else ""
    return finish(comm, args, run, losses, records, diff, compared, lines, {
        "cp_layout": args.layout, "cp_comm": args.cp_comm, "overlap": overlap,
        "comm_bytes_per_step": max(comm.allgather(sent)), "comm_bytes_formula": total_formula,
        "collectives_per_step": sum(c for name, c in calls.items() if name not in ("Isend", "Irecv")),
        "messages_per_step": calls.get("Isend", 0), "calls_by_kind": calls,
        "causal_pairs_per_rank": pairs, "causal_pairs_formula": pairs_formula, "scores_computed_per_rank": scores,
        "scores_computed_formula": scores_formula,
        "activation_bytes_per_rank": saved, "activation_bytes_formula": saved_formula, "activation_bytes_one_process": one,
        "activation_bytes_plain_attention": plain, "parameters": params, "grad_norms": norms,
        "check_grad_norm_max_abs_diff": norm_diff})

def parse_args(argv, world_size):
    p = common_arguments("Context parallelism over MPI: ring attention on a small GPT, the sequence split.",
                         steps=40, batch_size=16, lr=1e-3, log_every=10)
    p.add_argument("--layers", type=COUNT, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=COUNT, default=64, help="hidden size")
    p.add_argument("--heads", type=COUNT, default=4, help="attention heads")
    p.add_argument("--seq-len", type=COUNT, default=120,
                   help="characters per sequence (2N divides 120 for N <= 6; longer runs: see the README)")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag", help="which positions a rank holds")
    p.add_argument("--cp-comm", choices=tuple(VARIANTS), default="ring",
                   help="how attention sees the whole sequence: K and V round a ring, gathered, or heads by all-to-all")
    p.add_argument("--no-overlap", action="store_true", help="ring baseline: wait for each exchange before computing")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw",
                   help="SGD with momentum 0.9, or AdamW (betas 0.9, 0.95, eps 1e-8, weight decay 0.1)")
    p.add_argument("--clip-grad", type=checked(float, lambda v: v >= 0 and math.isfinite(v), "0 or more"), default=1.0,
                   metavar="MAX_NORM", help="clip the global gradient norm to MAX_NORM (0: no clip)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="after the warm-up: --lr throughout, or a cosine from --lr towards lr / 10 at --steps")
    p.add_argument("--warmup-steps", type=COUNT_OR_0, help="linear warm-up: step s gets lr (s + 1) / W (default: --steps / 10)")
    p.add_argument("--ragged", action="store_true", help="documents of uneven length: the loss over the valid targets")
    args = check_common(p.parse_args(argv))
    args.warmup_steps = args.steps // 10 if args.warmup_steps is None else args.warmup_steps  # a tenth by default
    if args.warmup_steps >= args.steps:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} must be below --steps {args.steps}: the warm-up "
                          f"would take every step; use fewer warm-up steps or more steps")
    n, t = world_size, args.seq_len
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} does not split into {args.heads} heads of equal "
                          f"size; use a multiple of {args.heads}, e.g. {16 * args.heads}")
    if t >= len(load_text()):
        raise ConfigError(f"--seq-len {t} must be shorter than the text ({len(load_text())})")
    parts = 2 * n if args.layout == "zigzag" else n
    if t % parts:
        raise ConfigError(f"--seq-len {t} does not split into {parts} equal chunks (--layout {args.layout} on {n} "
                          f"ranks); use a multiple of {parts}, e.g. {max(parts, t // parts * parts)} or "
                          f"{(t // parts + 1) * parts}" + (f", or --layout contiguous (a multiple of {n})"
                                                          if args.layout == "zigzag" else ""))
    if args.cp_comm == "alltoall" and args.heads % n:
        raise ConfigError(f"--cp-comm alltoall gives each rank heads/N of the {args.heads} heads, which {n} ranks do "
                          f"not divide; run on a divisor of {args.heads} ranks, or use --cp-comm ring, whose ranks the "
                          f"heads do not limit")
    if args.no_overlap and args.cp_comm != "ring":
        raise ConfigError(f"--no-overlap is the ring's baseline; --cp-comm {args.cp_comm} has no exchange in flight to "
                          "switch off: drop --no-overlap, or use --cp-comm ring")
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
