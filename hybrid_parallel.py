"""Hybrid parallelism over MPI: data, context, tensor, pipeline and expert parallelism at once, on one grid of ranks.

What is split: everything, as Megatron-LM splits its largest models (Narayanan et al. 2021). The P x D x C x T ranks of
the world form a grid (--pp P --dp D --cp C --tp T); a rank's place in it is written (pp, dp, cp, tp), slowest first:
  pipeline (P): the blocks cut into P stages; each replica's share cut into M micro-batches (--micro-batches), 1F1B;
  data (D):     D replicas of that pipeline, each taking B/D of the global batch of B sequences;
  context (C):  each sequence cut over C ranks, S/C positions each (--layout zigzag: chunks c and 2C-1-c of 2C, equal
                causal work; contiguous: block c); ring attention: K/V go round, merged by log-sum-exp (Liu 2023);
  tensor (T):   within a stage every weight matrix split over T ranks: Megatron's f and g, column- and row-parallel
                linears, the vocabulary-parallel embedding and cross-entropy (Shoeybi 2019); --sequence-parallel also
                cuts the S/C positions over the T ranks between those layers (LayerNorms, residuals): f and g become
                all-gather and reduce-scatter (Korthikanti 2022);
  expert (E):   --experts X: each block's MLP is X experts, a router sends each token to its top K (GShard; Switch).
                No ranks of its own: the D x C ranks of equal (pp, tp) fold into groups of E (Megatron's expert-data-
                parallel folding); rank e of a group holds experts eX/E to (e+1)X/E - 1; rows go by Alltoallv (MoE).
The D x C ranks of equal (pp, tp) hold the same dense weights and saw different tokens: one gradient allreduce
averages over them all; an expert's, over the D x C / E ranks that hold it, is divided by D x C too (GradBuckets).

  global rank = ((pp x D + dp) x C + cp) x T + tp. Tensor fastest: its allreduces sit inside every layer, on the
  critical path, so its T ranks share a node's fastest links; context next: a ring hop per block and layer, within a
  node (4 or 8 GPUs) when C x T <= 8, as an expert group's all-to-alls when E x T <= 8; data next: one allreduce a
  step, hidden behind backward, may cross nodes; pipeline outermost: one activation per micro-batch and stage
  boundary, the least traffic. --pp 2 --dp 2 --cp 2 --tp 2, stage 0's ranks:

                 cp 0 (positions of chunks 0, 3)    cp 1 (chunks 1, 2)
   replica 0    [ rank 0 | rank 1 ]  <== ring ==>  [ rank 2 | rank 3 ]   == activations ==> ranks 8-11
     (dp 0)         |        |                         |        |
                    gradient allreduce over the D x C ranks of equal tp (0-2-4-6, 1-3-5-7)
                    |        |                         |        |
   replica 1    [ rank 4 | rank 5 ]  <== ring ==>  [ rank 6 | rank 7 ]   == activations ==> ranks 12-15
  [ a | b ]: a tensor-parallel group (0-1, ...); ring: the ranks of equal (pp, dp, tp) (0-2, ...); ==>: point-to-
  point between the ranks of equal (dp, cp, tp) (0-8, ...). --ep 2 --experts 4: the expert groups 0-2, 4-6, 1-3,
  5-7 (experts 0-1 on ranks 0 and 4, 2-3 on ranks 2 and 6; ...).

Communication per step, summed over the grid (L blocks, B sequences of S characters, hidden h, M micro-batches,
A = 4BSh bytes, one float32 activation of the whole batch; e = 4 bytes an element moved, 2 in bf16; an axis of size 1
moves nothing; G = 4 f/g pairs a block, 2 with experts, which need none; F = GL/2 with --recompute full, else 0; R = 1
with selective or full, else 0; R_d = Sh + 6Lh + 2h the parameters whole on every tensor-parallel rank (LayerNorms,
positions, row-parallel biases), Sh + (5 + X)Lh + 2h with experts (the routers); W_x = TL(X/E)x(8h^2+5h)):
  pipeline: 2M(P - 1) x D x C x T messages, 2(P - 1) x T x eBSh bytes: each of a stage's T ranks sends its copy.
  data:     one allreduce per bucket (--bucket-mb) in each group of equal (pp, tp), the experts' apart; D x C x 4W
            bytes, W the dense parameters of a replica (its vocabulary padded to a multiple of T) + (T - 1) x R_d; + D x
            C x 4W_x when D x C / E > 1 (W_x: a replica's experts, whole on each tensor-parallel rank); --ragged: + T
            Allreduces of the count of valid targets (the last stage's groups), 8 x D x C x T bytes.
  context:  L x M x D x C x T x (3C - 2 + R(C - 1)) Sendrecvs, L x 2BSh x ((2 + R)e(C - 1) + 4C) bytes: each rank's K/V
            C - 1 hops forward, C - 1 in backward (R: again, rerun), float32 dK/dV C hops home (RingAttention).
  tensor:   D x C x M x (GL + 5 + F) allreduces (G/2 per block forward (g), G/2 backward (f), the embedding's g, the
            head's f, 3 for the loss; F: the blocks' g again); T x [(GL + 2 + F) x A + 3 x 4BS] bytes, float32 always.
  tensor, --sequence-parallel: D x C x M x ((2G + 6 + 4X/E)L + 10 + 2F) collectives, (GL + 2 + F)T x A + (GL + 1 + F)
            x eBSh + A + 12BST + 4MDCT x R_r bytes, R_r = R_d + W_x/T: all-gathers (e), float32 reduce-scatters, and
            per micro-batch an allreduce of each replicated parameter's gradient (experts too); pipeline: 2(P - 1)eBSh.
  expert:   (5 + 3f)LMDCT/E + (1 + f)LM collectives, (4 + 2f)eh(LKBST' - d) + (1 + f)16XLMDCT bytes: per block and
            micro-batch in each group an Alltoall of the counts and 4 Alltoallv (dispatch, combine, each way) of a row
            per kept (token, choice) pair, over each stage an Allreduce of the router's counts; f = 1 with --recompute
            full (the 3 and the Allreduce again), else 0; T' = T (1 with sequence parallelism), d the pairs dropped.
  bubble:   (P - 1)/(M + P - 1) of each step idle, as in pipeline parallelism.
  ZeRO-1 (--zero-stage 1, Megatron's distributed optimizer): the allreduce becomes a reduce-scatter of each bucket
            (still posted in backward) and an Allgather of the updated parameters after the step: 2 collectives per
            bucket, 4W'(D x C + 1) + 4W_x'(D x C + E) bytes, W' = W padded bucket by bucket to a multiple of the n
            ranks that sum it (n = D x C; D x C / E for W_x'); rank r of n steps slice r and keeps its optimizer state.
  the norm: one 4-byte Allreduce over all ranks a step (global_grad_norm), outside the axes' counts above.
The recipe (nanoGPT's): --optimizer sgd (momentum 0.9) or adamw (two float32 moments), --clip-grad to the global
gradient norm, --lr-schedule constant or cosine (down to lr/10) after --warmup-steps of linear warm-up.
--ragged: documents of uneven length; the loss, the sum over the step's valid targets / their count.
Mixed precision (--precision bf16): forward and loss under torch.autocast(bfloat16), on the ranks and in --check's one
process: matmuls on bf16 copies of the float32 master weights; gradients add up and are reduced in float32 (Megatron's
default: bf16 would round small terms away, and MPI cannot sum it), as the optimizer's state. Float32 too: the residual
stream, LayerNorm, softmax, the router, the ring's scores, lse and merge, the loss, every sum to MPI. Only what moves is
bf16: the pipeline's activations and gradients, K/V round the ring, sequence-parallel gathers, the experts' rows.
Recomputation (--recompute): torch.utils.checkpoint(fn, *inputs, use_reentrant=True) keeps fn's inputs by
save_for_backward (where the hooks that count activations see them) and reruns fn in backward under the forward's
autocast. full: each block from its input, its g, ring hops and expert exchanges again (F, R, f); selective: attention's
core (Korthikanti); at C > 1 the ring keeps no weights (recomputed from lse): selective drops its output and lse (R).
Memory per rank, W_r its stage's parameters (its slice of the T-way split, X/E experts a block): weights and gradients
  4W_r each, in bf16 too; SGD's momentum 4W_r, AdamW's moments 8W_r (--zero-stage 1: 4W_r'/n, 8W_r'/n). Activations of a
  micro-batch (b = B/(DM) sequences, s = S/C positions, a heads, t = T, c = t with --sequence-parallel, else 1), per
  dense block (experts': measured only): none bsh(8/c + 2e + 12e/t) + 16bs/c + Y; selective without Y; full 4bsh/c, its
  input. Y: (4, bf16 6)abs^2/t + s^2 (softmax, bf16 copy, mask) at C = 1; ebsh/t + 4abs/t (ring output, lse) at C > 1.
  Once: 9bs + 8s/c on stage 0, bsh(4/c + e) + 8bs/c + 4bsV/t + 9bs on the last (V padded); min(M, P - s) of them.
Checkpoints (--save, --resume): the whole model's tensors and optimizer state by one process's names, in blocks
(blocks_held), each element written once; a resume on any grid reads the blocks it holds (--check replays each grid).

When to choose it: the model outgrows a node, or the sequence a device: tensor in a node, context next, pipeline across
nodes, data parallelism over the replicas left; experts when parameters must grow and compute not.
The network: tensor_parallel.py's GPT (--experts: expert_parallel.py's MLPs), on argparse.py, textwrap.py, shlex.py.
Run:  mpirun -np 16 python hybrid_parallel.py --pp 2 --dp 2 --cp 2 --tp 2     (add --help for the flags)
"""
import argparse, collections, contextlib, ctypes, errno, fractions, functools, hashlib, importlib.util  # noqa: E401
import io, json, math, os, pickle, shutil, signal, statistics, sys, time, traceback, types  # noqa: E401

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
import mpi4py

mpi4py.rc.initialize = False  # MPI starts in start_mpi(), once this rank's GPU is chosen
mpi4py.rc.finalize = True  # and ends when the process does
from mpi4py import MPI  # noqa: E402

STRATEGY = "hybrid_parallel"
TOLERANCE, TOLERANCE_BF16 = 2e-5, 2e-2  # the check's largest |difference|, float32 and bf16: measured (above check())
POLL_S = 1e-4  # a rank waiting on MPI sleeps between polls, leaving the core to ranks that compute
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text
VOCAB, IGNORE = 128, -100  # the ASCII codes; a target past a document's end (--ragged): ignored

# -----------------------------------------------------------------------------
# The grid: P x D x C x T ranks in Megatron's order, and one communicator per axis
# -----------------------------------------------------------------------------
def coordinates(rank, dp, cp, tp):
    """(pp, dp, cp, tp) of a global rank: pp varies slowest, then dp, then cp, tp fastest."""
    return rank // (dp * cp * tp), (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp

def rank_at(p, d, c, t, dp, cp, tp):
    """The global rank at (pp, dp, cp, tp) = (p, d, c, t)."""
    return ((p * dp + d) * cp + c) * tp + t

def make_grid(comm, pp, dp, cp, tp, ep=1):
    """A Cartesian communicator (pp, dp, cp, tp), tp fastest (Megatron's order), and one communicator per axis."""
    cart = comm.Create_cart([pp, dp, cp, tp], periods=[False] * 4, reorder=False)
    assert tuple(cart.Get_coords(cart.Get_rank())) == coordinates(comm.Get_rank(), dp, cp, tp)
    axes = {"pipeline": cart.Sub([True, False, False, False]),  # equal (dp, cp, tp): one pipeline, rank = stage
            "data": cart.Sub([False, True, True, False]),  # equal (pp, tp): the D x C ranks of one shard's weights
            "context": cart.Sub([False, False, True, False]),  # equal (pp, dp, tp): one sequence's ring
            "tensor": cart.Sub([False, False, False, True]),  # equal (pp, dp, cp): one stage's matrices
            "stage": cart.Sub([False, True, True, True])}  # equal pp: every rank that routes the stage's tokens
    r = axes["data"].Get_rank()
    axes["expert"] = axes["data"].Split(r // ep, r)  # the D x C ranks in (dp, cp) order, cut into groups of E
    axes["expert-data"] = axes["data"].Split(r % ep, r)  # the D x C / E ranks with the same experts
    cart.Free()
    return axes

# -----------------------------------------------------------------------------
# Tensor parallelism within a stage: f and g, Megatron's layers, on the tensor-parallel communicator
# -----------------------------------------------------------------------------
def allreduce(t, comm, op=MPI.SUM):
    """A new tensor: t summed (or maxed) over comm; on one rank there is nothing to exchange."""
    t = t.detach().clone(memory_format=torch.contiguous_format)
    if comm.Get_size() > 1:
        buffer = mpi_buffer(t)
        comm.Allreduce(MPI.IN_PLACE, buffer, op=op)
        t = from_mpi(t, buffer)
    return t

# MPI reads GPU memory when the library is CUDA-aware (setup() finds out), else a host copy travels; CPU: no copy.
CUDA_AWARE = False

def mpi_buffer(t, nonblocking=False, send=True):
    """The buffer to hand MPI for t: t itself, or a pinned host copy (for a receive, an empty one). Open MPI's
    non-blocking collectives never read GPU memory, CUDA-aware or not: always staged. A receive into t itself waits
    too: t is fresh from the caching allocator, which hands out memory that kernels still queued may read."""
    if not t.is_cuda:
        return t
    if CUDA_AWARE and not nonblocking:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the kernels queued before, that write or read t, must finish first
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t) if send else host  # copy_ waits for t's kernels

def from_mpi(t, buffer):
    """Bring what MPI wrote into a host copy back to t; returns t."""
    return t if buffer is t else t.copy_(buffer)

class f(torch.autograd.Function):
    """Identity forward, allreduce backward: before a column-parallel layer, the input's gradient summed over ranks."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x
    @staticmethod
    def backward(ctx, dy):
        return allreduce(dy, ctx.comm), None

class g(torch.autograd.Function):
    """Allreduce forward, identity backward: the sum of a row-parallel layer's partial products, float32 for MPI."""
    @staticmethod
    def forward(ctx, x, comm):
        return allreduce(x.float(), comm)
    @staticmethod
    def backward(ctx, dy):
        return dy, None

def gather_sequence(x, comm):
    """b x s x h on each of the T ranks -> b x Ts x h, rank t's positions at [ts, (t+1)s)."""
    x = x.detach().contiguous()
    every = x.new_empty((comm.Get_size(), *x.shape))
    buffer = mpi_buffer(every, send=False)
    comm.Allgather(mpi_buffer(x), buffer)
    return from_mpi(every, buffer).transpose(0, 1).flatten(1, 2)

def scatter_sequence(x, comm):
    """b x Ts x h partial sums on each rank -> b x s x h: the ranks' sum of rank t's positions."""
    b, n, h, size = *x.shape, comm.Get_size()
    pieces = x.detach().reshape(b, size, n // size, h).transpose(0, 1).contiguous()
    mine = x.new_empty((b, n // size, h))
    buffer = mpi_buffer(mine, send=False)
    comm.Reduce_scatter_block(mpi_buffer(pieces), buffer, op=MPI.SUM)
    return from_mpi(mine, buffer)

class GatherSequence(torch.autograd.Function):
    """Sequence parallelism's f (Korthikanti 2022): all-gather T pieces of the sequence; backward, reduce-scatter."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return gather_sequence(x, comm)
    @staticmethod
    def backward(ctx, dy):
        return scatter_sequence(dy.float(), ctx.comm), None  # a sum: float32

class ScatterSequence(torch.autograd.Function):
    """Sequence parallelism's g: reduce-scatter a row-parallel layer's partial sums by position; backward, gather."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm, ctx.dtype = comm, x.dtype
        return scatter_sequence(x.float(), comm)  # a sum: float32
    @staticmethod
    def backward(ctx, dy):
        return gather_sequence(dy.to(ctx.dtype), ctx.comm), None

def shard(t, dim, comm, groups=1, padded=None):
    """This rank's slice of t along dim, as a parameter. groups=3: t is q, k, v side by side and
    the rank keeps the same slice of each (its heads). padded: zero rows first, up to that size."""
    t = t.detach()
    if padded is not None and padded > t.size(dim):
        t = torch.cat([t, t.new_zeros(t.shape[:dim] + (padded - t.size(dim),) + t.shape[dim + 1:])], dim)
    rank, size = comm.Get_rank(), comm.Get_size()
    param = nn.Parameter(torch.cat([part.chunk(size, dim)[rank] for part in t.chunk(groups, dim)], dim).clone())
    param.sliced = dim, groups  # a slice: its gradient is this rank's own (the others are whole on every rank)
    return param

class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) A_r + b_r: rank r's slice of the output features; X is whole on every rank."""
    def __init__(self, full, comm, groups=1, padded=None):
        super().__init__()
        self.comm, self.sequence_parallel = comm, False  # True: X comes cut along the sequence
        self.weight = shard(full.weight, 0, comm, groups, padded)
        self.bias = None if full.bias is None else shard(full.bias, 0, comm, groups, padded)
    def forward(self, x):
        if self.sequence_parallel and torch.is_autocast_enabled(x.device.type):  # the all-gather moves bf16
            x = x.to(torch.get_autocast_dtype(x.device.type))
        x = GatherSequence.apply(x, self.comm) if self.sequence_parallel else f.apply(x, self.comm)
        return F.linear(x, self.weight, self.bias)

class RowParallelLinear(nn.Module):
    """Y = g(X_r B_r) + b: rank r holds B's rows for its slice X_r of the features; b, whole, is added after the sum."""
    def __init__(self, full, comm):
        super().__init__()
        self.comm, self.sequence_parallel = comm, False  # True: Y leaves cut along the sequence
        self.weight = shard(full.weight, 1, comm)
        self.bias = nn.Parameter(full.bias.detach().clone())
    def forward(self, x):
        sum_ = ScatterSequence if self.sequence_parallel else g
        return sum_.apply(F.linear(x, self.weight), self.comm) + self.bias

class VocabParallelEmbedding(nn.Module):
    """Rank r owns a range of the vocabulary: its tokens' rows, zeros for others; g sums them: one row each."""
    def __init__(self, full, comm, padded):
        super().__init__()
        self.comm, self.sequence_parallel = comm, False  # True: the sum leaves cut along the sequence
        self.weight = shard(full.weight, 0, comm, padded=padded)
        self.start = comm.Get_rank() * self.weight.size(0)
    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.start + self.weight.size(0))
        rows = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        sum_ = ScatterSequence if self.sequence_parallel else g
        return sum_.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.comm)

class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy (--ragged: sum / count) of each rank's slice of the logits: 3 b x S allreduces, none back."""
    @staticmethod
    def forward(ctx, logits, target, comm, count=None):
        logits, per = logits.float(), logits.size(-1)  # max, target logit, sum of exps: float32
        start = comm.Get_rank() * per
        padding = torch.arange(start, start + per, device=logits.device) >= VOCAB
        logits = logits.masked_fill(padding, float("-inf"))  # padded columns take no probability
        top = allreduce(logits.max(dim=-1).values, comm, op=MPI.MAX)
        shifted = logits - top.unsqueeze(-1)  # exp() stays <= 1
        owned = (target >= start) & (target < start + per)
        local = (target - start).clamp(0, per - 1)
        picked = allreduce(shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0), comm)
        exps = shifted.exp()
        total, ignored = allreduce(exps.sum(dim=-1), comm), (target == IGNORE)[..., None]  # owned nowhere
        ctx.save_for_backward((exps / total[..., None]).masked_fill(ignored, 0), local, owned)  # no gradient
        ctx.count, losses = count or owned.numel(), (total.log() - picked).masked_fill(ignored[..., 0], 0)
        return losses.mean() if count is None else losses.sum() / count
    @staticmethod
    def backward(ctx, dloss):
        softmax, local, owned = ctx.saved_tensors  # d loss / d logit = softmax - one-hot(target)
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -owned.unsqueeze(-1).to(softmax.dtype))
        return grad * (dloss / ctx.count), None, None, None

def padded_vocab(tp):
    return -(-VOCAB // tp) * tp

def shard_block(block, comm):
    """Megatron's block, in place: attention f -> qkv columns (this rank's heads) -> proj rows -> g, MLP f -> fc1
    columns -> GELU -> fc2 rows -> g; experts stay whole. Block.forward is unchanged."""
    block.qkv, block.proj = ColumnParallelLinear(block.qkv, comm, groups=3), RowParallelLinear(block.proj, comm)
    block.heads //= comm.Get_size()
    if isinstance(block.mlp, MLP):
        block.mlp.fc1, block.mlp.fc2 = ColumnParallelLinear(block.mlp.fc1, comm), RowParallelLinear(block.mlp.fc2, comm)
    return block

class Stage(nn.Module):
    """Blocks [lo, hi) of the model, the embedding on the first stage, norm and head on the last, cut over T ranks."""
    def __init__(self, model, lo, hi, first, last, comm, ring, where, sequence_parallel, recompute):
        super().__init__()
        self.first, self.last, self.hidden, self.where = first, last, model.norm.normalized_shape[0], where
        padded = padded_vocab(comm.Get_size())
        if first:
            self.tokens, self.positions = VocabParallelEmbedding(model.tokens, comm, padded), model.positions
        self.blocks = nn.ModuleList(shard_block(b, comm) for b in model.blocks[lo:hi])
        for block in self.blocks:
            block.ring, block.recompute = ring, recompute
        if last:
            self.norm, self.out = model.norm, ColumnParallelLinear(model.out, comm, padded=padded)
        # Sequence parallelism: between tensor-parallel layers (LayerNorms, residuals) each of T ranks holds S/(C T)
        # positions (f, g gather and scatter them); a parameter whole on each rank (LayerNorm, row-parallel bias,
        # positions, router, expert) gets its positions' gradient: a hook sums it over T (Megatron: after the step).
        self.cut = comm.Get_size() if sequence_parallel else 1  # a piece of the sequence per rank
        for layer in (m for m in self.modules() if hasattr(m, "sequence_parallel")):
            layer.sequence_parallel = sequence_parallel
        for p in self.parameters() if sequence_parallel else ():
            if not getattr(p, "sliced", False):
                p.register_hook(functools.partial(allreduce, comm=comm))
    def forward(self, x):
        if self.first:  # this rank's global positions, wherever the layout put them
            x = self.tokens(x) + self.positions(self.where)
        for block in self.blocks:  # --recompute full: each block's input kept alone, the block run again in backward
            x = checkpoint(block, x, use_reentrant=True) if block.recompute == "full" else block(x)
        return self.out(self.norm(x)) if self.last else x

class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Around one micro-batch's forward: the bytes autograd saves for backward, each storage once, no parameter."""
    def __init__(self, stage):
        super().__init__(self.pack, lambda t: t)
        self.parameters, self.storages, self.bytes = {p.untyped_storage().data_ptr() for p in stage.parameters()}, {}, 0
    def pack(self, t):
        base = t if t._base is None else t._base  # the tensor a view (a weight's transpose) looks at
        copied = base.grad_fn.next_functions[0][0] if type(base.grad_fn).__name__ == "ToCopyBackward0" else None
        storage = getattr(copied, "variable", t).untyped_storage()  # autocast's copy of a parameter counts as it
        self.storages[storage.data_ptr()] = 0 if storage.data_ptr() in self.parameters else storage.nbytes()
        return t
    def __exit__(self, *exception):
        super().__exit__(*exception)
        self.bytes, self.storages = max(self.bytes, sum(self.storages.values())), {}

def layer_split(layers, pp):
    """Blocks [lo, hi) of each stage, as even as can be; the extra ones to the first stages (the last has the head)."""
    sizes = [layers // pp + (s < layers % pp) for s in range(pp)]
    return [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(pp)]

# -----------------------------------------------------------------------------
# Context parallelism within a stage: the sequence cut over C ranks, attention by ring
# -----------------------------------------------------------------------------
def shard_positions(seq_len, cp, layout):
    """Row c: rank c's global positions. zigzag: chunks c and 2C-1-c of 2C (equal causal work); else the c-th of C."""
    if layout == "contiguous" or cp == 1:
        return torch.arange(seq_len).view(cp, -1)
    chunks = torch.arange(seq_len).view(2 * cp, -1)
    return torch.stack([torch.cat([chunks[c], chunks[2 * cp - 1 - c]]) for c in range(cp)])

def block_plan(queries, keys):
    """Of one block of keys: the queries (rows) that see any, the keys (cols) any sees, their mask; None: none."""
    visible = keys.view(1, -1) <= queries.view(-1, 1)
    rows, cols = visible.any(1).nonzero().flatten(), visible.any(0).nonzero().flatten()
    return None if rows.numel() == 0 else types.SimpleNamespace(rows=rows, cols=cols, mask=~visible[rows][:, cols])

def block_attention(q, k, v, plan):
    """The plan's queries against one block of keys: its output and log-sum-exp, float32 (matmuls in q's dtype)."""
    scores = (q[:, :, plan.rows] @ k[:, :, plan.cols].transpose(-2, -1)).float() / math.sqrt(q.size(-1))
    scores = scores.masked_fill(plan.mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return ((scores - lse.unsqueeze(-1)).exp().to(v.dtype) @ v[:, :, plan.cols]).float(), lse

def ring_pass(t, comm):
    """Send t to the next rank of the ring and receive the previous rank's in its place."""
    rank, size, came = comm.Get_rank(), comm.Get_size(), torch.empty_like(t)
    buffer = mpi_buffer(came, send=False)
    comm.Sendrecv(mpi_buffer(t), dest=(rank + 1) % size, recvbuf=buffer, source=(rank - 1) % size)
    return from_mpi(came, buffer)

class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over all keys: the K/V blocks go round the ring, C-1 hops, each block's
    output merged by log-sum-exp: out <- out - sigmoid(lse_b - lse)(out - out_b), lse <- lse - logsigmoid(lse - lse_b).
    Backward: round again, the weights recomputed from the final lse; dQ adds up at home, each block's dK/dV travels
    with it, home after C hops. Blocking Sendrecvs (context_parallel.py hides them behind work)."""
    @staticmethod
    def forward(ctx, q, k, v, ring):
        ctx.ring, kv, out, lse = ring, torch.stack([k, v]), None, None
        for i in range(ring.comm.Get_size()):
            plan = ring.plans[i]  # rank c-i's block is in hand
            if plan is not None:
                block_out, block_lse = block_attention(q, kv[0], kv[1], plan)
                if out is None:  # the own block, first: every query sees itself
                    out, lse = block_out, block_lse
                else:
                    o, s = out[:, :, plan.rows], lse[:, :, plan.rows]
                    out[:, :, plan.rows] = o - torch.sigmoid(block_lse - s).unsqueeze(-1) * (o - block_out)
                    lse[:, :, plan.rows] = s - F.logsigmoid(s - block_lse)
            if i < ring.comm.Get_size() - 1:
                kv = ring_pass(kv, ring.comm)
        out = out.to(q.dtype)  # merged in float32, kept and returned in q's dtype (proj's, under autocast)
        ctx.save_for_backward(q, k, v, out, lse)
        return out
    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, dout, scale = ctx.ring, dout.contiguous(), 1 / math.sqrt(q.size(-1))
        delta = (dout.float() * out.float()).sum(-1)  # FlashAttention's D: rowsum(dO O) = rowsum(P dP)
        dq, kv, travelling, low = torch.zeros_like(q, dtype=lse.dtype), torch.stack([k, v]), None, q.dtype
        for i in range(ring.comm.Get_size()):  # sums in float32 (dQ, and dK/dV going home); K/V move in q's dtype
            dkv, plan = torch.zeros_like(kv, dtype=lse.dtype), ring.plans[i]
            if plan is not None:
                rows, cols, dor = plan.rows, plan.cols, dout[:, :, plan.rows].to(low)
                kb, vb = kv[:, :, :, cols]  # this block's keys and values that the rows see
                scores = ((q[:, :, rows] @ kb.transpose(-2, -1)).float() * scale).masked_fill(plan.mask, float("-inf"))
                weights = (scores - lse[:, :, rows].unsqueeze(-1)).exp()  # the block's share of the whole softmax
                dscores = weights * ((dor @ vb.transpose(-2, -1)).float() - delta[:, :, rows].unsqueeze(-1)) * scale
                dq[:, :, rows] += (dscores.to(low) @ kb).float()
                dkv[0][:, :, cols] += (dscores.to(low).transpose(-2, -1) @ q[:, :, rows]).float()
                dkv[1][:, :, cols] += (weights.to(low).transpose(-2, -1) @ dor).float()
            if travelling is not None:
                dkv += travelling  # the shares of the ranks before, of this same block
            travelling = ring_pass(dkv, ring.comm)
            if i < ring.comm.Get_size() - 1:
                kv = ring_pass(kv, ring.comm)
        return dq, travelling[0], travelling[1], None  # after C hops, the own block's dK, dV

class Ring:
    """A block's attention on rank c: the communicator, the plans against the K/V in hand after i hops (rank c-i's)."""
    def __init__(self, comm, positions, device):
        self.comm, c, C = comm, comm.Get_rank(), comm.Get_size()
        plans = (block_plan(positions[c], positions[(c - i) % C]) for i in range(C))
        self.plans = [p and types.SimpleNamespace(**{k: t.to(device) for k, t in vars(p).items()}) for p in plans]

# -----------------------------------------------------------------------------
# Expert parallelism within a stage: a mixture of experts, each expert group sharing the experts out
# -----------------------------------------------------------------------------
class MoE(nn.Module):
    """The block's MLP as X expert MLPs. A router (softmax, top K, a tie to the lowest index) sends each token to K of
    them: y = sum of gate x expert(x). Experts are whole on each tensor-parallel rank (Megatron's expert tensor
    parallelism splits them over T): the T ranks route the same tokens, or with sequence parallelism each its own
    positions, the experts' gradients then summed over T like a LayerNorm's. Switch's loss counts every choice of the
    stage's ranks per micro-batch and trains the routers where they are; the loss printed is the cross-entropy."""
    def __init__(self, args):
        super().__init__()
        self.router = nn.Linear(args.hidden, args.experts, bias=False)
        self.experts = nn.ModuleList(MLP(args.hidden) for _ in range(args.experts))
        self.top_k, self.capacity_factor, self.aux_coef = args.top_k, args.capacity_factor, args.aux_loss_coef
        self.group = self.routers = self.written = None  # build_stage() sets them (scale: the aux loss's share)
        self.scale, self.dropped, self.gap = 1.0, 0, math.inf  # the report's: pairs dropped, smallest top-k gap
    def forward(self, x):
        tokens, k, X = x.reshape(-1, x.size(-1)), self.top_k, self.router.out_features
        with torch.autocast(x.device.type, enabled=False):  # the router in float32: bf16 logits would flip choices
            probs = self.router(tokens).softmax(dim=-1)
        ranked, order = probs.sort(dim=-1, descending=True, stable=True)
        self.gap = min(self.gap, (ranked[:, k - 1] - ranked[:, k]).min().item())
        if self.written is not None and torch.is_grad_enabled():  # --check's one process follows the choices made
            self.written.append(order[:, :k])
        pairs, gates = order[:, :k].reshape(-1), ranked[:, :k]  # token t's choice c is pair t K + c
        exact = fractions.Fraction(repr(self.capacity_factor or 0))  # F: an expert keeps its first ceil(F K n / X)
        limit = math.inf if self.capacity_factor is None else math.ceil(exact * k * len(tokens) / X)
        kept = F.one_hot(pairs, X).cumsum(0).gather(1, pairs[:, None]).squeeze(1) <= limit
        self.dropped += int((~kept).sum()) * torch.is_grad_enabled()  # once: --recompute full's first pass has no grad
        kept = kept.nonzero().squeeze(1)
        kept = kept[pairs[kept].sort(stable=True).indices]  # by expert; in token order within one
        out = self.run_experts(tokens[kept // k], torch.bincount(pairs[kept], minlength=X))
        y = out.new_zeros(len(pairs), out.size(1)).index_put((kept,), out).view(len(tokens), k, -1)
        y = sum(gates[:, c, None] * y[:, c] for c in range(k))  # a dropped pair adds 0: the residual carries it
        # Switch's load-balancing loss, alpha X sum_i f_i P_i: f_i the share of all routing ranks' pairs
        # that chose expert i (the counts summed over the stage), P_i the mean probability of i here.
        counts = allreduce(torch.bincount(pairs, minlength=X), self.routers)
        aux = self.aux_coef * X * (counts / counts.sum() * probs.mean(dim=0)).sum() * self.scale
        return LoadBalancing.apply(y.view_as(x), aux)
    def run_experts(self, rows, sent):
        """rows sorted by expert, sent[i] of them for expert i. Dispatch: each to the rank of the group that holds its
        expert, which runs once on its rows from every rank; combine: the outputs back, in the order the rows left."""
        size, local, kind = self.group.Get_size(), len(self.experts), rows.device.type
        received = torch.empty_like(sent) if size > 1 else sent  # [i x local + e]: from rank i for this rank's expert e
        if size > 1:
            buffer = mpi_buffer(received, send=False)
            self.group.Alltoall(mpi_buffer(sent), buffer)
            from_mpi(received, buffer)
            back, forth = sent.view(size, local).sum(1).tolist(), received.view(size, local).sum(1).tolist()
            rows = rows.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else rows  # fc1 casts
            rows = AllToAll.apply(rows, back, forth, self.group)  # dispatch
        pieces = torch.arange(len(rows), device=rows.device).split(received.tolist())
        by_expert = torch.cat([pieces[i * local + e] for e in range(local) for i in range(size)])
        sizes = received.view(size, local).sum(0).tolist()
        out = torch.cat([e(r) for e, r in zip(self.experts, rows[by_expert].split(sizes))])[by_expert.argsort()]
        return AllToAll.apply(out, forth, back, self.group) if size > 1 else out  # combine

class AllToAll(torch.autograd.Function):
    """MPI_Alltoallv of a matrix's rows: send_rows[j] to rank j, recv_rows[i] from rank i; backward, the reverse."""
    @staticmethod
    def forward(ctx, rows, send_rows, recv_rows, comm):
        ctx.reverse, out = (recv_rows, send_rows, comm), rows.new_empty(sum(recv_rows), rows.size(1))
        send, recv = mpi_buffer(rows.detach().contiguous()), mpi_buffer(out, send=False)
        counts = [[n * rows.size(1) * rows.element_size() for n in numbers] for numbers in (send_rows, recv_rows)]
        offsets = [[sum(c[:j]) for j in range(len(c))] for c in counts]  # in bytes: any dtype
        comm.Alltoallv([send, (counts[0], offsets[0]), MPI.BYTE], [recv, (counts[1], offsets[1]), MPI.BYTE])
        return from_mpi(out, recv)
    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, *ctx.reverse), None, None, None

class LoadBalancing(torch.autograd.Function):
    """Identity on the mixture's output; backward gives the load-balancing loss its gradient, 1, on its own stage."""
    @staticmethod
    def forward(ctx, y, aux):
        return y
    @staticmethod
    def backward(ctx, dy):
        return dy, torch.ones((), device=dy.device)

# -----------------------------------------------------------------------------
# Pipeline parallelism across stages: 1F1B as per-rank lists of actions, simulated before they run
# -----------------------------------------------------------------------------
# op: forward, backward, send_act/recv_act (an activation), send_grad/recv_grad (its gradient), or reduce (the
# data-parallel gradient allreduce); mb: the micro-batch acted on, None for reduce, which sums all M of them.
Action = collections.namedtuple("Action", "op mb")

class ScheduleError(Exception):
    """A schedule that would deadlock, lose a message or use an input before it exists."""

def one_f_one_b(pp, m, stage):
    """1F1B (PipeDream-Flush): P-1-stage warm-up forwards, one forward one backward, the rest; then the 'reduce'."""
    def forward(i):
        return [Action(op, i) for op in ["recv_act"] * (stage > 0) + ["forward"] + ["send_act"] * (stage < pp - 1)]
    def backward(i):
        return [Action(op, i) for op in ["recv_grad"] * (stage < pp - 1) + ["backward"] + ["send_grad"] * (stage > 0)]
    warmup = min(pp - 1 - stage, m)
    actions = [a for i in range(warmup) for a in forward(i)]
    for i in range(m - warmup):
        actions += forward(warmup + i) + backward(i)
    return actions + [a for i in range(m - warmup, m) for a in backward(i)] + [Action("reduce", None)]

def dry_run(lists, dp, cp, tp, m, experts=False):
    """Execute every rank's list on paper, a slot per forward or backward. A send never blocks (Isend); a receive waits
    for the send of the rank of equal (dp, cp, tp) a stage away. A forward or backward holds the tensor allreduces and
    ring hops: the C x T ranks of equal (pp, dp) run it together (with experts the stage's D x C x T, the router's
    counts), 'reduce' the D x C of equal (pp, tp). Raises ScheduleError unless each rank runs each micro-batch's forward
    and backward once, after its inputs exist, and every message arrives. Returns each rank's ideal timeline."""
    n, pp = len(lists), len(lists) // (dp * cp * tp)
    pc, clock, sent = [0] * n, [0] * n, {}  # sent: (src, dst, kind, mb) -> slot it was sent at
    have = [set() for _ in range(n)]  # (act|grad, mb) received, (forward|backward, mb) computed
    spans = [[] for _ in range(n)]  # (F or B and the micro-batch, first slot, slot after)
    def neighbour(r, step):  # the rank of equal (dp, cp, tp) `step` stages away, if any
        p, d, c, t = coordinates(r, dp, cp, tp)
        return rank_at(p + step, d, c, t, dp, cp, tp) if 0 <= p + step < pp else None
    def group(r, op):  # who runs op together: the data-parallel group, or a stage's C x T (or D x C x T) ranks
        p, d, c, t = coordinates(r, dp, cp, tp)
        ds, ts = (range(dp), [t]) if op == "reduce" else (range(dp) if experts else [d], range(tp))
        return [rank_at(p, e, b, u, dp, cp, tp) for e in ds for b in range(cp) for u in ts]
    def compute(r, op, i):
        needs = {"forward": [("act", i)] * (neighbour(r, -1) is not None),
                 "backward": [("forward", i)] + [("grad", i)] * (neighbour(r, 1) is not None),
                 "reduce": [("backward", j) for j in range(m)]}[op]
        if (op, i) in have[r] or i not in (range(m) if op != "reduce" else [None]) or set(needs) - have[r]:
            raise ScheduleError(f"rank {r}: {op} {i} twice, out of range, or before {needs}")
        have[r].add((op, i))
        if op != "reduce":
            spans[r].append((f"{op[0].upper()}{i}", clock[r], clock[r] + 1))
            clock[r] += 1
    moved = True
    while moved:
        moved = False
        for r in range(n):
            while pc[r] < len(lists[r]):
                op, i = lists[r][pc[r]]
                kind = op.split("_")[-1]
                if op.startswith("recv_"):
                    key = (neighbour(r, -1 if kind == "act" else 1), r, kind, i)
                    if key not in sent:
                        break  # blocked until the peer sends
                    clock[r] = max(clock[r], sent.pop(key))
                    have[r].add((kind, i))
                elif op.startswith("send_"):
                    dst, needs = (neighbour(r, 1), "forward") if kind == "act" else (neighbour(r, -1), "backward")
                    if (needs, i) not in have[r] or dst is None or (r, dst, kind, i) in sent:
                        raise ScheduleError(f"rank {r}: {op} {i} before its {needs}, to no rank, or twice")
                    sent[(r, dst, kind, i)] = clock[r]
                elif op in ("forward", "backward", "reduce"):
                    members = group(r, op)
                    if any(pc[q] >= len(lists[q]) or lists[q][pc[q]] != (op, i) for q in members):
                        break  # a collective: waits until the whole group is here
                    start = max(clock[q] for q in members)
                    for q in members:
                        clock[q] = start
                        compute(q, op, i)
                        pc[q] += 1 if q != r else 0
                else:
                    raise ScheduleError(f"rank {r}: unknown action {op!r}")
                pc[r] += 1
                moved = True
    stuck = [f"rank {r} at {lists[r][pc[r]]}" for r in range(n) if pc[r] < len(lists[r])]
    if stuck:
        raise ScheduleError(f"deadlock: {', '.join(stuck)} wait for messages or peers that never come")
    if sent:
        raise ScheduleError(f"messages never received (src, dst, kind, micro-batch): {sorted(sent)}")
    for r in range(n):  # each ran at most once and in range: 2M of them means all of them
        if len(spans[r]) != 2 * m or ("reduce", None) not in have[r]:
            raise ScheduleError(f"rank {r} does not run all {m} micro-batches and the reduce")
    return spans

def tag(op, mb):
    """A message's tag: its micro-batch and direction, so that no two in flight share one."""
    return 2 * mb + op.endswith("grad")

# -----------------------------------------------------------------------------
# Data parallelism across replicas: the bucketed gradient allreduce on the data-parallel communicator
# -----------------------------------------------------------------------------
class GradBuckets:
    """PyTorch DDP's reducer in miniature. Buckets in reverse registration order: the order backward produces gradients.
    In the step's last backward (after it a gradient holds all M micro-batches), a post-accumulate-grad hook counts a
    bucket's gradients and starts its non-blocking allreduce once the last is in. groups: (parameters, the ranks that
    sum them), each in its own buckets: the dense over the N = D x C ranks of equal (pp, tp), an expert's over the N/E
    that hold it. finish() divides the sums by N: the loss is the mean of N shares, and an expert's N/E copies saw all N
    between them (/ (N/E) would step the experts E times too far); ragged: by 1, each share a sum over the step's count.
    zero (ZeRO-1): a reduce-scatter: rank r of n gets slice r's sum of each bucket (padded), in shards."""
    def __init__(self, groups, shares, bucket_bytes, zero=False, ragged=False):
        self.shares, self.zero, self.buckets, self.comms = shares, zero and shares > 1, [], []
        self.divisor = 1 if ragged else shares  # finish()'s
        for params, comm in groups:
            size = bucket_bytes  # a group's first parameter opens a bucket
            for p in reversed(list(params)):
                if size >= bucket_bytes:
                    self.buckets, self.comms, size = self.buckets + [[]], self.comms + [comm], 0
                self.buckets[-1].append(p)
                size += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        sizes = [sum(p.numel() for p in b) for b in self.buckets]
        self.padded = [-(-n // c.Get_size()) * c.Get_size() for n, c in zip(sizes, self.comms)]
        self.shards = [None] * len(self.buckets)  # ZeRO-1: this rank's slice of each bucket's averaged gradient
        self.exchanging, self.ready, self.pending = False, [0] * len(self.buckets), []
        # The report's marks: how many gradients the last backward had computed (a hook of its own) as each bucket left.
        self.computed, self.posted_at = 0, []
        for p in self.bucket_of if shares > 1 else ():
            p.register_post_accumulate_grad_hook(self._computed)
            p.register_post_accumulate_grad_hook(self._grad_ready)
    def start(self):
        """Before the last backward of the step: exchange each bucket when it is complete."""
        self.exchanging, self.ready, self.pending = True, [0] * len(self.buckets), []
        self.computed, self.posted_at = 0, []
    def _computed(self, p):
        self.computed += self.exchanging
    def _grad_ready(self, p):
        if not self.exchanging:  # an earlier micro-batch: gradients just add up
            return
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            flat, comm = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]), self.comms[i]
            if comm.Get_size() == 1:  # experts no other rank holds: no sum, finish() divides
                self.pending.append((i, flat, flat, None))
                return
            if self.zero:  # each rank receives the sum of its own slice: 1/n of the bucket
                flat = F.pad(flat, (0, self.padded[i] - flat.numel()))
                shard = flat.new_empty(self.padded[i] // comm.Get_size())
                buffer = mpi_buffer(shard, nonblocking=True, send=False)
                request = comm.Ireduce_scatter_block(mpi_buffer(flat, nonblocking=True), buffer, op=MPI.SUM)
                flat = shard
            else:
                buffer = mpi_buffer(flat, nonblocking=True)
                request = comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            self.pending.append((i, flat, buffer, request))
            self.posted_at.append(self.computed)
        for *_, request in self.pending:
            request and request.Test()  # MPICH moves non-blocking collectives only inside MPI calls
    def finish(self):
        """Wait for every bucket; leave the sums / divisor in .grad (ZeRO-1: in shards)."""
        self.exchanging = False
        if self.shares == 1:
            return
        assert len(self.pending) == len(self.buckets), "a gradient never arrived"
        for i, flat, buffer, request in self.pending:
            if request is not None:
                request.Wait()
            flat = from_mpi(flat, buffer) / self.divisor
            if self.zero:
                self.shards[i] = flat
                continue
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

class ShardedOptimizer:
    """ZeRO stage 1 (Megatron's distributed optimizer) over the n ranks that sum a bucket: rank r keeps the state of
    slice r of each bucket only (SGD's momentum, AdamW's two moments): 1/n of it. Its step: torch's on the slice (the
    gradient's from the reduce-scatter), then an Allgather of all slices into the bucket's parameters."""
    def __init__(self, buckets, args):
        self.buckets = buckets
        self.slices = [nn.Parameter(torch.zeros(n // c.Get_size(), device=b[0].device))
                       for n, b, c in zip(buckets.padded, buckets.buckets, buckets.comms)]
        self.inner = make_optimizer(args, self.slices)  # torch's own step, on slices
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
    def zero_grad(self, set_to_none=False):
        for p in self.buckets.bucket_of:
            if p.grad is not None:
                p.grad.zero_()
    def step(self):
        every = list(zip(self.slices, self.buckets.buckets, self.buckets.padded, self.buckets.comms))
        for (piece, bucket, n, comm), grad in zip(every, self.buckets.shards):
            flat = F.pad(torch.cat([p.detach().reshape(-1) for p in bucket]), (0, n - sum(p.numel() for p in bucket)))
            piece.data.copy_(flat.view(comm.Get_size(), -1)[comm.Get_rank()])  # the parameters' slice: the master
            piece.grad = grad
        self.inner.step()
        for piece, bucket, n, comm in every:
            whole = piece.new_empty(n)
            buffer = mpi_buffer(whole, send=False)
            comm.Allgather(mpi_buffer(piece.detach()), buffer) if comm.Get_size() > 1 else buffer.copy_(piece.detach())
            whole, offset = from_mpi(whole, buffer), 0
            with torch.no_grad():
                for p in bucket:
                    p.copy_(whole[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
    def moments(self, field):
        """For a checkpoint: each parameter's `field` of the state, whole, all-gathered over the n ranks of each bucket
        (on the plain communicator: not the step's traffic). Before a first step, zeros: the same to SGD."""
        every, out = zip(self.slices, self.buckets.buckets, self.buckets.padded, self.buckets.comms), {}
        for piece, bucket, n, comm in every:
            mine, whole = self.inner.state[piece].get(field, torch.zeros_like(piece)), piece.new_empty(n)
            buffer = mpi_buffer(whole, send=False)
            getattr(comm, "comm", comm).Allgather(mpi_buffer(mine), buffer)
            whole, offset = from_mpi(whole, buffer), 0
            for p in bucket:
                out[p], offset = whole[offset:offset + p.numel()].view_as(p), offset + p.numel()
        return out
    def load_moments(self, moments, step):
        """After a resume, on any grid: {field: {p: the whole parameter's}}; slice r of each bucket kept."""
        for piece, bucket, n, comm in zip(self.slices, self.buckets.buckets, self.buckets.padded, self.buckets.comms):
            for field, whole in moments.items():
                flat = F.pad(torch.cat([whole[p].reshape(-1) for p in bucket]), (0, n - sum(p.numel() for p in bucket)))
                self.inner.state[piece][field] = flat.view(comm.Get_size(), -1)[comm.Get_rank()].clone()
            self.inner.state[piece].update({k: v.clone() for k, v in step.items()})  # a count each

# -----------------------------------------------------------------------------
# The recipe: AdamW, the gradient clipped to its global norm, a warm-up and a cosine (as nanoGPT's train.py)
# -----------------------------------------------------------------------------
def make_optimizer(args, parameters):
    """--optimizer: SGD with momentum 0.9, or AdamW (float32 moments: 8 bytes for each parameter a rank steps)."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return torch.optim.SGD(parameters, lr=args.lr, momentum=0.9)

def learning_rate(args, step):
    """Linear warm-up over --warmup-steps W, then --lr or a cosine to lr / 10 at --steps: of the step alone."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    low, progress = args.lr / 10, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    cosine = low + 0.5 * (args.lr - low) * (1 + math.cos(math.pi * progress))  # lr at progress 0, lr / 10 at 1
    return args.lr if args.lr_schedule == "constant" else cosine

def adds_squares(p, axes, sharded=False):
    """Whether this rank adds p's squares to the norm. A tensor-parallel slice: each of the T ranks its own; whole on
    the T ranks (LayerNorms, row-parallel biases, positions, routers, experts): tensor rank 0. Of the D x C ranks
    with equal gradients after the reduce (an expert's D x C / E), the first; ZeRO-1's slices: each its own."""
    holders = axes["expert-data" if hasattr(p, "expert") else "data"]
    return (hasattr(p, "sliced") or axes["tensor"].Get_rank() == 0) and (sharded or holders.Get_rank() == 0)

def global_grad_norm(stage, buckets, axes, comm):
    """The whole model's gradient norm in float32, after the reduce: each rank adds the squares adds_squares() gives it
    (ZeRO-1: of its slices of the buckets, the only reduced ones), one Allreduce over all ranks sums every stage's. On
    every rank, a LayerNorm would count T x D x C times (Megatron-LM's #5916); over one stage, the others would miss."""
    squares = torch.zeros((), device=next(stage.parameters()).device)
    for shard, bucket, group in zip(buckets.shards, buckets.buckets, buckets.comms) if buckets.zero else ():
        counted = torch.cat([torch.full((p.numel(),), float(adds_squares(p, axes, True))) for p in bucket])
        counted = F.pad(counted, (0, shard.numel() * group.Get_size() - counted.numel())).view(group.Get_size(), -1)
        squares += (shard.float().square() * counted[group.Get_rank()].to(shard.device)).sum()
    for p in stage.parameters() if not buckets.zero else ():
        squares += p.grad.float().square().sum() if adds_squares(p, axes) else 0.0
    return allreduce(squares.reshape(1), comm).sqrt().item()  # not one axis's traffic: uncounted

# -----------------------------------------------------------------------------
# The hybrid training step: this rank's list of actions, executed
# -----------------------------------------------------------------------------
def valid_targets(y, comm):
    """--ragged: the step's count of valid targets (not IGNORE) over comm, the D x C ranks of equal (pp, tp): one
    Allreduce of a number before the forward; only the last stage divides by it, its T ranks (same targets) each over
    its own D x C. A per-rank mean would overweigh each target of a rank with fewer: a gradient no process computes."""
    return allreduce(torch.tensor([(y != IGNORE).sum().item()], dtype=torch.float64), comm).item()

def train_step(stage, optimizer, buckets, actions, x, y, args, axes, timeline, comm):
    """One optimizer step on this replica's share (x, y) of the batch, in M micro-batches, the gradient clipped to its
    norm --clip-grad (0: not). Returns the replica's loss on the last stage (the micro-batches' losses summed / M;
    --ragged: sums over the step's count), elsewhere 0; and the norm, before the clip, on every rank."""
    m, pp_comm, tp_comm, bf16 = args.micro_batches, axes["pipeline"], axes["tensor"], args.precision == "bf16"
    s, last_stage = pp_comm.Get_rank(), pp_comm.Get_size() - 1
    wire = torch.bfloat16 if bf16 else torch.float32  # what crosses a stage boundary, both ways
    xs, ys = x.chunk(m), y.chunk(m)
    shape = (xs[0].size(0), xs[0].size(1) // stage.cut, stage.hidden)  # an activation, or its gradient
    inputs, outputs, received, grads, recvs, sends, total = {}, {}, {}, {}, {}, [], 0.0
    last_backward = max(k for k, a in enumerate(actions) if a.op == "backward")
    count = valid_targets(y, axes["data"]) if args.ragged and s == last_stage else None
    optimizer.zero_grad(set_to_none=False)
    def post(a):  # a receive from the previous stage (activations) or the next (gradients)
        t, source = torch.empty(shape, dtype=wire, device=x.device), s - 1 if a.op == "recv_act" else s + 1
        buffer = mpi_buffer(t, send=False)
        recvs[a] = (pp_comm.Irecv(buffer, source=source, tag=tag(a.op, a.mb)), t, buffer)
    for k, a in enumerate(actions):
        if a.op in ("forward", "backward"):  # post the next receive, to land while we compute
            upcoming = next((b for b in actions[k + 1:] if b.op.startswith("recv_")), None)
            if upcoming is not None and upcoming not in recvs:
                post(upcoming)
        if a.op.startswith("recv_"):
            if a not in recvs:
                post(a)
            request, t, buffer = recvs.pop(a)
            request.Wait()  # idle until the peer's message is in
            received[a] = from_mpi(t, buffer)
        elif a.op == "forward":
            with timeline.span("compute", f"F{a.mb}"), stage.meter, torch.autocast(x.device.type, wire, enabled=bf16):
                inp = xs[a.mb] if s == 0 else received.pop(Action("recv_act", a.mb)).float().requires_grad_()
                out = stage(inp)
                if s == last_stage:  # / M (--ragged: / count): the summed gradients are the share's
                    out = VocabParallelCrossEntropy.apply(out, ys[a.mb], tp_comm, count) / (1 if count else m)
                    total += out.item()
            inputs[a.mb], outputs[a.mb] = inp, out
        elif a.op == "backward":
            if k == last_backward:
                buckets.start()  # from now on, a complete bucket starts its allreduce
            with timeline.span("compute", f"B{a.mb}"):
                outputs.pop(a.mb).backward(None if s == last_stage else received.pop(Action("recv_grad", a.mb)).float())
            grads[a.mb] = inputs.pop(a.mb).grad
        elif a.op.startswith("send_"):  # the activation to the next stage, or the gradient back
            forward = a.op == "send_act"
            buffer = mpi_buffer((outputs[a.mb].detach() if forward else grads.pop(a.mb)).to(wire).contiguous())
            sends.append((pp_comm.Isend(buffer, dest=s + 1 if forward else s - 1, tag=tag(a.op, a.mb)), buffer))
        elif a.op == "reduce":
            buckets.finish()
        sends = [(r, b) for r, b in sends if not r.Test()]  # MPICH moves a message only inside MPI calls
    for request, _ in sends:
        request.Wait()
    norm = global_grad_norm(stage, buckets, axes, comm)  # of the reduced gradients
    with timeline.span("compute", "optimizer"):
        scale = min(1.0, args.clip_grad / (norm + 1e-6)) if args.clip_grad else 1.0  # clip_grad_norm_'s, on every rank
        for grad in (buckets.shards if buckets.zero else [p.grad for p in stage.parameters()]) if scale < 1 else ():
            grad.mul_(scale)
        optimizer.step()
    return total, norm

# -----------------------------------------------------------------------------
# Model: a GPT-2 style character-level language model, plain (what one process trains)
# -----------------------------------------------------------------------------
def attend(qkv, heads, ring=None):
    """Causal self-attention of `heads` heads, q, k, v side by side: in one process or by `ring`."""
    b, t, c = qkv.size(0), qkv.size(1), qkv.size(2) // 3
    q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in qkv.split(c, dim=2))
    if ring is not None:
        return RingAttention.apply(q, k, v, ring).transpose(1, 2).reshape(b, t, c)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // heads)
    future = torch.ones(t, t, dtype=torch.bool, device=qkv.device).triu(1)
    weights = scores.float().masked_fill(future, float("-inf")).softmax(dim=-1)  # float32, bf16 or not
    return (weights @ v).transpose(1, 2).reshape(b, t, c)

class MLP(nn.Module):
    """h -> 4h -> h with GELU: a block's MLP, and each expert of a mixture."""
    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

class Block(nn.Module):
    """Pre-LayerNorm block (--experts: its MLP a mixture); GELU and LayerNorm keep rounding differences small."""
    recompute = "none"  # the plain model's; Stage sets the run's --recompute
    def __init__(self, args):
        super().__init__()
        h, self.heads, self.ring = args.hidden, args.heads, None  # ring: a rank's Ring under context parallelism
        self.ln1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)  # q, k, v side by side
        self.ln2, self.mlp = nn.LayerNorm(h), MoE(args) if args.experts else MLP(h)
    def forward(self, x):
        inputs, selective = (self.qkv(self.ln1(x)), self.heads, self.ring), self.recompute == "selective"
        x = x + self.proj(checkpoint(attend, *inputs, use_reentrant=True) if selective else attend(*inputs))
        return x + self.mlp(self.ln2(x))

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
    """The full model from the seed, on the CPU: the same network on every grid (GPT-2's init)."""
    torch.manual_seed(args.seed)
    model = GPT(args)
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            nn.init.normal_(mod.weight, std=0.02)
        if isinstance(mod, nn.Linear) and mod.bias is not None:
            nn.init.zeros_(mod.bias)
    return model

def build_stage(args, axes, device, model=None):
    """The full model (from the seed, on the CPU) cut to this rank's stage, moved alone, with its ring and experts."""
    s, pp, cp, model = axes["pipeline"].Get_rank(), args.pp, axes["context"], model or build_model(args)
    lo, hi = layer_split(args.layers, pp)[s]
    for moe in [block.mlp for block in model.blocks[lo:hi]] if args.experts else ():  # rank e: experts eX/E on
        e, per = axes["expert"].Get_rank(), args.experts // axes["expert"].Get_size()
        moe.experts = nn.ModuleList(moe.experts[e * per:(e + 1) * per])  # marked: their gradients, buckets of their own
        for p in moe.experts.parameters():
            p.expert = True
        moe.group, moe.routers, moe.written = axes["expert"], axes["stage"], [] if args.check else None
        moe.scale = 1 / (args.micro_batches * args.tp ** args.sequence_parallel * (args.dp * args.cp) ** args.ragged)
    positions = shard_positions(args.seq_len, cp.Get_size(), args.layout)
    ring = Ring(cp, positions, device) if cp.Get_size() > 1 else None
    where = positions[cp.Get_rank()]  # --sequence-parallel: tensor-parallel rank t's piece of them
    where = where.view(args.tp, -1)[axes["tensor"].Get_rank()] if args.sequence_parallel else where
    stage = Stage(model, lo, hi, s == 0, s == pp - 1, axes["tensor"], ring, where.clone().to(device),
                  args.sequence_parallel, args.recompute).to(device)
    stage.meter = SavedActivations(stage)  # the report's: what a micro-batch's forward saves
    return stage

def build_optimizer(args, stage, axes):
    """The gradient buckets (dense over "data", experts over "expert-data"), ZeRO-1's or torch's optimizer."""
    dense, experts = ([p for p in stage.parameters() if hasattr(p, "expert") == kind] for kind in (False, True))
    groups = [(dense, axes["data"]), (experts, axes["expert-data"])]
    buckets = GradBuckets(groups, axes["data"].Get_size(), args.bucket_mb * 2**20, args.zero_stage == 1, args.ragged)
    return buckets, ShardedOptimizer(buckets, args) if buckets.zero else make_optimizer(args, stage.parameters())

def blocks_held(args, axes, stage):
    """For checkpoints: this rank's parameters as blocks of the whole model's tensors, {name: (parameter, the whole's
    shape, offset, size, the parameter's shape in the whole's dimensions)}. A slice starts at t x its size along
    shard()'s dimension, no padding; q, k, v, (3h, ..), as (3, h, ..): rank t's heads one block."""
    s, t, e = (axes[axis].Get_rank() for axis in ("pipeline", "tensor", "expert"))
    with torch.device("meta"):  # the whole model's shapes, by name: no memory, no init
        shapes = {name: list(w.shape) for name, w in GPT(args).state_dict().items()}
    lo, held = layer_split(args.layers, args.pp)[s][0], {}
    for name, p in stage.named_parameters():
        parts = name.split(".")  # blocks.i.mlp.experts.k.fc1.weight: block lo + i, expert e X/E + k
        if parts[0] == "blocks":
            parts[1] = str(lo + int(parts[1]))
            if parts[3] == "experts":
                parts[4] = str(e * args.experts // args.ep + int(parts[4]))
        shape, (dim, groups), view = shapes[".".join(parts)], getattr(p, "sliced", (0, 1)), list(p.shape)
        if groups > 1:  # (3h, ..) as (3, h, ..)
            shape, view, dim = [*shape[:dim], groups, shape[dim] // groups, *shape[dim + 1:]], \
                [*view[:dim], groups, view[dim] // groups, *view[dim + 1:]], dim + 1
        offset, size = [0] * len(shape), list(view)
        if hasattr(p, "sliced"):
            offset[dim] = t * view[dim]
            size[dim] = min(view[dim], shape[dim] - offset[dim])  # padding rows: not the model's
        held[".".join(parts)] = (p, shape, offset, size, view)
    return held

# -----------------------------------------------------------------------------
# Data: characters of Python's own source, batches a function of (seed, step)
# -----------------------------------------------------------------------------
@functools.cache
def load_text():
    """argparse.py, textwrap.py and shlex.py of this Python, every byte >= 128 made '?'."""
    raw = b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in SOURCES)
    return torch.tensor([b if b < 128 else ord("?") for b in raw], dtype=torch.long)

def make_batch(seed, step, size, seq_len, ragged=False):
    """The global batch of one step: inputs and next-character targets, from (seed, step) alone. ragged:
    each document's length drawn next, 1 to seq_len; past it inputs 0, targets IGNORE (experts route them too)."""
    data = load_text()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - seq_len - 1, (size,), generator=gen).tolist()
    x = torch.stack([data[o:o + seq_len] for o in starts])
    y = torch.stack([data[o + 1:o + seq_len + 1] for o in starts])
    if ragged:  # drawn after the starts: without it, the batch is what it was
        past = torch.arange(seq_len) >= torch.randint(1, seq_len + 1, (size, 1), generator=gen)
        x, y = x.masked_fill(past, 0), y.masked_fill(past, IGNORE)
    return x, y

# -----------------------------------------------------------------------------
# The run
# -----------------------------------------------------------------------------
def train(args, comm, counted, device, stage, optimizer, buckets, actions, timeline, past=((), ())):
    """This rank's list of `actions` (proven by the dry run), once a step, after the `past` steps (losses and norms,
    from a checkpoint). Returns each step's global loss and gradient norm, on every rank, and the timings."""
    pp_comm, dp_comm, cp_comm, tp_comm = (counted[a] for a in ("pipeline", "data", "context", "tensor"))
    reports = pp_comm.Get_rank() == pp_comm.Get_size() - 1 and tp_comm.Get_rank() == 0
    replica = dp_comm.Get_rank() // cp_comm.Get_size()  # the D x C ranks in order (dp, cp)
    positions = shard_positions(args.seq_len, cp_comm.Get_size(), args.layout)[cp_comm.Get_rank()]
    losses, norms, records, shares = [], list(past[1]), [], 1 if args.ragged else dp_comm.Get_size()  # D x C means
    for step in range(len(past[0]), args.steps):
        start = time.perf_counter()
        batch = make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged)
        x, y = (t.chunk(args.dp)[replica][:, positions].to(device) for t in batch)  # its replica's B/D, its positions
        for settings in optimizer.param_groups:
            settings["lr"] = learning_rate(args, step)
        loss, norm = train_step(stage, optimizer, buckets, actions, x, y, args, counted, timeline, comm)
        losses.append(loss), norms.append(norm), records.append(timeline.step_record(start))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print_progress(comm, args, step, global_losses(comm, losses[-1:], reports, shares)[0], records[-1], norm)
        checkpoint_if_due(comm, args, step, lambda: hybrid_shard(comm, args, counted, stage, optimizer, list(past[0])
                          + global_losses(comm, losses, reports, shares), norms), model_config(args))
    return list(past[0]) + global_losses(comm, losses, reports, shares), norms, records

def global_losses(comm, losses, reports, shares):
    """The global batch's losses: the sum of the losses known to their last stage (`reports`: one rank) / shares."""
    total = torch.tensor(losses if reports else [0.0] * len(losses), dtype=torch.float64)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    return (total / shares).tolist()

def model_config(args):
    """What a checkpoint holds: the model alone, never the grid (any grid re-cuts it; the state says which wrote it)."""
    return {"model": "GPT", "vocab": VOCAB, "top_k": args.top_k if args.experts else None,
            **{key: vars(args)[key] for key in ("layers", "hidden", "heads", "seq_len", "experts", "optimizer")}}

def main(argv=None, comm=MPI.COMM_WORLD):
    """Parse, set up, prove the schedule, train, check, report. Returns this rank's exit status."""
    try:
        args = parse_args(argv, comm.Get_size())
        check_paths(comm, args)
        check_tags(comm, args.micro_batches)
        run = setup(comm, args)
        # Every rank writes and proves on paper the lists of all ranks (one verdict), then runs its own, the one proven.
        lists = [one_f_one_b(args.pp, args.micro_batches, coordinates(r, args.dp, args.cp, args.tp)[0])
                 for r in range(comm.Get_size())]
        ideal = dry_run(lists, args.dp, args.cp, args.tp, args.micro_batches, args.experts > 0)
        axes = make_grid(comm, args.pp, args.dp, args.cp, args.tp, args.ep)
        counted = {axis: CountedComm(c, run.timeline) for axis, c in axes.items()}
        stage = build_stage(args, counted, run.device)
        buckets, optimizer = build_optimizer(args, stage, counted)
        past, resumed = ((), ()), None
        if args.resume:  # any grid: each rank asks for the blocks of the whole model that it holds on this one
            resumed, blocks = load_checkpoint(comm, args.save, model_config(args),
                                              lambda manifest: blocks_wanted(args, counted, stage), args.steps)
            past = restore(args, counted, stage, optimizer, resumed, blocks) if blocks is not None else ((), ())
        print_header(comm, args, run, stage, buckets, resumed)
        run.memory.reset()  # the peak of training alone: not the model's building, nor the check
        losses, norms, records = train(args, comm, counted, run.device, stage, optimizer, buckets,
                                       lists[comm.Get_rank()], run.timeline, past)
        run.memory.stop()
    except ConfigError as e:
        print0(comm, f"error: {e}", file=sys.stderr)
        return e.status
    diff = check(comm, args, run.device, losses, norms, stage, counted) if args.check else None
    if args.trace:
        write_trace(comm, run.timeline, args.trace)
    return report(comm, args, run, stage, buckets, losses, norms, records, counted, ideal, diff)

# =============================================================================
# You may stop reading here: the strategy is all above. Below, first this file's own machinery
# (the check against single-process training, the report, its arguments and checkpoints), then
# the machinery that every strategy file repeats word for word: the summary, checkpoints and
# signals, counters, timeline and memory, device and MPI setup, arguments.
# =============================================================================

# --- This file's own: the check against single-process training, the report, arguments, checkpoints
# What the reference shares with the ranks, and why each is harmless: GPT, Block, attend and
# build_model (the network), make_batch (with --ragged its IGNORE targets), make_optimizer (torch's
# SGD or AdamW, the recipe's settings on both sides) and F.cross_entropy. --ragged: its loss is
# F.cross_entropy's mean over the valid targets of the whole batch (ignore_index), never the
# ranks' count; padding still passes through each router, there as on the ranks (routed, counted
# in capacities and in the load-balancing loss), since both run the model on the same inputs.
# Its own: nn.Linear, nn.Embedding and whole logits, one process, one backward, the learning rates written out (not
# learning_rate), torch's clip_grad_norm_ (its norm compared as a loss): no f, g, parallel layer, schedule, message,
# bucket or global_grad_norm. build_stage cuts the trained reference as each rank's stage was cut, so that like is
# compared with like; the losses, from the uncut model and compared first, show a cut that loses or repeats a part of
# the model. The mixture of experts it writes apart (reference_moe): the ranks' choices of experts followed (check(),
# below), its own before a resume, the capacity counted pair by pair, every expert on every token weighted by gates, the
# load-balancing loss from its definition. What it must know of the grid it writes plainly: which tokens each rank
# routed, in its order (its replica's micro-batch, its context rank's positions, with sequence parallelism its tensor
# rank's piece): capacity and the loss's counts are per rank and per micro-batch; after a resume on another grid, each
# step's as the grid that trained it (args.grids). What it cannot see: a fault that the ranks' router and the reference
# share through torch (softmax, a stable sort), and nothing about which rank ran which expert (the result is the same).
# Which sequences share a balancing loss or a capacity is the grid's (D, M): the reference replays each step's grid.
# Near-ties: see the comment above check().
def reference_training(args, device, followed=None):
    """The same steps in one plain process: the unsplit GPT on the whole batch at once, nn.Linear and F.cross_entropy, no MPI;
    with experts, the choices `followed` (step x block x B x S x K, -1: its own) where the ranks made them."""
    model, lr, W, losses, norms = build_model(args).to(device), args.lr, args.warmup_steps, [], []
    optimizer, schedule = make_optimizer(args, model.parameters()), [lr * (k + 1) / W for k in range(W)] + [lr if args.lr_schedule == "constant" else lr / 10 + 0.45 * lr * (1 + math.cos(math.pi * k / max(1, args.steps - W))) for k in range(args.steps - W)]
    for step in range(args.steps):  # routed as the grid that trained the step (args.grids: a resume may change it)
        trained = argparse.Namespace(**vars(args) | {f.replace("-", "_"): v for f, v in [g for start, g in args.grids if start <= step][-1].items()})
        for i, block in enumerate(model.blocks) if args.experts else ():
            block.mlp.forward = functools.partial(reference_moe, block.mlp, trained, None if followed is None else followed[step, i])
        x, y = (t.to(device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged))
        with torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16"):  # bf16 against bf16
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)  # over the valid targets
        optimizer.zero_grad()
        (loss + sum(block.mlp.aux for block in model.blocks if args.experts)).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or math.inf).item())
        optimizer.param_groups[0]["lr"] = schedule[step]
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, model

def reference_moe(moe, args, followed, x):
    """The mixture of experts in one process, written apart from MoE (see the comment above reference_training)."""
    (B, S, _), X, K, M, D, F_ = x.shape, len(moe.experts), moe.top_k, args.micro_batches, args.dp, moe.capacity_factor
    with torch.autocast(x.device.type, enabled=False):  # the router in float32, in bf16 too, as the ranks'
        probs, b, T = torch.softmax(x @ moe.router.weight.T, dim=-1), B // (D * M), args.tp if args.sequence_parallel else 1
    own = probs.detach().argsort(dim=-1, descending=True, stable=True)[..., :K]  # B x S x K; a tie: the lowest index first
    choice, keep, moe.aux = own if followed is None else torch.where(followed < 0, own, followed.to(own)), torch.ones(B, S, K, dtype=torch.bool).tolist(), 0
    moe.disagreement = max(getattr(moe, "disagreement", 0.0), (probs.gather(-1, own) - probs.gather(-1, choice)).sum(-1).abs().max().item())
    # The tokens each rank routed, in its order: sequences (d M + m) b to (d M + m + 1) b - 1 (micro-batch m of
    # replica d; b a micro-batch's), at the positions of context rank c (--sequence-parallel: tensor rank t's piece).
    for d, m, c, t in [(d, m, c, t) for d in range(D) for m in range(M) for c in range(args.cp) for t in range(T)] if F_ else ():
        where, taken = shard_positions(S, args.cp, args.layout)[c].view(T, -1)[t].tolist(), collections.Counter()
        for i, p, j in [(i, p, j) for i in range((d * M + m) * b, (d * M + m + 1) * b) for p in where for j in range(K)]:
            taken[int(choice[i, p, j])] += 1
            keep[i][p][j] = taken[int(choice[i, p, j])] <= math.ceil(fractions.Fraction(repr(F_)) * K * b * len(where) / X)
    for m in range(M):  # Switch's alpha X sum_e f_e P_e over micro-batch m of every replica; the step's: their mean
        rows = [(d * M + m) * b + i for d in range(D) for i in range(b)]
        moe.aux = moe.aux + moe.aux_coef * X * sum((choice[rows] == e).sum() / choice[rows].numel() * probs[rows][..., e].mean() for e in range(X)) / M
    gates = (F.one_hot(choice, X) * (probs.gather(-1, choice) * torch.tensor(keep, device=x.device)).unsqueeze(-1)).sum(-2)
    return sum(gates[..., e:e + 1] * expert(x) for e, expert in enumerate(moe.experts))

# A parameter's optimizer state by its checkpoint name and torch's: float32, shaped as the parameter (or slice)
MOMENTS = {"sgd": {"momentum": "momentum_buffer"}, "adamw": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}

# The tolerances, as the largest |difference| against one process measured. float32, 30 steps (5 blocks, hidden 32,
# M = 2): every grid of 1, 2, 4 ranks of data, tensor, pipeline 4.8e-7 to 7.2e-7, 2 x 2 x 2 5.4e-7; the ring (zigzag /
# contiguous): --cp 4 7.7e-7 / 7.2e-7, --cp 2 with --tp 2 7.7e-7 / 1.2e-6, --pp 2 8.3e-7, --dp 2 6.6e-7 / 1.2e-6; ZeRO-1
# up to 8.0e-7; experts (the tests' 3 steps) with each axis at N = 4 2.1e-7 to 4.8e-7, all five on 16 ranks 3.3e-7; the
# recipe (AdamW at lr 1e-3, a clip of 1 that acts, warm-up 1, cosine; the tests' 3 steps; the norms compared as losses):
# --pp 2 --tp 2 --sequence-parallel 2.2e-6, --dp 2 --tp 2 --zero-stage 1 1.6e-6, --dp 4 --ep 2 with experts 8.6e-7.
# tensor's and pipeline's 2e-5 kept: a 10x nudge shows. --ragged with the recipe (the tests' 3 steps): --dp 2, --tp 2
# --sequence-parallel, --pp 2, --cp 2, --dp 2 --ep 2, --pp 2 --dp 2 --zero-stage 1 5.3e-7 to 8.5e-7; each rank over its own
# count x D x C: 6.8e-2 (--dp 2), 1.7e-2 (--cp 2). At lr 1e-2 AdamW's first step magnifies float32 order where a gradient
# is near its eps (1e-8): --ragged, 3 blocks of hidden 16, 3 steps, one process: 3.0e-5 (an out.weight gradient of 2.0e-8,
# 1% off F.cross_entropy's); at lr 1e-3, 3.0e-6.
# bf16, both sides under autocast: the tests' runs (3 steps, grids of 1, 2, 4 ranks, sequence-parallel, contiguous,
# ZeRO-1) 5.5e-4 to 1.3e-3; the recipe's 3 steps 2.9e-3 to 3.5e-3 (--ragged too); the exactness matrix (bench/run.py, 28
# grids, the recipe) 4.0e-3 at most without experts, 6.1e-3 with (--tp 2 --ep 2): 2e-2 holds them 3.3x, and a 1/N fault
# (0.16) is 8x past it. The default 40 steps, now the recipe, 5.8e-3 to 6.4e-3 at N = 1, 2, 4 on an AVX-512 BF16 CPU.
# With SGD at lr 0.1 they exceed it: on an AVX2 CPU --tp 2 3.2e-2, --pp 2 4.1e-2, --cp 2 --tp 2 6.8e-3, --pp 2 --dp 2
# 4.6e-2; on an AVX-512 BF16 one 0.32, 0.14, 0.21, 0.18, and 8.8e-2 in one process. The ranks round in other places than
# the reference (its whole batch in one backward, its nn.Linear; the ranks' micro-batches, stage boundaries, partial
# products): accumulating the same micro-batches and rounding at the same boundaries in the reference measured 0.32 ->
# 0.18 (--tp 2), 0.14 -> 4.9e-2 (--pp 2), 8.8e-2 -> 3.2e-2 (one process), not enough to hold SGD's run. Experts in bf16
# (the router float32 on both sides; the tests' 3 steps, --ep 2 on 4 ranks with data, tensor with sequence parallelism,
# pipeline, context with a capacity, recomputation full and the recipe) 9.7e-4 to 3.9e-3; the default 40 steps with
# --experts 4 at N = 1, 2, 4 5.4e-3, 6.6e-3, 5.5e-3, the same with --recompute full (fp32: 1.1e-6, 1.1e-6, 6.6e-6); an
# expert's gradient E times too far 0.13 (6.6x).
# Experts: a near-tie between a token's K-th and (K+1)-th expert flips on float32 rounding (the ranks route other shapes
# of batch, from inputs rounded otherwise): the default 40 steps with --experts 4 at N = 4 met a gap of 3.0e-8 and
# differed by 3.6e-4 where the reference chose for itself. So it follows the ranks (as expert_parallel.py's does): each
# rank's choices (MoE.written), step x block x B x S x K, reach rank 0 by an MPI_MAX over -1 elsewhere (and before a
# resume: the reference chooses there); where the reference's own top K would have taken more probability than the
# ranks', the largest such gap joins the check's max: a flip on rounding shows by its gap (3.0e-8 there; that run's
# check 6.6e-6), a router that chose wrongly on the ranks by much more. The tests' plants: the choices written down
# moved to the next expert 0.11; the ranks' router taking the K least likely experts 0.13, which without the gap's term
# the followed reference would match (4.8e-7).
def check(comm, args, device, losses, norms, stage, counted):
    """Rank 0 trains the reference (following the ranks' experts: above) and broadcasts it; each rank cuts it, compares."""
    (p, d, _, _), M, where, b = coordinates(comm.Get_rank(), args.dp, args.cp, args.tp), args.micro_batches, stage.where.cpu(), args.batch_size // (args.dp * args.micro_batches)
    followed = torch.full((args.steps, args.layers, args.batch_size, args.seq_len, args.top_k) if args.experts else (), -1, dtype=torch.int16)
    for i, block in enumerate(stage.blocks if args.experts else (), start=layer_split(args.layers, args.pp)[p][0]):
        for j, choice in enumerate(block.mlp.written, start=args.steps * M - len(block.mlp.written)):  # step j // M, micro-batch j % M
            followed[j // M, i, torch.arange(b)[:, None] + (d * M + j % M) * b, where] = choice.view(b, len(where), -1).to(followed).cpu()
    comm.Reduce(MPI.IN_PLACE if comm.Get_rank() == 0 else followed, followed, op=MPI.MAX, root=0)
    reference, (ref_losses, ref_norms, trained) = build_model(args), reference_training(args, device, followed) if comm.Get_rank() == 0 else [None] * 3
    flat = nn.utils.parameters_to_vector((reference if trained is None else trained).parameters()).detach().cpu()
    request = comm.Ibcast(flat, root=0)
    while not request.Test():
        time.sleep(POLL_S)  # the waiting ranks leave the cores to rank 0
    nn.utils.vector_to_parameters(flat, reference.parameters())
    diff = max_difference(losses + norms, stage.state_dict(), sum(comm.bcast((ref_losses, ref_norms), root=0), []),
                          build_stage(args, counted, device, reference))
    return comm.allreduce(max([diff, *(b.mlp.disagreement for b in trained.blocks if args.experts)] if trained else [diff]), op=MPI.MAX)

def activation_bytes(args, s):
    """The docstring's activations of one micro-batch on stage s (9bs, 8s/c: indices, masks); None with experts."""
    b, n, h, a, T = args.batch_size // (args.dp * args.micro_batches), args.seq_len // args.cp, args.hidden, args.heads, args.tp
    e, cut, (lo, hi) = 2 if args.precision == "bf16" else 4, T if args.sequence_parallel else 1, layer_split(args.layers, args.pp)[s]
    core = (e * b * n * h + 4 * a * b * n) // T if args.cp > 1 else (4 if e == 4 else 6) * a * b * n * n // T + n * n
    block = 4 * b * n * h // cut if args.recompute == "full" else (8 * b * n * h + 16 * b * n) // cut + 2 * e * b * n * h + 12 * e * b * n * h // T + core * (args.recompute == "none")
    last = (4 * b * n * h + 8 * b * n) // cut + e * b * n * h + 4 * b * n * padded_vocab(T) // T + 9 * b * n
    return None if args.experts else (hi - lo) * block + (9 * b * n + 8 * n // cut) * (s == 0) + last * (s == args.pp - 1)

def print_header(comm, args, run, stage, buckets, resumed):
    (P, D, C, T, M, X), per_rank = (args.pp, args.dp, args.cp, args.tp, args.micro_batches, args.experts), comm.allgather((sum(p.numel() for p in stage.parameters()), len(buckets.buckets)))
    stages = " | ".join(f"stage {s}: " + "embedding + " * (s == 0) + f"blocks {lo}-{hi - 1}" + " + norm, head, loss" * (s == P - 1) for s, (lo, hi) in enumerate(layer_split(args.layers, P)))
    grid = " ".join(f"--{flag}" + f" {v}" * (v is not True) for flag, v in (resumed["state"]["grids"][-1][1].items() if resumed else ()) if v is not False)
    print0(comm, *([f"resumed from {args.save} at step {resumed['step']} (written by {resumed['world_size']} ranks) with {grid}"] if resumed else []),
           *run.header, f"model: GPT, {args.layers} blocks, hidden {args.hidden}, {args.heads} heads, {sum(p.numel() for p in build_model(args).parameters()):,} "
           "parameters" + f", each block's MLP {X} experts, top-{args.top_k}, " * (X > 0) + ("dropless" if args.capacity_factor is None else
           f"capacity factor {args.capacity_factor:g}") * (X > 0), f"grid: pp {P} x dp {D} x cp {C} x tp {T} | rank: (pp, dp, cp, tp) "
           + " ".join(f"{r}:{coordinates(r, D, C, T)}" for r in range(comm.Get_size())) + f" | expert groups of {args.ep} of the {D * C} "
           f"ranks of equal (pp, tp), {X // args.ep} experts a block each" * (X > 0), f"{stages} | each tensor-parallel rank: {args.heads // T} "
           f"of {args.heads} heads, {padded_vocab(T) // T} of {padded_vocab(T)} vocabulary rows" + f", {args.seq_len // (C * T)} positions between "
           "its layers (sequence parallelism)" * args.sequence_parallel, f"global batch {args.batch_size} = {D} replicas x {M} micro-batches x "
           f"{args.batch_size // (D * M)} sequences of {args.seq_len} characters, each cut over {C} context-parallel ranks ({args.layout}: "
           f"{args.seq_len // C} positions a rank)" + f" | --ragged: documents of 1 to {args.seq_len} characters, the loss over the step's valid targets" * args.ragged + " | schedule 1f1b, every rank's actions simulated first (dry run): no deadlock",
           f"parameters per rank: {' '.join(str(p) for p, _ in per_rank)} | gradient buckets per rank: {' '.join(str(b) for _, b in per_rank)}"
           f" of <= {args.bucket_mb:g} MB" + " | ZeRO-1: each of a bucket's n ranks steps 1/n of it, all-gathers the rest" * buckets.zero)

FORMULA_TEXT = {  # the docstring's formulas, as the summary prints them: (axis, its variant) -> (count, bytes)
    ("pipeline", False): ("messages 2M(P - 1) x D x C x T", "2(P - 1) x T x eBSh"),
    ("pipeline", True): ("messages 2M(P - 1) x D x C x T", "2(P - 1) x eBSh (sequence-parallel)"),
    ("data", (False, False)): ("allreduces: one per bucket per group", "D x C x 4(W + W_x)"),
    ("data", (True, False)): ("reduce-scatters and all-gathers: one each per bucket per group", "4W'(D x C + 1) + 4W_x'(D x C + E)"),
    ("data", (False, True)): ("allreduces: one per bucket per group + T (the count)", "D x C x 4(W + W_x) + 8 x D x C x T"),
    ("data", (True, True)): ("reduce-scatters and all-gathers: one each per bucket per group + T allreduces (the count)",
                             "4W'(D x C + 1) + 4W_x'(D x C + E) + 8 x D x C x T"),
    ("context", False): ("messages L x M x D x C x T x (3C - 2 + R(C - 1))", "L x 2BSh x ((2 + R)e(C - 1) + 4C)"),
    ("tensor", False): ("allreduces D x C x M x (GL + 5 + F)", "T x [(GL + 2 + F) x 4BSh + 3 x 4BS]"),
    ("tensor", True): ("collectives D x C x M x ((2G + 6 + 4X/E)L + 10 + 2F)",
                       "(GL + 2 + F)T x 4BSh + (GL + 1 + F) x eBSh + 4BSh + 12BST + 4MDCT x R_r"),
    ("expert", False): ("collectives 5LMDCT/E + LM", "16h(LKBST' - d) + 2 x 8XLMDCT"),
    ("expert", True): ("collectives (5 + 3f)LMDCT/E + (1 + f)LM", "(4 + 2f)eh(LKBST' - d) + (1 + f) x 2 x 8XLMDCT")}

def report(comm, args, run, stage, buckets, losses, norms, records, counted, ideal, diff):
    """The summary lines and JSON keys of this file; finish() prints them with the house's."""
    P, D, C, T, M, steps_run = args.pp, args.dp, args.cp, args.tp, args.micro_batches, max(1, len(records))
    moes = [b.mlp for b in stage.blocks if args.experts]  # dropped: (token, choice) pairs a step, all ranks'
    measured, dropped = per_axis(comm, counted, steps_run), fractions.Fraction(comm.allreduce(sum(m.dropped for m in moes)), steps_run)
    formula, gap = formulas(args, comm, stage, buckets, dropped), comm.allreduce(min([m.gap for m in moes], default=math.inf), op=MPI.MIN)
    waits = comm.allgather(statistics.median(r["wait_s"] / r["step_s"] for r in records[1:] or records))
    theory, bubble, pipeline = (P - 1) / (M + P - 1), statistics.mean(waits), [ideal[rank_at(p, 0, 0, 0, D, C, T)] for p in range(P)]
    slots, SP = max(e for row in pipeline for _, _, e in row), args.sequence_parallel
    text = {a: FORMULA_TEXT[a, v] for a, v in (("pipeline", SP), ("data", (buckets.zero, args.ragged and D * C > 1)), ("context", False), ("tensor", SP), ("expert", args.precision == "bf16" or args.recompute == "full"))}
    saved, saved_formula = comm.allgather(stage.meter.bytes), comm.allgather(activation_bytes(args, counted["pipeline"].Get_rank()))
    lines = [f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f}; a uniform guess is ln {VOCAB} = {math.log(VOCAB):.4f}) | {args.optimizer}, "
             f"lr {args.lr:g} {args.lr_schedule}" + f", gradient norm clipped at {sum(n > args.clip_grad for n in norms)} of {len(norms)} steps" * bool(args.clip_grad),
             "ideal timeline of one pipeline (the dry run; F/B: forward/backward of micro-batch i):",
             *(f"stage {s} | " + "".join({start: name for name, start, _ in spans}.get(i, ".").ljust(len(f"B{M - 1}") + 1)
                                         for i in range(slots)).rstrip() for s, spans in enumerate(pipeline)),  # a cell a slot, '.' idle
             f"bubble: measured {100 * bubble:.0f}% of the step waiting for a peer | theory (P-1)/(M+P-1) = "
             f"{P - 1}/{M + P - 1} = {100 * theory:.0f}% | dry run {100 * (1 - 2 * M / slots):.0f}%",
             f"communication per step, summed over the grid, measured | formula (e = {2 if args.precision == 'bf16' else 4}, "
             f"R = {int(args.recompute != 'none')}, F = {(1 if moes else 2) * args.layers * (args.recompute == 'full')}" + f", f = {int(args.recompute == 'full')}" * bool(moes) + "):",
             *(f"  {axis:8} {measured[axis][k]:g} {'messages' if k else 'collectives'}, {measured[axis][2]:,.0f} "
               f"bytes | {text[axis][0]} = {formula[axis][k]}, {text[axis][1]} = {formula[axis][2]:,.0f}"
               for axis, k in (("pipeline", 1), ("data", 0), ("context", 1), ("tensor", 0), ("expert", 0))),
             *[f"experts: (token, choice) pairs dropped a step, all ranks: {float(dropped):g} | smallest gap between a token's K-th and "
               f"(K+1)-th router probability: {gap:.1e} (rounding may flip a smaller one: the check follows the ranks)"] * bool(moes),
             f"activations one micro-batch's forward saves per rank ({args.precision}, --recompute {args.recompute}), bytes: measured "
             f"{' '.join(map(str, saved))} | formula " + (" ".join(map(str, saved_formula)) if not moes else "not given with experts")]
    return finish(comm, args, run, losses, records, diff, "losses, gradient norms, parameters", lines, {
        "comm_bytes_per_step": sum(m[2] for m in measured.values()), "collectives_per_step": sum(m[0] for m in measured.values()),
        "grid": {"pp": P, "dp": D, "cp": C, "tp": T, "ep": args.ep}, **{k: vars(args)[k] for k in ("layout", "zero_stage", "experts", "top_k",
        "capacity_factor", "optimizer", "clip_grad", "lr_schedule", "warmup_steps", "ragged")}, "pairs_dropped_per_step": float(dropped),
        "min_topk_gap": gap if moes else None, "sequence_parallel": SP, "micro_batches": M, "grad_norms": norms,
        "layer_split": layer_split(args.layers, P), "comm_bytes_per_step_by_axis": {a: m[2] for a, m in measured.items()},
        "collectives_per_step_by_axis": {a: m[0] for a, m in measured.items()}, "messages_per_step": measured["pipeline"][1],
        "activation_bytes_per_rank": saved, "activation_bytes_formula_per_rank": None if moes else saved_formula,
        "formula_by_axis": {a: dict(zip(("collectives", "messages", "bytes"), v)) for a, v in formula.items()},
        "bubble_fraction": bubble, "bubble_fraction_theory": theory, "bubble_fraction_dry_run": 1 - 2 * M / slots,
        "overlap": overlap_counts(comm, run.timeline.step_events, M, buckets)})

# The overlaps the lesson claims, over the grid as [n, total]: the bucket exchanges posted before the last backward
# computed a later gradient (GradBuckets' marks; a stage's last never counts); the pipeline sends (in flight from Isend
# to the rank's next Wait on a send) in whose flight a forward or backward began: 1F1B's schedule, not the library's
# speed, makes it all but those after a stage's last backward, (2M - 1)(P - 1) of 2M(P - 1).
def overlap_counts(comm, events, m, buckets):
    """The overlaps claimed, in the step of `events` (a rank's timeline); see the comment above."""
    compute = [b for name, _, b, _ in events if name in {f"{op}{i}" for op in "FB" for i in range(m)}]
    waits = sorted(b for name, _, b, _ in events if name == "Isend wait") + [math.inf]
    flights = [(b, next(w for w in waits if w >= b)) for name, _, b, _ in events if name == "Isend"]
    sends = [sum(any(lo <= c < hi for c in compute) for lo, hi in flights), len(flights)]
    posted = [sum(mark < buckets.computed for mark in buckets.posted_at), len(buckets.posted_at)]
    return {"buckets_posted_before_later_gradients": [comm.allreduce(v) for v in posted],  # reporting: not counted
            "sends_in_flight_during_compute": [comm.allreduce(v) for v in sends]}

def per_axis(comm, counted, steps_run):
    """Per step, over the grid, by axis: (collectives (once per group), messages, bytes); "stage" counts as "expert"."""
    out, collectives = collections.defaultdict(lambda: [0, 0, 0]), ("Allreduce", "Iallreduce", "Reduce_scatter_block", "Ireduce_scatter_block", "Allgather", "Alltoall", "Alltoallv")
    for name, c in counted.items():
        total = out[{"stage": "expert", "expert-data": "data"}.get(name, name)]
        total[0] += comm.allreduce(sum(c.calls[name] for name in collectives)) / c.Get_size()
        total[1] += comm.allreduce(c.calls["Isend"] + c.calls["Sendrecv"])
        total[2] += comm.allreduce(sum(c.bytes[name] for name in collectives + ("Isend", "Sendrecv")))
    return {axis: tuple(v / steps_run for v in total) for axis, total in out.items()}

def formulas(args, comm, stage, buckets, dropped):
    """The docstring's (collectives, messages, bytes) a step by axis, from the ranks' parameters, buckets and drops."""
    P, D, C, T, M, E, X, K = args.pp, args.dp, args.cp, args.tp, args.micro_batches, args.ep, args.experts, args.top_k
    L, B, S, h, N, G, SP = args.layers, args.batch_size, args.seq_len, args.hidden, D * C, 2 if X else 4, args.sequence_parallel
    e, rerun, full = 2 if args.precision == "bf16" else 4, args.recompute != "none", args.recompute == "full"  # R, and F = GL/2 if full
    again = G * L // 2 * full
    moved = e * B * S * h  # an activation as it moves: bf16 in bf16 runs; every sum float32
    activation, zero, expert, n, kinds = 4 * B * S * h, args.zero_stage == 1 and N > 1, 8 * h * h + 5 * h, N // E, [hasattr(b[0], "expert") for b in buckets.buckets]
    params, dense_b, expert_b, dense_pad, expert_pad = (sum(v) for v in zip(*comm.allgather((sum(p.numel() for p in stage.parameters()), kinds.count(False), kinds.count(True), *(sum(e for e, k in zip(buckets.padded, kinds) if k == kind) for kind in (False, True))))))
    replicated = S * h + 2 * h + L * (5 * h + X * h if X else 6 * h)  # held whole on every tensor-parallel rank
    W = 2 * padded_vocab(T) * h + S * h + L * (4 * h * h + 8 * h + (X * h if X else 8 * h * h + 5 * h)) + 2 * h + (T - 1) * replicated
    W_x, R_r, counts, routed, valid = T * L * X // E * expert, replicated + L * X // E * expert, 8 * X * L * M * N * T * (1 + full), K * B * S * (1 if SP else T), T * (N > 1) * args.ragged  # valid: --ragged's count, an Allreduce in each of the last stage's T groups
    assert params == N * (W + W_x)  # what the ranks hold, added up
    return {"pipeline": (0, 2 * M * (P - 1) * N * T, 2 * (P - 1) * (1 if SP else T) * moved),
            "data": ((dense_b // N * (N > 1) + expert_b // n * (n > 1) + valid, 0, N * 4 * (W * (N > 1) + W_x * (n > 1)) + 8 * N * valid) if not zero else
                     (2 * dense_b // N + 2 * expert_b // n * (n > 1) + valid, 0, 4 * dense_pad * (N + 1) // N + 4 * expert_pad * (n + 1) // n * (n > 1) + 8 * N * valid)),
            "context": (0, L * M * N * T * (3 * C - 2 + rerun * (C - 1)) * (C > 1), L * 2 * B * S * h * ((2 + rerun) * e * (C - 1) + 4 * C) * (C > 1)),
            "tensor": (N * M * ((2 * G + 6 + 4 * X // E) * L + 10 + 2 * again), 0, (G * L + 2 + again) * T * activation
                       + (G * L + 1 + again) * moved + activation + 12 * B * S * T + 4 * M * N * T * R_r)
            if SP else (N * M * (G * L + 5 + again) * (T > 1), 0, T * ((G * L + 2 + again) * activation + 12 * B * S) * (T > 1)),
            "expert": ((5 + 3 * full) * L * M * N * T // E * (E > 1) + (1 + full) * L * M * (N * T > 1), 0,  # routed: pairs a block, T copies without SP
                       float(((4 + 2 * full) * e * h * (L * routed - dropped) + counts) * (E > 1) + counts * (N * T > 1))) if X else (0, 0, 0)}

def check_tags(comm, m):
    """MPI promises tags up to 32767 only (MPI_TAG_UB says how far this library goes): refuse an M whose largest tag, 2M - 1, it cannot carry, rather than fail inside MPI mid-step."""
    largest, bound = tag("send_grad", m - 1), comm.Get_attr(MPI.TAG_UB)
    if largest > bound:
        raise ConfigError(f"--micro-batches {m} needs message tags up to {largest}, but this MPI's MPI_TAG_UB is {bound}; use --micro-batches {(bound + 1) // 2} or fewer")

SIZES = (("--layers", 4, "transformer blocks"), ("--hidden", 64, "hidden size"), ("--heads", 4, "attention heads"),  # flag, default, help
         ("--seq-len", 64, "characters per sequence"), ("--pp", 1, "pipeline stages"), ("--cp", 1, "context-parallel ranks: each holds S/C "
         "positions"), ("--tp", 1, "tensor-parallel ranks per stage"), ("--dp", None, "data-parallel replicas (default: world size / (pp x cp "
         "x tp))"), ("--micro-batches", None, "micro-batches per replica's share (default: the most, up to 4, that it splits into)"),
         ("--ep", None, "ranks of an expert group, folded over a stage's D x C (default: the most that divide D x C and the experts)"))

OPTIONS = (  # flag, argparse's keywords: this file's flags of plain types (SIZES: its counts)
    ("--sequence-parallel", dict(action="store_true", help="cut the sequence between the tensor-parallel ranks outside their "
                                 "layers (LayerNorms, residuals): all-gather and reduce-scatter for f and g")),
    ("--layout", dict(default="zigzag", choices=("zigzag", "contiguous"), help="context parallelism's positions: chunks c and "
                      "2C-1-c of 2C (zigzag), or the c-th of C")),
    ("--top-k", dict(type=int, choices=(1, 2), default=2, help="experts per token")),
    ("--zero-stage", dict(type=int, choices=(0, 1), default=0, help="1: the optimizer's state sharded over the ranks that sum "
                          "each gradient (ZeRO-1: reduce-scatter, step a slice, all-gather)")),
    ("--optimizer", dict(choices=("sgd", "adamw"), default="adamw", help="SGD (momentum 0.9) or AdamW (betas 0.9, 0.95, eps "
                         "1e-8, weight decay 0.1)")),
    ("--lr-schedule", dict(choices=("constant", "cosine"), default="cosine", help="after the warm-up: --lr throughout, or a "
                           "cosine from --lr towards lr / 10 at --steps")),
    ("--ragged", dict(action="store_true", help="documents of uneven length: the loss over the valid targets")))

def parse_args(argv, world_size):
    p = common_arguments("Hybrid (pipeline x data x context x tensor x expert) parallelism over MPI: a small GPT on "
                         "Python's own source.", steps=40, batch_size=16, lr=1e-3, log_every=10)
    for flag, default, text in SIZES:
        p.add_argument(flag, type=COUNT, default=default, help=text)
    for flag, options in OPTIONS:
        p.add_argument(flag, **options)
    p.add_argument("--bucket-mb", type=AMOUNT, default=25.0, help="gradient bucket size in MB")
    p.add_argument("--experts", type=COUNT_OR_0, default=0, help="expert MLPs in every block (0: the dense MLP)")
    p.add_argument("--capacity-factor", type=AMOUNT, help="at most ceil(F K n / X) pairs per expert from each rank's n tokens (default: dropless)")
    p.add_argument("--aux-loss-coef", type=checked(float, lambda v: v >= 0 and math.isfinite(v), "0 or more"), default=0.01, help="alpha of the load-balancing loss")
    p.add_argument("--clip-grad", type=checked(float, lambda v: v >= 0 and math.isfinite(v), "0 or more"), default=1.0, metavar="MAX_NORM", help="clip the global gradient norm to MAX_NORM, as clip_grad_norm_ does (0: off)")
    p.add_argument("--warmup-steps", type=COUNT_OR_0, help="linear warm-up: step s (from 0) at lr (s + 1) / W (default: --steps / 10)")
    args = check_common(p.parse_args(argv))
    args.warmup_steps = args.steps // 10 if args.warmup_steps is None else args.warmup_steps  # a tenth by default
    if args.warmup_steps >= args.steps:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} leaves no step of --steps {args.steps}; use fewer")
    if args.sequence_parallel and args.tp == 1:
        raise ConfigError("--sequence-parallel cuts the sequence between tensor-parallel ranks: use it with --tp 2 or more")
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} does not split into {args.heads} heads; use a multiple of {args.heads}, or --heads that divides {args.hidden}")
    if args.seq_len > len(load_text()) - 2:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the text; use at most {len(load_text()) - 2}")
    P, C, T = args.pp, args.cp, args.tp
    D, chunks = args.dp or max(1, world_size // (P * C * T)), (lambda c: 2 * c if c > 1 else 1) if args.layout == "zigzag" else (lambda c: c)

    def grid_fits(p, d, c, t):  # equal chunks of S, heads, blocks
        return args.heads % t == 0 and p <= args.layers and args.seq_len % (chunks(c) * t ** args.sequence_parallel) == 0 \
            and (t > 1 or not args.sequence_parallel)
    if P * D * C * T != world_size or not grid_fits(P, D, C, T):
        works = [f"--pp {world_size // (d * c * t)} --dp {d} --cp {c} --tp {t}" for d in range(1, world_size + 1) for c in range(1, world_size + 1)
                 for t in range(1, world_size + 1) if world_size % (d * c * t) == 0 and grid_fits(world_size // (d * c * t), d, c, t)]
        why = (f"--pp {P} --dp {D} --cp {C} --tp {T} make {P * D * C * T} ranks, this job has {world_size}"
               if P * D * C * T != world_size else f"--tp {T} does not divide --heads {args.heads}" if args.heads % T
               else f"--pp {P} stages need at least {P} --layers, got {args.layers}" if args.layers < P
               else f"--seq-len {args.seq_len} does not split into the {chunks(C)} chunks of --cp {C} --layout {args.layout}"
               + f" x the {T} pieces of --sequence-parallel" * args.sequence_parallel)
        raise ConfigError(f"{why}; grids of {world_size} ranks that work with --heads {args.heads} --layers "
                          f"{args.layers} --seq-len {args.seq_len}: {'; '.join(works[:8]) or 'none'}{f' and {len(works) - 8} more' * (len(works) > 8)}")
    X, N, E = args.experts, D * C, args.ep or math.gcd(D * C, args.experts or 1)
    if args.ep and not X or X and (N % E or X % E or args.top_k >= X):
        raise ConfigError(f"--ep {E} shares out experts, but --experts is 0 (the dense MLP); add --experts, a multiple of {E}" if not X else
                          f"--top-k {args.top_k} of --experts {X} leaves the router no choice; use --experts {args.top_k + 1} or more" if args.top_k >= X
                          else f"--ep {E} must divide both the D x C = {N} data- and context-parallel ranks of a stage and --experts {X}; "
                          f"use --ep " + " or ".join(str(e) for e in range(1, N + 1) if N % e == 0 == X % e))
    args.dp, args.ep, share = D, E if X else 1, args.batch_size // D if args.batch_size % D == 0 else 0
    M = args.micro_batches = args.micro_batches or next((k for k in range(min(4, share), 0, -1) if share % k == 0), 1)
    if args.batch_size % (D * M):
        fits = ", ".join(str(k) for k in range(1, share + 1) if share % k == 0)
        raise ConfigError(f"--batch-size {args.batch_size} does not split into {D} replicas x {M} micro-batches; "
                          f"use {f'--micro-batches {fits}, or ' if fits else ''}a --batch-size multiple of {D * M}")
    args.grids = [[0, grid_flags(args)]]  # [first step, grid] of each stretch of steps: a resume adds the checkpoint's
    return args

def grid_flags(args):
    """The flags that place the ranks and cut the batch, as the header prints them; the check's reference routes each step as they did."""
    return {flag: vars(args)[flag.replace("-", "_")] for flag in ("pp", "dp", "cp", "tp", "ep", "layout", "micro-batches", "zero-stage", "sequence-parallel")}

# --- Checkpoints: the blocks of blocks_held(), each written once, asked for again on any grid
def blocks_wanted(args, axes, stage):
    """What a resuming rank asks load_checkpoint for: the blocks it holds on this grid, and their optimizer state."""
    return {name: region(*held[1:4]) for key, held in blocks_held(args, axes, stage).items() for name in (key, *(f"{k}/{key}" for k in MOMENTS[args.optimizer]))}

def hybrid_shard(comm, args, axes, stage, optimizer, losses, norms):
    """(pieces, state) of this rank: its blocks of every parameter and its optimizer state, written by the first of the
    ranks that hold it; state (global rank 0's): the losses, norms, grids, AdamW's step count. Collective under ZeRO-1."""
    kinds, sharded = MOMENTS[args.optimizer], isinstance(optimizer, ShardedOptimizer)
    state = {kind: optimizer.moments(field) if sharded else {p: optimizer.state[p].get(field, torch.zeros_like(p)) for p in stage.parameters()} for kind, field in kinds.items()}
    pieces, steps = {}, [int(s["step"]) for s in optimizer.state.values() if "step" in s][:1]  # SGD: none
    for key, (p, shape, offset, size, view) in blocks_held(args, axes, stage).items():
        holders = axes["expert-data" if hasattr(p, "expert") else "data"]
        if holders.Get_rank() == 0 and (hasattr(p, "sliced") or axes["tensor"].Get_rank() == 0):
            for name, tensor in [(key, p)] + [(f"{kind}/{key}", state[kind][p]) for kind in kinds]:
                pieces[name] = piece(tensor.detach().reshape(view)[tuple(map(slice, size))], shape, offset)
    return pieces, {"losses": losses, "grad_norms": list(norms), "grids": args.grids, **{"adamw_step": s for s in steps}} if comm.Get_rank() == 0 else None

def restore(args, axes, stage, optimizer, manifest, blocks):
    """Each parameter and its optimizer state from the blocks asked for (ZeRO-1 cuts its slices): the losses, norms so far."""
    state, kinds = manifest["state"], MOMENTS[args.optimizer]
    moments, step = {field: {} for field in kinds.values()}, {"step": torch.tensor(float(state["adamw_step"]))} if "adamw_step" in state else {}
    with torch.no_grad():
        for key, (p, _, _, size, view) in blocks_held(args, axes, stage).items():
            for name, into in [(key, p)] + [(f"{k}/{key}", moments[f].setdefault(p, torch.zeros_like(p))) for k, f in kinds.items()]:
                into.zero_()  # the vocabulary's padding rows, as shard() made them
                into.view(view)[tuple(map(slice, size))] = blocks[name].to(into.device)
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.load_moments(moments, step)
    else:
        for p in stage.parameters():
            optimizer.state[p].update({f: moments[f][p] for f in moments} | {k: v.clone() for k, v in step.items()})
    args.grids = state["grids"] + [[manifest["step"], grid_flags(args)]]
    return state["losses"], state["grad_norms"]

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
