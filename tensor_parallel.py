"""Tensor parallelism over MPI (Megatron-LM): every rank holds a slice of every layer's weights.

What is split: the weight matrices inside each layer, as in Megatron-LM (Shoeybi et al. 2019). Every
rank sees the whole batch and holds 1/N of every block; the N ranks share each matrix product.

  one block on N = 4 ranks; x (B x T x h) is whole on every rank before f and after g
      x -- LayerNorm -- f --+-------------+-------------+-------------+
                            |             |             |             |
   attention: q, k, v    rank 0        rank 1        rank 2        rank 3      column-parallel:
   columns of its heads  head 0        head 1        head 2        head 3      its heads, whole
   proj rows             partial sum   partial sum   partial sum   partial sum row-parallel
                            |             |             |             |
      x + bias + sum <- g --+-------------+-------------+-------------+
   the MLP likewise: LayerNorm, f, fc1 columns (4h/N features each), GELU, fc2 rows, g, + bias, + x

  f: identity forward, allreduce backward: before a column-parallel layer, whose input every rank
     holds whole; each rank's backward sees only the gradient through its own columns.
  g: allreduce forward, identity backward: sums the row-parallel partial products; the bias is
     added once, after the sum.
  Token embedding: rank r owns a range of the vocabulary, writes zeros for other tokens, g sums.
  Head and loss: f, then column-parallel, rank r computes only its range's logits; cross-entropy
     from three allreduces of B x T numbers (the maximum, the target's logit, the sum of
     exponentials): the full B x T x V logits never exist on one rank.
  Replicated: LayerNorms, the position embedding, the row-parallel biases; every rank computes the
     same gradients for them (checked bitwise at the end).
  Vocabulary: the 128 ASCII codes, padded to a multiple of N as Megatron pads; the padding logits
     are masked out of the softmax, so every N trains the same network.

Communication per step (L blocks, B sequences of T characters, hidden size h, float32 = 4 bytes):
  forward:  2L + 1 allreduces of B x T x h (g in each attention and MLP, g in the embedding)
            + 3 of B x T (cross-entropy)
  backward: 2L + 1 allreduces of B x T x h (f in each attention and MLP, f before the head)
  total:    4L + 5 collectives, (4L + 2) x 4BTh + 3 x 4BT bytes from each rank (a ring moves
            2(N-1)/N of that in and out of each rank). The paper: per block, two allreduces
            forward and two backward. No gradient is exchanged: each rank updates its own slice.
The exchange grows with the batch and the sequence, not with the weights, and is on the critical
path: every block waits for it twice each way.

When to choose it: a layer's weights, or its activations, do not fit on one device, and the ranks
share a fast link (Megatron keeps it within a node, on NVLink, and uses data or pipeline
parallelism across nodes). For a model this small on a CPU it is slower than one process.

The text: the standard library's argparse.py, textwrap.py and shlex.py, read from the running
Python, bytes >= 128 replaced by '?'.

Run:  mpirun -np 4 python tensor_parallel.py            (add --help for the flags)
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
from mpi4py import MPI

STRATEGY = "tensor_parallel"
# Largest |difference| allowed against single-process training (float32). Only float32 sums are
# reordered (row-parallel partial sums, the loss's reductions): measured 5e-7 to 7e-7 after 100
# steps at N = 1 to 4, 2e-6 after 300. A nudge of 1.5x the tolerance to any one parameter or
# loss is reported above it (tests/test_tensor_parallel.py).
TOLERANCE = 2e-5
POLL_S = 1e-4  # a rank waiting on MPI sleeps between polls and leaves the core to ranks that compute
VOCAB = 128  # the ASCII codes
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text
PROMPT, TEMPERATURE = "def ", 0.8  # how the sample at the end starts, and how adventurous it is


# -----------------------------------------------------------------------------
# The strategy: Megatron's f and g, the column- and row-parallel layers, the vocabulary-parallel
# embedding and cross-entropy
# -----------------------------------------------------------------------------
# MPI reads GPU memory only when the library is CUDA-aware (found at start-up by setup()).
# Otherwise a tensor on a GPU travels through a host copy. On the CPU these helpers do nothing.
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


def from_mpi(t, buffer):
    """Bring what MPI wrote into a host copy back to t; returns t."""
    if buffer is not t:
        t.copy_(buffer)
    return t


class f(torch.autograd.Function):
    """Identity forward, allreduce backward. It stands before a column-parallel layer: each
    rank's backward sees only the gradient through its own columns; the input's is their sum."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, dy):
        total = dy.clone(memory_format=torch.contiguous_format)  # MPI sums into it
        buffer = mpi_buffer(total)
        ctx.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        return from_mpi(total, buffer), None


class g(torch.autograd.Function):
    """Allreduce forward, identity backward. It ends a row-parallel layer: the ranks' partial
    products add up to the output, whose gradient every rank already holds whole."""

    @staticmethod
    def forward(ctx, x, comm):
        total = x.clone(memory_format=torch.contiguous_format)
        buffer = mpi_buffer(total)
        comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        return from_mpi(total, buffer)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def allreduce(t, comm, op=MPI.SUM):
    """g's three lines for the loss and the sample: t (contiguous) reduced over comm, in place."""
    buffer = mpi_buffer(t)
    comm.Allreduce(MPI.IN_PLACE, buffer, op=op)
    return from_mpi(t, buffer)


def shard(t, dim, comm, groups=1, padded=None):
    """This rank's slice of t along dim, as a parameter. groups=3: t is q, k, v side by side and
    the rank keeps the same slice of each (its heads). padded: zero rows first, up to that size."""
    t = t.detach()
    full_size = t.size(dim)
    if padded is not None and padded > full_size:
        t = torch.cat([t, t.new_zeros(t.shape[:dim] + (padded - full_size,) + t.shape[dim + 1:])], dim)
    rank, world_size = comm.Get_rank(), comm.Get_size()
    p = nn.Parameter(torch.cat([part.chunk(world_size, dim)[rank] for part in t.chunk(groups, dim)], dim))
    p.partition = (dim, groups, full_size)  # how join_slices() puts the full tensor back together
    return p


class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) A_r + b_r: rank r's slice of the output features; X is whole on every rank."""

    def __init__(self, full, comm, groups=1, padded=None):
        super().__init__()
        self.comm = comm
        self.weight = shard(full.weight, 0, comm, groups, padded)
        self.bias = None if full.bias is None else shard(full.bias, 0, comm, groups, padded)

    def forward(self, x):
        return F.linear(f.apply(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = g(X_r B_r) + b: rank r holds the rows of B for its slice X_r of the input features.
    The bias is whole on every rank and added once, after the sum."""

    def __init__(self, full, comm):
        super().__init__()
        self.comm = comm
        self.weight = shard(full.weight, 1, comm)
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return g.apply(F.linear(x, self.weight), self.comm) + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r owns the rows of a range of the vocabulary: it looks up the tokens in its range,
    writes zeros for the others, and g sums: every token's row comes from exactly one rank."""

    def __init__(self, full, comm, padded):
        super().__init__()
        self.comm = comm
        self.weight = shard(full.weight, 0, comm, padded=padded)
        self.start = comm.Get_rank() * self.weight.size(0)

    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.start + self.weight.size(0))
        rows = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        return g.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.comm)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over tokens from each rank's slice of the logits: three allreduces of
    B x T numbers forward (max, target logit, sum of exponentials), none backward."""

    @staticmethod
    def forward(ctx, logits, target, comm):
        per = logits.size(-1)
        start = comm.Get_rank() * per
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
        ctx.save_for_backward(exps / total.unsqueeze(-1), local, owned)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, dloss):
        softmax, local, owned = ctx.saved_tensors  # d loss / d logit = softmax - one-hot(target)
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -owned.unsqueeze(-1).to(softmax.dtype))
        return grad * (dloss / owned.numel()), None, None


def padded_vocab(world_size):
    return -(-VOCAB // world_size) * world_size


def shard_block(block, comm, row_comm=None):
    """Megatron's block, in place: attention f -> qkv columns (this rank's heads) -> proj rows -> g,
    MLP f -> fc1 columns -> GELU -> fc2 rows -> g. Block.forward is unchanged. f's allreduces go
    over comm, g's over row_comm (the same by default; a second one lets a report count apart)."""
    row_comm = row_comm or comm
    block.qkv = ColumnParallelLinear(block.qkv, comm, groups=3)  # q, k, v of its heads
    block.proj = RowParallelLinear(block.proj, row_comm)
    block.heads //= comm.Get_size()
    block.fc1 = ColumnParallelLinear(block.fc1, comm)
    block.fc2 = RowParallelLinear(block.fc2, row_comm)
    return block


def shard_model(model, comm, row_comm=None):
    """Keep this rank's slice of the full model, in place: Megatron's layers take the place of the
    linears and the token embedding; LayerNorms and the position embedding stay whole."""
    padded = padded_vocab(comm.Get_size())
    model.tokens = VocabParallelEmbedding(model.tokens, row_comm or comm, padded)
    for block in model.blocks:
        shard_block(block, comm, row_comm)
    model.out = ColumnParallelLinear(model.out, comm, padded=padded)
    return model


def train_step(model, optimizer, x, y, loss_comm, timeline):
    """One step: every rank the whole batch, its slice of every layer."""
    optimizer.zero_grad()
    with timeline.span("compute", "forward"):
        loss = VocabParallelCrossEntropy.apply(model(x), y, loss_comm)
    with timeline.span("compute", "backward"):
        loss.backward()
    with timeline.span("compute", "optimizer"):
        optimizer.step()  # SGD acts element by element: each rank updates its slice alone
    return loss.item()  # the same on every rank: it is made of allreduced numbers


def join_slices(pieces, partition):
    """The full tensor from every rank's slice of it, in rank order (the inverse of shard)."""
    dim, groups, full_size = partition
    parts = [torch.cat([piece.chunk(groups, dim)[k] for piece in pieces], dim) for k in range(groups)]
    return torch.cat(parts, dim).narrow(dim, 0, full_size)


def gather_model(model, comm, root=0):
    """{name: full tensor} of every parameter on root's CPU, None on the other ranks: the check's
    reference is the only full model of the job, and no rank's device ever holds one."""
    full = {}
    for name, p in model.named_parameters():
        local = p.detach().cpu().contiguous()
        if hasattr(p, "partition"):
            pieces = local.new_empty((comm.Get_size(), *local.shape)) if comm.Get_rank() == root else None
            comm.Gather(local, pieces, root=root)
            local = None if pieces is None else join_slices(pieces.unbind(0), p.partition)
        full[name] = local
    return full if comm.Get_rank() == root else None


# -----------------------------------------------------------------------------
# The model: a GPT-2 style character-level language model, plain (what one process trains)
# -----------------------------------------------------------------------------
def attend(qkv, heads):
    """Causal self-attention of `heads` heads, from queries, keys and values side by side."""
    b, t, c = qkv.size(0), qkv.size(1), qkv.size(2) // 3
    q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in qkv.split(c, dim=2))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // heads)
    future = torch.ones(t, t, dtype=torch.bool, device=qkv.device).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return (weights @ v).transpose(1, 2).reshape(b, t, c)


class Block(nn.Module):
    """Pre-LayerNorm decoder block. GELU and LayerNorm keep training a smooth function of the
    weights, so float32 rounding differences between world sizes stay at rounding level."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv = nn.LayerNorm(hidden), nn.Linear(hidden, 3 * hidden)  # q, k, v side by side
        self.proj = nn.Linear(hidden, hidden)
        self.ln2, self.fc1 = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.proj(attend(self.qkv(self.ln1(x)), self.heads))
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
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def build_model(args, device="cpu"):
    """The full model from the seed: the same network at every world size (GPT-2's init). On the
    CPU unless asked: a rank cuts its slice from it there and moves only the slice to its device."""
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.hidden, args.heads, args.seq_len)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return model.to(device)


def sharded_model(args, comm, device, row_comm=None):
    """The full model from the seed on every rank's CPU; each rank cuts its slice and moves only
    the slice to its device. Returns the slice, its optimizer and the size of the full model."""
    model = build_model(args)
    full_params = sum(p.numel() for p in model.parameters())
    model = shard_model(model, comm, row_comm).to(device)  # Module.to keeps the parameters' .partition
    # SGD with momentum, not Adam: Adam divides each gradient by its own size, so rounding noise
    # in a gradient that is zero in exact arithmetic (the key bias: softmax ignores a shift that
    # is the same for every key) becomes a full-size step. A 1e-6 nudge to one weight grew to
    # 0.17 in 200 steps with Adam; with SGD it stayed 1e-6, so the check's tolerance can be tight.
    return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), full_params


def replicated_checksum(model):
    """A bitwise fingerprint of the parameters every rank holds whole."""
    crc = 0
    for p in model.parameters():
        if not hasattr(p, "partition"):
            crc = zlib.crc32(p.detach().cpu().contiguous().numpy().tobytes(), crc)
    return crc


# -----------------------------------------------------------------------------
# The data: characters of Python's own source, batches a function of (seed, step)
# -----------------------------------------------------------------------------
_TEXT = []


def load_text():
    """argparse.py, textwrap.py and shlex.py from this Python, bytes >= 128 replaced by '?'."""
    if not _TEXT:
        raw = b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in SOURCES)
        _TEXT.append(torch.tensor([b if b < 128 else ord("?") for b in raw], dtype=torch.long))
    return _TEXT[0]


def make_batch(seed, step, size, seq_len):
    """The global batch of one step: inputs and next-character targets, from (seed, step) alone."""
    data = load_text()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - seq_len - 1, (size,), generator=gen).tolist()
    x = torch.stack([data[o:o + seq_len] for o in starts])
    y = torch.stack([data[o + 1:o + seq_len + 1] for o in starts])
    return x, y


# -----------------------------------------------------------------------------
# The run: the step loop, the sample, and main() as a table of contents
# -----------------------------------------------------------------------------
def train(args, comm, device, model, optimizer, loss_comm, timeline, past=()):
    """The steps after the `past` ones (their losses, from a checkpoint). Returns the losses of
    all steps (the same on every rank) and the new steps' timings."""
    losses, records = list(past), []
    for step in range(len(past), args.steps):
        inject_failure(comm, step, model=model)
        start = time.perf_counter()
        x, y = make_batch(args.seed, step, args.batch_size, args.seq_len)
        losses.append(train_step(model, optimizer, x.to(device), y.to(device), loss_comm, timeline))
        records.append(timeline.step_record(start))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print_progress(comm, args, step, losses[-1], records[-1])
        if args.save and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            shard = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "losses": losses}
            save_checkpoint(comm, args.save, step + 1, shard, model_config(args, comm.Get_size()))
    return losses, records


@torch.no_grad()
def generate(model, comm, args, device):
    """Text from the sharded model, sampled without gathering the logits: the argmax of
    logits / temperature + Gumbel noise is a draw from their softmax (the Gumbel-max trick). The
    noise comes from the same generator on every rank, one number per character of the
    vocabulary whatever the padding, so the text is a function of the seed alone, the same at
    every world size. Each rank adds its own columns' share of the noise and takes the best of
    them, and two max-allreduces find the best score and its column: all ranks agree."""
    gen = torch.Generator().manual_seed(args.seed)
    text = list(PROMPT.encode())
    for _ in range(args.sample_chars):
        logits = model(torch.tensor([text[-args.seq_len:]], device=device))[0, -1].float()
        per = logits.numel()
        start = comm.Get_rank() * per
        noise = -torch.empty(VOCAB).exponential_(generator=gen).log()
        noise = torch.cat([noise, noise.new_zeros(per * comm.Get_size() - VOCAB)])  # padding
        score = logits / TEMPERATURE + noise[start:start + per].to(device)
        score[torch.arange(start, start + per, device=device) >= VOCAB] = float("-inf")
        best = allreduce(score.max().reshape(1), comm, MPI.MAX)
        column = start + score.argmax() if score.max() == best[0] else torch.tensor(-1, device=device)
        text.append(int(allreduce(column.reshape(1).clone(), comm, MPI.MAX)[0]))
    return "".join(chr(c) if chr(c).isprintable() or c == 10 else "?" for c in text)


def model_config(args, world_size):
    """What the shapes of a checkpoint's slices depend on."""
    return {"model": "GPT", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "seq_len": args.seq_len, "vocab": VOCAB, "padded_vocab": padded_vocab(world_size)}


def main(argv=None, comm=MPI.COMM_WORLD):
    """Parse, set up, train, check, report. Returns the exit status of this rank."""
    try:
        args = parse_args(argv, comm.Get_size())
        check_paths(comm, args)
        run = setup(comm, args)
        counted = {kind: CountedComm(comm, run.timeline) for kind in ("f", "g", "cross-entropy")}
        model, optimizer, full_params = sharded_model(args, counted["f"], run.device, counted["g"])
        past, resumed = [], None
        if args.resume:
            resumed, shard = load_checkpoint(comm, args.save, model_config(args, comm.Get_size()),
                                             lambda manifest: f"rank-{comm.Get_rank()}.pt", args.steps)
            past = restore(model, optimizer, shard)
        print_header(comm, args, run, model, full_params, resumed)
        losses, records = train(args, comm, run.device, model, optimizer, counted["cross-entropy"],
                                run.timeline, past)
    except ConfigError as e:
        print0(comm, f"error: {e}", file=sys.stderr)
        return e.status
    traffic = {kind: (sum(c.calls.values()), sum(c.bytes.values())) for kind, c in counted.items()}
    if len(set(comm.allgather(replicated_checksum(model)))) != 1:
        raise RuntimeError("replicated parameters (LayerNorm, positions, biases) differ across ranks")
    sample = generate(model, comm, args, run.device) if args.sample_chars else None
    diff = check(comm, args, losses, model) if args.check else None
    if args.trace:
        write_trace(comm, run.timeline, args.trace)
    return report(comm, args, run, model, full_params, losses, records, traffic, sample, diff)


# =============================================================================
# You may stop reading here: the strategy is all above. Below is the machinery that every
# strategy file repeats in the same order and the same words: the check against single-process
# training, the report, checkpoints, counters and timeline, device and MPI setup, arguments.
# =============================================================================

# --- Check against single-process training -----------------------------------
def reference_training(args):
    """The same steps in one plain process on the CPU: the unsharded model, nn.Linear,
    F.cross_entropy. The CPU holds what no single device of a tensor-parallel job may."""
    model = build_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for step in range(args.steps):
        x, y = make_batch(args.seed, step, args.batch_size, args.seq_len)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model

def check(comm, args, losses, model):
    """Rank 0 gathers the slices on its CPU and trains the reference there; the others wait
    without spinning; every rank gets the largest difference, NaN if any loss or parameter is
    NaN (max() would pass over it)."""
    full, diff = gather_model(model, comm), None
    if comm.Get_rank() == 0:
        diff = max_difference(losses, full, *reference_training(args))
        if any(math.isnan(x) for x in losses) or any(t.isnan().any() for t in full.values()):
            diff = math.nan
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)
    return comm.bcast(diff, root=0)

def max_difference(losses, state, ref_losses, ref_model):
    """Largest |difference| in the losses and in the tensors of `state` (a state dict of the
    whole model or of a part of it) against the reference model's; a NaN anywhere is infinite."""
    ref_state = ref_model.state_dict()
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)] + [
        (t.detach().double().cpu() - ref_state[name].double().cpu()).abs().max().item() for name, t in state.items()]
    return math.inf if any(math.isnan(d) for d in diffs) else max(diffs)

# --- Report: header, progress, summary, --json, --trace ----------------------
def print_header(comm, args, run, model, full_params, resumed):
    world_size, h, padded = comm.Get_size(), args.hidden, padded_vocab(comm.Get_size())
    if resumed:
        print0(comm, f"resumed from {args.save} at step {resumed['step']} "
                     f"(written by {resumed['world_size']} ranks)")
    print0(comm, *run.header,
           f"model: GPT, {args.layers} blocks, hidden {h}, {args.heads} heads, {full_params:,} parameters; "
           f"this rank holds {sum(p.numel() for p in model.parameters()):,}",
           f"each rank: {args.heads // world_size} of {args.heads} heads, {4 * h // world_size} of {4 * h} "
           f"MLP features, {padded // world_size} of {padded} vocabulary rows | batch {args.batch_size} x "
           f"{args.seq_len} characters, whole on every rank",
           f"text: {' + '.join(s + '.py' for s in SOURCES)} of Python {sys.version.split()[0]} "
           f"({len(load_text()):,} characters) | vocabulary {VOCAB} ASCII codes"
           + (f", padded to {padded} (a multiple of {world_size}, as Megatron pads; the padding is "
              f"masked out of the softmax)" if padded != VOCAB else ""))

def report(comm, args, run, model, full_params, losses, records, traffic, sample, diff):
    """The summary, the sample, the check's verdict and --json; returns the exit status."""
    world_size, steps_run = comm.Get_size(), max(1, len(records))
    calls = {kind: count / steps_run for kind, (count, _) in traffic.items()}
    volume = {kind: size / steps_run for kind, (_, size) in traffic.items()}
    slowest = step_summary(comm, records)
    L, activation = args.layers, args.batch_size * args.seq_len * args.hidden * 4
    formula_calls, formula_bytes = 4 * L + 5, (4 * L + 2) * activation + 3 * args.batch_size * args.seq_len * 4
    ring = 2 * (world_size - 1) / world_size * formula_bytes
    print0(comm, f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f}; a uniform guess is "
                 f"ln {VOCAB} = {math.log(VOCAB):.4f})", summary_line(slowest),
           f"collectives per step: {sum(calls.values()):g} (f {calls['f']:g}, g {calls['g']:g}, "
           f"cross-entropy {calls['cross-entropy']:g}); formula 4L + 5 = {formula_calls}: per block "
           f"2 forward (g) + 2 backward (f), embedding g, head f, 3 for the loss",
           f"bytes per step: {sum(volume.values()):,.0f}; formula (4L + 2) x 4BTh + 3 x 4BT = "
           f"{formula_bytes:,}, of which the blocks' 4L x 4BTh = {4 * L * activation:,} (the paper's "
           f"4 allreduces of b x s x h per block); a ring moves 2(N-1)/N x that = {ring:,.0f} bytes in "
           f"and out of each rank",
           f"replicated parameters (LayerNorms, position embedding, row-parallel biases): "
           f"bitwise identical on all {world_size} ranks")
    if sample is not None:
        print0(comm, f"sample ({args.sample_chars} characters after {PROMPT!r}, temperature {TEMPERATURE}):",
               *("  | " + line for line in sample.split("\n")))
    ok = verdict(comm, diff, "losses, parameters")
    if args.json:
        print0(comm, json.dumps({
            **house_keys(comm, args, run, losses, slowest, diff),
            "comm_bytes_per_step": sum(volume.values()), "collectives_per_step": sum(calls.values()),
            "collectives_formula": formula_calls, "comm_bytes_formula": formula_bytes,
            "collectives_by_kind": calls, "ring_bytes_per_rank": ring, "parameters": full_params,
            "parameters_this_rank": sum(p.numel() for p in model.parameters()),
            "padded_vocab": padded_vocab(world_size), "sample": sample}))
    return 0 if ok else 1

def print_progress(comm, args, step, loss, record):
    print0(comm, f"step {step + 1}/{args.steps} | loss {loss:.4f} | {record['step_s'] * 1e3:.1f} ms/step | "
                 f"comm {record['comm_s'] * 1e3:.1f} ms | idle {100 * record['idle_s'] / record['step_s']:.0f}%")

def summary_line(slowest):
    return (f"median step {slowest['step_s'] * 1e3:.1f} ms: compute {slowest['compute_s'] * 1e3:.1f} | "
            f"comm {slowest['comm_s'] * 1e3:.1f} | idle {slowest['idle_s'] * 1e3:.1f} ms (slowest rank)")

def verdict(comm, diff, compared):
    """Print the check's verdict (if it ran); True unless the difference exceeds the tolerance."""
    ok = diff is None or diff <= TOLERANCE
    if diff is not None:
        print0(comm, f"check against single-process training: max |diff| {diff:.2e} "
                     f"({compared}; tolerance {TOLERANCE:g}) -> {'PASS' if ok else 'FAIL'}")
    return ok

def house_keys(comm, args, run, losses, slowest, diff):
    """The JSON keys every strategy file reports."""
    return {"strategy": STRATEGY, "world_size": comm.Get_size(), "device": run.device.type,
            "steps": args.steps, "losses": losses, "final_loss": losses[-1],
            "step_time_s": slowest["step_s"], "compute_s": slowest["compute_s"],
            "comm_s": slowest["comm_s"], "idle_s": slowest["idle_s"], "check_max_abs_diff": diff}

def step_summary(comm, records):
    """Medians over steps after the first, of the slowest rank (by median step time)."""
    medians = [{k: statistics.median(r[k] for r in (rank_records[1:] or rank_records)) for k in rank_records[0]}
               for rank_records in comm.allgather(records)]
    return max(medians, key=lambda m: m["step_s"])

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

# --- Checkpoints: a folder appears whole or not at all ------------------------
def checkpoints(root):
    """The complete checkpoints in root, oldest first: step-NNNNNN folders with a manifest."""
    names = sorted(n for n in (os.listdir(root) if os.path.isdir(root) else [])
                   if n.startswith("step-") and os.path.isfile(os.path.join(root, n, "manifest.json")))
    return [os.path.join(root, n) for n in names]

def sha256(path):
    with open(path, "rb") as stream:
        return hashlib.sha256(stream.read()).hexdigest()

def write_durably(path, data):
    with open(path, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())

def save_checkpoint(comm, root, step, shard, config, keep=2):
    """Each rank's shard (None: nothing) goes into root/.tmp-step-N, then rank 0 writes the
    manifest and renames the folder to step-N: a job killed before the rename leaves the
    previous checkpoint as it was. A write that fails on any rank (a full disk) ends the job on
    every rank with one line, the previous checkpoint whole."""
    final, tmp = os.path.join(root, f"step-{step:06d}"), os.path.join(root, f".tmp-step-{step:06d}")
    files, error = {}, None
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    comm.Barrier()
    try:
        os.makedirs(tmp, exist_ok=True)
        inject_failure(comm, step, "save")
        if shard is not None:
            name, stream = f"rank-{comm.Get_rank()}.pt", io.BytesIO()
            torch.save(shard, stream)
            write_durably(os.path.join(tmp, name), stream.getvalue())
            files[name] = hashlib.sha256(stream.getvalue()).hexdigest()
    except OSError as e:
        error = f"rank {comm.Get_rank()}: {e}"
    gathered = comm.gather((files, error), root=0)
    if comm.Get_rank() == 0:
        error = next((e for _, e in gathered if e), None)
        try:
            if error is None:
                manifest = {"strategy": STRATEGY, "world_size": comm.Get_size(), "config": config,
                            "step": step, "files": {k: v for f, _ in gathered for k, v in f.items()}}
                write_durably(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1).encode())
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)  # atomic: the checkpoint is now complete
                fd = os.open(root, os.O_RDONLY)
                os.fsync(fd)  # make the rename itself durable
                os.close(fd)
                for old in checkpoints(root)[:-keep]:
                    shutil.rmtree(old)
        except OSError as e:
            error = f"rank 0: {e}"
    error = comm.bcast(error, root=0)
    if error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = (checkpoints(root) or ["none"])[-1]
        raise ConfigError(f"the checkpoint of step {step} could not be written ({error}); the previous "
                          f"one ({previous}) is whole: make room and rerun with --resume", status=1)

def load_checkpoint(comm, root, config, shard_name, steps, same_world_size=True):
    """The latest complete checkpoint's manifest and the shard this rank needs, verified.
    Any problem on any rank is a ConfigError on every rank."""
    error = manifest = shard = None
    try:
        found = checkpoints(root)
        if not found:
            raise ConfigError(f"--resume: no complete checkpoint in {root} (no step-N/manifest.json); "
                              f"start without --resume to create one")
        path = found[-1]
        with open(os.path.join(path, "manifest.json")) as stream:
            manifest = json.load(stream)
        if manifest["strategy"] != STRATEGY:
            raise ConfigError(f"{path} was written by {manifest['strategy']}, not {STRATEGY}")
        if manifest["step"] >= steps:
            raise ConfigError(f"{path} is at step {manifest['step']}: --steps {steps} leaves nothing to "
                              f"train; ask for more steps to continue")
        if same_world_size and manifest["world_size"] != comm.Get_size():
            raise ConfigError(f"{path} was written by {manifest['world_size']} ranks, this job has "
                              f"{comm.Get_size()}; resume with mpirun -np {manifest['world_size']}")
        if manifest["config"] != config:
            raise ConfigError(f"{path} holds a model {manifest['config']}, these flags make {config}")
        name = shard_name(manifest)
        if sha256(os.path.join(path, name)) != manifest["files"][name]:
            raise ConfigError(f"{path}/{name} is damaged: its SHA-256 differs from the manifest's")
        shard = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
    except ConfigError as e:
        error = str(e)
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        error = f"cannot read the checkpoint in {root}: {type(e).__name__}: {e}"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise ConfigError(errors[0])
    return manifest, shard

def restore(model, optimizer, shard):
    """Load this rank's slice of a tensor-parallel checkpoint (written at this world size).
    Returns the losses so far."""
    model.load_state_dict(shard["model"])
    optimizer.load_state_dict(shard["optimizer"])
    return shard["losses"]

# --- Counters and timeline: measured around the strategy's own MPI calls -----
class Timeline:
    """Spans of compute, comm and idle time on one rank, for the summary and --trace; a span's
    own time leaves out its children's. On a GPU the edges are CUDA events, read once a step
    (step_record), so that timing never stalls the device in the middle of a step."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.origin_s, self.origin = time.perf_counter(), self._mark()  # the trace's zero
        self.open, self.closed, self.events = [], [], []  # events: (name, cat, start_s, end_s)

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

        def own_time(name, cat, start_mark, end_mark, children):
            begin, end = self._seconds(start_mark), self._seconds(end_mark)
            self.events.append((name, cat, begin, end))
            record[{"idle": "wait"}.get(cat, cat) + "_s"] += end - begin - sum(own_time(*c) for c in children)
            return end - begin

        for span in self.closed:
            own_time(*span)
        self.closed = []
        record["idle_s"] = max(0.0, record["step_s"] - record["compute_s"] - record["comm_s"])
        return record

class CountedComm:
    """The communicator the strategy is given: every call goes to mpi4py unchanged, and on the
    way the buffer methods are counted (calls, bytes, by name) and timed as 'comm' spans. Their
    requests' Wait polls with short sleeps (MPICH's Wait spins and takes the core of a rank that
    computes) in a span: a point-to-point wait is the peer's lateness (idle), a collective's is comm."""

    COUNTED = {"Allreduce", "Iallreduce", "Bcast", "Ibcast", "Send", "Recv", "Isend", "Irecv", "Sendrecv",
               "Allgather", "Iallgather", "Reduce_scatter_block", "Ireduce_scatter_block"}

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
            while not self.request.Test():
                time.sleep(POLL_S)

# --- Device and MPI setup -----------------------------------------------------
def setup(comm, args):
    """This rank's device, whether MPI reads its memory, the timeline, and the header's facts."""
    global CUDA_AWARE
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this machine
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    gpus, cores = torch.cuda.device_count(), os.cpu_count() or 1
    if args.device == "cuda" or (args.device == "auto" and gpus):
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
        check_thread_level(MPI.Query_thread())
        CUDA_AWARE = mpi_cuda_aware(comm)
        if args.check:  # float32 against float32: no TF32 in the run or in the reference
            torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "ieee"
        transport = "direct (CUDA-aware MPI)" if CUDA_AWARE else "staged through host memory"
        shared = f"note: {local_size} ranks share {gpus} GPU(s) on this node (fails in EXCLUSIVE_PROCESS mode)"
    else:
        device, CUDA_AWARE, transport = torch.device("cpu"), False, "n/a (CPU)"
        torch.set_num_threads(max(1, cores // local_size))  # oversubscribed ranks would thrash
        shared = f"note: {local_size} ranks share {cores} CPU cores, so ranks that could compute at once take turns"
    comm.Barrier()  # the timeline's zero, about the same moment on every rank
    header = [f"{STRATEGY} | {comm.Get_size()} ranks | device {device.type} | {mpi_library()}",
              f"CUDA buffers: {transport}"] + ([shared] if local_size > (gpus if device.type == "cuda" else cores) else [])
    return types.SimpleNamespace(device=device, timeline=Timeline(device), header=header)

def mpi_cuda_aware(comm):
    """Can MPI read GPU memory? MPI_CUDA_AWARE=1|0 decides when set (a 1 that the library denies
    is refused); else MPI 4.1's mpi_memory_alloc_kinds; else the library's MPIX_Query_cuda_support."""
    try:
        kinds = comm.Get_info().Get("mpi_memory_alloc_kinds")
    except (MPI.Exception, NotImplementedError, AttributeError):
        kinds = None
    says = cuda_in_kinds(kinds) if kinds is not None else mpix_query_cuda_support()
    forced = os.environ.get("MPI_CUDA_AWARE")
    if forced == "1" and says is False:
        raise ConfigError(f"MPI_CUDA_AWARE=1, but this MPI library cannot read GPU memory (memory kinds "
                          f"{kinds!r}); unset it to stage through host memory, or launch a CUDA-aware MPI "
                          f"with mpiexec -memory-alloc-kinds system,cuda:device")
    return forced == "1" if forced in ("0", "1") else bool(says)

def cuda_in_kinds(kinds):
    """MPI 4.1's memory kinds (e.g. 'mpi,system,cuda:device'), which list only the kinds asked for
    at launch: 'cuda' or 'cuda:device' is GPU memory; 'cuda:host' (pinned host memory) is not."""
    return any(kind.strip() in ("cuda", "cuda:device") for kind in kinds.split(","))

def mpix_query_cuda_support():
    """The answer of Open MPI's and MPICH's MPIX_Query_cuda_support; None without it."""
    maps = "/proc/self/maps"  # the libraries loaded in this process (Linux)
    for path in sorted({line.split()[-1] for line in open(maps) if "libmpi" in line} if os.path.exists(maps) else []):
        query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        if query is not None:
            return bool(query())
    return None

def check_thread_level(provided):
    """On a GPU, autograd runs backward hooks and autograd functions on a thread of its own."""
    if provided < MPI.THREAD_SERIALIZED:
        raise ConfigError(f"MPI runs at thread level {provided}, but on a GPU MPI is called from autograd's "
                          f"thread: MPI_THREAD_SERIALIZED ({MPI.THREAD_SERIALIZED}) or more is needed; "
                          f"keep mpi4py.rc.thread_level at its default, 'multiple'")

def mpi_library():
    """The first line of the library's version, printable characters only (Open MPI's ends in NUL)."""
    text = "".join(c for c in MPI.Get_library_version() if c.isprintable() or c == "\n")
    return text.strip().splitlines()[0].strip()

def inject_failure(comm, step, during="step", model=None):
    """Testing aid: FAIL_AT=RANK:STEP:HOW[:save] (RANK a number, or * for all): at the start of
    that step, or while saving its checkpoint, raise an exception, kill (SIGKILL), oserror (a
    full disk), or nudge (move one parameter by 10x the tolerance: the check must FAIL)."""
    spec = os.environ.get("FAIL_AT", "")
    rank, at, how, *where = spec.split(":") if spec else ("", -1, "", "")
    if rank not in ("*", str(comm.Get_rank())) or int(at) != step or (where or ["step"])[0] != during:
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "oserror":
        raise OSError(errno.ENOSPC, f"No space left on device (injected: FAIL_AT={spec})")
    if how != "nudge":
        raise RuntimeError(f"injected failure (FAIL_AT={spec})")
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 10 * TOLERANCE

# --- Arguments, and the paths a run will write, checked before anything is built
class ConfigError(Exception):
    """A problem every rank finds alike: rank 0 prints one `error:` line, every rank exits with
    `status`: 2 for an impossible configuration, 1 for a checkpoint that could not be written."""

    def __init__(self, message, status=2):
        super().__init__(message)
        self.status = status

class Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage on every rank."""

    def error(self, message):
        raise ConfigError(message.replace("argument ", "", 1).replace(": must", " must") if ": must" in message
                          else message)

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:  # --help once, not once per rank
            super()._print_message(message, file)

def checked(kind, ok, must):
    """A type= for argparse: kind(text), refused unless ok(value): '--flag must be <must>, got ...'."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {value}")
        return value
    return parse

COUNT = checked(int, lambda v: v > 0, "a positive integer")
COUNT_OR_0 = checked(int, lambda v: v >= 0, "0 or more")
AMOUNT = checked(float, lambda v: v > 0 and math.isfinite(v), "a positive number")

def common_arguments(description, steps, batch_size, lr, log_every):
    p = Parser(description=description)
    p.add_argument("--steps", type=COUNT, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=COUNT, default=batch_size, help="global batch: samples per step, any world size")
    p.add_argument("--lr", type=AMOUNT, default=lr, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--log-every", type=COUNT, default=log_every, help="rank 0 prints progress every N steps")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with single-process training (default: on)")
    p.add_argument("--json", action="store_true", help="last stdout line is one JSON object")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace of every rank")
    p.add_argument("--save", metavar="DIR", help="write checkpoints into DIR, a folder every rank sees")
    p.add_argument("--save-every", type=COUNT_OR_0, default=0, help="also checkpoint every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save")
    return p

def check_common(args):
    if args.resume and not args.save:
        raise ConfigError("--resume needs --save DIR, the folder that holds the checkpoints")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no CUDA device; use --device cpu or auto")
    return args

def parse_args(argv, world_size):
    p = common_arguments("Tensor parallelism over MPI (Megatron-LM): a small GPT on Python's own source.",
                         steps=50, batch_size=16, lr=0.1, log_every=10)
    p.add_argument("--layers", type=COUNT, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=COUNT, default=64, help="hidden size")
    p.add_argument("--heads", type=COUNT, default=4, help="attention heads")
    p.add_argument("--seq-len", type=COUNT, default=64, help="characters per sequence")
    p.add_argument("--sample-chars", type=COUNT_OR_0, default=120,
                   help="characters of text the trained model writes at the end (0: none)")
    args = check_common(p.parse_args(argv))
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} does not split into {args.heads} heads of equal "
                          f"size; use a multiple of {args.heads}, e.g. {16 * args.heads}")
    if args.heads % world_size:  # whole heads per rank; then hidden and 4 x hidden split too
        works = [n for n in range(1, args.heads + 1) if args.heads % n == 0]
        size = args.hidden // args.heads
        raise ConfigError(f"--heads {args.heads} does not split over {world_size} ranks (each rank "
                          f"computes whole heads); world sizes that work: {', '.join(map(str, works))}; "
                          f"or for {world_size} ranks e.g. --heads {world_size} --hidden {world_size * size}")
    if args.seq_len >= len(load_text()):
        raise ConfigError(f"--seq-len {args.seq_len} must be shorter than the text ({len(load_text())})")
    return args

def check_paths(comm, args):
    """Before anything is built, each rank tries what it will write: --save, a folder (made if
    missing) that every rank can write and sees as one folder; --trace, a file rank 0 creates."""
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
        unseen = [r for r in range(comm.Get_size()) if not os.path.exists(os.path.join(args.save, f".probe-{r}"))]
        error = unseen and (f"--save {args.save}: rank {rank} does not see the files of rank(s) "
                            f"{', '.join(map(str, unseen))}; checkpoints need a folder every rank shares")
    errors = [e for e in comm.allgather(error) if e]
    with contextlib.suppress(OSError, TypeError):
        os.remove(os.path.join(args.save, f".probe-{rank}"))
    if errors:
        raise ConfigError(errors[0])

def abort_on_exception(kind, value, tb):
    """An exception on one rank must end the whole job, not leave the others in a collective."""
    rank = MPI.COMM_WORLD.Get_rank()
    text = "".join(traceback.format_exception(kind, value, tb))
    print(f"rank {rank}: {text}", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(1)

if __name__ == "__main__":
    sys.excepthook = abort_on_exception
    sys.exit(main())
