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
their gradient back, each B x T x H float32: 2(N-1) x B x T x H x 4 bytes in 2(N-1) point-to-point
messages over all ranks, and no collective (each rank updates only its own parameters).

When to choose it: the model, its gradients and optimizer state do not fit on one device, and
simplicity matters more than speed; otherwise pipeline it (pipeline_parallel.py) or split each
layer (tensor_parallel.py).

The network: a GPT-2 style character-level language model trained on the source of Python's own
argparse.py, textwrap.py and shlex.py, read from this Python's standard library.

Run:  mpirun -np 4 python model_parallel.py            (add --help for the flags)
"""
import argparse
import collections
import contextlib
import functools
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

import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

STRATEGY = "model_parallel"
# Largest |difference| allowed against single-process training (float32): the same as in
# pipeline_parallel.py. Nothing here reorders a sum (0 measured at N = 1..4 on one machine), but
# ranks with another thread count or device than the reference's could, as micro-batches do there.
TOLERANCE = 2e-5
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text
VOCAB = 128  # the ASCII codes
POLL_S = 1e-4  # a rank waiting for a peer sleeps between polls and leaves the core to ranks that compute


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
    p = Parser(description="Model parallelism over MPI: a small GPT on Python's own source.")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16,
                   help="global batch: samples per optimizer step, whatever the world size")
    p.add_argument("--lr", type=float, default=0.2, help="learning rate (SGD, momentum 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--log-every", type=int, default=20, help="rank 0 prints progress every N steps")
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
    args = p.parse_args(argv)

    for name in ("steps", "batch_size", "log_every", "layers", "hidden", "heads", "seq_len"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, "
                              f"got {getattr(args, name)}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ConfigError(f"--lr must be a positive number, got {args.lr}")
    if args.save_every < 0:
        raise ConfigError(f"--save-every must be 0 or more, got {args.save_every}")
    if args.resume and not args.save:
        raise ConfigError("--resume needs --save DIR, the folder that holds the checkpoints")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no CUDA device; use --device cpu or auto")
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


def resident_bytes():
    """This process's resident memory now, from /proc/self/statm (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


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

    def isend(self, t, dest, tag):
        """Start sending t to rank dest; t must not change until the Transfer is done."""
        return self._start("send", self.comm.Isend, t, dest, tag)

    def irecv(self, t, source, tag):
        """Start receiving into t from rank source; the Transfer's wait() returns t, filled."""
        return self._start("recv", self.comm.Irecv, t, source, tag)

    def _start(self, kind, call, t, peer, tag):
        self._count(kind, t)
        with self.timeline.span("comm", kind):
            buf = self._to_mpi(t)
            return Transfer(self.timeline, call(buf, peer, tag), t, buf, kind)

    def bcast(self, t, root=0):
        self._count("bcast", t)
        with self.timeline.span("comm", "bcast"):
            buf = self._to_mpi(t)
            self.comm.Bcast(buf, root=root)
            if buf is not t:
                t.copy_(buf)
        return t


class Transfer:
    """A point-to-point message in flight. Time spent waiting for the peer is idle, not comm."""

    def __init__(self, timeline, request, t, buf, kind):
        self.timeline, self.request, self.t, self.buf, self.kind = timeline, request, t, buf, kind

    def done(self):
        return self.request.Test()  # also moves MPI along: MPICH progresses only inside MPI calls

    def wait(self):
        with self.timeline.span("idle", "wait " + self.kind):
            while not self.request.Test():
                time.sleep(POLL_S)  # spinning in Wait would steal the core of a rank that computes
            if self.buf is not self.t:
                self.t.copy_(self.buf)
        return self.t


# -----------------------------------------------------------------------------
# Model: a GPT-2 style character-level language model, built whole, then cut into stages
# -----------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and the positions before it."""

    def __init__(self, hidden, heads, seq_len):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.register_buffer("future", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        weights = scores.masked_fill(self.future[:t, :t], float("-inf")).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm decoder block. GELU and LayerNorm keep training a smooth function of the
    weights, so that float32 rounding differences between world sizes stay at rounding level."""

    def __init__(self, hidden, heads, seq_len):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), CausalSelfAttention(hidden, heads, seq_len)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token plus learned position embedding: what the first stage holds besides its blocks."""

    def __init__(self, hidden, seq_len):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(seq_len, hidden)

    def forward(self, idx):
        return self.tokens(idx) + self.positions(torch.arange(idx.size(1), device=idx.device))


class Head(nn.Module):
    """Final LayerNorm and the untied language-model head: what the last stage holds besides."""

    def __init__(self, hidden):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


def build_model(args):
    """The full model from the seed, on the CPU: the same network at every world size (GPT-2's
    init). One nn.Sequential of embeddings, blocks and head, so that a stage is a slice of it."""
    torch.manual_seed(args.seed)
    model = nn.Sequential(Embedding(args.hidden, args.seq_len),
                          *(Block(args.hidden, args.heads, args.seq_len) for _ in range(args.layers)),
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
    return stage_of(build_model(args), rank, n).to(device)


def describe_split(layers, n):
    return " | ".join(f"rank {r}: " + "embeddings + " * (r == 0) +
                      (f"block {lo}" if hi - lo == 1 else f"blocks {lo}-{hi - 1}") +
                      " + norm, head, loss" * (r == n - 1)
                      for r, (lo, hi) in enumerate(layer_split(layers, n)))


# -----------------------------------------------------------------------------
# Data: the characters of Python's own source; each batch a function of (seed, step)
# -----------------------------------------------------------------------------
@functools.cache
def load_text():
    """argparse.py, textwrap.py and shlex.py of this Python, every byte >= 128 made '?'."""
    raw = b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in SOURCES)
    return torch.tensor([b if b < 128 else ord("?") for b in raw], dtype=torch.long)


def make_batch(seed, step, size, seq_len):
    """The global batch of one step: inputs and next-character targets, from (seed, step) alone."""
    data = load_text()
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - seq_len - 1, (size,), generator=g).tolist()
    x = torch.stack([data[o:o + seq_len] for o in starts])
    y = torch.stack([data[o + 1:o + seq_len + 1] for o in starts])
    return x, y


# -----------------------------------------------------------------------------
# The model-parallel training step: forward down the ranks, backward back up
# -----------------------------------------------------------------------------
TAGS = {"act": 1, "grad": 2, "check": 3}  # tag 0: the shapes, before training


def agree_shapes(stage, comm, batch, seq_len, device):
    """Before training, each stage learns what it will receive: rank r runs its stage on a probe of
    its input and tells rank r+1 the shape and dtype of its output (metadata: pickled is fine).
    Returns (shape, dtype) of the activations this rank receives and of the gradients."""
    rank, n = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        probe = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    else:
        shape, dtype = comm.recv(source=rank - 1, tag=0)
        probe = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    with torch.no_grad():
        out = stage(probe)
    if rank < n - 1:
        comm.send((tuple(out.shape), str(out.dtype).removeprefix("torch.")), dest=rank + 1, tag=0)
    return {"act": (probe.shape, probe.dtype), "grad": (out.shape, out.dtype)}


def train_step(stage, optimizer, x, y, shapes, exchange, timeline):
    """One optimizer step on the whole batch. Returns the loss on the last rank, elsewhere 0.
    While one rank computes, every other rank waits for its activations or its gradient."""
    rank, n = exchange.comm.Get_rank(), exchange.comm.Get_size()
    optimizer.zero_grad()  # no gradient memory until backward makes it, while the activations peak
    inp = x
    if rank > 0:
        buf = torch.empty(shapes["act"][0], dtype=shapes["act"][1], device=x.device)
        inp = exchange.irecv(buf, rank - 1, TAGS["act"]).wait().requires_grad_()  # idle until it is in
    with timeline.span("compute", "F"):
        out = stage(inp)
        if rank == n - 1:
            out = F.cross_entropy(out.flatten(0, 1), y.flatten())
    grad = None
    if rank < n - 1:
        buf = torch.empty(shapes["grad"][0], dtype=shapes["grad"][1], device=x.device)
        receive = exchange.irecv(buf, rank + 1, TAGS["grad"])  # posted first: ready for the answer
        exchange.isend(out.detach(), rank + 1, TAGS["act"]).wait()
        grad = receive.wait()
    with timeline.span("compute", "B"):
        out.backward(grad)
    if rank > 0:
        exchange.isend(inp.grad.contiguous(), rank - 1, TAGS["grad"]).wait()
    with timeline.span("compute", "optimizer"):
        optimizer.step()
    return out.item() if rank == n - 1 else 0.0


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
    """The same steps in one plain process on the CPU: the unsplit model on the whole batch at once."""
    model = build_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for step in range(args.steps):
        x, y = make_batch(args.seed, step, args.batch_size, args.seq_len)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


def check(args, comm, losses, stage, reference=None):
    """Largest |difference| in losses and in final parameters. Rank 0 trains the reference on the
    CPU (or takes reference, its (losses, model)) and sends each rank the parameters of that rank's
    stage alone, which it compares with its own: no other rank ever holds the whole model."""
    rank, n = comm.Get_rank(), comm.Get_size()
    diff, expected = 0.0, torch.empty(sum(p.numel() for p in stage.parameters()))
    if rank == 0:
        ref_losses, ref_model = reference or reference_training(args)
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        for r in reversed(range(n)):
            flat = torch.cat([p.detach().reshape(-1) for p in stage_of(ref_model, r, n).parameters()])
            if r > 0:
                comm.Send(flat, dest=r, tag=TAGS["check"])
            else:
                expected = flat
    else:
        request = comm.Irecv(expected, source=0, tag=TAGS["check"])
        while not request.Test():  # rank 0 trains the reference meanwhile: leave it the core
            time.sleep(POLL_S)
    at = 0
    for p in stage.parameters():
        got = p.detach().reshape(-1).cpu().double()
        diff = max(diff, (got - expected[at:at + p.numel()].double()).abs().max().item())
        at += p.numel()
    return comm.allreduce(diff, op=MPI.MAX)


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


def measured_timeline(comm, timeline, window, t0, width, most):
    """The last step as every rank lived it (on its clock since the barrier before training), from
    rank 0's start, which runs the first forward, to the end of the last rank to finish. A cell
    lasts a typical forward, the fastest rank's median, so that a backward shows about twice."""
    ends = comm.allgather((window[0] - t0, window[1] - t0))
    first, last = ends[0][0], max(e for _, e in ends)
    rows = comm.gather([("o" if name == "optimizer" else name, max(0.0, s - t0 - first), e - t0 - first)
                        for name, cat, s, e in timeline.events
                        if cat == "compute" and s >= window[0]], root=0)
    if comm.Get_rank() != 0:
        return []
    forward = min(statistics.median([e - s for name, s, e in row if name[0] == "F"] or [last - first])
                  for row in rows)
    columns = max(1, min(most, round((last - first) / forward)))
    return draw_timeline(rows, last - first, columns, width) + \
        [f"         one cell {(last - first) / columns * 1e3:.2f} ms, the step {(last - first) * 1e3:.1f} ms"]


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
    device = setup_device(comm, args.device)
    cuda_aware = device.type == "cuda" and mpi_cuda_aware(comm)
    timeline = Timeline(device)
    exchange = Exchange(comm, timeline, cuda_aware)

    # The ideal step, one slot per forward or backward: forward down the ranks, backward back up.
    n = world_size
    ideal = [[("F", r, r + 1), ("B", 2 * n - 1 - r, 2 * n - r)] for r in range(n)]

    stage = build_stage(args, rank, n, device)  # cut from the whole built on the CPU; the rest freed
    optimizer = torch.optim.SGD(stage.parameters(), lr=args.lr, momentum=0.9)
    config = {"model": "GPT", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
              "seq_len": args.seq_len, "vocab": VOCAB}  # the network the shards belong to
    done = []
    if args.resume:
        try:
            manifest, shard = load_checkpoint(comm, args.save, config, lambda m: f"rank-{rank}.pt",
                                              args.steps, same_world_size=True)
        except ConfigError as e:
            if rank == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        stage.load_state_dict(shard["model"])
        optimizer.load_state_dict(shard["optimizer"])
        done = shard["losses"]
        say(comm, f"resumed from {args.save} at step {manifest['step']} "
                  f"(written by {manifest['world_size']} ranks)")
    shapes = agree_shapes(stage, comm, args.batch_size, args.seq_len, device)
    stage_params = comm.allgather(sum(p.numel() for p in stage.parameters()))
    params = sum(stage_params)
    transport = "n/a (CPU)" if device.type == "cpu" else (
        "direct (CUDA-aware MPI)" if cuda_aware else "staged through host memory")
    say(comm, f"{STRATEGY} | {world_size} ranks | device {device.type} | {mpi_library()}",
        f"CUDA buffers: {transport} | model: GPT, {args.layers} blocks x {args.hidden} hidden x "
        f"{args.heads} heads, {params:,} parameters ({4 * params / 1e6:.2f} MB) | text: "
        f"{' + '.join(s + '.py' for s in SOURCES)}, {len(load_text()):,} characters",
        f"stages: {describe_split(args.layers, n)} | parameters per rank: "
        f"{' '.join(f'{k:,}' for k in stage_params)}",
        f"global batch {args.batch_size} sequences of {args.seq_len} characters, all through every "
        f"rank in turn | between stages: {list(shapes['grad'][0]) if n > 1 else 'nothing'} float32")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if device.type == "cpu" and node.Get_size() > (os.cpu_count() or 1):
        say(comm, f"note: {node.Get_size()} ranks share {os.cpu_count()} CPU cores; one computes "
                  f"at a time here, so it has a core, and the others wait without spinning")
    node.Free()

    comm.Barrier()
    t0 = time.perf_counter()
    losses, records, window = list(done), [], None
    for step in range(len(done), args.steps):
        inject_failure(comm, step)
        start = time.perf_counter()
        x, y = (t.to(device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len))
        losses.append(train_step(stage, optimizer, x, y, shapes, exchange, timeline))
        sync(device)
        window = (start, time.perf_counter())
        record = {"step_s": window[1] - start, **{f"{k}_s": v for k, v in timeline.take().items()}}
        record["resident"] = resident_bytes()  # the stage, its gradients and momentum, what the step left
        record["wait_s"] = record.pop("idle_s", 0.0)  # blocked on a peer
        record["idle_s"] = max(0.0, record["step_s"] - record.get("compute_s", 0) - record.get("comm_s", 0))
        records.append(record)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            loss = comm.bcast(losses[-1], root=n - 1)  # reporting only, not counted
            say(comm, f"step {step + 1}/{args.steps} | loss {loss:.4f} | "
                      f"{record['step_s'] * 1e3:.1f} ms/step | comm {record.get('comm_s', 0) * 1e3:.1f} ms | "
                      f"idle {100 * record['idle_s'] / record['step_s']:.0f}%")
        if args.save and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            shard = {"model": stage.state_dict(), "optimizer": optimizer.state_dict(),
                     "losses": comm.bcast(losses, root=n - 1)}  # the last rank computed them
            save_checkpoint(comm, args.save, step + 1, shard, config)
    ran = max(1, args.steps - len(done))  # per-step counts: the training exchanges only
    messages, sent = (comm.allreduce(count["send"] / ran) for count in (exchange.calls, exchange.bytes))

    # The last rank computed the losses; every rank gets them.
    losses = exchange.bcast(torch.tensor(losses, dtype=torch.float64), root=n - 1).tolist()
    measured = measured_timeline(comm, timeline, window, t0, 2, 4 * n)
    later = records[1:] or records
    busy = comm.allgather(statistics.median(r.get("compute_s", 0) / r["step_s"] for r in later))
    waits = comm.allgather(statistics.median(r["wait_s"] / r["step_s"] for r in later))
    # What each rank holds: its parameters, and SGD's momentum buffer for each of them.
    param_bytes = comm.allgather(sum(p.numel() * p.element_size() for p in stage.parameters()))
    state_bytes = comm.allgather(sum(t.numel() * t.element_size() for s in optimizer.state.values()
                                     for t in s.values() if torch.is_tensor(t)))
    one_process = 2 * sum(param_bytes)
    resident = comm.allgather(max(r["resident"] or 0 for r in records) if records[0]["resident"] else None)
    diff = check(args, comm, losses, stage) if args.check else None
    if args.trace:
        write_trace(comm, timeline, args.trace, t0)

    slowest, _ = step_summary(comm, records)
    formula = 2 * (n - 1) * args.batch_size * args.seq_len * args.hidden * 4
    idle, m = statistics.mean(waits), 8  # m: pipeline_parallel.py's default micro-batches
    say(comm, f"ideal timeline (one slot per forward F or backward B of a rank's layers, '.': idle) | "
              f"busy 1/N = {100 / n:.0f}% of the step on every rank:",
        *draw_timeline(ideal, 2 * n, 2 * n, 3),
        "measured timeline (the last step; o: optimizer, '.': waiting for a peer or communicating):",
        *measured,
        f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f})",
        f"median step {slowest['step_s'] * 1e3:.1f} ms: compute {slowest['compute_s'] * 1e3:.1f} | "
        f"comm {slowest['comm_s'] * 1e3:.1f} | idle {slowest['idle_s'] * 1e3:.1f} ms (slowest rank)",
        f"share of the step per rank: busy {' '.join(f'{100 * b:.0f}%' for b in busy)} | waiting for a "
        f"peer {' '.join(f'{100 * w:.0f}%' for w in waits)} | ideal: busy 1/N = {100 / n:.0f}%, idle "
        f"(N-1)/N = {100 * (n - 1) / n:.0f}%",
        "held per rank (parameters + optimizer state): " + " | ".join(
            f"{(a + b) / 1e6:.2f} MB ({100 * (a + b) / one_process:.0f}%)" for a, b in
            zip(param_bytes, state_bytes)) + f" of the {one_process / 1e6:.2f} MB one process holds",
        f"point-to-point: {messages:g} messages, {sent:,.0f} bytes/step over all ranks; "
        f"2(N-1) x B x T x H x 4 = {formula:,} | no collective in the step",
        f"pipeline_parallel.py cuts the batch into M micro-batches so that the ranks work at once: "
        f"with N = {n} and M = {m}, idle (N-1)/(M+N-1) = {100 * (n - 1) / (m + n - 1):.0f}% of the step "
        f"instead of (N-1)/N = {100 * (n - 1) / n:.0f}% here (measured: {100 * idle:.0f}% waiting); "
        f"mpirun -np {n} python pipeline_parallel.py measures it" if n > 1 else
        "one rank holds the whole model and never waits: there is no idle time for a pipeline to remove")
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
            "comm_bytes_per_step": sent, "collectives_per_step": 0,
            "check_max_abs_diff": diff, "messages_per_step": messages,
            "layer_split": layer_split(args.layers, n), "stage_params": stage_params,
            "busy_fraction": busy, "idle_fraction": waits, "busy_fraction_ideal": 1 / n,
            "param_bytes": param_bytes, "optimizer_state_bytes": state_bytes,
            "single_process_bytes": one_process, "resident_bytes": resident}))
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
