"""Model parallelism over MPI, the naive layer split: one rank holds each part, one works at a time.

What is split: the model's layers. Rank r holds one contiguous part of the stack, with its
parameters and their optimizer state, so a model too large for one device fits on N of them. The
whole global batch of B sequences (--batch-size, the same at every world size) goes through the
parts in turn: rank 0 runs its layers and sends the activations to rank 1, and so on to the last
rank, which computes the loss; the gradient of the activations then travels back the same way,
and every rank updates its own parameters.

   tokens  +------------+ act  +---------+ act  +---------+ act  +--------------+  loss
   ------> | rank 0     | ---> | rank 1  | ---> | rank 2  | ---> | rank 3       | ----->
           | embeddings | <--- | blocks  | <--- | blocks  | <--- | blocks, norm |
           | blocks     | grad |         | grad |         | grad | head, loss   |
           +------------+      +---------+      +---------+      +--------------+

One step for N = 4 ranks, one slot per forward (F) or backward (B) of a rank's part, '.' idle:

   rank 0 | F  .  .  .  .  .  .  B
   rank 1 | .  F  .  .  .  .  B  .
   rank 2 | .  .  F  .  .  B  .  .
   rank 3 | .  .  .  F  B  .  .  .

One rank is busy at a time: each is idle (N-1)/N of the step, and N devices train no faster
than one. That is the point to see. pipeline_parallel.py removes most of that idle time by
cutting the batch into M micro-batches that follow each other down the ranks, so that the ranks
work at once on different micro-batches: idle (N-1)/(M+N-1) instead of (N-1)/N.

Communication per step: each of the N-1 boundaries carries the batch's activations forward and
their gradient back, each B x T x H elements of e bytes (float32: e = 4; bf16: e = 2):
2(N-1) x B x T x H x e bytes in 2(N-1) point-to-point messages over all ranks, and one collective:
the Iallreduce of 4 bytes that sums the stages' squares into the gradient norm (--clip-grad).

bf16 (--precision): forward and loss under torch.autocast(dtype=torch.bfloat16), on the ranks and
in the check's one process. The parameters stay float32 (master weights; autocast casts each to bf16
as a matmul uses it), gradients, the optimizer's state and the norm land in float32; no gradient is
summed, so float32 against bf16 sums (half the bytes, rounding, no MPI bf16 sum) does not arise.
LayerNorm's input, softmax and loss in float32 (.float(): the CPU's autocast leaves them bf16). The
residual stream is bf16 from the embeddings on, as Megatron's default (--fp32-residual-connection
the other way), so what crosses a boundary is bf16 already and travels as bf16 both ways (e = 2):
a pure move, with no rounding at a cut that one process would not do. A float32 stream: e = 4.

Recomputation (--recompute): torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=True),
which keeps fn's inputs with save_for_backward (the saved-tensor hooks that measure activations
see them; the non-reentrant form keeps them where no hook counts), runs fn without autograd, and
in backward reruns it under the forward's autocast state. full: each block, its input alone kept.
selective: attention's core (scores, mask, softmax, times V, which grow with s^2), q, k, v kept
(Korthikanti et al. 2022). No block communicates, so recomputing adds a forward, not bytes.

Activations per rank, the bytes autograd saves in a forward (b, s, h, a: --batch-size, --seq-len,
--hidden, --heads; V = 128; parameters, buffers and their bf16 copies left out), measured in --json
as activation_bytes_per_rank: L_r x A_block + (r = 0)(8bs + 8s) + (r = N-1) A_head, L_r: r's blocks
  A_block: none     fp32 64bsh + 16bs + 4abs^2    bf16 36bsh + 16bs + 6abs^2
           selective     64bsh + 16bs                  36bsh + 16bs
           full          4bsh                          2bsh
  A_head:               8bsh + 16bs + 4bsV + 4        6bsh + 16bs + 4bsV + 4
fp32 per block: the LayerNorms' inputs and outputs, q, k, v, the projection's input, GELU's input
and output (16bsh floats), mean and 1/std (4bs), the softmax (abs^2); bf16: the matmuls' inputs
as bf16 copies, LayerNorms' float32 inputs, the softmax in float32 and a bf16 copy (6abs^2).
8bs + 8s: token and position indices; A_head: LayerNorm in and out, log-softmax, targets, a scalar.

When to choose it: the model, its gradients and optimizer state do not fit on one device, and
simplicity matters more than speed; otherwise pipeline_parallel.py or tensor_parallel.py.

The network: a GPT-2 style character-level language model trained on the source of Python's own
argparse.py, textwrap.py and shlex.py, read from this Python's standard library.

Run:  mpirun -np 4 python model_parallel.py            (add --help for the flags)
"""
import argparse
import collections
import contextlib
import ctypes
import errno
import functools
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

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
import mpi4py

mpi4py.rc.initialize = False  # MPI starts in start_mpi(), once this rank's GPU is chosen
mpi4py.rc.finalize = True  # and ends when the process does
from mpi4py import MPI  # noqa: E402

STRATEGY = "model_parallel"
# Largest |difference| allowed against single-process training (float32), as pipeline_parallel.py's.
# Only the gradient norm reorders a sum here (AdamW, clipped: 4.8e-7 in 3 steps, 1.4e-6 in 60), but
# ranks on another thread count or device than the reference's could, as micro-batches do there.
TOLERANCE = 2e-5
# bf16, both sides: 0 at N = 1..4 too; threads alone part the reference by 3.9e-4 in 5 steps (a float32
# rounding that crosses a bf16 boundary), which AdamW grows where a gradient is mostly rounding (docs/
# results.md): 60 steps, clip 1, cosine, 6.0e-3 to 8.3e-3 on AVX-512 BF16. The 1/N plant: 13x above.
TOLERANCE_BF16 = 2e-2
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text
VOCAB = 128  # the ASCII codes
POLL_S = 1e-4  # a rank waiting on MPI sleeps between polls and leaves the core to ranks that compute


# -----------------------------------------------------------------------------
# The strategy: forward down the ranks, backward back up, one rank at work at a time
# -----------------------------------------------------------------------------
TAGS = {"act": 1, "grad": 2}  # far below 32767, the least MPI_TAG_UB that MPI allows


def train_step(stage, optimizer, x, y, shapes, comm, timeline, precision="fp32",
               saved=contextlib.nullcontext(), max_norm=0.0):
    """One optimizer step on the whole batch, the gradients clipped to the global norm max_norm
    (0: not clipped). Returns the loss on the last rank, elsewhere 0, and the global gradient norm.
    The forward and the loss under autocast in bf16 (backward follows the forward's casts); `saved`
    measures what the forward keeps for backward (SavedActivations, below the divider).
    While one rank computes, every other rank waits for its activations or its gradient.
    Each receive is an Irecv and a Wait, not a Recv: comm counts and times the calls (below the
    divider), and its Wait sleeps between polls, so that a waiting rank leaves its core to the
    one that computes (MPICH's blocking Recv spins on it). mpi_receive_buffer, mpi_buffer and
    from_mpi (after agree_shapes) stage GPU tensors for an MPI that cannot read GPU memory."""
    rank, n = comm.Get_rank(), comm.Get_size()
    optimizer.zero_grad()  # no gradient memory until backward makes it, while the activations peak
    valid = valid_targets(y) if rank == n - 1 else 0  # the loss's divisor, counted here
    inp = x
    if rank > 0:  # idle until the previous rank's activations are in
        inp = torch.empty(shapes["act"][0], dtype=shapes["act"][1], device=x.device)
        buffer = mpi_receive_buffer(inp)
        comm.Irecv(buffer, source=rank - 1, tag=TAGS["act"]).Wait()
        inp = from_mpi(inp, buffer).requires_grad_()
    with timeline.span("compute", "F"), autocast(x.device, precision), saved:
        out = stage(inp)  # the activations; on the last rank the logits, and then the loss (float32)
        loss = F.cross_entropy(out.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE,
                               reduction="sum") / valid if rank == n - 1 else None
    grad = None
    if rank < n - 1:
        grad = torch.empty(shapes["grad"][0], dtype=shapes["grad"][1], device=x.device)
        buffer = mpi_receive_buffer(grad)
        receive = comm.Irecv(buffer, source=rank + 1, tag=TAGS["grad"])  # posted first: ready for the answer
        sent = mpi_buffer(out.detach())  # held until the send is done: MPI reads it meanwhile
        comm.Isend(sent, dest=rank + 1, tag=TAGS["act"]).Wait()
        receive.Wait()
        from_mpi(grad, buffer)
    with timeline.span("compute", "B"):
        if loss is not None:
            loss.backward()
        else:
            out.backward(grad)
    if rank > 0:
        sent = mpi_buffer(inp.grad.contiguous())
        comm.Isend(sent, dest=rank - 1, tag=TAGS["grad"]).Wait()
    norm = clip_global_norm(stage, max_norm, comm)  # after every stage's backward, before any step
    with timeline.span("compute", "optimizer"):
        optimizer.step()
    return loss.item() if loss is not None else 0.0, norm


def valid_targets(y):
    """How many targets of y count in the loss: with --ragged, those before their document's end
    (not IGNORE). The loss of a step is the cross-entropy summed over them divided by their count.
    The last rank holds every target of the batch, so it counts them itself, with no exchange. A
    mean per sequence would weigh a token of a short document more than one of a long one: another
    gradient than one process's."""
    return int((y != IGNORE).sum())


def clip_global_norm(stage, max_norm, comm):
    """The norm of the whole model's gradient, the same on every rank, and the gradients scaled by
    max_norm / (norm + 1e-6) where that is below 1, as torch.nn.utils.clip_grad_norm_ does in one
    process (max_norm 0: measured, not clipped). No rank holds the whole gradient, but each
    parameter lives on exactly one rank, so the squares add up stage by stage, each counted once:
        |g|^2 = sum over the ranks r of ( sum over the parameters p of r's stage of sum(g_p^2) )
    Each rank adds its own stage's squares; one Iallreduce over comm, all ranks (each holds
    distinct parameters, none a replica), sums the N partial sums; every rank takes the square
    root: the same norm, the same clip factor. An Iallreduce and a Wait, as the receives above: a
    rank done with its backward waits there for rank 0's, napping between polls. float32
    throughout; on a GPU the one float goes to MPI as a host copy."""
    squares = sum(p.grad.square().sum() for p in stage.parameters()).reshape(1)  # this stage's part
    buffer = mpi_buffer(squares, nonblocking=True)
    comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM).Wait()  # + every other stage's: the whole
    norm = from_mpi(squares, buffer).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if max_norm > 0 and scale < 1:
        for p in stage.parameters():
            p.grad.mul_(scale)
    return norm.item()


def autocast(device, precision):
    """bf16: the matmuls in bfloat16 on float32 weights (the master weights); fp32: nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def agree_shapes(stage, comm, batch, seq_len, device, precision="fp32"):
    """Before training, each stage learns what it will receive: rank r runs its stage on a probe of
    its input and tells rank r+1 the shape and dtype of its output (metadata: pickled is fine, with
    tag 0, which the step's messages never use). Returns (shape, dtype) of the activations this rank
    receives and of the gradients."""
    rank, n = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        probe = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    else:
        shape, dtype = comm.recv(source=rank - 1, tag=0)
        probe = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    with torch.no_grad(), autocast(device, precision):
        out = stage(probe)
    if rank < n - 1:
        comm.send((tuple(out.shape), str(out.dtype).removeprefix("torch.")), dest=rank + 1, tag=0)
    return {"act": (probe.shape, probe.dtype), "grad": (out.shape, out.dtype)}


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


def mpi_receive_buffer(t):
    """Where MPI writes what t is to hold: t itself, or an empty pinned host buffer (from_mpi
    copies it back). t is fresh from PyTorch's caching allocator, whose memory kernels still
    queued on the stream may read (a tensor freed a moment ago): MPI writes outside the stream,
    so those kernels must finish first (an event, not the whole device)."""
    if not t.is_cuda:
        return t
    if CUDA_AWARE:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def from_mpi(t, buffer):
    """Copy back what MPI wrote into a host copy (mpi_buffer's, mpi_receive_buffer's) to t; returns t."""
    if buffer is not t:
        t.copy_(buffer)
    return t


# -----------------------------------------------------------------------------
# Model: a GPT-2 style character-level language model, built whole, then cut into stages
# -----------------------------------------------------------------------------
def attention_core(q, k, v, future):
    """Scores, mask, softmax, times V: the part whose activations grow with the sequence squared.
    The softmax in float32 (under autocast on the CPU it would stay in the scores' bf16)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    weights = scores.float().masked_fill(future, float("-inf")).softmax(dim=-1)
    return weights @ v


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and the positions before it.
    recompute "selective": the core is recomputed in backward; only q, k and v are kept."""

    def __init__(self, hidden, heads, seq_len, recompute="none"):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.register_buffer("future", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1),
                             persistent=False)
        self.recompute = recompute

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        if self.recompute == "selective" and torch.is_grad_enabled():
            y = checkpoint(attention_core, q, k, v, self.future[:t, :t], use_reentrant=True)
        else:
            y = attention_core(q, k, v, self.future[:t, :t])
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm decoder block. GELU and LayerNorm keep training a smooth function of the
    weights, so that float32 rounding differences between world sizes stay at rounding level.
    LayerNorm takes its input in float32 (its statistics; in bf16 the stream is bf16).
    recompute "full": the whole block is recomputed in backward; only its input is kept."""

    def __init__(self, hidden, heads, seq_len, recompute="none"):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), CausalSelfAttention(hidden, heads, seq_len, recompute)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.recompute = recompute

    def forward(self, x):
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self.layers, x, use_reentrant=True)
        return self.layers(x)

    def layers(self, x):
        x = x + self.attn(self.ln1(x.float()))
        return x + self.mlp(self.ln2(x.float()))


class Embedding(nn.Module):
    """Token plus learned position embedding: what the first stage holds besides its blocks.
    Under bf16 autocast it starts the residual stream in bf16, as Megatron keeps it: the blocks'
    sums then stay bf16, and so do the activations that cross from stage to stage."""

    def __init__(self, hidden, seq_len):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(seq_len, hidden)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.size(1), device=idx.device))
        kind = idx.device.type
        return x.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else x


class Head(nn.Module):
    """Final LayerNorm and the untied language-model head: what the last stage holds besides."""

    def __init__(self, hidden):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, x):
        return self.out(self.norm(x.float()))


def build_model(args, recompute="none"):
    """The full model from the seed, on the CPU: the same network at every world size (GPT-2's
    init). One nn.Sequential of embeddings, blocks and head, so that a stage is a slice of it."""
    torch.manual_seed(args.seed)
    model = nn.Sequential(Embedding(args.hidden, args.seq_len),
                          *(Block(args.hidden, args.heads, args.seq_len, recompute) for _ in range(args.layers)),
                          Head(args.hidden))
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return model


def layer_split(layers, n):
    """Blocks [lo, hi) of each rank, as even as can be. The extra blocks go to the first ranks:
    the last also runs the head and the loss, while the embeddings cost next to nothing."""
    sizes = [layers // n + (r < layers % n) for r in range(n)]
    return [(sum(sizes[:r]), sum(sizes[:r + 1])) for r in range(n)]


def stage_of(model, rank, n):
    """This rank's slice of the full model: its blocks, with the embeddings first, the head last."""
    lo, hi = layer_split(len(model) - 2, n)[rank]
    return model[0 if rank == 0 else lo + 1:len(model) if rank == n - 1 else hi + 1]


def build_stage(args, rank, n, device):
    """This rank's stage alone on its device. The whole model is built on the CPU, so that the seed
    gives the same weights at every world size, and the other stages' layers are freed on return:
    no rank keeps the full model, and no device ever holds more than its stage."""
    return stage_of(build_model(args, args.recompute), rank, n).to(device)


def model_config(args):
    """The network a checkpoint's shards belong to."""
    return {"model": "GPT", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "seq_len": args.seq_len, "vocab": VOCAB}


def describe_split(layers, n):
    return " | ".join(f"rank {r}: " + "embeddings + " * (r == 0) +
                      (f"block {lo}" if hi - lo == 1 else f"blocks {lo}-{hi - 1}") +
                      " + norm, head, loss" * (r == n - 1)
                      for r, (lo, hi) in enumerate(layer_split(layers, n)))


def activation_bytes(args, rank, n):
    """The docstring's formula: the bytes rank r's forward keeps for backward (its L_r blocks, the
    embeddings' indices on rank 0, the head and the loss on the last rank)."""
    b, s, h, a = args.batch_size, args.seq_len, args.hidden, args.heads
    bf16 = args.precision == "bf16"
    block = {"none": (36 if bf16 else 64) * b * s * h + 16 * b * s + (6 if bf16 else 4) * a * b * s * s,
             "selective": (36 if bf16 else 64) * b * s * h + 16 * b * s,
             "full": (2 if bf16 else 4) * b * s * h}[args.recompute]
    lo, hi = layer_split(args.layers, n)[rank]
    head = (6 if bf16 else 8) * b * s * h + 16 * b * s + 4 * b * s * VOCAB + 4
    return (hi - lo) * block + (rank == 0) * (8 * b * s + 8 * s) + (rank == n - 1) * head


# -----------------------------------------------------------------------------
# Data: the characters of Python's own source; each batch a function of (seed, step)
# -----------------------------------------------------------------------------
IGNORE = -100  # a target past its document's end (--ragged): F.cross_entropy's ignore_index


@functools.cache
def load_text():
    """argparse.py, textwrap.py and shlex.py of this Python, every byte >= 128 made '?'."""
    raw = b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in SOURCES)
    return torch.tensor([b if b < 128 else ord("?") for b in raw], dtype=torch.long)


def make_batch(seed, step, size, seq_len, ragged=False):
    """The global batch of one step: inputs and next-character targets, from (seed, step) alone.
    ragged: after the starts, the same generator draws each sequence's document length (1 to
    seq_len); past it the targets are IGNORE and the inputs 0. Without it nothing more is drawn."""
    data = load_text()
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - seq_len - 1, (size,), generator=g).tolist()
    x = torch.stack([data[o:o + seq_len] for o in starts])
    y = torch.stack([data[o + 1:o + seq_len + 1] for o in starts])
    if ragged:
        lengths = torch.randint(1, seq_len + 1, (size,), generator=g)
        past = torch.arange(seq_len) >= lengths[:, None]  # the positions after each document's end
        x, y = x.masked_fill(past, 0), y.masked_fill(past, IGNORE)
    return x, y


# -----------------------------------------------------------------------------
# The run: the step loop, and main() as a table of contents
# -----------------------------------------------------------------------------
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1  # --optimizer adamw: AdamW's, on every parameter


def make_optimizer(args, parameters):
    """--optimizer: SGD with momentum 0.9, or AdamW (float32 moments, decay on every parameter)."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(parameters, args.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return torch.optim.SGD(parameters, lr=args.lr, momentum=0.9)


def learning_rate(args, step):
    """The learning rate of `step` (from 0), a function of the step alone, so that a resumed run
    goes on where it stopped: a linear warm-up over --warmup-steps, then --lr, or a cosine from --lr
    down to --lr / 10."""
    lr, warmup = args.lr, args.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if args.lr_schedule == "constant":
        return lr
    min_lr, progress = lr / 10, (step - warmup) / max(1, args.steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def train(args, comm, counted, device, stage, optimizer, shapes, timeline, saved, past=None):
    """The steps after the `past` ones (a checkpoint's state: their losses and gradient norms).
    Returns the losses of the new steps (0 but on the last rank), their gradient norms, their
    timings, and when the last step began and ended on the timeline's clock. The step talks
    through `counted`, the communicator that counts; the rest through comm."""
    past = past or {"losses": [], "grad_norms": []}
    losses, norms, records, window = [], [], [], (0.0, 0.0)
    for step in range(len(past["losses"]), args.steps):
        start = time.perf_counter()
        batch = make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged)
        x, y = (t.to(device) for t in batch)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        loss, norm = train_step(stage, optimizer, x, y, shapes, counted, timeline, args.precision,
                                saved, args.clip_grad)
        losses.append(loss)
        norms.append(norm)
        records.append(timeline.step_record(start))
        window = (start - timeline.origin_s, start - timeline.origin_s + records[-1]["step_s"])
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            loss = comm.bcast(losses[-1], root=comm.Get_size() - 1)  # reporting only, not counted
            print_progress(comm, args, step, loss, records[-1], norm)
        so_far = lambda: {"losses": past["losses"] + losses, "grad_norms": past["grad_norms"] + norms}
        checkpoint_if_due(comm, args, step, lambda: stage_shard(comm, stage, optimizer, so_far()),
                          model_config(args))
    return losses, norms, records, window


def all_losses(comm, losses):
    """The last rank computed the losses; every rank gets them."""
    values = torch.tensor(losses, dtype=torch.float64)
    comm.Bcast(values, root=comm.Get_size() - 1)
    return values.tolist()


# Checkpoints: rank r writes what it holds, its stage's parameters and their optimizer state, each
# tensor whole under the whole model's name, not by rank (a slice of the nn.Sequential keeps its
# indices: 3.attn.qkv.weight is block 2 on whichever rank holds it, momentum/3.attn.qkv.weight
# its SGD momentum, exp_avg/ and exp_avg_sq/3.attn.qkv.weight its AdamW moments); the last rank,
# which computes the losses, adds them, the gradient norms and AdamW's step count. A resume on M
# ranks cuts layer_split(L, M) afresh: each rank asks for the names of its new stage, wherever the
# old split put them, and reads only the files that hold them. The learning rate is the step's.
MOMENTS = {torch.optim.SGD: {"momentum": "momentum_buffer"},  # a checkpoint's prefix: the state's key
           torch.optim.AdamW: {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}


def stage_shard(comm, stage, optimizer, so_far):
    """What this rank saves: each tensor of its stage and its optimizer state, whole (see piece());
    the last rank adds so_far, the losses (elsewhere zeros) and norms so far, and AdamW's step
    count, as the checkpoint's state."""
    pieces = {name: piece(t) for name, t in stage.state_dict().items()}
    pieces.update({f"{kind}/{name}": piece(optimizer.state[p][key]) for name, p in stage.named_parameters()
                   for kind, key in MOMENTS[type(optimizer)].items() if key in optimizer.state[p]})
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]  # AdamW's
    state = {**so_far, **({"adam_step": steps[0]} if steps else {})}
    return pieces, state if comm.Get_rank() == comm.Get_size() - 1 else None


def stage_regions(stage, optimizer):
    """What this rank asks a checkpoint for, whatever split wrote it: every tensor of its stage on
    this run's split and that tensor's optimizer state, each whole."""
    shapes = {name: t.shape for name, t in stage.state_dict().items()}
    shapes.update({f"{kind}/{name}": p.shape for name, p in stage.named_parameters()
                   for kind in MOMENTS[type(optimizer)]})
    return {key: region(shape) for key, shape in shapes.items()}


def restore_stage(stage, optimizer, manifest, blocks):
    """Load the blocks stage_regions asked for into the stage and its optimizer; returns the losses
    and gradient norms of the steps the checkpoint trained."""
    stage.load_state_dict({name: blocks[name] for name in stage.state_dict()})
    state = manifest["state"]
    for name, p in stage.named_parameters():
        optimizer.state[p].update({key: blocks[f"{kind}/{name}"].to(p.device)
                                   for kind, key in MOMENTS[type(optimizer)].items()})
        if "adam_step" in state:
            optimizer.state[p]["step"] = torch.tensor(float(state["adam_step"]))
    return {"losses": state["losses"], "grad_norms": state["grad_norms"]}


def main(argv=None, comm=MPI.COMM_WORLD):
    """Parse, set up, train, check, report. Returns the exit status of this rank."""
    try:
        args = parse_args(argv, comm.Get_size())
        check_paths(comm, args)
        run = setup(comm, args)
        counted = CountedComm(comm, run.timeline)
        rank, n = comm.Get_rank(), comm.Get_size()
        stage = build_stage(args, rank, n, run.device)  # cut from the whole built on the CPU; the rest freed
        optimizer = make_optimizer(args, stage.parameters())
        past, resumed = {"losses": [], "grad_norms": []}, None
        if args.resume:
            resumed, blocks = load_checkpoint(comm, args.save, model_config(args),
                                              lambda manifest: stage_regions(stage, optimizer), args.steps)
            if blocks is not None:  # this run's split, whatever split wrote the checkpoint
                past = restore_stage(stage, optimizer, resumed, blocks)
        shapes = agree_shapes(stage, comm, args.batch_size, args.seq_len, run.device, args.precision)
        print_header(comm, args, run, stage, shapes, resumed)
        counted.reset()  # count the training steps only
        run.memory.reset()  # the peak of training alone: not the model's building, nor the check
        saved = SavedActivations(stage)  # what each step's forward keeps for backward, measured
        losses, norms, records, window = train(args, comm, counted, run.device, stage, optimizer,
                                               shapes, run.timeline, saved, past)
        run.memory.stop()
    except ConfigError as e:
        print0(comm, f"error: {e}", file=sys.stderr)
        return e.status
    losses, norms = past["losses"] + all_losses(comm, losses), past["grad_norms"] + norms  # every rank's
    diff = check(comm, args, losses, norms, stage, device=run.device) if args.check else None
    if args.trace:
        write_trace(comm, run.timeline, args.trace)
    return report(comm, args, run, stage, optimizer, losses, norms, records, counted, diff, window, saved)


# =============================================================================
# You may stop reading here: the strategy is all above. Below, first this file's own machinery
# (the check against single-process training, the report, its arguments), then the machinery
# that every strategy file repeats word for word: the summary, checkpoints and signals,
# counters, timeline and memory, device and MPI setup, arguments.
# =============================================================================

# --- This file's own: the check against single-process training, the report, arguments
class SavedActivations:
    """Around a forward: the bytes of the distinct storages autograd saves for backward, that is
    the activations (a view and its base, or one tensor saved twice, count once). Left out: the
    stage's parameters and buffers, and the bf16 copies autocast makes of parameters (the model's
    memory, not the batch's), known by their grad_fn: ToCopyBackward0 whose next function is a
    parameter's AccumulateGrad (or a view of such a copy). self.bytes: the first forward's (every
    step saves alike; the hooks cost time, so later steps run without them)."""

    def __init__(self, module):
        self.params = {id(p) for p in module.parameters()}
        self.model = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
        self.bytes, self.storages, self.hooks = 0, {}, None

    def __enter__(self):
        self.storages = {}
        self.hooks = contextlib.nullcontext() if self.bytes else torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()

    def pack(self, t):
        storage, fn = t.untyped_storage(), t.grad_fn
        while type(fn).__name__ in ("TBackward0", "ViewBackward0", "TransposeBackward0"):
            fn = fn.next_functions[0][0]  # a matmul saves the copy's transpose: back to the copy
        copied = (type(fn).__name__ == "ToCopyBackward0"
                  and id(getattr(fn.next_functions[0][0], "variable", None)) in self.params)
        if storage.data_ptr() not in self.model and not copied:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self.bytes = self.bytes or sum(self.storages.values())

CHECK_TAG = 3  # the stages' parameters sent to rank 0 for the check; the step's messages use 1 and 2


# What the reference shares with the ranks, and why each is harmless: build_model and its classes
# (the network), make_batch (with --ragged its IGNORE targets), autocast, torch's SGD and AdamW
# (AdamW's BETAS, EPS, WEIGHT_DECAY) and F.cross_entropy. Its own: the whole model on the whole
# batch, no stage and no message; the loss as F.cross_entropy's own mean over the valid targets (the
# ranks: a sum divided by valid_targets' count); the schedule written out step by step; the norm and
# the clip by torch.nn.utils.clip_grad_norm_, which returns the norm. stage_of only cuts the trained
# reference to compare each rank's stage with its part; the losses, from the uncut model, show a
# split that drops or repeats a layer.
def reference_training(args, device=torch.device("cpu")):
    """The same steps in one plain process on `device` (rank 0's): the unsplit model, built on the CPU
    from the seed and moved there, on the whole batch at once. Returns the losses, the trained model
    and the gradient norms."""
    model, lr, warmup = build_model(args).to(device), args.lr, args.warmup_steps
    optimizer = (torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
                 if args.optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    decay = [lr if args.lr_schedule == "constant" else lr / 10 + 0.5 * (lr - lr / 10) * (
        1 + math.cos(math.pi * k / max(1, args.steps - warmup))) for k in range(args.steps - warmup)]
    schedule = [lr * (k + 1) / warmup for k in range(warmup)] + decay
    losses, norms = [], []
    for step in range(args.steps):
        x, y = (t.to(device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged))
        optimizer.zero_grad()
        with autocast(device, args.precision):  # the mean over the valid targets, as F.cross_entropy takes it
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or math.inf).item())
        optimizer.param_groups[0]["lr"] = schedule[step]
        optimizer.step()
        losses.append(loss.item())
    return losses, model, norms

# The gradient norms count as the losses do, but as |norm - reference| / max(reference, 1): bf16
# rounds a norm in proportion to its size (a norm of 2.97 came 1.7e-2 apart, 0.6%, in model_parallel.py's
# 60 default steps with AdamW at N = 1; docs/results.md, "The recipe at each file's default sizes").
def check(comm, args, losses, norms, stage, reference=None, device=torch.device("cpu")):
    """Rank 0 trains the reference on its device (or takes `reference`, its losses, model and norms)
    and compares the losses, the gradient norms and every stage, which each rank sends it in turn:
    no other rank holds more than its stage. Every rank gets the largest difference."""
    diff = None
    if comm.Get_rank() == 0:
        ref_losses, ref_model, ref_norms = reference or reference_training(args, device)
        scaled = [(n / max(r, 1), r / max(r, 1)) for n, r in zip(norms, ref_norms)]  # the norms: relative (above)
        losses, ref_losses = losses + [n for n, _ in scaled], ref_losses + [r for _, r in scaled]
        diff = max_difference(losses, stage.state_dict(), ref_losses, ref_model)
        for r in range(1, comm.Get_size()):
            part = stage_of(ref_model, r, comm.Get_size()).state_dict()  # r's part of the reference
            state = {name: torch.empty_like(t, device="cpu") for name, t in part.items()}  # MPI fills host memory
            for t in state.values():
                comm.Recv(t, source=r, tag=CHECK_TAG)
            diff = max(diff, max_difference(losses, state, ref_losses, ref_model))
    else:
        for t in stage.state_dict().values():
            buffer = t.detach().cpu().contiguous()
            request = comm.Isend(buffer, dest=0, tag=CHECK_TAG)
            while not request.Test():  # rank 0 trains the reference meanwhile: leave it the core
                time.sleep(POLL_S)
    return comm.bcast(diff, root=0)

def print_header(comm, args, run, stage, shapes, resumed):
    n, stage_params = comm.Get_size(), comm.allgather(sum(p.numel() for p in stage.parameters()))
    params = sum(stage_params)
    if resumed:
        print0(comm, f"resumed from {args.save} at step {resumed['step']} "
                     f"(written by {resumed['world_size']} ranks)")
    print0(comm, *run.header,
           f"model: GPT, {args.layers} blocks x {args.hidden} hidden x {args.heads} heads, {params:,} "
           f"parameters ({4 * params / 1e6:.2f} MB) | text: {' + '.join(s + '.py' for s in SOURCES)}, "
           f"{len(load_text()):,} characters",
           f"stages: {describe_split(args.layers, n)} | parameters per rank: "
           f"{' '.join(f'{k:,}' for k in stage_params)}",
           f"global batch {args.batch_size} sequences of {args.seq_len} characters"
           + (f" (--ragged: documents of 1 to {args.seq_len}, the loss a mean over their targets)"
              if args.ragged else "")
           + f", all through every "
           f"rank in turn | between stages: {list(shapes['grad'][0]) if n > 1 else 'nothing'} "
           f"{str(shapes['grad'][1]).removeprefix('torch.') if n > 1 else ''}".rstrip(),
           f"{args.optimizer}, lr {args.lr:g}, {args.lr_schedule} after {args.warmup_steps} warm-up step(s) | "
           + (f"gradients clipped to a global norm of {args.clip_grad:g}" if args.clip_grad else "no clipping"))

def report(comm, args, run, stage, optimizer, losses, norms, records, counted, diff, window, saved):
    """The timelines, the busy share, memory and messages, the overlap; then finish() (the split of
    a step, the verdict, --json). Returns the exit status."""
    n, steps_run = comm.Get_size(), max(1, len(records))
    messages, sent = (comm.allreduce(count["Isend"] / steps_run) for count in (counted.calls, counted.bytes))
    collectives, summed = counted.calls["Iallreduce"] / steps_run, counted.bytes["Iallreduce"] / steps_run
    ideal = [[("F", r, r + 1), ("B", 2 * n - 1 - r, 2 * n - r)] for r in range(n)]  # one slot each
    measured = measured_timeline(comm, run.timeline, window, 2, 4 * n)
    later = records[1:] or records
    busy = comm.allgather(statistics.median(r["compute_s"] / r["step_s"] for r in later))
    # The norm's Iallreduce (comm) waits for rank 0's backward: waiting for a peer too, as a receive does.
    waits = comm.allgather(statistics.median((r["wait_s"] + r["comm_s"]) / r["step_s"] for r in later))
    # What each rank holds after training: its parameters, their gradients, the optimizer's state.
    param_bytes = comm.allgather(sum(p.numel() * p.element_size() for p in stage.parameters()))
    grad_bytes = comm.allgather(sum(p.grad.numel() * p.grad.element_size() for p in stage.parameters()
                                    if p.grad is not None))
    state_bytes = comm.allgather(sum(t.numel() * t.element_size() for s in optimizer.state.values()
                                     for t in s.values() if torch.is_tensor(t)))
    moments = len(MOMENTS[type(optimizer)])  # SGD's momentum, or AdamW's two moments
    held = [sum(b) for b in zip(param_bytes, grad_bytes, state_bytes)]
    one_process = (2 + moments) * sum(param_bytes)
    e = 2 if args.precision == "bf16" else 4  # bytes per element of what crosses a boundary
    formula = 2 * (n - 1) * args.batch_size * args.seq_len * args.hidden * e
    kept, predicted = comm.allgather(saved.bytes), [activation_bytes(args, r, n) for r in range(n)]
    idle, m = statistics.mean(waits), 8  # m: pipeline_parallel.py's default micro-batches
    in_flight = [comm.allreduce(c) for c in sends_in_flight(run.timeline.step_events)]  # over the ranks: not counted
    lines = [f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f})",
             f"ideal timeline (one slot per forward F or backward B of a rank's layers, '.': idle) | "
             f"busy 1/N = {100 / n:.0f}% of the step on every rank:",
             *draw_timeline(ideal, 2 * n, 2 * n, 3),
             "measured timeline (the last step; o: optimizer, '.': waiting for a peer or communicating):",
             *measured,
             f"share of the step per rank: busy {' '.join(f'{100 * b:.0f}%' for b in busy)} | waiting for a "
             f"peer {' '.join(f'{100 * w:.0f}%' for w in waits)} | ideal: busy 1/N = {100 / n:.0f}%, idle "
             f"(N-1)/N = {100 * (n - 1) / n:.0f}%",
             "memory per rank: stage states (live tensors after training: parameters, gradients, "
             + ("SGD's momentum) " if moments == 1 else "AdamW's moments) ")
             + " | ".join(f"{h / 1e6:.2f} MB ({100 * h / one_process:.0f}%)" for h in held)
             + f" of the {one_process / 1e6:.2f} MB one process holds; measured peak "
             + " | ".join(f"{b / 1e6:.2f}" for b in comm.allgather(run.memory.bytes))
             + " MB: the states, the batch's activations, and the process's working memory",
             f"point-to-point: {messages:g} messages, {sent:,.0f} bytes/step over all ranks; "
             f"2(N-1) x B x T x H x {e} = {formula:,} | collectives: {collectives:g} Iallreduce of {summed:g} "
             f"bytes per step, the global gradient norm (last {norms[-1]:.4f})",
             f"activations kept for backward (--recompute {args.recompute}), measured per rank: "
             f"{' | '.join(f'{k:,}' for k in kept)} bytes; the docstring's formula: "
             f"{' | '.join(f'{k:,}' for k in predicted)}",
             f"pipeline_parallel.py cuts the batch into M micro-batches so that the ranks work at once: "
             f"with N = {n} and M = {m}, idle (N-1)/(M+N-1) = {100 * (n - 1) / (m + n - 1):.0f}% of the step "
             f"instead of (N-1)/N = {100 * (n - 1) / n:.0f}% here (measured: {100 * idle:.0f}% waiting); "
             f"mpirun -np {n} python pipeline_parallel.py measures it" if n > 1 else
             "one rank holds the whole model and never waits: there is no idle time for a pipeline to remove"]
    return finish(comm, args, run, losses, records, diff, "losses, gradient norms, parameters", lines, {
        "comm_bytes_per_step": sent, "collectives_per_step": collectives, "messages_per_step": messages,
        "collective_bytes_per_step": summed, "grad_norms": norms,
        "layer_split": layer_split(args.layers, n), "stage_params": [b // 4 for b in param_bytes],
        "busy_fraction": busy, "idle_fraction": waits, "busy_fraction_ideal": 1 / n,
        "param_bytes": param_bytes, "grad_bytes": grad_bytes, "optimizer_state_bytes": state_bytes,
        "single_process_bytes": one_process, "activation_bytes_per_rank": kept,
        "activation_bytes_formula": predicted, "overlap": {"sends_in_flight_during_compute": in_flight}})

def draw_timeline(rows, length, columns, width):
    """One line per rank, [0, length) cut into equal cells: a cell shows the span over its middle,
    else '.' (idle or communicating); a span too short to cover a middle shows in its cell if free."""
    lines, cell = [], length / columns
    for r, spans in enumerate(rows):
        cells, short = ["."] * columns, []
        for name, s, e in spans:
            covered = range(math.ceil(s / cell - 0.5), min(columns, math.ceil(e / cell - 0.5)))
            for c in covered:
                cells[c] = name
            if not covered:
                short.append((name, min(columns - 1, int((s + e) / 2 / cell))))
        for name, c in short:
            cells[c] = name if cells[c] == "." else cells[c]
        lines.append(f"rank {r} | " + "".join(c.ljust(width) for c in cells).rstrip())
    return lines

def measured_timeline(comm, timeline, window, width, most):
    """The last step as every rank lived it (on the timeline's clock, zero at the barrier of
    setup), from rank 0's start, which runs the first forward, to the end of the last rank to
    finish. A cell lasts a typical forward, the fastest rank's median, so a backward shows twice."""
    ends = comm.allgather(window)
    first, last = ends[0][0], max(e for _, e in ends)
    rows = comm.gather([("o" if name == "optimizer" else name, max(0.0, s - first), e - first)
                        for name, cat, s, e in timeline.events if cat == "compute" and s >= window[0]], root=0)
    if comm.Get_rank() != 0:
        return []
    forward = min(statistics.median([e - s for name, s, e in row if name[0] == "F"] or [last - first])
                  for row in rows)
    columns = max(1, min(most, round((last - first) / forward)))
    return draw_timeline(rows, last - first, columns, width) + \
        [f"         one cell {(last - first) / columns * 1e3:.2f} ms, the step {(last - first) * 1e3:.1f} ms"]

def sends_in_flight(events):
    """overlap's sends_in_flight_during_compute in the step of `events` (this rank's timeline), as
    [n, total]. A send is in flight from its Isend until the rank next blocks in a Wait on a send
    (a Test, which never blocks, does not end it); n: the sends in whose flight a forward or a backward
    began, that is, the rank computed instead of waiting for them. The lesson decides it, not the library's speed: here 0 of every
    send, since each hand-off is waited for before the rank computes again (one rank busy at a
    time); a pipeline computes in its sends' flight instead."""
    compute = [b for name, cat, b, _ in events if cat == "compute" and name != "optimizer"]
    waits = sorted(b for name, _, b, _ in events if name == "Isend wait") + [math.inf]
    flights = [(b, next(w for w in waits if w >= b)) for name, _, b, _ in events if name == "Isend"]
    return [sum(any(lo <= c < hi for c in compute) for lo, hi in flights), len(flights)]

def parse_args(argv, world_size):
    p = common_arguments("Model parallelism over MPI: a small GPT on Python's own source.",
                         steps=60, batch_size=16, lr=1e-3, log_every=20)
    p.add_argument("--layers", type=COUNT, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=COUNT, default=64, help="hidden size")
    p.add_argument("--heads", type=COUNT, default=4, help="attention heads")
    p.add_argument("--seq-len", type=COUNT, default=64, help="characters per sequence")
    p.add_argument("--optimizer", default="adamw", choices=("sgd", "adamw"),
                   help="sgd: momentum 0.9; adamw: betas (0.9, 0.95), eps 1e-8, weight decay 0.1 (wants a far "
                        "smaller --lr than SGD, e.g. 1e-3)")
    p.add_argument("--lr-schedule", default="cosine", choices=("constant", "cosine"),
                   help="after the warm-up: --lr throughout, or a cosine from --lr down to --lr / 10 (reached a "
                        "step after the last)")
    p.add_argument("--warmup-steps", type=COUNT_OR_0, help="linear warm-up: step k at --lr x (k+1) / W (default: --steps / 10)")
    p.add_argument("--clip-grad", type=checked(float, lambda v: 0 <= v < math.inf, "a number, 0 or more"),
                   default=1.0, metavar="MAX_NORM", help="clip the global gradient norm to MAX_NORM (0: off)")
    p.add_argument("--ragged", action="store_true",
                   help="documents of uneven length: each sequence ends at a drawn length, the targets past it ignored")
    args = check_common(p.parse_args(argv))
    args.warmup_steps = args.steps // 10 if args.warmup_steps is None else args.warmup_steps  # a tenth by default
    if args.warmup_steps >= args.steps:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} leaves none of the {args.steps} steps after the "
                          f"warm-up; use at most {args.steps - 1}, or more --steps")
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} does not split into {args.heads} heads; use a "
                          f"multiple of {args.heads}, or --heads that divides {args.hidden}")
    if args.seq_len > len(load_text()) - 2:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the text; use at most "
                          f"{len(load_text()) - 2}")
    if args.layers < world_size:
        raise ConfigError(f"--layers {args.layers} cannot fill {world_size} stages, one per rank; "
                          f"use --layers {world_size} or more, or at most {args.layers} ranks")
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
