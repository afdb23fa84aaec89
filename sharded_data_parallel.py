r"""Sharded data parallelism over MPI (ZeRO): data parallelism that keeps 1/N of the state per rank.

What is split: the data, as in data parallelism (each of the N ranks trains on B/N samples of the
global batch), and also what plain data parallelism repeats on every rank: Adam's moments (stage
1), the gradients (stage 2) and the parameters themselves (stage 3), as in ZeRO (Rajbhandari et al.
2020), which DeepSpeed and PyTorch's FSDP implement. Each layer's parameters form one flat vector,
padded with zeros to a multiple of N; rank r owns partition r of every layer, and updates only it.

  one layer's flat vector on N = 4 ranks:  [ w w w w w w w w w w w w w w 0 0 ]  (padding: 0 0)
                                           | part 0 | part 1 | part 2 | part 3 |
                                             rank 0   rank 1   rank 2   rank 3

              parameters   gradients   Adam moments  one step, layer by layer
  plain DP    whole        whole       whole         allreduce(gradients), every rank steps all
  stage 1     whole        whole       its part      after backward: reduce-scatter(gradients),
                                                     step its part, all-gather(parameters)
  stage 2     whole        its part    its part      during backward: each layer's reduce-scatter
                                                     starts when its gradients are in (a bucket)
  stage 3     its part     its part    its part      before a layer's forward: all-gather it, free
              (+ gathered layers)                    it after; again before its backward; its
                                                     reduce-scatter as in stage 2; the next layer's
                                                     gather starts while this one computes

Memory per rank at the peak of a step, for Psi parameters (padding included), with AdamW:
            float32 (4 + 4 + 8 bytes)     bf16 (2 + 4 + 12 bytes)
  plain DP  16 Psi + A                    18 Psi + A           A: the activations autograd keeps
  stage 1   8 Psi + 8 Psi / N + A         6 Psi + 12 Psi / N + A     for backward (B/N samples)
  stage 2   4 Psi + 12 Psi / N + W + A    2 Psi + 16 Psi / N + W + A   W: 4 bytes x the largest
  stage 3   16 Psi / N + 2 W + A          16 Psi / N + 1.5 W + A       two neighbouring layers
W is transient: stage 3 gathers a layer before it computes and the next one while it does (W;
bf16 W / 2); stages 2 and 3 hold a layer's whole gradient from its first gradient in backward to
its reduce-scatter's end, two at most (W). bf16 is Megatron's count (float32 gradients); the
paper's has 2-byte gradients: stage 1 4 Psi + 12 Psi / N, stage 2 2 Psi + 14 Psi / N.

Mixed precision, --precision bf16: each layer's whole vector, what forward and backward compute
with, is bf16 (ZeRO's 2-byte parameters); every stage keeps this rank's partition apart as a
float32 master (4 Psi / N) that AdamW steps and rounds into its part of the whole vector. Autocast
casts each activation to bf16 as a matmul takes it; LayerNorm, softmax, the loss and the residual
stream stay float32 (.float(): on the CPU autocast leaves them in their input's dtype). Gradients
leave backward in bf16 (as in FSDP's mixed precision), are added into the float32 whole gradient
and reduce-scattered in float32, as Megatron does: MPI has no bf16 sum, and bf16 sums round away.

Communication per step, for G = 4 Psi bytes: stages 1 and 2 reduce-scatter the gradients and
all-gather the parameters, one call of each per layer; a ring moves (N-1)/N of each vector in and
out of each rank: 2(N-1)/N x G, what an allreduce (a reduce-scatter, then an all-gather) moves.
Stage 3 all-gathers twice (before forward and backward): 3(N-1)/N x G, 1.5 times that. bf16: the
reduce-scatter float32 (G), each all-gather bf16 (G / 2): 1.5 G, stage 3 2 G, x (N-1)/N.
--no-overlap, the baseline: stages 2 and 3 reduce-scatter after backward, stage 3 never prefetches.

The recipe (--clip-grad, --lr-schedule cosine, --warmup-steps): the clip needs the whole model's
gradient norm, which ZeRO holds once between the ranks: each rank's sum of squares of its reduced
partitions, summed by one Allreduce of 4 bytes, counts each element once (ZeRO.global_grad_norm).
--ragged: a rank's loss is its valid targets' sum / the step's count, one Allreduce of 8 bytes more.

A, for b = B/N sequences of s characters, hidden h, a heads, L blocks, V = 128: 8bs + 8s (indices),
the head's 8bsh (bf16 6bsh) + 16bs + 4bsV + 4 (LayerNorm, float32 logits, targets), L blocks of
  --recompute   float32                          bf16
  none          64bsh + 16bs + 4abs^2 + s^2      40bsh + 16bs + 6abs^2 + s^2
  selective     64bsh + 16bs                     40bsh + 16bs        full: 4bsh (float32 input)
none: LayerNorms' float32 inputs (16bs of statistics), the matmuls' inputs (bf16: LayerNorm's
output cast for q, k and v each), q, k, v, the MLP's two 4h-wide; the s^2 core: the float32 softmax
(bf16: and its cast), the mask. selective reruns the core in backward (Korthikanti et al. 2022),
full each block: one more forward. Both by checkpoint(fn, ..., use_reentrant=True): it keeps fn's
inputs by save_for_backward (seen by saved-tensor hooks), reruns fn in backward under forward's
autocast and backpropagates (stage 3: through the layer gathered for backward: no more bytes move).
The network: tensor_parallel.py's GPT, no key bias (see Block); the text: argparse, textwrap, shlex.

When to choose it: the model trains with data parallelism, but its parameters, gradients and
optimizer state do not fit on one device. Stages 1 and 2 cost nothing in traffic, so take them
first; stage 3 pays 1.5 times the traffic for memory that falls as 1/N.

Run:  mpirun -np 4 python sharded_data_parallel.py --zero-stage 3      (add --help for the flags)
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
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
import mpi4py

mpi4py.rc.initialize = False  # MPI starts in start_mpi(), once this rank's GPU is chosen
mpi4py.rc.finalize = True  # and ends when the process does
from mpi4py import MPI  # noqa: E402

STRATEGY = "sharded_data_parallel"
TOLERANCE = 2e-5  # largest |difference| from one process (float32); measured (check()): 6.0e-7 to 2.4e-6
TOLERANCE_BF16 = 2e-2  # bf16 (check()): 7.6e-3, N = 3, the default 50 steps; at most 1.8e-3 in the tests' GPTs
POLL_S = 1e-4  # a rank waiting on MPI sleeps between polls and leaves the core to ranks that compute
SOURCES, VOCAB = ("argparse", "textwrap", "shlex"), 128  # the text: these modules' source; ASCII codes
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-6, 0.01  # AdamW's, as in BERT; EPS: see check()


# -----------------------------------------------------------------------------
# The strategy: each rank owns 1/N of every layer's flat parameter vector, and steps only it
# -----------------------------------------------------------------------------
class FlatLayer:
    """A layer's parameters as one flat vector `whole`, padded with zeros to a multiple of N; rank r's
    partition: elements [r S, (r + 1) S), S = padded / N. The module's parameters become views into
    `whole`, which stage 3 frees between uses: `state` "whole", "gathering" (in flight) or "free"."""

    def __init__(self, module, comm, stage, device, dtype=torch.float32):
        self.params, world_size, rank = list(module.parameters()), comm.Get_size(), comm.Get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.size = -(-self.numel // world_size)  # a partition: the layer, padded to a multiple of N, / N
        self.padded, self.mine = self.size * world_size, slice(rank * self.size, (rank + 1) * self.size)
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        master = F.pad(flat, (0, self.padded - self.numel)).to(device)  # float32: the weights AdamW updates
        self.whole = master.to(dtype)  # what forward and backward use (float32: master itself)
        for p, view in zip(self.params, self.views(self.whole)):
            p.data = view
        # What AdamW steps, this rank's float32 partition: in float32 at stages 1 and 2 a view into
        # `whole` (the all-gather then runs in place); else its own (stage 3 frees `whole`; bf16 rounds)
        self.partition = master[self.mine] if stage < 3 and dtype == torch.float32 else master[self.mine].clone()
        # Stage 1 keeps a whole float32 gradient (the sum of my part lands in my part of it, AdamW's
        # gradient); stages 2 and 3 keep their part alone, and the whole one briefly (see ZeRO)
        self.grad_whole, self.state, self.request = None, "whole", None
        if stage == 1:
            self.grad_whole = torch.zeros(self.padded, device=device)
            for p, view in zip(self.params, self.views(self.grad_whole)):
                p.grad = view if dtype == torch.float32 else None  # bf16: ZeRO adds it in
        self.partition.grad = self.grad_whole[self.mine] if stage == 1 else torch.zeros(self.size, device=device)
        if stage == 3:
            self.free()

    def gather(self, comm):
        """Stage 3: give `whole` its memory back and start the all-gather that refills it."""
        self.whole.untyped_storage().resize_(self.padded * self.whole.element_size())
        self.buffer = gather_buffer(self.whole, self.mine, self.partition.detach(), nonblocking=True)
        self.request, self.state = comm.Iallgather(MPI.IN_PLACE, self.buffer), "gathering"

    def wait_gathered(self):
        self.request.Wait()
        from_mpi(self.whole, self.buffer)
        self.request, self.buffer, self.state = None, None, "whole"

    def views(self, flat):
        """Views into a flat vector of this layer, one shaped like each parameter, in order."""
        chunks = flat[:self.numel].split([p.numel() for p in self.params])
        return [chunk.view_as(p) for chunk, p in zip(chunks, self.params)]

    def free(self):
        """Give back the whole vector's memory. The views (and autograd's saved tensors, views
        too) keep their shapes, and see the values again once the next gather refills it."""
        self.whole.untyped_storage().resize_(0)
        self.state = "free"


class ZeRO:
    """AdamW on this rank's partitions, and the exchange of ZeRO stage 1, 2 or 3 around it.
    Stage 1: backward adds into whole gradients; then per layer a Reduce_scatter_block leaves each
    rank the sum of its partition, AdamW steps it, and an Allgather brings back every partition.
    Stage 2: a layer's first gradient allocates its whole gradient; a post-accumulate-grad hook
    counts them, and with the last the layer's Ireduce_scatter_block starts while backward goes on.
    Stage 3: forward hooks all-gather a layer before its forward (and start the next one's) and
    free it after; a hook on its output gathers it again before its backward; then as stage 2.
    Spans named after the layer ("gather 3", "before forward 3") show what was prefetched."""

    def __init__(self, model, comm, stage, lr, device, timeline, overlap=True, dtype=torch.float32):
        self.comm, self.stage, self.world_size, self.device = comm, stage, comm.Get_size(), device
        self.timeline, self.overlap, self.in_backward = timeline, overlap, False
        self.layers = [FlatLayer(m, comm, stage, device, dtype) for m in model.layers]
        self.optimizer = torch.optim.AdamW([layer.partition for layer in self.layers], lr=lr, betas=BETAS, eps=EPS,
                                           weight_decay=WEIGHT_DECAY)  # this rank's partitions
        # arrived: gradients in, per layer; in_flight: the reduce-scatter under way (a layer's whole
        # gradient, its buffers and request); deferred: --no-overlap's layers waiting for backward's end
        self.arrived, self.in_flight, self.deferred = [0] * len(self.layers), None, []
        for i, (layer, module) in enumerate(zip(self.layers, model.layers)):
            for k, p in enumerate(layer.params):
                if stage >= 2:
                    p.register_hook(lambda grad, i=i: self._grad_arriving(i))
                if stage >= 2 or dtype != torch.float32:
                    p.register_post_accumulate_grad_hook(lambda p, i=i, k=k: self._grad_ready(i, k, p))
            if stage == 3:
                module.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
                module.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))

    # --- one optimizer step -------------------------------------------------------------------
    def backward(self, loss, divisor=None):
        """loss.backward() with the gradient exchange; leaves each partition's summed gradient over
        divisor (N: each rank's loss is its slice's mean; --ragged's 1: a share of the step's)."""
        self.arrived = [0] * len(self.layers)
        for layer in self.layers if self.stage == 1 else []:
            layer.grad_whole.zero_()  # autograd adds into it
        with self.timeline.span("compute", "backward"):
            self.in_backward = True  # what autograd saves from here on is recomputed, not kept
            loss.backward()
            self.in_backward = False
        if self.stage == 1:
            for layer in reversed(self.layers):  # into a buffer of its own: not in place, which
                received = receive_buffer(torch.empty(layer.size, device=self.device))  # some CUDA-aware MPIs break
                self.comm.Reduce_scatter_block(mpi_buffer(layer.grad_whole), received, op=MPI.SUM)
                layer.partition.grad.copy_(received)  # from the host where staged
        else:
            assert self.arrived == [len(layer.params) for layer in self.layers], "a gradient never arrived"
            for layer in self.deferred:  # --no-overlap: the reduce-scatters start now
                self.reduce_scatter(layer)
            self.deferred = []
            self.finish_reduce_scatter(wait=True)
        for layer in self.layers:
            layer.partition.grad /= divisor or self.world_size

    def global_grad_norm(self, comm):
        """The whole gradient's norm, alike on every rank, in float32 (bf16 too): rank r holds part
        r of each layer's reduced gradient (the padding's zero), so its squares summed over comm
        (the ranks that hold the distinct parts) count each element once. The local gradient's norm,
        before the reduce-scatter, is a slice's; one rank's partitions alone, no Allreduce, miss
        (N-1)/N: either clips by a wrong scale, another on each rank. Counted, clip or not: 4 bytes."""
        squares = torch.stack([layer.partition.grad.square().sum() for layer in self.layers]).sum().reshape(1)
        buffer = mpi_buffer(squares)
        comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)  # + the other ranks' partitions: the whole gradient
        return from_mpi(squares, buffer).sqrt().item()

    def clip_gradients(self, max_norm, comm):
        """Each rank's partitions scaled to the global norm max_norm (0: not clipped) by
        torch.nn.utils.clip_grad_norm_'s rule, before AdamW steps them; returns the norm before the clip."""
        norm = self.global_grad_norm(comm)
        scale = max_norm / (norm + 1e-6)
        for layer in self.layers if max_norm and scale < 1 else []:
            layer.partition.grad.mul_(scale)
        return norm

    def step(self, lr):
        """AdamW at rate lr on this rank's partitions; stages 1 and 2 then all-gather the parameters."""
        self.optimizer.param_groups[0]["lr"] = lr  # its one group
        self.optimizer.step()
        for layer in self.layers if self.stage < 3 else []:
            buffer = gather_buffer(layer.whole, layer.mine, layer.partition.detach())  # bf16: rounded
            self.comm.Allgather(MPI.IN_PLACE, buffer)
            from_mpi(layer.whole, buffer)

    # --- stages 2 and 3: reduce-scatter each layer's gradients as soon as backward has them --
    def _grad_arriving(self, i):
        """A gradient of layer i is about to be added: the layer's first allocates its whole
        gradient, and autograd adds each into a view of it (no copy into a send buffer)."""
        layer = self.layers[i]
        if layer.grad_whole is None:
            layer.grad_whole = torch.zeros(layer.padded, device=self.device)
            for p, view in zip(layer.params, layer.views(layer.grad_whole)):
                p.grad = view if p.dtype == view.dtype else None  # bf16: _grad_ready adds it in

    def _grad_ready(self, i, k, p):
        """Parameter k of layer i has its gradient; bf16's is added here into the float32 whole one."""
        layer = self.layers[i]
        if p.grad is not None and p.grad.dtype != layer.grad_whole.dtype:
            layer.views(layer.grad_whole)[k].add_(p.grad)
            p.grad = None
        if self.stage == 1:
            return
        self.arrived[i] += 1
        if self.arrived[i] == len(layer.params):  # the layer's whole gradient is in
            for p in layer.params:
                p.grad = None  # the flat vector alone holds it now
            if self.overlap:
                self.reduce_scatter(layer)
            else:
                self.deferred.append(layer)
            if self.stage == 3:
                layer.free()  # every node of its backward has run: each one fed a gradient
        self.progress()

    def reduce_scatter(self, layer):
        """Start summing the layer's whole gradient, my partition of the sum into partition.grad.
        One at a time: with the one backward fills, at most two whole gradients exist."""
        self.finish_reduce_scatter(wait=True)
        send = mpi_buffer(layer.grad_whole, nonblocking=True)
        received = receive_buffer(layer.partition.grad, nonblocking=True)
        request = self.comm.Ireduce_scatter_block(send, received, op=MPI.SUM)
        self.in_flight, layer.grad_whole = (layer, send, received, request), None  # send holds it

    def finish_reduce_scatter(self, wait):
        """Complete the reduce-scatter in flight, if any, once Test says done (or wait for it),
        and let go of its buffers: the layer's whole gradient lives no longer."""
        if self.in_flight is None:
            return
        layer, send, received, request = self.in_flight
        if wait:
            request.Wait()
        elif not request.Test():
            return
        from_mpi(layer.partition.grad, received)
        self.in_flight = None

    def progress(self):
        """MPICH moves a non-blocking collective forward only inside MPI calls: poll them all."""
        self.finish_reduce_scatter(wait=False)
        for layer in self.layers:
            if layer.request is not None:
                layer.request.Test()

    # --- stage 3: gather a layer just before it is needed, free it right after ---------------
    def gather(self, i):
        """Start the all-gather of layer i, unless it is whole or on its way."""
        if self.layers[i].state == "free":
            with self.timeline.span("comm", f"gather {i}"):
                self.layers[i].gather(self.comm)

    def wait_gathered(self, i):
        self.gather(i)
        if self.layers[i].state == "gathering":
            self.layers[i].wait_gathered()

    def _before_forward(self, i):
        with self.timeline.span("compute", f"before forward {i}"):
            self.wait_gathered(i)
            if i + 1 < len(self.layers) and self.overlap:
                self.gather(i + 1)  # prefetch: the next layer arrives while this one computes
            self.progress()

    def _after_forward(self, i, out):
        self.layers[i].free()
        if out.requires_grad:  # runs once out's gradient is in, before layer i's backward
            out.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i):
        with self.timeline.span("compute", f"before backward {i}"):
            self.wait_gathered(i)
            if i > 0 and self.overlap:
                self.gather(i - 1)  # prefetch: backward runs the layers in reverse
            self.progress()


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


def receive_buffer(t, nonblocking=False):
    """Where MPI writes a result for t: t itself where MPI reads GPU memory, else an empty pinned host
    buffer. Never a copy of t: MPI overwrites it, and the copy would cost a transfer from the device."""
    staged = t.is_cuda and not (CUDA_AWARE and not nonblocking)
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if staged else mpi_buffer(t, nonblocking)


def gather_buffer(t, part, mine, nonblocking=False):
    """For an all-gather in place into t: t[part] = mine (this rank's part; bf16: rounded), then t itself, or
    where staged a receive buffer with t[part] alone copied in (1/N of t): MPI sends it and writes the rest."""
    t[part] = mine
    buffer = receive_buffer(t, nonblocking)
    if buffer is not t:
        buffer[part] = t[part]
    return buffer


def from_mpi(t, buffer):
    """Copy back: what MPI wrote into the host copy of t goes into t; returns t."""
    return t if buffer is t else t.copy_(buffer)


def valid_targets(y, comm):
    """--ragged: the step's targets not IGNORE, over the ranks (each holds other sequences):
    one Allreduce of a float64 in host memory, before the forward. A per-rank mean would weigh each
    target of a rank with fewer valid targets more: a gradient that no one process computes."""
    count = torch.tensor([(y != IGNORE).sum().item()], dtype=torch.float64)
    comm.Allreduce(MPI.IN_PLACE, count, op=MPI.SUM)
    return count.item()


def train_step(model, zero, x, y, timeline, lr, bf16=False, max_norm=0.0, count=None):
    """One step at rate lr, the gradient clipped to the global norm max_norm (0: off); count
    (--ragged's valid_targets) divides this rank's sum: its share of the step's loss, the shares'
    gradients summed, not / N. Returns this rank's loss and the norm, before the clip."""
    with timeline.span("compute", "forward"), torch.autocast(x.device.type, torch.bfloat16, enabled=bf16):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE,
                               reduction="sum" if count else "mean") / (count or 1)  # in float32
    zero.backward(loss, 1 if count else None)  # backward, then what the exchange has left to do
    with timeline.span("compute", "optimizer"):
        norm = zero.clip_gradients(max_norm, zero.comm)  # of the reduced partitions; counted
        zero.step(lr)
    return loss.item(), norm


# -----------------------------------------------------------------------------
# The model: the GPT of tensor_parallel.py as a list of layers, without the key bias
# -----------------------------------------------------------------------------
def attend(q, k, v, heads):
    """Causal self-attention of `heads` heads: attention's core (softmax in float32)."""
    b, t, c = q.shape
    q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(c // heads)
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return (weights @ v).transpose(1, 2).reshape(b, t, c)


def layer_norm(norm, x):
    """norm(x) with its statistics and parameters in float32, whatever their dtype."""
    return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps)


class Embedding(nn.Module):
    def __init__(self, hidden, seq_len):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(seq_len, hidden)

    def forward(self, idx):  # the residual stream in float32, as autocast leaves it
        return self.tokens(idx).float() + self.positions(torch.arange(idx.size(1), device=idx.device)).float()


class Block(nn.Module):
    """Pre-LayerNorm decoder block (GELU and LayerNorm keep training smooth in the weights). No key
    bias: the softmax ignores a shift shared by a query's scores, so its gradient is zero exactly and
    rounding noise in float32, which Adam turns into full steps: summing 4 slices instead of one
    batch moved it by 6e-4 in 100 steps, every other parameter by less than 1e-6."""

    def __init__(self, hidden, heads, recompute="none"):
        super().__init__()
        self.heads, self.recompute = heads, recompute
        self.ln1, self.q = nn.LayerNorm(hidden), nn.Linear(hidden, hidden)  # the order of the seed's draws
        self.k, self.v = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden)
        self.proj, self.ln2 = nn.Linear(hidden, hidden), nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        if self.recompute == "full":  # autograd keeps x alone; backward reruns the block first
            return checkpoint(self.body, x, use_reentrant=True)
        return self.body(x)

    def body(self, x):
        a = layer_norm(self.ln1, x)
        q, k, v = self.q(a), self.k(a), self.v(a)
        if self.recompute == "selective":  # keeps q, k, v; backward reruns the core (t x t)
            core = checkpoint(attend, q, k, v, self.heads, use_reentrant=True)
        else:
            core = attend(q, k, v, self.heads)
        x = x + self.proj(core)
        return x + self.fc2(F.gelu(self.fc1(layer_norm(self.ln2, x))))


class Head(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, x):
        return self.out(layer_norm(self.norm, x))


class GPT(nn.Module):
    """Embeddings, --layers blocks, final LayerNorm and untied head: the layers ZeRO flattens."""

    def __init__(self, layers, hidden, heads, seq_len, recompute="none"):
        super().__init__()
        self.layers = nn.ModuleList([Embedding(hidden, seq_len)] + [Block(hidden, heads, recompute)
                                                                    for _ in range(layers)] + [Head(hidden)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_model(args, recompute=None):
    """The full model from the seed, on the CPU: the same network at every world size."""
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.hidden, args.heads, args.seq_len, recompute or args.recompute)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return model


def shard_model(args, comm, device, timeline):
    """The full model from the seed on every rank's CPU; ZeRO keeps on the device what this
    stage keeps. Returns the model (its parameters views into ZeRO's flat vectors) and ZeRO."""
    model, dtype = build_model(args), torch.bfloat16 if args.precision == "bf16" else torch.float32
    return model, ZeRO(model, comm, args.zero_stage, args.lr, device, timeline, not args.no_overlap, dtype)


# -----------------------------------------------------------------------------
# The data: characters of Python's own source, batches a function of (seed, step)
# -----------------------------------------------------------------------------
IGNORE = -100  # --ragged: the target past a document's end (F.cross_entropy's ignore_index)


@functools.cache
def load_text():
    """argparse.py, textwrap.py and shlex.py from this Python, bytes >= 128 replaced by '?'."""
    raw = b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in SOURCES)
    return torch.tensor([b if b < 128 else ord("?") for b in raw], dtype=torch.long)


def make_batch(seed, step, size, seq_len, ragged=False):
    """The global batch of one step: inputs and next-character targets, from (seed, step) alone.
    ragged: a document of 1 to seq_len characters a sequence; past it targets IGNORE, inputs 0."""
    data = load_text()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - seq_len - 1, (size,), generator=gen).tolist()
    x, y = (torch.stack([data[o + i:o + i + seq_len] for o in starts]) for i in (0, 1))
    if ragged:  # drawn after the starts: without it, the batch is what it always was
        past = torch.arange(seq_len) >= torch.randint(1, seq_len + 1, (size, 1), generator=gen)
        x, y = x.masked_fill(past, 0), y.masked_fill(past, IGNORE)
    return x, y


# -----------------------------------------------------------------------------
# The run: the step loop, and main() as a table of contents
# -----------------------------------------------------------------------------
def learning_rate(args, step):
    """Of the step alone: a linear warm-up (--warmup-steps), then --lr or a cosine towards lr/10."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    low, progress = args.lr / 10, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    if args.lr_schedule == "constant":
        return args.lr
    return low + 0.5 * (args.lr - low) * (1 + math.cos(math.pi * progress))


def train(args, comm, device, model, zero, timeline, activations, past=((), ()), config=None):
    """The steps after the `past` ones (their global losses and norms, from a checkpoint), each rank on
    its slice of the batch, `activations` measuring what autograd saves. Returns losses, norms, timings."""
    per_rank, losses, norms, records = args.batch_size // comm.Get_size(), [], [], []
    mine = slice(comm.Get_rank() * per_rank, (comm.Get_rank() + 1) * per_rank)
    for step in range(len(past[0]), args.steps):
        start = time.perf_counter()
        x, y = make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged)
        count = valid_targets(y[mine], zero.comm) if args.ragged else None  # 8 bytes, counted
        with activations:  # copies: autograd keeps b s, not B s
            loss, norm = train_step(model, zero, x[mine].to(device, copy=True), y[mine].to(device, copy=True), timeline,
                                    learning_rate(args, step), args.precision == "bf16", args.clip_grad, count)
        losses.append(loss), norms.append(norm), records.append(timeline.step_record(start))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean_loss = comm.allreduce(losses[-1]) / (1 if args.ragged else comm.Get_size())  # a report: uncounted
            print_progress(comm, args, step, mean_loss, records[-1], norm)
        # A checkpoint is ZeRO's too: each rank saves its partitions of the masters and Adam moments, pieces
        # of the layers' unpadded wholes (zero_shard); a resume on any grid reads its new ranges alone (resume)
        checkpoint_if_due(comm, args, step, lambda: zero_shard(
            zero, list(past[0]) + global_losses(comm, losses, args.ragged), list(past[1]) + norms), config)
    return losses, norms, records


def global_losses(comm, losses, shares=False):
    """Every rank's loss is that of its slice; the step's is their mean (--ragged's shares: sum)."""
    total = torch.tensor(losses, dtype=torch.float64)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    return (total / (1 if shares else comm.Get_size())).tolist()


def main(argv=None, comm=MPI.COMM_WORLD):
    """Parse, set up, train, check, report. Returns the exit status of this rank."""
    try:
        args = parse_args(argv, comm.Get_size())
        check_paths(comm, args)
        run = setup(comm, args)
        counted = CountedComm(comm, run.timeline)
        model, zero = shard_model(args, counted, run.device, run.timeline)
        activations = ActivationMeter(zero)
        config = {"model": "GPT", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "seq_len": args.seq_len, "vocab": VOCAB}  # what the flat vectors depend on
        resumed, past = resume(comm, args, config, zero) if args.resume else (None, ([], []))
        print_header(comm, args, run, model, zero, resumed)
        run.memory.reset()  # the peak of training alone: not the model's building, nor the check
        losses, norms, records = train(args, comm, run.device, model, zero, run.timeline, activations, past, config)
        run.memory.stop()
    except ConfigError as e:
        print0(comm, f"error: {e}", file=sys.stderr)
        return e.status
    losses, norms = past[0] + global_losses(comm, losses, args.ragged), past[1] + norms  # norms: alike on all
    diff = check(comm, args, losses, norms, zero, model) if args.check else None
    if args.trace:
        write_trace(comm, run.timeline, args.trace)
    return report(comm, args, run, zero, losses, norms, records, counted, activations, diff)


# =============================================================================
# You may stop reading here: the strategy is all above. Below, first this file's own machinery
# (the check against single-process training, the report, its arguments and checkpoints), then
# the machinery that every strategy file repeats word for word: the summary, checkpoints and
# signals, counters, timeline and memory, device and MPI setup, arguments.
# =============================================================================

# --- This file's own: the check against single-process training, the report, arguments, checkpoints
# What the reference shares with the ranks, and why each is harmless: build_model and its classes
# (the network), make_batch, F.cross_entropy (--ragged: its own mean over the batch's valid targets, no
# count of the ranks', no shares), torch's AdamW with the same hyperparameters. Its schedule
# is written out (not learning_rate: a bug there shows); its norm and clip are clip_grad_norm_'s.
# AdamW acts element by element, which is what lets ZeRO step a partition alone; the reference
# steps each parameter whole, so the flat vectors, their padding and partitions, the
# reduce-scatters, the gathers and the division by N (FlatLayer, ZeRO) are the ranks' alone. bf16:
# the reference rounds a copy of its model (.to(bfloat16)); the ranks' bf16 views, their masters
# and the float32 sum of bf16 gradients are theirs alone. The comparison reads each parameter of
# the gathered masters through the views the ranks use, so it sees the values they trained.
def reference_training(args, device=torch.device("cpu")):
    """The same steps in one plain process on device (rank 0's): the plain model, built on the CPU and
    moved, AdamW, the whole batch; bf16: a bf16 copy (`working`) computes under autocast, its gradients
    step the float32 model."""
    model, bf16 = build_model(args, recompute="none").to(device), args.precision == "bf16"
    working = build_model(args, recompute="none").to(device, torch.bfloat16) if bf16 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    lr, warmup, rest = args.lr, args.warmup_steps, args.steps - args.warmup_steps  # the schedule, written out
    schedule = [lr * (k + 1) / warmup for k in range(warmup)] + [
        lr if args.lr_schedule == "constant" else lr / 10 + 0.45 * lr * (1 + math.cos(math.pi * k / max(1, rest)))
        for k in range(rest)]
    losses, norms = [], []
    for step in range(args.steps):
        x, y = (t.to(device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged))
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):  # the mean over the valid targets
            loss = F.cross_entropy(working(x).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        working.zero_grad()
        loss.backward()
        for p, w in zip(model.parameters(), working.parameters()):
            p.grad = w.grad.float()  # float32: the same tensor
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or math.inf).item())
        optimizer.param_groups[0]["lr"] = schedule[step]  # its one group
        optimizer.step()
        if bf16:  # rounded to nearest, as the ranks round their masters
            working.load_state_dict(model.state_dict())
        losses.append(loss.item())
    return losses, model, norms

# The gradient norms count as the losses do, but as |norm - reference| / max(reference, 1): bf16
# rounds a norm in proportion to its size (a norm of 2.97 came 1.7e-2 apart, 0.6%, in model_parallel.py's
# 60 default steps with AdamW at N = 1; docs/results.md, "The recipe at each file's default sizes").
def check(comm, args, losses, norms, zero, model):
    """Every rank's float32 masters, gathered from the partitions on the plain communicator (uncounted);
    rank 0 trains the reference on its device and compares; every rank gets the largest difference.
    Only float32 sums are reordered (each rank's gradient is its slice's, then summed), but Adam
    divides each gradient by its own size, which amplifies rounding. Summing the slices' gradients
    instead of the batch's in one process moved the parameters by 7e-7 after 100 steps (3 slices of
    the default 24), by 5e-7 after 50 and 2.4e-6 after 100 (4 slices of 16), at lr 1e-3; at lr 3e-3
    by 2e-2 after 50 (a loss spike turned rounding into chaos). With eps 1e-8 one weight in 200k moved
    by 5e-5 in the first step (lr x delta / eps for a change delta of its gradient): EPS 1e-6.
    The gradient norms join the comparison (norms: this run's, one per step)."""
    full = {}
    for layer in zero.layers:  # the float32 masters: each rank's partition
        whole = torch.zeros(layer.padded)
        whole[layer.mine] = layer.partition.detach().cpu()
        comm.Allgather(MPI.IN_PLACE, whole)
        full.update((p, view.clone()) for p, view in zip(layer.params, layer.views(whole)))
    state, diff = {name: full[p] for name, p in model.named_parameters()}, None
    if comm.Get_rank() == 0:
        ref_losses, ref_model, ref_norms = reference_training(args, zero.device)
        norm_diff = max((abs(n - r) / max(r, 1) for n, r in zip(norms, ref_norms)), default=0.0)  # relative (above)
        diff = max(max_difference(losses, state, ref_losses, ref_model), norm_diff)
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)  # the other ranks leave the cores to rank 0, which trains the reference
    return comm.bcast(diff, root=0)

class ActivationMeter(torch.autograd.graph.saved_tensors_hooks):
    """`with meter:` around a step counts each tensor autograd saves, by storage, until autograd lets
    go of it; not the whole vectors (parameters, gathered layers) nor a parameter's copies (grad_fn
    ToCopyBackward0 fed by its AccumulateGrad). kept: the most in forward; peak: with recomputation."""

    def __init__(self, zero):
        self.zero, self.live, self.peak, self.kept, self.refs = zero, 0, 0, 0, collections.Counter()
        super().__init__(self.pack, lambda saved: saved)

    def pack(self, t):
        pointer, size, fn = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.grad_fn
        if any(pointer == layer.whole.untyped_storage().data_ptr() for layer in self.zero.layers) or (
                type(fn).__name__ == "ToCopyBackward0" and type(fn.next_functions[0][0]).__name__ == "AccumulateGrad"):
            return t
        saved = t.detach()  # what autograd keeps: its finalizer runs when autograd lets go
        self.refs[pointer] += 1
        self.live += size if self.refs[pointer] == 1 else 0
        self.peak = max(self.peak, self.live)
        self.kept = self.kept if self.zero.in_backward else max(self.kept, self.live)
        weakref.finalize(saved, self.release, pointer, size)
        return saved

    def release(self, pointer, size):
        self.refs[pointer] -= 1
        if not self.refs[pointer]:
            del self.refs[pointer]
            self.live -= size

def memory_formula(zero, activations):
    """The docstring's bytes per rank at a step's peak (Psi with padding; e: 4, bf16 2 + masters apart),
    activations as measured. Without overlap stages 2 and 3 hold every whole gradient until backward
    ends, and stage 3 gathers one layer at a time."""
    sizes, n, stage = [layer.padded for layer in zero.layers], zero.world_size, zero.stage
    psi, pair, e = sum(sizes), max(a + b for a, b in zip(sizes, sizes[1:])), zero.layers[0].whole.element_size()
    formula = {"parameters": (e * psi if stage < 3 else 0) + (4 * psi // n if stage == 3 or e == 2 else 0),
               "gradients": 4 * psi if stage == 1 else 4 * psi // n, "optimizer": 8 * psi // n,
               "gathered": 0 if stage < 3 else e * pair if zero.overlap else e * max(sizes),
               "whole_gradients": 0 if stage == 1 else 4 * pair if zero.overlap else 4 * psi,
               "activations": activations}
    return {**formula, "total": sum(formula.values())}

def live_tensor_bytes(zero):
    """Bytes of the parameters, gradients and optimizer state alive after the last step, counted
    from the tensors (each storage once, padding included): what persists between steps."""
    def held(tensors):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        return sum(n for pointer, n in storages.items() if pointer)
    params = [p for layer in zero.layers for p in layer.params + [layer.partition]]
    state = [v for s in zero.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    live = {"parameters": held(params), "gradients": held(t.grad for t in params), "optimizer": held(state)}
    return {**live, "total": sum(live.values())}

def overlap_counts(zero, events):
    """[started in time, total] in the last step's spans. Stages 2 and 3: reduce-scatters begun
    inside backward. Stage 3: layers whose gather began before the hook that opens the layer's
    forward (or backward) did, as the prefetch promises for all but the first of each pass."""
    counts = {"reduce_scatters_started_in_backward": started_within(events, "Ireduce_scatter_block", "backward")}
    for phase in ("forward", "backward") if zero.stage == 3 else ():
        begin, end = next((b, e) for name, _, b, e in events if name == phase)
        gathers = {name.split()[1]: b for name, _, b, _ in events if name.startswith("gather ") and begin <= b <= end}
        layers = {name.split()[2]: b for name, _, b, _ in events if name.startswith(f"before {phase} ")}
        counts[f"prefetched_{phase}"] = [sum(gathers.get(i, b) < b for i, b in layers.items()), len(layers)]
    return counts if zero.stage > 1 else {}

def print_header(comm, args, run, model, zero, resumed):
    params, padded = sum(p.numel() for p in model.parameters()), sum(layer.padded for layer in zero.layers)
    if resumed:
        print0(comm, f"resumed from {args.save} at step {resumed['step']} (written by {resumed['world_size']} ranks) "
                     f"at ZeRO stage {resumed['state']['zero_stage']}")
    print0(comm, *run.header,
           f"ZeRO stage {args.zero_stage} | model: GPT, {args.layers} blocks, hidden {args.hidden}, "
           f"{args.heads} heads, {params:,} parameters in {len(zero.layers)} layers, padded to {padded:,} "
           f"(each layer a multiple of {comm.Get_size()}); this rank owns {padded // comm.Get_size():,}",
           f"global batch {args.batch_size} x {args.seq_len} characters = {comm.Get_size()} ranks x "
           f"{args.batch_size // comm.Get_size()} | AdamW, lr {args.lr:g} ({args.lr_schedule}, {args.warmup_steps} "
           f"warm-up steps), eps {EPS:g}, weight decay {WEIGHT_DECAY:g}, clip {args.clip_grad or 'off'}"
           + (f" | ragged: documents of 1 to {args.seq_len} characters, the loss over the step's valid targets"
              if args.ragged else "")
           + ("" if args.zero_stage == 1 else " | exchange overlapped with compute" if not args.no_overlap
              else " | no overlap (--no-overlap)"))

def report(comm, args, run, zero, losses, norms, records, counted, activations, diff):
    """The summary lines and JSON keys of ZeRO: traffic against its formula, the measured peak
    memory beside the formula, the live tensors, the overlap; finish() prints and returns."""
    world_size, steps_run, stage = comm.Get_size(), max(1, len(records)), args.zero_stage
    calls, volume = ({k: v / steps_run for k, v in counts.items()} for counts in (counted.calls, counted.bytes))
    psi = sum(layer.padded for layer in zero.layers)
    e, gathers = zero.layers[0].whole.element_size(), 1 if stage < 3 else 2  # stage 3 gathers twice
    moved = (4 + gathers * e) * psi + 4 + 8 * args.ragged  # reduce-scatter float32, all-gathers e; norm; count
    ring = (world_size - 1) / world_size * moved
    every = comm.allgather(live_tensor_bytes(zero))  # the same on every rank: so is S
    live = {kind: max(m[kind] for m in every) for kind in every[0]}
    formula = memory_formula(zero, max(comm.allgather(activations.peak)))
    peak = max(comm.allgather(run.memory.bytes))
    lines = [f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f}; a uniform guess is ln {VOCAB} = "
             f"{math.log(VOCAB):.4f})",
             "per step: " + ", ".join(f"{calls[k]:g} {k} ({volume[k]:,.0f} bytes)" for k in sorted(calls))
             + f"; formula 4 Psi + {gathers} x {e} Psi + 4 (the norm){' + 8 (the count)' * args.ragged} = {moved:,} bytes "
             f"(Psi = {psi:,} with padding); a ring "
             f"moves (N-1)/N of that per rank, {ring:,.0f}, {ring / (8 * psi * (world_size - 1) / world_size or 1):g}"
             f" x a float32 allreduce of the gradients",
             f"memory per rank at the peak of a step: measured {peak / 1e6:.2f} MB (the largest rank), formula "
             f"{formula['total'] / 1e6:.2f} MB = " + " + ".join(f"{k} {v / 1e6:.2f}" for k, v in formula.items()
                                                                if k != "total")
             + f" (activations measured); plain data parallelism: {16 if e == 4 else 18} Psi + activations = "
             f"{((16 if e == 4 else 18) * psi + formula['activations']) / 1e6:.2f} MB",
             "live tensors after the last step: " + " | ".join(f"{k} {v:,}" for k, v in live.items()) + " bytes"]
    return finish(comm, args, run, losses, records, diff, "losses, parameters, norms", lines, {"grad_norms": norms,
        "comm_bytes_per_step": sum(volume.values()), "collectives_per_step": sum(calls.values()),
        "zero_stage": stage, "ragged": args.ragged, "param_count": sum(layer.numel for layer in zero.layers),
        "padded_param_count": psi, "memory_bytes_formula": formula, "live_bytes_after_last_step": live,
        "comm_bytes_formula": moved, "ring_bytes_per_rank": ring, "collectives_by_kind": calls,
        "activation_bytes_per_rank": comm.allgather(activations.kept),
        "overlap": overlap_counts(zero, run.timeline.step_events)})

def parse_args(argv, world_size):
    p = common_arguments("Sharded data parallelism over MPI (ZeRO 1, 2, 3): a small GPT on Python source.",
                         steps=50, batch_size=24, lr=1e-3, log_every=10)
    p.add_argument("--layers", type=COUNT, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=COUNT, default=64, help="hidden size")
    p.add_argument("--heads", type=COUNT, default=4, help="attention heads")
    p.add_argument("--seq-len", type=COUNT, default=64, help="characters per sequence")
    p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3),
                   help="1: optimizer state sharded; 2: and gradients; 3: and parameters")
    p.add_argument("--no-overlap", action="store_true",
                   help="baseline: reduce-scatter after backward (stages 2, 3), no prefetch (stage 3)")
    p.add_argument("--optimizer", choices=("adamw",), default="adamw", help="AdamW (SGD is not offered here)")
    p.add_argument("--clip-grad", type=float, default=1.0, metavar="MAX_NORM",
                   help="clip the global gradient norm to MAX_NORM (0: no clipping)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="after the warm-up: constant, or a cosine towards lr / 10, reached after the last step")
    p.add_argument("--warmup-steps", type=COUNT_OR_0, help="linear warm-up from 0 to --lr over W steps (default: --steps / 10)")
    p.add_argument("--ragged", action="store_true", help="documents of uneven length: the loss over the valid targets")
    args = check_common(p.parse_args(argv))
    args.warmup_steps = args.steps // 10 if args.warmup_steps is None else args.warmup_steps  # a tenth by default
    if not args.clip_grad >= 0 or args.warmup_steps >= args.steps:
        raise ConfigError(f"--clip-grad {args.clip_grad:g} must be 0 (off) or more" if not args.clip_grad >= 0 else
                          f"--warmup-steps {args.warmup_steps} leaves no step after the warm-up of --steps "
                          f"{args.steps}; use fewer warm-up steps")
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} does not split into {args.heads} heads of equal "
                          f"size; use a multiple of {args.heads}, e.g. {16 * args.heads}")
    if args.batch_size % world_size:
        raise ConfigError(f"--batch-size {args.batch_size} does not split into {world_size} ranks; use a "
                          f"multiple of {world_size}, e.g. {world_size}, {2 * world_size}, {3 * world_size}")
    if args.seq_len >= len(load_text()):
        raise ConfigError(f"--seq-len {args.seq_len} must be shorter than the text ({len(load_text())})")
    return args

KINDS = ("params", "exp_avg", "exp_avg_sq")  # what a checkpoint holds of a layer: masters, Adam's moments

def checkpoint_keys(i):
    """The checkpoint's names for layer i: its flat vector as one parameter `layers.<i>.params` (the
    layer's module name in the model), of the layer's unpadded numel; Adam's moments of it under the
    house's optimizer prefixes (exp_avg/layers.<i>.params)."""
    name = f"layers.{i}.params"
    return {kind: name if kind == "params" else f"{kind}/{name}" for kind in KINDS}

def saved_part(layer):
    """(start, count): where this rank's partition starts in the layer's unpadded vector, and how
    many of its elements lie below numel; the rest is padding, which no checkpoint holds (count 0:
    a partition wholly in the padding, as the last of a layer of 5 elements on 4 ranks)."""
    return layer.mine.start, max(0, min(layer.size, layer.numel - layer.mine.start))

def zero_shard(zero, losses, norms):
    """What each rank saves: its partition of every layer's float32 masters and Adam moments, each a
    piece of the layer's unpadded whole (the padding left out): every element saved once, no rank
    more than its 1/N. Rank 0 adds, as state, the losses and gradient norms so far, Adam's step count
    and the stage that wrote it (the world size is the manifest's)."""
    pieces = {}
    for i, layer in enumerate(zero.layers):
        (start, count), adam = saved_part(layer), zero.optimizer.state[layer.partition]
        for kind, key in checkpoint_keys(i).items() if count else ():
            t = layer.partition if kind == "params" else adam[kind]
            pieces[key] = piece(t[:count], [layer.numel], [start])
    state = {"losses": list(losses), "grad_norms": list(norms),
             "adam_step": int(zero.optimizer.state[zero.layers[0].partition]["step"]),
             "zero_stage": zero.stage}
    return pieces, (state if zero.comm.Get_rank() == 0 else None)

def resume(comm, args, config, zero):
    """Continue from the newest whole checkpoint, whatever the world size and stage that wrote it:
    each rank asks for its partition of each layer on this grid (the part below numel), which
    load_checkpoint cuts from the pieces that overlap it, reading only their files; the padding
    stays zero, as in a new run. Stages 1 and 2 then all-gather each layer's whole vector, on the
    plain communicator (the counters measure training alone); stage 3 gathers as it computes.
    Returns the manifest and (losses, norms) so far (None and ([], []): no checkpoint yet)."""
    def wanted(manifest):
        asked = {}
        for i, layer in enumerate(zero.layers):
            start, count = saved_part(layer)
            if count:
                asked.update({key: region([layer.numel], [start], [count]) for key in checkpoint_keys(i).values()})
        return asked
    manifest, blocks = load_checkpoint(comm, args.save, config, wanted, args.steps)
    if blocks is None:
        return None, ([], [])
    for i, layer in enumerate(zero.layers):
        (_, count), step = saved_part(layer), torch.tensor(float(manifest["state"]["adam_step"]))
        adam = {"step": step, **{kind: torch.zeros_like(layer.partition) for kind in KINDS[1:]}}
        with torch.no_grad():
            for kind, key in checkpoint_keys(i).items() if count else ():
                (layer.partition if kind == "params" else adam[kind])[:count] = blocks[key]
            if zero.stage < 3:
                buffer = gather_buffer(layer.whole, layer.mine, layer.partition)  # bf16: the masters rounded
                comm.Allgather(MPI.IN_PLACE, buffer)
                from_mpi(layer.whole, buffer)
        zero.optimizer.state[layer.partition] = adam
    return manifest, (manifest["state"]["losses"], manifest["state"]["grad_norms"])

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
