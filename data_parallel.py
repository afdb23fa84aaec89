r"""Data parallelism over MPI: every rank holds the whole model and a slice of each batch.

What is split: the data. Each optimizer step takes one global batch of B samples (--batch-size,
the same at every world size) and gives each of the N ranks B/N of them. Every rank holds a full
copy of the model, computes the loss and the gradients of its slice, and the gradients are
averaged with allreduce, so every rank takes the identical optimizer step.

            global batch of B samples
     +-----------+-----------+-----------+-----------+
     | B/N       | B/N       | B/N       | B/N       |
     +-----------+-----------+-----------+-----------+
          |           |           |           |
     +---------+ +---------+ +---------+ +---------+
     | rank 0  | | rank 1  | | rank 2  | | rank 3  |   each: the whole model
     | fwd+bwd | | fwd+bwd | | fwd+bwd | | fwd+bwd |   (parameters, optimizer state)
     +---------+ +---------+ +---------+ +---------+
          \___________ allreduce(gradients) / N ___/   buckets, overlapped with backward
                                |
                  identical optimizer step on every rank

Communication per step: gradients of P parameters, G = 4P bytes in float32, summed by
ceil(G / bucket) allreduces (one with --no-overlap). A ring allreduce moves 2(N-1)/N x G bytes
in and out of each rank, whatever N. With --sync-bn, each BatchNorm layer adds one allreduce of
2C+1 float64 statistics forward and one of 2C float32 sums backward.

Overlap (bucketing, as in PyTorch DDP, Li et al. 2020): gradients are grouped into buckets of
--bucket-mb in reverse registration order, the order backward produces them. A post-accumulate-
grad hook counts each bucket's gradients; when a bucket is full its non-blocking allreduce
(Iallreduce) starts while backward carries on with earlier layers. All are completed before the
optimizer step. What really overlaps depends on the MPI library: MPICH (the pip wheel) moves a
non-blocking collective forward only while the process is inside an MPI call, so the hooks poll
(Test) every pending bucket; MPIR_CVAR_ASYNC_PROGRESS=1 gives MPICH a progress thread instead,
which only pays off with a spare core per rank. With the default 25 MB buckets this small network
is a single bucket, which can only start after the last gradient: pass a smaller --bucket-mb to
see overlap. Measured on 2 shared cores (bench/): with small buckets 84% of the exchange stayed
exposed at N = 2, since the hooks can poll only when a gradient arrives; the progress thread
took the cores from the computation (27 -> 39 ms a step with no exchange at all).

BatchNorm: by default each rank normalizes with the statistics of its own slice (per-GPU BN, as
in Goyal et al. 2017), so N ranks train like one process that runs the N slices one after another
and averages. --sync-bn reduces the statistics over all ranks in forward and the matching sums in
backward, so N ranks train exactly like one process on the whole global batch.

When to choose it: the model, its gradients and optimizer state fit on one device and you want
more samples per second. It is the first strategy to reach for; the exchange grows with the model,
not with N, so it scales until the allreduce no longer hides behind backward.

Run:  mpirun -np 4 python data_parallel.py            (add --help for the flags)
"""
import argparse
import collections
import contextlib
import hashlib
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

STRATEGY = "data_parallel"
TOLERANCE = 2e-5  # largest |difference| allowed against single-process training (float32)


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
    p = Parser(description="Data parallelism over MPI: a LeNet with BatchNorm on synthetic images.")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64,
                   help="global batch: samples per optimizer step, whatever the world size")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate (SGD, momentum 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--log-every", type=int, default=25, help="rank 0 prints progress every N steps")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with single-process training (default: on)")
    p.add_argument("--json", action="store_true", help="last stdout line is one JSON object")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace of every rank")
    p.add_argument("--save", metavar="DIR", help="write checkpoints into DIR")
    p.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N steps as well as at the end (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save")
    # Data parallelism's own flags.
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB")
    p.add_argument("--no-overlap", action="store_true",
                   help="baseline: one blocking allreduce after backward")
    p.add_argument("--accum-steps", type=int, default=1,
                   help="gradient accumulation: micro-steps per optimizer step")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks")
    p.add_argument("--scale-lr", action="store_true",
                   help="linear scaling rule: lr x batch-size / base-batch")
    p.add_argument("--base-batch", type=int, default=32, help="the batch --lr was tuned for")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up from --lr")
    args = p.parse_args(argv)

    for name in ("steps", "batch_size", "log_every", "accum_steps", "base_batch"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, "
                              f"got {getattr(args, name)}")
    for name in ("lr", "bucket_mb"):
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, "
                              f"got {getattr(args, name)}")
    for name in ("warmup_steps", "save_every"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if args.resume and not args.save:
        raise ConfigError("--resume needs --save DIR, the folder that holds the checkpoints")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no CUDA device; use --device cpu or auto")
    slices = world_size * args.accum_steps
    if args.batch_size % slices:
        works = [b for b in range(slices, 4 * slices + 1, slices)]
        raise ConfigError(f"--batch-size {args.batch_size} does not split into {world_size} ranks x "
                          f"{args.accum_steps} accumulation steps; use a multiple of {slices}, "
                          f"e.g. {', '.join(map(str, works[:3]))}")
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

    def iallreduce(self, t, kind="allreduce"):
        """Start summing t over all ranks; the returned Pending's wait() finishes it in place."""
        self._count(kind, t)
        with self.timeline.span("comm", kind + " start"):
            buf = self._to_mpi(t)
            return Pending(self.timeline, self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
                           t, buf, kind)

    def bcast(self, t, root=0):
        self._count("bcast", t)
        with self.timeline.span("comm", "bcast"):
            buf = self._to_mpi(t)
            self.comm.Bcast(buf, root=root)
            if buf is not t:
                t.copy_(buf)
        return t


class Pending:
    """A non-blocking allreduce in flight."""

    def __init__(self, timeline, request, t, buf, kind):
        self.timeline, self.request, self.t, self.buf, self.kind = timeline, request, t, buf, kind

    def poll(self):
        """MPICH moves a non-blocking collective forward only inside MPI calls: poll it."""
        return self.request.Test()

    def wait(self):
        with self.timeline.span("comm", self.kind + " wait"):
            self.request.Wait()
            if self.buf is not self.t:
                self.t.copy_(self.buf)
        return self.t


# -----------------------------------------------------------------------------
# Model: LeNet-5 with BatchNorm; SyncBatchNorm as an autograd Function over MPI
# -----------------------------------------------------------------------------
class SyncBatchNormFunction(torch.autograd.Function):
    """BatchNorm whose statistics are those of the samples of all ranks together.

    forward:  one allreduce of [sum x, sum x^2, count] per channel (float64, no cancellation)
    backward: one allreduce of [sum dy, sum dy*xhat] per channel. Each rank's dy is that of its
              own loss; the gradient allreduce later divides by N, which makes these global sums
              exactly N times those of the mean loss, as they must be.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, exchange):
        dims, shape, c = [0] + list(range(2, x.dim())), [1, -1] + [1] * (x.dim() - 2), x.size(1)
        x64 = x.double()
        stats = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), x64.new_full([1], x.numel() / c)])
        exchange.allreduce(stats, "syncbn")
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean  # biased, used to normalize
        running_mean.mul_(1 - momentum).add_(momentum * mean.float())
        running_var.mul_(1 - momentum).add_(momentum * (var * n / (n - 1)).float())
        invstd = torch.rsqrt(var + eps).float()
        xhat = (x - mean.float().view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.exchange, ctx.n, ctx.dims, ctx.shape = exchange, n.item(), dims, shape
        return xhat * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        c, shape = weight.numel(), ctx.shape
        local = torch.cat([dy.sum(ctx.dims), (dy * xhat).sum(ctx.dims)])
        grad_bias, grad_weight = local[:c].clone(), local[c:].clone()
        total = ctx.exchange.allreduce(local, "syncbn")
        mean_dy, mean_dy_xhat = (total[:c] / ctx.n).view(shape), (total[c:] / ctx.n).view(shape)
        dx = (weight * invstd).view(shape) * (dy - mean_dy - xhat * mean_dy_xhat)
        return dx, grad_weight, grad_bias, None, None, None, None, None


class BatchNorm(nn.BatchNorm2d):
    """nn.BatchNorm for 2-D and 4-D inputs; statistics over all ranks when given an Exchange."""

    def __init__(self, channels, exchange=None):
        super().__init__(channels)
        self.exchange = exchange

    def _check_input_dim(self, x):
        if x.dim() not in (2, 4):
            raise ValueError(f"expected 2-D or 4-D input, got {x.dim()}-D")

    def forward(self, x):
        if not (self.training and self.exchange is not None):
            return super().forward(x)
        self.num_batches_tracked += 1
        return SyncBatchNormFunction.apply(x, self.weight, self.bias, self.running_mean,
                                           self.running_var, self.eps, self.momentum, self.exchange)


class LeNet(nn.Module):
    """LeNet-5 (LeCun et al. 1998) with BatchNorm after each of the first three layers.

    tanh and average pooling, as in the original, rather than ReLU and max pooling: training is
    then a smooth function of the weights, so float32 rounding differences stay at rounding
    level. With ReLU and max pooling a 1e-7 nudge of one weight grew to 3e-2 in 150 steps of
    single-process training, and no tolerance could tell a bug from that chaos.
    """

    def __init__(self, exchange=None):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 6, 5, padding=2), BatchNorm(6, exchange)
        self.conv2, self.bn2 = nn.Conv2d(6, 16, 5), BatchNorm(16, exchange)
        self.fc1, self.bn3 = nn.Linear(16 * 5 * 5, 120), BatchNorm(120, exchange)
        self.fc2, self.fc3 = nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.avg_pool2d(torch.tanh(self.bn1(self.conv1(x))), 2)  # 28x28 -> 14x14
        x = F.avg_pool2d(torch.tanh(self.bn2(self.conv2(x))), 2)  # 10x10 -> 5x5
        x = torch.tanh(self.bn3(self.fc1(x.flatten(1))))
        return self.fc3(torch.tanh(self.fc2(x)))


def build_model(seed, device, exchange=None):
    """The full model from the seed: the same network at every world size."""
    torch.manual_seed(seed)
    return LeNet(exchange).to(device)


# -----------------------------------------------------------------------------
# Data: ten classes of smooth random 28x28 patterns under heavy noise, made from the seed
# -----------------------------------------------------------------------------
CLASSES, NOISE = 10, 4.0


def prototypes(seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(CLASSES, 1, 28, 28, generator=g)
    smooth = F.avg_pool2d(F.pad(raw, (3, 3, 3, 3), mode="circular"), 7, stride=1)
    return (smooth - smooth.mean()) / smooth.std()


def make_batch(seed, step, size):
    """The global batch of one step: a function of (seed, step) alone, so any rank can cut it."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    labels = torch.randint(CLASSES, (size,), generator=g)
    images = prototypes(seed)[labels] + NOISE * torch.randn(size, 1, 28, 28, generator=g)
    return images, labels


def slice_of(images, labels, index, count):
    n = images.size(0) // count
    return images[index * n:(index + 1) * n], labels[index * n:(index + 1) * n]


def learning_rate(args, step):
    """Depends on the step only. --scale-lr: Goyal et al.'s linear scaling rule with warm-up."""
    peak = args.lr * args.batch_size / args.base_batch if args.scale_lr else args.lr
    if args.warmup_steps and step < args.warmup_steps:
        return args.lr + (peak - args.lr) * step / args.warmup_steps
    return peak


# -----------------------------------------------------------------------------
# The data-parallel training step: bucketed allreduce overlapped with backward
# -----------------------------------------------------------------------------
class GradBuckets:
    """PyTorch DDP's reducer in miniature: average gradients over ranks, bucket by bucket.

    Buckets follow reverse registration order, the order in which backward produces gradients.
    With overlap, a post-accumulate-grad hook counts a bucket's gradients and starts its
    non-blocking allreduce the moment the last one is in, while backward goes on.
    """

    def __init__(self, params, exchange, bucket_bytes, overlap):
        self.exchange, self.overlap, self.world = exchange, overlap, exchange.comm.Get_size()
        self.buckets, size = [[]], 0
        for p in reversed(list(params)):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.exchanging, self.ready, self.pending = False, [0] * len(self.buckets), []
        if overlap:
            for p in self.bucket_of:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        if not self.exchanging:  # an accumulation micro-step: gradients just add up
            return
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            self.pending.append((i, flat, self.exchange.iallreduce(flat)))
        for _, _, pending in self.pending:
            pending.poll()

    def reduce(self, backward):
        """Run backward (a function) with the exchange; leave averaged gradients in .grad."""
        self.exchanging, self.ready, self.pending = True, [0] * len(self.buckets), []
        backward()
        self.exchanging = False
        if not self.overlap:  # the baseline: one blocking allreduce of all gradients
            params = [p for b in self.buckets for p in b]
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            self._unflatten(params, self.exchange.allreduce(flat))
            return
        assert len(self.pending) == len(self.buckets), "a gradient never arrived"
        for i, flat, pending in self.pending:
            self._unflatten(self.buckets[i], pending.wait())

    def _unflatten(self, params, flat):
        flat /= self.world
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def train_step(model, optimizer, buckets, images, labels, accum_steps, timeline):
    """One optimizer step on this rank's slice, cut into accum_steps micro-batches."""
    optimizer.zero_grad(set_to_none=False)
    total = 0.0
    for k in range(accum_steps):
        x, y = slice_of(images, labels, k, accum_steps)
        with timeline.span("compute", "forward"):
            loss = F.cross_entropy(model(x), y) / accum_steps
        total += loss.item()

        def backward():
            with timeline.span("compute", "backward"):
                loss.backward()

        if k < accum_steps - 1:
            backward()  # gradients accumulate locally; no exchange
        else:
            buckets.reduce(backward)
    with timeline.span("compute", "optimizer"):
        optimizer.step()
    return total


def replicate(args, comm, device, exchange):
    """The model from the seed, rank 0's copy broadcast to all and proven identical."""
    model = build_model(args.seed, device, exchange if args.sync_bn else None)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            exchange.bcast(t.data)
    sums = comm.allgather(checksum(model))
    if len(set(sums)) != 1:
        raise RuntimeError(f"model differs across ranks after broadcast: checksums {sums}")
    exchange.calls.clear(), exchange.bytes.clear()  # count the training steps only
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    buckets = GradBuckets(model.parameters(), exchange, args.bucket_mb * 2**20, not args.no_overlap)
    return model, optimizer, buckets


def train(args, comm, device, exchange, model, optimizer, buckets, done=(), log=False):
    """The steps after the `done` ones (their global losses, from a checkpoint); returns this
    rank's losses of the new steps and their timings."""
    rank, world_size, timeline = comm.Get_rank(), comm.Get_size(), exchange.timeline
    losses, records = [], []
    for step in range(len(done), args.steps):
        inject_failure(comm, step)
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        images, labels = make_batch(args.seed, step, args.batch_size)
        images, labels = slice_of(images.to(device), labels.to(device), rank, world_size)
        losses.append(train_step(model, optimizer, buckets, images, labels, args.accum_steps, timeline))
        sync(device)
        record = {"step_s": time.perf_counter() - start, **{f"{k}_s": v for k, v in timeline.take().items()}}
        record["idle_s"] = max(0.0, record["step_s"] - record.get("compute_s", 0) - record.get("comm_s", 0))
        records.append(record)
        if log and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            mean_loss = comm.allreduce(losses[-1]) / world_size  # reporting only, not counted
            say(comm, f"step {step + 1}/{args.steps} | loss {mean_loss:.4f} | "
                      f"{record['step_s'] * 1e3:.1f} ms/step | comm {record.get('comm_s', 0) * 1e3:.1f} ms | "
                      f"idle {100 * record['idle_s'] / record['step_s']:.0f}%")
        if args.save and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            so_far = list(done) + finish(args, comm, exchange, model, losses, buffers=False)
            shard = data_parallel_shard(comm, exchange, model, optimizer, so_far)
            save_checkpoint(comm, args.save, step + 1, shard, {"model": "LeNet-5+BN"})
    return losses, records


def finish(args, comm, exchange, model, losses, buffers=True):
    """One model and one loss curve: every rank's loss is that of its slice, the step's is their
    mean; per-rank BatchNorm statistics are averaged. Returns the losses of the global batch."""
    world_size = comm.Get_size()
    losses = (exchange.allreduce(torch.tensor(losses, dtype=torch.float64), "report")
              / world_size).tolist()
    if not buffers:
        return losses
    if not args.sync_bn:
        average_buffers(model, exchange)
    if len(set(comm.allgather(checksum(model)))) != 1:
        raise RuntimeError("model replicas diverged")
    return losses


def average_buffers(model, exchange):
    """Per-rank BatchNorm keeps per-rank running statistics: average them into one model."""
    for b in model.buffers():
        if b.is_floating_point():
            b.copy_(exchange.allreduce(b.clone(), "buffers") / exchange.comm.Get_size())


def checksum(model):
    """A bitwise fingerprint of every parameter and buffer."""
    crc = 0
    for t in list(model.parameters()) + list(model.buffers()):
        crc = zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes(), crc)
    return crc


def accuracy(model, seed, device):
    images, labels = make_batch(seed, -1, 2000)  # step -1: a held-out batch never trained on
    model.eval()
    with torch.no_grad():
        correct = (model(images.to(device)).argmax(1) == labels.to(device)).float().mean().item()
    model.train()
    return correct


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


def data_parallel_shard(comm, exchange, model, optimizer, losses):
    """What rank 0 saves: the model, the optimizer, every rank's BatchNorm statistics (they
    differ without --sync-bn) and the losses so far. Collective: every rank must call it."""
    buffers = torch.cat([b.reshape(-1) for b in model.buffers() if b.is_floating_point()])
    every = torch.zeros(comm.Get_size(), buffers.numel(), dtype=buffers.dtype, device=buffers.device)
    every[comm.Get_rank()] = buffers
    exchange.allreduce(every, "checkpoint")  # a gather built from the one collective we have
    if comm.Get_rank() != 0:
        return None
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "buffers_per_rank": every.cpu(), "losses": list(losses)}


def restore(comm, model, optimizer, shard):
    """Load a data-parallel checkpoint at any world size: the model is replicated. Each rank
    takes its own BatchNorm statistics when the world size is unchanged, else their mean."""
    model.load_state_dict(shard["model"])
    optimizer.load_state_dict(shard["optimizer"])
    saved = shard["buffers_per_rank"]
    row = saved[comm.Get_rank()] if saved.size(0) == comm.Get_size() else saved.mean(0)
    offset = 0
    for b in (b for b in model.buffers() if b.is_floating_point()):
        b.copy_(row[offset:offset + b.numel()].view_as(b))
        offset += b.numel()
    return shard["losses"]


# -----------------------------------------------------------------------------
# Check against single-process training
# -----------------------------------------------------------------------------
def reference_training(args, world_size, device):
    """The same steps in one plain process: no MPI, plain nn.BatchNorm.

    --sync-bn: each accumulation micro-step is one batch made of every rank's slice.
    Otherwise: every rank's micro-batches one after another, each with its own statistics and
    its loss scaled by 1/(N*K); each rank's running statistics start from the same values and
    are averaged over the ranks (they are linear in the batch statistics, so averaging once at
    the end, as the ranks do, gives the same).
    """
    model = build_model(args.seed, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    k_steps, losses = args.accum_steps, []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        images, labels = make_batch(args.seed, step, args.batch_size)
        images, labels = images.to(device), labels.to(device)
        slices = [[slice_of(*slice_of(images, labels, r, world_size), k, k_steps)
                   for r in range(world_size)] for k in range(k_steps)]
        optimizer.zero_grad()
        total = 0.0
        if args.sync_bn:
            for per_rank in slices:
                x, y = torch.cat([s[0] for s in per_rank]), torch.cat([s[1] for s in per_rank])
                loss = F.cross_entropy(model(x), y) / k_steps
                loss.backward()
                total += loss.item()
        else:
            start = [b.clone() for b in model.buffers()]
            after = [torch.zeros_like(b, dtype=torch.float64) for b in start]
            for r in range(world_size):  # rank r's micro-steps, from the shared running statistics
                for b, b0 in zip(model.buffers(), start):
                    b.copy_(b0)
                for k in range(k_steps):
                    x, y = slices[k][r]
                    loss = F.cross_entropy(model(x), y) / (world_size * k_steps)
                    loss.backward()
                    total += loss.item()
                for acc, b in zip(after, model.buffers()):
                    acc += b
            for b, acc in zip(model.buffers(), after):
                b.copy_(acc / world_size if b.is_floating_point() else b)
        optimizer.step()
        losses.append(total)
    return losses, model


def max_difference(losses, model, ref_losses, ref_model):
    """Largest |difference| in losses and in final parameters and buffers."""
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    ref_state = ref_model.state_dict()
    for name, t in model.state_dict().items():
        diff = max(diff, (t.double() - ref_state[name].double().to(t.device)).abs().max().item())
    return diff


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

    model, optimizer, buckets = replicate(args, comm, device, exchange)
    done = []
    if args.resume:
        try:
            manifest, shard = load_checkpoint(comm, args.save, {"model": "LeNet-5+BN"},
                                              lambda m: "rank-0.pt", args.steps, same_world_size=False)
        except ConfigError as e:
            if rank == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        done = restore(comm, model, optimizer, shard)
        say(comm, f"resumed from {args.save} at step {manifest['step']} "
                  f"(written by {manifest['world_size']} ranks)")
    params = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    transport = "n/a (CPU)" if device.type == "cpu" else (
        "direct (CUDA-aware MPI)" if cuda_aware else "staged through host memory")
    say(comm, f"{STRATEGY} | {world_size} ranks | device {device.type} | {mpi_library()}",
        f"CUDA buffers: {transport} | model: LeNet-5 + BatchNorm, {params:,} parameters "
        f"({grad_bytes / 1e6:.2f} MB) | {len(buckets.buckets)} bucket(s) of <= {args.bucket_mb:g} MB, "
        f"{'no overlap' if args.no_overlap else 'overlapped with backward'}",
        f"global batch {args.batch_size} = {world_size} ranks x {args.accum_steps} micro-steps x "
        f"{args.batch_size // (world_size * args.accum_steps)} | BatchNorm: "
        f"{'synchronized over ranks' if args.sync_bn else 'per rank'}")

    losses, records = train(args, comm, device, exchange, model, optimizer, buckets, done, log=True)
    ran = max(1, args.steps - len(done))  # per-step counts: the training exchanges only
    calls = {k: exchange.calls[k] / ran for k in ("allreduce", "syncbn") if exchange.calls[k]}
    volume = {k: exchange.bytes[k] / ran for k in ("allreduce", "syncbn") if exchange.bytes[k]}
    losses = list(done) + finish(args, comm, exchange, model, losses)
    acc = accuracy(model, args.seed, device)
    diff = None
    if args.check:
        diff = (max_difference(losses, model, *reference_training(args, world_size, device))
                if rank == 0 else None)
        diff = comm.bcast(diff, root=0)
    if args.trace:
        write_trace(comm, timeline, args.trace, t0)

    slowest, _ = step_summary(comm, records)
    ring = 2 * (world_size - 1) / world_size * grad_bytes
    say(comm, f"final loss {losses[-1]:.4f} | accuracy {100 * acc:.1f}% on 2000 held-out samples "
              f"(chance {100 / CLASSES:.0f}%)",
        f"median step {slowest['step_s'] * 1e3:.1f} ms: compute {slowest['compute_s'] * 1e3:.1f} | "
        f"comm {slowest['comm_s'] * 1e3:.1f} | idle {slowest['idle_s'] * 1e3:.1f} ms (slowest rank)",
        f"gradient allreduce: {calls.get('allreduce', 0):g} call(s), {volume.get('allreduce', 0):,.0f} "
        f"bytes/step (G = {grad_bytes:,}); a ring moves 2(N-1)/N x G = {ring:,.0f} bytes per rank"
        + (f" | sync-BN: {calls.get('syncbn', 0):g} allreduces, {volume.get('syncbn', 0):,.0f} bytes/step"
           if args.sync_bn else ""))
    ok = diff is None or diff <= TOLERANCE
    if diff is not None:
        say(comm, f"check against single-process training: max |diff| {diff:.2e} "
                  f"(losses, parameters, buffers; tolerance {TOLERANCE:g}) -> {'PASS' if ok else 'FAIL'}")
    if args.json:
        say(comm, json.dumps({
            "strategy": STRATEGY, "world_size": world_size, "device": device.type,
            "steps": args.steps, "losses": losses, "final_loss": losses[-1],
            "step_time_s": slowest["step_s"], "compute_s": slowest["compute_s"],
            "comm_s": slowest["comm_s"], "idle_s": slowest["idle_s"],
            "comm_bytes_per_step": sum(volume.values()), "collectives_per_step": sum(calls.values()),
            "check_max_abs_diff": diff, "accuracy": acc, "grad_bytes": grad_bytes,
            "ring_bytes_per_rank": ring, "buckets": len(buckets.buckets),
            "overlap": not args.no_overlap, "sync_bn": args.sync_bn}))
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
