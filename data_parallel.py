r"""Data parallelism over MPI: every rank holds the whole model and a slice of each batch.

What is split: the data. Each optimizer step takes one global batch of B samples (--batch-size,
the same at every world size) and gives each of the N ranks B/N of them. Every rank holds a full
copy of the model and computes its slice's share of the batch's mean loss (its losses' sum over the
batch's count of targets) and its gradients, which allreduce sums: every rank takes the same step.

            global batch of B samples
     +-----------+-----------+-----------+-----------+
     | B/N       | B/N       | B/N       | B/N       |
     +-----------+-----------+-----------+-----------+
          |           |           |           |
     +---------+ +---------+ +---------+ +---------+
     | rank 0  | | rank 1  | | rank 2  | | rank 3  |   each: the whole model
     | fwd+bwd | | fwd+bwd | | fwd+bwd | | fwd+bwd |   (parameters, optimizer state)
     +---------+ +---------+ +---------+ +---------+
          \____________ allreduce(gradients) _____/   a sum, buckets overlapped with backward
                                |
                  identical optimizer step on every rank

Communication per step: gradients of P parameters, G = 4P bytes in float32, summed by one allreduce
per bucket (one in all with --no-overlap). A bucket closes as soon as it holds at least --bucket-mb,
so the parameter that crosses the cap stays in it: at most ceil(G / bucket) buckets, fewer where
large parameters cross (the header prints their real sizes). A ring allreduce moves 2(N-1)/N x G
bytes in and out of each rank, whatever N. With --sync-bn, each BatchNorm layer adds one allreduce
of 2C+1 float64 statistics forward and one of 2C float32 sums backward. --ragged adds one of 8
bytes, the step's count of targets (count_targets).

Overlap (bucketing, as in PyTorch DDP, Li et al. 2020): gradients are grouped into buckets of
--bucket-mb in reverse registration order, the order backward produces them. A post-accumulate-
grad hook counts each bucket's gradients; when a bucket is full its non-blocking allreduce
(Iallreduce) starts while backward carries on with earlier layers. All are completed before the
optimizer step. What really overlaps depends on the MPI library: MPICH (the pip wheel) moves a
non-blocking collective forward only while the process is inside an MPI call, so the hooks poll
(Test) every pending bucket; MPIR_CVAR_ASYNC_PROGRESS=1 gives MPICH a progress thread instead,
which pays off only with a spare core per rank. With the default 25 MB buckets this small network
is a single bucket, which can only start after the last gradient: pass a smaller --bucket-mb to
see overlap (docs/results.md says how much of it this machine's MPI delivered). The run counts
a bucket as overlapped only if its allreduce was posted before backward computed a later gradient,
so the last bucket never counts and the default prints 0/1.

BatchNorm: by default each rank normalizes with the statistics of its own slice (per-GPU BN, as
in Goyal et al. 2017), so N ranks train like one process that runs the N slices one after another
and averages. --sync-bn reduces the statistics over all ranks in forward and the matching sums in
backward, so N ranks train exactly like one process on the whole global batch (with
--accum-steps K, like one process on each micro-step's K-th of it: BatchNorm sees one micro-step).

Mixed precision (--precision bf16): forward and loss under torch.autocast(dtype=torch.bfloat16),
on the ranks and in the check's one process alike. The parameters stay float32, the master weights:
autocast casts each to bf16 as a convolution or a linear layer uses it (autograd keeps that copy).
BatchNorm takes its input in float32 (its statistics and --sync-bn's sums as in fp32; on the CPU
autocast would leave them bf16), and so does the loss. The gradients land in float32, so the
buckets sum float32, G = 4P bytes in bf16 too (Megatron's default). bf16 gradients would halve
those bytes and their memory, but round each rank's gradient to 8 bits before N are summed, and
MPI has no bf16 sum (MPICH's Allreduce with MPI.SUM on a bf16 buffer fails). --recompute is
refused: it saves a transformer block's activations, and LeNet-5 has none.

When to choose it: the model, its gradients and optimizer state fit on one device and you want
more samples per second. It is the first strategy to reach for; the exchange grows with the model,
not with N, so it scales until the allreduce no longer hides behind backward.

Run:  mpirun -np 4 python data_parallel.py            (add --help for the flags)
"""
import argparse
import collections
import contextlib
import ctypes
import errno
import hashlib
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

STRATEGY = "data_parallel"
# Largest |difference| allowed against single-process training (float32). Measured: at most 4.8e-6
# over N = 1..4, with and without --sync-bn, accumulation and small buckets; 1.9e-6 for the default
# run. A fourfold margin over the worst case, well below what one wrong step would give (1e-3).
# Not for BatchNorm over 3 samples (batch 24 on 4 ranks with --accum-steps 2): the variance of 3
# samples amplifies rounding to 4.5e-5 in 12 steps. Check with 6 or more per rank and micro-step.
TOLERANCE = 2e-5
# bf16, both sides: 1.05e-3 at most in the tests' runs (N = 1..4), 6.6e-3 in 60 steps at N = 3 (batch 48),
# 1.04e-3 at N = 4: a weight's float32 rounding that crosses a bf16 boundary moves its bf16 copy by 2^-8.
# 3x the worst; a gradient divided once more by N gives 5.0e-2 in 3 steps at N = 2.
TOLERANCE_BF16 = 2e-2
POLL_S = 1e-4  # a rank waiting on MPI sleeps between polls and leaves the core to ranks that compute


# -----------------------------------------------------------------------------
# The strategy: sum the gradients over the ranks, bucket by bucket, while backward runs
# -----------------------------------------------------------------------------
class GradBuckets:
    """PyTorch DDP's reducer in miniature: sum gradients over ranks, bucket by bucket.

    Buckets follow reverse registration order, the order in which backward produces gradients.
    With overlap, a post-accumulate-grad hook counts a bucket's gradients and starts its
    non-blocking allreduce the moment the last one is in, while backward goes on."""

    def __init__(self, params, comm, bucket_bytes, overlap):
        self.comm, self.overlap = comm, overlap
        self.buckets, size = [[]], 0
        for p in reversed(list(params)):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        # exchanging: True only in the micro-step whose gradients are summed, the last of
        # --accum-steps (the earlier ones only accumulate); ready: gradients in, per bucket;
        # pending: the buckets whose allreduce has started, with their buffers and requests.
        self.exchanging, self.ready, self.pending = False, [0] * len(self.buckets), []
        # The report's marks, not the strategy's: how many gradients backward has computed
        # (a hook of its own, first on each parameter), and that number as each allreduce was posted.
        self.computed, self.posted_at = 0, []
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._computed)
            if overlap:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _computed(self, p):
        self.computed += self.exchanging

    def _grad_ready(self, p):
        if not self.exchanging:  # an accumulation micro-step: gradients just add up
            return
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):  # the bucket is full: start summing it
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            buffer = mpi_buffer(flat, nonblocking=True)
            request = self.comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            self.pending.append((i, flat, buffer, request))
            self.posted_at.append(self.computed)
        for *_, request in self.pending:
            request.Test()  # MPICH moves a non-blocking collective forward only inside MPI calls

    def reduce(self, backward):
        """Run backward with the exchange; leave summed gradients in .grad. backward comes as a
        function because the exchange starts inside it, from the hooks: reduce() opens the
        exchange before it and completes every bucket after it."""
        self.exchanging, self.ready, self.pending = True, [0] * len(self.buckets), []
        self.computed, self.posted_at = 0, []
        backward()
        self.exchanging = False
        if not self.overlap:  # the baseline: one blocking allreduce of all gradients
            params = [p for b in self.buckets for p in b]
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            buffer = mpi_buffer(flat)
            self.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            self.posted_at.append(self.computed)
            self._unflatten(params, from_mpi(flat, buffer))
            return
        assert len(self.pending) == len(self.buckets), "a gradient never arrived"
        for i, flat, buffer, request in self.pending:
            request.Wait()
            self._unflatten(self.buckets[i], from_mpi(flat, buffer))

    def _unflatten(self, params, flat):
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class SyncBatchNormFunction(torch.autograd.Function):
    """BatchNorm whose statistics are those of the samples of all ranks together.

    forward:  one allreduce of [sum x, sum x^2, count] per channel; var = E[x^2] - E[x]^2
              still cancels, and float64 makes that harmless
    backward: one allreduce of [sum dy, sum dy*xhat] per channel. Each rank's dy is that of its
              share of the step's mean loss, so these global sums are the mean loss's, as the
              gradient allreduce's sum is later.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, comm):
        dims, shape, c = [0] + list(range(2, x.dim())), [1, -1] + [1] * (x.dim() - 2), x.size(1)
        x64 = x.double()
        stats = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), x64.new_full([1], x.numel() / c)])
        buffer = mpi_buffer(stats)
        comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        stats = from_mpi(stats, buffer)
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean  # biased, used to normalize
        running_mean.mul_(1 - momentum).add_(momentum * mean.float())
        running_var.mul_(1 - momentum).add_(momentum * (var * n / (n - 1)).float())
        invstd = torch.rsqrt(var + eps).float()
        xhat = (x - mean.float().view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.comm, ctx.n, ctx.dims, ctx.shape = comm, n.item(), dims, shape
        return xhat * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        c, shape = weight.numel(), ctx.shape
        sums = torch.cat([dy.sum(ctx.dims), (dy * xhat).sum(ctx.dims)])
        grad_bias, grad_weight = sums[:c].clone(), sums[c:].clone()  # this rank's, before the sum
        buffer = mpi_buffer(sums)
        ctx.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        total = from_mpi(sums, buffer)
        mean_dy, mean_dy_xhat = (total[:c] / ctx.n).view(shape), (total[c:] / ctx.n).view(shape)
        dx = (weight * invstd).view(shape) * (dy - mean_dy - xhat * mean_dy_xhat)
        return dx, grad_weight, grad_bias, None, None, None, None, None


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
    """Where MPI writes a result for t: t itself, or an empty pinned host buffer. Never a copy of t:
    MPI overwrites it, and the copy would cost a transfer from the device."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if t.is_cuda and not CUDA_AWARE else mpi_buffer(t)


def from_mpi(t, buffer):
    """Copy back: what MPI wrote into the host copy of t goes into t; returns t."""
    if buffer is not t:
        t.copy_(buffer)
    return t


class BatchNorm(nn.BatchNorm2d):
    """nn.BatchNorm for 2-D and 4-D inputs; statistics over all ranks when given a communicator."""

    def __init__(self, channels, comm=None):
        super().__init__(channels)
        self.comm = comm

    def _check_input_dim(self, x):
        if x.dim() not in (2, 4):
            raise ValueError(f"expected 2-D or 4-D input, got {x.dim()}-D")

    def forward(self, x):
        x = x.float()  # statistics in float32: under autocast a convolution hands on bf16
        if not (self.training and self.comm is not None):
            return super().forward(x)
        self.num_batches_tracked += 1
        return SyncBatchNormFunction.apply(x, self.weight, self.bias, self.running_mean,
                                           self.running_var, self.eps, self.momentum, self.comm)


def replicate(args, comm, device, sync_bn_comm=None):
    """The model from the seed, rank 0's copy broadcast to all and proven identical, its
    optimizer, and the buckets that will sum its gradients over comm."""
    model = build_model(args.seed, device, sync_bn_comm if args.sync_bn else None)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            buffer = mpi_buffer(t.data) if comm.Get_rank() == 0 else receive_buffer(t.data)
            comm.Bcast(buffer, root=0)
            from_mpi(t.data, buffer)
    sums = comm.allgather(checksum(model))
    if len(set(sums)) != 1:
        raise RuntimeError(f"model differs across ranks after broadcast: checksums {sums}")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    buckets = GradBuckets(model.parameters(), comm, args.bucket_mb * 2**20, not args.no_overlap)
    return model, optimizer, buckets


def count_targets(comm, labels):
    """The step's count of valid targets, over the ranks (comm) and the micro-steps (labels: this
    rank's whole slice, made on the CPU): one allreduce of a number, before the forward. --ragged
    makes about half the samples padding (a blank image, its target IGNORE), spread unevenly over
    the ranks, and each rank divides its losses' sum by this count. A per-rank mean, averaged over
    the ranks, would weigh each target of a rank that holds fewer of them more: a gradient that is
    not one process's on the whole batch."""
    count = (labels != IGNORE).sum().double().reshape(1)
    comm.Allreduce(MPI.IN_PLACE, count, op=MPI.SUM)
    return count.item()


def train_step(model, optimizer, buckets, images, labels, count, accum_steps, timeline, precision="fp32", clip=0.0):
    """One optimizer step on this rank's slice, cut into accum_steps micro-batches; count: the step's
    valid targets over every rank. Returns this rank's share of the loss and the gradient norm. In
    bf16, forward and loss under autocast; backward outside it (it follows the forward's casts)."""
    optimizer.zero_grad(set_to_none=False)
    total = torch.zeros((), device=images.device)
    for k in range(accum_steps):
        x, y = slice_of(images, labels, k, accum_steps)
        with timeline.span("compute", "forward"), autocast(x.device, precision):  # the loss in float32
            loss = F.cross_entropy(model(x).float(), y, ignore_index=IGNORE, reduction="sum") / count
        total += loss.detach()  # on the device: no synchronization until the step ends

        def backward():
            with timeline.span("compute", "backward"):
                loss.backward()

        if k < accum_steps - 1:
            backward()  # gradients accumulate locally; no exchange
        else:
            buckets.reduce(backward)
    with timeline.span("compute", "optimizer"):
        norm = clip_gradients(model, clip)
        optimizer.step()
    return total.item(), norm.item()


# -----------------------------------------------------------------------------
# The model: LeNet-5 with BatchNorm, built from the seed, the same at every world size
# -----------------------------------------------------------------------------
class LeNet(nn.Module):
    """LeNet-5 (LeCun et al. 1998) with BatchNorm after each of the first three layers.

    tanh and average pooling, as in the original, rather than ReLU and max pooling: training is
    then a smooth function of the weights, so float32 rounding differences stay at rounding
    level. With ReLU and max pooling a 1e-7 nudge of one weight grew to 3e-2 in 150 steps of
    single-process training, and no tolerance could tell a bug from that chaos.
    """

    def __init__(self, comm=None):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 6, 5, padding=2), BatchNorm(6, comm)
        self.conv2, self.bn2 = nn.Conv2d(6, 16, 5), BatchNorm(16, comm)
        self.fc1, self.bn3 = nn.Linear(16 * 5 * 5, 120), BatchNorm(120, comm)
        self.fc2, self.fc3 = nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.avg_pool2d(torch.tanh(self.bn1(self.conv1(x))), 2)  # 28x28 -> 14x14
        x = F.avg_pool2d(torch.tanh(self.bn2(self.conv2(x))), 2)  # 10x10 -> 5x5
        x = torch.tanh(self.bn3(self.fc1(x.flatten(1))))
        return self.fc3(torch.tanh(self.fc2(x)))


def build_model(seed, device, comm=None):
    """The full model from the seed: the same network at every world size."""
    torch.manual_seed(seed)
    return LeNet(comm).to(device)


def checksum(model):
    """A bitwise fingerprint of every parameter and buffer."""
    crc = 0
    for t in list(model.parameters()) + list(model.buffers()):
        crc = zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes(), crc)
    return crc


# -----------------------------------------------------------------------------
# The data: ten classes of smooth random 28x28 patterns under heavy noise, made from the seed
# -----------------------------------------------------------------------------
CLASSES, NOISE = 10, 4.0
IGNORE = -100  # the target of a padding sample (--ragged): F.cross_entropy's ignore_index leaves it out


def prototypes(seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(CLASSES, 1, 28, 28, generator=g)
    smooth = F.avg_pool2d(F.pad(raw, (3, 3, 3, 3), mode="circular"), 7, stride=1)
    return (smooth - smooth.mean()) / smooth.std()


def make_batch(seed, step, size, ragged=False):
    """The global batch of one step: a function of (seed, step) alone, so any rank can cut it. ragged:
    then one more draw per sample, from the same generator, makes about half of them padding."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    labels = torch.randint(CLASSES, (size,), generator=g)
    images = prototypes(seed)[labels] + NOISE * torch.randn(size, 1, 28, 28, generator=g)
    if ragged:
        padding = torch.randint(2, (size,), generator=g).bool()
        images[padding], labels[padding] = 0.0, IGNORE
    return images, labels


def slice_of(images, labels, index, count):
    n = images.size(0) // count
    return images[index * n:(index + 1) * n], labels[index * n:(index + 1) * n]


def autocast(device, precision):
    """bf16: convolutions and linear layers compute in bfloat16 on float32 weights; fp32: nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def learning_rate(args, step):
    """A function of the step alone, so a resumed run continues it. The peak: --lr, or with --scale-lr
    Goyal et al.'s linear scaling rule, reached by a linear warm-up from --lr (without it, from 0 as
    in a GPT's recipe). After the warm-up, constant, or a cosine towards a tenth of the peak."""
    peak = args.lr * args.batch_size / args.base_batch if args.scale_lr else args.lr
    if step < args.warmup_steps:
        low = args.lr if args.scale_lr else 0.0
        return low + (peak - low) * (step + (0 if args.scale_lr else 1)) / args.warmup_steps
    if args.lr_schedule == "constant":
        return peak
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return peak / 10 + 0.45 * peak * (1 + math.cos(math.pi * progress))


def clip_gradients(model, max_norm):
    """The global gradient norm, in float32, and the clip to max_norm (0: none). After the allreduce
    every rank holds the same summed gradient, so the norm needs no exchange: a norm of a rank's
    own gradient before it would be a different number on every rank, and the replicas would part."""
    norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    if max_norm:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for p in model.parameters():
            p.grad.mul_(scale)
    return norm


def accuracy(model, seed, device):
    images, labels = make_batch(seed, -1, 2000)  # step -1: a held-out batch never trained on
    model.eval()
    with torch.no_grad():
        correct = (model(images.to(device)).argmax(1) == labels.to(device)).float().mean().item()
    model.train()
    return correct


# -----------------------------------------------------------------------------
# The run: the step loop, and main() as a table of contents
# -----------------------------------------------------------------------------
def train(args, comm, device, model, optimizer, buckets, timeline, past=(), world_sizes=(), norms=(),
          count_comm=None):
    """The steps after the `past` ones (their global losses and gradient norms, from a checkpoint);
    count_comm: the communicator of --ragged's count (default comm). Returns this rank's shares of
    the new steps' losses, every step's gradient norm and the timings."""
    rank, world_size = comm.Get_rank(), comm.Get_size()
    losses, records, norms = [], [], list(norms)
    for step in range(len(past), args.steps):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        images, labels = slice_of(*make_batch(args.seed, step, args.batch_size, args.ragged), rank, world_size)
        # Without padding every sample is a target: the count is the batch size, no exchange needed
        count = count_targets(count_comm or comm, labels) if args.ragged else args.batch_size
        loss, norm = train_step(model, optimizer, buckets, images.to(device), labels.to(device), count,
                                args.accum_steps, timeline, args.precision, args.clip_grad)
        losses.append(loss)
        norms.append(norm)
        records.append(timeline.step_record(start))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            step_loss = comm.allreduce(losses[-1])  # the shares summed; reporting only, not counted
            print_progress(comm, args, step, step_loss, records[-1], norm)
        checkpoint_if_due(comm, args, step, lambda: data_parallel_shard(
            comm, model, optimizer, list(past) + global_losses(comm, losses),
            list(world_sizes) + [world_size] * len(losses), norms), {"model": "LeNet-5+BN"})
    return losses, records, norms


def global_losses(comm, losses):
    """Every rank's loss is its share of the step's; the step's loss is their sum."""
    total = torch.tensor(losses, dtype=torch.float64)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    return total.tolist()


def average_buffers(model, comm):
    """Per-rank BatchNorm keeps per-rank running statistics: average them into one model. A
    convention (as DDP's broadcast of rank 0's is another): the mean of the per-rank variances
    leaves out the variance of the per-rank means."""
    for b in model.buffers():
        if b.is_floating_point():
            buffer = mpi_buffer(b.clone())
            comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            b.copy_(buffer / comm.Get_size())


def main(argv=None, comm=MPI.COMM_WORLD):
    """Parse, set up, train, check, report. Returns the exit status of this rank."""
    try:
        args = parse_args(argv, comm.Get_size())
        check_paths(comm, args)
        run = setup(comm, args)
        counted = {name: CountedComm(comm, run.timeline) for name in ("gradients", "syncbn", "targets")}
        model, optimizer, buckets = replicate(args, counted["gradients"], run.device, counted["syncbn"])
        for c in counted.values():
            c.reset()  # count the training steps only
        past, world_sizes, norms, resumed = [], [], [], None
        if args.resume:
            resumed, blocks = load_checkpoint(comm, args.save, {"model": "LeNet-5+BN"}, everything_saved, args.steps)
            if blocks is not None:
                past, world_sizes, norms = restore(comm, model, optimizer, resumed, blocks)
        print_header(comm, args, run, model, buckets, resumed)
        run.memory.reset()  # the peak of training alone: not the model's building, nor the check
        losses, records, norms = train(args, comm, run.device, model, optimizer, buckets, run.timeline,
                                       past, world_sizes, norms, counted["targets"])
        run.memory.stop()
    except ConfigError as e:
        print0(comm, f"error: {e}", file=sys.stderr)
        return e.status
    losses = past + global_losses(comm, losses)
    if not args.sync_bn:
        average_buffers(model, comm)
    if len(set(comm.allgather(checksum(model)))) != 1:
        raise RuntimeError("model replicas diverged")
    world_sizes += [comm.Get_size()] * (args.steps - len(world_sizes))
    diff = check(comm, args, run.device, losses, norms, model, world_sizes) if args.check else None
    if args.trace:
        write_trace(comm, run.timeline, args.trace)
    return report(comm, args, run, model, buckets, losses, norms, records, counted, diff)


# =============================================================================
# You may stop reading here: the strategy is all above. Below, first this file's own machinery
# (the check against single-process training, the report, its arguments and checkpoints), then
# the machinery that every strategy file repeats word for word: the summary, checkpoints and
# signals, counters, timeline and memory, device and MPI setup, arguments.
# =============================================================================

# --- This file's own: the check against single-process training, the report, arguments, checkpoints
# What the reference shares with the ranks, and why each is harmless: LeNet and build_model (the
# network: a bug there trains alike at every N and proves nothing about the exchange), make_batch
# (the data, a function of the step alone), torch's SGD and F.cross_entropy, autocast
# (torch.autocast, or nothing), and the BatchNorm class, which without a communicator is nn.BatchNorm2d. What
# the check proves is written here anew: the schedule (not learning_rate, so that its bug shows), which
# samples each rank and micro-step takes (index arithmetic, not slice_of), the loss's divisor (the whole
# batch's valid targets, counted at once: no allreduce, no IGNORE), the gradients' sum (one backward
# of each slice's share, no GradBuckets), --sync-bn's statistics (torch's BatchNorm on the joined
# batch, not SyncBatchNormFunction) and the running statistics' mean over the ranks.
def reference_training(args, world_sizes, device):
    """The same steps in one plain process: no MPI, plain nn.BatchNorm. world_sizes[step] is
    the world size that ran the step (a job may resume at another).

    --sync-bn: each accumulation micro-step is one batch made of every rank's slice.
    Otherwise: every rank's micro-batches one after another, each with its own statistics;
    each rank's running statistics start from the same values and are averaged over the ranks
    (they are linear in the batch statistics, so averaging once at the end, as the ranks do,
    gives the same). Either way each piece's loss is its sum over the step's valid targets.
    """
    model = build_model(args.seed, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    k_steps, losses, norms = args.accum_steps, [], []
    lr, w, rest = args.lr, args.warmup_steps, args.steps - args.warmup_steps  # the schedule, written out
    peak = lr * args.batch_size / args.base_batch if args.scale_lr else lr
    rise = [lr + (peak - lr) * k / w if args.scale_lr else peak * (k + 1) / w for k in range(w)]
    schedule = rise + [peak if args.lr_schedule == "constant" else
                       peak / 10 + 0.45 * peak * (1 + math.cos(math.pi * k / max(1, rest))) for k in range(rest)]
    for step in range(args.steps):
        world_size = world_sizes[step]
        for group in optimizer.param_groups:
            group["lr"] = schedule[step]
        images, labels = make_batch(args.seed, step, args.batch_size, args.ragged)
        images, labels = images.to(device), labels.to(device)
        valid = (labels != -100).sum()  # the step's targets (F.cross_entropy's default ignore_index: -100)
        m = args.batch_size // (world_size * k_steps)  # samples per rank and micro-step
        cut = [[slice((r * k_steps + k) * m, (r * k_steps + k + 1) * m) for r in range(world_size)]
               for k in range(k_steps)]  # rank r's k-th micro-batch: the (r K + k)-th m samples
        slices = [[(images[c], labels[c]) for c in per_rank] for per_rank in cut]
        optimizer.zero_grad()
        total = 0.0
        if args.sync_bn:
            for per_rank in slices:
                x, y = torch.cat([s[0] for s in per_rank]), torch.cat([s[1] for s in per_rank])
                with autocast(device, args.precision):
                    loss = F.cross_entropy(model(x).float(), y, reduction="sum") / valid
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
                    with autocast(device, args.precision):
                        loss = F.cross_entropy(model(x).float(), y, reduction="sum") / valid
                    loss.backward()
                    total += loss.item()
                for acc, b in zip(after, model.buffers()):
                    acc += b
            for b, acc in zip(model.buffers(), after):
                b.copy_(acc / world_size if b.is_floating_point() else b)
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or math.inf).item())
        optimizer.step()
        losses.append(total)
    return losses, norms, model

def check(comm, args, device, losses, norms, model, world_sizes):
    """Rank 0 trains the reference (the replicated model fits where one rank's does) and
    compares the losses, gradient norms and parameters; every rank gets the largest difference."""
    diff = None
    if comm.Get_rank() == 0:
        ref_losses, ref_norms, ref_model = reference_training(args, world_sizes, device)
        diff = max_difference(losses + norms, model.state_dict(), ref_losses + ref_norms, ref_model)
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)  # the other ranks leave the cores to rank 0, which trains the reference
    return comm.bcast(diff, root=0)

def print_header(comm, args, run, model, buckets, resumed):
    params = sum(p.numel() for p in model.parameters())
    if resumed:
        print0(comm, f"resumed from {args.save} at step {resumed['step']} "
                     f"(written by {resumed['world_size']} ranks)")
    print0(comm, *run.header,
           f"model: LeNet-5 + BatchNorm, {params:,} parameters ({4 * params / 1e6:.2f} MB) | "
           f"{len(buckets.buckets)} bucket(s) of {' + '.join(f'{sum(p.numel() * p.element_size() for p in b):,}' for b in buckets.buckets)} bytes (cap {args.bucket_mb:g} MB), "
           f"{'no overlap' if args.no_overlap else 'overlapped with backward'}",
           f"global batch {args.batch_size} = {comm.Get_size()} ranks x {args.accum_steps} micro-steps "
           f"x {args.batch_size // (comm.Get_size() * args.accum_steps)} | BatchNorm: "
           f"{'synchronized over ranks' if args.sync_bn else 'per rank'}"
           + (" | ragged: about half the samples padding, the loss over the valid targets" if args.ragged else ""))

def report(comm, args, run, model, buckets, losses, norms, records, counted, diff):
    """The summary, the check's verdict and --json; returns the exit status."""
    world_size, steps_run = comm.Get_size(), max(1, len(records))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    calls = {k: sum(c.calls.values()) / steps_run for k, c in counted.items()}
    volume = {k: sum(c.bytes.values()) / steps_run for k, c in counted.items()}
    ring = 2 * (world_size - 1) / world_size * grad_bytes
    acc = accuracy(model, args.seed, run.device)
    lines = [f"final loss {losses[-1]:.4f} | accuracy {100 * acc:.1f}% on 2000 held-out samples "
             f"(chance {100 / CLASSES:.0f}%)",
             f"gradient allreduce: {calls['gradients']:g} call(s), {volume['gradients']:,.0f} bytes/step "
           f"(G = {grad_bytes:,}); a ring moves 2(N-1)/N x G = {ring:,.0f} bytes per rank"
           + (f" | sync-BN: {calls['syncbn']:g} allreduces, {volume['syncbn']:,.0f} bytes/step"
              if args.sync_bn else "")
           + (f" | the count of valid targets: {calls['targets']:g} allreduce, {volume['targets']:,.0f} bytes/step"
              if args.ragged else "")]
    overlap = {"buckets_posted_before_later_gradients": posted_in_time(buckets)}
    return finish(comm, args, run, losses, records, diff, "losses, gradient norms, parameters, buffers", lines, {
        "grad_norms": norms,
        "comm_bytes_per_step": sum(volume.values()), "collectives_per_step": sum(calls.values()),
        "accuracy": acc, "grad_bytes": grad_bytes, "ring_bytes_per_rank": ring,
        "buckets": len(buckets.buckets), "overlap": overlap, "sync_bn": args.sync_bn, "ragged": args.ragged})

def posted_in_time(buckets):
    """[n, total] in the last step: of the gradient allreduces, how many were posted before
    backward computed some later gradient, so that backward had work left to hide them behind.
    From GradBuckets' marks, as the step ran: the last bucket closes with the last gradient and
    never counts, nor does --no-overlap's one allreduce after backward."""
    return [sum(mark < buckets.computed for mark in buckets.posted_at), len(buckets.posted_at)]

def parse_args(argv, world_size):
    p = common_arguments("Data parallelism over MPI: a LeNet with BatchNorm on synthetic images.",
                         steps=150, batch_size=64, lr=0.02, log_every=25)
    p.add_argument("--bucket-mb", type=AMOUNT, default=25.0, help="gradient bucket size in MB")
    p.add_argument("--no-overlap", action="store_true", help="baseline: one blocking allreduce after backward")
    p.add_argument("--accum-steps", type=COUNT, default=1, help="gradient accumulation: micro-steps per step")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks")
    p.add_argument("--ragged", action="store_true",
                   help="about half the samples are padding (a blank image, no target): ranks hold uneven counts")
    p.add_argument("--scale-lr", action="store_true", help="linear scaling rule: lr x batch-size / base-batch")
    p.add_argument("--base-batch", type=COUNT, default=32, help="the batch --lr was tuned for")
    p.add_argument("--warmup-steps", type=COUNT_OR_0, default=0,
                   help="linear warm-up: from --lr to the scaled peak with --scale-lr, else from 0 to --lr")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="after the warm-up: constant, or a cosine towards a tenth of the peak, reached after the last step")
    p.add_argument("--clip-grad", type=float, default=0.0, metavar="MAX_NORM",
                   help="clip the global gradient norm to MAX_NORM (0: no clipping)")
    args = check_common(p.parse_args(argv))
    if not args.clip_grad >= 0 or args.warmup_steps >= args.steps > 0 < args.warmup_steps:
        raise ConfigError(f"--clip-grad {args.clip_grad:g} must be 0 (off) or more" if not args.clip_grad >= 0 else
                          f"--warmup-steps {args.warmup_steps} leaves no step after the warm-up of --steps "
                          f"{args.steps}; use fewer warm-up steps")
    if args.recompute != "none":
        raise ConfigError(f"--recompute {args.recompute}: data_parallel.py's LeNet-5 has no transformer "
                          f"blocks to recompute; leave --recompute at none")
    slices = world_size * args.accum_steps
    if args.batch_size % slices:
        raise ConfigError(f"--batch-size {args.batch_size} does not split into {world_size} ranks x "
                          f"{args.accum_steps} accumulation steps; use a multiple of {slices}, "
                          f"e.g. {slices}, {2 * slices}, {3 * slices}")
    return args

def data_parallel_shard(comm, model, optimizer, losses, world_sizes, norms):
    """What rank 0 saves: the model, SGD's momentum, every rank's BatchNorm statistics (they differ
    without --sync-bn), and as state the losses so far and the world size of each step. Collective."""
    buffers = torch.cat([b.reshape(-1) for b in model.buffers() if b.is_floating_point()]).cpu()
    every = torch.empty(comm.Get_size(), buffers.numel()) if comm.Get_rank() == 0 else None
    comm.Gather(buffers, every, root=0)
    if comm.Get_rank() != 0:
        return {}, None
    pieces = {name: piece(t) for name, t in model.state_dict().items()}
    pieces.update({f"momentum/{name}": piece(optimizer.state[p]["momentum_buffer"])
                   for name, p in model.named_parameters() if optimizer.state[p].get("momentum_buffer") is not None})
    pieces["buffers_per_rank"] = piece(every)
    return pieces, {"losses": list(losses), "world_sizes": list(world_sizes), "grad_norms": list(norms)}

def restore(comm, model, optimizer, manifest, blocks):
    """Load a data-parallel checkpoint at any world size: the model is replicated (rank 0 reads the
    one file and broadcasts it). Each rank takes its own BatchNorm statistics when the world size is
    unchanged, else their mean. Returns the losses so far, each step's world size and gradient norm."""
    model.load_state_dict({name: blocks[name] for name in model.state_dict()})
    for name, p in model.named_parameters():
        if f"momentum/{name}" in blocks:
            optimizer.state[p]["momentum_buffer"] = blocks[f"momentum/{name}"].to(p.device)
    saved = blocks["buffers_per_rank"]
    row = saved[comm.Get_rank()] if saved.size(0) == comm.Get_size() else saved.mean(0)
    offset = 0
    for b in (b for b in model.buffers() if b.is_floating_point()):
        b.copy_(row[offset:offset + b.numel()].view_as(b))
        offset += b.numel()
    return manifest["state"]["losses"], manifest["state"]["world_sizes"], manifest["state"]["grad_norms"]

def everything_saved(manifest):
    """What a resuming rank asks for, whatever the world size that saved: all of rank 0's one file."""
    return {key: region(shape) for key, (shape, _, _) in manifest["files"]["rank-0.pt"]["pieces"].items()}

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
