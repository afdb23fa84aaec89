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
import hashlib
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
import traceback
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

STRATEGY = "tensor_parallel"
TOLERANCE = 2e-5  # largest |difference| allowed against single-process training (float32)
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text
VOCAB = 128  # the ASCII codes
PROMPT, TEMPERATURE = "def ", 0.8  # how the sample at the end starts, and how adventurous it is
POLL_S = 1e-3  # a rank with nothing to do sleeps between polls and leaves the cores to rank 0


# -----------------------------------------------------------------------------
# Arguments
# -----------------------------------------------------------------------------
class ConfigError(Exception):
    """An impossible configuration. Every rank finds it the same way and exits 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage on every rank."""

    def error(self, message):
        raise ConfigError(message)

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:  # --help once, not once per rank
            super()._print_message(message, file)


def parse_args(argv, world_size):
    p = Parser(description="Tensor parallelism over MPI (Megatron-LM): a small GPT on Python's own source.")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16,
                   help="global batch: samples per optimizer step, whatever the world size")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate (SGD, momentum 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints progress every N steps")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with single-process training (default: on)")
    p.add_argument("--json", action="store_true", help="last stdout line is one JSON object")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace of every rank")
    p.add_argument("--save", metavar="DIR", help="write checkpoints into DIR")
    p.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N steps as well as at the end (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save")
    # The network, the same in every strategy file.
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    # Tensor parallelism's own flag.
    p.add_argument("--sample-chars", type=int, default=120,
                   help="characters of text the trained model writes at the end (0: none)")
    args = p.parse_args(argv)

    for name in ("steps", "batch_size", "log_every", "layers", "hidden", "heads", "seq_len"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, "
                              f"got {getattr(args, name)}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ConfigError(f"--lr must be a positive number, got {args.lr}")
    for name in ("sample_chars", "save_every"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if args.resume and not args.save:
        raise ConfigError("--resume needs --save DIR, the folder that holds the checkpoints")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no CUDA device; use --device cpu or auto")
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


# -----------------------------------------------------------------------------
# MPI and device setup
# -----------------------------------------------------------------------------
def setup_device(comm, choice):
    """One device per rank: cuda:(local rank % GPUs), or the CPU with a fair share of cores."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this machine
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Oversubscribed ranks that each start one thread per core thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    return device


def mpi_cuda_aware(comm):
    """Can MPI read CUDA memory? MPI_CUDA_AWARE=1|0 decides; else ask MPI 4.1; else no."""
    forced = os.environ.get("MPI_CUDA_AWARE")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        kinds = comm.Get_info().Get("mpi_memory_alloc_kinds") or ""
    except (MPI.Exception, NotImplementedError, AttributeError):
        kinds = ""
    return "cuda" in kinds


def mpi_library():
    return MPI.Get_library_version().splitlines()[0].strip()


def inject_failure(comm, step, during="step"):
    """Testing aid: FAIL_AT=RANK:STEP:raise|kill[:save] makes one rank raise or SIGKILL itself
    at the start of a step, or with ':save' while writing the checkpoint of that step."""
    spec = os.environ.get("FAIL_AT")
    if not spec:
        return
    rank, at, how, *where = spec.split(":")
    if int(rank) == comm.Get_rank() and int(at) == step and (where or ["step"])[0] == during:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure (FAIL_AT={spec})")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -----------------------------------------------------------------------------
# Communication: a timeline of spans, and the counted MPI primitives
# -----------------------------------------------------------------------------
class Timeline:
    """Spans of compute and comm on one rank. Nested spans count once (self time)."""

    def __init__(self, device):
        self.device, self.events, self.stack = device, [], []
        self.totals = collections.Counter()  # self time per category since the last take()

    @contextlib.contextmanager
    def span(self, cat, name):
        sync(self.device)
        start = time.perf_counter()
        self.stack.append(0.0)
        try:
            yield
        finally:
            sync(self.device)
            end = time.perf_counter()
            children = self.stack.pop()
            self.totals[cat] += end - start - children
            if self.stack:
                self.stack[-1] += end - start
            self.events.append((name, cat, start, end))

    def take(self):
        totals, self.totals = dict(self.totals), collections.Counter()
        return totals


class Exchange:
    """MPI on torch tensors: CUDA memory directly when MPI is CUDA-aware, else staged via host.

    Every call is counted (calls and payload bytes, by kind) and timed as a 'comm' span.
    """

    def __init__(self, comm, timeline, cuda_aware):
        self.comm, self.timeline, self.cuda_aware = comm, timeline, cuda_aware
        self.calls, self.bytes = collections.Counter(), collections.Counter()

    def _count(self, kind, t):
        self.calls[kind] += 1
        self.bytes[kind] += t.numel() * t.element_size()

    def _to_mpi(self, t):
        """The buffer MPI reads and writes: t itself, or a host copy when MPI cannot see CUDA."""
        assert t.is_contiguous() and not t.requires_grad
        if t.is_cuda:
            torch.cuda.current_stream().synchronize()  # kernels writing t must finish first
            if not self.cuda_aware:
                return t.cpu()
        return t

    def allreduce(self, t, kind="allreduce"):
        """Sum t over all ranks, in place; returns t."""
        self._count(kind, t)
        with self.timeline.span("comm", kind):
            buf = self._to_mpi(t)
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            if buf is not t:
                t.copy_(buf)
        return t

    def allreduce_max(self, t, kind="allreduce max"):
        """Elementwise maximum of t over all ranks, in place; returns t."""
        self._count(kind, t)
        with self.timeline.span("comm", kind):
            buf = self._to_mpi(t)
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
            if buf is not t:
                t.copy_(buf)
        return t

    def gather(self, t, root=0, kind="gather"):
        """Every rank's t, stacked in rank order: a new (N, *t.shape) tensor on root, None elsewhere."""
        self._count(kind, t)
        with self.timeline.span("comm", kind):
            buf = self._to_mpi(t)
            out = buf.new_empty((self.comm.Get_size(), *t.shape)) if self.comm.Get_rank() == root else None
            self.comm.Gather(buf, out, root=root)
        return None if out is None else out.to(t.device)

    def allgather(self, t, kind="allgather"):
        """Every rank's t, stacked in rank order: a new (N, *t.shape) tensor on every rank."""
        self._count(kind, t)
        with self.timeline.span("comm", kind):
            buf = self._to_mpi(t)
            out = buf.new_empty((self.comm.Get_size(), *t.shape))
            self.comm.Allgather(buf, out)
        return out.to(t.device)


def wait_quietly(comm):
    """A barrier that sleeps between polls: ranks with nothing to do leave the cores to rank 0."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)


# -----------------------------------------------------------------------------
# Model: a GPT-2 style character-level language model, plain (what one process trains)
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


# -----------------------------------------------------------------------------
# Megatron's layers: f and g, column- and row-parallel linears, the vocabulary-parallel
# embedding and cross-entropy; and the slice of the full model each rank keeps
# -----------------------------------------------------------------------------
class f(torch.autograd.Function):
    """Identity forward, allreduce backward. It stands before a column-parallel layer: each
    rank's backward sees only the gradient through its own columns; the input's is their sum."""

    @staticmethod
    def forward(ctx, x, exchange):
        ctx.exchange = exchange
        return x

    @staticmethod
    def backward(ctx, dy):
        return ctx.exchange.allreduce(dy.clone(memory_format=torch.contiguous_format), "f"), None


class g(torch.autograd.Function):
    """Allreduce forward, identity backward. It ends a row-parallel layer: the ranks' partial
    products add up to the output, whose gradient every rank already holds whole."""

    @staticmethod
    def forward(ctx, x, exchange):
        return exchange.allreduce(x.clone(memory_format=torch.contiguous_format), "g")

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def shard(t, dim, comm, groups=1, padded=None):
    """This rank's slice of t along dim, as a parameter. groups=3: t is q, k, v side by side and
    the rank keeps the same slice of each (its heads). padded: zero rows first, up to that size."""
    t = t.detach()
    full_size = t.size(dim)
    if padded is not None and padded > full_size:
        shape = list(t.shape)
        shape[dim] = padded - full_size
        t = torch.cat([t, t.new_zeros(shape)], dim)
    rank, world = comm.Get_rank(), comm.Get_size()
    p = nn.Parameter(torch.cat([part.chunk(world, dim)[rank] for part in t.chunk(groups, dim)], dim))
    p.partition = (dim, groups, full_size)  # how unshard() puts the full tensor back together
    return p


def join_slices(pieces, partition):
    """The full tensor from every rank's slice of it, in rank order (the inverse of shard)."""
    dim, groups, full_size = partition
    parts = [torch.cat([piece.chunk(groups, dim)[k] for piece in pieces], dim) for k in range(groups)]
    return torch.cat(parts, dim).narrow(dim, 0, full_size)


def unshard(t, partition, exchange, kind="gather"):
    """The full tensor from every rank's slice of it, on every rank."""
    return join_slices(exchange.allgather(t.detach().contiguous(), kind).unbind(0), partition)


class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) A_r + b_r: rank r's slice of the output features; X is whole on every rank."""

    def __init__(self, full, exchange, groups=1, padded=None):
        super().__init__()
        self.exchange = exchange
        self.weight = shard(full.weight, 0, exchange.comm, groups, padded)
        self.bias = None if full.bias is None else shard(full.bias, 0, exchange.comm, groups, padded)

    def forward(self, x):
        return F.linear(f.apply(x, self.exchange), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = g(X_r B_r) + b: rank r holds the rows of B for its slice X_r of the input features.
    The bias is whole on every rank and added once, after the sum."""

    def __init__(self, full, exchange):
        super().__init__()
        self.exchange = exchange
        self.weight = shard(full.weight, 1, exchange.comm)
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return g.apply(F.linear(x, self.weight), self.exchange) + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r owns the rows of a range of the vocabulary: it looks up the tokens in its range,
    writes zeros for the others, and g sums: every token's row comes from exactly one rank."""

    def __init__(self, full, exchange, padded):
        super().__init__()
        self.exchange = exchange
        self.weight = shard(full.weight, 0, exchange.comm, padded=padded)
        self.start = exchange.comm.Get_rank() * self.weight.size(0)

    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.start + self.weight.size(0))
        rows = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        return g.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.exchange)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over tokens from each rank's slice of the logits: three allreduces of
    B x T numbers forward (max, target logit, sum of exponentials), none backward."""

    @staticmethod
    def forward(ctx, logits, target, exchange):
        per = logits.size(-1)
        start = exchange.comm.Get_rank() * per
        padding = torch.arange(start, start + per, device=logits.device) >= VOCAB
        logits = logits.masked_fill(padding, float("-inf"))  # padded columns take no probability
        top = exchange.allreduce_max(logits.max(dim=-1).values.contiguous(), "cross-entropy")
        shifted = logits - top.unsqueeze(-1)  # exp() stays <= 1
        mine = (target >= start) & (target < start + per)
        local = (target - start).clamp(0, per - 1)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exchange.allreduce(picked, "cross-entropy")  # the target's logit: from its one owner
        exps = shifted.exp()
        total = exchange.allreduce(exps.sum(dim=-1), "cross-entropy")
        ctx.save_for_backward(exps / total.unsqueeze(-1), local, mine)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, dloss):
        softmax, local, mine = ctx.saved_tensors  # d loss / d logit = softmax - one-hot(target)
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        return grad * (dloss / mine.numel()), None, None


def padded_vocab(world_size):
    return -(-VOCAB // world_size) * world_size


def shard_block(block, exchange):
    """Megatron's block, in place: attention f -> qkv columns (this rank's heads) -> proj rows -> g,
    MLP f -> fc1 columns -> GELU -> fc2 rows -> g. Block.forward is unchanged."""
    block.qkv = ColumnParallelLinear(block.qkv, exchange, groups=3)  # q, k, v of its heads
    block.proj = RowParallelLinear(block.proj, exchange)
    block.heads //= exchange.comm.Get_size()
    block.fc1 = ColumnParallelLinear(block.fc1, exchange)
    block.fc2 = RowParallelLinear(block.fc2, exchange)
    return block


def shard_model(model, exchange):
    """Keep this rank's slice of the full model, in place: Megatron's layers take the place of the
    linears and the token embedding; LayerNorms and the position embedding stay whole."""
    padded = padded_vocab(exchange.comm.Get_size())
    model.tokens = VocabParallelEmbedding(model.tokens, exchange, padded)
    for block in model.blocks:
        shard_block(block, exchange)
    model.out = ColumnParallelLinear(model.out, exchange, padded=padded)
    return model


def unshard_model(model, exchange, of=lambda p: p):
    """{name: full tensor} of every parameter (or of what `of` takes from it), on every rank."""
    return {name: unshard(of(p), p.partition, exchange) if hasattr(p, "partition") else of(p).detach()
            for name, p in model.named_parameters()}


def gather_model(model, exchange, root=0):
    """{name: full tensor} of every parameter on root's CPU, None on the other ranks: the check's
    reference is the only full model of the job, and no rank's device ever holds one."""
    full = {}
    for name, p in model.named_parameters():
        local = p.detach().cpu().contiguous()
        if hasattr(p, "partition"):
            pieces = exchange.gather(local, root)
            local = None if pieces is None else join_slices(pieces.unbind(0), p.partition)
        full[name] = local
    return full if exchange.comm.Get_rank() == root else None


def replicated_checksum(model):
    """A bitwise fingerprint of the parameters every rank holds whole."""
    crc = 0
    for p in model.parameters():
        if not hasattr(p, "partition"):
            crc = zlib.crc32(p.detach().cpu().contiguous().numpy().tobytes(), crc)
    return crc


# -----------------------------------------------------------------------------
# Data: characters of Python's own source, batches a function of (seed, step)
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
# The tensor-parallel training step: every rank, the whole batch, its slice of every layer
# -----------------------------------------------------------------------------
def train_step(model, optimizer, x, y, exchange, timeline):
    optimizer.zero_grad()
    with timeline.span("compute", "forward"):
        loss = VocabParallelCrossEntropy.apply(model(x), y, exchange)
    with timeline.span("compute", "backward"):
        loss.backward()
    with timeline.span("compute", "optimizer"):
        optimizer.step()  # SGD acts element by element: each rank updates its slice alone
    return loss.item()  # the same on every rank: it is made of allreduced numbers


def setup(args, exchange, device):
    """The full model from the seed on every rank's CPU; each rank cuts its slice and moves only
    the slice to its device. Returns the slice, its optimizer and the size of the full model."""
    model = build_model(args)
    full_params = sum(p.numel() for p in model.parameters())
    model = shard_model(model, exchange).to(device)  # Module.to keeps the parameters' .partition
    # SGD with momentum, not Adam: Adam divides each gradient by its own size, so rounding noise
    # in a gradient that is zero in exact arithmetic (the key bias: softmax ignores a shift that
    # is the same for every key) becomes a full-size step. A 1e-6 nudge to one weight grew to
    # 0.17 in 200 steps with Adam; with SGD it stayed 1e-6, so the check's tolerance can be tight.
    return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), full_params


def train(args, comm, device, exchange, model, optimizer, done=(), config=None, log=False):
    """The steps after the `done` ones (their losses, from a checkpoint), saving checkpoints of
    `config`'s model with --save; returns the losses of all steps and the new steps' timings."""
    timeline, losses, records = exchange.timeline, list(done), []
    for step in range(len(done), args.steps):
        inject_failure(comm, step)
        start = time.perf_counter()
        x, y = make_batch(args.seed, step, args.batch_size, args.seq_len)
        losses.append(train_step(model, optimizer, x.to(device), y.to(device), exchange, timeline))
        sync(device)
        record = {"step_s": time.perf_counter() - start, **{f"{k}_s": v for k, v in timeline.take().items()}}
        record["idle_s"] = max(0.0, record["step_s"] - record.get("compute_s", 0) - record.get("comm_s", 0))
        records.append(record)
        if log and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            say(comm, f"step {step + 1}/{args.steps} | loss {losses[-1]:.4f} | "
                      f"{record['step_s'] * 1e3:.1f} ms/step | comm {record.get('comm_s', 0) * 1e3:.1f} ms | "
                      f"idle {100 * record['idle_s'] / record['step_s']:.0f}%")
        if args.save and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            shard = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "losses": losses}
            save_checkpoint(comm, args.save, step + 1, shard, config)
    return losses, records


@torch.no_grad()
def generate(model, exchange, args, device):
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
        start = exchange.comm.Get_rank() * per
        noise = -torch.empty(VOCAB).exponential_(generator=gen).log()
        noise = torch.cat([noise, noise.new_zeros(per * exchange.comm.Get_size() - VOCAB)])  # padding
        score = logits / TEMPERATURE + noise[start:start + per].to(device)
        score[torch.arange(start, start + per, device=device) >= VOCAB] = float("-inf")
        best = exchange.allreduce_max(score.max().reshape(1), "sample")
        column = start + score.argmax() if score.max() == best[0] else torch.tensor(-1, device=device)
        text.append(int(exchange.allreduce_max(column.reshape(1).clone(), "sample")[0]))
    return "".join(chr(c) if chr(c).isprintable() or c == 10 else "?" for c in text)


# -----------------------------------------------------------------------------
# Checkpoints: a folder appears whole or not at all
# -----------------------------------------------------------------------------
def checkpoints(root):
    """The complete checkpoints in root, oldest first: step-NNNNNN folders with a manifest."""
    names = sorted(n for n in (os.listdir(root) if os.path.isdir(root) else [])
                   if n.startswith("step-") and os.path.isfile(os.path.join(root, n, "manifest.json")))
    return [os.path.join(root, n) for n in names]


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_durably(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(comm, root, step, shard, config, keep=2):
    """Each rank's shard (None: nothing) goes into root/.tmp-step-N, then rank 0 writes the
    manifest and renames the folder to step-N: a job killed before the rename leaves the
    previous checkpoint as it was. The folder must be on a file system every rank sees."""
    final = os.path.join(root, f"step-{step:06d}")
    tmp = os.path.join(root, f".tmp-step-{step:06d}")
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.Barrier()
    files = {}
    if shard is not None:
        name = f"rank-{comm.Get_rank()}.pt"
        with open(os.path.join(tmp, name), "wb") as f:
            torch.save(shard, f)
            f.flush()
            os.fsync(f.fileno())
        files[name] = sha256(os.path.join(tmp, name))
    inject_failure(comm, step, "save")
    every = comm.gather(files, root=0)
    if comm.Get_rank() == 0:
        manifest = {"strategy": STRATEGY, "world_size": comm.Get_size(), "config": config,
                    "step": step, "files": {k: v for d in every for k, v in d.items()}}
        write_durably(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1).encode())
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)  # atomic: the checkpoint is now complete
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)  # make the rename itself durable
        os.close(fd)
        for old in checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    comm.Barrier()


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
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
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


# -----------------------------------------------------------------------------
# Check against single-process training
# -----------------------------------------------------------------------------
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


def check(args, losses, full):
    """Largest |difference| in losses and in final parameters (full: gather_model's tensors).
    Only float32 sums are reordered (row-parallel partial sums, the loss's reductions): measured
    5e-7 to 7e-7 after 100 steps at N = 1 to 4, 2e-6 after 300; TOLERANCE is 2e-5."""
    return max_difference(losses, full, *reference_training(args))


def max_difference(losses, full, ref_losses, ref_model):
    """The largest |difference| of losses and parameters; NaN if any of them is NaN, which
    fails the check (max() alone would pass over a NaN)."""
    gaps = [abs(a - b) for a, b in zip(losses, ref_losses, strict=True)]
    gaps += [(full[name].double() - p.detach().double()).abs().max().item()
             for name, p in ref_model.named_parameters()]
    return math.nan if any(math.isnan(gap) for gap in gaps) else max(gaps)


# -----------------------------------------------------------------------------
# Report
# -----------------------------------------------------------------------------
def step_summary(comm, records):
    """Medians over steps after the first, of the slowest rank (by median step time)."""
    per_rank = comm.allgather(records)
    medians = []
    for recs in per_rank:
        recs = recs[1:] or recs
        medians.append({k: statistics.median(r.get(k, 0.0) for r in recs)
                        for k in ("step_s", "compute_s", "comm_s", "idle_s")})
    return max(medians, key=lambda m: m["step_s"]), medians


def write_trace(comm, timeline, path, t0):
    """Chrome trace-event JSON: one track (pid) per rank; opens in Perfetto or chrome://tracing."""
    events = comm.gather([(n, c, s - t0, e - t0) for n, c, s, e in timeline.events], root=0)
    if comm.Get_rank() != 0:
        return
    trace = []
    for rank, evs in enumerate(events):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        trace += [{"name": n, "cat": c, "ph": "X", "pid": rank, "tid": 0,
                   "ts": s * 1e6, "dur": (e - s) * 1e6} for n, c, s, e in evs]
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def say(comm, *lines):
    if comm.Get_rank() == 0:
        print(*lines, sep="\n", flush=True)


# -----------------------------------------------------------------------------
# main
# -----------------------------------------------------------------------------
def main(argv=None, comm=MPI.COMM_WORLD):
    rank, world_size = comm.Get_rank(), comm.Get_size()
    try:
        args = parse_args(argv, world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    comm.Barrier()
    t0 = time.perf_counter()  # the trace's zero, about the same moment on every rank
    device = setup_device(comm, args.device)
    cuda_aware = device.type == "cuda" and mpi_cuda_aware(comm)
    timeline = Timeline(device)
    exchange = Exchange(comm, timeline, cuda_aware)

    model, optimizer, full_params = setup(args, exchange, device)
    L, B, T, h, padded = args.layers, args.batch_size, args.seq_len, args.hidden, padded_vocab(world_size)
    config = {"model": "GPT", "layers": L, "hidden": h, "heads": args.heads, "seq_len": T,
              "vocab": VOCAB, "padded_vocab": padded}  # what the shards' shapes depend on
    done = []
    if args.resume:
        try:
            manifest, shard = load_checkpoint(comm, args.save, config, lambda m: f"rank-{rank}.pt",
                                              args.steps, same_world_size=True)
        except ConfigError as e:
            if rank == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        model.load_state_dict(shard["model"])
        optimizer.load_state_dict(shard["optimizer"])
        done = shard["losses"]
        say(comm, f"resumed from {args.save} at step {manifest['step']} "
                  f"(written by {manifest['world_size']} ranks)")
    mine = sum(p.numel() for p in model.parameters())
    transport = "n/a (CPU)" if device.type == "cpu" else (
        "direct (CUDA-aware MPI)" if cuda_aware else "staged through host memory")
    say(comm, f"{STRATEGY} | {world_size} ranks | device {device.type} | {mpi_library()}",
        f"CUDA buffers: {transport} | model: GPT, {L} blocks, hidden {h}, {args.heads} heads, "
        f"{full_params:,} parameters; this rank holds {mine:,}",
        f"each rank: {args.heads // world_size} of {args.heads} heads, {4 * h // world_size} of {4 * h} "
        f"MLP features, {padded // world_size} of {padded} vocabulary rows | batch {B} x {T} "
        f"characters, whole on every rank",
        f"text: {' + '.join(s + '.py' for s in SOURCES)} of Python {sys.version.split()[0]} "
        f"({len(load_text()):,} characters) | vocabulary {VOCAB} ASCII codes"
        + (f", padded to {padded} (a multiple of {world_size}, as Megatron pads; the padding is "
           f"masked out of the softmax)" if padded != VOCAB else ""))

    losses, records = train(args, comm, device, exchange, model, optimizer, done, config, log=True)
    ran = max(1, args.steps - len(done))  # per-step counts: the training exchanges only
    calls = {k: v / ran for k, v in exchange.calls.items()}
    volume = {k: v / ran for k, v in exchange.bytes.items()}
    if len(set(comm.allgather(replicated_checksum(model)))) != 1:
        raise RuntimeError("replicated parameters (LayerNorm, positions, biases) differ across ranks")
    sample = generate(model, exchange, args, device) if args.sample_chars else None
    diff = None
    if args.check:
        full = gather_model(model, exchange)  # on rank 0's CPU; None on the others
        diff = check(args, losses, full) if rank == 0 else None
        wait_quietly(comm)
        diff = comm.bcast(diff, root=0)
    if args.trace:
        write_trace(comm, timeline, args.trace, t0)

    slowest, _ = step_summary(comm, records)
    activation = B * T * h * 4
    formula_calls, formula_bytes = 4 * L + 5, (4 * L + 2) * activation + 3 * B * T * 4
    ring = 2 * (world_size - 1) / world_size * formula_bytes
    say(comm, f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f}; a uniform guess is "
              f"ln {VOCAB} = {math.log(VOCAB):.4f})",
        f"median step {slowest['step_s'] * 1e3:.1f} ms: compute {slowest['compute_s'] * 1e3:.1f} | "
        f"comm {slowest['comm_s'] * 1e3:.1f} | idle {slowest['idle_s'] * 1e3:.1f} ms (slowest rank)",
        f"collectives per step: {sum(calls.values()):g} (f {calls.get('f', 0):g}, g {calls.get('g', 0):g}, "
        f"cross-entropy {calls.get('cross-entropy', 0):g}); formula 4L + 5 = {formula_calls}: per block "
        f"2 forward (g) + 2 backward (f), embedding g, head f, 3 for the loss",
        f"bytes per step: {sum(volume.values()):,.0f}; formula (4L + 2) x 4BTh + 3 x 4BT = "
        f"{formula_bytes:,}, of which the blocks' 4L x 4BTh = {4 * L * activation:,} (the paper's "
        f"4 allreduces of b x s x h per block); a ring moves 2(N-1)/N x that = {ring:,.0f} bytes in "
        f"and out of each rank",
        f"replicated parameters (LayerNorms, position embedding, row-parallel biases): "
        f"bitwise identical on all {world_size} ranks")
    if sample is not None:
        say(comm, f"sample ({args.sample_chars} characters after {PROMPT!r}, temperature {TEMPERATURE}):",
            *("  | " + line for line in sample.split("\n")))
    ok = diff is None or diff <= TOLERANCE
    if diff is not None:
        say(comm, f"check against single-process training: max |diff| {diff:.2e} "
                  f"(losses, parameters; tolerance {TOLERANCE:g}) -> {'PASS' if ok else 'FAIL'}")
    if args.json:
        say(comm, json.dumps({
            "strategy": STRATEGY, "world_size": world_size, "device": device.type,
            "steps": args.steps, "losses": losses, "final_loss": losses[-1],
            "step_time_s": slowest["step_s"], "compute_s": slowest["compute_s"],
            "comm_s": slowest["comm_s"], "idle_s": slowest["idle_s"],
            "comm_bytes_per_step": sum(volume.values()), "collectives_per_step": sum(calls.values()),
            "check_max_abs_diff": diff, "collectives_formula": formula_calls,
            "comm_bytes_formula": formula_bytes, "collectives_by_kind": calls, "ring_bytes_per_rank": ring,
            "parameters": full_params, "parameters_this_rank": mine, "padded_vocab": padded,
            "sample": sample}))
    return 0 if ok else 1


def abort_on_exception(kind, value, tb):
    """An exception on one rank must end the whole job, not leave the others in a collective."""
    rank = MPI.COMM_WORLD.Get_rank()
    text = "".join(traceback.format_exception(kind, value, tb))
    print(f"rank {rank}: {text}", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    sys.excepthook = abort_on_exception
    sys.exit(main())
